"""Strategy × sparsity sweep on the benchmark protocol.

Measures, for each sparsity and each pipeline (run back to back, so they share conditions),
what slicing costs in quality and time: the kept width, the perplexity of the dense and
pruned models, the perplexity increase in %, the mean per-token KL(original ‖ pruned) in nats,
the KL and wall-time ratios to `pca`, the parameter counts, and the prune / evaluation / total
wall-clock seconds. Why: the paper's claim is a comparison (output-aware selection beats
activation energy at every sparsity, for ≤ 1.3× the time), so both sides are measured in one run.

Run by hand (not part of the tests):

    .venv/bin/python benchmarks/strategy_sweep.py \
        [--recipe recipes/ref_llama_pca.yaml] [--pipelines pca sensitivity sensitivity+stiefel] \
        [--sparsities 0.1 0.2 0.25 0.3] [--targets 0.75] [--set model.path=/abs/path] [--repeats 1] \
        [--out benchmarks/results/strategy_sweep.json] [--runs-dir DIR]

A pipeline may be named and carry recipe overrides: `name=chain:key=value,key=value`, e.g.
`pca+refinement=pca:refinement.windows=48`. The KL ratio is to the row named `pca` of the same
budget (a sparsity, or a `--targets` parameter fraction); the prune phase (walk plus refinement)
is also given relative to the row named `sensitivity`.

With `--repeats N` every pipeline runs N times per sparsity (interleaved: pca, sensitivity, …,
pca, sensitivity, …) and each row reports the median wall times; the quality figures of the
repeats should agree (the runs are seeded), and a warning names any row where they do not.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import argparse
import json
import platform
import statistics
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
from compressor.recipe.schema import load_recipe
from compressor.reports.report import kept_label
from compressor.run.runner import run
from compressor.strategies.registry import PluginRegistry

ROOT = Path(__file__).resolve().parent.parent


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "ref_llama_pca.yaml"), help="benchmark recipe")
    parser.add_argument(
        "--sparsities", type=float, nargs="+", default=None, help="default 0.1 0.2 0.25 0.3 unless --targets is given"
    )
    parser.add_argument(
        "--targets",
        type=float,
        nargs="+",
        default=[],
        help="target_params fractions, run as points of their own (sparsity: null)",
    )
    parser.add_argument(
        "--set",
        dest="common",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for every run, e.g. model.path=/abs/path (repeatable)",
    )
    parser.add_argument(
        "--pipelines",
        nargs="+",
        default=["pca"],
        help="strategy chains joined by '+', e.g. pca sensitivity sensitivity+stiefel; "
        "recipe overrides may follow a colon: sensitivity:sensitivity.autocast=bfloat16; "
        "NAME= in front names the row",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each pipeline per sparsity; rows report median wall times"
    )
    parser.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "results" / "strategy_sweep.json"),
        help="where the JSON results are written",
    )
    parser.add_argument(
        "--runs-dir", default=None, help="keep each run's output folder here (default: a temporary folder, deleted)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if len(set(args.pipelines)) != len(args.pipelines):
        parser.error("a pipeline is listed twice")
    if args.sparsities is None:
        args.sparsities = [] if args.targets else [0.1, 0.2, 0.25, 0.3]
    return args


def _points(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(budget label, recipe overrides) of each point: sparsities, then parameter targets."""
    return [(f"{s:.2f}", [f"sparsity={s}"]) for s in args.sparsities] + [
        (f"params ≤ {t:g}", ["sparsity=null", f"target_params={t}"]) for t in args.targets
    ]


def _row(report: dict[str, Any]) -> dict[str, Any]:
    metrics, timings = report["metrics"], report["timings"]
    baseline, pruned = metrics["baseline"]["ppl"], metrics["pruned"]["ppl"]
    return {
        "pipeline": report["label"],
        "budget": report["budget"],
        "sparsity": report["sparsity"],
        "target_params": report.get("target_params"),
        "params_ratio": report["params"]["ratio"],
        "kept_width": kept_label(report),
        "baseline_ppl": baseline,
        "pruned_ppl": pruned,
        "ppl_increase_pct": 100.0 * (pruned / baseline - 1.0),
        "kl": metrics["pruned"]["kl"],
        "params_baseline": report["params"]["baseline"],
        "params_pruned": report["params"]["pruned"],
        "prune_s": timings["prune_s"],
        "refine_s": timings.get("refine_s", 0.0),
        "prune_phase_s": timings["prune_s"] + timings.get("refine_s", 0.0),
        "kl_unrefined": metrics.get("unrefined", {}).get("kl"),
        "eval_s": timings["eval_s"],
        "total_s": timings["total_s"],
    }


TIMES = ("prune_s", "refine_s", "prune_phase_s", "eval_s", "total_s")


def _median_row(runs: list[dict[str, Any]], console: Console) -> dict[str, Any]:
    """One row for the repeats of a (pipeline, sparsity): median wall times (each taken on its
    own), each run's times and quality kept. Seeded CPU runs agree exactly; a difference (e.g.
    non-deterministic GPU kernels) is reported, not fatal, so no finished run is thrown away."""
    first = runs[0]
    if any((r["kl"], r["pruned_ppl"]) != (first["kl"], first["pruned_ppl"]) for r in runs[1:]):
        console.print(
            f"warning: {first['pipeline']} at {first['budget']}: repeats differ in quality "
            f"(KL {', '.join(format(r['kl'], '.6g') for r in runs)}); the row shows the medians"
        )
    row = dict(first)
    for key in (*TIMES, "kl", "pruned_ppl"):
        row[key] = statistics.median(r[key] for r in runs)
        row[f"{key}_runs"] = [r[key] for r in runs]
    row["ppl_increase_pct"] = 100.0 * (row["pruned_ppl"] / row["baseline_ppl"] - 1.0)
    return row


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """KL and wall-time ratios of each row to the `pca` row of the same budget, if there is one."""
    reference = {r["budget"]: r for r in rows if r["pipeline"] == "pca"}
    sensitivity = {r["budget"]: r for r in rows if r["pipeline"] == "sensitivity"}
    for r in rows:
        base = reference.get(r["budget"])
        r["kl_ratio_to_pca"] = r["kl"] / base["kl"] if base and base["kl"] > 0 else None
        r["total_ratio_to_pca"] = r["total_s"] / base["total_s"] if base else None
        sens = sensitivity.get(r["budget"])  # the prune phase (walk + refinement) against sensitivity's
        r["prune_ratio_to_sensitivity"] = r["prune_phase_s"] / sens["prune_phase_s"] if sens else None


def _summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per pipeline, the KL and wall-time ratios to `pca` over the sparsities: mean, min, max."""
    summary: dict[str, dict[str, float]] = {}
    for chain in dict.fromkeys(r["pipeline"] for r in rows):
        for key in ("kl_ratio_to_pca", "total_ratio_to_pca"):
            values = [r[key] for r in rows if r["pipeline"] == chain and r[key] is not None]
            if values:
                summary.setdefault(chain, {}).update(
                    {f"{key}_mean": statistics.fmean(values), f"{key}_min": min(values), f"{key}_max": max(values)}
                )
    return summary


COLUMNS = (
    "pipeline",
    "budget",
    "kept",
    "base ppl",
    "pruned ppl",
    "Δppl %",
    "KL (nats)",
    "KL / pca",
    "params pruned",
    "params / orig",
    "prune s",
    "refine s",
    "prune / sens",
    "eval s",
    "total s",
    "time / pca",
)


def _cells(r: dict[str, Any]) -> list[str]:
    def ratio(value: float | None) -> str:
        return "" if value is None else f"{value:.3f}"

    return [
        r["pipeline"],
        r["budget"],
        str(r["kept_width"]),
        f"{r['baseline_ppl']:.4f}",
        f"{r['pruned_ppl']:.4f}",
        f"{r['ppl_increase_pct']:.2f}",
        f"{r['kl']:.5f}",
        ratio(r["kl_ratio_to_pca"]),
        f"{r['params_pruned']:,}",
        f"{r['params_ratio']:.4f}",
        f"{r['prune_s']:.1f}",
        f"{r['refine_s']:.1f}",
        ratio(r["prune_ratio_to_sensitivity"]),
        f"{r['eval_s']:.1f}",
        f"{r['total_s']:.1f}",
        ratio(r["total_ratio_to_pca"]),
    ]


def _table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for name in COLUMNS:
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(*_cells(r))
    return table


def _markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _split(spec: str) -> tuple[str, str]:
    """`name=a+b:...` → (name, `a+b:...`); a spec without a name is its own label. (A chain has
    no '=' before its first ':', so an '=' there names it.)"""
    if "=" in spec.partition(":")[0]:
        name, _, body = spec.partition("=")
        return name, body
    return spec, spec


def _overrides(spec: str) -> list[str]:
    """`[name=]a+b[:key=value,...]` → the pipeline override plus any extra recipe overrides."""
    spec = _split(spec)[1]
    chain, _, extra = spec.partition(":")
    steps = ", ".join(f"{{strategy: {name}}}" for name in chain.split("+"))
    return [f"pipeline=[{steps}]", *(item for item in extra.split(",") if item)]


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    # Wide enough for the full table when the output goes to a log file (nohup) rather than a terminal.
    console = Console(width=None if sys.stdout.isatty() else 140)
    registry = PluginRegistry()
    started = datetime.now(timezone.utc)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="strategy_sweep_") as scratch:
        runs_dir = Path(args.runs_dir) if args.runs_dir else Path(scratch)
        for number, (budget, point) in enumerate(_points(args)):
            runs: dict[str, list[dict[str, Any]]] = {chain: [] for chain in args.pipelines}
            for repeat in range(args.repeats):
                for index, chain in enumerate(args.pipelines):
                    label = f"{_split(chain)[0]} at {budget}" + (
                        f" (run {repeat + 1}/{args.repeats})" if args.repeats > 1 else ""
                    )
                    output = runs_dir / f"{index}-{number}-{repeat}"
                    overrides = [*args.common, *point, *_overrides(chain)]
                    recipe = load_recipe(args.recipe, registry, overrides, str(output))
                    tick = time.perf_counter()
                    report = run(recipe, registry, phase_logger(console, label), overwrite=True)
                    runs[chain].append(_row({**report, "label": _split(chain)[0], "budget": budget}))
                    console.log(f"{label}: done in {time.perf_counter() - tick:.1f} s")
            rows += [_median_row(runs[chain], console) for chain in args.pipelines]
    _add_ratios(rows)
    device = report["environment"]["device"] if rows else None
    result = {
        "benchmark": "strategy_sweep",
        "recipe": str(Path(args.recipe).resolve()),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "repeats": args.repeats,
        "rows": rows,
        "summary": _summary(rows),
        "environment": {
            "date": started.isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cuda_available": torch.cuda.is_available(),
            "device": device,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(rows))
    console.print(_table(rows, f"strategy sweep ({Path(args.recipe).name})"))
    for chain, ratios in result["summary"].items():
        if chain != "pca" and "total_ratio_to_pca_mean" in ratios:
            console.print(
                f"{chain}: time / pca {ratios['total_ratio_to_pca_mean']:.3f} on average "
                f"({ratios['total_ratio_to_pca_min']:.3f}-{ratios['total_ratio_to_pca_max']:.3f})"
                + (
                    f", KL / pca {ratios['kl_ratio_to_pca_mean']:.3f} on average"
                    if "kl_ratio_to_pca_mean" in ratios
                    else ""
                )
            )
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
