"""Per-layer MLP widths saved as DeciLM (`slicing.layout: heterogeneous`, issue 49 item 3) against
the stock models at the same parameter budget. Each configuration is a `compress run` of a base
recipe with `--set` changes; the table gives parameters, the MLP widths, held-out KL to the
original and perplexity, and the time the MLP stage (curves, allocation and pruning) and the walk
took. The heterogeneous layout keeps the stream whole (DeciLM's engines derive head_dim from the
hidden size); "stock, width and MLP" is the global layout with the run's split chooser (`mlp: {}`);
"stock, width alone" the global layout without an MLP axis; "attention removable" the
heterogeneous layout with `mlp.remove_attention` (its "attention removed" column names the layers).

    python benchmarks/heterogeneous.py                    # ref-llama, ../shared data (recipes/ref_llama_sens.yaml)
    python benchmarks/heterogeneous.py --targets 0.8 --no-stock
    python benchmarks/heterogeneous.py --rows attention   # only the rows that may remove attention

Writes benchmarks/results/heterogeneous_<model>.json and .md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from axis_runs import EVALUATION, ROOT, run_all, write_tables
from rich.console import Console

ROWS = ("plain", "attention", "stock")
"""The kinds of row: heterogeneous by fisher and by energy; heterogeneous by fisher with removable
attention; the stock models."""


def configurations(targets: list[float], rows: list[str]) -> list[tuple[str, list[str]]]:
    """(label, --set changes) at each target, for each kind of row in `rows` (`ROWS`)."""
    runs: list[tuple[str, list[str]]] = []
    for target in targets:
        budget = [f"target_params={target}", "sparsity=null"]
        for weighing in ("fisher", "energy") if "plain" in rows else ():
            het = ["slicing.layout=heterogeneous", "mlp={}", f"mlp.allocate_by={weighing}"]
            runs.append((f"{target}: heterogeneous ({weighing})", [*budget, *het]))
        if "attention" in rows:
            het = ["slicing.layout=heterogeneous", "mlp={}", "mlp.remove_attention=true"]
            runs.append((f"{target}: heterogeneous (fisher), attention removable", [*budget, *het]))
        if "stock" in rows:
            runs.append((f"{target}: stock, width alone", [*budget, "slicing.layout=global"]))
            runs.append((f"{target}: stock, width and MLP", [*budget, "slicing.layout=global", "mlp={}"]))
    return runs


def figures(report: dict[str, Any]) -> dict[str, Any]:
    mlp = report.get("mlp") or {}
    return {
        "widths": mlp.get("widths"),
        "attention_removed": mlp.get("attention_removed"),
        "mlp_kept": mlp.get("kept"),
        "mlp_of": mlp.get("of"),
        "mlp_s": report["timings"].get("mlp_s", 0.0),
        "split_s": report["timings"].get("split_s", 0.0),
    }


def cells(row: dict[str, Any]) -> list[str]:
    if row["widths"] is not None:
        mlp = " ".join(str(w) for w in row["widths"])
    else:
        mlp = "all" if row["mlp_kept"] is None else f"{row['mlp_kept']} of {row['mlp_of']}"
    return [
        row["label"],
        f"{row['share']:.1%}",
        str(row["width"]),
        mlp,
        "–" if row["attention_removed"] is None else " ".join(map(str, row["attention_removed"])) or "none",
        f"{row['kl']:.4f}",
        f"{row['ppl']:.2f}",
        f"{row['mlp_s'] + row['split_s']:.1f}",
        f"{row['prune_s']:.1f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "ref_llama_sens.yaml")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.75, 0.6])
    parser.add_argument("--no-stock", action="store_true", help="skip the stock models (the split chooser is slow)")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="the kinds of row to run")
    parser.add_argument("--name", default="ref-llama")
    args = parser.parse_args()
    console = Console()
    kinds = [kind for kind in args.rows if not (args.no_stock and kind == "stock")]
    rows = run_all(args.recipe, configurations(args.targets, kinds), EVALUATION, figures, console)
    columns = ("configuration", "params", "width", "MLP widths", "attention removed", "KL", "ppl", "MLP s", "prune s")
    title = f"{args.name}: per-layer MLP widths (DeciLM) against the stock layout (held-out KL)"
    write_tables(rows, columns, cells, title, f"heterogeneous_{args.name}", args.recipe, console)


if __name__ == "__main__":
    main()
