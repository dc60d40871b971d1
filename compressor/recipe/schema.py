"""YAML recipes: strict validation before anything is loaded.

A recipe is its sections (`recipe.sections`: each a pydantic options class with its own checks,
beside the code that reads it) plus the run-wide keys declared here (budget, device, seed, output)
and the pipeline of strategies. An unknown key, a missing key, a value of the wrong type or range,
or an unknown strategy raises `UserError` naming the key (as a dotted path) and what is expected, in
one line. Relative paths resolve against the recipe file's folder. `recipe_schema` is the JSON
schema of a recipe, for editors.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import StrictInt, StrictStr, TypeAdapter

from compressor.errors import UserError, did_you_mean
from compressor.recipe.paths import BUNDLED, resolve_path
from compressor.recipe.reading import apply_override, read_yaml
from compressor.recipe.sections.contract import SectionContext
from compressor.recipe.sections.data import DataSpec
from compressor.recipe.sections.depth import DepthSpec
from compressor.recipe.sections.distillation import DistillationSpec
from compressor.recipe.sections.evaluation import EvaluationSpec
from compressor.recipe.sections.experts import ExpertsSpec
from compressor.recipe.sections.heads import HeadsSpec
from compressor.recipe.sections.mlp import MlpSpec
from compressor.recipe.sections.model import ModelSpec
from compressor.recipe.sections.order import BUILTIN_SECTIONS
from compressor.recipe.sections.refinement import RefinementSpec
from compressor.recipe.sections.sensitivity import SensitivityOptions
from compressor.recipe.sections.slicing import AllocationSpec, SlicingSpec
from compressor.strategies.contract import Strategy, StrategyOptionError
from compressor.strategies.registry import PluginRegistry
from compressor.validation import FORBID, Number, check, described, options, shown

__all__ = ["Recipe", "load_recipe", "recipe_schema", "validate"]

Offload = Literal["host", "disk"]
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"


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
    target_active_params: (
        Annotated[Number, described("the fraction of the original's parameters per token kept", gt=0, le=1)] | None
    ) = None
    """Instead of `sparsity`, alone or beside `target_params`: a Mixture-of-Experts model's
    parameters used per token (each layer's top-k routed experts, the router, everything else) as
    a fraction of the original's; the pruned model keeps within both targets."""
    target_decode: (
        Annotated[Number, described("the fraction of the dense model's decode time per token kept", gt=0, le=1)] | None
    ) = None
    """Instead of `sparsity`, alone or beside `target_params`: the pruned model's decode step (batch
    1, this run's device and dtype) takes at most this fraction of the dense model's. Each
    candidate the run may choose gets the largest parameter budget whose model decodes within it,
    measured on models of those shapes (`plan.decode_budget`); a global layout (a stock class)."""
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
    threads: Annotated[StrictInt, described("CPU threads torch uses", ge=1)] | None = None
    """CPU threads torch uses; None: on the command line, the CPUs this process is given (its
    affinity mask, capped by a cgroup CPU quota) less those other work keeps busy, or
    `OMP_NUM_THREADS` (`runtime.threads.command_threads`); from Python, the caller's count."""
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
    experts: ExpertsSpec | None = None
    """Prune a Mixture-of-Experts model's routed experts too, the same count in every layer (off
    when absent)."""
    depth: DepthSpec | None = None
    """Remove whole decoder blocks before the walk (off when absent)."""
    heads: HeadsSpec | None = None
    """Prune every attention layer's query heads too, under the same budget (off when absent)."""
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
    _refuse_unknown_sections(raw, registry)
    for section in BUILTIN_SECTIONS:
        if section.shorthand is not None and section.key in raw:
            raw[section.key] = section.shorthand(raw[section.key])
    recipe = check(Recipe, raw)
    _check_budget(recipe)
    context = SectionContext(base=base, registry=registry)
    for section in BUILTIN_SECTIONS:  # each section's own checks, in order, on the recipe checked so far
        spec = getattr(recipe, section.key)
        if spec is not None and section.check is not None:
            recipe = dataclasses.replace(recipe, **{section.key: section.check(spec, recipe, context)})
    if recipe.output.startswith(BUNDLED):
        raise UserError(f"output: {recipe.output} names a file the package ships; give a folder of yours")
    return dataclasses.replace(recipe, pipeline=steps, stages=stages, output=resolve_path(recipe.output, base))


def _check_budget(recipe: Recipe) -> None:
    """One budget: a sparsity or parameter targets (total, per token or both), and `budget` only
    with the targets it qualifies."""
    targets = any(
        value is not None for value in (recipe.target_params, recipe.target_active_params, recipe.target_decode)
    )
    if recipe.sparsity is not None and targets:
        raise UserError(
            "give one of sparsity (the fraction of the hidden width removed) or targets "
            "(target_params, target_active_params, target_decode), not both; remove sparsity (on the command "
            "line: --set sparsity=null)"
        )
    if recipe.target_decode is not None and recipe.slicing.layout != "global":
        raise UserError(
            f"target_decode times the stock model each candidate saves, and slicing.layout: {recipe.slicing.layout} "
            f"saves another class; set slicing.layout: global, or give target_params instead"
        )
    if recipe.sparsity is None and not targets:
        raise UserError(
            "give one of sparsity (the fraction of the hidden width removed, e.g. 0.25) or "
            "target_params (the fraction of the original's parameters kept, e.g. 0.75)"
        )
    if recipe.budget != "all" and not targets:
        raise UserError(
            f"budget: {recipe.budget} says which parameters target_params counts, but this recipe gives a "
            f"sparsity; set target_params instead, or remove budget"
        )


def _refuse_unknown_sections(raw: dict[str, Any], registry: PluginRegistry) -> None:
    """A top-level key that is neither the recipe's nor an installed stage's: the nearest of both
    suggested (a misspelt plugin section is told its name, as a built-in one is)."""
    names = [f.name for f in dataclasses.fields(Recipe) if f.name != "stages"]
    names += [stage.section for stage in registry.stages() if stage.section and stage.section not in names]
    for key in raw:
        if key not in names:
            raise UserError(f"unknown key '{key}'{did_you_mean(str(key), names)}; allowed keys: {', '.join(names)}")


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
        strategy = entry.item
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
    for section in BUILTIN_SECTIONS:
        if section.schema_edit is not None:
            section.schema_edit(definitions)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "compressor recipe", **schema}
