"""YAML recipes: strict validation before anything is loaded.

Every section is a pydantic dataclass (`compressor.validation`): an unknown key, a missing key,
a value of the wrong type or range, or an unknown strategy raises `UserError` naming the key
(as a dotted path) and what is expected, in one line. Relative paths resolve against the recipe
file's folder. `recipe_schema` is the JSON schema of a recipe, for editors.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterator
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import StrictBool, StrictInt, StrictStr, TypeAdapter

from compressor.errors import UserError
from compressor.recipe.sensitivity_options import ACCUMULATION_DTYPES, AUTOCAST_DTYPES, REDUCTIONS, SensitivityOptions
from compressor.strategies.contract import Strategy, StrategyOptionError
from compressor.strategies.registry import PluginRegistry
from compressor.validation import FORBID, Number, check, described, options, shown

__all__ = ["ACCUMULATION_DTYPES", "AUTOCAST_DTYPES", "REDUCTIONS", "Recipe", "load_recipe", "recipe_schema", "validate"]

Dtype = Literal["float32", "float16", "bfloat16", "float64"]
Attention = Literal["sdpa", "eager"]
Format = Literal["text", "chat"]
AllocationMethod = Literal["uniform", "curves"]
Layout = Literal["per_site", "global"]
Pooling = Literal["trace", "sum"]
TiedFit = Literal["symmetric", "diagonal"]
Offload = Literal["host", "disk"]
ModelLoad = Literal["memory", "stream", "auto"]
DistillationMethod = Literal["lora", "full"]
Precision = Literal["auto", "float32", "bfloat16", "float16"]
Schedule = Literal["cosine", "linear", "constant", "constant_with_warmup", "inverse_sqrt"]
TeacherPlacement = Literal["model", "cached"]
DeviceMap = Literal["auto", "balanced", "balanced_low_0", "sequential"]
DTYPES = get_args(Dtype)
FORMATS = get_args(Format)
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"


@options(frozen=True, config=FORBID)
class ModelSpec:
    path: StrictStr
    dtype: Dtype = "float32"
    revision: StrictStr | None = None
    attn_implementation: Attention = "sdpa"
    trust_remote_code: StrictBool = False
    """Run the model's own Python code from its folder or hub repository (auto_map); off unless asked."""
    load: ModelLoad = "memory"
    """memory: the whole model in host memory; stream: a shell whose decoder layers are read from the
    safetensors shards when a layer-by-layer pass reaches them (capture, H, survey, walk, MLP stage),
    the result bit-identical. Whole-model stages (refinement, distillation's teacher, throughput,
    lm-eval unless `evaluation.device_map`, measuring splits) still load the original in memory. auto: memory where the memory plan fits this
    machine so, else stream."""


@options(frozen=True, config=FORBID)
class DataSpec:
    dataset: dict[StrictStr, Any]
    num_samples: Annotated[StrictInt, described("how many windows", ge=1)]
    seq_len: Annotated[StrictInt, described("tokens per window", ge=2)]
    batch_size: Annotated[StrictInt, described("windows per batch", ge=1)] = 8
    format: Format = "text"
    text_field: StrictStr = "text"
    messages_field: StrictStr = "messages"


@options(frozen=True, config=FORBID)
class LmEvalSpec:
    """lm-evaluation-harness tasks, run in-process on the models already loaded."""

    tasks: Annotated[list[StrictStr], described("task names or task YAML files, e.g. [arc_easy]", min_length=1)]
    """Task, group or tag names (lm-eval's registry or `include_path`), or task YAML files."""
    include_path: StrictStr | None = None
    """A folder of local task YAMLs, relative to the recipe's folder."""
    num_fewshot: Annotated[StrictInt, described("or null for each task's default", ge=0)] | None = None
    """None keeps each task's own default (GSM8K chain-of-thought is 8-shot by its definition)."""
    limit: Number | None = None
    """At most this many documents per task (a number below 1 is a fraction); None: all."""
    batch_size: Annotated[StrictInt, described("documents per batch", ge=1)] = 8
    apply_chat_template: StrictBool = False


@options(frozen=True, config=FORBID)
class EvaluationSpec(DataSpec):
    """Perplexity and KL windows, and optionally lm-eval task suites (one mapping, or a list of
    them when suites need different settings, e.g. zero-shot tasks and chat-template ones)."""

    lm_eval: list[LmEvalSpec] | None = None
    throughput: StrictBool = True
    """Measure prefill and decode tokens/s of both models (batch 1 and 8) for the report."""
    device_map: DeviceMap | None = None
    """lm-eval tasks on each model placed by accelerate's `device_map` (what lm-eval's
    `parallelize=True` does): over the GPUs, then host memory, then disk (the run's staging
    folder), one model at a time, for models one device cannot hold; perplexity and KL then run
    layer by layer (unless refinement or distillation ran). None: each model whole on the run's device."""
    max_memory: dict[StrictStr | StrictInt, StrictStr | StrictInt] | None = None
    """With device_map: the most each device may hold, accelerate's `max_memory` ({0: 70GiB,
    1: 70GiB, cpu: 100GiB}); None: what each has free when the model is placed. A run on the CPU
    (`device: cpu`) places its models on the host and disk only."""


@options(frozen=True, config=FORBID)
class SlicingSpec:
    layout: Layout = "per_site"
    """per_site: a basis per site, joined by transition matrices (a `sliced_*` class, SliceGPT's
    layout); global: one basis for the whole stream, saved as the original architecture at a
    smaller hidden size (`compressor.models.stock`: vLLM, llama.cpp, TGI load it)."""
    pooling: Pooling = "trace"
    """global: how the sites' statistics are summed into one problem: each divided by its trace
    (every site counts alike), or raw sums."""
    round_to: Annotated[StrictInt, described("kept widths are multiples of it", ge=1)] = 8
    """Kept widths are multiples of it: 64 or 128 suit tensor cores, 256 llama.cpp's k-quants."""
    slice_head: StrictBool = False
    correct_readers: StrictBool = False
    """Read each site's stream through the least-squares map C·V(VᵀCV)⁻¹ instead of V (no parameter cost)."""
    shared_bases: StrictBool = False
    """Each layer's MLP site keeps its attention site's basis, so no transition matrix sits between them."""
    tie_head: StrictBool | None = None
    """For a model with tied embeddings: the last site keeps the embedding's basis and the head
    stays tied to the (sliced) embedding, with a small map after the final norm. With the global
    layout: the head stays tied and the final norm's scale becomes the best diagonal fit
    (`stock.tied_scale`); false saves it untied (exact, vocabulary × width more). Unset: off for
    per_site, on for global when the model ties its embeddings (measured better at equal
    parameters, docs/benchmarks.md)."""
    tied_fit: TiedFit = "symmetric"
    """global with a tied head: how the head is fitted to the untied one. symmetric: the basis is
    rotated within its span so that the final norm's diagonal realises the best symmetric map
    (`stock.tied_rotation`, free: the stock model's other norms are uniform); diagonal: the
    final norm's scale alone (`stock.tied_scale`)."""


@options(frozen=True, config=FORBID)
class AllocationSpec:
    """How many directions each site keeps (`compressor.engine.allocation`), under the budget that
    `sparsity` (the uniform model's parameter count) or `target_params` sets."""

    method: AllocationMethod = "uniform"
    """uniform: one width everywhere; curves: per-site widths from predicted-KL curves."""
    min_kept: Annotated[Number, described("a fraction of the hidden width", gt=0, le=1)] = 0.5
    """curves: the narrowest a site may become, as a fraction of the hidden width."""
    step: Annotated[StrictInt, described("a positive multiple of slicing.round_to", ge=1)] | None = None
    """curves: the width grid (a multiple of slicing.round_to; default round_to)."""


@options(frozen=True, config=FORBID)
class RefinementSpec:
    """End-to-end refinement of the walk's bases against the output KL (`compressor.engine.refine`)."""

    epochs: Annotated[Number, described("passes over the calibration windows", gt=0)] = 1.0
    """Passes over its windows (one Riemannian Adam step per batch)."""
    windows: Annotated[StrictInt, described("or null for all calibration windows", ge=1)] | None = None
    """How many calibration windows it uses (evenly spaced); None: all."""
    lr: Annotated[Number, described("the Riemannian Adam step size", gt=0)] = 0.02
    batch_size: Annotated[StrictInt, described("calibration windows per step", ge=1)] = 4
    """Calibration windows per step."""
    top_k: Annotated[StrictInt, described("0 keeps the whole distribution", ge=0)] = 64
    """Teacher probabilities kept per token (the rest is one bin); 0 keeps the whole distribution."""
    heldout_windows: Annotated[
        StrictInt, described("calibration-dataset windows after the calibration set, for the held-out guard", ge=1)
    ] = 16
    """The guard's windows: read from the calibration dataset after the `num_samples` windows the
    walk and refinement use. The refined model is kept only when its KL to the original on them,
    saved as it will be, is not above the received model's."""


@options(frozen=True, config=FORBID)
class MlpSpec:
    """The MLP's width as a second axis (`compressor.engine.neurons`): every layer keeps `kept` of
    its intermediate neurons, chosen by `selector`, the down projection refitted to what the
    dropped ones wrote; the residual width then takes what the budget leaves. Without `kept` the
    run measures `candidates` splits of the budget (the residual width alone among them) and keeps
    the best (`compressor.run.split_choice`)."""

    kept: (
        Annotated[Number, described("neurons kept per layer (a whole number), or a fraction of them below 1", gt=0)]
        | None
    ) = None
    """Neurons every layer's MLP keeps (an integer), or that fraction of its width, rounded down
    to a multiple of `round_to`; None: the run chooses the split of the budget."""
    selector: StrictStr = "obs"
    """The neuron selector (`compress strategies` lists them): obs (output-aware: optimal brain
    surgeon weighed by H where the walk estimated it, except for families with a norm after the
    MLP, e.g. Gemma2), magnitude (Minitron-style), leverage (MoDeGPT)."""
    refit: StrictBool = True
    """Refit the down projection to what the dropped neurons wrote (least squares on the
    calibration tokens); off: the kept neurons' weights as they were."""
    feedback: Annotated[Number, described("share of the stream's error the refit takes back, 0 to 1", ge=0, le=1)] = 0.5
    """Error feedback: the refit reproduces what the layer's own neurons wrote plus this share of
    the difference between the stream the layer wrote before the MLP stage and the one it writes
    on the pruned stream (0: its own output only; 1: the whole stream as it was). Families with a
    norm after the MLP (Gemma2) run without it."""
    damping: Annotated[Number, described("the refit's ridge, times the mean of diag C", gt=0)] = 0.01
    """Above 0: a neuron that never fires (common after a ReLU) leaves C singular without it."""
    round_to: Annotated[StrictInt, described("a fraction's neuron count is a multiple of this", ge=1)] = 8
    min_kept: Annotated[Number, described("the plan's splits keep at least this share of the neurons", gt=0, lt=1)] = (
        0.25
    )
    """Without `kept`: the fewest neurons (a share of the MLP's width) a candidate split keeps."""
    candidates: Annotated[StrictInt, described("splits the plan measures, residual width alone among them", ge=2)] = 4
    """Without `kept`: how many splits of the budget are tried: the residual width alone, then
    residual widths evenly spaced up to the widest whose MLPs keep `min_kept` of their neurons;
    each is pruned and measured."""
    heldout_windows: Annotated[
        StrictInt, described("calibration-dataset windows after the calibration set, to measure the splits", ge=1)
    ] = 16
    """Without `kept`: the windows each split's KL to the original is measured on, read from the
    calibration dataset after its `num_samples` windows (text the walk never saw)."""


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


@options(frozen=True, config=FORBID)
class StepSpec:
    strategy: StrictStr
    options: dict[StrictStr, Any]


@options(frozen=True, config=FORBID)
class Recipe:
    model: ModelSpec
    calibration: DataSpec
    pipeline: list[StepSpec]
    output: StrictStr
    sparsity: Annotated[Number, described("the fraction of the hidden width removed", ge=0, lt=1)] | None = None
    """The fraction of the hidden width removed; with shared bases, a tied head or allocation by
    curves, the budget: the parameter count of SliceGPT's model (one basis per site, untied
    head) at that sparsity."""
    target_params: Annotated[Number, described("the fraction of the original's parameters kept", gt=0, le=1)] | None = (
        None
    )
    """Instead of `sparsity`: the pruned model's parameters as a fraction of the original's,
    transitions and the (untied) head counted."""
    budget: Literal["all", "non_embedding"] = "all"
    """Which parameters `target_params` counts: all of them, or all but the token and position
    embedding tables (how small-model users read "25% smaller": Gemma 3 270M is 63% embedding).
    A head tied to the embedding is the embedding; an untied head counts."""
    allocation: AllocationSpec = field(default_factory=AllocationSpec)
    evaluation: EvaluationSpec | None = None
    slicing: SlicingSpec = field(default_factory=SlicingSpec)
    sensitivity: SensitivityOptions = field(default_factory=SensitivityOptions)
    device: Annotated[StrictStr, described("auto, cpu, cuda or cuda:N", pattern=DEVICE_PATTERN)] = "auto"
    seed: Annotated[StrictInt, described("the random seed, as torch takes it", ge=0, lt=2**64)] = 0
    activations: Offload = "host"
    """Where calibration activations wait between layers: host memory, or disk (memory-mapped files)."""
    refinement: RefinementSpec | None = None
    """After the walk, refine every site's kept directions on the output KL (off when absent)."""
    distillation: DistillationSpec | None = None
    """After slicing and refinement, train the pruned model's weights on the original's output
    distribution (off when absent); the saved architecture is unchanged."""
    mlp: MlpSpec | None = None
    """Prune the MLP's intermediate width too, under the same budget (off when absent: the residual
    width alone, as SliceGPT)."""
    stages: dict[StrictStr, Any] = field(default_factory=dict)
    """Plugin stages' sections, by name, each its stage's options (`compressor_stages`); written in
    the YAML as top-level keys, as the built-in sections are."""

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe, in the same shape as the YAML it came from."""
        values = dataclasses.asdict(self)
        values["pipeline"] = [{"strategy": s.strategy, **s.options} for s in self.pipeline]
        values.pop("stages")
        for name, spec in self.stages.items():
            values[name] = _plain(dataclasses.asdict(spec)) if dataclasses.is_dataclass(spec) else spec
        return values


# --- overrides and paths ------------------------------------------------------------------


class RecipeLoader(yaml.SafeLoader):
    """YAML as the 1.2 core schema reads it: only true/false are booleans (`yes`, `on`, `n` stay
    strings, so a misspelt value is refused rather than read as another type), `1e-3` is a number,
    and `010` or `1:30` are not octal or sexagesimal numbers."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp)
        for tag, regexp in resolvers
        if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _pattern, _first in (
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        "tag:yaml.org,2002:float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
):
    RecipeLoader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))


MAX_DIGITS = 40
"""The longest integer a recipe may write (no setting takes more than 64 bits)."""

MAX_VALUES = 100_000
"""The most values a recipe may expand to (a recipe holds hundreds; YAML aliases can make billions)."""


class _Core12Constructor:
    """Ints in the 1.2 core forms (decimal, 0o octal, 0x hex); floats with an exponent and no dot.
    A scalar that is not what its tag says (`!!int 1.5`, `!!float abc`), an integer longer than
    any setting, and a key given twice are YAML errors at their line, not Python exceptions."""

    @staticmethod
    def int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
        text = str(loader.construct_scalar(node))
        if len(text.lstrip("+-")) > MAX_DIGITS:
            raise _bad(node, f"an integer of {len(text.lstrip('+-'))} digits, longer than any setting takes")
        try:
            return int(text, 0) if text.lstrip("+-").startswith(("0o", "0x")) else int(text)
        except ValueError:
            raise _bad(node, f"{text[:40]!r} is tagged as an integer but is not one") from None

    @staticmethod
    def float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
        text = str(loader.construct_scalar(node)).lower()
        try:
            return float(text.replace(".inf", "inf").replace(".nan", "nan"))
        except ValueError:
            raise _bad(node, f"{text[:40]!r} is tagged as a number but is not one") from None

    @staticmethod
    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
        seen: dict[str, yaml.Node] = {}
        for key_node, _ in node.value:  # the keys as written (a merge key's `<<` brings keys it may override)
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if key_node.value in seen:
                line = seen[key_node.value].start_mark.line + 1
                raise _bad(key_node, f"the key '{key_node.value}' is given twice (first at line {line}); keep one")
            seen[key_node.value] = key_node
        return loader.construct_mapping(node)


def _bad(node: yaml.Node, problem: str) -> yaml.constructor.ConstructorError:
    return yaml.constructor.ConstructorError(None, None, problem, node.start_mark)


RecipeLoader.add_constructor("tag:yaml.org,2002:int", _Core12Constructor.int)
RecipeLoader.add_constructor("tag:yaml.org,2002:float", _Core12Constructor.float)
RecipeLoader.add_constructor("tag:yaml.org,2002:map", _Core12Constructor.mapping)


def parse_yaml(text: str) -> Any:
    """`text` read as YAML with `RecipeLoader` (recipes, sweep files and --set values alike): YAML
    errors as `yaml.YAMLError`, nesting too deep for the parser and values expanded past
    `MAX_VALUES` (aliases) included."""
    try:
        value = yaml.load(text, Loader=RecipeLoader)  # noqa: S506 (a SafeLoader)
    except RecursionError:
        raise yaml.YAMLError("it is nested too deeply to read") from None
    if _values(value) > MAX_VALUES:
        raise yaml.YAMLError(
            f"it expands to more than {MAX_VALUES:,} values (YAML aliases?), more than any recipe holds"
        )
    return value


def _values(value: Any) -> int:
    """How many values `value` holds, counted as far as `MAX_VALUES` + 1 (an alias counts again
    wherever it is used, as every reader of the recipe would see it)."""
    count, pending = 0, [value]
    while pending and count <= MAX_VALUES:
        item = pending.pop()
        count += 1
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return count


def dotted(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys (lists stay values), as `--set` and sweep grids name them."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `--set dotted.key=value` (value parsed as YAML) to the raw recipe."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise UserError(f"--set expects KEY=VALUE, got '{assignment}'")
    try:
        value = parse_yaml(text) if text else None
    except yaml.YAMLError as error:
        raise UserError(
            f"--set {key}: the value is not valid YAML ({getattr(error, 'problem', None) or error})"
        ) from None
    assign(raw, key, value, "--set ")


def assign(raw: dict[str, Any], key: str, value: Any, where: str = "") -> None:
    """Set the dotted `key` (list items by index) of a raw recipe to `value`; `where` prefixes errors."""
    parts = key.split(".")
    node: Any = raw
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        here = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) > len(node):
                raise UserError(f"{where}{key}: '{here}' needs a list index from 0 to {len(node)}")
            index = int(part)
            if index == len(node):
                node.append({} if not last else value)
            if last:
                node[index] = value
            node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise UserError(f"{where}{key}: '{'.'.join(parts[:depth])}' is not a mapping or list")


def _is_remote(path: str) -> bool:
    return "://" in path


def resolve_path(path: str, base: Path) -> str:
    """`path` made absolute against `base`, unless it is absolute already or a URL."""
    return path if _is_remote(path) or Path(path).is_absolute() else str((base / path).resolve())


def resolve_model_path(path: str, base: Path, where: str = "model.path, relative to the recipe's folder") -> str:
    """A folder relative to `base` if it looks like a path or exists; else a hub id."""
    local = base / path
    if path.startswith((".", "/", "~")) or local.exists():
        resolved = Path(path).expanduser() if path.startswith("~") else Path(resolve_path(path, base))
        if not resolved.is_dir():
            raise UserError(f"model folder not found: {resolved} ({where}){_reference_hint(resolved)}")
        return str(resolved)
    if not _is_hub_id(path):
        raise UserError(
            f"model folder not found: {local} ({where}), and {shown(path)} is not a hub id "
            f"(name or organisation/name) either; give the folder of a model, or its hub id"
        )
    return path


def _is_hub_id(path: str) -> bool:
    """Whether `path` could name a model on the hub (huggingface_hub's own rule)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _reference_hint(missing: Path) -> str:
    """The benchmark recipes read the reference model and corpus from a `shared/` folder beside the
    checkout: say so, and where the demo's own copies are, instead of a bare "not found"."""
    if "shared" not in missing.parts:
        return ""
    return (
        "; the ref_llama_* recipes expect the reference data (models/ref-llama, corpus/) in a shared/ folder "
        "beside the checkout; without it, recipes/demo.yaml runs on the copies in examples/ref-llama and "
        "examples/data"
    )


def _resolve_data_files(files: Any, base: Path, where: str) -> Any:
    if isinstance(files, str):
        resolved = resolve_path(files, base)
        if not _is_remote(resolved) and not any(ch in resolved for ch in "*?[") and not Path(resolved).exists():
            raise UserError(
                f"data file not found: {resolved} ({where}, relative to the recipe's folder)"
                f"{_reference_hint(Path(resolved))}"
            )
        return resolved
    if isinstance(files, list):
        return [_resolve_data_files(f, base, where) for f in files]
    if isinstance(files, dict):
        return {k: _resolve_data_files(v, base, f"{where}.{k}") for k, v in files.items()}
    raise UserError(f"{where} must be a path, a list of paths or a mapping of split to paths")


# --- validation ---------------------------------------------------------------------------


def check_data(spec: DataSpec, where: str, base: Path) -> DataSpec:
    """`dataset` names a loader or dataset, and its local files (resolved against `base`) exist."""
    return dataclasses.replace(spec, dataset=check_dataset(spec.dataset, where, base))


def check_dataset(dataset: dict[str, Any], where: str, base: Path) -> dict[str, Any]:
    """A dataset spec with a `path`, its local files resolved against `base` (and existing)."""
    if "path" not in dataset:
        raise UserError(f"{where}.dataset needs a 'path' (a dataset name or a loader such as json)")
    loader = dataset["path"]
    if loader in FILE_LOADERS and not any(dataset.get(key) for key in ("data_files", "data_dir")):
        raise UserError(
            f"{where}.dataset: path {loader} is the loader of {loader} files and reads the files data_files "
            f"(or data_dir) names; add data_files: <your file>"
        )
    dataset = dict(dataset)
    for key in ("data_files", "data_dir"):
        if key in dataset:
            dataset[key] = _resolve_data_files(dataset[key], base, f"{where}.dataset.{key}")
    return dataset


FILE_LOADERS = ("json", "csv", "text", "parquet", "arrow", "pandas", "xml", "webdataset")
"""datasets' loaders of local files by format: without data_files they read nothing (a hub dataset
of that name is never what was meant)."""


TASK_FILE_SUFFIXES = (".yaml", ".yml")


def check_lm_eval(spec: LmEvalSpec, where: str, base: Path) -> LmEvalSpec:
    """Ranges, and task files and `include_path` resolved against `base`. Task names are
    checked against lm-eval's registry later (`compressor.evaluation.harness.check_tasks`), as that
    index takes seconds to build."""
    if spec.limit is not None and (spec.limit <= 0 or (spec.limit >= 1 and spec.limit != int(spec.limit))):
        raise UserError(
            f"{where}.limit must be a whole number of documents per task, or a fraction below 1, got {spec.limit}"
        )
    tasks = []
    for index, task in enumerate(spec.tasks):
        if task.endswith(TASK_FILE_SUFFIXES):
            task = resolve_path(task, base)
            if not Path(task).is_file():
                raise UserError(
                    f"lm-eval task file not found: {task} ({where}.tasks.{index}, relative to the recipe's folder)"
                )
        tasks.append(task)
    include_path = spec.include_path
    if include_path is not None:
        include_path = resolve_path(include_path, base)
        if not Path(include_path).is_dir():
            raise UserError(
                f"lm-eval include_path is not a folder: {include_path} "
                f"({where}.include_path, relative to the recipe's folder)"
            )
    return dataclasses.replace(spec, tasks=tasks, include_path=include_path)


def check_evaluation(spec: EvaluationSpec, where: str, base: Path) -> EvaluationSpec:
    if spec.format != "text":
        raise UserError(f"{where}.format must be text (perplexity and KL are measured on text windows)")
    spec = check_data(spec, where, base)
    if spec.lm_eval is not None:
        if not spec.lm_eval:
            raise UserError(f"{where}.lm_eval must hold at least one suite (a mapping with tasks), or be left out")
        suites = spec.lm_eval
        spec = dataclasses.replace(
            spec,
            lm_eval=[
                check_lm_eval(suite, f"{where}.lm_eval" + (f".{i}" if len(suites) > 1 else ""), base)
                for i, suite in enumerate(suites)
            ],
        )
        named = [task for suite in spec.lm_eval for task in suite.tasks]
        twice = sorted({task for task in named if named.count(task) > 1})
        if twice:
            raise UserError(
                f"lm-eval task '{twice[0]}' is named twice in {where}.lm_eval; its scores share one key "
                f"in the report, so name each task once"
            )
    check_placement(spec, where)
    return spec


def check_placement(spec: EvaluationSpec, where: str) -> None:
    """`device_map` and `max_memory` make sense together, and without whole-model throughput."""
    if spec.max_memory is not None and spec.device_map is None:
        raise UserError(f"{where}.max_memory applies to models placed by accelerate: set {where}.device_map: auto")
    if spec.device_map is not None and spec.throughput:
        raise UserError(
            f"{where}.throughput measures both models whole on the run's device, which {where}.device_map "
            f"is for avoiding: set {where}.throughput: false"
        )
    for key, value in (spec.max_memory or {}).items():
        if str(key) not in ("cpu", "disk") and not str(key).isdigit():
            raise UserError(f"{where}.max_memory: '{key}' is not a device; use GPU numbers (0, 1), cpu or disk")
        if isinstance(value, str) and value.rstrip().endswith("b"):
            raise UserError(
                f"{where}.max_memory.{key}: '{value}' would be read as bits (accelerate reads a lowercase b so); "
                f"write bytes: GB or GiB"
            )
        try:
            memory_bytes(value)
        except ValueError:
            raise UserError(
                f"{where}.max_memory.{key}: '{value}' is not a size; give bytes or a size such as 70GiB"
            ) from None


def memory_bytes(value: str | int) -> int:
    """A size as accelerate reads it ("70GiB", "500MB", bytes)."""
    from accelerate.utils import convert_file_size_to_int

    count = convert_file_size_to_int(value)
    if count < 0:
        raise ValueError(value)
    return count


def check_allocation(spec: AllocationSpec, round_to: int) -> None:
    if spec.step is not None and spec.step % round_to:
        raise UserError(
            f"allocation.step must be a positive multiple of slicing.round_to ({round_to}), got {spec.step}"
        )


def _plain(value: Any) -> Any:
    """Tuples to lists (recursively), so options dump as plain YAML."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _strings(value: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """Every string in `value` (keys too), with the dotted key it sits under."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, (list, dict)):
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            inner = f"{where}.{key}" if where else str(key)
            yield from _strings(item, inner)
            yield from _strings(key, inner)


def validate(raw: Any, base: Path, registry: PluginRegistry) -> Recipe:
    """Check a raw recipe mapping completely and return it with paths resolved."""
    if not isinstance(raw, dict):
        raise UserError("the recipe must be a YAML mapping of keys (model, calibration, sparsity, pipeline, ...)")
    for where, text in _strings(raw):
        if "\x00" in text:
            raise UserError(f"{where} holds a NUL character, which no path, name or setting may; remove it")
    raw = copy.deepcopy(raw)
    pipeline_raw = raw.pop("pipeline", None)
    if not isinstance(pipeline_raw, list) or not pipeline_raw:
        raise UserError("pipeline must be a non-empty list of steps, e.g. [{strategy: pca}]")
    steps = []
    for index, step in enumerate(pipeline_raw):
        where = f"pipeline.{index}"
        if not isinstance(step, dict) or "strategy" not in step:
            raise UserError(f"{where} must be a mapping with a 'strategy' key, got {shown(step)}")
        options = {k: v for k, v in step.items() if k != "strategy"}
        strategy = registry.strategy(str(step["strategy"]))
        try:
            parsed = strategy.parse_options(options)
        except StrategyOptionError as error:
            raise UserError(f"{where}: {error}") from None
        if dataclasses.is_dataclass(parsed):  # record the defaults too, so the saved recipe is complete
            complete = _plain(dataclasses.asdict(parsed))
            try:
                strategy.parse_options(complete)
                options = complete
            except StrategyOptionError:  # the plugin's fields are not its option names: keep what was given
                pass
        steps.append(StepSpec(strategy=strategy.name, options=options))
    raw["pipeline"] = []
    stages = _stage_sections(raw, registry)
    evaluation = raw.get("evaluation")
    if isinstance(evaluation, dict) and isinstance(evaluation.get("lm_eval"), dict):
        evaluation["lm_eval"] = [evaluation["lm_eval"]]  # one suite may be written without the list
    recipe = check(Recipe, raw)
    if (recipe.sparsity is None) == (recipe.target_params is None):
        raise UserError(
            "give one of sparsity (the fraction of the hidden width removed, e.g. 0.25) or "
            "target_params (the fraction of the original's parameters kept, e.g. 0.75)"
        )
    if recipe.budget != "all" and recipe.target_params is None:
        raise UserError(
            f"budget: {recipe.budget} says which parameters target_params counts, but this recipe gives a "
            f"sparsity; set target_params instead, or remove budget"
        )
    check_allocation(recipe.allocation, recipe.slicing.round_to)
    if recipe.refinement is not None and recipe.slicing.correct_readers:
        raise UserError(
            "refinement cannot follow slicing.correct_readers: it optimises the bases of a model "
            "whose readers are its bases; turn one of them off"
        )
    check_layout(recipe)
    if recipe.mlp is not None:
        check_mlp(recipe.mlp, registry)
    calibration = check_data(recipe.calibration, "calibration", base)
    evaluation = check_evaluation(recipe.evaluation, "evaluation", base) if recipe.evaluation else None
    return dataclasses.replace(
        recipe,
        distillation=(
            check_distillation(recipe.distillation, calibration, evaluation, base) if recipe.distillation else None
        ),
        pipeline=steps,
        stages=stages,
        model=dataclasses.replace(recipe.model, path=resolve_model_path(recipe.model.path, base)),
        calibration=calibration,
        evaluation=evaluation,
        output=resolve_path(recipe.output, base),
    )


def _stage_sections(raw: dict[str, Any], registry: PluginRegistry) -> dict[str, Any]:
    """The plugin stages' sections taken out of `raw`, each checked by its stage's options class
    (absent: the stage does not run); a `stages` key is no section's and is refused as unknown."""
    if "stages" in raw:
        raise UserError(
            "the recipe has no key 'stages': a plugin stage's options go under its own section "
            "(`compress schema` lists the sections)"
        )
    found = {}
    for stage in registry.stages():
        if stage.section is None or stage.section not in raw:
            continue
        value = raw.pop(stage.section)
        if value is not None:
            found[stage.section] = check(stage.options, value, f"{stage.section}.") if stage.options else value
    return found


def check_mlp(spec: MlpSpec, registry: PluginRegistry) -> None:
    """`mlp.kept` is a whole number or a fraction below 1 (or absent: the plan chooses the split, and
    only then do the split's keys apply), and the selector is registered."""
    if spec.kept is not None:
        if spec.kept >= 1 and spec.kept != int(spec.kept):
            raise UserError(f"mlp.kept {spec.kept:g}: give a whole number of neurons, or a fraction below 1")
        fixed = MlpSpec(kept=spec.kept)
        for key in ("min_kept", "candidates", "heldout_windows"):
            if getattr(spec, key) != getattr(fixed, key):
                raise UserError(
                    f"mlp.{key} applies when the plan chooses the split, but mlp.kept fixes it; remove one of them"
                )
    registry.selector(spec.selector)


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
    trainer keys are checked against the model and transformers in `run.checks.plan`.)"""
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


def check_layout(recipe: Recipe) -> None:
    """What a global layout (one basis, one width) cannot be combined with."""
    slicing = recipe.slicing
    if slicing.layout != "global":
        return
    if slicing.shared_bases:
        raise UserError(
            "slicing.shared_bases shares a basis within each layer, and slicing.layout: global already "
            "keeps one basis everywhere; remove slicing.shared_bases"
        )
    if recipe.allocation.method != "uniform":
        raise UserError(
            "slicing.layout: global keeps one width everywhere, so allocation.method must be uniform "
            f"(got {recipe.allocation.method}); use slicing.layout: per_site for per-site widths"
        )


def read_yaml(path: Path, what: str) -> Any:
    """A YAML file's contents; a missing file or bad YAML is a one-line UserError."""
    if path.is_dir():
        raise UserError(f"{path} is a folder; give the {what} file, e.g. {path / 'demo.yaml'}")
    if not path.is_file():
        raise UserError(f"{what} file not found: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        kind = "a gzip file" if data.startswith(b"\x1f\x8b") else "not UTF-8 text"
        raise UserError(
            f"{what} {path} is {kind} (byte 0x{data[error.start]:02x} at offset {error.start}); "
            f"give a YAML file saved as UTF-8"
        ) from None
    if "\x00" in text:
        raise UserError(f"{what} {path} holds NUL bytes, so it is not a YAML text file; give a YAML file")
    try:
        return parse_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise UserError(f"{what} {path} is not valid YAML{where}: {problem}") from None


def load_recipe(
    path: str | Path, registry: PluginRegistry, overrides: list[str] = (), output: str | None = None
) -> Recipe:
    """Read, override (`--set`), and validate a recipe file. `output` (from the CLI)
    replaces the recipe's output and resolves against the current folder."""
    path = Path(path)
    raw = read_yaml(path, "recipe")
    if isinstance(raw, dict):
        for assignment in overrides:
            apply_override(raw, assignment)
        if output is not None:
            raw["output"] = str(Path(output).resolve())
    return validate(raw, path.resolve().parent, registry)


def recipe_schema(registry: PluginRegistry) -> dict[str, Any]:
    """The JSON schema of a recipe (draft 2020-12), for editors: every section's keys, types,
    bounds and meanings from its options class; each pipeline step as `strategy` plus that
    strategy's options (any options, for a plugin that checks them in its own code)."""
    schema = TypeAdapter(Recipe).json_schema()
    definitions = schema.setdefault("$defs", {})
    definitions.pop("StepSpec", None)
    steps = []
    for name, entry in registry.strategies().items():
        strategy = entry.strategy
        step: dict[str, Any] = {
            "type": "object",
            "title": name,
            "description": strategy.description,
            "properties": {"strategy": {"const": name}},
            "required": ["strategy"],
            "additionalProperties": False,
        }
        if strategy.option_class is not None:
            found = TypeAdapter(strategy.option_class).json_schema()
            definitions.update(found.pop("$defs", {}))
            step["properties"].update(found.get("properties", {}))
        elif type(strategy).parse_options is not Strategy.parse_options:
            step["additionalProperties"] = True
        steps.append(step)
    schema["properties"]["pipeline"] = {
        "type": "array",
        "minItems": 1,
        "items": {"oneOf": steps},
        "description": "selection strategies, applied in order at every site",
    }
    schema["properties"].pop("stages", None)
    for stage in registry.stages():  # a plugin stage's section, beside the built-in ones
        if stage.section is not None and stage.options is not None:
            found = TypeAdapter(stage.options).json_schema()
            definitions.update(found.pop("$defs", {}))
            schema["properties"][stage.section] = {"anyOf": [found, {"type": "null"}], "description": stage.name}
    suites = definitions["EvaluationSpec"]["properties"]["lm_eval"]  # one suite may be written without the list
    suites["anyOf"].insert(1, {"$ref": "#/$defs/LmEvalSpec"})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "compressor recipe", **schema}
