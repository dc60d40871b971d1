"""The device side of the memory plan, measured: the engine's own code runs one decoder layer of the
real config, and the head, on fake tensors (`FakeTensorMode`: shapes and dtypes, no data, so a 70B
layer costs nothing), and `memtrack.LiveBytes` records the peak of live bytes. Every layer has the
same shapes, so one stands for all. The time plan builds its one real layer the same way."""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from compressor.errors import UserError


def small_model(config: Any, dtype: torch.dtype, attention: str, depth: int) -> Any:
    """The config's model with `depth` decoder layers, on fake tensors (inside FakeTensorMode)."""
    from transformers import AutoModelForCausalLM

    single = copy.deepcopy(config)
    single.num_hidden_layers = depth
    if isinstance(getattr(single, "layer_types", None), list):
        single.layer_types = single.layer_types[:depth]
    model = AutoModelForCausalLM.from_config(single, dtype=dtype, attn_implementation=attention).eval()
    model.requires_grad_(False)
    return model


def layer_inputs(model: Any, family: Any, batch: int, seq_len: int, dtype: torch.dtype, depth: int = 1) -> Any:
    """One calibration batch as the first layer receives it (fake): the stream, positions and, for
    rotary families, the rotary embedding."""
    from compressor.engine.activations import ActivationStore
    from compressor.engine.calibration import LayerInputs

    hidden = torch.randn(batch, seq_len, model.config.hidden_size, dtype=dtype)
    positions = torch.arange(seq_len).unsqueeze(0).expand(batch, -1)
    kwargs: dict[str, Any] = {"attention_mask": None, "position_ids": positions}
    rotary = getattr(model.get_submodule(family.base_model), "rotary_emb", None)
    if rotary is not None:
        by_type = "layer_type" in inspect.signature(rotary.forward).parameters  # Gemma 3: one RoPE per layer type
        kind = {"layer_type": model.config.layer_types[0]} if by_type else {}
        kwargs["position_embeddings"] = rotary(hidden, positions, **kind)
    store = ActivationStore(torch.device("cpu"))
    store.append(hidden)
    mask = torch.ones(batch, seq_len, dtype=torch.bool)
    return LayerInputs(
        hidden=store,
        layer_kwargs=[[kwargs] * depth],
        token_masks=[mask],
        sensitivity_masks=[mask],
        token_counts=[mask.numel()],
        sensitivity_counts=[mask.numel()],
    )


@dataclass(frozen=True)
class FakeBatch:
    """The calibration batch a fake layer is measured on, and the dtype and attention it runs in:
    what every peak of one plan shares."""

    dtype: torch.dtype
    batch: int
    seq_len: int
    attention: str = "sdpa"
    """The model's attention implementation."""


def prepared(config: Any, family: Any, shape: FakeBatch, depth: int) -> Any:
    """A fused fake model of `depth` layers and one calibration batch for it (inside FakeTensorMode)."""
    from compressor.engine.transforms import fuse_norms

    model = small_model(config, shape.dtype, shape.attention, depth)
    fuse_norms(model, family)
    return model, layer_inputs(model, family, shape.batch, shape.seq_len, shape.dtype, depth)


def walk_peak(config: Any, family: Any, shape: FakeBatch, kept: int) -> int:
    """Device peak (bytes) of the walk through one layer: its weights, each site opened, one batch
    run and its C, the sensitivity strategy's τ candidates and losses, the site closed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compressor.engine.bases import close_site, open_site
    from compressor.engine.site_walk import SiteWalk
    from compressor.evaluation.memtrack import LiveBytes
    from compressor.models.sites import layer_site_ids
    from compressor.strategies.contract import DEFAULT_TAUS, coupled_losses, frobenius_normalised, tau_candidates

    cpu, d = torch.device("cpu"), config.hidden_size
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, inputs = prepared(config, family, shape, 1)
        layer = model.get_submodule(family.layers)[0]
        tracker = LiveBytes()
        with tracker:
            tracker.adopt(*layer.parameters())
            previous = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0][:, :kept]
            walk = SiteWalk(inputs, cpu)
            walk.pending = previous
            for site, name in zip(layer.sites(family), layer_site_ids(family, 0)):
                open_site(layer, family, site, previous)
                moment = walk.advance(name, site.block, 0)
                C, H = (
                    frobenius_normalised(moment.value()),
                    frobenius_normalised(torch.randn(d, d, dtype=torch.float64)),
                )
                bases = tau_candidates(C, H, DEFAULT_TAUS)  # every τ candidate: one batched eigendecomposition
                losses = coupled_losses(C, H, bases[:, :, kept:])
                chosen = bases[0, :, :kept].contiguous()
                del C, H, bases, losses, moment
                close_site(layer, family, site, previous, chosen)
                previous = walk.pending = chosen
    return tracker.peak["cpu"]


def fisher_peak(config: Any, family: Any, shape: FakeBatch, recompute: bool, depth: int) -> int:
    """Device peak (bytes) of the H pass over a `depth`-layer model, one batch per chunk: the
    layers on the device (one when recomputing, else all with their graphs) and the head."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compressor.engine.fisher import estimate_fisher
    from compressor.evaluation.memtrack import LiveBytes
    from compressor.recipe.sections.sensitivity import SensitivityOptions

    with FakeTensorMode(allow_non_fake_inputs=True):
        model, inputs = prepared(config, family, shape, depth)
        layers = model.get_submodule(family.layers)
        tracker = LiveBytes()
        with tracker:
            heads = (p for part in family.head_modules(model) for p in part.parameters())
            tracker.adopt(*(layers[0] if recompute else layers).parameters(), *heads)
            options = SensitivityOptions(chunk=shape.batch, recompute=recompute)
            estimate_fisher(model, family, inputs, options, torch.device("cpu"))
    return tracker.peak["cpu"]


_MEASURED: dict[tuple[Any, ...], dict[str, int]] = {}
"""Each shape's measured peaks, once per process."""


def measure_device(config: Any, family: Any, shape: FakeBatch, kept: int, recompute: bool = True) -> dict[str, int]:
    """Device peaks (bytes) of the walk and the H pass, and one layer's weights. Without
    `recompute` the H pass keeps every layer's graph: measured at one and two layers and
    extrapolated to the model's depth (linear: every layer has the same shapes). Remembered per
    config and settings: a sweep's runs, or a test suite's, measure once."""
    dtype, batch, seq_len, attention = shape.dtype, shape.batch, shape.seq_len, shape.attention
    key = (config.to_json_string(), family.name, str(dtype), batch, seq_len, kept, attention, recompute)
    too_large = UserError(
        f"calibration.batch_size × seq_len ({batch:,} × {seq_len:,} tokens) at this model's widths is more "
        f"than one tensor can hold; lower calibration.batch_size or seq_len"
    )
    widest = max(config.hidden_size, config.vocab_size, getattr(config, "intermediate_size", 0) or 0)
    heads = getattr(config, "num_attention_heads", 1) or 1
    if 8 * batch * seq_len * max(widest, heads * seq_len) >= 1 << 63:  # bytes past what a tensor's size holds
        raise too_large
    if key not in _MEASURED:
        try:
            fisher = fisher_peak(config, family, shape, recompute, 1)
            if not recompute:
                deeper = fisher_peak(config, family, shape, recompute, 2)
                fisher += (config.num_hidden_layers - 1) * (deeper - fisher)
            walk = walk_peak(config, family, shape, kept)
        except RuntimeError as error:  # a shape the bound above let through, still too large to allocate
            if "overflow" not in str(error):
                raise
            raise too_large from None
        _MEASURED[key] = {"walk": walk, "fisher": fisher, "layer": layer_bytes(config, family, dtype, attention)}
    return dict(_MEASURED[key])


def layer_bytes(config: Any, family: Any, dtype: torch.dtype, attention: str) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        layer = small_model(config, dtype, attention, 1).get_submodule(family.layers)[0]
        return sum(p.numel() * p.element_size() for p in layer.parameters())
