"""`compress sweep SWEEP.yaml`: a grid of runs over one base recipe, with what they share done once.

    base: ref_llama_sens.yaml          # a recipe, relative to this file
    output: ../runs/sweep              # relative to this file
    set: {evaluation.num_samples: 64}  # optional: changes to the base for every run
    grid:                              # dotted recipe keys (as --set), each with its values
      sparsity: [0.2, 0.3]
      pipeline: [[{strategy: pca}], [{strategy: sensitivity}, {strategy: stiefel, steps: 20}]]
    save_models: false                 # keep each run's model/ (the bases are always kept)

Relative paths in `set` and `grid` values (data files, task files) resolve against the base
recipe's folder, as they would written in the base recipe itself.

Every combination of the grid is a run (`<output>/runs/NNN`, a normal run folder, numbered in grid
order) checked before any work starts. When the grid is edited (a value inserted), finished runs
are matched to the new points by recipe and renamed, not recomputed; runs that no longer belong
to the grid move to `<output>/previous/`. The runs share, through `SharedResources`: the tokenizer and the tokenised
windows, the loaded original model (each run prunes a copy), H for each (model, calibration
data, H options, seed), and the original model's lm-eval scores. H and the scores are also kept
under `<output>/shared/`, so a sweep that was interrupted continues where it stopped: finished
runs are kept (when their recipe is unchanged), an interrupted run resumes from its checkpoint,
and nothing shared is computed twice. Results go to `results.{csv,json,md}` and PNG plots. In
the results, `prune s` is each run's own work and `shared s` the loading, tokenising and H that
the first run needing them did for all; `results.md` ends with a warning where the runs were
evaluated on different data (a grid over `evaluation.*`), whose KL and perplexity do not compare.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from compressor.commands.compare import compare_runs, read_report, render
from compressor.data.batches import Batch
from compressor.engine.checkpoint import json_digest, write_atomic
from compressor.errors import UserError
from compressor.plan.checks import check_device_settings, plan
from compressor.recipe.reading import assign, read_yaml
from compressor.recipe.schema import Recipe, load_recipe, validate
from compressor.recipe.sections.data import DataSpec
from compressor.recipe.sections.model import ModelSpec
from compressor.run.runner import RunOptions, run
from compressor.runtime.loading import Resources, resolve_device
from compressor.runtime.resume import interrupted_with_another_recipe
from compressor.runtime.staging import RUN_MARKER
from compressor.stages.order import run_order
from compressor.strategies.registry import PluginRegistry
from compressor.validation import shown

SWEEP_MARKER = "sweep.yaml"
"""A folder holding this file was written by a sweep (the sweep file as it was run)."""
KEYS = ("base", "output", "grid", "set", "save_models")
RESULT_FILES = ("results.csv", "results.json", "results.md")
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Point:
    """One run of the grid: its folder name, the grid values it takes, and its recipe."""

    name: str
    values: dict[str, Any]
    recipe: Recipe


@dataclass(frozen=True)
class Sweep:
    file: Path
    output: Path
    grid: dict[str, list[Any]]
    points: list[Point]
    save_models: bool


def load_sweep(path: Path, registry: PluginRegistry) -> Sweep:
    """Read and check a sweep file and every recipe of its grid; load no weights."""
    raw = read_yaml(path, "sweep")
    if not isinstance(raw, dict):
        raise UserError(f"sweep {path} must be a mapping with keys {', '.join(KEYS)}")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise UserError(f"unknown key '{unknown[0]}' in sweep {path}; allowed keys: {', '.join(KEYS)}")
    for key in ("base", "output", "grid"):
        if key not in raw:
            raise UserError(f"missing key '{key}' in sweep {path}")
    folder = path.resolve().parent
    grid, fixed = raw["grid"], raw.get("set") or {}
    if not isinstance(grid, dict) or not grid:
        raise UserError("grid must map dotted recipe keys to lists of values, e.g. {sparsity: [0.2, 0.3]}")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise UserError(f"grid.{key} must be a non-empty list of values, got {shown(values)}")
    if not isinstance(fixed, dict):
        raise UserError(f"set must map dotted recipe keys to values, got {shown(fixed)}")
    if not isinstance(raw.get("save_models", False), bool):
        raise UserError(f"save_models must be true or false, got {shown(raw['save_models'])}")
    base_path = folder / str(raw["base"])
    base = read_yaml(base_path, "base recipe")
    if not isinstance(base, dict):
        raise UserError(f"base recipe {base_path} must be a YAML mapping")
    output = (folder / str(raw["output"])).resolve()
    points = []
    combinations = list(itertools.product(*grid.values()))
    width = max(3, len(str(len(combinations) - 1)))
    for index, combination in enumerate(combinations):
        values = dict(zip(grid, combination))
        point_raw = copy.deepcopy(base)
        for key, value in [*fixed.items(), *values.items()]:
            assign(point_raw, key, copy.deepcopy(value), "sweep: ")
        name = f"{index:0{width}d}"
        point_raw["output"] = str(output / "runs" / name)
        try:
            recipe = validate(point_raw, base_path.resolve().parent, registry)
        except UserError as error:
            where = ", ".join(f"{k}={json.dumps(v)}" for k, v in values.items())
            raise UserError(f"sweep run {name} ({where}): {error}") from None
        points.append(Point(name, values, recipe))
    save_models = bool(raw.get("save_models", False))
    pruned_mlp = next((p for p in points if p.recipe.mlp is not None), None)
    if pruned_mlp is not None and not save_models:
        raise UserError(
            f"sweep run {pruned_mlp.name} prunes the MLP (mlp), whose pruned MLPs bases.safetensors cannot "
            f"rebuild; set save_models: true in the sweep"
        )
    return Sweep(path, output, dict(grid), points, save_models)


def check_output(sweep: Sweep) -> None:
    """The output may be new, empty, or an earlier sweep's (which this one continues)."""
    out = sweep.output
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / SWEEP_MARKER).is_file())):
        raise UserError(f"sweep output {out} exists and is not an earlier sweep's folder; choose another output")


class SharedResources(Resources):
    """What a sweep's runs share, loaded or computed once: in memory for this process, and H and
    the original model's task scores also on disk (`folder`), for a sweep that is continued."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._tokenizers: dict[str, Any] = {}
        self._batches: dict[str, list[Batch]] = {}
        self._models: dict[str, PreTrainedModel] = {}
        self._fisher: dict[str, dict[str, torch.Tensor]] = {}

    def tokenizer(self, spec: ModelSpec) -> Any:
        key = json_digest(dataclasses.asdict(spec))
        if key not in self._tokenizers:
            self._tokenizers[key] = super().tokenizer(spec)
        return self._tokenizers[key]

    def batches(self, spec: DataSpec, tokenizer: Any, where: str) -> list[Batch]:
        key = json_digest({"data": dataclasses.asdict(spec), "tokenizer": id(tokenizer)})
        if key not in self._batches:
            self._batches[key] = super().batches(spec, tokenizer, where)
        return self._batches[key]

    def whole_model(self, spec: ModelSpec) -> PreTrainedModel:
        """A streamed sweep keeps no whole original between its runs: loaded each time it is needed."""
        if spec.load == "stream":
            return Resources().whole_model(spec)
        return super().whole_model(spec)

    def model(self, spec: ModelSpec) -> PreTrainedModel:
        if spec.load == "stream":  # a shell is cheap to build, and its open shards are not copied
            return super().model(spec)
        key = json_digest(dataclasses.asdict(spec))
        if key not in self._models:
            self._models[key] = super().model(spec)
        return copy.deepcopy(self._models[key])

    def fisher(self, key: str) -> dict[str, torch.Tensor] | None:
        from safetensors import safe_open

        path = self.folder / f"fisher-{key[:16]}.safetensors"
        if key not in self._fisher and path.is_file():
            with safe_open(str(path), framework="pt") as handle:
                self._fisher[key] = {site: handle.get_tensor(site) for site in handle.keys()}
        kept = self._fisher.get(key)
        return None if kept is None else {site: h.clone() for site, h in kept.items()}  # a plugin may edit its H

    def keep_fisher(self, key: str, fisher: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        if key in self._fisher:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        tensors = {site: h.detach().cpu().contiguous() for site, h in fisher.items()}
        self._fisher[key] = tensors  # read now: H the walk left in its checkpoint goes with that checkpoint
        write_atomic(self.folder / f"fisher-{key[:16]}.safetensors", lambda p: save_file(tensors, str(p)))

    def baseline_tasks(self, key: str) -> dict[str, Any] | None:
        path = self.folder / f"tasks-{key[:16]}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def keep_baseline_tasks(self, key: str, scores: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomic(self.folder / f"tasks-{key[:16]}.json", lambda p: p.write_text(json.dumps(scores, indent=2)))


_MEMORY_ONLY = ("output", "activations")


def _comparable(recipe: dict[str, Any]) -> dict[str, Any]:
    """A recipe as saved, without what does not change a run's results (output, memory settings)."""
    values = {k: v for k, v in recipe.items() if k not in _MEMORY_ONLY}
    values["sensitivity"] = {
        k: v for k, v in (values.get("sensitivity") or {}).items() if k not in ("chunk", "recompute")
    }
    return values


def _finished(point: Point, save_models: bool, registry: PluginRegistry) -> bool:
    """A published run folder of this point whose recipe equals the point's in every key that
    decides a result (model, data, pipeline, evaluation, ...; read with today's defaults filled
    in), with its model if models are kept."""
    folder = Path(point.recipe.output)
    if not (folder / RUN_MARKER).is_file() or not (folder / "recipe.yaml").is_file():
        return False
    if save_models and not (folder / "model").is_dir():
        return False
    try:
        saved = load_recipe(folder / "recipe.yaml", registry)
        read_report(folder)
    except (UserError, OSError):
        return False
    return _comparable(saved.to_dict()) == _comparable(point.recipe.to_dict())


PREVIOUS_FOLDER = "previous"
"""Where earlier run folders that no point of the current grid matches are kept (never deleted)."""


def _rearrange(sweep: Sweep, registry: PluginRegistry) -> list[str]:
    """Give each point the finished run folder that holds its recipe, wherever an earlier grid
    put it (runs are numbered by position, so inserting a value shifts them); folders no point
    matches move to `<output>/previous/`. Returns what moved, for the log."""
    runs = sweep.output / "runs"
    if not runs.is_dir():
        return []
    wanted = {p.name: p for p in sweep.points}
    misplaced = [
        f
        for f in sorted(runs.iterdir())
        if f.is_dir()
        and not f.name.startswith(".")
        and (f / RUN_MARKER).is_file()
        and not (f.name in wanted and _finished(wanted[f.name], sweep.save_models, registry))
    ]
    if not misplaced:
        return []
    holding = runs / ".rearranging"
    holding.mkdir(exist_ok=True)
    for folder in misplaced:
        folder.rename(holding / folder.name)
    moves = []
    for point in sweep.points:
        if (runs / point.name).exists():
            continue
        for folder in sorted(holding.iterdir()):
            probe = dataclasses.replace(point, recipe=dataclasses.replace(point.recipe, output=str(folder)))
            if _finished(probe, sweep.save_models, registry):
                folder.rename(runs / point.name)
                moves.append(f"runs/{folder.name} -> runs/{point.name}")
                break
    leftovers = sorted(holding.iterdir())
    if leftovers:
        previous = sweep.output / PREVIOUS_FOLDER
        previous.mkdir(exist_ok=True)
        for folder in leftovers:
            target = previous / folder.name
            suffix = 1
            while target.exists():
                target, suffix = previous / f"{folder.name}-{suffix}", suffix + 1
            folder.rename(target)
            moves.append(f"runs/{folder.name} -> {PREVIOUS_FOLDER}/{target.name} (no longer in the grid)")
    holding.rmdir()
    return moves


def results(finished: list[Point]) -> list[dict[str, Any]]:
    """One row per finished run: `compress compare`'s columns and the run's grid values (its
    other differing settings too, but not again the dotted keys under a grid key)."""
    return results_and_warnings(finished)[0]


def warnings(finished: list[Point]) -> list[str]:
    """`compress compare`'s warnings for the finished runs (e.g. a grid over the evaluation
    windows makes their KL and perplexity incomparable)."""
    return results_and_warnings(finished)[1]


def results_and_warnings(finished: list[Point]) -> tuple[list[dict[str, Any]], list[str]]:
    """`results` and `warnings`, each run's report and recipe read once."""
    table, notes = compare_runs(
        [Path(p.recipe.output) for p in finished], shown=list(finished[0].values) if finished else ()
    )
    for row, point in zip(table, finished):
        for key, value in point.values.items():
            row.setdefault(key, value if not isinstance(value, (list, dict)) else json.dumps(value))
    return table, notes


def write_results(sweep: Sweep, table: list[dict[str, Any]], notes: list[str] | None = None) -> None:
    """results.{csv,json,md}; `notes` (`warnings`) go under the Markdown table."""
    for name in RESULT_FILES:
        text = render(table, Path(name).suffix, notes or ())
        write_atomic(sweep.output / name, lambda p, text=text: p.write_text(text))


def run_sweep(
    sweep: Sweep, registry: PluginRegistry, progress: Progress | None = None, restart: bool = False
) -> dict[str, Any]:
    """Run every point not finished yet; write the results and plots; return a summary. If a
    point fails, the tables still list every finished point before the error goes up."""
    report = progress or (lambda *_: None)
    shared = _prepared(sweep, registry, restart, report)
    finished = {p.name for p in sweep.points if _finished(p, sweep.save_models, registry)}

    def done() -> list[Point]:
        return [p for p in sweep.points if p.name in finished]

    ran, computed = [], 0
    try:
        for position, point in enumerate(sweep.points):
            label = f"run {position + 1}/{len(sweep.points)} ({point.name})"
            if not restart and point.name in finished:
                report(f"{label}: finished earlier", position, len(sweep.points))
                continue
            # the point's interrupted run was started with another recipe (the grid was edited since):
            # its checkpoint is discarded for this point only, instead of refusing the whole sweep
            stale = interrupted_with_another_recipe(Path(point.recipe.output), point.recipe)
            result = run(
                point.recipe,
                registry,
                lambda phase, d, t, label=label: report(f"{label}: {phase}", d, t),
                overwrite=True,
                restart=restart or stale,
                options=RunOptions(resources=shared, save_model=sweep.save_models),
            )
            ran.append(point.name)
            finished.add(point.name)
            computed += result is not None and result.fisher_source == "computed"
            write_results(sweep, *results_and_warnings(done()))
    except BaseException:
        if done():
            write_results(sweep, *results_and_warnings(done()))
        raise
    table, notes = results_and_warnings(done())
    write_results(sweep, table, notes)
    report("plotting", 0, 1)
    plots = _plots(sweep, table, done())
    return {
        "output": str(sweep.output),
        "runs": len(table),
        "ran": ran,
        "fisher_computed": computed,
        "plots": [str(p) for p in plots],
        "table": table,
        "warnings": notes,
    }


def _prepared(sweep: Sweep, registry: PluginRegistry, restart: bool, report: Progress) -> SharedResources:
    """The sweep checked and its folder made, marked with its file; the data and H its runs share,
    an earlier run's kept where the grid moved it (`_rearrange`) unless `restart`."""
    check(sweep, registry)
    sweep.output.mkdir(parents=True, exist_ok=True)
    write_atomic(sweep.output / SWEEP_MARKER, lambda p: p.write_text(sweep.file.read_text()))
    shared = SharedResources(sweep.output / "shared")
    if restart:
        shutil.rmtree(shared.folder, ignore_errors=True)
    else:
        for move in _rearrange(sweep, registry):
            report(f"kept an earlier run: {move}", 0, 1)
    return shared


def _plots(sweep: Sweep, table: list[dict[str, Any]], done: list[Point]) -> list[Path]:
    """The sweep's plots of its finished points (matplotlib imported only here)."""
    from compressor.evaluation.plots import sweep_plots

    reports = [read_report(Path(p.recipe.output)) for p in done]
    return sweep_plots(
        table,
        [[site.model_dump(exclude_unset=True) for site in r.sites] for r in reports],
        [r.distillation.curve if r.distillation is not None else [] for r in reports],
        list(sweep.grid),
        sweep.output,
    )


def check(sweep: Sweep, registry: PluginRegistry) -> None:
    """What `compress run --dry-run` checks, for every point (configs, families, widths, task
    names), and the output folder; loads no weights."""
    check_output(sweep)
    for point in sweep.points:
        try:
            plan(point.recipe, registry)
            _check_device_settings(point.recipe, sweep.save_models, registry)
        except UserError as error:
            raise UserError(f"sweep run {point.name}: {error}") from None


def _check_device_settings(recipe: Recipe, save_model: bool, registry: PluginRegistry) -> None:
    """What the run would refuse on its device at the start of this point (a sweep of GPU runs
    checked on a machine without one: the device's own checks wait for it)."""
    try:
        device = resolve_device(recipe.device)
    except UserError:
        return
    check_device_settings(recipe, device, save_model, run_order(registry.stages()))


def dump(sweep: Sweep) -> str:
    """One line per run: its folder name and grid values, for the dry-run listing."""
    return "".join(
        f"  {p.name}: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in p.values.items()) + "\n" for p in sweep.points
    )
