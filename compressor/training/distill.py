"""Recovery distillation: the pruned model learns back from the original what slicing took.

After slicing (and refinement) the student is the pruned model and the teacher the original.
The loss is KL(teacher ‖ student) on the teacher's distribution (its top-k tokens plus the
remaining mass as one bin, `refine.teacher_target`, or the whole vocabulary), optionally plus
the cross-entropy on the data, counted on the positions H counts (all real tokens; for chat,
those whose next token is an assistant token). Training is transformers' `Trainer` with a
custom `compute_loss`, so mixed precision, gradient checkpointing and accumulation, schedules,
checkpoints, and DDP/FSDP under `torchrun`/`accelerate` are theirs, not ours. (TRL's GKD trainer
generates on-policy samples and mixes a JSD; the stage needs a fixed-text KL with a top-k tail
and optionally a teacher cached off the device, which a `compute_loss` gives in a few lines.)

By default the student gets LoRA adapters (peft) on its linear layers, merged at the end, so the
saved model has exactly the class, config and parameter count it had (residual transitions are
linear layers: they get adapters too; weightless norms have nothing to train). `method: full`
trains every weight in place. A held-out KL on windows never trained on (after the training
windows in the distillation data) is measured every `eval_every` steps; each measurement is a
checkpoint, the best one is loaded at the end, training stops after `patience` measurements
without a new best, and if no checkpoint beat the student as received, the student is returned
unchanged.
"""

from __future__ import annotations

import json
import math
import resource
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import EarlyStoppingCallback, PrinterCallback, ProgressCallback
from transformers.utils import logging as hf_logging

from compressor import faults
from compressor.engine.checkpoint import FINGERPRINT_FILE, TRAINER_STATE_FILE, trainer_checkpoints, write_atomic
from compressor.engine.refine import kl_to_target
from compressor.errors import UserError, did_you_mean, first_line
from compressor.recipe.sections.distillation import DistillationSpec
from compressor.training.teachers import DistillationData, LiveTeacher, Row, Teacher, collate
from compressor.validation import shown

Progress = Callable[[str, int, int], None]

DEFAULT_LR = {"lora": 1e-3, "full": 1e-4}
"""Peak learning rates when the recipe gives none (docs/benchmarks.md, "Recovery distillation")."""


# --- data ---------------------------------------------------------------------------------


# --- teachers -----------------------------------------------------------------------------


# --- adapters -----------------------------------------------------------------------------


def linear_names(model: nn.Module) -> set[str]:
    """The last name of every linear layer of `model` but its head: what LoRA may target."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not head
    }


def check_target_modules(spec: DistillationSpec, names: set[str]) -> None:
    """Each named LoRA target is a linear layer of the student (`names`); one line otherwise."""
    targets = spec.lora.target_modules
    if spec.method != "lora" or targets == "all-linear":
        return
    for name in [targets] if isinstance(targets, str) else targets:
        if name not in names:
            raise UserError(
                f"distillation.lora.target_modules: '{name}' is not a linear layer of this model"
                f"{did_you_mean(name, names)}; its linear layers: {', '.join(sorted(names))} "
                f"(or all-linear)"
            )


def trainer_keys(spec: DistillationSpec) -> None:
    """The keys of `distillation.trainer` are TrainingArguments fields, and their values of the
    kind the field's default is: a mapping where it is one (a JSON object as text too), a finite
    number where it is a number, and not negative where the default is not (transformers takes
    `dataloader_num_workers: -1` or `lr_scheduler_kwargs: abc` and fails only when training)."""
    known = {f.name: f for f in fields(TrainingArguments)}
    for key, value in spec.trainer.items():
        if key not in known:
            raise UserError(
                f"distillation.trainer.{key} is not a transformers TrainingArguments field{did_you_mean(key, known)}"
            )
        field_ = known[key]
        default = field_.default_factory() if field_.default_factory is not MISSING else field_.default
        where = f"distillation.trainer.{key}"
        mapping = isinstance(default, dict) or "dict" in str(field_.type)
        if mapping and value is not None and not isinstance(value, dict) and not _json_object(value):
            raise UserError(
                f"{where} must be a mapping (or a JSON object, or a JSON file where TrainingArguments reads one), "
                f"got {shown(value)}"
            )
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and isinstance(default, (int, float)) and not isinstance(default, bool):
            if not math.isfinite(value):
                raise UserError(f"{where} must be a finite number, got {shown(value)}")
            if value < 0 <= default:
                raise UserError(f"{where} must not be negative (its default is {default}), got {shown(value)}")


def _json_object(value: Any) -> bool:
    """`value` is text holding a JSON object, or naming a JSON file (how TrainingArguments also
    takes a mapping: DeepSpeed's and FSDP's configs are files)."""
    if not isinstance(value, str):
        return False
    try:
        return isinstance(json.loads(value), dict)
    except json.JSONDecodeError:
        return value.endswith(".json") and Path(value).is_file()


def _with_adapters(model: PreTrainedModel, spec: DistillationSpec, seed: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = spec.lora
    targets = lora.target_modules
    targets = (
        targets if targets == "all-linear" or not isinstance(targets, str) else [targets]
    )  # peft: a string is a regex
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha or 2 * lora.rank,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
    )
    torch.manual_seed(seed)  # the adapters' random half starts the same in a fresh and a resumed run
    try:
        adapted = get_peft_model(model, config)
    except ValueError as error:
        raise UserError(f"distillation.lora.target_modules: {first_line(error)}") from None
    # No base model for peft to compare embeddings with when it saves adapters: the name is the
    # original's (a hub id peft would look up), whose config is not the student's.
    adapted.peft_config["default"].base_model_name_or_path = ""
    return adapted


# --- the trainer --------------------------------------------------------------------------


class _Distiller(Trainer):
    """`Trainer` with the distillation loss, and a held-out KL as its evaluation."""

    def __init__(self, *args: Any, teacher: Teacher, spec: DistillationSpec, heldout: list[Row], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher
        self.spec = spec
        self.heldout = heldout

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        kl, ce, count = self._losses(model, inputs)
        loss = kl / count + (self.spec.ce_weight * ce if ce is not None else 0.0)
        return (loss, None) if return_outputs else loss

    def _losses(
        self, model: nn.Module, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Summed KL over the counted positions, mean cross-entropy (when weighted), count."""
        mask = inputs["attention_mask"]
        counted = inputs["loss_mask"].bool() & mask.bool()
        logits = model(input_ids=inputs["input_ids"], attention_mask=mask, use_cache=False).logits
        kl = kl_to_target(self.teacher.target(inputs, counted), logits, counted)
        ce = None
        if self.spec.ce_weight > 0:
            predicts = counted[:, :-1] & mask[:, 1:].bool()
            ce = (
                F.cross_entropy(logits[:, :-1][predicts].float(), inputs["input_ids"][:, 1:][predicts])
                if predicts.any()
                else logits.sum() * 0.0
            )  # no next token to predict: nothing, not NaN
        return kl, ce, counted.sum().clamp(min=1)

    @torch.no_grad()
    def heldout_kl(self) -> float:
        """KL(teacher ‖ student) per counted token over the held-out rows, on the loss's bins, in
        the training's precision. Every process measures all of them; rank 0's value is used."""
        model = self.model
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        size = self.args.per_device_eval_batch_size
        for start in range(0, len(self.heldout), size):
            inputs = {k: v.to(self.args.device) for k, v in collate(self.heldout[start : start + size]).items()}
            with self.accelerator.autocast():  # as in training (accelerate patches the trained forward alone)
                kl, _, counted = self._losses(model, inputs)
            total += torch.stack([kl.double(), counted.double()])
        model.train(was_training)
        if self.args.world_size > 1:  # rank 0's value for all: best checkpoint and early stop agree everywhere
            torch.distributed.broadcast(total, src=0)
        return float(total[0] / total[1].clamp(min=1))

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        metrics = {f"{metric_key_prefix}_kl": self.heldout_kl()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


class _Steps(TrainerCallback):
    """Progress for the run's bar; the last step is always measured and saved; a test may kill
    the process once a checkpoint is written (`faults`: `distillation:<step>`)."""

    def __init__(self, report: Progress, label: str) -> None:
        self.report = report
        self.label = label

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
        self.report(self.label, state.global_step, state.max_steps)
        if state.global_step >= state.max_steps:
            control.should_evaluate = True
            control.should_save = True
        return control

    def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
        faults.reached(f"distillation:{state.global_step}")
        return control


# --- checkpoints --------------------------------------------------------------------------


def last_checkpoint(folder: Path) -> tuple[int, Path] | None:
    """The step and folder of the newest complete Trainer checkpoint in `folder` (its state file,
    written last, reads back); newer incomplete ones (a kill while saving) are removed."""
    for step, path in trainer_checkpoints(folder):
        try:
            json.loads((path / TRAINER_STATE_FILE).read_text())
            return step, path
        except (OSError, ValueError):
            shutil.rmtree(path, ignore_errors=True)
    return None


def has_progress(folder: Path) -> bool:
    return last_checkpoint(folder) is not None if folder.is_dir() else False


def check_fingerprint(folder: Path, fingerprint: dict[str, str], write: bool) -> None:
    """Continue only checkpoints made with the same settings, student and data; a different
    fingerprint with progress is refused (`--restart` discards it)."""
    path = folder / FINGERPRINT_FILE
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = None
    if saved is not None and saved != fingerprint and has_progress(folder):
        changed = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k))
        raise UserError(
            f"an interrupted run's distillation in {folder} was started with a different "
            f"{' and '.join(changed)}; rerun with --restart to discard its progress"
        )
    if write and saved != fingerprint:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda p: p.write_text(json.dumps(fingerprint, indent=2) + "\n"))


# --- the stage ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DistillationRecord:
    """What the stage did, for the report. KLs are held-out (nats per counted token, on the
    loss's bins: top_k plus the rest, or the whole vocabulary)."""

    method: str
    steps: int
    max_steps: int
    tokens: int
    """Tokens in the windows trained on (padding excluded), all processes."""
    windows_per_step: int
    train_windows: int
    heldout_windows: int
    epochs: float
    world_size: int
    seconds: float
    """The whole stage: held-out measurements, merging, and training."""
    train_seconds: float
    """`Trainer.train` in this process (after a resume: the part it ran)."""
    seconds_per_million_tokens: float
    """`train_seconds` per million tokens trained since this process started training (all
    processes' tokens; evaluations included)."""
    peak_memory_bytes: int
    peak_memory_of: str
    heldout_kl_before: float
    heldout_kl_best: float
    best_step: int
    stopped_early: bool
    kept: str
    """"distilled", or "received" when no checkpoint beat the student as it came."""
    resumed_from_step: int | None
    curve: list[dict[str, int | float]]
    """Held-out KL against step and tokens, from step 0 (the student as received)."""
    trainable_params: int
    merge_max_abs_diff: float | None
    """LoRA: the largest logit difference between the merged model and the adapted one."""
    lr: float
    precision: str
    options: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _precision(spec: DistillationSpec, device: torch.device) -> str:
    if spec.precision != "auto":
        return spec.precision
    return "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"


def _arguments(
    spec: DistillationSpec, folder: Path, device: torch.device, seed: int, max_steps: int, precision: str
) -> TrainingArguments:
    options: dict[str, Any] = {"report_to": [], **spec.trainer}
    try:
        return TrainingArguments(
            output_dir=str(folder),
            max_steps=max_steps,
            per_device_train_batch_size=spec.batch_size,
            per_device_eval_batch_size=spec.batch_size,
            gradient_accumulation_steps=spec.gradient_accumulation,
            learning_rate=spec.lr or DEFAULT_LR[spec.method],
            lr_scheduler_type=spec.schedule,
            warmup_steps=math.ceil(spec.warmup * max_steps),
            weight_decay=spec.weight_decay,
            max_grad_norm=spec.max_grad_norm,
            bf16=precision == "bfloat16",
            fp16=precision == "float16",
            activation_checkpointing=spec.gradient_checkpointing,
            activation_checkpointing_kwargs={"use_reentrant": False} if spec.gradient_checkpointing else None,
            eval_strategy="steps",
            eval_steps=spec.eval_every,
            save_strategy="steps",
            save_steps=spec.eval_every,
            save_total_limit=2,
            load_best_model_at_end=True,
            metric_for_best_model="kl",
            greater_is_better=False,
            logging_steps=spec.eval_every,
            seed=seed,
            data_seed=seed,
            use_cpu=device.type == "cpu",
            remove_unused_columns=False,
            disable_tqdm=True,
            log_level="warning",
            dataloader_pin_memory=False,
            include_num_input_tokens_seen="non_padding",
            restore_callback_states_from_checkpoint=True,
            **options,
        )
    except (TypeError, ValueError) as error:
        raise UserError(f"distillation: transformers refused the training settings: {first_line(error)}") from None


def check_training_arguments(spec: DistillationSpec) -> None:
    """The section's TrainingArguments (its own and `trainer`'s) as transformers reads them, on a
    throwaway folder: a bad value is refused before the walk, not after it."""
    with tempfile.TemporaryDirectory(prefix="compress-args-") as folder:
        _arguments(spec, Path(folder), torch.device("cpu"), 0, 1, "float32")


def steps_for(spec: DistillationSpec, world: int) -> tuple[int, int]:
    """(optimiser steps, windows per step) for the token budget on `world` processes."""
    assert spec.seq_len is not None
    per_step = spec.batch_size * spec.gradient_accumulation * world
    return max(1, math.ceil(spec.tokens / (per_step * spec.seq_len))), per_step


@dataclass(frozen=True)
class TrainingRun:
    """Where and how one distillation runs, beside what it trains (the spec): its checkpoints,
    device, seeds and callbacks, one object so a new need is a field, not a parameter."""

    folder: Path
    """Checkpoints; a killed run's same call continues from them when `fingerprint` matches."""
    device: torch.device
    fingerprint: dict[str, str]
    seed: int = 0
    progress: Progress | None = None
    world: int = 1
    """Processes training together (`torchrun`): the windows per step count them."""
    callbacks: Sequence[TrainerCallback] = ()
    """More Trainer callbacks (a benchmark's measurements along the way)."""


def distill(
    student: PreTrainedModel, teacher: Teacher, data: DistillationData, spec: DistillationSpec, run: TrainingRun
) -> tuple[PreTrainedModel, DistillationRecord]:
    """Train `student` from `teacher` on `data`; return it (adapters merged, same class and
    parameter count, in its own dtype) and the record. Checkpoints go to `run.folder`."""
    started = time.perf_counter()
    report = run.progress or (lambda *_: None)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    hf_logging.get_logger("transformers.trainer_utils").setLevel(hf_logging.ERROR)  # "mtime may not be reliable"
    max_steps, per_step = steps_for(spec, run.world)
    precision = _precision(spec, run.device)
    dtypes = {name: p.dtype for name, p in student.named_parameters()}  # restored after (buffers untouched)
    use_cache = getattr(student.config, "use_cache", None)  # the Trainer turns it off for training
    args = _arguments(spec, run.folder, run.device, run.seed, max_steps, precision)
    resume = _resumable(run, args)
    model, received = _trainable(student, spec, run.seed)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    steps = _Steps(report, f"distillation: {spec.method} step")
    trainer = _trainer(model, args, data, teacher, spec, [steps, *run.callbacks])
    report("distillation: held-out KL of the student as received", 0, 1)
    before = trainer.heldout_kl()
    tick = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(resume[1]) if resume else None)
    train_seconds = time.perf_counter() - tick
    state = trainer.state
    best = state.best_metric if state.best_metric is not None else math.inf
    kept = "distilled" if best < before else "received"
    model, merge_diff = _finished(trainer, spec, data, kept, received)
    tokens = int(state.num_input_tokens_seen or state.global_step * per_step * data.seq_len)
    resumed_at = resume[0] if resume else None
    peak, of = _peak_memory(args.device)
    return _as_received(model, dtypes, use_cache), DistillationRecord(
        method=spec.method,
        steps=state.global_step,
        max_steps=max_steps,
        tokens=tokens,
        windows_per_step=per_step,
        train_windows=len(data.train),
        heldout_windows=len(data.heldout),
        epochs=state.global_step * per_step / max(len(data.train), 1),
        world_size=args.world_size,
        seconds=time.perf_counter() - started,
        train_seconds=train_seconds,
        seconds_per_million_tokens=train_seconds / max(_trained_here(tokens, state.global_step, resumed_at), 1) * 1e6,
        peak_memory_bytes=int(peak),
        peak_memory_of=of,
        heldout_kl_before=before,
        heldout_kl_best=min(best, before),
        best_step=int(state.best_global_step or 0) if kept == "distilled" else 0,
        stopped_early=state.global_step < max_steps,
        kept=kept,
        resumed_from_step=resumed_at,
        curve=_curve(state, before, per_step * data.seq_len),
        trainable_params=trainable,
        merge_max_abs_diff=merge_diff,
        lr=args.learning_rate,
        precision=precision,
        options=asdict(spec),
    )


def _resumable(run: TrainingRun, args: TrainingArguments) -> tuple[int, Path] | None:
    """The checkpoint to continue from, after rank 0 has checked (or cleared) the folder against
    the run's fingerprint and every rank has waited for it."""
    check_fingerprint(run.folder, run.fingerprint, write=args.process_index == 0)
    if args.world_size > 1:
        torch.distributed.barrier()  # rank 0 has checked (or cleared) the checkpoints the others will read
    return last_checkpoint(run.folder)


def _as_received(model: nn.Module, dtypes: dict[str, torch.dtype], use_cache: bool | None) -> PreTrainedModel:
    """The trained model in the student's own dtypes and cache setting, frozen for inference."""
    for name, parameter in model.named_parameters():
        parameter.data = parameter.data.to(dtypes.get(name, parameter.dtype))
    student = model.eval().requires_grad_(False)
    if use_cache is not None:
        student.config.use_cache = use_cache
    return student  # type: ignore[return-value]


def _trainable(student: PreTrainedModel, spec: DistillationSpec, seed: int) -> tuple[nn.Module, dict[str, Any] | None]:
    """The model the Trainer trains: the student itself in float32 master weights (`full`, with a
    copy of its state as received, to give back if nothing beats it), or with LoRA adapters."""
    if spec.method != "full":
        return _with_adapters(student, spec, seed).train(), None
    received = {k: v.detach().to("cpu", copy=True) for k, v in student.state_dict().items()}
    for parameter in student.parameters():  # fp32 master weights (buffers as they are); autocast computes
        parameter.data = parameter.data.float()
    return student.train().requires_grad_(True), received


def _trainer(
    model: nn.Module,
    args: TrainingArguments,
    data: DistillationData,
    teacher: Teacher,
    spec: DistillationSpec,
    callbacks: list[TrainerCallback],
) -> _Distiller:
    """The Trainer with this project's loss and callbacks, transformers' console printers removed,
    a live teacher on the training device, and the device's peak memory counted from here."""
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)
    try:
        trainer = _Distiller(
            model=model,
            args=args,
            train_dataset=data.train,
            eval_dataset=data.heldout,
            data_collator=collate,
            teacher=teacher,
            spec=spec,
            heldout=data.heldout,
            callbacks=callbacks,
        )
    except ValueError as error:
        raise UserError(f"distillation: transformers' Trainer refused the settings: {first_line(error)}") from None
    for noisy in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(noisy)
    if spec.patience is not None:
        trainer.add_callback(EarlyStoppingCallback(early_stopping_patience=spec.patience))
    if isinstance(teacher, LiveTeacher):
        teacher.model.to(args.device)
    return trainer


def _curve(state: Any, before: float, tokens_per_step: int) -> list[dict[str, int | float]]:
    """Held-out KL against step and tokens, from step 0 (the student as received)."""
    curve: list[dict[str, int | float]] = [{"step": 0, "tokens": 0, "kl": before}]
    curve += [
        {
            "step": entry["step"],
            "kl": entry["eval_kl"],
            "tokens": entry.get("num_input_tokens_seen") or entry["step"] * tokens_per_step,
        }
        for entry in state.log_history
        if "eval_kl" in entry
    ]
    return curve


def _finished(
    trainer: _Distiller, spec: DistillationSpec, data: DistillationData, kept: str, received: dict[str, Any] | None
) -> tuple[nn.Module, float | None]:
    """The trained model unwrapped, LoRA merged (or unloaded when the student as received stays)
    and the merge's largest logit difference on one held-out window; `full` given back its
    received state when nothing beat it."""
    model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False).eval()  # no autocast patch
    merge_diff = None
    if spec.method == "lora":
        probe = {k: v.to(trainer.args.device) for k, v in collate(data.heldout[:1]).items()}
        with torch.no_grad():
            adapted = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits.float()
        model = model.merge_and_unload() if kept == "distilled" else model.unload()
        with torch.no_grad():
            merged = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits.float()
        merge_diff = float((adapted - merged).abs().max()) if kept == "distilled" else None
    elif kept == "received":
        assert received is not None
        model.load_state_dict(received)
    return model, merge_diff


def _trained_here(tokens: int, steps: int, resumed_at: int | None) -> float:
    """The tokens this process trained: after a resume, the steps it ran of the run's `steps`."""
    return tokens * (steps - (resumed_at or 0)) / max(steps, 1)


def _peak_memory(device: torch.device) -> tuple[int, str]:
    """The device's peak allocation, or on the host the process's peak RSS, and what it is of."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), str(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS (whole run)"
