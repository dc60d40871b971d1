"""Peak device and host memory of each phase of a run, for real model configs, on a machine
without a GPU: the plan `compress run --dry-run` prints (`compressor/plan/memory.py`), for the
published configs of 3B-70B models, with one GPU's memory beside it.

The device side of the walk and the H pass is *measured*: the engine's own code runs one decoder
layer of the real config (and the head) on fake tensors (`FakeTensorMode`) and
`memtrack.LiveBytes` records the peak of live tensor bytes. Every layer of a model has the same
shapes, so one layer stands for all; host and device tensors are both fake CPU tensors there, so
the batch the walk hands back is counted on the device too (an upper bound). The host side and the
other phases are *computed* from tensor sizes.

    python benchmarks/memory_plan.py [--samples 1024 --seq-len 2048 --batch-size 4]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rich.console import Console
from rich.table import Table
from transformers import AutoConfig

import compressor  # noqa: F401
from compressor.models.families import family_for
from compressor.models.layout import LayoutRequest, sliced_layout
from compressor.plan.memory import PlanSettings, memory_plan
from compressor.recipe.sections.sensitivity import SensitivityOptions
from compressor.stages.costs import GiB

ROOT = Path(__file__).resolve().parent.parent

CONFIGS: dict[str, dict[str, Any]] = {  # the published configs' shapes (config.json of each model)
    "Llama-3.2-3B": dict(
        model_type="llama",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    ),
    "Mistral-7B-v0.3": dict(
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32768,
    ),
    "Llama-3.1-8B": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    ),
    "Mistral-Nemo-12B": dict(
        model_type="mistral",
        hidden_size=5120,
        intermediate_size=14336,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=131072,
    ),
    "Phi-3-medium": dict(
        model_type="phi3",
        hidden_size=5120,
        intermediate_size=17920,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=10,
        head_dim=128,
        vocab_size=32064,
    ),
    "Llama-3.1-70B": dict(
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    ),
}


def plan(
    name: str, values: dict[str, Any], samples: int, seq_len: int, batch: int, chunk: int, sparsity: float
) -> dict[str, Any]:
    """The run's memory plan for a published config: the walk (sensitivity, H), the MLP stage
    with its feedback, evaluation; bf16 weights, activations on the host, on an accelerator."""
    config = AutoConfig.for_model(**{**values, "max_position_embeddings": 131072})
    family = family_for(config.model_type)
    layout = sliced_layout(config, family, [family], LayoutRequest(sparsity=sparsity, round_to=8))
    settings = PlanSettings(
        dtype="bfloat16", samples=samples, seq_len=seq_len, batch=batch, chunk=chunk, recompute=True, mlp_feedback=0.5
    )
    memory = memory_plan(settings, layout, needs_h=True, accelerator=True)
    return {
        "model": name,
        "params": layout.params.original,
        "hidden_size": config.hidden_size,
        "layers": config.num_hidden_layers,
        "kept_width": layout.kept,
        "device_GiB": {phase.name: (phase.device or 0) / GiB for phase in memory.phases},
        "host_GiB": {phase.name: phase.host / GiB for phase in memory.phases},
    }


def recipe_plan(path: Path, model_path: str | None, overrides: list[str]) -> None:
    """A recipe's plan as a run on a GPU makes it (`plan.memory.run_memory_plan` with an accelerator),
    printed phase by phase, without a GPU here."""
    import torch

    from compressor.plan.checks import plan as checked_plan
    from compressor.plan.memory import run_memory_plan
    from compressor.recipe.schema import load_recipe
    from compressor.strategies.registry import PluginRegistry

    registry = PluginRegistry()
    overrides = [*([f"model.path={model_path}"] if model_path is not None else []), *overrides]
    recipe = load_recipe(path, registry, overrides)
    checked = checked_plan(recipe, registry)
    memory = run_memory_plan(recipe, checked, torch.device("cuda"))
    table = Table(title=f"{path}: {memory.shape} (host figures include this process, {memory.base / GiB:.1f} GiB)")
    for column in ("phase", "host (GiB)", "device (GiB)"):
        table.add_column(column)
    for phase in memory.phases:
        table.add_row(phase.name, f"{phase.host / GiB:.1f}", f"{(phase.device or 0) / GiB:.1f}")
    console = Console(width=160)
    console.print(table)
    for note in memory.notes:
        console.print(note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=SensitivityOptions().chunk, help="sensitivity.chunk")
    parser.add_argument("--sparsity", type=float, default=0.25)
    parser.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_plan.json"))
    parser.add_argument(
        "--config-folder",
        type=Path,
        help="write each model's config.json (no weights) under FOLDER/<model> and stop: a folder "
        "`compress run RECIPE --dry-run --set model.path=FOLDER/<model>` plans with, without the hub",
    )
    parser.add_argument(
        "--recipe",
        type=Path,
        help="print the plan of this recipe on a machine with a GPU (its `model.path` replaced by "
        "--model-path, e.g. a --config-folder folder), as `--dry-run` prints it on that machine",
    )
    parser.add_argument("--model-path", help="with --recipe: the model folder whose config is planned for")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="with --recipe: as `compress run --set`"
    )
    args = parser.parse_args()
    if args.recipe is not None:
        recipe_plan(args.recipe, args.model_path, args.set)
        return
    if args.config_folder is not None:
        for name in args.models:
            config = AutoConfig.for_model(**{**CONFIGS[name], "max_position_embeddings": 131072})
            config.save_pretrained(args.config_folder / name)
            print(args.config_folder / name)
        return
    rows = [
        plan(name, CONFIGS[name], args.samples, args.seq_len, args.batch_size, args.chunk, args.sparsity)
        for name in args.models
    ]
    table = Table(
        title=f"peak memory (GiB), {args.samples} × {args.seq_len} tokens, batch {args.batch_size}, "
        f"bf16, H chunk {args.chunk} sequences, sparsity {args.sparsity}"
    )
    for column in ("model", "phase", "device (measured)", "host (computed)", "fits 80 GB", "fits 141 GB"):
        table.add_column(column)
    for row in rows:
        for phase, device in row["device_GiB"].items():
            host = row["host_GiB"].get(phase)
            table.add_row(
                row["model"],
                phase,
                f"{device:.1f}",
                "" if host is None else f"{host:.0f}",
                "yes" if device * GiB <= 80e9 else "no",
                "yes" if device * GiB <= 141e9 else "no",
            )
    Console(width=160).print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
