"""Evaluating: perplexity, KL and lm-eval suites of both models, the unrefined and undistilled
models' KL, throughput; layer by layer where the walk's memory is all there is, and lm-eval on
models placed by accelerate (`evaluation.device_map`) after the rest."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

import torch

from compressor.evaluation.metrics import TaskOptions, compare, evaluate_models
from compressor.evaluation.throughput import compare_speed, cost_note, report_settings
from compressor.recipe.schema import Recipe
from compressor.recipe.sections.evaluation import EvaluationSpec, LmEvalSpec
from compressor.recipe.sections.model import ModelSpec
from compressor.runtime.layerwise_eval import Placement, evaluates_layer_by_layer, layerwise_compare, placed_task_scores
from compressor.runtime.resume import baseline_tasks_key
from compressor.runtime.staging import SCRATCH_FOLDER
from compressor.stages.base import RunState
from compressor.stages.contract import Stage
from compressor.stages.costs import TimedPhase, Work, decode_seconds, size
from compressor.validation import replaced

if TYPE_CHECKING:
    from compressor.plan.checks import Plan
    from compressor.plan.memory import Footprint
    from compressor.stages.costs import Phase


class Evaluate(Stage):
    name = "evaluating"
    timing = "eval_s"
    section = "evaluation"
    options = EvaluationSpec

    def check_plan(self, recipe: Recipe, plan: Plan, world: int) -> None:
        """The recipe's lm-eval task names exist (lm-eval is imported only when there are some)."""
        check_evaluation_tasks(recipe)

    def seconds(self, work: Work) -> list[TimedPhase]:
        """Perplexity and KL of the original and the pruned model (and the unrefined or undistilled one)
        on the evaluation windows, the throughput's bounded rounds; lm-eval's tasks are not estimated."""
        spec, recipe, costs = work.recipe.evaluation, work.recipe, work.costs
        assert spec is not None
        models = 2 + (recipe.refinement is not None) + (recipe.distillation is not None)
        seconds = work.evaluation_tokens * (
            costs.model_forward(work.original_layers) + (models - 1) * costs.model_forward(work.layers)
        )
        if spec.throughput:
            seconds += throughput_seconds(work)
        phases = [TimedPhase("evaluation", seconds, "eval_s")]
        if spec.lm_eval:
            phases.append(TimedPhase("lm-eval tasks", None, "eval_s"))
        return phases

    def memory(self, footprint: Footprint) -> list[Phase]:
        fp, settings = footprint, footprint.settings
        if not settings.evaluation:
            return []
        if settings.evaluation_layerwise is not None:
            windows, tokens, per_batch = settings.evaluation_layerwise
            streams = 2 * windows * tokens * fp.d * fp.item  # both models' final streams, on the host
            logits = 3 * per_batch * tokens * fp.vocab * 4  # one batch's logits and log-probabilities, float32
            # a written model's parts outside its layers (at most the original's), its layers read back one at a time
            pruned_held = min(fp.resident, fp.pruned_weights) if fp.writes else fp.pruned_weights
            streamed_models = (
                "both models streamed"
                if fp.writes
                else "the original streamed"
                if fp.streaming
                else "the original in memory"
            )
            # on the device: the pruned model (or its resident part; on CPU the host's copy), one layer, one batch
            return [
                fp.phase(
                    f"evaluation (layer by layer, {streamed_models})",
                    fp.held + pruned_held + streams,
                    (pruned_held if fp.accelerator else 0) + fp.measured["layer"] + logits,
                    "a smaller evaluation.batch_size, or fewer evaluation.num_samples",
                )
            ]
        tokens, per_batch = settings.evaluation_batch
        # a batch's float32 log-probabilities of both models and the KL's three temporaries of that size
        log_probs = 5 * per_batch * tokens * fp.vocab * 4
        both = fp.weights + fp.pruned_weights
        return [
            fp.phase(
                "evaluation (both models on the device)",
                both,
                both + log_probs,
                "a smaller evaluation.batch_size, or evaluation: null (then `compress eval` where both models fit)",
                whole_model=True,
            )
        ]

    def memory_notes(self, footprint: Footprint) -> list[str]:
        settings = footprint.settings
        if not (settings.evaluation and settings.evaluation_layerwise is not None and settings.evaluation_placed):
            return []
        return [
            f"lm-eval: each model alone, placed by accelerate over the devices, then host memory (what "
            f"each has free), then disk in the output's staging folder (at most {size(footprint.weights)})"
        ]

    def run(self, state: RunState) -> None:
        evaluate(state)


def throughput_seconds(work: Work) -> float:
    """The report's throughput: for each batch size both models prefill and decode once untimed, then
    timed rounds until the repeats or the budget run out (`evaluation.throughput.REPORT_*`)."""
    from compressor.evaluation.throughput import REPORT_BATCH_SIZES, REPORT_BUDGET_S, REPORT_REPEATS

    costs, seconds = work.costs, 0.0
    for batch in REPORT_BATCH_SIZES:
        round_s = sum(
            batch * 128 * costs.model_forward(layers) + decode_seconds(costs, layers, batch, 32)
            for layers in (work.original_layers, work.layers)
        )
        seconds += round_s + min(REPORT_REPEATS * round_s, REPORT_BUDGET_S + round_s)
    return seconds


def check_evaluation_tasks(recipe: Recipe) -> None:
    """The recipe's lm-eval task names exist (lm-eval is imported only when there are some)."""
    if recipe.evaluation is not None and recipe.evaluation.lm_eval is not None:
        from compressor.evaluation.harness import check_suites

        check_suites(recipe.evaluation.lm_eval)


def evaluate(state: RunState) -> None:
    """ "evaluating": perplexity, KL and lm-eval suites of both models; the unrefined model's KL;
    throughput. lm-eval on models placed by accelerate (`evaluation.device_map`) comes after the
    rest, each model loaded from its folder alone."""
    recipe, device, evaluation, resources = state.recipe, state.device, state.evaluation, state.resources
    assert evaluation is not None and recipe.evaluation is not None
    state.progress("evaluating", 0, len(evaluation))
    placed = recipe.evaluation.device_map is not None
    suites = None if placed else recipe.evaluation.lm_eval
    if evaluates_layer_by_layer(recipe) and state.original is None and state.unrefined is None:
        state.metrics = layerwise_compare(
            resources.model(recipe.model),
            state.pruned if state.writes else state.pruned.to(device),  # written: its layers read when visited
            state.family,
            evaluation,
            device,
            lambda done, total: state.progress("evaluating, layer by layer", done, total),
        )
        if state.undistilled is not None:
            state.metrics["undistilled"] = state.undistilled
    else:
        evaluate_whole(state, suites)
    if placed and recipe.evaluation.lm_eval:
        if not state.writes:  # the device's memory is accelerate's to place the models in
            state.pruned.to("cpu")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        placed_tasks(state)


def evaluate_whole(state: RunState, suites: list[LmEvalSpec] | None) -> None:
    """Both models whole on the run's device: perplexity, KL, lm-eval `suites`, throughput."""
    recipe, device, evaluation, resources = state.recipe, state.device, state.evaluation, state.resources
    assert evaluation is not None and recipe.evaluation is not None
    original = (state.original if state.original is not None else resources.whole_model(recipe.model)).to(device)
    state.original = None
    tasks_key = baseline_tasks_key(suites or [], state.fingerprint["model"], recipe, state.tokenizer, device)
    metrics = evaluate_models(
        original,
        state.pruned.to(device),
        evaluation,
        device,
        state.progress,
        TaskOptions(suites, state.tokenizer, recipe.seed, resources.baseline_tasks(tasks_key)),
    )
    if suites:
        resources.keep_baseline_tasks(tasks_key, metrics["baseline"]["tasks"])
    if state.undistilled is not None:  # measured before the distillation stage, on the same windows
        metrics["undistilled"] = state.undistilled
    if state.unrefined is not None:  # held-out KL before refinement (the model as it was saved), beside the refined
        state.progress("evaluating the unrefined model", 0, len(evaluation))
        metrics["unrefined"] = compare(original, state.unrefined.to(device), evaluation, device)["pruned"]
        state.unrefined = None
    if recipe.evaluation.throughput:
        settings = report_settings([original, state.pruned])
        state.progress(f"measuring throughput ({cost_note(settings)})", 0, 1)
        state.speed = compare_speed(original, state.pruned, device, **settings)
    state.metrics = metrics
    del original


def placed_tasks(state: RunState) -> None:
    """lm-eval on each model in turn, placed by accelerate over the GPUs, host memory and disk
    (offloaded weights in the staging folder, removed after each model): the original from its
    folder, the pruned model from the saved `model/` (or a copy saved for it when the run
    saves no model)."""
    recipe, staging = state.recipe, state.staging
    spec = recipe.evaluation
    assert spec is not None and spec.lm_eval
    key = baseline_tasks_key(spec.lm_eval, state.fingerprint["model"], recipe, state.tokenizer, state.device)
    offload = staging / SCRATCH_FOLDER / "offload"  # cleared at a run's start and at publishing

    def scores(model: ModelSpec, which: str) -> tuple[dict[str, Any], dict[str, int]]:
        return placed_task_scores(
            model,
            spec,
            state.tokenizer,
            recipe.seed,
            Placement(offload, state.device),
            lambda phase, done, total: state.progress(f"lm-eval, {which} model (placed): {phase}", done, total),
        )

    baseline, placement = state.resources.baseline_tasks(key), None
    if baseline is None:
        baseline, placement = scores(recipe.model, "original")
        state.resources.keep_baseline_tasks(key, baseline)
    state.metrics.setdefault("baseline", {}).update(tasks=baseline, placement=placement)
    folder = staging / "model" if state.save_model else staging / SCRATCH_FOLDER / "lm-eval-model"
    if not state.save_model:
        state.pruned.save_pretrained(folder)
    try:
        pruned, placement = scores(replaced(recipe.model, path=str(folder), revision=None), "pruned")
    finally:
        if not state.save_model:
            shutil.rmtree(folder, ignore_errors=True)
    state.metrics["pruned"].update(tasks=pruned, placement=placement)
