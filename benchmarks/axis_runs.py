"""What the axis benchmarks share (`depth_axis.py`, `heads_axis.py`, `heterogeneous.py`): each
configuration is a `compress run` of a base recipe with `--set` changes; its report is read back,
and the rows become a rich table, a Markdown table and a JSON file under benchmarks/results/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
EVALUATION = ["evaluation.lm_eval=null", "evaluation.throughput=false", "evaluation.num_samples=64"]
"""Every configuration is evaluated on 64 held-out windows of the base recipe's evaluation data,
without lm-eval or throughput."""


def run_report(
    recipe: Path, changes: Sequence[str], output: Path, entry: Sequence[str] = ("-m", "compressor.cli")
) -> dict[str, Any]:
    """`compress run recipe --set change ...` into `output`; its report.json. Exits on failure.
    `entry`: how Python starts the CLI (`-c CODE` for a patched one)."""
    command = [sys.executable, *entry, "run", str(recipe), "--output", str(output), "--overwrite"]
    for change in changes:
        command += ["--set", change]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "TERM": "dumb"})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(changes)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads((output / "report.json").read_text())


NOT_PRUNING = ("data_s", "load_s", "save_s", "eval_s")
"""A run's phases that neither choose nor prune."""


def working_seconds(timings: dict[str, float]) -> float:
    """A run's time less loading, saving and evaluation: H, choosing and pruning."""
    return timings["total_s"] - sum(timings.get(key, 0.0) for key in NOT_PRUNING)


def common(report: dict[str, Any]) -> dict[str, Any]:
    """The figures every axis table shows: parameters, width, KL, perplexity and prune time."""
    return {
        "params": report["params"]["pruned"],
        "share": report["params"]["ratio"],
        "width": report["kept_width"],
        "kl": report["metrics"]["pruned"]["kl"],
        "ppl": report["metrics"]["pruned"]["ppl"],
        "baseline_ppl": report["metrics"]["baseline"]["ppl"],
        "prune_s": report["timings"]["prune_s"] + report["timings"].get("fisher_s", 0.0),
    }


def run_all(
    recipe: Path,
    configurations: Sequence[tuple[str, list[str]]],
    base: Sequence[str],
    figures: Callable[[dict[str, Any]], dict[str, Any]],
    console: Console,
) -> list[dict[str, Any]]:
    """Each (label, changes) run on top of `base`; a row of `common` and `figures` of its report."""
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, (label, changes) in enumerate(configurations):
            console.print(f"[{index + 1}/{len(configurations)}] {label}")
            report = run_report(recipe, [*base, *changes], Path(scratch) / "out")
            rows.append({"label": label, "changes": changes, **common(report), **figures(report)})
    return rows


def write_tables(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    cells: Callable[[dict[str, Any]], Sequence[str]],
    title: str,
    stem: str,
    recipe: Path,
    console: Console,
) -> None:
    """Print the rows as a rich table and write benchmarks/results/<stem>.json and .md."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column == columns[0] else "right")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        values = list(cells(row))
        table.add_row(*values)
        lines.append("| " + " | ".join(values) + " |")
    console.print(table)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / f"{stem}.json").write_text(json.dumps({"recipe": str(recipe), "rows": list(rows)}, indent=2))
    (results / f"{stem}.md").write_text("\n".join(lines) + "\n")
    console.print(f"wrote {results / stem}.json and .md")
