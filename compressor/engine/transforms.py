"""Exact weight transformations: norm fusion and changes of residual-stream basis.

Every product is formed in float64 and cast back to the weight's dtype once, so a rotation
without slicing changes the model only by that final rounding. A weight goes through float64 a
block of rows at a time (`_by_rows`), so a 14336 × 4096 MLP weight never has a whole float64 copy
(470 MB) beside it: the walk's memory is the layer's, not four times it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel

from compressor.models.families import ModelFamily, optional_module, stream_reader, stream_writers
from compressor.models.sliced import WeightlessRMSNorm, family_mlp, wrap_layer

_BLOCK_BYTES = 1 << 26
"""The float64 rows of a weight formed at once (64 MiB)."""


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data = value.to(dtype=param.dtype, device=param.device).contiguous()


def _by_rows(weight: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`product(weight in float64)` cast to the weight's dtype, formed a block of rows at a time:
    each output row depends only on its own input row (a row times a matrix, a row scaled)."""
    width = max(1, weight[0].numel() if weight.shape[0] else 1)
    step = max(1, _BLOCK_BYTES // (8 * width))
    out: torch.Tensor | None = None
    for start in range(0, weight.shape[0], step):
        block = product(weight[start : start + step].to(torch.float64)).to(weight.dtype)
        if out is None:
            out = torch.empty((weight.shape[0], *block.shape[1:]), dtype=weight.dtype, device=weight.device)
        out[start : start + step] = block
    return out if out is not None else product(weight.to(torch.float64)).to(weight.dtype)


def _fold_scale(scale: torch.Tensor, linears: list[nn.Linear]) -> None:
    """Fold a norm's per-coordinate scale into the columns of the linears it feeds."""
    for linear in linears:
        w = linear.weight.data
        factor = scale.to(device=w.device, dtype=torch.float64)
        _assign(linear.weight, _by_rows(w, lambda rows, factor=factor: rows * factor))


def fuse_norms(model: PreTrainedModel, family: ModelFamily) -> None:
    """Fold every RMSNorm scale into the next linears and untie the head, in float64.

    Replaces each decoder layer with a `SlicedDecoderLayer` (identity shortcuts,
    weightless norms that keep each norm's own eps). The function the model computes is
    unchanged; unlike SliceGPT, nothing is mean-centred (RMSNorm needs no centring).
    """
    if family.prepare is not None:  # e.g. GPT-2's Conv1D → nn.Linear
        family.prepare(model)
    d = model.config.hidden_size
    head = model.get_submodule(family.head)
    embedding = model.get_submodule(family.embedding)
    if head.weight is embedding.weight:  # tied (the same Parameter)
        head.weight = nn.Parameter(embedding.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    if family.layer_norm:  # centre what writes the stream, so every LayerNorm sees a zero-mean input
        projection, embeddings = stream_writers(model, family)
        if projection is not None:
            _centre_output(projection)
        for embedding in embeddings:
            _centre_rows(embedding)
    layers = model.get_submodule(family.layers)
    for index, layer in enumerate(layers):
        layers[index] = fuse_layer(layer, family, d)
    final_norm = model.get_submodule(family.final_norm)
    reader = stream_reader(model, family)
    if family.layer_norm:
        _fold_shift(final_norm, [reader])
    _fold_scale(_scale(final_norm, family), [reader])
    model.set_submodule(family.final_norm, WeightlessRMSNorm(d, _eps(final_norm)))


def fuse_layer(layer: nn.Module, family: ModelFamily, d: int) -> nn.Module:
    """One decoder layer's part of `fuse_norms`: its norms folded into the linears they feed (and,
    for LayerNorm families, its writers centred), wrapped as a `SlicedDecoderLayer`. A streamed
    layer goes through this when it is read (`engine.streaming`)."""
    mixer = family.mixer_of(layer)
    attention, mlp = layer.get_submodule(mixer.path), family_mlp(family, layer)
    attn_norm, mlp_norm = optional_module(layer, family.attn_norm), optional_module(layer, family.mlp_norm)
    attn_readers = [attention.get_submodule(p) for p in mixer.inputs]
    mlp_readers = family.mlp_readers(mlp)
    attn_out, mlp_outs = attention.get_submodule(mixer.output), family.mlp_writers(mlp)
    if family.layer_norm:
        for writer in (attn_out, *mlp_outs):
            _centre_output(writer)
        _fold_shift(attn_norm, attn_readers)
        _fold_shift(mlp_norm, mlp_readers)
    for norm, readers in ((attn_norm, attn_readers), (mlp_norm, mlp_readers)):
        if norm is not None:  # a block without a norm before it reads the stream as it is (OLMo 2)
            _fold_scale(_scale(norm, family), readers)
    writers = {}
    for block, path in (("attn", family.attn_post_norm), ("mlp", family.mlp_post_norm)):
        if path is not None:  # output norm: weightless, its scale becomes the writer diag(scale)
            post_norm = layer.get_submodule(path)
            writer = nn.Linear(d, d, bias=False, device=attn_out.weight.device, dtype=attn_out.weight.dtype)
            writer.requires_grad_(False)
            _assign(writer.weight, torch.diag(_scale(post_norm, family)))
            writers[block] = (WeightlessRMSNorm(d, _eps(post_norm)), writer)
    if family.residual_multiplier is not None:  # Granite: x + m·block(x), m folded into what writes
        factor = float(getattr(layer, family.residual_multiplier))
        for block, linears in (("attn", [attn_out]), ("mlp", mlp_outs)):
            for linear in [writers[block][1]] if block in writers else linears:
                _scale_output(linear, factor)
    return wrap_layer(family, layer, d, _eps(attn_norm), _eps(mlp_norm), writers)


def _scale_output(linear: nn.Linear, factor: float) -> None:
    """`W ← m·W` (and the bias): the linear writes m times what it wrote."""
    _assign(linear.weight, _by_rows(linear.weight.data, lambda rows: rows * factor))
    if linear.bias is not None:
        _assign(linear.bias, linear.bias.data.to(torch.float64) * factor)


def _scale(norm: nn.Module, family: ModelFamily) -> torch.Tensor:
    """The per-coordinate factor the norm applies, in float64 (Gemma stores it as 1 + w)."""
    if getattr(norm, "weight", None) is None:  # LayerNorm without affine parameters
        return torch.ones(norm.normalized_shape[0], dtype=torch.float64)
    return norm.weight.data.to(torch.float64) + family.norm_offset


def _centre_rows(embedding: nn.Embedding) -> None:
    """Subtract each embedding vector's mean over the hidden coordinates."""
    w = embedding.weight.data.to(torch.float64)
    _assign(embedding.weight, w - w.mean(dim=1, keepdim=True))


def _centre_output(linear: nn.Linear) -> None:
    """`W ← (I − 11ᵀ/d)·W` (and the bias): the linear writes zero-mean vectors to the stream."""
    w = linear.weight.data.to(torch.float64)
    _assign(linear.weight, w - w.mean(dim=0, keepdim=True))
    if linear.bias is not None:
        b = linear.bias.data.to(torch.float64)
        _assign(linear.bias, b - b.mean())


def _fold_shift(norm: nn.Module, linears: list[nn.Module]) -> None:
    """Fold a LayerNorm's bias β into the next linears: b ← b + W·β (before the scale is folded)."""
    beta = getattr(norm, "bias", None)
    if beta is None:
        return
    for linear in linears:
        w = linear.weight.data.to(torch.float64)
        shift = w @ beta.data.to(device=w.device, dtype=torch.float64)
        if linear.bias is None:
            linear.bias = nn.Parameter(
                torch.zeros(linear.out_features, dtype=linear.weight.dtype, device=linear.weight.device),
                requires_grad=False,
            )
        _assign(linear.bias, linear.bias.data.to(torch.float64) + shift)


def _eps(norm: nn.Module | None) -> float | None:
    if norm is None:
        return None
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise TypeError(f"cannot find the epsilon of norm {type(norm).__name__}")


def rotate_inputs(linear: nn.Linear, basis: torch.Tensor) -> None:
    """`W ← W·V`: the linear now reads the stream expressed in (the kept columns of) `basis`."""
    w = linear.weight.data
    v = basis.to(w.device, torch.float64)
    _assign(linear.weight, _by_rows(w, lambda rows: rows @ v))


def rotate_embedding(embedding: nn.Embedding, basis: torch.Tensor) -> None:
    """`E ← E·V`: token embeddings expressed in `basis`."""
    rotate_inputs(embedding, basis)  # same algebra: rows are vectors of the stream


def rotate_output(linear: nn.Linear, basis: torch.Tensor) -> None:
    """`W ← Vᵀ·W` (and the bias): the linear now writes the stream in `basis`, formed as (Wᵀ·V)ᵀ
    a block of Wᵀ's rows at a time."""
    w = linear.weight.data
    v = basis.to(w.device, torch.float64)
    _assign(linear.weight, _by_rows(w.T, lambda rows: rows @ v).T)
    if linear.bias is not None:
        _assign(linear.bias, v.T @ linear.bias.data.to(torch.float64))


def transition(previous: torch.Tensor, new: torch.Tensor, like: torch.Tensor) -> nn.Linear:
    """Residual-path linear `V_newᵀ·V_prev`, mapping the previous site's basis to the new one."""
    weight = new.T @ previous
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=like.device, dtype=like.dtype)
    linear.requires_grad_(False)
    _assign(linear.weight, weight)
    return linear
