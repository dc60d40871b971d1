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
from pathlib import Path
from typing import Any

from axis_runs import EVALUATION, ROOT, run_all, write_tables
from rich.console import Console

BASE = [
    "slicing.layout=global",
    *EVALUATION,
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


def figures(report: dict[str, Any]) -> dict[str, Any]:
    heads = report.get("heads") or {}
    return {"heads": heads.get("kept"), "of": heads.get("of"), "heads_s": report["timings"].get("heads_s", 0.0)}


def cells(row: dict[str, Any]) -> list[str]:
    return [
        row["label"],
        f"{row['share']:.1%}",
        str(row["width"]),
        "all" if row["heads"] is None else f"{row['heads']} of {row['of']}",
        f"{row['kl']:.4f}",
        f"{row['ppl']:.2f}",
        f"{row['heads_s']:.1f}",
        f"{row['prune_s']:.1f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "ref_llama_sens.yaml")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.75, 0.6])
    parser.add_argument("--kept", type=float, nargs="+", default=[0.5], help="heads.kept values (count or fraction)")
    parser.add_argument("--name", default="ref-llama")
    args = parser.parse_args()
    console = Console()
    rows = run_all(args.recipe, configurations(args.targets, args.kept), BASE, figures, console)
    columns = ("configuration", "params", "width", "heads", "KL", "ppl", "heads s", "prune s")
    title = f"{args.name}: query heads against width (stock layout, held-out KL)"
    write_tables(rows, columns, cells, title, f"heads_axis_{args.name}", args.recipe, console)


if __name__ == "__main__":
    main()
