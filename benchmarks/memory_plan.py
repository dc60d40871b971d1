"""Peak device and host memory of each phase of a run, for real model configs, on a machine
without a GPU.

The device side is *measured*: the engine's own code (one decoder layer of the real config, the
head, one calibration batch) runs on fake tensors (`FakeTensorMode`: shapes and dtypes, no
data), and `compressor.evaluation.memtrack.LiveBytes` records the peak of live tensor bytes:
- walk: a layer's weights, then for each of its sites `open_site`, `_Walk.advance` (the batch,
  its projection on the previous basis, the block, C in float64), H of the site in float64,
  the sensitivity strategy's τ candidates (one batched eigendecomposition) and their losses,
  `close_site`;
- H pass: `estimate_fisher` on that layer and the head (sampling, score, gradients) with
  recomputation, one batch per chunk.
Every layer of a model has the same shapes, so one layer stands for all. In the emulation
host and device tensors are both fake CPU tensors, so the batch the walk hands back to the
host and the H pass's stored inputs are counted on the device too: an upper bound.
The host side is *computed* from tensor sizes (weights, the activation store, the H pass's
stored inputs and gradients, H, the bases kept by the walk).

    python benchmarks/memory_plan.py [--samples 1024 --seq-len 2048 --batch-size 4]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from rich.console import Console
from rich.table import Table
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoConfig, AutoModelForCausalLM

import compressor  # noqa: F401
from compressor.engine.activations import ActivationStore
from compressor.engine.bases import close_site, open_site
from compressor.engine.calibration import LayerInputs
from compressor.engine.fisher import estimate_fisher
from compressor.engine.transforms import fuse_norms
from compressor.engine.walk import _Walk
from compressor.evaluation.memtrack import LiveBytes
from compressor.models.families import family_for
from compressor.models.layout import kept_width
from compressor.models.sites import layer_site_ids
from compressor.recipe.sensitivity_options import SensitivityOptions
from compressor.strategies.contract import DEFAULT_TAUS, coupled_losses, frobenius_normalised, tau_candidates

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30

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


def _one_layer(values: dict[str, Any], dtype: torch.dtype) -> tuple[Any, Any, int, int]:
    """The config's model with one decoder layer (fake weights), fused; and its real depth and size."""
    config = AutoConfig.for_model(**{**values, "num_hidden_layers": 1, "max_position_embeddings": 131072})
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    model.requires_grad_(False)
    family = family_for(config.model_type)
    fuse_norms(model, family)
    layer_params = sum(p.numel() for p in model.get_submodule(family.layers).parameters())
    other = sum(p.numel() for p in model.parameters()) - layer_params
    return model, family, values["num_hidden_layers"] * layer_params + other, layer_params


def _inputs(model: Any, family: Any, batch: int, seq_len: int, dtype: torch.dtype) -> LayerInputs:
    d = model.config.hidden_size
    hidden = torch.randn(batch, seq_len, d, dtype=dtype)
    positions = torch.arange(seq_len).unsqueeze(0).expand(batch, -1)
    rotary = model.get_submodule(family.base_model).rotary_emb(hidden, positions)
    store = ActivationStore(torch.device("cpu"))
    store.append(hidden)
    mask = torch.ones(batch, seq_len, dtype=torch.bool)
    kwargs = {"attention_mask": None, "position_ids": positions, "position_embeddings": rotary}
    return LayerInputs(
        hidden=store,
        layer_kwargs=[[kwargs]],
        token_masks=[mask],
        sensitivity_masks=[mask],
        token_counts=[mask.numel()],
        sensitivity_counts=[mask.numel()],
    )


def measure(values: dict[str, Any], batch: int, seq_len: int, sparsity: float) -> dict[str, float]:
    dtype = torch.bfloat16
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, family, params, layer_params = _one_layer(values, dtype)
        d = model.config.hidden_size
        keep = kept_width(d, sparsity, 8)
        layer = model.get_submodule(family.layers)[0]
        head_parts = family.head_modules(model)

        inputs = _inputs(model, family, batch, seq_len, dtype)
        walk_tracker = LiveBytes()
        with walk_tracker:
            walk_tracker.adopt(*layer.parameters())
            previous = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0][:, :keep]
            walk = _Walk(inputs, torch.device("cpu"), None, {}, {}, None)  # type: ignore[arg-type]
            walk.pending = previous
            for site, name in zip(layer.sites(family), layer_site_ids(family, 0)):
                open_site(layer, family, site, previous)
                moment = walk.advance(name, site.block, 0)
                C = moment.value()
                H = torch.randn(d, d, dtype=torch.float32).to(C.device, torch.float64)  # the site's H, as chosen
                # The sensitivity strategy's choice: both statistics normalised, every τ candidate (and
                # PCA's) from one batched eigendecomposition, their losses as one tensor.
                C, H = frobenius_normalised(C), frobenius_normalised(H)
                bases = tau_candidates(C, H, DEFAULT_TAUS)
                losses = coupled_losses(C, H, bases[:, :, keep:])
                chosen = bases[0, :, :keep].contiguous()
                del C, H, bases, losses, moment
                close_site(layer, family, site, previous, chosen)
                previous = walk.pending = chosen

        model, family, _, _ = _one_layer(values, dtype)
        layer = model.get_submodule(family.layers)[0]
        inputs = _inputs(model, family, batch, seq_len, dtype)
        fisher_tracker = LiveBytes()
        with fisher_tracker:
            fisher_tracker.adopt(
                *layer.parameters(), *(p for part in family.head_modules(model) for p in part.parameters())
            )
            estimate_fisher(model, family, inputs, SensitivityOptions(chunk=batch, recompute=True), torch.device("cpu"))
    embedding = values["vocab_size"] * d
    return {
        "params": params,
        "layer_params": layer_params,
        "head_params": sum(p.numel() for part in head_parts for p in part.parameters()),
        "embedding_params": embedding,
        "hidden_size": d,
        "kept": keep,
        "walk_device": walk_tracker.peak["cpu"],
        "fisher_device": fisher_tracker.peak["cpu"],
    }


def plan(
    name: str, values: dict[str, Any], samples: int, seq_len: int, batch: int, chunk: int, sparsity: float
) -> dict[str, Any]:
    m = measure(values, batch, seq_len, sparsity)
    d, layers, keep = m["hidden_size"], values["num_hidden_layers"], m["kept"]
    sites = 2 * layers + 1
    weights = 2 * m["params"]  # bf16
    store = samples * seq_len * d * 2
    position_embeddings = (samples // batch) * 2 * batch * seq_len * values["head_dim"] * 2
    fisher_totals = sites * d * d * 4  # float32 accumulation
    stored = (layers + 1) * chunk * seq_len * d * 2 + chunk * seq_len * d * 2  # layer inputs + gradients
    bases = sites * d * keep * 8
    capture_device = 2 * m["embedding_params"] + batch * seq_len * d * 2 * 2
    pruned_weights = weights * (1 - sparsity)  # close enough for the evaluation row
    f = values["intermediate_size"]
    # `mlp:` (engine.neurons), computed: one layer (bf16), one batch's stream and MLP activation, and at
    # the peak three f x f float64 matrices (C, C + δI and its inverse P while obs inverts it; C and P
    # after, P downdated in place), the down projection and its refit (d x f float64 each); the refit's
    # error feedback (`mlp.feedback`, on by default) adds the reference batch's stream and E[e hᵀ] (d x f
    # float64) on the device and a second copy of the calibration stream on the host.
    mlp_device = 2 * m["layer_params"] + 3 * batch * seq_len * d * 2 + 2 * batch * seq_len * f * 2
    mlp_device += 3 * f * f * 8 + 3 * d * f * 8
    return {
        "model": name,
        "params": m["params"],
        "hidden_size": d,
        "layers": layers,
        "kept_width": keep,
        "device_GiB": {
            "capture": capture_device / GiB,
            "H pass (layer-wise, recompute)": m["fisher_device"] / GiB,
            "walk (one layer, one batch)": m["walk_device"] / GiB,
            "mlp: neurons (one layer, computed)": mlp_device / GiB,
            "evaluation (both models on the device)": (weights + pruned_weights) / GiB,
        },
        "host_GiB": {
            "capture": (weights + store + position_embeddings) / GiB,
            "H pass (layer-wise, recompute)": (weights + store + position_embeddings + stored + fisher_totals) / GiB,
            "walk (one layer, one batch)": (weights + store + position_embeddings + fisher_totals + bases) / GiB,
            "mlp: neurons (one layer, computed)": (weights + 2 * store + position_embeddings) / GiB,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=SensitivityOptions().chunk, help="sensitivity.chunk")
    parser.add_argument("--sparsity", type=float, default=0.25)
    parser.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_plan.json"))
    args = parser.parse_args()
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
