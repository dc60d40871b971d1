"""The memory plan: peak host and device memory of each phase of a run, from the model's config and
the recipe alone, against the memory of the machine it would run on.

The device side of the walk and the H pass is *measured* on one fake layer (`plan.fake_layer`).
Host and device are both fake CPU tensors
there, so the batch the walk hands back to the host is counted on the device too: an upper bound.
Everything else is *computed* from tensor sizes: the weights, the activation store (one copy of the
calibration stream, two with the MLP refit's feedback), the H pass's stored inputs and gradients,
H, the bases, the MLP stage's f×f matrices, evaluation's two models, distillation's student,
gradients, Adam states and teacher. `compress run --dry-run` prints the plan, and a run refuses,
before it writes anything, a recipe whose peak is above what the machine has.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from compressor.errors import UserError
from compressor.plan.fake_layer import FakeBatch, measure_device
from compressor.recipe.schema import Recipe
from compressor.stages.costs import GiB, Phase, size


@dataclass(frozen=True)
class Machine:
    """The memory a run can have here: host RAM, and the device's when it is an accelerator."""

    host: int
    device: int | None
    device_name: str

    def describe(self) -> str:
        where = f"{size(self.device)} on {self.device_name}" if self.device is not None else "no accelerator"
        return f"this machine: {size(self.host)} host memory, {where}"


@dataclass(frozen=True)
class MemoryPlan:
    """Every phase a recipe runs, its peaks, and the model's shape they come from."""

    phases: tuple[Phase, ...]
    weights: int
    shape: str
    base: int = 0
    """The process before any weight is loaded (interpreter, libraries), counted in every host figure."""
    streamed: bool = False
    """The layers are read from their shards when needed: the weights need not fit the host."""
    notes: tuple[str, ...] = ()
    """What the plan leaves to others to fit (accelerate's placement), said after the phases."""

    def peak_host(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.host)

    def peak_device(self) -> Phase | None:
        on_device = [phase for phase in self.phases if phase.device is not None]
        return max(on_device, key=lambda phase: phase.device or 0) if on_device else None

    def lines(self) -> list[str]:
        """One line per phase, for a dry run."""
        return [
            f"{phase.name}: host {size(phase.host)}"
            + ("" if phase.device is None else f", device {size(phase.device)}")
            for phase in self.phases
        ] + list(self.notes)

    def refusal(self, machine: Machine) -> str | None:
        """One line naming the phase that does not fit and what to change; None when all fit."""
        host = self.peak_host()
        after = "(`compress run --dry-run` prints the plan; --skip-memory-check runs it anyway)"
        if host.host > machine.host:
            fix = (
                host.fix
                if self.weights < machine.host or self.streamed
                else "the weights alone do not fit: model.load: stream, or a machine with more memory"
            )
            return (
                f"this run needs about {size(host.host)} of host memory at its peak ({host.name}; the weights "
                f"are {size(self.weights)}) and this machine has {size(machine.host)}: {fix} {after}"
            )
        device = self.peak_device()
        if device is not None and machine.device is not None and (device.device or 0) > machine.device:
            return (
                f"this run needs about {size(device.device or 0)} on {machine.device_name} at its peak "
                f"({device.name}) and the device has {size(machine.device)}: {device.fix} {after}"
            )
        return None


@dataclass(frozen=True)
class PlanSettings:
    """What of a recipe the plan reads (a benchmark builds one without a recipe)."""

    dtype: str = "bfloat16"
    load: str = "memory"
    """model.load: memory, or stream (the layer-by-layer passes hold the layers they visit)."""
    writes: bool = False
    """A streamed walk writes the sliced model as it goes (`writes_as_it_goes`, decided by
    `run_memory_plan`): each layer leaves memory once written, and the bases and H are read from
    the checkpoint when needed."""
    attn_implementation: str = "sdpa"
    samples: int = 128
    seq_len: int = 2048
    batch: int = 8
    activations: str = "host"
    h_dtype: str = "float32"
    chunk: int = 32
    recompute: bool | None = None
    """sensitivity.recompute (None: on an accelerator only)."""
    mlp_feedback: float | None = None
    """None: no `mlp` stage."""
    experts_sample: int | None = None
    """The tokens an `experts` stage's output-aware selector routes through every expert (counted
    whatever the selector); None: no `experts` stage."""
    refinement: bool = False
    split_choice: bool = False
    """`mlp` without `kept`: the run measures splits with the whole original beside each trial."""
    predicts_splits: bool = False
    """The plan's `measure_best`: every site's C and H held on the host to predict the splits."""
    depth_windows: int = 0
    """The held-out windows a measuring `depth` selector runs the whole original on (0: none)."""
    distillation: tuple[str, str] | None = None
    """(method, teacher placement), or None."""
    evaluation: bool = True
    evaluation_batch: tuple[int, int] = (0, 0)
    """(tokens per window, windows per batch) of the evaluation: its log-probabilities are
    vocabulary-wide (Gemma 3's 262,144 entries a token)."""
    evaluation_layerwise: tuple[int, int, int] | None = None
    """(windows, tokens per window, windows per batch) where a run evaluates layer by layer
    (`layerwise_eval.evaluates_layer_by_layer`: nothing needs the original whole on the device)."""
    evaluation_placed: bool = False
    """lm-eval runs each model placed by accelerate (`evaluation.device_map`) within what the
    devices and the host have free, the rest on disk."""

    @classmethod
    def of(cls, recipe: Recipe) -> PlanSettings:
        spec = recipe.distillation
        return cls(
            dtype=recipe.model.dtype,
            load="stream" if recipe.model.load == "stream" else "memory",
            attn_implementation=recipe.model.attn_implementation,
            samples=recipe.calibration.num_samples,
            seq_len=recipe.calibration.seq_len,
            batch=min(recipe.calibration.batch_size, recipe.calibration.num_samples),  # a batch holds what there is
            activations=recipe.activations,
            h_dtype=recipe.sensitivity.dtype,
            chunk=recipe.sensitivity.chunk,
            recompute=recipe.sensitivity.recompute,
            mlp_feedback=recipe.mlp.feedback if recipe.mlp is not None else None,
            experts_sample=recipe.experts.sample_tokens if recipe.experts is not None else None,
            refinement=recipe.refinement is not None,
            distillation=(spec.method, spec.teacher) if spec is not None else None,
            evaluation=recipe.evaluation is not None,
            evaluation_batch=(
                recipe.evaluation.seq_len,
                min(recipe.evaluation.batch_size, recipe.evaluation.num_samples),
            )
            if recipe.evaluation
            else (0, 0),
            evaluation_layerwise=_layerwise_evaluation(recipe),
            evaluation_placed=recipe.evaluation is not None
            and recipe.evaluation.device_map is not None
            and bool(recipe.evaluation.lm_eval),
        )


def writes_as_it_goes(recipe: Recipe, layout: Any, save_model: bool = True, stages: Any = None) -> bool:
    """A streamed run writes the pruned model as its walk goes, each layer leaving memory when it is
    written, when it saves the model (a sweep's `save_models`) and no stage after the walk changes it
    whole (`Stage.changes_model`: refinement, the MLP stage, distillation, a plugin's), no symmetric
    fit of a global layout's tied head (it rotates every layer after the walk; `slicing.tied_fit:
    diagonal` is written as it goes), and no evaluation beyond the layer-by-layer one (throughput,
    and lm-eval tasks unless accelerate places their models, run both models whole). `layout`: the
    run's `SlicedLayout`; `stages`: the plan's (the built-in ones when None)."""
    from compressor.runtime.layerwise_eval import evaluates_layer_by_layer
    from compressor.stages.contract import changes_model_between
    from compressor.stages.order import BUILTIN_STAGES

    rotates_head = layout.one_basis and layout.tie_head and recipe.slicing.tied_fit == "symmetric"
    return (
        save_model
        and recipe.model.load == "stream"
        and not changes_model_between(stages or BUILTIN_STAGES, recipe, "walk")
        and not rotates_head
        and (recipe.evaluation is None or evaluates_layer_by_layer(recipe))
    )


def _layerwise_evaluation(recipe: Recipe) -> tuple[int, int, int] | None:
    from compressor.runtime.layerwise_eval import evaluates_layer_by_layer

    spec = recipe.evaluation
    if spec is None or not evaluates_layer_by_layer(recipe):
        return None
    return spec.num_samples, spec.seq_len, spec.batch_size


def machine_memory(device: torch.device) -> Machine:
    """Host RAM (`COMPRESS_HOST_MEMORY_GIB` overrides it), this process's share of it under
    torchrun, and, on CUDA, the device's total memory (`COMPRESS_DEVICE_MEMORY_GIB` overrides it)."""
    host_override = os.environ.get("COMPRESS_HOST_MEMORY_GIB")
    host = (
        int(float(host_override) * GiB) if host_override else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    )
    host //= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # under torchrun each process on this host holds its own
    device_override = os.environ.get("COMPRESS_DEVICE_MEMORY_GIB")
    if device.type == "cuda":
        total = int(float(device_override) * GiB) if device_override else torch.cuda.mem_get_info(device)[1]
        return Machine(host, total, torch.cuda.get_device_name(device) if not device_override else str(device))
    return Machine(host, None, "cpu")


def process_rss() -> int:
    """This process's resident memory now (Linux; 0 elsewhere): the interpreter and libraries a run starts with."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _sizes(settings: PlanSettings, layout: Any) -> dict[str, int]:
    """The model's and the calibration's sizes under a plan's settings, by `Footprint`'s field names:
    the part of it that depends on the config and layout alone."""
    config, family = layout.config, layout.family
    item = getattr(torch, settings.dtype).itemsize
    d = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    samples, seq_len, batch = settings.samples, settings.seq_len, settings.batch
    return {
        "item": item,
        "d": d,
        "layers": config.num_hidden_layers,
        "vocab": config.vocab_size,
        "f": getattr(config, family.mlp_width) if family.mlp_width is not None else 0,
        "batch": batch,
        "seq_len": seq_len,
        "params": layout.params.original,
        "pruned": layout.params.count(layout.widths) if layout.widths is not None else layout.budget,
        "positions": (samples // batch + 1) * 2 * batch * seq_len * head_dim * item,
    }


@dataclass(frozen=True)
class Footprint:
    """What every stage's memory estimate reads: the model's shape and sizes under the plan's
    settings, the activation store, the walk's and H pass's device peaks measured on one fake
    layer (`measure_device`). Each stage turns it into its phases (`Stage.memory`)."""

    settings: PlanSettings
    layout: Any
    needs_h: bool
    accelerator: bool
    base: int
    item: int
    d: int
    layers: int
    vocab: int
    f: int
    batch: int
    seq_len: int
    params: int
    pruned: int
    weights: int
    pruned_weights: int
    store: int
    positions: int
    h_item: int
    totals: int
    chunk: int
    stored: int
    bases: int
    measured: dict[str, int]
    disk: str
    smaller_batch: str
    streaming: bool
    writes: bool
    resident: int
    held: int
    walked: int
    walk_host: int
    recipe: Any = None
    """The recipe the plan is of, for a plugin stage's options (None: a benchmark's settings alone)."""

    @classmethod
    def of(
        cls, settings: PlanSettings, layout: Any, needs_h: bool, accelerator: bool, base: int = 0, recipe: Any = None
    ) -> Footprint:
        config, family, sizes = layout.config, layout.family, _sizes(settings, layout)
        item, d, layers, batch, seq_len = (sizes[k] for k in ("item", "d", "layers", "batch", "seq_len"))
        kept = layout.kept if layout.kept is not None else d
        weights = sizes["params"] * item
        stream = settings.samples * seq_len * d * item
        store = 0 if settings.activations == "disk" else stream
        sites = 2 * layers + 1
        h_item = 8 if settings.h_dtype == "float64" else 4
        recompute = settings.recompute if settings.recompute is not None else accelerator
        chunk = settings.chunk if recompute else batch  # without recomputation H goes one batch at a time
        fake = FakeBatch(getattr(torch, settings.dtype), batch, seq_len, settings.attn_implementation)
        measured = measure_device(config, family, fake, kept, recompute if needs_h else True)
        disk = "activations: disk" if settings.activations == "host" else "fewer calibration.num_samples"
        streaming = settings.load == "stream"
        if not streaming:
            disk += ", model.load: stream"
        # the model during the layer-by-layer passes: whole in memory, or streamed (what is outside the
        # layers, plus the layers the walk has sliced, which it keeps)
        resident = weights - layers * measured["layer"]
        totals = sites * d * d * h_item if needs_h else 0
        bases = sites * d * kept * 8
        writes = streaming and settings.writes
        walked = min(weights, resident + sizes["pruned"] * item) if streaming else weights
        # a walk that writes as it goes holds what is outside the layers, the layer it is on (read to
        # the host first on an accelerator), one site's H and two bases; the rest is on disk
        read = measured["layer"] if accelerator else 0
        walk_host = (
            resident + read + store + sizes["positions"] + (d * d * h_item if needs_h else 0) + 2 * d * kept * 8
            if writes
            else walked + store + sizes["positions"] + totals + bases
        )
        return cls(
            **sizes,
            settings=settings,
            layout=layout,
            needs_h=needs_h,
            accelerator=accelerator,
            base=base,
            weights=weights,
            pruned_weights=sizes["pruned"] * item,
            store=store,
            h_item=h_item,
            totals=totals,
            chunk=chunk,
            stored=(layers + 1) * chunk * seq_len * d * item + chunk * seq_len * d * item if recompute else 0,
            bases=bases,
            measured=measured,
            disk=disk,
            smaller_batch="a smaller calibration.batch_size (or seq_len)",
            streaming=streaming,
            writes=writes,
            resident=resident,
            held=resident if streaming else weights,
            walked=walked,
            walk_host=walk_host,
            recipe=recipe,
        )

    def phase(self, name: str, host: int, device_bytes: int, fix: str, whole_model: bool = False) -> Phase:
        """On CPU the device is the host: a layer-wise phase's device bytes add to the host's; a
        whole-model phase's device figure already holds the models the host holds."""
        if self.accelerator:
            return Phase(name, self.base + host, device_bytes, fix)
        total = max(host, device_bytes) if whole_model else host + device_bytes
        return Phase(name, self.base + total, None, fix)


@dataclass(frozen=True)
class PlanContext:
    """What a run's plan knows beyond a benchmark's settings: the process it runs in, its stages
    and its recipe."""

    base: int = 0
    """The process as it stands, before any weight is loaded: every host figure is on top of it."""
    stages: Any = None
    """The plan's stages, a plugin's among them (None: the built-in stages)."""
    recipe: Any = None
    """The recipe the plan is of: only the stages it asks for count, and a plugin stage reads its
    options (None: a benchmark's settings say it for the built-ins)."""


def memory_plan(
    settings: PlanSettings, layout: Any, needs_h: bool, accelerator: bool, context: PlanContext = PlanContext()
) -> MemoryPlan:
    """The plan of `settings` on `layout` (a `SlicedLayout`): the sum of its stages' phases, each host
    figure on top of the process's (`PlanContext`)."""
    base, stages, recipe = context.base, context.stages, context.recipe
    if stages is None:
        from compressor.stages.order import BUILTIN_STAGES as stages
    footprint = Footprint.of(settings, layout, needs_h, accelerator, base, recipe)
    if recipe is not None:  # the stages the recipe asks for (a benchmark's settings say it for the built-ins)
        stages = [stage for stage in stages if stage.wanted(recipe)]
    phases = [phase for stage in stages for phase in stage.memory(footprint)]
    notes = [note for stage in stages for note in stage.memory_notes(footprint)]
    config = layout.config
    shape = (
        f"{config.model_type}, {footprint.layers} layers, hidden {footprint.d}, MLP {footprint.f or '-'}, "
        f"vocabulary {footprint.vocab}, {footprint.params / 1e9:.2f}B parameters "
        f"({footprint.weights / GiB:.1f} GiB in {settings.dtype})"
    )
    return MemoryPlan(tuple(phases), footprint.weights, shape, base, footprint.streaming, tuple(notes))


def check_memory(plan: MemoryPlan, machine: Machine) -> None:
    """Refuse (one line, exit 2) a plan whose peak does not fit `machine`."""
    refusal = plan.refusal(machine)
    if refusal is not None:
        raise UserError(refusal)


def run_memory_plan(recipe: Recipe, checked: Any, device: torch.device, save_model: bool = True) -> MemoryPlan:
    """The plan of a checked recipe (`plan.checks.Plan`): H counted when the pipeline or the
    allocator needs it; `save_model=False` (a sweep's runs by default) keeps the walked layers."""
    from compressor.engine.pooling import required_statistics

    needed = required_statistics(checked.pipeline) | (set(checked.allocator.requires) if checked.allocator else set())
    settings = dataclasses.replace(
        PlanSettings.of(recipe),
        split_choice=checked.may_choose_split,
        predicts_splits=checked.measure_best is not None,
        depth_windows=recipe.depth.heldout_windows
        if recipe.depth is not None
        and checked.block_selector is not None
        and "measure" in checked.block_selector.requires
        else 0,
        writes=writes_as_it_goes(recipe, checked.layout, save_model, checked.stages),
    )
    context = PlanContext(process_rss(), checked.stages, recipe)
    return memory_plan(settings, checked.layout, "H" in needed, device.type != "cpu", context)


def resolved_load(
    recipe: Recipe, checked: Any, device: torch.device, machine: Machine, save_model: bool = True
) -> tuple[Recipe, str | None]:
    """`model.load: auto` decided by the plan: memory where the run fits this machine so, stream
    where only streaming fits; the recipe with that choice, and a line saying it (None otherwise)."""
    from compressor.engine.streaming import cannot_stream
    from compressor.validation import replaced

    if recipe.model.load != "auto":
        return recipe, None
    in_memory = replaced(recipe, model=replaced(recipe.model, load="memory"))
    if cannot_stream(checked.layout.family) is not None:
        return in_memory, "model.load: auto chose memory (this model family does not stream)"
    if recipe.depth is not None:
        return in_memory, "model.load: auto chose memory (depth removes blocks, which a streamed model cannot)"
    if run_memory_plan(in_memory, checked, device, save_model).refusal(machine) is None:
        return in_memory, "model.load: auto chose memory (the whole model fits this machine)"
    streamed = replaced(recipe, model=replaced(recipe.model, load="stream"))
    return streamed, "model.load: auto chose stream (the plan with the whole model in memory does not fit this machine)"
