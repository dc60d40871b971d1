"""What recovery distillation buys: held-out KL and perplexity against distillation tokens.

For each layout (per-site bases, and the stock layout: one basis, the original class) the
benchmark recipe (default `recipes/ref_llama_distill.yaml`) is run once without its
distillation section (an ordinary run: prune, refine, save), and its saved model is the student.
Then, per method (LoRA, full weights), `compressor.training.distill.distill` trains it from the original
on the recipe's distillation data with the recipe's settings and a budget of `--tokens`; at each
of `--marks` tokens seen (and at 0), a Trainer callback measures KL(original ‖ student) and
perplexity on the recipe's evaluation windows (valid.jsonl), timed apart from training. So the
points along one run share its schedule (cosine over the whole budget): a run given a smaller
budget would anneal sooner. The last row is the model the stage returns (its best held-out
checkpoint, adapters merged).

Run by hand (not part of the tests):

    .venv/bin/python benchmarks/distillation.py [--recipe recipes/ref_llama_distill.yaml] \
        [--layouts per_site global] [--methods lora full] [--tokens 2000000] \
        [--marks 250000 500000 1000000 2000000] [--eval-samples 64] [--set key=value ...] \
        [--out benchmarks/results/distillation.json]
    .venv/bin/python benchmarks/distillation.py --combine A.json B.json --out C.json   # one table and plot
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import argparse
import dataclasses
import json
import platform
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, TrainerCallback

import compressor  # noqa: F401  (registers the sliced classes)
from compressor.cli.display import phase_logger
from compressor.evaluation.metrics import compare, parameter_count
from compressor.recipe.schema import load_recipe
from compressor.run.runner import run
from compressor.runtime.loading import load_model, load_tokenizer, token_batches
from compressor.strategies.registry import PluginRegistry
from compressor.training.distill import TrainingRun, distill
from compressor.training.teachers import LiveTeacher, distillation_data

ROOT = Path(__file__).resolve().parent.parent
CONSOLE = Console()


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "ref_llama_distill.yaml"))
    parser.add_argument("--layouts", nargs="+", default=["per_site", "global"], choices=["per_site", "global"])
    parser.add_argument("--methods", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--tokens", type=int, default=2_000_000, help="the distillation budget of each run")
    parser.add_argument(
        "--method-tokens",
        action="append",
        default=[],
        metavar="METHOD=TOKENS",
        help="a budget for one method instead of --tokens (repeatable)",
    )
    parser.add_argument("--marks", type=int, nargs="+", default=[250_000, 500_000, 1_000_000, 2_000_000])
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="use a student run folder left by an earlier invocation (same recipe) instead of pruning again",
    )
    parser.add_argument("--eval-samples", type=int, default=64, help="evaluation windows (valid.jsonl) per point")
    parser.add_argument(
        "--set",
        dest="common",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a further recipe override for every run (repeatable)",
    )
    parser.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: write --out's table and plot from the rows of earlier outputs",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "distillation.json"))
    return parser.parse_args(argv)


class Marks(TrainerCallback):
    """At each mark of tokens seen, the student's KL and perplexity on the evaluation windows
    (its seconds kept apart, so training's seconds per token exclude them)."""

    def __init__(self, marks: list[int], teacher: Any, windows: list[Any], device: torch.device) -> None:
        self.marks = sorted(marks)
        self.teacher = teacher
        self.windows = windows
        self.device = device
        self.points: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self.measuring = 0.0

    def measure(self, model: Any, tokens: int, step: int) -> None:
        tick = time.perf_counter()
        was = model.training
        model.eval()
        result = compare(self.teacher, model, self.windows, self.device)
        model.train(was)
        self.points.append(
            {
                "tokens": tokens,
                "step": step,
                "kl": result["pruned"]["kl"],
                "ppl": result["pruned"]["ppl"],
                "baseline_ppl": result["baseline"]["ppl"],
                "train_s": time.perf_counter() - self.started - self.measuring,
            }
        )
        self.measuring += time.perf_counter() - tick

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> Any:
        while self.marks and state.num_input_tokens_seen >= self.marks[0]:
            self.marks.pop(0)
            self.measure(model, int(state.num_input_tokens_seen), state.global_step)
        return control


def _student_run(recipe: Any, layout: str, folder: Path, registry: PluginRegistry) -> dict[str, Any]:
    """The recipe without distillation (and without lm-eval or throughput): the student."""
    plain = dataclasses.replace(
        recipe,
        distillation=None,
        output=str(folder),
        slicing=dataclasses.replace(recipe.slicing, layout=layout),
        evaluation=dataclasses.replace(recipe.evaluation, lm_eval=None, throughput=False),
    )
    return run(plain, registry, progress=phase_logger(CONSOLE, f"{layout} student"), overwrite=True)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.combine:
        _write(args, [row for path in args.combine for row in json.loads(Path(path).read_text())["rows"]], show=True)
        return 0
    registry = PluginRegistry()
    recipe = load_recipe(args.recipe, registry, overrides=args.common)
    assert recipe.distillation is not None and recipe.evaluation is not None
    budgets = {m: args.tokens for m in args.methods}
    for item in args.method_tokens:
        method, _, tokens = item.partition("=")
        budgets[method] = int(tokens)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(recipe.model)
    evaluation = dataclasses.replace(recipe.evaluation, num_samples=args.eval_samples)
    windows = token_batches(evaluation, tokenizer, "evaluation")
    work = Path(args.out).with_suffix("")
    rows: list[dict[str, Any]] = []
    for layout in args.layouts:
        folder = work / f"student-{layout}"
        tick = time.perf_counter()
        reused = args.reuse and (folder / "report.json").is_file()
        student_report = (
            json.loads((folder / "report.json").read_text())
            if reused
            else _student_run(recipe, layout, folder, registry)
        )
        prune_s = time.perf_counter() - tick
        for method in args.methods:
            spec = dataclasses.replace(recipe.distillation, method=method, tokens=budgets[method])
            if (
                method == "full"
                and recipe.distillation.method == "lora"
                and not any(s.startswith("distillation.lr=") for s in args.common)
            ):
                spec = dataclasses.replace(spec, lr=None)  # the method's default rate, not LoRA's
            student = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32).to(device)
            teacher = load_model(recipe.model).to(device)
            marks = Marks([m for m in args.marks if m <= spec.tokens], teacher, windows, device)
            marks.measure(student, 0, 0)
            data = distillation_data(spec, tokenizer)
            checkpoints = work / f"checkpoints-{layout}-{method}"
            shutil.rmtree(checkpoints, ignore_errors=True)
            distilled, record = distill(
                student,
                LiveTeacher(teacher, spec.top_k),
                data,
                spec,
                TrainingRun(
                    checkpoints,
                    device,
                    {"benchmark": f"{layout}-{method}"},
                    recipe.seed,
                    phase_logger(CONSOLE, f"{layout} {method}"),
                    callbacks=[marks],
                ),
            )
            final = compare(teacher, distilled.to(device), windows, device)
            shutil.rmtree(checkpoints, ignore_errors=True)
            trained_s = record.train_seconds - marks.measuring
            rows.append(
                {
                    "layout": layout,
                    "method": method,
                    "budget": spec.tokens,
                    "lr": record.lr,
                    "train_s": trained_s,
                    "s_per_million_tokens": trained_s / max(record.tokens, 1) * 1e6,
                    "params": parameter_count(distilled),
                    "baseline_params": student_report["params"]["baseline"],
                    "width": student_report["kept_width"],
                    "prune_s": None if reused else prune_s,
                    "points": marks.points,
                    "final": {
                        "tokens": record.tokens,
                        "best_step": record.best_step,
                        "kl": final["pruned"]["kl"],
                        "ppl": final["pruned"]["ppl"],
                        "baseline_ppl": final["baseline"]["ppl"],
                    },
                    "record": record.to_json(),
                }
            )
            _write(args, rows)
            del student, teacher, distilled
    _write(args, rows, show=True)
    return 0


COLUMNS = ("layout", "method", "params", "tokens", "KL", "KL / undistilled", "ppl", "ppl vs original", "s / M tokens")


def _table(rows: list[dict[str, Any]]) -> list[list[str]]:
    cells = []
    for row in rows:
        start = row["points"][0]
        per_million = row["s_per_million_tokens"]
        for point, label in [
            *((p, f"{p['tokens'] / 1e6:.2f}M") for p in row["points"]),
            (row["final"], f"kept (step {row['final']['best_step']})"),
        ]:
            cells.append(
                [
                    row["layout"],
                    row["method"],
                    f"{row['params']:,}",
                    label,
                    f"{point['kl']:.5f}",
                    f"{point['kl'] / start['kl']:.3f}",
                    f"{point['ppl']:.3f}",
                    f"{100 * (point['ppl'] / point['baseline_ppl'] - 1):+.2f}%",
                    f"{per_million:.0f}",
                ]
            )
    return cells


def _figure(rows: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.5), layout="constrained")
    kl_axes, ppl_axes = figure.subplots(1, 2)
    for row in rows:
        tokens = [p["tokens"] / 1e6 for p in row["points"]]
        label = f"{row['layout']} {row['method']} ({row['params'] / 1e6:.2f}M params)"
        kl_axes.plot(tokens, [p["kl"] for p in row["points"]], marker="o", label=label)
        ppl_axes.plot(tokens, [p["ppl"] for p in row["points"]], marker="o", label=label)
    if rows:
        ppl_axes.axhline(rows[0]["points"][0]["baseline_ppl"], color="grey", linestyle="--", label="original")
    kl_axes.set_yscale("log")
    kl_axes.set_xlabel("distillation tokens (millions)")
    kl_axes.set_ylabel("KL(original ‖ student) on valid.jsonl, nats/token")
    ppl_axes.set_xlabel("distillation tokens (millions)")
    ppl_axes.set_ylabel("perplexity on valid.jsonl")
    kl_axes.legend(fontsize=8)
    ppl_axes.legend(fontsize=8)
    figure.savefig(path, dpi=120, bbox_inches="tight")


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], show: bool = False) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    environment = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
    out.write_text(
        json.dumps(
            {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "environment": environment, "rows": rows},
            indent=2,
        )
        + "\n"
    )
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in _table(rows)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if rows:
        _figure(rows, out.with_suffix(".png"))
    if show:
        table = Table(title="recovery distillation")
        for column in COLUMNS:
            table.add_column(column, justify="right")
        for cells in _table(rows):
            table.add_row(*cells)
        CONSOLE.print(table)
        print(f"wrote {out}, {out.with_suffix('.md')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    sys.exit(main())
