"""The `distillation` section: the pruned model trained on the original's output distribution."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import StrictBool, StrictInt, StrictStr

from compressor.errors import UserError
from compressor.recipe.sections.contract import Section, SectionContext
from compressor.recipe.sections.data import Format, check_dataset
from compressor.validation import FORBID, Number, described, options

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe
    from compressor.recipe.sections.data import DataSpec
    from compressor.recipe.sections.evaluation import EvaluationSpec


DistillationMethod = Literal["lora", "full"]
Precision = Literal["auto", "float32", "bfloat16", "float16"]
Schedule = Literal["cosine", "linear", "constant", "constant_with_warmup", "inverse_sqrt"]
TeacherPlacement = Literal["model", "cached"]


@options(frozen=True, config=FORBID)
class LoraSpec:
    """LoRA adapters (peft) on the student's linear layers, merged into its weights at the end."""

    rank: Annotated[StrictInt, described("the adapters' rank", ge=1)] = 16
    alpha: Annotated[Number, described("the adapters' scale numerator (scale alpha/rank)", gt=0)] | None = None
    """LoRA's alpha (the update is scaled by alpha/rank); None: twice the rank."""
    dropout: Annotated[Number, described("dropout on the adapters' input", ge=0, lt=1)] = 0.0
    target_modules: StrictStr | list[StrictStr] = "all-linear"
    """all-linear: every linear layer but the head (residual transitions included), or names of
    linear layers, e.g. [q_proj, v_proj, attn_shortcut]."""


@options(frozen=True, config=FORBID)
class DistillationSpec:
    """After slicing (and refinement): the pruned model learns from the original on the output
    distribution, through transformers' Trainer (`compressor.training.distill`); off when absent."""

    tokens: Annotated[StrictInt, described("training tokens: optimiser steps x windows per step x seq_len", ge=1)]
    """The budget: optimiser steps × windows per step (all processes) × seq_len tokens."""
    dataset: dict[StrictStr, Any] | None = None
    """Its own dataset spec (as calibration.dataset); None: the calibration's dataset. Never the
    evaluation's: the held-out windows must be unseen by both."""
    format: Format | None = None
    """text or chat (only the assistant tokens count, as for H); None: the calibration's."""
    text_field: StrictStr | None = None
    messages_field: StrictStr | None = None
    seq_len: Annotated[StrictInt, described("tokens per window", ge=2)] | None = None
    """Tokens per training window; None: the calibration's."""
    batch_size: Annotated[StrictInt, described("windows per process per micro-batch", ge=1)] = 8
    gradient_accumulation: Annotated[StrictInt, described("micro-batches per optimiser step", ge=1)] = 1
    method: DistillationMethod = "lora"
    """lora: adapters merged at the end (the default); full: every weight of the student trains."""
    lora: LoraSpec = field(default_factory=LoraSpec)
    lr: Annotated[Number, described("the peak learning rate", gt=0)] | None = None
    """Peak learning rate (AdamW); None: 1e-3 for lora, 1e-4 for full (what docs/benchmarks.md
    measured on ref-llama; not tuned further)."""
    schedule: Schedule = "cosine"
    """The learning-rate schedule after warm-up (transformers' scheduler names)."""
    warmup: Annotated[Number, described("a fraction of the steps", ge=0, lt=1)] = 0.05
    weight_decay: Annotated[Number, described("AdamW's weight decay", ge=0)] = 0.0
    max_grad_norm: Annotated[Number, described("gradient clipping", gt=0)] = 1.0
    top_k: Annotated[StrictInt, described("0 keeps the whole distribution", ge=0)] = 64
    """Teacher probabilities kept per token (the rest is one bin); 0: the whole vocabulary."""
    ce_weight: Annotated[Number, described("weight of the cross-entropy on the data", ge=0)] = 0.0
    """Loss = KL(teacher ‖ student) + ce_weight × cross-entropy on the data (0: logits only, as Minitron)."""
    heldout_windows: Annotated[StrictInt, described("windows for the held-out KL", ge=1)] = 32
    """Windows after the training ones, never trained on, for the held-out KL."""
    eval_every: Annotated[StrictInt, described("optimiser steps between held-out evaluations", ge=1)] = 50
    """Optimiser steps between held-out KL measurements; each one is also a checkpoint."""
    patience: Annotated[StrictInt, described("evaluations without improvement", ge=1)] | None = 3
    """Stop after this many held-out evaluations without a new best (null: never stop early). The
    best checkpoint is kept either way."""
    precision: Precision = "auto"
    """Mixed precision (autocast): auto is bfloat16 on a GPU that has it, float32 otherwise."""
    gradient_checkpointing: StrictBool = False
    """Recompute each layer in the backward pass: less memory, about a third more time."""
    teacher: TeacherPlacement = "model"
    """model: the original sits beside the student on the device; cached: its top-k targets are
    computed once, layer by layer as the H pass does, and kept in host memory (for models whose
    teacher and student do not fit together); that pass's activations wait on the host, or on
    disk with the recipe's `activations: disk`."""
    trainer: dict[StrictStr, Any] = field(default_factory=dict)
    """More transformers TrainingArguments, e.g. {optim: adamw_torch_fused, report_to: [wandb]}."""


TRAINER_OWNED = (
    "output_dir",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "eval_strategy",
    "eval_steps",
    "save_strategy",
    "save_steps",
    "load_best_model_at_end",
    "metric_for_best_model",
    "greater_is_better",
    "seed",
    "use_cpu",
    "resume_from_checkpoint",
    "remove_unused_columns",
    "activation_checkpointing",
    "activation_checkpointing_kwargs",
    "gradient_checkpointing_kwargs",
    "save_total_limit",
    "data_seed",
    "logging_steps",
    "include_num_input_tokens_seen",
    "restore_callback_states_from_checkpoint",
    "disable_tqdm",
    "log_level",
    "dataloader_pin_memory",
)
"""TrainingArguments the distillation section sets itself (under its own names, or from the run)."""


def check_distillation(
    spec: DistillationSpec, calibration: DataSpec, evaluation: EvaluationSpec | None, base: Path
) -> DistillationSpec:
    """Its data completed from the calibration's (dataset, format, fields, seq_len) and not the
    evaluation's; no trainer key that the section sets itself. (Target modules and the other
    trainer keys are checked against the model and transformers in `plan.checks.plan`.)"""
    dataset = check_dataset(spec.dataset, "distillation", base) if spec.dataset is not None else None
    if evaluation is not None and (dataset or calibration.dataset) == evaluation.dataset:
        where = "distillation.dataset" if dataset is not None else "the calibration dataset (distillation's default)"
        raise UserError(
            f"{where} is the evaluation's dataset: distillation would train on the text it is scored on; "
            f"give distillation.dataset other text"
        )
    sharded = sorted(set(spec.trainer) & {"fsdp", "fsdp_config", "deepspeed"})
    if sharded:
        raise UserError(
            f"distillation.trainer.{sharded[0]}: sharded training is not supported yet (merging LoRA and "
            f"saving need the whole student in each process); train with DDP under torchrun, or "
            f"lower batch_size, use gradient_checkpointing or teacher: cached"
        )
    owned = sorted(set(spec.trainer) & set(TRAINER_OWNED))
    if owned:
        raise UserError(
            f"distillation.trainer.{owned[0]} is set by the distillation section itself or by the run; "
            f"remove it from distillation.trainer (see `compress schema` for the section's keys)"
        )
    return dataclasses.replace(
        spec,
        dataset=dataset or calibration.dataset,
        format=spec.format or calibration.format,
        text_field=spec.text_field or calibration.text_field,
        seq_len=spec.seq_len or calibration.seq_len,
        messages_field=spec.messages_field or calibration.messages_field,
    )


def _check(spec: DistillationSpec, recipe: Recipe, context: SectionContext) -> DistillationSpec:
    return check_distillation(spec, recipe.calibration, recipe.evaluation, context.base)


SECTION = Section("distillation", DistillationSpec, _check)
