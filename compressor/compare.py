"""`compress compare RUN...`: finished run folders side by side, for ablations.

Reads each run's `report.json` and makes one row per run. A pipeline is shown as its chain of
strategies, with the options in which the compared runs differ (so two ablation runs never
look alike) and whether the bases were refined on the KL after the walk, and the table can be
written as Markdown, CSV or JSON.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from compressor.errors import UserError
from compressor.runner import RUN_MARKER

COLUMNS = ("run", "model", "pipeline", "sparsity", "kept", "params", "baseline ppl", "pruned ppl", "KL",
           "prune s", "seed")
FORMATS = (".md", ".csv", ".json")
REQUIRED = ("model", "pipeline", "sparsity", "kept_width", "params", "timings")


def read_report(folder: Path) -> dict[str, Any]:
    path = folder / RUN_MARKER
    if not path.is_file():
        raise UserError(f"{folder} is not a finished run (no {RUN_MARKER}); give run folders written by compress run")
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {path}: {error}") from None
    missing = [key for key in REQUIRED if not isinstance(report, dict) or key not in report]
    if missing:
        raise UserError(f"{path} is not a run report (no {', '.join(missing)})")
    return report


def _steps(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Pipeline steps as {strategy, options} (reports before per-step options listed names only)."""
    return [step if isinstance(step, dict) else {"strategy": step, "options": {}} for step in report["pipeline"]]


def _labels(reports: list[dict[str, Any]]) -> list[str]:
    """Each run's chain of strategies with the options that differ between the runs that use the
    same strategy at that step."""
    pipelines = [_steps(r) for r in reports]
    labels = []
    for steps in pipelines:
        parts = []
        for position, step in enumerate(steps):
            others = [p[position]["options"] for p in pipelines
                      if len(p) > position and p[position]["strategy"] == step["strategy"]]
            parts.append(step["strategy"] + _differing(step["options"], others))
        labels.append(" + ".join(parts))
    return [label + _extras(report, reports) for label, report in zip(labels, reports)]


def _differing(own: dict[str, Any], others: list[dict[str, Any]]) -> str:
    """`key=value` for the entries of `own` that some of `others` lack or set differently."""
    varying = [f"{key}={json.dumps(value)}" for key, value in own.items()
               if any(other.get(key) != value for other in others)]
    return f"({', '.join(varying)})" if varying else ""


def _extras(report: dict[str, Any], reports: list[dict[str, Any]]) -> str:
    """What a run did besides its strategies: corrected readers, and refinement on the KL (with the
    settings that differ between refined runs), or its refinement rejected."""
    text = " + corrected readers" if (report.get("slicing") or {}).get("correct_readers") else ""
    refinement = report.get("refinement")
    if refinement:
        others = [(r.get("refinement") or {}).get("options", {}) for r in reports if r.get("refinement")]
        settings = _differing(refinement.get("options", {}), others)
        text += (f" → refined on KL{settings}" if refinement.get("kept") == "refined"
                 else f" → refinement{settings} rejected")
    return text


def primary_metric(scores: dict[str, Any]) -> str | None:
    """The score a table shows for a task: acc_norm where the task has it (as the paper reports),
    else acc, else its first metric."""
    metrics = [m for m in scores if not m.endswith("_stderr") and m != "samples"]
    for preferred in ("acc_norm", "acc"):
        if preferred in metrics:
            return preferred
    return metrics[0] if metrics else None


def task_cells(metrics: dict[str, Any]) -> dict[str, Any]:
    """`<task> <metric>` (pruned) and `dense <task> <metric>` columns, one metric per task."""
    cells: dict[str, Any] = {}
    baseline = metrics.get("baseline", {}).get("tasks", {})
    for task, scores in metrics.get("pruned", {}).get("tasks", {}).items():
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


def rows(folders: list[Path]) -> list[dict[str, Any]]:
    reports = [read_report(folder) for folder in folders]
    table = []
    for folder, report, label in zip(folders, reports, _labels(reports)):
        metrics = report.get("metrics") or {}
        baseline, pruned = metrics.get("baseline", {}), metrics.get("pruned", {})
        table.append({
            "run": folder.name, "model": Path(report["model"]["path"]).name, "pipeline": label,
            "sparsity": report["sparsity"], "kept": report["kept_width"], "params": report["params"]["ratio"],
            "baseline ppl": baseline.get("ppl"), "pruned ppl": pruned.get("ppl"), "KL": pruned.get("kl"),
            "prune s": report["timings"]["prune_s"], "seed": report.get("seed"), **task_cells(metrics),
        })
        if "refine_s" in report["timings"]:
            table[-1]["refine s"] = report["timings"]["refine_s"]
    return table


def cell(column: str, value: Any) -> str:
    if value is None:
        return ""
    if column == "params":
        return f"{value:.1%}"
    if column == "KL":
        return f"{value:.5f}"
    if column in ("prune s", "refine s"):
        return f"{value:.1f}"
    if column in ("baseline ppl", "pruned ppl") or (isinstance(value, float) and " " in column):
        return f"{value:.3f}"
    return str(value)


def render(table: list[dict[str, Any]], suffix: str) -> str:
    """The table as Markdown (.md), CSV (.csv) or JSON (.json)."""
    if suffix == ".json":
        return json.dumps(table, indent=2) + "\n"
    names = columns(table)
    if suffix == ".csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=names)
        writer.writeheader()
        writer.writerows(table)
        return out.getvalue()
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(cell(c, row.get(c)) for c in names) + " |" for row in table]
    return "\n".join(lines) + "\n"
