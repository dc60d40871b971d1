"""`compress eval TARGET`: perplexity, KL to a reference model, and lm-eval tasks, of a finished
run or any model.

For a run folder the defaults come from the run itself: the pruned model in `model/`, the
original model of its recipe as the reference, and its recipe's evaluation windows and lm-eval
suites. Any model (a local folder or a hub id) can be evaluated too, alone or against
`--reference`. The figures are those of a run's report (`EvalReport`): `metrics.baseline` (the reference)
and `metrics.pruned` (the evaluated model; `kl` when there is a reference; `tasks` for lm-eval).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import PretrainedConfig

import compressor
from compressor.engine.bases import BASES_FILE, READERS_FILE, apply_bases, load_bases
from compressor.errors import UserError
from compressor.evaluation.harness import check_suites
from compressor.evaluation.metrics import TaskOptions, evaluate_models
from compressor.evaluation.throughput import compare_speed, cost_note, measure, model_size, report_settings
from compressor.models.families import ModelFamily
from compressor.models.stock import to_stock
from compressor.plan.checks import plan as plan_run
from compressor.recipe.paths import resolve_model_path
from compressor.recipe.schema import Recipe, load_recipe
from compressor.recipe.sections.data import DataSpec, check_data
from compressor.recipe.sections.evaluation import LmEvalSpec, check_lm_eval
from compressor.recipe.sections.model import DTYPES, ModelSpec
from compressor.reports.report_model import Environment, EvalReport, Metrics, Sizes
from compressor.runtime.loading import load_model, load_tokenizer, resolve_device, token_batches
from compressor.runtime.staging import RUN_MARKER
from compressor.runtime.threads import use_threads
from compressor.stages.formats import saved_format
from compressor.strategies.registry import PluginRegistry
from compressor.validation import replaced

DEFAULT_WINDOWS = DataSpec(dataset={}, num_samples=64, seq_len=512, batch_size=8)


@dataclass(frozen=True)
class EvalRequest:
    """What the command line asked for; None means the run's (or the default) value."""

    target: str
    reference: str | None = None
    data: str | None = None
    text_field: str | None = None
    num_samples: int | None = None
    seq_len: int | None = None
    batch_size: int | None = None
    dtype: str | None = None
    device: str = "auto"
    tasks: tuple[str, ...] = ()
    """lm-eval tasks (names or YAML files); given, they replace a run's own suites."""
    include_path: str | None = None
    num_fewshot: int | None = None
    limit: float | None = None
    task_batch_size: int = 8
    apply_chat_template: bool = False
    throughput: bool | None = None
    """None: a run's own `evaluation.throughput`, else measured."""
    threads: int | None = None
    """torch's CPU threads; None: as the caller set them (the command line: `runtime.threads.command_threads`)."""


def _model_spec(path: str, dtype: str) -> ModelSpec:
    folder = Path(path).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise UserError(_not_a_target(folder))
    return ModelSpec(path=resolve_model_path(path, Path.cwd(), "relative to the current folder"), dtype=dtype)


def _not_a_target(folder: Path) -> str:
    """What a folder that is neither a run nor a model is, and what `compress eval` would take."""
    runs = sorted(child.name for child in folder.iterdir() if (child / RUN_MARKER).is_file())
    if runs:
        return (
            f"{folder} is not a run folder (no {RUN_MARKER}) but holds {len(runs)} run(s): evaluate one "
            f"(compress eval {folder / runs[0]}) or tabulate them (compress compare {folder}/*)"
        )
    return (
        f"{folder} is neither a run folder (no {RUN_MARKER}) nor a model folder (no config.json): give a run's "
        f"output folder, a saved model's folder or a hub id"
    )


@dataclass(frozen=True)
class EvalPlan:
    target: ModelSpec
    reference: ModelSpec | None
    data: DataSpec | None
    """None: no perplexity or KL, only lm-eval tasks."""
    suites: list[LmEvalSpec]
    rebuild: tuple[Path, ModelFamily] | None = None
    """For a run folder without model/: its bases file and family, applied to the original."""
    seed: int = 0
    """A run's seed (lm-eval's few-shot sampling and generation use it), as in the run."""
    throughput: bool = True
    stock: PretrainedConfig | None = None
    """A rebuilt global-layout run: the original's config, for the stock conversion."""


def _suites(request: EvalRequest, recipe_suites: list[LmEvalSpec] | None) -> list[LmEvalSpec]:
    if not request.tasks:
        return list(recipe_suites or [])
    spec = LmEvalSpec(
        tasks=list(request.tasks),
        include_path=request.include_path,
        num_fewshot=request.num_fewshot,
        limit=request.limit,
        batch_size=request.task_batch_size,
        apply_chat_template=request.apply_chat_template,
    )
    return [check_lm_eval(spec, "--tasks", Path.cwd())]


def _rebuilt_from_bases(
    folder: Path, recipe: Recipe, registry: PluginRegistry
) -> tuple[tuple[Path, ModelFamily], PretrainedConfig | None]:
    """A run that kept only its bases: where they are and the family that rebuilds the model from
    the original, and the original class's config where it saved one basis (None: per site)."""
    checked = plan_run(dataclasses.replace(recipe, evaluation=None), registry)
    rebuild = (folder / BASES_FILE, checked.layout.family)
    if not checked.layout.one_basis:
        return rebuild, None
    if checked.layout.tie_head:
        raise UserError(
            f"{folder} kept no model/, and its tied head's scale was fitted on the run's own "
            f"statistics, which only model/ holds; rerun it with the sweep's save_models: true"
        )
    return rebuild, checked.layout.config


def _windows(request: EvalRequest, data: DataSpec | None) -> DataSpec | None:
    """The evaluation windows: the run's, or `--data`'s, with the command line's overrides, checked."""
    if request.data is not None:
        data = dataclasses.replace(
            data or DEFAULT_WINDOWS, dataset={"path": "json", "data_files": request.data}, format="text"
        )
    if data is None:
        return None
    overrides = {
        key: getattr(request, key)
        for key in ("text_field", "num_samples", "seq_len", "batch_size")
        if getattr(request, key) is not None
    }
    return check_data(replaced(data, "evaluation.", **overrides), "evaluation", Path.cwd())


def _plan(request: EvalRequest, registry: PluginRegistry) -> EvalPlan:
    """The model to evaluate, the reference (if any), the evaluation windows and task suites."""
    if request.dtype is not None and request.dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got '{request.dtype}'")
    folder = Path(request.target)
    data: DataSpec | None = None
    recipe_suites: list[LmEvalSpec] | None = None
    rebuild: tuple[Path, ModelFamily] | None = None
    seed, throughput, stock = 0, True, None
    if (folder / RUN_MARKER).is_file():
        has_model, has_bases = (folder / "model").is_dir(), (folder / BASES_FILE).is_file()
        if not (folder / "recipe.yaml").is_file() or not (has_model or has_bases):
            raise UserError(
                f"{folder} holds a report but no recipe.yaml and model/ (or {BASES_FILE}): not a complete run folder"
            )
        recipe = load_recipe(folder / "recipe.yaml", registry)
        dtype = request.dtype or recipe.model.dtype
        if has_model:  # a heterogeneous run's model/ is DeciLM with modelling code the run itself wrote
            saved = saved_format(json.loads((folder / "model" / "config.json").read_text()))
            own_code = recipe.model.trust_remote_code or saved.own_code
            target = dataclasses.replace(
                recipe.model,
                path=str((folder / "model").resolve()),
                revision=None,
                dtype=dtype,
                load="memory",
                trust_remote_code=own_code,
            )
        else:  # a sweep's run keeps only its bases: the pruned model is rebuilt from the original
            target = dataclasses.replace(recipe.model, dtype=dtype, load="memory")
            rebuild, stock = _rebuilt_from_bases(folder, recipe, registry)
        # `compress eval` runs whole models: a run streamed for its walk is evaluated from memory here
        reference = dataclasses.replace(recipe.model, dtype=dtype, load="memory") if request.reference is None else None
        data = recipe.evaluation
        recipe_suites = recipe.evaluation.lm_eval if recipe.evaluation else None
        seed, throughput = recipe.seed, recipe.evaluation.throughput if recipe.evaluation else True
    else:
        dtype = request.dtype or "float32"
        target = _model_spec(request.target, dtype)
        reference = None
    if request.reference is not None:
        reference = _model_spec(request.reference, dtype)
    suites = _suites(request, recipe_suites)
    data = _windows(request, data)
    if data is None and not suites:
        raise UserError(
            f"nothing to evaluate for {request.target}: pass --data FILE.jsonl (one JSON object per line, "
            f"with a text field) and/or --tasks"
        )
    if request.throughput is not None:
        throughput = request.throughput
    return EvalPlan(target, reference, data, suites, rebuild, seed, throughput, stock)


def evaluate_target(request: EvalRequest, progress: Callable[[str, int, int], None] | None = None) -> EvalReport:
    """Evaluate as `request` says; return the report (the CLI prints it and may write it)."""
    report_progress = progress or (lambda *_: None)
    started = time.perf_counter()
    plan = _plan(request, PluginRegistry())
    device = resolve_device(request.device)
    if request.threads is not None:  # else the caller's count (the command line's)
        use_threads(request.threads)
    check_suites(plan.suites)
    report_progress("tokenising data", 0, 1)
    tokenizer = load_tokenizer(plan.target)
    batches = token_batches(plan.data, tokenizer, "evaluation") if plan.data is not None else None
    report_progress("loading models", 0, 1)
    target = load_model(plan.target)
    if plan.rebuild is not None:
        report_progress("rebuilding the pruned model from its bases", 0, 1)
        readers = plan.rebuild[0].with_name(READERS_FILE)
        target = apply_bases(
            target,
            plan.rebuild[1],
            load_bases(plan.rebuild[0]),
            device,
            load_bases(readers) if readers.is_file() else None,
            keep_tied=False if plan.stock is not None else None,
        )
        if plan.stock is not None:  # a global layout's model is the original class (its head untied)
            target = to_stock(target, plan.rebuild[1], plan.stock)[0]
    target = target.to(device)
    reference = load_model(plan.reference).to(device) if plan.reference is not None else None
    metrics = evaluate_models(
        reference, target, batches, device, report_progress, TaskOptions(plan.suites, tokenizer, plan.seed)
    )
    sizes = {"pruned": model_size(target), **({"baseline": model_size(reference)} if reference is not None else {})}
    speed = None
    if plan.throughput:
        settings = report_settings([target] if reference is None else [reference, target])
        report_progress(f"measuring throughput ({cost_note(settings)})", 0, 1)
        if reference is None:
            speed = {"pruned": measure(target, device, **settings)}
        else:
            speed = compare_speed(reference, target, device, **settings)
    return EvalReport(
        compressor=compressor.__version__,
        target=plan.target.path if plan.rebuild is None else f"{request.target} (rebuilt from {BASES_FILE})",
        size=Sizes.model_validate(sizes),
        speed=speed,
        reference=plan.reference.path if plan.reference is not None else None,
        evaluation=dataclasses.asdict(plan.data) if plan.data is not None else None,
        metrics=Metrics.model_validate(metrics),
        timings={"eval_s": time.perf_counter() - started},
        environment=Environment.here(device),
    )
