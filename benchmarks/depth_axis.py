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
from pathlib import Path
from typing import Any

from axis_runs import EVALUATION, ROOT, run_all, write_tables
from rich.console import Console

BASE = [
    "slicing.layout=global",
    *EVALUATION,
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


def figures(report: dict[str, Any]) -> dict[str, Any]:
    depth = report.get("depth") or {}
    return {
        "blocks": report["model"]["num_layers"] - len(depth.get("removed", [])),
        "removed": depth.get("removed", []),
        "depth_s": report["timings"].get("depth_s", 0.0),
        "measurements": depth.get("measurements", 0),
    }


def cells(row: dict[str, Any]) -> list[str]:
    removed = ",".join(str(i) for i in row["removed"]) or "none"
    return [
        row["label"],
        f"{row['share']:.1%}",
        str(row["width"]),
        f"{row['blocks']} ({removed})",
        f"{row['kl']:.4f}",
        f"{row['ppl']:.2f}",
        f"{row['depth_s']:.1f}",
        f"{row['prune_s']:.1f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "ref_llama_sens.yaml")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.75, 0.6])
    parser.add_argument("--removed", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--name", default="ref-llama")
    args = parser.parse_args()
    console = Console()
    rows = run_all(args.recipe, configurations(args.targets, args.removed), BASE, figures, console)
    columns = ("configuration", "params", "width", "blocks (removed)", "KL", "ppl", "choosing s", "prune s")
    title = f"{args.name}: depth against width (stock layout, held-out KL)"
    write_tables(rows, columns, cells, title, f"depth_axis_{args.name}", args.recipe, console)


if __name__ == "__main__":
    main()
