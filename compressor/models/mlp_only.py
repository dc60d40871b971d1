"""A stock layout that prunes the MLP's width alone: what `slicing.layout: global` means for a
model whose own class cannot hold a rotated residual stream (`ModelFamily.stock_refusal`: norms
after each block, or LayerNorm; `TextTower.keeps_stream`: a vision-language class that ties
something else to the text width, Mistral 3's projector).

One residual basis is not a stock model there, but the MLP's width is: the stream keeps its basis
and width, every MLP keeps m of its f neurons, and the saved folder is the original class with
`intermediate_size` m, loaded by plain transformers. The layout is a `SlicedLayout` whose
`kept_stream` says why: every site at the full width, no walk (the run's MLP stage prunes the
original model). Its parameters are affine in m, so two meta-device models give every count, and a
`target_params` budget decides m (the most neurons within it, a multiple of `mlp.round_to`).
Loads no weights.
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig

from compressor.errors import UserError
from compressor.models.budget import ParamModel
from compressor.models.families import ModelFamily
from compressor.models.layout import SlicedLayout, kept_neurons, mlp_neurons, with_mlp_width
from compressor.models.sites import site_ids, site_widths
from compressor.models.stock import meta_params
from compressor.models.towers import TextTower

HETEROGENEOUS = "DeciLM's engines derive head_dim from the hidden size, and each MLP takes its own width"
"""Why `slicing.layout: heterogeneous` keeps the stream whole (`models.decilm`)."""


def kept_stream(family: ModelFamily, layout: str, tower: TextTower | None = None) -> str | None:
    """Why a `layout` run of this model keeps its stream whole and prunes the MLP alone: a global
    layout whose class cannot hold a rotated stream, where the MLP's width is described; None: it
    does not (a per-site layout, or a class that holds one basis; a text family without an MLP
    width to prune is refused by `stock.check_stock`, a vision-language one here)."""
    if layout == "heterogeneous":
        return HETEROGENEOUS
    if layout != "global":
        return None
    if tower is not None and tower.keeps_stream is not None:
        if family.mlp_width is None:
            raise UserError(
                f"this vision-language class keeps its text stream whole ({tower.keeps_stream}), and its "
                f"{family.name} text model does not describe its MLP's width (ModelFamily.mlp_width): nothing "
                f"in it can be pruned stock"
            )
        return tower.keeps_stream
    return family.stock_refusal if family.mlp_width is not None else None


def mlp_only_layout(
    config: PretrainedConfig,
    family: ModelFamily,
    reason: str,
    *,
    pruned_mlp: bool,
    sparsity: float | None = None,
    target_params: float | None = None,
    mlp_kept: float | None = None,
    mlp_round_to: int = 1,
    min_kept: float = 0.0,
    counts: str = "all",
    layout: str = "global",
) -> SlicedLayout:
    """The stock layout of `family`, whose stream stays whole for `reason` (see the module
    docstring): every MLP keeps `mlp_kept` neurons, or the most the `target_params` budget allows
    (not fewer than `min_kept` of them). Refused in one line where it cannot be: no `mlp` section
    (`pruned_mlp` false), a `sparsity` (it cuts the residual width), or a budget the MLP alone
    cannot reach (naming the fraction it can)."""
    name = config.model_type
    kind = "stock" if layout == "global" else layout
    kept_whole = f"a {kind} {name} keeps its residual stream whole ({reason})"
    if not pruned_mlp:
        raise UserError(
            f"slicing.layout: {layout}: {kept_whole}, so only the MLP's width can be pruned; add mlp: {{}} "
            f"(or mlp.kept), or set slicing.layout: per_site"
        )
    if sparsity is not None:
        raise UserError(
            f"sparsity cuts the residual width, but {kept_whole}; give target_params (the MLP's width "
            f"takes the cut), or set slicing.layout: per_site"
        )
    assert target_params is not None, "the recipe gives a sparsity or a target_params"
    width = mlp_neurons(config, family)
    low = (
        1
        if mlp_kept is not None
        else min(width, max(mlp_round_to, math.ceil(min_kept * width / mlp_round_to) * mlp_round_to))
    )
    at_full, tables = meta_params(config, family)
    at_low, _ = meta_params(with_mlp_width(config, family, low), family)
    embedding = tables if counts == "non_embedding" else 0
    original = at_full - embedding
    budget = int(target_params * original)
    slope = (at_full - at_low) // (width - low) if width != low else 0

    def counted(neurons: int) -> int:
        return at_low + (neurons - low) * slope - embedding

    def fraction(params: int) -> str:
        return f"{params / original:.4f}".rstrip("0").rstrip(".")

    what = "non-embedding parameters" if counts == "non_embedding" else "parameters"
    if mlp_kept is not None:
        neurons = kept_neurons(config, family, mlp_kept, mlp_round_to)
        if counted(neurons) > budget:
            raise UserError(
                f"target_params {target_params}: {kept_whole}, and MLPs of {neurons} neurons leave "
                f"{counted(neurons):,} {what} ({fraction(counted(neurons))} of them); lower mlp.kept, or raise "
                f"target_params to at least {fraction(counted(neurons))}"
            )
    else:
        most = low + (budget - counted(low)) // slope if slope else width
        neurons = min(width, most // mlp_round_to * mlp_round_to)
        if neurons < low:
            raise UserError(
                f"target_params {target_params}: {kept_whole}, and its MLPs at mlp.min_kept {min_kept:g} "
                f"({low} of {width} neurons) still hold {fraction(counted(low))} of the {what}; raise "
                f"target_params to at least {fraction(counted(low))}, lower mlp.min_kept, or set "
                f"slicing.layout: per_site to prune the residual width too"
            )
    layers, d = config.num_hidden_layers, config.hidden_size
    sites = tuple(site_ids(family, layers))
    params = ParamModel(
        sites=sites,
        constant=counted(neurons) + embedding,
        linear={site: 0 for site in sites},
        transitions=(),
        original=at_full,
        hidden_size=d,
        embedding=tables,
        embedding_constant=tables,
    )
    return SlicedLayout(
        family=family,
        config=config,
        one_basis=True,
        sites=sites,
        widths=site_widths(family, layers, d, d, True),
        shared=(),
        tie_head=False,
        slice_head=False,
        params=params,
        budget=budget,
        mlp_width=neurons,
        counts=counts,
        kept_stream=reason,
    )
