"""Depth (whole decoder blocks, issue 49 item 2) against width at the same parameter budget: each
configuration is a `compress run` of a base recipe with `--set` changes, and the table gives its
parameters, held-out KL to the original and perplexity, the blocks removed and the time spent
choosing them and pruning. "depth alone" keeps the residual width whole (`sparsity: 0`), so its
parameter share is what the blocks leave.

    python benchmarks/depth_axis.py                       # ref-llama, ../shared data (recipes/ref_llama_sens.yaml)
    python benchmarks/depth_axis.py --targets 0.75 --removed 1 2

Writes benchmarks/results/depth_axis_<model>.json and .md.
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
"""The stock layout (the original class, fewer layers where depth removes them), evaluated on 64
held-out windows of the base recipe's evaluation data, no lm-eval or throughput."""


def configurations(targets: list[float], removed: list[int]) -> list[tuple[str, list[str]]]:
    """(label, --set changes): width alone and depth with width at each target, each selector; depth alone."""
    runs: list[tuple[str, list[str]]] = []
    for target in targets:
        budget = [f"target_params={target}", "sparsity=null"]
        runs.append((f"{target}: width alone", budget))
        for count in removed:
            for selector in ("kl", "influence"):
                runs.append(
                    (
                        f"{target}: {count} blocks ({selector}) + width",
                        [*budget, f"depth.removed={count}", f"depth.selector={selector}"],
                    )
                )
    for count in removed:
        runs.append((f"depth alone: {count} blocks (kl)", ["sparsity=0.0", f"depth.removed={count}"]))
    return runs


def run_one(recipe: Path, changes: list[str], output: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "compressor.cli", "run", str(recipe), "--output", str(output), "--overwrite"]
    for change in [*BASE, *changes]:
        command += ["--set", change]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "TERM": "dumb"})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(changes)} failed: {done.stderr.strip().splitlines()[-1:]}")
    report = json.loads((output / "report.json").read_text())
    depth = report.get("depth") or {}
    return {
        "params": report["params"]["pruned"],
        "share": report["params"]["ratio"],
        "width": report["kept_width"],
        "blocks": report["model"]["num_layers"] - len(depth.get("removed", [])),
        "removed": depth.get("removed", []),
        "kl": report["metrics"]["pruned"]["kl"],
        "ppl": report["metrics"]["pruned"]["ppl"],
        "baseline_ppl": report["metrics"]["baseline"]["ppl"],
        "depth_s": report["timings"].get("depth_s", 0.0),
        "prune_s": report["timings"]["prune_s"] + report["timings"].get("fisher_s", 0.0),
        "measurements": depth.get("measurements", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "ref_llama_sens.yaml")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.75, 0.6])
    parser.add_argument("--removed", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--name", default="ref-llama")
    args = parser.parse_args()
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, (label, changes) in enumerate(configurations(args.targets, args.removed)):
            console.print(f"[{index + 1}] {label}")
            rows.append({"label": label, "changes": changes, **run_one(args.recipe, changes, Path(scratch) / "out")})
    table = Table(title=f"{args.name}: depth against width (stock layout, held-out KL)")
    columns = ("configuration", "params", "width", "blocks (removed)", "KL", "ppl", "choosing s", "prune s")
    for column in columns:
        table.add_column(column, justify="left" if column == "configuration" else "right")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        removed = ",".join(str(i) for i in row["removed"]) or "none"
        cells = (
            row["label"],
            f"{row['share']:.1%}",
            str(row["width"]),
            f"{row['blocks']} ({removed})",
            f"{row['kl']:.4f}",
            f"{row['ppl']:.2f}",
            f"{row['depth_s']:.1f}",
            f"{row['prune_s']:.1f}",
        )
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / f"depth_axis_{args.name}.json").write_text(
        json.dumps({"recipe": str(args.recipe), "rows": rows}, indent=2)
    )
    (results / f"depth_axis_{args.name}.md").write_text("\n".join(lines) + "\n")
    console.print(f"wrote {results / f'depth_axis_{args.name}.json'} and .md")


if __name__ == "__main__":
    main()
