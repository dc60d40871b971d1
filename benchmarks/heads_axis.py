"""Query heads (issue 49 item 1) against width at the same parameter budget: each configuration is
a `compress run` of a base recipe with `--set` changes, and the table gives its parameters, the
heads kept per layer, held-out KL to the original and perplexity, and the time the heads stage
and the walk took. "heads alone" keeps the residual width whole (`sparsity: 0`), so its parameter
share is what the heads leave.

    python benchmarks/heads_axis.py                       # ref-llama, ../shared data (recipes/ref_llama_sens.yaml)
    python benchmarks/heads_axis.py --targets 0.75 --kept 2

Writes benchmarks/results/heads_axis_<model>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
BASE = [
    "slicing.layout=global",
    "evaluation.lm_eval=null",
    "evaluation.throughput=false",
    "evaluation.num_samples=64",
]
"""The stock layout (the original class, fewer heads where the heads axis prunes them), evaluated
on 64 held-out windows of the base recipe's evaluation data, no lm-eval or throughput."""

SELECTORS = ("obs", "norm")


def configurations(targets: list[float], kept: list[float]) -> list[tuple[str, list[str]]]:
    """(label, --set changes): width alone and heads with width at each target, each selector; heads alone."""
    runs: list[tuple[str, list[str]]] = []
    for target in targets:
        budget = [f"target_params={target}", "sparsity=null"]
        runs.append((f"{target}: width alone", budget))
        for count in kept:
            for selector in SELECTORS:
                label = f"{target}: heads {count:g} ({selector}) + width"
                runs.append((label, [*budget, f"heads.kept={count:g}", f"heads.selector={selector}"]))
    for count in kept:
        for selector in SELECTORS:
            runs.append(
                (
                    f"heads alone: {count:g} ({selector})",
                    ["sparsity=0.0", f"heads.kept={count:g}", f"heads.selector={selector}"],
                )
            )
    return runs


def run_one(recipe: Path, changes: list[str], output: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "compressor.cli", "run", str(recipe), "--output", str(output), "--overwrite"]
    for change in [*BASE, *changes]:
        command += ["--set", change]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "TERM": "dumb"})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(changes)} failed: {done.stderr.strip().splitlines()[-1:]}")
    report = json.loads((output / "report.json").read_text())
    heads = report.get("heads") or {}
    return {
        "params": report["params"]["pruned"],
        "share": report["params"]["ratio"],
        "width": report["kept_width"],
        "heads": heads.get("kept"),
        "of": heads.get("of"),
        "kl": report["metrics"]["pruned"]["kl"],
        "ppl": report["metrics"]["pruned"]["ppl"],
        "baseline_ppl": report["metrics"]["baseline"]["ppl"],
        "heads_s": report["timings"].get("heads_s", 0.0),
        "prune_s": report["timings"]["prune_s"] + report["timings"].get("fisher_s", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "ref_llama_sens.yaml")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.75, 0.6])
    parser.add_argument("--kept", type=float, nargs="+", default=[0.5], help="heads.kept values (count or fraction)")
    parser.add_argument("--name", default="ref-llama")
    args = parser.parse_args()
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, (label, changes) in enumerate(configurations(args.targets, args.kept)):
            console.print(f"[{index + 1}] {label}")
            rows.append({"label": label, "changes": changes, **run_one(args.recipe, changes, Path(scratch) / "out")})
    table = Table(title=f"{args.name}: query heads against width (stock layout, held-out KL)")
    columns = ("configuration", "params", "width", "heads", "KL", "ppl", "heads s", "prune s")
    for column in columns:
        table.add_column(column, justify="left" if column == "configuration" else "right")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = (
            row["label"],
            f"{row['share']:.1%}",
            str(row["width"]),
            "all" if row["heads"] is None else f"{row['heads']} of {row['of']}",
            f"{row['kl']:.4f}",
            f"{row['ppl']:.2f}",
            f"{row['heads_s']:.1f}",
            f"{row['prune_s']:.1f}",
        )
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / f"heads_axis_{args.name}.json").write_text(
        json.dumps({"recipe": str(args.recipe), "rows": rows}, indent=2)
    )
    (results / f"heads_axis_{args.name}.md").write_text("\n".join(lines) + "\n")
    console.print(f"wrote {results / f'heads_axis_{args.name}.json'} and .md")


if __name__ == "__main__":
    main()
