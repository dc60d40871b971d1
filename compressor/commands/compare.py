"""`compress compare RUN...`: finished run folders side by side, for ablations.

Reads each run's `report.json` and makes one row per run. A pipeline is shown as its chain of
strategies, with the options in which the compared runs differ (so two ablation runs never
look alike) and whether the bases were refined on the KL after the walk, and the table can be
written as Markdown, CSV or JSON. Time is split so that a sweep's first run does not look slow:
`prune s` is the run's own work, `shared s` what runs can share (tokenising, loading, computing H).
Every recipe setting in which the runs differ gets a column, and `warnings_for` says when
the runs were not evaluated alike (their KL and perplexity are then not comparable).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from compressor.errors import UserError
from compressor.recipe.reading import dotted, parse_yaml
from compressor.reports.report_model import Metrics, RunReport
from compressor.runtime.staging import RUN_MARKER

COLUMNS = (
    "run",
    "model",
    "pipeline",
    "sparsity",
    "kept",
    "params",
    "baseline ppl",
    "pruned ppl",
    "KL",
    "prune s",
    "shared s",
    "seed",
)
FORMATS = (".md", ".csv", ".json")
SHARED_TIMINGS = ("data_s", "load_s", "fisher_s")
"""Work a sweep's runs share (done by whichever run needs it first): tokenising, loading, H."""
SHOWN_SETTINGS = ("output", "sparsity", "seed", "pipeline")
"""Recipe keys never given a settings column: the output always differs, the rest have columns."""
EVALUATION_DATA = ("dataset", "num_samples", "seq_len", "format", "text_field", "messages_field")
"""The `evaluation` settings that decide the windows the KL and perplexity are measured on."""
PPL_TOLERANCE = 1e-4
"""Relative difference of baseline perplexities beyond float noise (same model, same windows)."""


def read_report(folder: Path) -> RunReport:
    path = folder / RUN_MARKER
    if not path.is_file():
        raise UserError(f"{folder} is not a finished run (no {RUN_MARKER}); give run folders written by compress run")
    return RunReport.read(path)


def _labels(reports: list[RunReport]) -> list[str]:
    """Each run's chain of strategies with the options that differ between the runs that use the
    same strategy at that step."""
    pipelines = [r.pipeline for r in reports]
    labels = []
    for steps in pipelines:
        parts = []
        for position, step in enumerate(steps):
            others = [
                p[position].options for p in pipelines if len(p) > position and p[position].strategy == step.strategy
            ]
            parts.append(step.strategy + _differing(step.options, others))
        labels.append(" + ".join(parts))
    return [label + _extras(report, reports) for label, report in zip(labels, reports)]


def _differing(own: dict[str, Any], others: list[dict[str, Any]]) -> str:
    """`key=value` for the entries of `own` that some of `others` lack or set differently."""
    varying = [
        f"{key}={json.dumps(value)}" for key, value in own.items() if any(other.get(key) != value for other in others)
    ]
    return f"({', '.join(varying)})" if varying else ""


def _extras(report: RunReport, reports: list[RunReport]) -> str:
    """What a run did besides its strategies: corrected readers, refinement on the KL and
    distillation (each with the settings that differ between runs that did it), or either rejected."""
    text = " + corrected readers" if report.slicing.correct_readers else ""
    refinement = report.refinement
    if refinement is not None:
        others = [r.refinement.options for r in reports if r.refinement is not None]
        settings = _differing(refinement.options, others)
        text += f" → refined on KL{settings}" if refinement.kept == "refined" else f" → refinement{settings} rejected"
    distillation = report.distillation
    if distillation is not None:
        others = [r.distillation.options for r in reports if r.distillation is not None]
        settings = _differing({k: v for k, v in distillation.options.items() if k != "dataset"}, others)
        text += (
            f" → distilled ({distillation.method}, {distillation.tokens / 1e6:.3g}M tokens){settings}"
            if distillation.kept == "distilled"
            else f" → distillation{settings} rejected"
        )
    return text


def primary_metric(scores: dict[str, Any]) -> str | None:
    """The score a table shows for a task: acc_norm where the task has it (as the paper reports),
    else acc, else its first metric."""
    metrics = [m for m in scores if not m.endswith("_stderr") and m != "samples"]
    for preferred in ("acc_norm", "acc"):
        if preferred in metrics:
            return preferred
    return metrics[0] if metrics else None


def task_cells(metrics: Metrics) -> dict[str, Any]:
    """`<task> <metric>` (pruned) and `dense <task> <metric>` columns, one metric per task."""
    cells: dict[str, Any] = {}
    baseline = (metrics.baseline.tasks if metrics.baseline is not None else None) or {}
    pruned = (metrics.pruned.tasks if metrics.pruned is not None else None) or {}
    for task, scores in pruned.items():
        metric = primary_metric(scores)
        if metric is not None:
            cells[f"{task} {metric}"] = scores.get(metric)
            cells[f"dense {task} {metric}"] = baseline.get(task, {}).get(metric)
    return cells


def columns(table: list[dict[str, Any]]) -> list[str]:
    """The fixed columns, then any others (task scores, a sweep's varied keys) in order of appearance."""
    extra = []
    for row in table:
        extra += [key for key in row if key not in COLUMNS and key not in extra]
    return [*COLUMNS, *extra]


def read_recipe(folder: Path) -> dict[str, Any] | None:
    """The recipe a run saved (`recipe.yaml`, read as recipes are), or None for a run folder
    without a readable one."""
    try:
        recipe = parse_yaml((folder / "recipe.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return recipe if isinstance(recipe, dict) else None


def _compact(value: Any) -> Any:
    """A setting as a table cell: scalars as they are, lists, mappings and null as compact JSON."""
    if value is None or isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return value


def _covered(key: str, shown: Iterable[str]) -> bool:
    return any(key == name or key.startswith(f"{name}.") for name in shown)


def differing_settings(recipes: list[dict[str, Any] | None], shown: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Per run, the dotted recipe keys in which the runs differ, so no setting that sets two runs
    apart is left out of the table. A section set in some runs and null in others is one column
    (`set` / `null`), not one per key inside it; a key some runs lack (a section they leave
    null, a key older recipes did not have) differs only where the runs that have it disagree.
    Keys with their own column (`SHOWN_SETTINGS`) or under `shown` are skipped; runs without a
    saved recipe get no settings."""
    flats = [dotted(recipe) if recipe is not None else None for recipe in recipes]
    known = [flat for flat in flats if flat is not None]
    keys = [
        key
        for key in dict.fromkeys(key for flat in known for key in flat)
        if not _covered(key, (*SHOWN_SETTINGS, *shown))
    ]
    sections = [key for key in keys if _toggled(key, known)]
    varying = [
        key for key in keys if key not in sections and len(_distinct([flat[key] for flat in known if key in flat])) > 1
    ]
    columns = list(dict.fromkeys(sections + varying))
    return [
        {} if flat is None else {key: _setting_cell(key, flat, key in sections) for key in columns} for flat in flats
    ]


def _toggled(key: str, flats: list[dict[str, Any]]) -> bool:
    """Whether `key` is a section that some runs set and others leave null."""
    return any(flat.get(key, 0) is None for flat in flats) and any(
        other.startswith(f"{key}.") for flat in flats for other in flat
    )


def _setting_cell(key: str, flat: dict[str, Any], section: bool) -> Any:
    if section:
        return "set" if any(other.startswith(f"{key}.") for other in flat) else "null"
    return _compact(flat.get(key))


def _distinct(values: list[Any]) -> list[Any]:
    """`values` without repeats, in order (JSON-equal values are one)."""
    seen: dict[str, Any] = {}
    for value in values:
        seen.setdefault(json.dumps(value, sort_keys=True), value)
    return list(seen.values())


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _baseline_ppls(reports: list[RunReport]) -> list[float]:
    """The distinct baseline perplexities of the runs that were evaluated, beyond float noise."""
    distinct: list[float] = []
    for report in reports:
        baseline = report.metrics.baseline
        ppl = baseline.ppl if baseline is not None else None
        if ppl is not None and not any(math.isclose(ppl, p, rel_tol=PPL_TOLERANCE) for p in distinct):
            distinct.append(float(ppl))
    return distinct


def evaluation_differences(reports: list[RunReport], recipes: list[dict[str, Any] | None]) -> list[str]:
    """What sets the evaluated runs' KL and perplexity apart besides the pruning: differing
    evaluation data settings, and a differing baseline perplexity of the same original model."""
    evaluated = [(report, recipe) for report, recipe in zip(reports, recipes) if report.metrics.baseline is not None]
    saved = [
        dotted({key: recipe["evaluation"].get(key) for key in EVALUATION_DATA}, "evaluation.")
        for _, recipe in evaluated
        if recipe is not None and isinstance(recipe.get("evaluation"), dict)
    ]
    found = []
    for key in dict.fromkeys(key for flat in saved for key in flat):
        values = _distinct([flat[key] for flat in saved if key in flat])  # a key older recipes lack is no difference
        if len(values) > 1:
            found.append(f"{key} " + " vs ".join(_shown(v) for v in values))
    models = {report.model.path for report, _ in evaluated}
    ppls = _baseline_ppls([report for report, _ in evaluated])
    if len(models) == 1 and len(ppls) > 1:
        found.append("baseline perplexity " + " vs ".join(f"{p:.3f}" for p in ppls))
    return found


def task_differences(reports: list[RunReport], recipes: list[dict[str, Any] | None]) -> list[str]:
    """Settings that change lm-eval scores (the task suites, the seed of few-shot sampling) where
    they differ between runs that have task scores."""
    scored = [
        recipe
        for report, recipe in zip(reports, recipes)
        if recipe is not None and report.metrics.pruned is not None and report.metrics.pruned.tasks
    ]
    found = []
    suites = _distinct([(recipe.get("evaluation") or {}).get("lm_eval") for recipe in scored])
    if len(suites) > 1:
        found.append("evaluation.lm_eval " + " vs ".join(_shown(s) for s in suites))
    seeds = _distinct([recipe.get("seed") for recipe in scored])
    if len(seeds) > 1:
        found.append("seed " + " vs ".join(_shown(s) for s in seeds))
    return found


def warnings_for(reports: list[RunReport], recipes: list[dict[str, Any] | None]) -> list[str]:
    """One line per kind of incomparability among the runs (empty when they were evaluated alike)."""
    lines = []
    data = evaluation_differences(reports, recipes)
    if data:
        lines.append(
            f"these runs were evaluated on different data: {'; '.join(data)}; "
            f"their KL and perplexity are not comparable"
        )
    tasks = task_differences(reports, recipes)
    if tasks:
        lines.append(
            f"these runs' task scores were computed with different settings: {'; '.join(tasks)}; "
            f"their task scores are not comparable"
        )
    return lines


def _timing_cells(timings: dict[str, float]) -> dict[str, Any]:
    """The run's own prune time, and apart from it what runs can share (tokenising, loading, H):
    in a sweep the first run pays the shared part, which would otherwise look like slower
    pruning. Reports from before `fisher_s` existed count H in `prune_s`: no `H s` cell then."""
    shared = [timings[key] for key in SHARED_TIMINGS if isinstance(timings.get(key), (int, float))]
    cells = {"prune s": timings["prune_s"], "shared s": sum(shared) if shared else None}
    if "fisher_s" in timings:
        cells["H s"] = timings["fisher_s"]
    if "refine_s" in timings:
        cells["refine s"] = timings["refine_s"]
    if "split_s" in timings:  # choosing the split of the budget: pruning each candidate, measuring it
        cells["split s"] = timings["split_s"]
    return cells


def rows(folders: list[Path], shown: Iterable[str] = ()) -> list[dict[str, Any]]:
    """One row per run folder; recipe settings that differ between the runs get columns, except
    keys under `shown` (a sweep's grid keys, which it adds itself)."""
    return compare_runs(folders, shown)[0]


def compare_runs(folders: list[Path], shown: Iterable[str] = ()) -> tuple[list[dict[str, Any]], list[str]]:
    """`rows` and `warnings_for` of the run folders, each report and recipe read once."""
    reports = [read_report(folder) for folder in folders]
    recipes = [read_recipe(folder) for folder in folders]
    return _rows(folders, reports, recipes, shown), warnings_for(reports, recipes)


def _rows(
    folders: list[Path], reports: list[RunReport], recipes: list[dict[str, Any] | None], shown: Iterable[str]
) -> list[dict[str, Any]]:
    settings = differing_settings(recipes, list(shown))
    table = []
    for folder, report, label, differing in zip(folders, reports, _labels(reports), settings):
        metrics = report.metrics
        baseline, pruned = metrics.baseline, metrics.pruned
        table.append(
            {
                "run": folder.name,
                "model": Path(report.model.path).name,
                "pipeline": label,
                "sparsity": report.sparsity,
                "kept": report.kept_width,
                "params": report.params.ratio,
                "baseline ppl": baseline.ppl if baseline is not None else None,
                "pruned ppl": pruned.ppl if pruned is not None else None,
                "KL": pruned.kl if pruned is not None else None,
                **_timing_cells(report.timings),
                "seed": report.seed,
                **_mlp_cells(report),
                **_expert_cells(report),
                **task_cells(metrics),
                **differing,
            }
        )
    return table


def _mlp_cells(report: RunReport) -> dict[str, Any]:
    """A run that pruned the MLP: the neurons each layer kept of its width (per layer, their range
    and sum), not just that an `mlp` section was set; nothing for other runs."""
    mlp = report.mlp
    if mlp is None:
        return {}
    if mlp.widths is None:
        return {"MLP kept": f"{mlp.kept}/{mlp.of}"}
    return {"MLP kept": f"{min(mlp.widths)}–{max(mlp.widths)}/{mlp.of} per layer, {sum(mlp.widths):,} in all"}


def _expert_cells(report: RunReport) -> dict[str, Any]:
    """A run with routed experts: the experts each layer kept (of how many) and the share of the
    parameters one token uses; nothing for other runs."""
    cells: dict[str, Any] = {}
    if report.experts is not None:
        cells["experts kept"] = f"{report.experts.kept}/{report.experts.of}"  # beside a varied `experts` setting
    if report.active_params is not None:
        cells["active params"] = report.active_params.ratio
    return cells


def cell(column: str, value: Any) -> str:
    if value is None:
        return ""
    if column in ("params", "active params"):
        return f"{value:.1%}"
    if column == "KL":
        return f"{value:.5f}"
    if column in ("prune s", "shared s", "H s", "refine s", "split s"):
        return f"{value:.1f}"
    if column in ("baseline ppl", "pruned ppl") or (isinstance(value, float) and " " in column):
        return f"{value:.3f}"
    return str(value)


def render(table: list[dict[str, Any]], suffix: str, warnings: Iterable[str] = ()) -> str:
    """The table as Markdown (.md), CSV (.csv) or JSON (.json); `warnings` (`warnings_for`)
    follow a Markdown table, where a reader of the table sees them (CSV and JSON stay plain data)."""
    if suffix == ".json":
        return json.dumps(table, indent=2) + "\n"
    notes = list(warnings)
    names = columns(table)
    if suffix == ".csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=names)
        writer.writeheader()
        writer.writerows(table)
        return out.getvalue()
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(cell(c, row.get(c)) for c in names) + " |" for row in table]
    lines += ["", *(f"> **warning**: {line}" for line in notes)] if notes else []
    return "\n".join(lines) + "\n"
