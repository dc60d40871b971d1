"""The `evaluation` section: perplexity and KL windows, lm-eval suites, placement."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import StrictBool, StrictInt, StrictStr

from compressor.errors import UserError
from compressor.recipe.paths import resolve_path
from compressor.recipe.sections.contract import Section, SectionContext
from compressor.recipe.sections.data import DataSpec, check_data
from compressor.validation import FORBID, Number, described, options

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe


DeviceMap = Literal["auto", "balanced", "balanced_low_0", "sequential"]


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


def one_suite_as_list(value: Any) -> Any:
    """One lm-eval suite may be written without the list around it."""
    if isinstance(value, dict) and isinstance(value.get("lm_eval"), dict):
        value = {**value, "lm_eval": [value["lm_eval"]]}
    return value


def one_suite_in_schema(definitions: dict[str, Any]) -> None:
    suites = definitions["EvaluationSpec"]["properties"]["lm_eval"]  # one suite may be written without the list
    suites["anyOf"].insert(1, {"$ref": "#/$defs/LmEvalSpec"})


def _check(spec: EvaluationSpec, recipe: Recipe, context: SectionContext) -> EvaluationSpec:
    return check_evaluation(spec, "evaluation", context.base)


SECTION = Section(
    "evaluation",
    EvaluationSpec,
    _check,
    shorthand=one_suite_as_list,
    schema_edit=one_suite_in_schema,
)
