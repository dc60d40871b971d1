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
from dataclasses import dataclass

from transformers import PretrainedConfig

from compressor.errors import UserError
from compressor.models.budget import ParamModel
from compressor.models.families import ModelFamily
from compressor.models.layout import LayoutRequest, SlicedLayout, kept_neurons, mlp_neurons, with_mlp_width
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
    request: LayoutRequest,
    *,
    pruned_mlp: bool,
    min_kept: float = 0.0,
) -> SlicedLayout:
    """The stock layout of `family`, whose stream stays whole for `reason` (see the module
    docstring): every MLP keeps the request's `mlp_kept` neurons, or the most its `target_params`
    budget allows (not fewer than `min_kept` of them). Refused in one line where it cannot be: no
    `mlp` section (`pruned_mlp` false), a `sparsity` (it cuts the residual width), or a budget the
    MLP alone cannot reach (naming the fraction it can)."""
    layout = request.layout
    kind = "stock" if layout == "global" else layout
    kept_whole = f"a {kind} {config.model_type} keeps its residual stream whole ({reason})"
    if not pruned_mlp:
        raise UserError(
            f"slicing.layout: {layout}: {kept_whole}, so only the MLP's width can be pruned; add mlp: {{}} "
            f"(or mlp.kept), or set slicing.layout: per_site"
        )
    if request.sparsity is not None:
        raise UserError(
            f"sparsity cuts the residual width, but {kept_whole}; give target_params (the MLP's width "
            f"takes the cut), or set slicing.layout: per_site"
        )
    assert request.target_params is not None, "the recipe gives a sparsity or a target_params"
    count = _MlpCount.of(config, family, request, min_kept)
    neurons = count.neurons(config, family, request, kept_whole, min_kept)
    layers, d = config.num_hidden_layers, config.hidden_size
    sites = tuple(site_ids(family, layers))
    params = ParamModel(
        sites=sites,
        constant=count.counted(neurons) + count.embedding,
        linear={site: 0 for site in sites},
        transitions=(),
        original=count.at_full,
        hidden_size=d,
        embedding=count.tables,
        embedding_constant=count.tables,
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
        budget=count.budget,
        mlp_width=neurons,
        counts=request.counts,
        kept_stream=reason,
    )


@dataclass(frozen=True)
class _MlpCount:
    """The model's parameters as an affine function of its MLPs' width (from `low` neurons up to
    `width`), measured on meta models, and the request's budget in them."""

    width: int
    low: int
    at_full: int
    at_low: int
    tables: int
    embedding: int
    """The embedding tables where the budget counts without them, else 0."""
    budget: int
    what: str

    @classmethod
    def of(cls, config: PretrainedConfig, family: ModelFamily, request: LayoutRequest, min_kept: float) -> _MlpCount:
        width, round_to = mlp_neurons(config, family), request.mlp_round_to
        low = (
            1
            if request.mlp_kept is not None
            else min(width, max(round_to, math.ceil(min_kept * width / round_to) * round_to))
        )
        at_full, tables = meta_params(config, family)
        at_low, _ = meta_params(with_mlp_width(config, family, low), family)
        embedding = tables if request.counts == "non_embedding" else 0
        assert request.target_params is not None
        budget = int(request.target_params * (at_full - embedding))
        what = "non-embedding parameters" if request.counts == "non_embedding" else "parameters"
        return cls(width, low, at_full, at_low, tables, embedding, budget, what)

    @property
    def slope(self) -> int:
        return (self.at_full - self.at_low) // (self.width - self.low) if self.width != self.low else 0

    def counted(self, neurons: int) -> int:
        return self.at_low + (neurons - self.low) * self.slope - self.embedding

    def fraction(self, params: int) -> str:
        return f"{params / (self.at_full - self.embedding):.4f}".rstrip("0").rstrip(".")

    def neurons(
        self, config: PretrainedConfig, family: ModelFamily, request: LayoutRequest, kept_whole: str, min_kept: float
    ) -> int:
        """The request's `mlp_kept` where the budget holds it, else the most neurons it allows."""
        target, round_to, counted, fraction = request.target_params, request.mlp_round_to, self.counted, self.fraction
        if request.mlp_kept is not None:
            neurons = kept_neurons(config, family, request.mlp_kept, round_to)
            if counted(neurons) > self.budget:
                raise UserError(
                    f"target_params {target}: {kept_whole}, and MLPs of {neurons} neurons leave "
                    f"{counted(neurons):,} {self.what} ({fraction(counted(neurons))} of them); lower mlp.kept, or "
                    f"raise target_params to at least {fraction(counted(neurons))}"
                )
            return neurons
        low, width = self.low, self.width
        most = low + (self.budget - counted(low)) // self.slope if self.slope else width
        neurons = min(width, most // round_to * round_to)
        if neurons < low:
            raise UserError(
                f"target_params {target}: {kept_whole}, and its MLPs at mlp.min_kept {min_kept:g} "
                f"({low} of {width} neurons) still hold {fraction(counted(low))} of the {self.what}; raise "
                f"target_params to at least {fraction(counted(low))}, lower mlp.min_kept, or set "
                f"slicing.layout: per_site to prune the residual width too"
            )
        return neurons
