"""What per-site checkpoints cost: the prune phase with and without a checkpoint, side by side.

Loads a recipe's model and calibration data once, then times `engine.prune` on a fresh copy of
the model, alternating runs without a checkpoint and with one (H and every site written to a
temporary folder), and reports median wall times, the overhead and the checkpoint's size.

    python benchmarks/checkpoint_overhead.py --recipe recipes/ref_llama_sens.yaml --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
from rich.console import Console
from rich.table import Table

from compressor.engine.checkpoint import Checkpoint
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.plan.checks import plan
from compressor.recipe.schema import load_recipe
from compressor.runtime.loading import load_model, load_tokenizer, resolve_device, token_batches
from compressor.strategies.registry import PluginRegistry

ROOT = Path(__file__).resolve().parent.parent


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "ref_llama_sens.yaml"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint_overhead.json"))
    args = parser.parse_args()
    registry = PluginRegistry()
    recipe = load_recipe(args.recipe, registry)
    checked = plan(recipe, registry)
    device = resolve_device(recipe.device)
    batches = token_batches(recipe.calibration, load_tokenizer(recipe.model), "calibration")
    original = load_model(recipe.model)

    def once(with_checkpoint: bool) -> tuple[float, int]:
        model = copy.deepcopy(original)
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = Checkpoint(Path(folder) / "checkpoint") if with_checkpoint else None
            if checkpoint is not None:
                checkpoint.start({"benchmark": "1"})
            torch.manual_seed(recipe.seed)
            tick = time.perf_counter()
            prune(
                model,
                checked.layout,
                batches,
                checked.pipeline,
                WalkOptions(device=device, sensitivity=recipe.sensitivity, seed=recipe.seed, checkpoint=checkpoint),
            )
            elapsed = time.perf_counter() - tick
            return elapsed, _size(Path(folder))

    runs: dict[str, list[float]] = {"without": [], "with": []}
    size = 0
    for _ in range(args.repeats):
        runs["without"].append(once(False)[0])
        elapsed, size = once(True)
        runs["with"].append(elapsed)
    median = {key: statistics.median(values) for key, values in runs.items()}
    result: dict[str, Any] = {
        "recipe": args.recipe,
        "pipeline": [s.strategy for s in recipe.pipeline],
        "repeats": args.repeats,
        "prune_s": runs,
        "median_s": median,
        "overhead_s": median["with"] - median["without"],
        "overhead_ratio": median["with"] / median["without"],
        "checkpoint_bytes": size,
        "torch_threads": torch.get_num_threads(),
    }
    table = Table(title=f"prune phase, {Path(args.recipe).name}, median of {args.repeats}")
    for column in ("checkpoint", "prune s (median)", "runs", "checkpoint size"):
        table.add_column(column)
    table.add_row("none", f"{median['without']:.2f}", ", ".join(f"{t:.2f}" for t in runs["without"]), "")
    table.add_row(
        "per site + H", f"{median['with']:.2f}", ", ".join(f"{t:.2f}" for t in runs["with"]), f"{size / 2**20:.1f} MiB"
    )
    console = Console()
    console.print(table)
    console.print(f"overhead: {result['overhead_s']:+.2f} s ({result['overhead_ratio']:.3f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
