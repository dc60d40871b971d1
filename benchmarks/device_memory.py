"""Peak accelerator and host memory of each prune phase against the calibration tokens, without a GPU.

The engine runs its own code, every move between host and device and every lifetime as on a GPU,
with the meta device standing in for the accelerator (`compressor.evaluation.memtrack.emulated_accelerator`:
tensors there have shapes and no data), and `compressor.evaluation.memtrack.LiveBytes` counts the live bytes
on each side: the accelerator's ("meta") and the host's ("cpu"). So a whole prune of a real
config at real token counts costs seconds to minutes, and shows how device and host memory grow
with the calibration tokens. What it leaves out: the allocator's rounding and caching, and
kernels' own workspaces (cuBLAS, cuSOLVER). Attention runs a fused kernel's shapes (the output
and a log-sum-exp per row, as a GPU's flash or memory-efficient kernel), not the math path's
attention weights. Weights are uninitialised: the chosen bases mean nothing, their sizes are exact.

    .venv/bin/python benchmarks/device_memory.py --config Llama-135M --samples 128 --seq-len 512
    .venv/bin/python benchmarks/device_memory.py --config Llama-3.1-8B --layers 2 --samples 1024 \\
        --seq-len 2048 --batch-size 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

import compressor  # noqa: F401
from compressor.data.batches import Batch
from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.evaluation.memtrack import LiveBytes, emulated_accelerator
from compressor.models.families import family_for
from compressor.models.layout import (
    fixed_layout,
    kept_width,
)
from compressor.models.sites import site_widths
from compressor.recipe.sections.sensitivity import SensitivityOptions
from compressor.strategies.registry import PluginRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prune_cost import CONFIGS

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, choices=sorted(CONFIGS), help="a published config")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (default: the config's); the device holds one layer at a time, so "
        "fewer layers keep the host side small without changing the device's peak",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--samples", type=int, default=128, help="calibration windows at 1×")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--scales", nargs="+", type=int, default=[1, 2, 4], help="multiples of --samples")
    parser.add_argument("--chunk", type=int, default=None, help="sensitivity.chunk (sequences per H-pass chunk)")
    parser.add_argument("--sparsity", type=float, default=0.25)
    parser.add_argument("--pipelines", nargs="+", default=["pca", "sensitivity"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "device_memory.json"))
    return parser.parse_args()


def _model(args: argparse.Namespace) -> PreTrainedModel:
    """The config's model on the host, uninitialised (nothing drawn; untouched pages cost nothing)."""
    values = {**CONFIGS[args.config], "max_position_embeddings": max(args.seq_len, 8192)}
    if args.layers:
        values["num_hidden_layers"] = args.layers
    config = AutoConfig.for_model(**values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    return model.to_empty(device="cpu").eval()


def _batches(vocab: int, samples: int, args: argparse.Namespace) -> list[Batch]:
    generator = torch.Generator().manual_seed(args.seed)
    out = []
    for start in range(0, samples, args.batch_size):
        ids = torch.randint(0, vocab, (min(args.batch_size, samples - start), args.seq_len), generator=generator)
        out.append(Batch(ids, torch.ones_like(ids)))
    return out


AFTER_WALK = "head and sliced model"
"""After the last layer the engine rotates the head on the host and re-homes the weights in a
`sliced_*` model built on the meta device: there meta bytes are placeholders, not the device's."""


ENGINE_ORDER = ("fusing norms", "capturing layer inputs", "estimating output sensitivity (H)", "walk", AFTER_WALK)


class PhasePeaks:
    """A progress callback: each engine phase's peak live bytes on the device and on the host."""

    def __init__(self, tracker: LiveBytes) -> None:
        self.tracker, self.name, self.rows = tracker, None, []

    def __call__(self, label: str, done: int, total: int) -> None:
        name = label
        if label.startswith("layer "):
            name = AFTER_WALK if done == total else "walk"
        if name == self.name:
            return
        if self.name is not None:
            device = None if self.name == AFTER_WALK else self.tracker.peak["meta"] / GiB
            self.rows.append({"phase": self.name, "device_gib": device, "host_gib": self.tracker.peak["cpu"] / GiB})
        self.tracker.reset_peak()
        self.name = name

    def close(self) -> list[dict[str, Any]]:
        self("(end)", 0, 0)
        return self.rows


def measure(args: argparse.Namespace, pipeline: str, samples: int, registry: PluginRegistry) -> list[dict[str, Any]]:
    """One prune on the emulated accelerator; its phases' peaks."""
    model = _model(args)
    config = model.config
    family = family_for(config.model_type)
    widths = site_widths(
        family, config.num_hidden_layers, config.hidden_size, kept_width(config.hidden_size, args.sparsity, 8), False
    )
    strategy = registry.strategy(pipeline)
    options = SensitivityOptions(**({"chunk": args.chunk} if args.chunk else {}))
    tracker = LiveBytes()
    phases = PhasePeaks(tracker)
    with emulated_accelerator() as device, tracker:
        tracker.adopt(*model.parameters(), *model.buffers())
        prune(
            model,
            fixed_layout(model.config, family, widths),
            _batches(config.vocab_size, samples, args),
            [PipelineStep(strategy, strategy.parse_options({}))],
            WalkOptions(device=device, sensitivity=options, seed=args.seed, progress=phases),
        )
    return phases.close()


def _cell(phase: dict[str, Any] | None) -> str:
    if phase is None:
        return ""
    device = "—" if phase["device_gib"] is None else f"{phase['device_gib']:.2f}"
    return f"{device} / {phase['host_gib']:.2f}"


def main() -> None:
    args = _args()
    transformers.utils.logging.set_verbosity_error()
    console = Console(width=None if sys.stdout.isatty() else 160)
    registry = PluginRegistry()
    runs = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("pruning on the emulated accelerator", total=len(args.scales) * len(args.pipelines))
        for scale in args.scales:
            for pipeline in args.pipelines:
                samples = args.samples * scale
                progress.update(task, description=f"{pipeline}, {samples} × {args.seq_len} tokens")
                phases = measure(args, pipeline, samples, registry)
                runs.append(
                    {
                        "scale": scale,
                        "samples": samples,
                        "tokens": samples * args.seq_len,
                        "pipeline": pipeline,
                        "phases": phases,
                        "device_peak_gib": max(p["device_gib"] or 0.0 for p in phases),
                        "host_peak_gib": max(p["host_gib"] for p in phases),
                    }
                )
                progress.advance(task)
    layers = args.layers or CONFIGS[args.config]["num_hidden_layers"]
    table = Table(
        title=f"peak live bytes (GiB) on the emulated accelerator: {args.config}, {layers} layers, "
        f"{args.dtype}, batch {args.batch_size}, sparsity {args.sparsity}"
    )
    seen = [p["phase"] for run in runs for p in run["phases"]]
    phases = [p for p in ENGINE_ORDER if p in seen] + [p for p in dict.fromkeys(seen) if p not in ENGINE_ORDER]
    for column in ("tokens", "pipeline", *[f"{phase}: device / host" for phase in phases], "device peak", "host peak"):
        table.add_column(column, justify="right")
    for run in runs:
        by_phase = {p["phase"]: p for p in run["phases"]}
        table.add_row(
            f"{run['tokens']:,}",
            run["pipeline"],
            *[_cell(by_phase.get(p)) for p in phases],
            f"{run['device_peak_gib']:.2f}",
            f"{run['host_peak_gib']:.2f}",
        )
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "device_memory",
                "config": args.config,
                "layers": layers,
                "settings": vars(args),
                "runs": runs,
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "environment": {
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "python": platform.python_version(),
                },
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
