"""Choosing the split of the budget (`mlp` without `kept`): every split of the plan pruned as the
run would prune it and measured on held-out windows (`stages.split_choice`), or the choice a killed
run made; the run goes on with the chosen layout, and adopts the chosen trial's walk and MLP
stage when nothing runs between them (it is not pruned twice)."""

from __future__ import annotations

import dataclasses
import math
import shutil
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from compressor import faults
from compressor.data.batches import Batch
from compressor.engine.checkpoint import Checkpoint
from compressor.engine.pooling import required_statistics
from compressor.engine.refine import rebatch
from compressor.engine.survey import SurveyMemo
from compressor.errors import ProgressKept, UserError
from compressor.models.depth import remove_blocks
from compressor.models.layout import SlicedLayout, mlp_neurons
from compressor.recipe.schema import Recipe
from compressor.recipe.sections.mlp import MlpSpec
from compressor.reports.report import without_blocks
from compressor.reports.report_model import SplitRecord
from compressor.runtime.staging import CHECKPOINT_FOLDER, SCRATCH_FOLDER
from compressor.stages.base import RunState
from compressor.stages.contract import Stage, changes_model_between
from compressor.stages.costs import TimedPhase, Work
from compressor.stages.experts import PruneExperts
from compressor.stages.heads import PruneHeads, heads_seconds
from compressor.stages.mlp import PruneMlp, mlp_seconds
from compressor.stages.split_choice import choose, split_label
from compressor.stages.split_prediction import Prediction, best_predicted, predict_splits
from compressor.stages.walk import walk, walk_seconds

if TYPE_CHECKING:
    from compressor.plan.checks import Plan
    from compressor.plan.memory import Footprint
    from compressor.stages.costs import Phase


TRIAL_TIMINGS = ("prune_s", "experts_s", "heads_s", "mlp_s")
"""A split's own pruning, stage by stage (the walk's less H): what an adopted trial hands the run."""


class ChooseSplit(Stage):
    name = "choosing the split of the budget"
    timing = "split_s"
    section = "mlp"
    options = MlpSpec
    checkpoint_key = "split"

    def wanted(self, recipe: Recipe) -> bool:
        return bool(open_sections(recipe))

    def runs(self, state: RunState) -> bool:
        return state.checked.chooses_split  # else nothing to choose (a warning said so)

    def check_plan(self, recipe: Recipe, plan: Plan, world: int) -> None:
        if world > 1 and plan.chooses_split:
            raise UserError(
                f"choosing the split of the budget runs in one process: fix {fixing_keys(recipe)}, or launch one process"
            )
        explicit = recipe.mlp is not None and isinstance(recipe.mlp.measure_best, int)  # auto: resolved to fit
        if explicit and len({split.experts for split in plan.splits}) > 1:
            raise UserError(
                "mlp.measure_best predicts the splits between the residual width and the MLP's, and experts "
                "without kept adds expert counts it cannot predict; set experts.kept, or remove mlp.measure_best"
            )
        if explicit and plan.layout.active is not None:
            raise UserError(
                "mlp.measure_best predicts dense MLPs' widths, and this model's MLPs are routed experts; "
                "remove mlp.measure_best"
            )

    def heldout_windows(self, recipe: Recipe, plan: Plan) -> int:
        """The larger count of the sections that leave theirs open (`mlp`, `experts`)."""
        if not plan.may_choose_split:
            return 0
        return max(getattr(recipe, name).heldout_windows for name in open_sections(recipe))

    def heldout_section(self, recipe: Recipe) -> str:
        return max(open_sections(recipe), key=lambda name: getattr(recipe, name).heldout_windows)

    def memory(self, footprint: Footprint) -> list[Phase]:
        if not footprint.settings.split_choice:
            return []
        weights, pruned = footprint.weights, footprint.pruned_weights
        phases = [
            footprint.phase(
                "choosing the split (the whole original beside each trial)",
                weights + 2 * pruned + footprint.store + footprint.positions,
                weights + pruned,
                "fixed counts (mlp.kept, experts.kept: no split to choose), or a machine with more memory",
                whole_model=True,
            )
        ]
        if footprint.settings.predicts_splits:  # every site's C and H, float32, on the host
            sites = 2 * footprint.layers + 1
            statistics = sites * 2 * footprint.d * footprint.d * 4 + 4 * footprint.d * footprint.d * 8
            phases.append(
                footprint.phase(
                    "predicting the splits (every site's C and H on the host)",
                    weights + footprint.store + footprint.positions + statistics,
                    footprint.measured["walk"],
                    "mlp.measure_best: null (every split measured), or a machine with more memory",
                )
            )
        return phases

    def seconds(self, work: Work) -> list[TimedPhase]:
        """H once per set of blocks kept (`depth` open), the prediction (`measure_best`), and each measured
        candidate's pruning (on the screened windows where asked) and held-out KL: the candidates' mean,
        times how many are measured."""
        checked, recipe = work.checked, work.recipe
        if not checked.may_choose_split:
            return []
        splits = checked.splits
        best = checked.measure_best
        measured = len(splits) if best is None else min(best, len(splits))
        screen = checked.screen_windows
        tokens = work.tokens if screen is None else screen * recipe.calibration.seq_len
        heldout = work.heldout.get(self.name, 0)
        trials = []
        trial_work = dataclasses.replace(work, recipe=trial_recipe(recipe, screen))
        for split in splits:
            trial = walk_seconds(work, split, tokens, with_h=False) + heads_seconds(work, split, tokens)
            trial += mlp_seconds(trial_work, split, tokens)
            layers = split.config.num_hidden_layers
            trials.append(sum(p.seconds or 0.0 for p in trial) + work.measured_kl(heldout, layers))
        models = min(measured, len({split.removed_blocks for split in splits}))  # H of each set of blocks kept
        phases = [p for p in walk_seconds(work, splits[0], tokens, with_h=True) if p.key == "fisher_s"]
        phases = [TimedPhase("choosing the split: H pass", models * (p.seconds or 0.0), "split_s") for p in phases]
        if best is not None:  # the survey and the MLPs' (and heads') curves: a pass each, layer by layer
            curves = 1 + (1 if any(s.mlp_width is not None for s in splits) else 0)
            curves += 1 if any(s.heads is not None for s in splits) else 0
            predict = work.layer_pass(tokens) * curves + work.layers * work.costs.neurons
            phases.append(TimedPhase("predicting the splits", predict, "split_s"))
        count = f"{measured} of {len(splits)} candidates" if best is not None else f"{measured} candidates"
        phases.append(TimedPhase(f"choosing the split ({count})", measured * sum(trials) / len(trials), "split_s"))
        return phases

    def run(self, state: RunState) -> None:
        splits, saved = state.checked.splits, state.checkpoint.load_split()
        if saved is not None:
            state.split = SplitRecord.model_validate(saved)
            chosen = state.split.candidates[state.split.chosen]
            layout = splits[state.split.chosen] if state.split.chosen < len(splits) else None
            if layout is None or (
                layout.kept,
                layout.mlp_width or chosen.mlp_kept,
                layout.experts,
                layout.heads,
                list(layout.removed_blocks),
            ) != (chosen.width, chosen.mlp_kept, chosen.experts, chosen.heads, chosen.removed_blocks or []):
                raise ProgressKept(
                    f"the interrupted run in {state.staging} chose a split (width {chosen.width}, MLP "
                    f"{chosen.mlp_kept}, experts {chosen.experts or 'all'}{without_blocks(chosen.removed_blocks)}) "
                    f"that this version's plan does not list; "
                    f"rerun with --restart"
                )
        else:
            state.split = fresh_choice(state, splits, self.name)
            if splits[state.split.chosen].removed_blocks != tuple(state.removed_blocks):
                state.checkpoint.drop_fisher()  # the trials' H was the model's with every block: not this one's
            state.checkpoint.save_split(state.split.model_dump())
        state.checked = dataclasses.replace(state.checked, layout=splits[state.split.chosen])
        take_blocks(state)
        if state.best_trial is not None and state.best_trial[1] == state.split.chosen:
            adopt(state, state.best_trial[2])
        state.best_trial = None
        if state.adopted:
            state.survey = None  # no walk will recall it
        if not state.adopted and state.model is None:
            state.model = state.model_to_prune()


def fresh_choice(state: RunState, splits: tuple[SlicedLayout, ...], stage: str) -> SplitRecord:
    """The splits predicted (`mlp.measure_best`), pruned and measured, and the choice, timed."""
    if state.checkpoint.has_fisher():  # a run killed while choosing: its H pass is not repeated
        loaded = state.checkpoint.load_fisher()
        assert loaded is not None
        state.resources.keep_fisher(state.fisher_key(), loaded)
        state.split_fisher_source = "checkpoint"
    original = state.resources.whole_model(state.recipe.model)  # on the device only while it measures
    state.model = None  # reloaded for the run's walk unless the chosen split's trial is kept
    rng = torch.get_rng_state()  # every split starts its walk where the run's own walk will
    state.survey = SurveyMemo()  # the first walk (or the prediction) surveys the original model for all
    prediction = predicted(state, splits)
    torch.set_rng_state(rng)
    split = choose(
        splits,
        lambda index, layout: measured_split(state, index, layout, original, rng),
        sum(len(batch.input_ids) for batch in state.measuring_windows[stage]),
        state.progress,
        None if prediction is None else best_predicted(prediction.kls, state.checked.measure_best or 0),
        None if prediction is None else prediction.kls,
    )
    torch.set_rng_state(rng)
    split = timed_split(split, state.split_prune_s, state.survey.passes, state.checked.screen_windows)
    predict_s = None if prediction is None else prediction.seconds
    return split.model_copy(update={"measure_best": state.checked.measure_best, "predict_s": predict_s})


CHOICE_KEYS = {"mlp": "kept", "experts": "kept", "heads": "kept", "depth": "removed"}
"""Each section whose count the split choice can take, and the key that fixes it."""


def take_blocks(state: RunState) -> None:
    """`depth` without `removed`: the chosen candidate's blocks are the run's (none where it keeps
    every block), gone from the model it holds and from every later fresh copy; the depth record
    says which, and what removing them alone cost where it was measured."""
    depth, layout = state.depth, state.checked.layout
    if depth is None or depth.candidates is None:
        return
    removed = list(layout.removed_blocks)
    own = next((c for c in depth.candidates if c.removed == removed), None)
    state.depth = depth.model_copy(
        update={
            "removed": removed,
            "heldout_kl": None if own is None else own.heldout_kl,
            "objectives": {} if own is None else own.objectives,
        }
    )
    if state.model is not None and removed:  # a resumed choice: the model loaded whole
        remove_blocks(state.model, state.family, removed)
    state.removed_blocks = removed
    state.checked = dataclasses.replace(state.checked, removed_blocks=tuple(removed))
    state.config = layout.config


def open_sections(recipe: Recipe) -> list[str]:
    """The sections that leave their count to the choice: `mlp`, `experts`, `heads` without `kept`,
    `depth` without `removed`."""
    return [
        name
        for name, key in CHOICE_KEYS.items()
        if getattr(recipe, name) is not None and getattr(getattr(recipe, name), key) is None
    ]


def fixing_keys(recipe: Recipe) -> str:
    """`mlp.kept and depth.removed`: the keys that would fix every count the run leaves open."""
    return " and ".join(f"{name}.{CHOICE_KEYS[name]}" for name in open_sections(recipe))


def timed_split(split: SplitRecord, seconds: dict[int, float], survey_passes: int, screen: int | None) -> SplitRecord:
    """The record with each candidate's own pruning time (where it was measured), the calibration
    windows it was pruned on and the surveys run."""
    candidates = [c.model_copy(update={"prune_s": seconds.get(i)}) for i, c in enumerate(split.candidates)]
    update = {"candidates": candidates, "survey_passes": survey_passes, "screen_windows": screen}
    return split.model_copy(update=update)


def adopt(state: RunState, trial: RunState) -> None:
    """The chosen split's trial becomes the run's walk and MLP stage: the same calls on the same
    model, data, H and random state as the run's own would make, so the same tensors."""
    assert trial.result is not None
    state.result, state.pruned, state.bases = trial.result, trial.pruned, trial.bases
    state.head_scale, state.head_fit = trial.head_scale, trial.head_fit
    state.neurons, state.mlp_weighed_by_h, state.config = trial.neurons, trial.mlp_weighed_by_h, trial.config
    state.experts = trial.experts
    state.heads, state.heads_weighed_by_h = trial.heads, trial.heads_weighed_by_h
    state.warnings += [line for line in trial.warnings if line not in state.warnings]
    for key in TRIAL_TIMINGS:
        if key in trial.timings:
            state.timings[key] = trial.timings[key]
    state.adopted = True


def measured_split(
    state: RunState, index: int, layout: SlicedLayout, original: PreTrainedModel, rng: torch.Tensor
) -> float:
    """One split pruned as this run would prune it (walk, tied head, experts, heads, MLP; no refinement or
    distillation) in a scratch folder, and its KL to `original` on the split's windows, saved as it would be."""
    label = f"split {index + 1}/{len(state.checked.splits)} ({split_label(layout)})"
    folder = state.staging / SCRATCH_FOLDER / f"split-{index}"
    screen = state.checked.screen_windows
    trial = RunState(
        folder,
        trial_recipe(state.recipe, screen),
        dataclasses.replace(state.checked, layout=layout),
        state.device,
        Checkpoint(folder / CHECKPOINT_FOLDER, writable=False),  # H goes to the run's checkpoint
        lambda phase, done, total: state.progress(f"{label}: {phase}", done, total),
        state.resources,
        state.ranks,
    )
    trial.tokenizer, trial.calibration = state.tokenizer, screened(state)
    trial.heldout, trial.removed_blocks = state.measuring_windows[ChooseSplit.name], list(layout.removed_blocks)
    trial.model = trial.model_to_prune()
    trial.fingerprint = trial_fingerprint(state)  # screened: other data, its own H shared by the trials only
    trial.survey = state.survey
    torch.set_rng_state(rng)
    with faults.scoped(f"split{index}/"):
        walk(trial)
        if layout.experts is not None:
            with trial.timed("experts_s"):
                PruneExperts().run(trial)
        if layout.heads is not None:
            with trial.timed("heads_s"):
                PruneHeads().run(trial)
        if layout.prunes_mlp:
            with trial.timed("mlp_s"):
                PruneMlp().run(trial)
    assert trial.result is not None
    state.split_prune_s[index] = sum(trial.timings.get(key, 0.0) for key in TRIAL_TIMINGS)
    own_model = trial.removed_blocks == state.removed_blocks  # else H of a model without other blocks
    if trial.result.fisher is not None and screen is None and own_model and not state.checkpoint.has_fisher():
        state.checkpoint.save_fisher(trial.result.fisher)
        if trial.result.fisher_source == "computed":
            state.split_fisher_source = "computed"
    state.timings["fisher_s"] = max(state.timings.get("fisher_s", 0.0), trial.timings.get("fisher_s", 0.0))
    trial.progress("measuring held-out KL", 0, 1)
    kl = trial.heldout_kl(original.to(state.device), trial.pruned, trial.head_scale)
    original.to("cpu")
    shutil.rmtree(folder, ignore_errors=True)
    if adoptable(state) and math.isfinite(kl) and (state.best_trial is None or kl < state.best_trial[0]):
        trial.pruned.to("cpu")  # the best so far waits on the host; the one it replaces is dropped
        # H is the checkpoint's and the resources'; the walk's own model (unrotated, before a tied
        # head's fit) is read by nothing after the walk: one model waits, not two
        trial.result = dataclasses.replace(trial.result, fisher=None, model=trial.pruned)
        state.best_trial = (kl, index, trial)
    return kl


def trial_recipe(recipe: Recipe, screen: int | None) -> Recipe:
    """A split trial's recipe: the run's, less `mlp.reconstruct` where trials are screened: they rank
    the splits by the refit alone, on a share of the windows (training on those would fit them and
    cost as much as on all), and the chosen split is pruned on every window by the run's own MLP
    stage, reconstruction included. Unscreened, the chosen trial is the saved model, so it is trained."""
    if screen is None or recipe.mlp is None or recipe.mlp.reconstruct is None:
        return recipe
    return dataclasses.replace(recipe, mlp=dataclasses.replace(recipe.mlp, reconstruct=None))


def predicted(state: RunState, splits: tuple[SlicedLayout, ...]) -> Prediction | None:
    """With `mlp.measure_best`, every split's predicted KL (`split_prediction`) on the windows its
    trial is pruned on, H kept (and checkpointed, on every window) for the trials' walks."""
    if state.checked.measure_best is None:
        return None
    prediction = predict_splits(state, splits, screened(state), state.fisher_key(trial_fingerprint(state)["data"]))
    survey = prediction.survey
    uses_h = "H" in required_statistics(state.checked.pipeline)  # else the run's own stages choose without it
    if uses_h and state.checked.screen_windows is None and not state.checkpoint.has_fisher():
        state.checkpoint.save_fisher(dict(survey.fisher))
        if survey.fisher_source == "computed":
            state.split_fisher_source = "computed"
    state.timings["fisher_s"] = max(state.timings.get("fisher_s", 0.0), survey.seconds)
    return prediction


def trial_fingerprint(state: RunState) -> dict[str, str]:
    """A trial's fingerprint: the run's, with its own data when screened (H of other windows)."""
    screen = state.checked.screen_windows
    if screen is None:
        return state.fingerprint  # the same recipe, model and data: not hashed again
    return {**state.fingerprint, "data": f"{state.fingerprint['data']}/screen-{screen}"}


def screened(state: RunState) -> list[Batch]:
    """The calibration windows a split's trial is pruned on: all, or `mlp.screen_windows` of them
    evenly spread through the set, in batches of the calibration's size."""
    windows = state.checked.screen_windows
    if windows is None:
        return state.calibration
    return rebatch(state.calibration, state.recipe.calibration.batch_size, windows)


def adoptable(state: RunState) -> bool:
    """The chosen trial's walk, expert, head and MLP stages can be the run's (`adoptable_trials`)."""
    return adoptable_trials(state.recipe, state.checked)


def adoptable_trials(recipe: Recipe, checked: Plan) -> bool:
    """The chosen trial's walk, expert, head and MLP stages can be the run's: pruned on every calibration
    window (not screened), and no other stage between the walk and the MLP's changes the model
    (refinement, a plugin's), so the run would make the same calls."""
    if checked.screen_windows is not None:
        return False
    own = (PruneExperts.name, PruneHeads.name)  # the trial's own
    stages = tuple(stage for stage in checked.stages if stage.name not in own)
    return not changes_model_between(stages, recipe, "walk", PruneMlp.name)


def adopts(recipe: Recipe, checked: Plan) -> bool:
    """The run will adopt a trial (it chooses a split, and the trials are adoptable): its walk, experts,
    heads and MLP stage are then within the choice's time."""
    return checked.may_choose_split and adoptable_trials(recipe, checked)


AUTO_MEASURED = 2
"""`mlp.measure_best: auto`: the splits measured, of those predicted best, where the prediction applies."""
AUTO_SCREEN_SHARE = 4
"""`mlp.screen_windows: auto`: a split is pruned on one in this many calibration windows, where they hold
at least `AUTO_SCREEN_TOKENS` tokens and `AUTO_SCREEN_PER_NEURON` per neuron of the MLP (else on all)."""
AUTO_SCREEN_TOKENS = 8192
"""On SmolLM2-135M (MLPs of 1,536) 8 windows of 512 tokens ranked two close splits wrongly and 16 rightly
(docs/history/benchmarks-notebook.md, "What choosing the split costs"): 5.3 tokens a neuron did, 2.7 did not."""
AUTO_SCREEN_PER_NEURON = 4


def resolved_choice(recipe: Recipe, checked: Plan) -> Plan:
    """The plan with `mlp.measure_best` and `mlp.screen_windows` decided: a number or None as the recipe
    gives it, or for `auto` (the default) what the benchmarks measured to keep choosing near the chosen
    split's own pruning without changing the choice beyond 6% ("What choosing costs by default",
    docs/benchmarks.md), where it was measured: a global layout of a dense model (no routed experts),
    `mlp` without `kept`, with the prediction only where it saves a measurement and H is estimated anyway."""
    spec = recipe.mlp
    if spec is None or spec.kept is not None or not checked.splits:
        return checked
    measured = recipe.slicing.layout == "global" and checked.layout.active is None
    best, screen = spec.measure_best, spec.screen_windows
    if best == "auto":
        experts_open = len({split.experts for split in checked.splits}) > 1
        with_h = "H" in required_statistics(checked.pipeline)
        predicts = measured and not experts_open and with_h and len(checked.splits) > AUTO_MEASURED
        best = AUTO_MEASURED if predicts else None
    if screen == "auto":
        share = recipe.calibration.num_samples // AUTO_SCREEN_SHARE
        screen = share if measured and share * recipe.calibration.seq_len >= screen_tokens(checked) else None
    assert not isinstance(best, str) and not isinstance(screen, str)
    return dataclasses.replace(checked, measure_best=best, screen_windows=screen)


def screen_tokens(checked: Plan) -> int:
    """The fewest calibration tokens `screen_windows: auto` prunes a split on: `AUTO_SCREEN_TOKENS`, and
    `AUTO_SCREEN_PER_NEURON` for each neuron of the MLP (whose refit they must determine)."""
    neurons = max(mlp_neurons(split.config, split.family) for split in checked.splits)
    return max(AUTO_SCREEN_TOKENS, AUTO_SCREEN_PER_NEURON * neurons)
