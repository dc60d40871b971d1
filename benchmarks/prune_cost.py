"""What a prune phase costs against its floor, phase by phase, on CPU or GPU.

The floor of the PCA prune phase is one plain forward pass of the original model over the same
calibration windows; that of the sensitivity prune phase is one forward pass plus one
forward-and-backward pass (gradients for activations only, as the H pass needs). All are measured
here, in one process, on one model: a local model folder (`--model`) or a published config with
random weights (`--config`, e.g. Llama-3.1-8B in bf16: no download, random tokens). For each
phase: wall time (device synchronised), peak device memory, and the host's peak resident memory
during the phase (Linux: the high-water mark is reset as the phase starts; elsewhere it is the
process's so far). `--scales 1 2 4` runs the whole measurement once per multiple of `--samples`,
each in a fresh process, and tabulates how time and memory grow with the calibration tokens.

    .venv/bin/python benchmarks/prune_cost.py --model ../shared/models/ref-llama --samples 128 --seq-len 512
    .venv/bin/python benchmarks/prune_cost.py --model ../shared/models/ref-llama --scales 1 2 4
    python benchmarks/prune_cost.py --config Llama-3.1-8B --device cuda --samples 1024 --seq-len 2048
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import contextlib
import copy
import ctypes
import json
import platform
import re
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

import compressor  # noqa: F401
from compressor.data.batches import Batch
from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.models.families import family_for
from compressor.models.layout import (
    fixed_layout,
    kept_width,
)
from compressor.models.sites import site_widths
from compressor.recipe.sections.sensitivity import SensitivityOptions
from compressor.strategies.registry import PluginRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_plan import CONFIGS

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30
CONFIGS = {
    **CONFIGS,  # the 135M-parameter Llama shape of issue 11 (SmolLM-135M's config)
    "Llama-135M": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
}


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a local model folder")
    source.add_argument("--config", choices=sorted(CONFIGS), help="a published config, random weights")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="default: float32 for --model, bfloat16 for --config",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8, help="calibration batch (the forward floor too)")
    parser.add_argument(
        "--backward-batch-size",
        type=int,
        default=None,
        help="batch of the forward-and-backward floor (default: --batch-size); smaller where a whole"
        " model's graph for a full batch does not fit the device",
    )
    parser.add_argument("--sparsity", type=float, default=0.25)
    parser.add_argument("--pipelines", nargs="+", default=["pca", "sensitivity"])
    parser.add_argument("--chunk", type=int, default=None, help="SensitivityOptions.chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scales",
        nargs="+",
        type=int,
        default=None,
        help="run once per multiple of --samples (fresh processes) and tabulate the growth",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run each prune under torch.profiler; its top operators go beside --out (.txt)",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prune_cost.json"))
    return parser.parse_args()


def _model(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """The original model on the host. Random weights are drawn on `device` (fast) and moved."""
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    config = AutoConfig.for_model(**CONFIGS[args.config], max_position_embeddings=max(args.seq_len, 8192))
    torch.manual_seed(args.seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.to("cpu").eval()


def _batches(vocab: int, args: argparse.Namespace, size: int) -> list[Batch]:
    """Random tokens (a published config has no tokenizer here), every position real."""
    generator = torch.Generator().manual_seed(args.seed)
    out = []
    for start in range(0, args.samples, size):
        rows = min(size, args.samples - start)
        ids = torch.randint(0, vocab, (rows, args.seq_len), generator=generator)
        out.append(Batch(ids, torch.ones_like(ids)))
    return out


def _reset_host_peak() -> bool:
    """Reset this process's resident-memory high-water mark to what is live now (Linux: freed heap
    handed back with glibc's malloc_trim, then clear_refs 5); False elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _host_gib(field: str = "VmHWM") -> float | None:
    """Linux's resident memory now (VmRSS) or its high-water mark since the last reset (VmHWM);
    elsewhere the process's high-water mark (and None for now)."""
    try:
        found = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    except OSError:
        found = None
    if found:
        return int(found.group(1)) * 1024 / GiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB if field == "VmHWM" else None


class Meter:
    """Wall time, device peak and host peak of named phases."""

    def __init__(self, device: torch.device, console: Console) -> None:
        self.device, self.console, self.rows = device, console, []
        self.host_start: float | None = None

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        """Keep a row and print it at once (a long run killed mid-way still shows its phases)."""
        self.rows.append(row)
        self.console.log(
            f"{row['phase'].strip()}: {row['seconds']:.1f} s"
            + (f", device peak {row['device_peak_gib']:.2f} GiB" if row["device_peak_gib"] is not None else "")
        )
        return row

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> float:
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        _reset_host_peak()
        self.host_start = _host_gib("VmRSS")
        return time.perf_counter()

    def stop(self, name: str, started: float, **extra: Any) -> dict[str, Any]:
        self._sync()
        row = {
            "phase": name,
            "seconds": time.perf_counter() - started,
            "device_peak_gib": torch.cuda.max_memory_allocated(self.device) / GiB
            if self.device.type == "cuda"
            else None,
            "host_peak_gib": _host_gib(),
            "host_start_gib": self.host_start,
            **extra,
        }
        return self.add(row)


def forward_floor(model: PreTrainedModel, batches: list[Batch], device: torch.device) -> None:
    """One plain forward pass over the windows (logits included)."""
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device), use_cache=False)


def forward_backward_floor(model: PreTrainedModel, batches: list[Batch], device: torch.device) -> None:
    """One forward-and-backward pass, gradients for the activations only (no weight gradients)."""
    embedding = model.get_input_embeddings()
    for batch in batches:
        ids = batch.input_ids.to(device)
        embeds = embedding(ids).detach().requires_grad_()
        logits = model(inputs_embeds=embeds, attention_mask=batch.attention_mask.to(device), use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(), reduction="sum")
        (grad,) = torch.autograd.grad(loss, embeds)
        del grad, loss, logits


def _pipeline(name: str, registry: PluginRegistry) -> list[PipelineStep]:
    strategy = registry.strategy(name)
    return [PipelineStep(strategy, strategy.parse_options({}))]


class PhaseClock:
    """A progress callback that times the engine's phases (norm fusion and capture, H, the walk)
    as rows of `meter`, each under `prefix`."""

    def __init__(self, meter: Meter, prefix: str) -> None:
        self.meter, self.prefix, self.name, self.tick = meter, prefix, None, 0.0

    def __call__(self, label: str, done: int, total: int) -> None:
        name = "walk" if label.startswith("layer ") else label
        if name == self.name:
            return
        self.meter._sync()
        now = time.perf_counter()
        if self.name is not None:
            self.meter.add(
                {
                    "phase": f"  {self.prefix}: {self.name}",
                    "seconds": now - self.tick,
                    "device_peak_gib": None,
                    "host_peak_gib": None,
                }
            )
        self.name, self.tick = name, now

    def close(self) -> None:
        self("(end)", 0, 0)


def _profiler(enabled: bool, device: torch.device) -> Any:
    if not enabled:
        return contextlib.nullcontext()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def scaling(args: argparse.Namespace) -> None:
    """Each multiple of the calibration tokens measured in a fresh process (its own host peaks);
    one table of how each prune phase's time, ratio to its floor and memory grow."""
    console = Console(width=None if sys.stdout.isatty() else 160)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    passed = list(sys.argv[1:])  # the same options, less --scales and its values (later options override)
    at = passed.index("--scales")
    del passed[at : at + 1 + len(args.scales)]
    runs = []
    for scale in args.scales:
        part = out.with_suffix(f".x{scale}.json")
        command = [sys.executable, __file__, *passed, "--samples", str(args.samples * scale), "--out", str(part)]
        console.log(f"× {scale}: {' '.join(command[1:])}")
        subprocess.run(command, check=True)
        runs.append({"scale": scale, **json.loads(part.read_text())})
    table = Table(title=f"prune cost against calibration tokens: {args.model or args.config}, {args.device}")
    for column in (
        "tokens",
        "pipeline",
        "prune s",
        "floor s",
        "× floor",
        "s per 1× tokens",
        "host peak GiB",
        "host peak above start",
        "device peak GiB",
    ):
        table.add_column(column, justify="right")
    for run in runs:
        for name, row in run["prune"].items():
            first = runs[0]["prune"][name]["seconds"]
            table.add_row(
                f"{run['samples'] * run['seq_len']:,}",
                name,
                f"{row['seconds']:.1f}",
                f"{row['floor_s']:.1f}",
                f"{row['over_floor']:.2f}",
                f"{row['seconds'] / run['scale'] / first * runs[0]['scale']:.2f}",
                f"{row['host_peak_gib']:.2f}",
                "" if row.get("host_start_gib") is None else f"{row['host_peak_gib'] - row['host_start_gib']:.2f}",
                "" if row["device_peak_gib"] is None else f"{row['device_peak_gib']:.2f}",
            )
    console.print(table)
    out.write_text(
        json.dumps({"benchmark": "prune_cost scaling", "scales": args.scales, "runs": runs}, indent=2) + "\n"
    )
    console.print(f"wrote {out}")


def main() -> None:
    args = _args()
    if args.scales:
        return scaling(args)
    transformers.utils.logging.set_verbosity_error()
    console = Console(width=None if sys.stdout.isatty() else 160)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if args.model else "bfloat16"))
    registry = PluginRegistry()
    meter = Meter(device, console)

    tick = meter.start()
    original = _model(args, dtype, device)
    family = family_for(original.config.model_type)
    config = original.config
    meter.stop("build or load the model", tick)
    batches = _batches(config.vocab_size, args, args.batch_size)
    tokens = args.samples * args.seq_len
    console.log(
        f"{args.model or args.config}: {sum(p.numel() for p in original.parameters()):,} parameters, "
        f"{dtype}, {tokens:,} calibration tokens, on {device}"
    )

    on_device = original.to(device)
    forward_floor(on_device, batches[:1], device)  # warm-up (kernels, allocator), untimed
    tick = meter.start()
    forward_floor(on_device, batches, device)
    forward = meter.stop("floor: forward", tick)["seconds"]
    rows = _batches(config.vocab_size, args, args.backward_batch_size or args.batch_size)
    forward_backward_floor(on_device, rows[:1], device)
    tick = meter.start()
    forward_backward_floor(on_device, rows, device)
    backward = meter.stop("floor: forward-and-backward", tick)["seconds"]
    original = on_device.to("cpu")
    del on_device
    if device.type == "cuda":
        torch.cuda.empty_cache()

    kept = kept_width(config.hidden_size, args.sparsity, 8)
    widths = site_widths(family, config.num_hidden_layers, config.hidden_size, kept, False)
    floors = {"pca": forward, "sensitivity": forward + backward}
    results = {}
    for name in args.pipelines:
        model = copy.deepcopy(original)
        progress = PhaseClock(meter, name)
        options = SensitivityOptions(**({"chunk": args.chunk} if args.chunk else {}))
        profiler = _profiler(args.profile, device)
        tick = meter.start()
        with profiler:
            prune(
                model,
                fixed_layout(model.config, family, widths),
                batches,
                _pipeline(name, registry),
                WalkOptions(device=device, sensitivity=options, seed=args.seed, progress=progress),
            )
        progress.close()
        floor = floors.get(name, forward + backward)
        row = meter.stop(f"prune: {name}", tick, floor_s=floor)
        row["over_floor"] = row["seconds"] / floor
        results[name] = row
        if args.profile:
            key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            with Path(args.out).with_suffix(f".{name}.txt").open("w") as file:
                for order in (key, "self_cpu_time_total") if device.type == "cuda" else (key,):
                    file.write(profiler.key_averages().table(sort_by=order, row_limit=40) + "\n")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    table = Table(
        title=f"prune cost: {args.model or args.config}, {args.samples} × {args.seq_len} tokens, "
        f"batch {args.batch_size}, sparsity {args.sparsity}, {device}"
    )
    for column in ("phase", "s", "device peak GiB", "host peak GiB", "× floor"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for row in meter.rows:
        table.add_row(
            row["phase"],
            f"{row['seconds']:.1f}",
            "" if row["device_peak_gib"] is None else f"{row['device_peak_gib']:.1f}",
            "" if row["host_peak_gib"] is None else f"{row['host_peak_gib']:.2f}",
            f"{row['over_floor']:.2f}" if "over_floor" in row else "",
        )
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "prune_cost",
                "model": args.model or args.config,
                "dtype": str(dtype),
                "samples": args.samples,
                "seq_len": args.seq_len,
                "batch_size": args.batch_size,
                "sparsity": args.sparsity,
                "kept": kept,
                "floors_s": {"forward": forward, "forward_and_backward": backward},
                "phases": meter.rows,
                "prune": results,
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "environment": {
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                    "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(),
                    "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                },
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
