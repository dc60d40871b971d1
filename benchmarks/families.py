"""Every supported family on a small random model of its own config class: exactness and the prune
phase's cost against its floor.

No checkpoint of the newer families (Gemma 3, Qwen3.5, SmolLM3, OLMo 2/3, Granite, the MoE ones) is here, so this
measures what a random model can show: (1) a rotation without slicing reproduces the original
logits (max |Δlogit| / max |logit|, float32) and (2) the prune phase of a PCA walk and of a
sensitivity walk (with its H pass) at sparsity 0.25, each against its floor: one forward pass of the
original over the same calibration tokens (one forward-and-backward pass for the sensitivity walk).
Quality figures need trained weights and are not claimed here. Each family's model is the test
suite's (`tests/conftest.py` `FAMILY_CONFIGS`, the families' own features switched on) at a larger
size: hidden 256, 4 layers, 8 heads of 32 (4 KV heads), MLP 768, vocabulary 8192.

    .venv/bin/python benchmarks/families.py                 # every family, table + benchmarks/results/families.json
    .venv/bin/python benchmarks/families.py --only qwen3_5_text gemma3_text
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import platform
import time
from datetime import datetime, timezone

import torch
import transformers
from rich.console import Console
from rich.table import Table

from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor_plugins.pca import PCA
from compressor_plugins.sensitivity import Sensitivity
from tests.conftest import FAMILY_CONFIGS, copy_model, max_relative_logit_error, random_batches, tiny_model, widths_for
from tests.engine.test_equivalence import RandomRotation

SIZE = dict(
    hidden_size=256,
    intermediate_size=768,
    ffn_dim=768,
    moe_intermediate_size=192,  # MoE families: 4 experts of 192, top-2 (the shared expert: 384)
    shared_expert_intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=8192,
    max_position_embeddings=512,
)


def _layer_types(name: str) -> dict:
    """The family's own mix of layer kinds, over four layers."""
    types = FAMILY_CONFIGS[name].get("layer_types")
    return {"layer_types": types * 2} if types else {}


def _timed(work) -> tuple[float, object]:
    start = time.perf_counter()
    out = work()
    return time.perf_counter() - start, out


def measure(name: str, windows: int, seq_len: int, batch: int) -> dict:
    extra = {"no_rope_layers": [1, 0, 1, 1]} if name == "smollm3" else {}
    original = tiny_model(name, **{**SIZE, **_layer_types(name), **extra})
    family = family_for(name)
    config = original.config
    batches = random_batches(config.vocab_size, count=windows // batch, batch=batch, length=seq_len)
    d = config.hidden_size
    full = widths_for(name, config, d, slice_head=True)
    rotated = prune(
        copy_model(original), fixed_layout(config, family, full), batches[:1], [PipelineStep(RandomRotation())]
    )
    error = max_relative_logit_error(original, rotated.model, batches[:1])

    def forward() -> None:
        with torch.no_grad():
            for b in batches:
                original(input_ids=b.input_ids, attention_mask=b.attention_mask)

    def forward_backward() -> None:
        for b in batches:
            original.zero_grad(set_to_none=True)
            out = original(input_ids=b.input_ids, attention_mask=b.attention_mask)
            out.logits.float().logsumexp(-1).sum().backward()
        original.zero_grad(set_to_none=True)

    forward()  # warm up kernels and allocator
    floor_s, _ = _timed(forward)
    original.requires_grad_(True)
    floor_grad_s, _ = _timed(forward_backward)
    original.requires_grad_(False)
    widths = widths_for(name, config, kept_width(d, 0.25, 8), slice_head=family.head_width_is_embedding_width)
    layout = fixed_layout(config, family, widths)
    pca_s, _ = _timed(lambda: prune(copy_model(original), layout, batches, [PipelineStep(PCA())]))
    sens = Sensitivity()
    sens_s, _ = _timed(
        lambda: prune(copy_model(original), layout, batches, [PipelineStep(sens, sens.parse_options({}))])
    )
    return {
        "family": name,
        "parameters": sum(p.numel() for p in original.parameters()),
        "rotation_error": error,
        "forward_s": floor_s,
        "forward_backward_s": floor_grad_s,
        "pca_prune_s": pca_s,
        "sensitivity_prune_s": sens_s,
        "pca_over_forward": pca_s / floor_s,
        "sensitivity_over_forward_backward": sens_s / floor_grad_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=sorted(FAMILY_CONFIGS))
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "families.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [measure(name, args.windows, args.seq_len, args.batch) for name in args.only]
    table = Table(title=f"families: {args.windows} windows x {args.seq_len} tokens, sparsity 0.25, float32")
    for column in (
        "family",
        "params",
        "rotation error",
        "forward s",
        "PCA prune s",
        "x forward",
        "fwd+bwd s",
        "sens. prune s",
        "x fwd+bwd",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["family"],
            f"{r['parameters']:,}",
            f"{r['rotation_error']:.1e}",
            f"{r['forward_s']:.2f}",
            f"{r['pca_prune_s']:.2f}",
            f"{r['pca_over_forward']:.1f}",
            f"{r['forward_backward_s']:.2f}",
            f"{r['sensitivity_prune_s']:.2f}",
            f"{r['sensitivity_over_forward_backward']:.1f}",
        )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "windows": args.windows,
        "seq_len": args.seq_len,
        "batch": args.batch,
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
