"""What `stiefel`'s steps buy: the coupled objective and the held-out KL against the step count.

Runs the benchmark recipe (default `recipes/ref_llama_sens.yaml`: ref-llama, the paper's H pass)
once with `sensitivity` alone (steps 0) and once per step count with `sensitivity` then
`stiefel` at `steps: N` (its other options at their defaults, so a run may stop early after
`patience` steps without gain). Every run is a whole `compressor.run.runner.run` with the recipe's
calibration and evaluation; the runs share data, model and H in memory (a sweep's
`SharedResources`), so H is computed once and each run's prune time is the walk alone.

Per run it reports, from the run's own report: the held-out KL(original ‖ pruned) and perplexity;
Σ over sites of the objective L(U) = Tr(UᵀCU·UᵀHU) the walk ended with (`stiefel`'s
`loss_after`, or `sensitivity`'s `loss` for steps 0) and its ratio to the sensitivity start;
the Stiefel steps taken (summed over sites) and the seconds spent in `stiefel` (timed around its
`select`), hence seconds per step; the share of the largest run's KL gain that the run reaches.

Run by hand (not part of the tests):

    .venv/bin/python benchmarks/stiefel_steps.py [--recipe recipes/ref_llama_sens.yaml] \
        [--steps 0 50 100 200 500 1000 2000 10000] [--sparsity 0.25] [--eval-samples 128] [--threads 1] \
        [--set key=value ...] [--out benchmarks/results/stiefel_steps.json]
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import datasets
import torch
import transformers
from rich.console import Console
from rich.table import Table

from compressor.cli.display import phase_logger
from compressor.commands.sweep import SharedResources
from compressor.recipe.schema import load_recipe
from compressor.run.runner import RunOptions, run
from compressor.strategies.registry import PluginRegistry

ROOT = Path(__file__).resolve().parent.parent


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "ref_llama_sens.yaml"), help="benchmark recipe")
    parser.add_argument(
        "--steps",
        type=int,
        nargs="+",
        default=[0, 50, 100, 200, 500, 1000, 2000, 10000],
        help="stiefel step counts; 0 is sensitivity alone",
    )
    parser.add_argument("--sparsity", type=float, default=0.25)
    parser.add_argument("--calibration-samples", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--eval-samples", type=int, default=128, help="held-out windows for the KL")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: small products on a shared, busy machine are far slower "
        "with 2 threads fighting other processes than with 1)",
    )
    parser.add_argument(
        "--set",
        dest="common",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a further recipe override for every run (repeatable)",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "stiefel_steps.json"))
    args = parser.parse_args(argv)
    if any(s < 0 for s in args.steps):
        parser.error("--steps must be 0 or more")
    return args


class StiefelTimer:
    """Seconds spent in `stiefel`'s `select` (summed over the sites of a run)."""

    def __init__(self) -> None:
        from compressor_plugins.stiefel import Stiefel

        self.seconds = 0.0
        original = Stiefel.select

        def timed(strategy: Any, *args: Any, **kwargs: Any) -> Any:
            tick = time.perf_counter()
            try:
                return original(strategy, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - tick

        Stiefel.select = timed  # this process only: a benchmark's instrument


def _row(steps: int, report: dict[str, Any], stiefel_s: float, load: tuple[float, float]) -> dict[str, Any]:
    sites = report["sites"]
    start, end, taken, early = 0.0, 0.0, 0, 0
    for site in sites:
        objectives = {step["strategy"]: step["objectives"] for step in site["steps"]}
        sens = objectives["sensitivity"]["loss"]
        start += sens
        if "stiefel" in objectives:
            end += objectives["stiefel"]["loss_after"]
            taken += objectives["stiefel"]["steps"]
            early += 0 < objectives["stiefel"]["steps"] < steps  # 0: a site with nothing removed
        else:
            end += sens
    metrics, timings = report["metrics"], report["timings"]
    return {
        "steps": steps,
        "kl": metrics["pruned"]["kl"],
        "pruned_ppl": metrics["pruned"]["ppl"],
        "baseline_ppl": metrics["baseline"]["ppl"],
        "objective": end,
        "objective_start": start,
        "objective_ratio": end / start if start > 0 else 1.0,
        "steps_taken": taken,
        "sites": len(sites),
        "sites_stopped_early": early,
        "stiefel_s": stiefel_s,
        "s_per_step": stiefel_s / taken if taken else None,
        "prune_s": timings["prune_s"],
        "fisher_s": timings.get("fisher_s", 0.0),
        "eval_s": timings.get("eval_s"),
        "eval_tokens": metrics["tokens"]["count"],
        "load_average_1min": {"start": load[0], "end": load[1]},
    }


def _add_shares(rows: list[dict[str, Any]]) -> None:
    """Each row's KL and objective gain over steps 0, as a share of the largest step count's."""
    base = next((r for r in rows if r["steps"] == 0), None)
    top = max(rows, key=lambda r: r["steps"])
    for r in rows:
        for key in ("kl", "objective"):
            whole = base[key] - top[key] if base else 0.0
            r[f"{key}_gain_share"] = (base[key] - r[key]) / whole if base and whole != 0 else None


COLUMNS = (
    "steps",
    "taken (Σ sites)",
    "early stops",
    "objective Σ",
    "obj / sens",
    "obj gain share",
    "KL (nats)",
    "KL / sens",
    "KL gain share",
    "pruned ppl",
    "stiefel s",
    "ms / step",
    "prune s",
)


def _cells(r: dict[str, Any], kl0: float | None) -> list[str]:
    def share(value: float | None) -> str:
        return "" if value is None else f"{100 * value:.0f}%"

    return [
        str(r["steps"]),
        f"{r['steps_taken']:,}",
        f"{r['sites_stopped_early']}/{r['sites']}",
        f"{r['objective']:.6g}",
        f"{r['objective_ratio']:.4f}",
        share(r["objective_gain_share"]),
        f"{r['kl']:.5f}",
        "" if kl0 is None else f"{r['kl'] / kl0:.4f}",
        share(r["kl_gain_share"]),
        f"{r['pruned_ppl']:.4f}",
        f"{r['stiefel_s']:.1f}",
        "" if r["s_per_step"] is None else f"{1000 * r['s_per_step']:.2f}",
        f"{r['prune_s']:.1f}",
    ]


def _markdown(rows: list[dict[str, Any]], kl0: float | None) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r, kl0)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _write(
    out: Path,
    args: argparse.Namespace,
    common: list[str],
    recipe: Any,
    report: dict[str, Any],
    rows: list[dict[str, Any]],
    started: datetime,
) -> None:
    result = {
        "benchmark": "stiefel_steps",
        "recipe": str(Path(args.recipe).resolve()),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "overrides": common,
        "calibration_samples": recipe.calibration.num_samples,
        "calibration_seq_len": recipe.calibration.seq_len,
        "eval_samples": args.eval_samples,
        "eval_seq_len": recipe.evaluation.seq_len if recipe.evaluation else None,
        "fisher_s": max((r["fisher_s"] for r in rows), default=0.0),  # the first run's: H is shared
        "rows": rows,
        "environment": {
            "date": started.isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": report.get("environment", {}).get("device"),
        },
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    kl0 = next((r["kl"] for r in rows if r["steps"] == 0), None)
    out.with_suffix(".md").write_text(_markdown(rows, kl0))


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    console = Console(width=None if sys.stdout.isatty() else 160)
    torch.set_num_threads(args.threads)
    registry = PluginRegistry()
    timer = StiefelTimer()
    started = datetime.now(timezone.utc)
    common = [
        f"sparsity={args.sparsity}",
        f"evaluation.num_samples={args.eval_samples}",
        "evaluation.lm_eval=null",
        "evaluation.throughput=false",
        *([f"calibration.num_samples={args.calibration_samples}"] if args.calibration_samples else []),
        *args.common,
    ]
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stiefel_steps_") as scratch:
        shared = SharedResources(Path(scratch) / "shared")
        for steps in args.steps:
            pipeline = (
                "[{strategy: sensitivity}]"
                if steps == 0
                else f"[{{strategy: sensitivity}}, {{strategy: stiefel, steps: {steps}}}]"
            )
            recipe = load_recipe(
                args.recipe, registry, [*common, f"pipeline={pipeline}"], str(Path(scratch) / f"steps-{steps}")
            )
            timer.seconds = 0.0
            tick, load = time.perf_counter(), os.getloadavg()[0]
            report = run(
                recipe,
                registry,
                phase_logger(console, f"steps {steps}"),
                overwrite=True,
                options=RunOptions(resources=shared, save_model=False),
            )
            rows.append(_row(steps, report, timer.seconds, (load, os.getloadavg()[0])))
            console.log(
                f"steps {steps}: KL {rows[-1]['kl']:.5f}, {rows[-1]['steps_taken']} steps taken in "
                f"{timer.seconds:.1f} s; run {time.perf_counter() - tick:.1f} s"
            )
            _add_shares(rows)
            _write(out, args, common, recipe, report, rows, started)  # after every run: a long one may be cut short
    kl0 = next((r["kl"] for r in rows if r["steps"] == 0), None)
    table = Table(
        title=f"stiefel steps ({Path(args.recipe).name}, sparsity {args.sparsity}, "
        f"{recipe.calibration.num_samples} calibration / {args.eval_samples} held-out windows, "
        f"{args.threads} thread(s))"
    )
    for name in COLUMNS:
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(*_cells(r, kl0))
    console.print(table)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
