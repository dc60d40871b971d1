"""`distillation`: the student (a global layout's converted to the original class first) trained
on the original's distribution; its guard is the trainer's own, the best held-out checkpoint or
the student as received, recorded as every guarded step's is."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from compressor.engine.activations import ActivationStore
from compressor.engine.checkpoint import DISTILLATION_FOLDER, tensor_digest
from compressor.errors import ProgressKept, UserError
from compressor.evaluation.metrics import compare
from compressor.models.layout import SlicedLayout
from compressor.models.stock import to_stock
from compressor.recipe.schema import Recipe
from compressor.recipe.sections.distillation import DistillationSpec
from compressor.reports.guard import GuardRecord
from compressor.runtime.resume import distillation_fingerprint
from compressor.runtime.staging import CHECKPOINT_FOLDER, SCRATCH_FOLDER
from compressor.stages.base import RunState
from compressor.stages.contract import Stage
from compressor.stages.costs import TimedPhase, Work

if TYPE_CHECKING:
    from compressor.plan.checks import Plan
    from compressor.plan.memory import Footprint
    from compressor.stages.costs import Phase


class ToStudent(Stage):
    name = "converting to the original architecture"
    section = "distillation"
    options = DistillationSpec
    changes_model = True

    def seconds(self, work: Work) -> list[TimedPhase]:
        return []  # reading, loading and writing files: not estimated, small beside the passes

    def run(self, state: RunState) -> None:
        """A global layout's student is what users load: the original class at the kept width."""
        if state.one_basis and state.checked.layout.residual:
            state.progress("converting to the original architecture", 0, 1)
            state.pruned, state.stock = to_stock(
                state.pruned,
                state.family,
                state.config,
                tie=state.checked.layout.tie_head,
                stream=state.head_stream(),
                scale=state.head_scale,
            )


class Distil(Stage):
    name = "distillation"
    timing = "distill_s"
    section = "distillation"
    options = DistillationSpec
    changes_model = True
    checkpoint_key = DISTILLATION_FOLDER

    def check_device(self, recipe: Recipe, device: torch.device, save_model: bool) -> None:
        if not save_model:
            raise UserError(
                "distillation changes the weights, which bases alone cannot rebuild: save the models "
                "(a sweep's save_models: true), or remove distillation"
            )
        assert recipe.distillation is not None
        if device.type == "cpu" and recipe.distillation.precision == "float16":
            raise UserError(
                "distillation.precision: float16 has no mixed precision on CPU; use bfloat16 or float32 (or auto)"
            )

    def check_plan(self, recipe: Recipe, plan: Plan, world: int) -> None:
        check_distillation(recipe, plan.layout)

    def seconds(self, work: Work) -> list[TimedPhase]:
        """Every training token through the teacher and the student's forward and backward (a full
        fine-tune's weight gradients and optimiser as much again), and its held-out evaluations."""
        spec = work.recipe.distillation
        assert spec is not None
        costs, layers = work.costs, work.layers
        student = layers * costs.layer_backward + costs.head_backward
        student *= 2 if spec.method == "full" else 1
        teacher = costs.model_forward(work.original_layers) if spec.teacher == "model" else 0.0
        seq_len = spec.seq_len or work.recipe.calibration.seq_len
        step_tokens = spec.batch_size * spec.gradient_accumulation * seq_len
        evaluations = spec.tokens // max(1, step_tokens) // spec.eval_every + 1
        heldout = evaluations * spec.heldout_windows * seq_len * costs.model_forward(layers)
        return [TimedPhase("distillation", spec.tokens * (student + teacher) + heldout, "distill_s")]

    def memory(self, footprint: Footprint) -> list[Phase]:
        if footprint.settings.distillation is None:
            return []
        method, placement = footprint.settings.distillation
        weights, pruned_weights = footprint.weights, footprint.pruned_weights
        trainable = footprint.pruned if method == "full" else 0
        teacher = weights if placement == "model" else 0
        # trained weights are float32 whatever the model's dtype: weights, gradients, Adam's two moments
        student = pruned_weights if method != "full" else trainable * (4 + 4 + 8)
        return [
            footprint.phase(
                "distillation (student and teacher; activations not counted)",
                weights + pruned_weights,
                student + teacher,
                "distillation.method: lora, or distillation.teacher: cached",
                whole_model=True,
            )
        ]

    def run(self, state: RunState) -> None:
        state.pruned, state.distillation, state.undistilled, state.original = distil_student(state)
        record = state.distillation  # guarded by the stage: its best held-out checkpoint, or the student as received
        trained = [point["kl"] for point in record.curve if point["step"] > 0]
        state.record_guard(
            GuardRecord(
                "distillation",
                record.heldout_windows,
                record.heldout_kl_before,
                min(trained, default=record.heldout_kl_before),
                record.kept == "distilled",
            )
        )


def distil_student(state: RunState) -> tuple[PreTrainedModel, Any, dict[str, float] | None, PreTrainedModel]:
    """The distillation stage on every rank, on the state's student (`pruned`): the original as
    teacher (beside the student, or its targets cached layer by layer), the student's
    evaluation-window KL before (rank 0, when the recipe evaluates), then `distill.distill` on the
    state's `distillation_rows` (read before the walk). Returns the student, the
    stage's record, the before-metrics and the original (reused for evaluation). A bad setting
    found here keeps the walk's checkpoint, to continue from once it is fixed."""
    from compressor.training.distill import TrainingRun, distill
    from compressor.training.teachers import CachedTeacher, LiveTeacher, cached_targets

    recipe, student, data, evaluation = state.recipe, state.pruned, state.distillation_rows, state.evaluation
    staging, device, ranks, report_progress = state.staging, state.device, state.ranks, state.progress
    spec = recipe.distillation
    assert spec is not None
    original = state.resources.whole_model(recipe.model)
    undistilled = None
    if evaluation is not None and ranks.rank == 0:
        report_progress("evaluating the undistilled model", 0, len(evaluation))
        undistilled = compare(original.to(device), student.to(device), evaluation, device)["pruned"]
    if spec.teacher == "cached":
        original.to("cpu")
        student.to("cpu")
        store = ActivationStore(device, recipe.activations, staging / SCRATCH_FOLDER)  # `activations: disk` spills
        teacher: Any = CachedTeacher(
            cached_targets(original, state.family, data.train + data.heldout, spec, store, report_progress)
        )
    else:
        teacher = LiveTeacher(original, spec.top_k)
    fingerprint = {
        "settings": distillation_fingerprint(recipe),
        "data": tensor_digest([row["input_ids"] for row in data.train + data.heldout]),
        "world": str(ranks.world),
    }
    folder = staging / CHECKPOINT_FOLDER / DISTILLATION_FOLDER
    try:
        run = TrainingRun(folder, device, fingerprint, recipe.seed, report_progress, ranks.world)
        student, record = distill(student, teacher, data, spec, run)
    except UserError as error:
        if isinstance(error, ProgressKept):
            raise
        raise ProgressKept(
            f"{error} (the walk's progress is kept in {staging}: fix that and run the same command to continue)"
        ) from None
    return student, record, undistilled, original


def check_distillation(recipe: Recipe, layout: SlicedLayout) -> None:
    """What the distillation section names exists: its LoRA targets among the student's linear
    layers (the student built on the meta device: the original class for a global layout, else the
    sliced one with its transitions), its extra TrainingArguments among transformers' and valid
    there; its device is one the Trainer can be given."""
    from compressor.models.sliced import apply_slicing_layout
    from compressor.training.distill import check_target_modules, check_training_arguments, linear_names, trainer_keys

    spec = recipe.distillation
    assert spec is not None
    trainer_keys(spec)
    check_training_arguments(spec)
    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(layout.config)
    if not layout.one_basis:
        apply_slicing_layout(student, layout.family, layout.slicing_config(student))
    check_target_modules(spec, linear_names(student))
    index = torch.device(recipe.device).index if recipe.device.startswith("cuda:") else None
    if index not in (None, 0) and "LOCAL_RANK" not in os.environ:
        raise UserError(
            f"distillation trains on the device accelerate assigns (the first visible GPU); instead of "
            f"device: {recipe.device}, set device: cuda and CUDA_VISIBLE_DEVICES={index}"
        )
