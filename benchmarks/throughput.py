"""What the pruning buys: size and speed of the dense and the pruned model, side by side.

Loads a recipe's model (by default the reference Llama in ../shared) and its pruned version,
either pruned here with the recipe (calibration and pruning, no evaluation, nothing saved) or
read from a run folder (`--pruned`), and measures both alike with `compressor.throughput`:
parameters (the residual transitions included, and shown apart), weight bytes, and prefill and
decode tokens per second at each batch size (random prompt of `--prompt-len` tokens, then
`--decode-tokens` single-token steps through the KV cache; warm-up untimed, median of
`--repeats`), for each dtype asked. Prints a table and its Markdown (for docs/benchmarks.md),
writes JSON.

    .venv/bin/python benchmarks/throughput.py                                   # prune ref-llama at 25% here
    .venv/bin/python benchmarks/throughput.py --pruned runs/demo-pca-25 --dtypes bfloat16
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedModel  # noqa: E402

import compressor  # noqa: E402,F401  (registers the sliced architectures)
from compressor.engine import prune  # noqa: E402
from compressor.plugins import PluginRegistry  # noqa: E402
from compressor.recipe import Recipe, load_recipe  # noqa: E402
from compressor.runner import load_model, load_tokenizer, plan, resolve_device, token_batches  # noqa: E402
from compressor.throughput import compare_speed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MB = 10**6


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "ref_llama_pca.yaml"),
                        help="its model is the dense one; without --pruned, it prunes that model here")
    parser.add_argument("--pruned", default=None, help="a run folder (or its model/ folder) to load instead")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="default: the recipe's device")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice); 1 is steadier on a busy machine")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "throughput.json"))
    return parser.parse_args()


def _pruned_model(args: argparse.Namespace, recipe: Recipe, registry: PluginRegistry, device: torch.device,
                  console: Console) -> tuple[PreTrainedModel, str]:
    """The pruned model and where it came from."""
    if args.pruned:
        folder = Path(args.pruned)
        folder = folder / "model" if (folder / "model" / "config.json").is_file() else folder
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), str(folder.resolve())
    checked = plan(recipe, registry)
    batches = token_batches(recipe.calibration, load_tokenizer(recipe.model), "calibration")
    tick = time.perf_counter()
    torch.manual_seed(recipe.seed)
    result = prune(load_model(recipe.model), checked.family, batches, checked.widths, checked.pipeline, device,
                   sensitivity=recipe.sensitivity, seed=recipe.seed)
    console.log(f"pruned to {checked.kept}/{checked.config.hidden_size} in {time.perf_counter() - tick:.1f} s")
    return result.model.eval(), f"pruned here: {recipe.sparsity:g} sparsity, {[s.strategy for s in recipe.pipeline]}"


def _rows(dtype: str, result: dict[str, Any], batches: list[str]) -> list[list[str]]:
    def cells(side: dict[str, Any]) -> list[str]:
        rates = side["throughput"]["batch"]
        return [f"{side['params']:,}", f"{side['transition_params']:,}", f"{side['weight_bytes'] / MB:.2f}",
                *(f"{rates[b][key]:,.0f}" for b in batches for key in ("prefill_tok_s", "decode_tok_s"))]

    ratio = [f"{result['ratio']['params']:.3f}", "", f"{result['ratio']['weight_bytes']:.3f}",
             *(f"{result['speedup'][b][phase]:.3f}" for b in batches for phase in ("prefill", "decode"))]
    return [[dtype, "dense", *cells(result["baseline"])], [dtype, "pruned", *cells(result["pruned"])],
            [dtype, "pruned / dense", *ratio]]


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
    pruned, source = _pruned_model(args, recipe, registry, device, console)
    dense = load_model(recipe.model)
    options = dict(prompt_len=args.prompt_len, decode_tokens=args.decode_tokens, batch_sizes=tuple(args.batch_sizes),
                   warmup=args.warmup, repeats=args.repeats)
    results: dict[str, Any] = {}
    for dtype in args.dtypes:
        cast = getattr(torch, dtype)
        base, cut = copy.deepcopy(dense).to(device, cast), copy.deepcopy(pruned).to(device, cast)
        tick = time.perf_counter()
        results[dtype] = compare_speed(base, cut, device, **options)
        console.log(f"{dtype}: measured in {time.perf_counter() - tick:.1f} s")
        del base, cut

    batches = [str(b) for b in args.batch_sizes]
    columns = ["dtype", "model", "params", "of which transitions", "weight MB",
               *(f"{phase} tok/s b{b}" for b in batches for phase in ("prefill", "decode"))]
    rows = [row for dtype in args.dtypes for row in _rows(dtype, results[dtype], batches)]
    table = Table(title=f"throughput on {device} ({torch.get_num_threads()} threads), prompt {args.prompt_len}, "
                        f"{args.decode_tokens} decoded, median of {args.repeats}")
    for name in columns:
        table.add_column(name, justify="left" if name in ("dtype", "model") else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    markdown = "\n".join(["| " + " | ".join(columns) + " |", "|---|---|" + "---:|" * (len(columns) - 2),
                          *("| " + " | ".join(row) + " |" for row in rows)]) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "throughput",
        "recipe": str(Path(args.recipe).resolve()),
        "dense": recipe.model.path,
        "pruned": source,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "options": options,
        "results": results,
        "environment": {
            "date": started.isoformat(timespec="seconds"), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": str(device),
            "load_average_1_5_15": {"start": load_before, "end": os.getloadavg()},  # other work on the machine
        },
    }, indent=2) + "\n")
    console.print(markdown, markup=False, highlight=False)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
