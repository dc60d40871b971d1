"""What the pruning buys: size and speed of the dense model and pruned ones, side by side.

Loads a recipe's model (by default the reference Llama in ../shared) and pruned versions of it,
either pruned here with the recipe (calibration and pruning, no evaluation, nothing saved) or
read from run folders (`--pruned LABEL=RUN ...`: the per-site `sliced_*` model and the global
layout's stock model at the same budget, say), and measures all of them alike, in one process,
their runs interleaved, with `compressor.evaluation.throughput`: parameters (the residual transitions
included, and shown apart), weight bytes, and prefill and decode tokens per second at each
batch size (random prompt of `--prompt-len` tokens, then `--decode-tokens` single-token steps
through the KV cache; warm-up untimed, median of `--repeats`), for each dtype asked.

`--shape NAME` measures speed without a trained model: a random dense model of a built-in shape
(`SHAPES`), the per-site sliced model at `--sparsity` (a random basis per site, transitions
included) and the stock model with one basis at the same parameter budget (`slicing.layout:
global`, the original class). Random weights say nothing of quality; they cost what trained
ones cost. Prints a table and its Markdown (for docs/benchmarks.md), writes JSON.

    .venv/bin/python benchmarks/throughput.py                                   # prune ref-llama at 25% here
    .venv/bin/python benchmarks/throughput.py --pruned per-site=runs/a global=runs/b --dtypes bfloat16
    .venv/bin/python benchmarks/throughput.py --shape llama-150m --sparsity 0.25 --dtypes float32
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import copy
import json
import math
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

import compressor  # noqa: F401  (registers the sliced architectures)
from compressor.engine.bases import apply_bases
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.evaluation.throughput import measure_side_by_side, relative
from compressor.models.budget import param_model, widest_uniform
from compressor.models.families import family_for
from compressor.models.layout import (
    kept_width,
)
from compressor.models.sites import EMBEDDING, site_ids, site_widths
from compressor.models.stock import stock_param_model, to_stock, width_multiple
from compressor.plan.checks import plan
from compressor.recipe.schema import Recipe, load_recipe
from compressor.runtime.loading import load_model, load_tokenizer, resolve_device, token_batches
from compressor.strategies.registry import PluginRegistry

ROOT = Path(__file__).resolve().parent.parent
MB = 10**6


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--recipe",
        default=str(ROOT / "recipes" / "ref_llama_pca.yaml"),
        help="its model is the dense one; without --pruned, it prunes that model here",
    )
    parser.add_argument(
        "--pruned",
        nargs="*",
        default=None,
        metavar="LABEL=RUN",
        help="run folders (or their model/ folders) to load instead, each with a label",
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="random weights of this shape: dense, per-site sliced and stock at one budget",
    )
    parser.add_argument("--sparsity", type=float, default=0.25, help="with --shape: SliceGPT's sparsity")
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"]
    )
    parser.add_argument("--device", default=None, help="default: the recipe's device")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice); 1 is steadier on a busy machine",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "throughput.json"))
    return parser.parse_args()


SHAPES = {
    # A 150M Llama (hidden 1024, 8 layers, GQA 16/4, SwiGLU 2816, 32k vocabulary): big enough that
    # the linears, not Python, take the time on a CPU.
    "llama-150m": dict(
        model_type="llama",
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
}


def _random_orthogonal(d: int, generator: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=generator))[0]


def _shape_models(name: str, sparsity: float, console: Console) -> dict[str, tuple[PreTrainedModel, str]]:
    """A random dense model of `name`'s shape, its per-site sliced model at `sparsity` (SliceGPT's
    layout: the head's input whole) and the stock model with one basis at the same budget."""
    config = AutoConfig.for_model(**SHAPES[name])
    family = family_for(config.model_type)
    ids = site_ids(family, config.num_hidden_layers)
    d = config.hidden_size
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(config).eval()
    kept = kept_width(d, sparsity, 8)
    widths = site_widths(family, config.num_hidden_layers, d, kept, slice_head=False)
    budget = param_model(config, family).count(widths)
    per_site = {site: _random_orthogonal(d, generator)[:, : widths[site]] for site in ids}
    sliced = apply_bases(copy.deepcopy(dense), family, per_site)
    stock_params = stock_param_model(config, family, tied=False)
    step = math.lcm(8, width_multiple(config, family))  # as a run plans it
    width = widest_uniform(stock_params, budget, step, lambda k: {site: k for site in ids})[EMBEDDING]
    basis = _random_orthogonal(d, generator)[:, :width]
    one = apply_bases(copy.deepcopy(dense), family, {site: basis for site in ids}, keep_tied=False)
    stock = to_stock(one, family, config)[0]
    console.log(f"{name}: per-site width {kept} and stock width {width} of {d}, budget {budget:,} parameters")
    return {
        "dense": (dense, f"random {name}"),
        f"per-site {kept}": (sliced, f"sliced_{config.model_type}, sparsity {sparsity:g}, random bases"),
        f"stock {width}": (stock, f"{type(stock).__name__} at hidden {width}, the same budget"),
    }


def _load_run(spec: str) -> tuple[str, PreTrainedModel, str]:
    label, _, path = spec.rpartition("=")
    folder = Path(path)
    folder = folder / "model" if (folder / "model" / "config.json").is_file() else folder
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return label or folder.parent.name, model, str(folder.resolve())


def _pruned_model(
    args: argparse.Namespace, recipe: Recipe, registry: PluginRegistry, device: torch.device, console: Console
) -> tuple[PreTrainedModel, str]:
    """The model pruned here with the recipe, and what it is."""
    checked = plan(recipe, registry)
    batches = token_batches(recipe.calibration, load_tokenizer(recipe.model), "calibration")
    tick = time.perf_counter()
    torch.manual_seed(recipe.seed)
    result = prune(
        load_model(recipe.model),
        checked.layout,
        batches,
        checked.pipeline,
        WalkOptions(device=device, sensitivity=recipe.sensitivity, seed=recipe.seed, pooling=recipe.slicing.pooling),
    )
    console.log(
        f"pruned to {checked.layout.kept}/{checked.layout.config.hidden_size} in {time.perf_counter() - tick:.1f} s"
    )
    return result.model.eval(), f"pruned here: {recipe.sparsity:g} sparsity, {[s.strategy for s in recipe.pipeline]}"


def _rows(dtype: str, sides: dict[str, Any], batches: list[str]) -> list[list[str]]:
    """A row per model, then each pruned model against the dense one (the first)."""

    def cells(side: dict[str, Any]) -> list[str]:
        rates = side["throughput"]["batch"]
        return [
            f"{side['params']:,}",
            f"{side['transition_params']:,}",
            f"{side['weight_bytes'] / MB:.2f}",
            *(f"{rates[b][key]:,.0f}" for b in batches for key in ("prefill_tok_s", "decode_tok_s")),
        ]

    names = list(sides)
    rows = [[dtype, name, *cells(sides[name])] for name in names]
    for name in names[1:]:
        versus = relative(sides[name], sides[names[0]])
        rows.append(
            [
                dtype,
                f"{name} / {names[0]}",
                f"{versus['ratio']['params']:.3f}",
                "",
                f"{versus['ratio']['weight_bytes']:.3f}",
                *(f"{versus['speedup'][b][phase]:.3f}" for b in batches for phase in ("prefill", "decode")),
            ]
        )
    return rows


def main() -> None:
    args = _args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    console = Console(width=None if sys.stdout.isatty() else 160)
    registry = PluginRegistry()
    recipe = load_recipe(args.recipe, registry)
    device = resolve_device(args.device or recipe.device)
    started, load_before = datetime.now(timezone.utc), os.getloadavg()
    if args.shape:
        models = _shape_models(args.shape, args.sparsity, console)
    else:
        models = {"dense": (load_model(recipe.model), recipe.model.path)}
        if args.pruned:
            for spec in args.pruned:
                label, model, source = _load_run(spec)
                models[label] = (model, source)
        else:
            pruned, source = _pruned_model(args, recipe, registry, device, console)
            models["pruned"] = (pruned, source)
    options = dict(
        prompt_len=args.prompt_len,
        decode_tokens=args.decode_tokens,
        batch_sizes=tuple(args.batch_sizes),
        warmup=args.warmup,
        repeats=args.repeats,
    )
    results: dict[str, Any] = {}
    for dtype in args.dtypes:
        cast = getattr(torch, dtype)
        copies = {name: copy.deepcopy(model).to(device, cast) for name, (model, _) in models.items()}
        tick = time.perf_counter()
        results[dtype] = measure_side_by_side(copies, device, **options)
        console.log(f"{dtype}: measured in {time.perf_counter() - tick:.1f} s")
        del copies

    batches = [str(b) for b in args.batch_sizes]
    columns = [
        "dtype",
        "model",
        "params",
        "of which transitions",
        "weight MB",
        *(f"{phase} tok/s b{b}" for b in batches for phase in ("prefill", "decode")),
    ]
    rows = [row for dtype in args.dtypes for row in _rows(dtype, results[dtype], batches)]
    table = Table(
        title=f"throughput on {device} ({torch.get_num_threads()} threads), prompt {args.prompt_len}, "
        f"{args.decode_tokens} decoded, median of {args.repeats}"
    )
    for name in columns:
        table.add_column(name, justify="left" if name in ("dtype", "model") else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    markdown = (
        "\n".join(
            [
                "| " + " | ".join(columns) + " |",
                "|---|---|" + "---:|" * (len(columns) - 2),
                *("| " + " | ".join(row) + " |" for row in rows),
            ]
        )
        + "\n"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "throughput",
                "recipe": str(Path(args.recipe).resolve()),
                "models": {name: source for name, (_, source) in models.items()},
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "options": options,
                "results": results,
                "environment": {
                    "date": started.isoformat(timespec="seconds"),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                    "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(),
                    "device": str(device),
                    "load_average_1_5_15": {"start": load_before, "end": os.getloadavg()},  # other work on the machine
                },
            },
            indent=2,
        )
        + "\n"
    )
    console.print(markdown, markup=False, highlight=False)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
