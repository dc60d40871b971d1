"""Residual-stream sites by name: the one key for widths, statistics, bases, checkpoints and reports.

A model with L layers has the sites `embedding` (the stream the first layer reads), then
`layers.{i}.attn` and `layers.{i}.mlp` for each layer, or `layers.{i}` where attention and MLP
write the stream together (parallel blocks, Phi-2). Everything else in the package derives
site order from here, never from list positions of its own.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from compressor.models.families import ModelFamily

EMBEDDING = "embedding"


def layer_site_ids(family: ModelFamily, layer: int) -> list[str]:
    """The sites one decoder layer produces, in order (they match `SlicedDecoderLayer.sites`)."""
    if family.parallel:
        return [f"layers.{layer}"]
    return [f"layers.{layer}.attn", f"layers.{layer}.mlp"]


def site_ids(family: ModelFamily, num_layers: int) -> list[str]:
    """Every site of a model, in stream order."""
    ids = [EMBEDDING]
    for layer in range(num_layers):
        ids += layer_site_ids(family, layer)
    return ids


def shared_site_ids(family: ModelFamily, num_layers: int, slice_head: bool, tie_head: bool) -> list[str]:
    """`slicing.shared_bases`: each layer's MLP site keeps its attention site's basis, except the
    last when the head's input is kept whole (its own width) or the head is tied (the
    embedding's basis)."""
    if family.parallel:
        return []
    shared = [layer_site_ids(family, i)[-1] for i in range(num_layers)]
    return shared[:-1] if tie_head or not slice_head else shared


def site_widths(family: ModelFamily, num_layers: int, hidden_size: int, kept: int, slice_head: bool) -> dict[str, int]:
    """Kept width of each site: `kept` everywhere; the last site (the head's input) stays full
    unless `slice_head`."""
    ids = site_ids(family, num_layers)
    widths = {site: kept for site in ids}
    if not slice_head:
        widths[ids[-1]] = hidden_size
    return widths


@dataclass(frozen=True)
class Layout:
    """The widths a sliced model is built with (stored in its config as `slicing`)."""

    embedding: int
    attn: list[int]
    mlp: list[int]
    attn_shared: list[bool]
    mlp_shared: list[bool]
    """Per layer: the site reuses the previous site's basis (the residual path has no transition)."""


def layout(family: ModelFamily, num_layers: int, widths: Mapping[str, int], shared: Collection[str] = ()) -> Layout:
    """Per-layer widths after attention and after the MLP (one site serves both for parallel
    blocks), and which of those sites reuse the previous site's basis (`shared`)."""
    missing = [site for site in site_ids(family, num_layers) if site not in widths]
    if missing:
        raise ValueError(f"no width given for site(s): {', '.join(missing)}")
    attn, mlp, attn_shared, mlp_shared = [], [], [], []
    for layer in range(num_layers):
        ids = layer_site_ids(family, layer)
        attn.append(widths[ids[0]])
        mlp.append(widths[ids[-1]])
        attn_shared.append(ids[0] in shared)
        mlp_shared.append(ids[-1] in shared and not family.parallel)
    return Layout(embedding=widths[EMBEDDING], attn=attn, mlp=mlp, attn_shared=attn_shared, mlp_shared=mlp_shared)
