"""Bases as data: a model's per-site kept directions, applied to weights by one exact function.

A set of bases maps each site id to V_s (d × k_s, float64): the kept columns of the orthogonal
basis chosen there. `apply_bases` turns an original model into the sliced model those bases
define; the walk applies each site with the same two steps (`open_site`, `close_site`), so a
saved set of bases reproduces a run's model bit for bit.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedModel

from compressor.engine.checkpoint import OnDisk
from compressor.engine.layerwise import visit_layers
from compressor.engine.shards import ShardWriter
from compressor.engine.transforms import fuse_norms, rotate_embedding, rotate_inputs, rotate_output, transition
from compressor.models.families import ModelFamily, stream_reader, stream_writers
from compressor.models.sites import EMBEDDING, layer_site_ids, layout, site_ids
from compressor.models.sliced import Site, SlicedDecoderLayer, sliced_classes

BASES_FILE = "bases.safetensors"
READERS_FILE = "readers.safetensors"
"""Per-site reader maps R_s, when they differ from the bases (`slicing.correct_readers`)."""


def reader_map(C: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """R = C·V(VᵀCV)⁻¹ (d × k): the least-squares prediction of the full stream x from its kept
    coordinates z = Vᵀx, under C = E[x xᵀ]. What reads the stream reads R·z instead of V·z, so
    the part of the removed coordinates that the kept ones predict is put back, at no parameter
    cost. When V spans eigenvectors of C (PCA), CV = VΛ and R = V.

    Kept directions with (almost) no energy, below 1e-6 of the largest in VᵀCV (e.g. the
    constant direction of a centred LayerNorm stream at a site kept whole), are read through V:
    any map fits them, and inverting a tiny eigenvalue would amplify noise on new text."""
    CV = C @ basis
    values, vectors = torch.linalg.eigh(basis.T @ CV)
    live = values > values.max().clamp_min(torch.finfo(values.dtype).tiny) * 1e-6
    inverse = (vectors[:, live] / values[live]) @ vectors[:, live].T
    dead = vectors[:, ~live]
    return CV @ inverse + basis @ (dead @ dead.T)


def prediction_error(C: torch.Tensor, basis: torch.Tensor, reader: torch.Tensor) -> float:
    """E‖x − R·Vᵀx‖² / E‖x‖² under C = E[x xᵀ] (R = V: the energy of the removed coordinates)."""
    M = reader @ basis.T
    return float((torch.trace(C) - 2 * torch.trace(M @ C) + torch.trace(M @ C @ M.T)) / torch.trace(C))


def apply_embedding_basis(model: PreTrainedModel, family: ModelFamily, basis: torch.Tensor) -> None:
    """What writes the stream before the first layer now writes it in `basis`."""
    projection, embeddings = stream_writers(model, family)
    if projection is not None:
        rotate_output(projection, basis)  # it writes the stream; the embedding keeps its own width
    for embedding in embeddings:
        rotate_embedding(embedding, basis)


def _like(layer: SlicedDecoderLayer, family: ModelFamily) -> torch.Tensor:
    return layer.writers("attn", family)[0].weight


def open_site(layer: SlicedDecoderLayer, family: ModelFamily, site: Site, previous: torch.Tensor) -> None:
    """The block reads the stream in the previous site's basis and, with an identity-like
    transition, outputs it in full d coordinates (so its statistics can be measured).
    `previous` is what reads the previous site's stream: its basis V, or its reader map R."""
    for linear in site.readers:
        rotate_inputs(linear, previous)
    identity = torch.eye(previous.shape[0], dtype=torch.float64, device=previous.device)
    setattr(layer, site.shortcut, transition(previous, identity, _like(layer, family)))


def close_site(
    layer: SlicedDecoderLayer,
    family: ModelFamily,
    site: Site,
    previous: torch.Tensor,
    chosen: torch.Tensor,
    shared: bool = False,
) -> None:
    """The block writes the stream in the chosen basis; the residual path carries V_newᵀ·V_prev,
    or the stream as it is when the site reuses the previous site's basis (`shared`)."""
    for linear in site.writers:
        rotate_output(linear, chosen)
    setattr(layer, site.shortcut, None if shared else transition(previous, chosen, _like(layer, family)))


def apply_head_basis(model: PreTrainedModel, family: ModelFamily, basis: torch.Tensor) -> None:
    """What reads the stream after the final norm reads it in the last site's basis."""
    rotate_inputs(stream_reader(model, family), basis)


def apply_tied_head(model: PreTrainedModel, family: ModelFamily, reader: torch.Tensor) -> None:
    """Keep a tied head tied: the head becomes the sliced embedding E·V_0 itself, and a k_0 × k
    map M after the final norm, fitted by least squares, makes (E·V_0)·M as close as it can be
    to what the untied head would compute (W·R: the head with the final norm's scale fused in,
    reading the last site's stream through R). Exact when nothing is sliced; otherwise the
    logits lose what lies outside the embedding's kept directions. A head bias (a LayerNorm's
    folded β) becomes M's bias the same way."""
    head = stream_reader(model, family)
    embedding = model.get_submodule(family.embedding)
    A = embedding.weight.data.to(torch.float64)
    target = head.weight.data.to(torch.float64) @ reader.to(A.device, torch.float64)
    if head.bias is not None:
        target = torch.cat([target, head.bias.data.to(torch.float64)[:, None]], 1)
    Q, R = torch.linalg.qr(A)  # least squares by QR: the same bits every time (LAPACK's gelsy is not)
    solution = torch.linalg.solve_triangular(R, Q.T @ target, upper=True)  # k_0 × k (and the bias column)
    del Q, R
    width = reader.shape[1]
    mixer = nn.Linear(
        width, A.shape[1], bias=head.bias is not None, dtype=head.weight.dtype, device=head.weight.device
    ).requires_grad_(False)
    mixer.weight.data = solution[:, :width].to(mixer.weight.dtype).contiguous()
    if head.bias is not None:
        mixer.bias.data = solution[:, width].to(mixer.weight.dtype).contiguous()
    head.in_features, head.bias, head.weight = A.shape[1], None, embedding.weight
    model.set_submodule(family.final_norm, nn.Sequential(model.get_submodule(family.final_norm), mixer))


def tied_head(model: PreTrainedModel, family: ModelFamily, bases: Mapping[str, torch.Tensor]) -> bool:
    """An original model whose head is its embedding (one Parameter), with bases whose last site
    kept the embedding's basis (`slicing.tie_head`), keeps its head tied."""
    last = site_ids(family, model.config.num_hidden_layers)[-1]
    head, embedding = model.get_submodule(family.head), model.get_submodule(family.embedding)
    return (
        head.weight is embedding.weight
        and bases[last].shape == bases[EMBEDDING].shape
        and torch.equal(bases[last], bases[EMBEDDING])
    )


def slicing_config(
    model: PreTrainedModel,
    family: ModelFamily,
    widths: Mapping[str, int],
    shared: Collection[str] = (),
    tied: bool = False,
) -> dict[str, Any]:
    """The `slicing` entry of a sliced model's config (how `apply_slicing_layout` rebuilds it);
    `shared` names the sites that reuse the previous site's basis (no transition into them)."""
    shape = layout(family, model.config.num_hidden_layers, widths, shared)
    value = {
        "hidden_size": model.config.hidden_size,
        "embedding": shape.embedding,
        "attn": shape.attn,
        "mlp": shape.mlp,
        "norm_eps": model.get_submodule(family.final_norm).eps,
        "reader_bias": stream_reader(model, family).bias is not None,
    }
    if any(shape.attn_shared) or any(shape.mlp_shared):
        value.update(attn_shared=shape.attn_shared, mlp_shared=shape.mlp_shared)
    if tied:
        value["tied_head"] = True
    return value


def shared_sites(ids: list[str], bases: Mapping[str, torch.Tensor]) -> list[str]:
    """Sites whose kept directions are exactly the previous site's (`slicing.shared_bases`): the
    stream passes them unchanged, so no transition matrix leads into them."""
    return [
        site
        for previous, site in zip(ids, ids[1:])
        if bases[site].shape == bases[previous].shape and torch.equal(bases[site], bases[previous])
    ]


@torch.no_grad()
def apply_bases(
    model: PreTrainedModel,
    family: ModelFamily,
    bases: Mapping[str, torch.Tensor],
    device: torch.device | str = "cpu",
    readers: Mapping[str, torch.Tensor] | None = None,
    keep_tied: bool | None = None,
) -> PreTrainedModel:
    """The sliced model that `bases` define, from the *original* `model` (which it consumes:
    weights are transformed in place, so a 70B model is never held twice). `readers` gives the
    maps R_s that read each site's stream where they are not its basis (`reader_map`).
    `keep_tied`: whether a tied head stays tied through the map after the final norm (default:
    `tied_head`, as the walk did; a global layout passes False, its stock conversion decides).

    Exact: the same float64 products as the walk, in the same order. Layers are moved to
    `device` one at a time and back.
    """
    readers = readers or {}
    device = torch.device(device)
    ids = site_ids(family, model.config.num_hidden_layers)
    missing = [site for site in ids if site not in bases]
    if missing:
        raise ValueError(f"no basis for site(s): {', '.join(missing)}")
    model.eval()
    model.requires_grad_(False)
    tied = tied_head(model, family, bases) if keep_tied is None else keep_tied  # before fusion unties the head
    fuse_norms(model, family)

    def reader(site: str) -> torch.Tensor:
        return readers.get(site, bases[site]).to(device, torch.float64)

    shared = shared_sites(ids, bases)
    apply_embedding_basis(model, family, bases[EMBEDDING].to(device, torch.float64))
    previous = reader(EMBEDDING)
    for index, layer in visit_layers(model, family, device):
        for site, name in zip(layer.sites(family), layer_site_ids(family, index)):
            chosen = bases[name].to(device, torch.float64)
            open_site(layer, family, site, previous)
            close_site(layer, family, site, previous, chosen, name in shared)
            previous = reader(name)
    widths = {site: bases[site].shape[1] for site in ids}
    slicing = slicing_config(model, family, widths, shared, tied)  # before the head changes (its bias)
    if tied:
        apply_tied_head(model, family, previous)
    else:
        apply_head_basis(model, family, previous)
    return as_sliced_model(model, family, slicing)


def sliced_shell(model: PreTrainedModel, family: ModelFamily, slicing: dict[str, Any]) -> PreTrainedModel:
    """The registered `sliced_*` model of `model`'s config and `slicing`, on the meta device, in
    `model`'s dtype: the names, shapes and dtypes a sliced model saves (what a written walk plans)."""
    config_cls, model_cls = sliced_classes(model.config.model_type)
    values = model.config.to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        values.pop(key, None)
    values["tie_word_embeddings"] = bool(slicing.get("tied_head"))
    config = config_cls(**values, slicing=slicing)
    config.architectures = [model_cls.__name__]
    config._attn_implementation = model.config._attn_implementation
    with torch.device("meta"):
        sliced = model_cls(config)
    return sliced.to(model.dtype)


def as_sliced_model(model: PreTrainedModel, family: ModelFamily, slicing: dict[str, Any]) -> PreTrainedModel:
    """Re-home the processed weights in the registered `sliced_*` class (no copy).

    Building the class from its config and loading the weights strictly proves that a
    saved model reloads into exactly this structure.
    """
    sliced = sliced_shell(model, family, slicing)
    sliced.load_state_dict(model.state_dict(), strict=True, assign=True)
    if slicing.get("tied_head"):
        sliced.tie_weights()
    source_buffers = dict(model.named_buffers())
    for name, buffer in sliced.named_buffers():
        if buffer.is_meta:
            owner, _, attr = name.rpartition(".")
            sliced.get_submodule(owner)._buffers[attr] = source_buffers[name]
    sliced.generation_config = model.generation_config
    sliced.eval()
    sliced.requires_grad_(False)
    return sliced


def save_bases(bases: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str] | None = None) -> None:
    """One safetensors file keyed by site id (float64, d × k_s each), written one basis at a time
    (bases left on disk by the walk are read one by one, never all at once)."""
    shapes = {
        site: bases.meta(site) if isinstance(bases, OnDisk) else torch.empty_like(bases[site], device="meta")
        for site in bases
    }
    writer = ShardWriter(
        path.parent,
        {site: meta.to(torch.float64) for site, meta in shapes.items()},
        max_shard_size=1 << 62,
        filename_pattern=path.stem + "{suffix}" + path.suffix,
        metadata=dict(metadata or {}),
    )
    for site in bases:
        writer.write({site: bases[site].detach().to("cpu", torch.float64)})  # each its own bytes, even where shared
    writer.finish()


def load_bases(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))
