"""How close is the time plan (`plan.timing`, issue 50 item 4) to what runs take? Each configuration
is one `compress run` (a fresh process, as a user starts it): its report holds the estimate made
before it started (`estimate`, from one layer timed on this machine) and what each phase took
(`timings`). The table gives both by the report's timing keys, and the total.

    python benchmarks/time_estimate.py                       # the demo, with mlp: {}, and ref-llama's recipes
    python benchmarks/time_estimate.py --only demo demo-split

Run it on a quiet machine: the estimate times a layer on the machine as it is when the run starts,
and the run is timed as it goes. Writes benchmarks/results/time_estimate.json and .md.
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
RESULTS = ROOT / "benchmarks" / "results"
STOCK_SPLIT = ["slicing.layout=global", "mlp={}", "sparsity=null", "target_params=0.75"]
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "demo": ("recipes/demo.yaml", []),
    # the new user's case: the stock layout choosing its split (96 windows: the demo text holds 16 more)
    "demo-split": ("recipes/demo.yaml", [*STOCK_SPLIT, "calibration.num_samples=96"]),
    "ref-llama-sens": ("recipes/ref_llama_sens.yaml", []),
    "ref-llama-stock-predicted": (
        "recipes/ref_llama_stock.yaml",
        ["refinement=null", "distillation=null", "evaluation.lm_eval=null", "mlp.measure_best=2"],
    ),
}
KEYS = ("depth_s", "split_s", "fisher_s", "prune_s", "refine_s", "experts_s", "heads_s", "mlp_s", "distill_s", "eval_s")


def run(recipe: str, changes: list[str], output: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "compressor.cli", "run", recipe, "--output", str(output), "--overwrite"]
    for change in changes:
        command += ["--set", change]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TERM": "dumb"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{recipe} {' '.join(changes)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads((output / "report.json").read_text())


def rows_of(name: str, report: dict[str, Any]) -> dict[str, Any]:
    estimate = report["estimate"]
    by_key: dict[str, float] = {}
    for phase in estimate["phases"]:
        if phase["key"] is not None and phase["seconds"] is not None:
            by_key[phase["key"]] = by_key.get(phase["key"], 0.0) + phase["seconds"]
    timings = report["timings"]
    keys = [key for key in KEYS if key in by_key or timings.get(key, 0.0) >= 0.5]
    return {
        "name": name,
        "keys": {key: {"estimated": by_key.get(key), "took": timings.get(key)} for key in keys},
        "total": {"estimated": estimate["total_s"], "took": timings["total_s"]},
        "measured_s": estimate["measured_s"],
        "phases": estimate["phases"],
        "timings": timings,
        "threads": report.get("environment", {}).get("threads"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS))
    args = parser.parse_args()
    console, results = Console(), []
    with tempfile.TemporaryDirectory() as scratch:
        for index, name in enumerate(args.only or list(CONFIGS)):
            recipe, changes = CONFIGS[name]
            console.print(f"[{index + 1}] {name}: {recipe} {' '.join(changes)}")
            results.append(rows_of(name, run(recipe, changes, Path(scratch) / name)))
    table = Table(title="time plan against the run: seconds by the report's timing keys")
    for column in ("run", "phase", "estimated s", "took s", "took / estimated"):
        table.add_column(column, justify="left" if column in ("run", "phase") else "right")
    lines = ["| run | phase | estimated s | took s | took / estimated |", "|---|---|---:|---:|---:|"]
    for result in results:
        entries = [*result["keys"].items(), ("total", result["total"])]
        for key, pair in entries:
            estimated, took = pair["estimated"], pair["took"]
            ratio = f"{took / estimated:.2f}" if estimated and took is not None else ""
            cells = [
                result["name"],
                key,
                "" if estimated is None else f"{estimated:.1f}",
                "" if took is None else f"{took:.1f}",
                ratio,
            ]
            table.add_row(*cells)
            lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "time_estimate.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "time_estimate.md").write_text("\n".join(lines) + "\n")
    console.print(f"wrote {RESULTS / 'time_estimate.json'} and .md")


if __name__ == "__main__":
    main()
