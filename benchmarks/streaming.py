"""Streamed weights against the model in memory: peak resident memory and wall time of the same
prune, each mode in its own process, on a random model with a real model's layer shape.

    python benchmarks/streaming.py [--hidden 4096 --intermediate 14336 --layers 6 --vocab 32000]
                                   [--dtype bfloat16] [--device cpu] [--layout per_site|global]

The model is written once, in bfloat16 safetensors shards, under benchmarks/results/; each mode
then prunes it (per-site PCA at sparsity 0.25, no H, calibration on random tokens) in a fresh
process and leaves the pruned model on disk, as a run does (`--layout global`: one basis from
every site's pooled C, saved as the original class at the kept width, `models.stock`):
- `memory` loads the whole model with `from_pretrained`, walks it (`engine.prune` keeps every
  sliced layer) and saves it with `save_pretrained` (global: `stock.save_stock`);
- `stream` builds the shell of `engine.streaming`, reads each layer when the walk reaches it and
  writes it to the output's shards as soon as it is sliced (`WalkOptions.write_to`, with a
  checkpoint as a run has, which also keeps the bases and H on disk).
Peak RSS is the operating system's (each child's own `ru_maxrss`: mapped shard pages that were
touched count too); on a GPU the device's peak is `torch.cuda.max_memory_allocated`. Wall time is
the child's whole life (imports, load, prune, save). The two saved models are compared bit for bit.
Prints a table and writes JSON (and Markdown) to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def write_model(folder: Path, args: argparse.Namespace) -> int:
    """A random Llama of the given shape, saved in bfloat16 shards; its weight bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type="llama",
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=max(1, args.hidden // 512),
        head_dim=128,
        vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder, max_shard_size="2GB")
        del model
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _folder_digest(folder: Path) -> str:
    """sha256 over every tensor of a saved folder, by name (shard boundaries do not matter)."""
    import hashlib

    import torch
    from safetensors import safe_open

    tensors: dict[str, Path] = {}
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            tensors.update({name: shard for name in handle.keys()})  # noqa: SIM118 (not a dict)
    digest = hashlib.sha256()
    for name in sorted(tensors):
        with safe_open(str(tensors[name]), framework="pt") as handle:
            tensor = handle.get_tensor(name)
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def child(args: argparse.Namespace) -> None:
    """One mode's prune and save, in this process: prints a JSON line with its figures."""
    import torch
    from transformers import AutoModelForCausalLM

    import compressor  # noqa: F401
    from compressor.data.batches import Batch
    from compressor.engine.checkpoint import Checkpoint
    from compressor.engine.pooling import PipelineStep
    from compressor.engine.streaming import streamed, streamed_model
    from compressor.engine.walk import prune
    from compressor.engine.walk_options import WalkOptions
    from compressor.models.families import family_for
    from compressor.models.layout import fixed_layout, kept_width
    from compressor.models.sites import site_ids, site_widths
    from compressor.models.stock import save_stock
    from compressor_plugins.pca import PCA

    torch.set_num_threads(args.threads)
    family = family_for("llama")
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    started = time.perf_counter()
    if args.child == "stream":
        model = streamed_model(args.folder, family, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype).eval()
    loaded = time.perf_counter()
    config = model.config
    kept = kept_width(config.hidden_size, 0.25, 8)
    widths = (
        dict.fromkeys(site_ids(family, config.num_hidden_layers), kept)  # one basis: one width everywhere
        if args.layout == "global"
        else site_widths(family, config.num_hidden_layers, config.hidden_size, kept, False)
    )
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.batches):
        ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=generator)
        batches.append(Batch(ids, torch.ones_like(ids)))
    output = Path(args.output)
    with tempfile.TemporaryDirectory(prefix="streaming-benchmark-") as scratch:
        checkpoint = Checkpoint(Path(scratch) / "checkpoint")
        checkpoint.start({"benchmark": args.child})
        options = WalkOptions(device=device, write_to=output if args.child == "stream" else None, checkpoint=checkpoint)
        layout = fixed_layout(config, family, widths, layout=args.layout)
        result = prune(model, layout, batches, [PipelineStep(PCA())], options)
        pruned = time.perf_counter()
        if args.child == "memory" and args.layout == "global":
            save_stock(result.model, family, layout.config, output)
        elif args.child == "memory":
            result.model.save_pretrained(output)
    done = time.perf_counter()
    source = streamed(model)
    print(
        json.dumps(
            {
                "load_s": loaded - started,
                "prune_s": pruned - loaded,
                "save_s": done - pruned,
                "digest": _folder_digest(output),
                "layers_resident_at_once": None if source is None else source.peak_resident,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", help="the run's dtype (the shards are bfloat16)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layout", choices=["per_site", "global"], default="per_site")
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path)
    parser.add_argument("--child", choices=["memory", "stream"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "streaming.json"))
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    args.folder = args.folder or RESULTS / f"random-llama-{args.hidden}x{args.layers}"
    weight_bytes = write_model(args.folder, args)
    rows: list[dict[str, Any]] = []
    for mode in ("memory", "stream"):
        with tempfile.TemporaryDirectory(prefix=f"streaming-{mode}-", dir=RESULTS) as output:
            started = time.perf_counter()
            command = [sys.executable, __file__, "--child", mode, "--folder", str(args.folder), "--output", output]
            command += ["--batches", str(args.batches), "--batch-size", str(args.batch_size)]
            command += ["--seq-len", str(args.seq_len), "--threads", str(args.threads)]
            command += ["--dtype", args.dtype, "--device", args.device, "--layout", args.layout]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"the {mode} child failed:\n{done.stderr[-3000:]}")
            wall = time.perf_counter() - started
        rows.append({"mode": mode, "wall_s": wall, **json.loads(done.stdout.splitlines()[-1])})
    from rich.console import Console
    from rich.table import Table

    identical = rows[0]["digest"] == rows[1]["digest"]
    goal = 0.25 * weight_bytes + 1.5e9
    table = Table(
        title=f"prune and save ({args.layout}) of a random Llama {args.hidden}×{args.layers} layers "
        f"({weight_bytes / 2**30:.2f} GiB "
        f"bf16 on disk, {args.dtype} in the run, {args.device}), bit-identical: {identical}; goal: streamed peak "
        f"RSS ≤ 0.25 × weights + 1.5 GB = {goal / 2**30:.2f} GiB, wall ≤ 1.2 × memory"
    )
    columns = (
        "mode",
        "peak RSS (GiB)",
        "RSS / weights on disk",
        "device peak (GiB)",
        "wall (s)",
        "prune (s)",
        "save (s)",
    )
    for column in columns:
        table.add_column(column)
    for row in rows:
        peak = row["peak_rss_bytes"]
        table.add_row(
            row["mode"],
            f"{peak / 2**30:.2f}",
            f"{peak / weight_bytes:.2f}",
            "-" if row["peak_device_bytes"] is None else f"{row['peak_device_bytes'] / 2**30:.2f}",
            f"{row['wall_s']:.0f}",
            f"{row['prune_s']:.0f}",
            f"{row['save_s']:.1f}",
        )
    Console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "weight_bytes": weight_bytes,
        "goal_peak_rss_bytes": goal,
        "bit_identical": identical,
        "rows": rows,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        "| mode | peak RSS (GiB) | device peak (GiB) | wall (s) | prune (s) | save (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['mode']} | {r['peak_rss_bytes'] / 2**30:.2f} | "
        f"{'-' if r['peak_device_bytes'] is None else format(r['peak_device_bytes'] / 2**30, '.2f')} | "
        f"{r['wall_s']:.0f} | {r['prune_s']:.0f} | {r['save_s']:.1f} |"
        for r in rows
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
