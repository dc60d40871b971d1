"""One budget over a Mixture-of-Experts model's axes (issue 48, item 5), measured on the reference
MoE: at each budget (75% and 50% of total parameters, 50% of the parameters a token uses), the
residual width alone, the expert count alone (each expert selector at the same count, the
residual width taking what the budget leaves), the experts' width alone (the residual whole) and
the run's own choice (`experts` and `mlp` without `kept`: every count of `experts.min_kept` ×
every split of the MLP's), each a real `compress run` of a stock (global) layout; KL and
perplexity on held-out text (valid.jsonl), parameters total and active, and the time spent
pruning (choosing included; loading, saving and evaluation not).

    python benchmarks/make_ref_moe.py      # once: the reference MoE (not in the repository)
    python benchmarks/moe_budget.py         # all three budgets
    python benchmarks/moe_budget.py --budgets total:0.75 --calibration 8 --heldout 8   # a quick look

Writes benchmarks/results/moe_budget_<model>.json and .md.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from axis_runs import working_seconds
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig

from compressor.models.families import family_for
from compressor.models.layout import LayoutRequest, sliced_layout

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHARED = ROOT.parent / "shared"
KEYS = {"total": "target_params", "active": "target_active_params"}


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=RESULTS / "ref-moe")
    parser.add_argument("--budgets", nargs="+", default=["total:0.75", "total:0.5", "active:0.5"])
    parser.add_argument("--experts", type=int, default=4, help="the count every expert selector keeps")
    parser.add_argument("--selectors", nargs="+", default=["frequency", "reap", "output"])
    parser.add_argument("--calibration", type=int, default=32, help="calibration windows of 512 tokens")
    parser.add_argument("--heldout", type=int, default=32, help="held-out windows of 512 tokens (valid.jsonl)")
    parser.add_argument("--split-windows", type=int, default=16, help="windows each candidate split is measured on")
    parser.add_argument("--tag", default="")
    return parser.parse_args()


def base_recipe(args: argparse.Namespace, budget: dict[str, float], output: Path) -> dict[str, Any]:
    def data(file: str, windows: int) -> dict[str, Any]:
        return {
            "dataset": {"path": "json", "data_files": str(SHARED / "corpus" / file)},
            "num_samples": windows,
            "seq_len": 512,
        }

    return {
        "model": {"path": str(args.model), "dtype": "float32"},
        "calibration": data("calib.jsonl", args.calibration),
        **budget,
        "slicing": {"layout": "global"},
        "pipeline": [{"strategy": "sensitivity"}],
        "sensitivity": {"dtype": "float32"},
        "evaluation": {**data("valid.jsonl", args.heldout), "throughput": False},
        "output": str(output),
    }


def widest_width_alone(args: argparse.Namespace, budget: dict[str, float]) -> int | None:
    """The most neurons every expert keeps with the residual stream whole under `budget` (a
    multiple of 8), or None where no expert width reaches it alone."""
    config = AutoConfig.from_pretrained(args.model)
    family = family_for(config.model_type)
    for width in range(config.moe_intermediate_size, 0, -8):
        layout = sliced_layout(config, family, [family], LayoutRequest(layout="global", mlp_kept=width, **budget))
        if layout.kept == config.hidden_size:
            return width
    return None


def configurations(args: argparse.Namespace, kind: str, budget: dict[str, float]) -> list[tuple[str, dict]]:
    configs: list[tuple[str, dict]] = [("residual width alone", {})]
    if kind == "total":  # a token uses top-k experts whatever the count: the count buys no active parameters
        for selector in args.selectors:
            configs.append(
                (f"{args.experts} experts ({selector})", {"experts": {"kept": args.experts, "selector": selector}})
            )
    width = widest_width_alone(args, budget)
    if width is not None:
        configs.append((f"experts' width alone ({width}, obs)", {"mlp": {"kept": width, "selector": "obs"}}))
    choice = {"mlp": {"selector": "obs", "heldout_windows": args.split_windows}}
    if kind == "total":
        choice["experts"] = {"selector": "output", "heldout_windows": args.split_windows}
    axes = "count × width × residual" if kind == "total" else "width × residual"
    configs.append((f"the run's choice ({axes})", choice))
    return configs


def measure(recipe: dict[str, Any], scratch: Path, name: str) -> dict[str, Any]:
    path = scratch / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    started = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "compress"), "run", str(path)], check=True)
    wall = time.perf_counter() - started
    report = json.loads((Path(recipe["output"]) / "report.json").read_text())
    timings = report["timings"]
    split = (report.get("mlp") or {}).get("split") or (report.get("experts") or {}).get("split")
    return {
        "params": report["params"],
        "active_params": report["active_params"],
        "kept_width": report["kept_width"],
        "experts": (report.get("experts") or {}).get("kept"),
        "mlp_kept": (report.get("mlp") or {}).get("kept"),
        "kl": report["metrics"]["pruned"]["kl"],
        "ppl": report["metrics"]["pruned"]["ppl"],
        "baseline_ppl": report["metrics"]["baseline"]["ppl"],
        "prune_s": working_seconds(timings),
        "split_s": timings.get("split_s"),
        "split": split,
        "wall_s": wall,
    }


def main() -> None:
    args = _args()
    console = Console()
    results: dict[str, Any] = {"model": str(args.model), "calibration": args.calibration, "heldout": args.heldout}
    rows = []
    with tempfile.TemporaryDirectory(prefix="moe-budget-") as scratch:
        for entry in args.budgets:
            kind, value = entry.split(":")
            budget = {KEYS[kind]: float(value)}
            results[entry] = {}
            for label, extra in configurations(args, kind, budget):
                name = f"{kind}-{value}-{len(results[entry])}"
                recipe = {**base_recipe(args, budget, Path(scratch) / name), **extra}
                console.print(f"[bold]{entry}: {label}")
                measured = measure(recipe, Path(scratch), name)
                results[entry][label] = measured
                rows.append(row(entry, label, measured))
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"moe_budget_{args.model.name}{args.tag}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    columns = ["budget", "configuration", "width", "experts × width", "params", "active", "KL", "ppl", "prune s"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    table = Table(title=f"one budget over the axes of {args.model.name}")
    for column in columns:
        table.add_column(column)
    for r in rows:
        table.add_row(*r)
    console.print(table)


def row(entry: str, label: str, m: dict[str, Any]) -> list[str]:
    experts = m["experts"] or "all"
    width = m["mlp_kept"] or "all"
    return [
        entry,
        label,
        str(m["kept_width"]),
        f"{experts} × {width}",
        f"{m['params']['ratio']:.1%}",
        f"{m['active_params']['ratio']:.1%}",
        f"{m['kl']:.4f}",
        f"{m['ppl']:.3f}",
        f"{m['prune_s']:.0f}" + (f" ({m['split_s']:.0f} choosing)" if m["split_s"] else ""),
    ]


if __name__ == "__main__":
    main()
