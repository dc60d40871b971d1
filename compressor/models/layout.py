"""What a model looks like sliced, decided once: its sites, their widths (or that an allocator
will choose them), which sites share a basis, whether the head stays tied, the parameter
budget and the exact parameter count of every choice. Built from the family, the config and
the slicing settings, before any weight is loaded; the run's checks, the walk's arguments, the
allocator, the distillation check and the report all read this one object."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from compressor.errors import UserError
from compressor.models.budget import ParamModel, layout_config, param_model, widest_uniform
from compressor.models.depth import depth_config
from compressor.models.families import ModelFamily, stream_reader, stream_writers
from compressor.models.heads import kept_heads, with_heads
from compressor.models.sites import EMBEDDING, layer_site_ids, shared_site_ids, site_ids, site_widths
from compressor.models.stock import check_stock, stock_config, stock_param_model, width_multiple

LAYOUTS = ("per_site", "global")
"""`per_site`: a basis per site, transitions on the residual path (a `sliced_*` class); `global`:
one basis for the whole stream, saved as the original architecture at a smaller width."""


@dataclass(frozen=True)
class SlicedLayout:
    """The sliced shape of one model under one recipe's slicing settings and budget."""

    family: ModelFamily
    config: PretrainedConfig
    one_basis: bool
    """A global layout: every site keeps the embedding's basis (`compressor.models.stock`)."""
    sites: tuple[str, ...]
    widths: dict[str, int] | None
    """The kept width of every site; None when an allocator chooses them from a survey."""
    shared: tuple[str, ...]
    """Sites that keep the previous site's basis (`slicing.shared_bases`), no transition into them."""
    tie_head: bool
    """The head stays tied to the sliced embedding (`slicing.tie_head` as it applies here)."""
    slice_head: bool
    params: ParamModel
    """The exact parameter count of any choice of widths."""
    budget: int
    """The most parameters the pruned model may have."""
    rounding: dict[str, int] | None = None
    """When a budget decides a uniform width: what rounding it to `round_to` gave up."""
    mlp_width: int | None = None
    """The intermediate neurons every layer's MLP keeps (`mlp:`); None: the MLP is not pruned.
    `params` counts it; `config` stays the original's (`with_mlp_width` gives the pruned one)."""
    shared_width: int | None = None
    """The intermediate neurons every shared expert keeps (`mlp.shared_kept`); None: its width
    stays. `params` counts it, as it counts `mlp_width`."""
    experts: int | None = None
    """The routed experts every MoE layer keeps (`experts:`); None: every expert stays. `params`
    counts it; `config` stays the original's (`with_experts` gives the pruned one)."""
    counts: str = "all"
    """What `budget` counts (the recipe's `budget`): all parameters, or `non_embedding`."""
    kept_stream: str | None = None
    """Why the stream keeps its basis and width and only the MLP is pruned, with no walk (a global
    layout whose class cannot hold a rotated stream: `models.mlp_only`); None: the walk rotates it."""
    active: ParamModel | None = None
    """The parameters one token uses, of any choice of widths (`ParamModel.active`): a model with
    routed experts counts top_k of each layer's; None for a model without them."""
    active_budget: int | None = None
    """The most parameters per token the pruned model may use (`target_active_params`); None: no limit."""
    heads: int | None = None
    """The query heads every attention layer keeps (`heads:`); None: every head stays. `params`
    counts it; `config` stays the original's (`models.heads.with_heads` gives the pruned one)."""
    removed_blocks: tuple[int, ...] = ()
    """The original's decoder blocks this layout is without (`depth`), ascending; `config` is the
    model's without them."""

    @property
    def prunes_mlp(self) -> bool:
        """The MLP stage runs: some MLP (a routed expert, a shared expert) keeps fewer neurons."""
        return self.mlp_width is not None or self.shared_width is not None

    def mlp_config(self, config: PretrainedConfig) -> PretrainedConfig:
        """`config` with the MLP widths this layout keeps (what the saved model's config says)."""
        return with_mlp_width(config, self.family, self.mlp_width, self.shared_width)

    @property
    def residual(self) -> bool:
        """The walk rotates and slices the residual stream (else it is kept whole)."""
        return self.kept_stream is None

    @property
    def counted(self) -> ParamModel:
        """The parameter polynomial `budget` is in: `params`, or it less the embedding tables."""
        return self.params.without_embedding() if self.counts == "non_embedding" else self.params

    @property
    def counted_active(self) -> ParamModel | None:
        """The active-parameter polynomial `active_budget` is in (`counted`'s, per token)."""
        if self.active is None:
            return None
        return self.active.without_embedding() if self.counts == "non_embedding" else self.active

    @property
    def reused(self) -> tuple[str, ...]:
        """Every site that keeps the previous site's basis: the shared sites, or in a global layout
        every site after the embedding."""
        return self.sites[1:] if self.one_basis else self.shared

    @property
    def kept(self) -> int | None:
        """The uniform kept width (None when an allocator chooses widths per site)."""
        return None if self.widths is None else self.widths[EMBEDDING]

    def uniform(self, kept: int) -> dict[str, int]:
        """Every site at `kept` (the head's input whole unless it is sliced, tied or global)."""
        return site_widths(
            self.family,
            self.config.num_hidden_layers,
            self.config.hidden_size,
            kept,
            self.one_basis or self.slice_head or self.tie_head,
        )

    def saved_config(self) -> PretrainedConfig:
        """The config of the stock model this layout saves (a global layout, or one that keeps its
        stream): its width, MLPs, experts, heads and blocks. A model built from it has the saved
        model's shape, which is all its speed depends on (`plan.decode_budget` times such models)."""
        if not self.one_basis and self.residual:
            raise ValueError("a per-site layout saves a sliced_* class, not a stock one")
        config = self.mlp_config(self.config)
        if self.experts is not None:
            config = with_experts(config, self.family, self.experts)
        if self.heads is not None:
            config = with_heads(config, self.heads)
        if self.residual:
            assert self.kept is not None, "a global layout has one width"
            config = stock_config(config, self.family, self.kept, self.tie_head)
        return config

    def slicing_config(self, model: torch.nn.Module, widths: dict[str, int] | None = None) -> dict[str, Any]:
        """The `slicing` entry of the sliced class's config for `widths` (default: this layout's, or
        every site whole when an allocator has not chosen yet), for `model` of the original class."""
        chosen = widths or self.widths or self.uniform(self.config.hidden_size)
        return layout_config(model, self.family, chosen, self.shared, self.tie_head)


def kept_width(hidden_size: int, sparsity: float, round_to: int) -> int:
    """Width kept at a sliced site: d − sparsity·d, floored to a multiple of `round_to` (as SliceGPT)."""
    kept = int((1.0 - sparsity) * hidden_size)
    kept -= kept % round_to
    if kept <= 0:
        raise UserError(
            f"sparsity {sparsity} leaves no width to keep at hidden size {hidden_size} "
            f"(kept widths are multiples of slicing.round_to={round_to}); lower the sparsity"
        )
    return kept


@dataclass(frozen=True)
class LayoutRequest:
    """What a recipe asks of the layout: its slicing settings, its budget and the count every axis
    keeps, as `sliced_layout` reads them (one object: an axis's setting is a field here, not
    another parameter every caller passes). The defaults leave every axis as it is."""

    layout: str = "per_site"
    slice_head: bool = False
    tie_head: bool | None = None
    shared_bases: bool = False
    round_to: int = 1
    sparsity: float | None = None
    """SliceGPT's budget: the parameters of its model at this sparsity (else `target_params`)."""
    target_params: float | None = None
    target_active_params: float | None = None
    """A limit on the parameters one token uses (a model with routed experts), with or without
    `target_params`."""
    allocated: bool = False
    """An allocator chooses the widths (none are set here)."""
    mlp_kept: float | None = None
    """Neurons every MLP keeps, or a fraction of them below 1, rounded down to `mlp_round_to`; the
    residual widths take what the budget leaves."""
    mlp_round_to: int = 1
    shared_kept: float | None = None
    """Likewise for every shared expert of an MoE layer."""
    experts: int | None = None
    """Routed experts every MoE layer keeps."""
    counts: str = "all"
    """`non_embedding`: either target counts without the embedding tables."""
    removed_blocks: Sequence[int] = ()
    """Decoder blocks the depth axis removes (`models.depth`): the layout is the model without them
    (its `config` the one its class reloads them from), the budget still a fraction of the original."""
    heads: float | None = None
    """Query heads every attention layer keeps (or a fraction, `models.heads.kept_heads`), counted
    like `mlp_kept`."""

    @property
    def narrower(self) -> bool:
        """Some axis besides the residual width keeps fewer units."""
        kept = (self.mlp_kept, self.shared_kept, self.experts, self.heads)
        return any(k is not None for k in kept)


@dataclass(frozen=True)
class _Shape:
    """The units a request keeps, resolved against the config, and how its parameters count."""

    family: ModelFamily
    full: PretrainedConfig
    """The original's config (blocks removed or not): the budget's reference."""
    config: PretrainedConfig
    one_basis: bool
    tied: bool
    shared: tuple[str, ...]
    mlp_width: int | None
    shared_width: int | None
    heads: int | None

    def param_model(self, config: PretrainedConfig) -> ParamModel:
        if self.one_basis:
            return stock_param_model(config, self.family, self.tied)
        return param_model(config, self.family, list(self.shared), self.tied)


def sliced_layout(
    config: PretrainedConfig, family: ModelFamily, families: Iterable[ModelFamily], request: LayoutRequest
) -> SlicedLayout:
    """Decide the sliced shape: check that the family allows the request's settings, then find the
    budget (SliceGPT's model at `sparsity`, or `target_params` of the original) and the widest
    uniform widths within it (or none, `allocated`: an allocator chooses), every other axis at the
    count the request keeps (`LayoutRequest`). Loads no weights."""
    shape = _shape(config, family, families, request)
    params, active = _counted_models(shape, request)
    widths, budget, rounding, active_budget = _budget_and_widths(shape, request, params, active)
    return SlicedLayout(
        family=family,
        config=shape.config,
        one_basis=shape.one_basis,
        sites=tuple(site_ids(family, shape.config.num_hidden_layers)),
        widths=None if request.allocated else widths,
        shared=shape.shared,
        tie_head=shape.tied,
        slice_head=request.slice_head,
        params=params,
        budget=budget,
        rounding=rounding,
        mlp_width=shape.mlp_width,
        shared_width=shape.shared_width,
        experts=request.experts,
        counts=request.counts,
        active=active,
        active_budget=active_budget,
        heads=shape.heads,
        removed_blocks=tuple(sorted(request.removed_blocks)),
    )


def _shape(
    config: PretrainedConfig, family: ModelFamily, families: Iterable[ModelFamily], request: LayoutRequest
) -> _Shape:
    """The request checked against the family and resolved: the config without the removed blocks,
    the basis sharing, the tied head and each axis's kept count."""
    if request.layout not in LAYOUTS:
        raise ValueError(f"unknown layout {request.layout!r}")
    if family.head_width_is_embedding_width and not request.slice_head:
        raise UserError(
            f"{config.model_type} models keep the embedding's width up to the head; set slicing.slice_head: true"
        )
    if request.shared_bases and family.parallel:
        raise UserError(
            f"slicing.shared_bases lets each layer's MLP keep its attention's basis, but {family.name} "
            f"layers have one site (attention and MLP in parallel); turn it off"
        )
    full = config
    if request.removed_blocks:
        config = depth_config(config, request.removed_blocks)
    one_basis = request.layout == "global"
    tied = request.tie_head
    tied = tied if tied is not None else (one_basis and bool(getattr(config, "tie_word_embeddings", False)))
    if tied:
        check_tie_head(config, family)
    if one_basis:
        check_stock(family, families)
    layers = config.num_hidden_layers
    shared = shared_site_ids(family, layers, request.slice_head, tied) if request.shared_bases else []
    mlp_kept, shared_kept, round_to = request.mlp_kept, request.shared_kept, request.mlp_round_to
    mlp_width = None if mlp_kept is None else kept_neurons(config, family, mlp_kept, round_to)
    shared_width = None if shared_kept is None else kept_shared_neurons(config, family, shared_kept, round_to)
    if request.experts is not None:
        kept_experts(config, family, request.experts)
    heads = None if request.heads is None else kept_heads(config, family, request.heads)
    return _Shape(family, full, config, one_basis, tied, tuple(shared), mlp_width, shared_width, heads)


def _counted_models(shape: _Shape, request: LayoutRequest) -> tuple[ParamModel, ParamModel | None]:
    """The parameter polynomial of the model the request keeps (the original's count its
    reference), and the active one where tokens are routed."""
    config, family = shape.config, shape.family
    params = shape.param_model(config)
    if request.removed_blocks:  # the original's own count stays the reference
        whole = shape.param_model(shape.full)
        params = dataclasses.replace(params, original=whole.original, routed=whole.routed)
    if request.narrower:  # every variant pruned so; `original` stays the original's
        reduced = with_mlp_width(config, family, shape.mlp_width, shape.shared_width)
        reduced = reduced if request.experts is None else with_experts(reduced, family, request.experts)
        reduced = reduced if shape.heads is None else with_heads(reduced, shape.heads)
        params = dataclasses.replace(shape.param_model(reduced), original=params.original, routed=params.routed)
    active = active_model(config, family, params, request.experts)
    if request.target_active_params is not None and active is None:
        raise UserError(
            f"target_active_params counts the parameters a token uses, but {config.model_type} models route "
            f"no token to some experts only (every parameter is active); give target_params instead"
        )
    return params, active


def _budget_and_widths(
    shape: _Shape, request: LayoutRequest, params: ParamModel, active: ParamModel | None
) -> tuple[dict[str, int], int, dict[str, int] | None, int | None]:
    """The widest uniform widths within the budget, the budget, what rounding gave up, and the
    active-parameter budget."""
    config, family, one_basis, round_to = shape.config, shape.family, shape.one_basis, request.round_to
    layers, d = config.num_hidden_layers, config.hidden_size

    def uniform(kept: int) -> dict[str, int]:
        return site_widths(family, layers, d, kept, one_basis or request.slice_head or shape.tied)

    saved = config if shape.heads is None else with_heads(config, shape.heads)  # the heads the saved class has
    required = width_multiple(saved, family) if one_basis else 1  # the stock class's own demand
    counted = params.without_embedding() if request.counts == "non_embedding" else params
    counted_active = None if active is None or request.counts != "non_embedding" else active.without_embedding()
    counted_active = counted_active or active
    active_budget = None
    if request.target_active_params is not None:
        assert counted_active is not None
        active_budget = int(request.target_active_params * counted_active.original)
    limit = None if active_budget is None else (counted_active, active_budget)

    def widest(budget: int) -> tuple[dict[str, int], dict[str, int]]:
        step = math.lcm(round_to, required)
        widths = widest_uniform(counted, budget, step, uniform, limit)
        exact = widest_uniform(counted, budget, required, uniform, limit)
        return widths, {
            "round_to": round_to,
            "class_multiple": required,
            "step": step,
            "width": widths[EMBEDDING],
            "params": counted.count(widths),
            "unrounded_width": exact[EMBEDDING],
            "unrounded_params": counted.count(exact),
        }

    rounding = None
    if request.sparsity is not None:  # the budget: the parameters of SliceGPT's model at this sparsity
        if request.counts != "all":
            raise ValueError("a sparsity's budget counts every parameter")
        kept = kept_width(d, request.sparsity, round_to)  # of the original: blocks removed come out of that budget
        widths = site_widths(family, layers, d, kept, request.slice_head)
        full = shape.full
        budget = param_model(full, family).count(
            site_widths(family, full.num_hidden_layers, d, kept, request.slice_head)
        )
        if shape.shared or shape.tied or one_basis or request.narrower or request.removed_blocks:  # more width
            widths, rounding = widest(budget)
    else:
        if request.target_params is None and request.target_active_params is None:
            raise ValueError("give a sparsity, a target_params or a target_active_params")
        budget = int((1.0 if request.target_params is None else request.target_params) * counted.original)
        widths, rounding = widest(budget)
    return widths, budget, rounding, active_budget


def active_model(
    config: PretrainedConfig, family: ModelFamily, params: ParamModel, experts: int | None
) -> ParamModel | None:
    """`params`' polynomial of the parameters one token uses, where each MoE layer keeps `experts`
    routed experts (None: all); None for a model without routed experts."""
    if family.experts is None or getattr(config, family.experts, None) is None or not params.routed:
        return None
    total = expert_count(config, family)
    top_k = int(getattr(config, family.experts_per_token, None) or total)
    return params.active(top_k, experts or total, total)


def kept_neurons(config: PretrainedConfig, family: ModelFamily, kept: float, round_to: int = 1) -> int:
    """The neurons every MLP keeps: `kept` itself, or (below 1) that fraction of the MLP's width
    rounded down to a multiple of `round_to`; checked against the width."""
    return _kept_of(mlp_neurons(config, family), kept, round_to, "mlp.kept", "the MLP's")


def _kept_of(width: int, kept: float, round_to: int, key: str, what: str) -> int:
    """`kept` neurons of `width` (a whole number, or below 1 a fraction rounded down to a multiple
    of `round_to`), or the line that refuses it."""
    neurons = int(kept) if kept >= 1 else int(kept * width) // round_to * round_to
    if not 0 < neurons <= width:
        raise UserError(
            f"{key} {kept:g} keeps {neurons} of {what} {width} neurons; keep between 1 and {width}"
            + (f" (a fraction is rounded down to a multiple of mlp.round_to={round_to})" if kept < 1 else "")
        )
    return neurons


def mlp_neurons(config: PretrainedConfig, family: ModelFamily) -> int:
    """The intermediate neurons of each of the model's MLPs; refused for a family that does not
    describe where they are (`ModelFamily.mlp_width`)."""
    if family.mlp_width is None or getattr(config, family.mlp_width, None) is None:
        raise UserError(
            f"{config.model_type} models: this family does not describe its MLP's width "
            f"(ModelFamily.mlp_width), so mlp: cannot prune it; remove mlp from the recipe"
        )
    return int(getattr(config, family.mlp_width))


def kept_shared_neurons(config: PretrainedConfig, family: ModelFamily, kept: float, round_to: int = 1) -> int:
    """The neurons every shared expert keeps (`mlp.shared_kept`, as `kept_neurons` reads `mlp.kept`)."""
    return _kept_of(shared_expert_neurons(config, family), kept, round_to, "mlp.shared_kept", "the shared expert's")


def shared_expert_neurons(config: PretrainedConfig, family: ModelFamily) -> int:
    """Each shared expert's intermediate neurons; refused for a model without a shared expert."""
    width = getattr(config, family.shared_expert_width, None) if family.shared_expert_width else None
    if not width:
        raise UserError(
            f"mlp.shared_kept: {config.model_type} models have no shared expert "
            f"(ModelFamily.shared_expert_width); remove mlp.shared_kept"
        )
    return int(width)


def with_mlp_width(
    config: PretrainedConfig, family: ModelFamily, neurons: int | None, shared: int | None = None
) -> PretrainedConfig:
    """A copy of `config` whose MLPs have `neurons` intermediate neurons and whose shared experts
    have `shared` (None: as they are): what the saved model's config says, and what its parameter
    count is counted from."""
    changed = copy.deepcopy(config)
    set_mlp_widths(changed, family, neurons, shared)
    return changed


def set_mlp_widths(config: PretrainedConfig, family: ModelFamily, neurons: int | None, shared: int | None) -> None:
    """Write the MLP widths into `config` in place (a model's own config, which its modules share)."""
    if neurons is not None:
        assert family.mlp_width is not None
        setattr(config, family.mlp_width, neurons)
    if shared is not None:
        assert family.shared_expert_width is not None
        setattr(config, family.shared_expert_width, shared)


def expert_count(config: PretrainedConfig, family: ModelFamily) -> int:
    """The routed experts of each of the model's MoE layers; refused for a family without them
    (`ModelFamily.experts`)."""
    if family.experts is None or getattr(config, family.experts, None) is None:
        raise UserError(
            f"{config.model_type} models have no routed experts this family describes (ModelFamily.experts), "
            f"so experts: cannot prune them; remove experts from the recipe"
        )
    return int(getattr(config, family.experts))


def kept_experts(config: PretrainedConfig, family: ModelFamily, kept: int) -> int:
    """`kept` checked against the layer's experts and the experts each token uses."""
    total, top_k = expert_count(config, family), getattr(config, family.experts_per_token, None)
    if top_k is None:
        raise UserError(
            f"{config.model_type} models: the config has no '{family.experts_per_token}' (the family's "
            f"ModelFamily.experts_per_token), so how many experts a token uses is unknown; name the config's key there"
        )
    top_k = int(top_k)
    if not top_k <= kept <= total:
        raise UserError(
            f"experts.kept {kept}: each token uses {top_k} of the {total} experts, so keep between {top_k} and {total}"
        )
    return kept


def with_experts(config: PretrainedConfig, family: ModelFamily, experts: int) -> PretrainedConfig:
    """A copy of `config` whose MoE layers have `experts` routed experts (the saved model's config)."""
    assert family.experts is not None
    changed = copy.deepcopy(config)
    setattr(changed, family.experts, experts)
    return changed


def fixed_layout(
    config: PretrainedConfig,
    family: ModelFamily,
    widths: Mapping[str, int] | None,
    *,
    shared: Collection[str] = (),
    tie_head: bool = False,
    layout: str = "per_site",
) -> SlicedLayout:
    """The layout of widths chosen by hand (None: an allocator chooses them), for a caller of
    `engine.prune` without a recipe (tests, benchmarks, a notebook); checked here, so the walk
    takes it as it is. The budget is what these widths cost (or the original model when none)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}")
    one_basis = layout == "global"
    sites = site_ids(family, config.num_hidden_layers)
    if one_basis:
        if shared or widths is None or len(set(widths.values())) != 1:
            raise ValueError(
                "a global layout takes one width for every site and no shared sites (every site keeps one basis)"
            )
    if tie_head:
        check_tie_head(config, family)
    if widths is not None:
        check_widths(family, sites, widths, sites[1:] if one_basis else shared, tie_head, one_basis)
    params = stock_param_model(config, family, tie_head) if one_basis else param_model(config, family, shared, tie_head)
    return SlicedLayout(
        family=family,
        config=config,
        one_basis=one_basis,
        sites=tuple(sites),
        widths=None if widths is None else dict(widths),
        shared=tuple(shared),
        tie_head=tie_head,
        slice_head=widths is not None and widths[sites[-1]] < config.hidden_size,
        params=params,
        budget=params.original if widths is None else params.count(dict(widths)),
    )


def check_widths(
    family: ModelFamily,
    sites: list[str],
    widths: Mapping[str, int],
    shared: Collection[str],
    tie_head: bool = False,
    one_basis: bool = False,
) -> None:
    """Every site has a width, the head's input is sliced like the embedding where it must be, and a
    site that keeps the previous site's basis follows it in its own layer (any site, one basis)
    at its width. A ValueError: widths come from code (a layout, an allocator), not from a user."""
    if sorted(widths) != sorted(sites):
        raise ValueError(f"expected widths for the sites {', '.join(sites)}; got {', '.join(widths)}")
    if (family.head_width_is_embedding_width or tie_head) and widths[EMBEDDING] != widths[sites[-1]]:
        raise ValueError(f"{family.name}: the head input must be sliced like the embedding (slice_head)")
    layer_of = {site: i for i in range(len(sites)) for site in layer_site_ids(family, i) if site in sites}
    for site in shared:
        if site not in sites[1:]:
            raise ValueError(f"{site} cannot reuse the previous site's basis: it is not a site after the first")
        previous = sites[sites.index(site) - 1]
        if not one_basis and (layer_of.get(site) is None or layer_of.get(previous) != layer_of[site]):
            raise ValueError(f"{site} can reuse only the basis of an earlier site of its own layer")
        if widths[site] != widths[previous]:
            raise ValueError(f"{site} reuses the previous site's basis, so it must keep the same width")


def check_tie_head(config: PretrainedConfig, family: ModelFamily) -> None:
    """`slicing.tie_head` needs a tied model whose embedding writes the stream and whose head reads it."""
    if not getattr(config, "tie_word_embeddings", False):
        raise UserError(
            "slicing.tie_head keeps a tied head tied, but this model's head is untied "
            "(tie_word_embeddings: false); turn slicing.tie_head off"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if stream_writers(model, family)[0] is not None or stream_reader(model, family) is not model.get_submodule(
        family.head
    ):
        raise UserError(
            f"slicing.tie_head: this {config.model_type} model projects between its embedding and the "
            f"stream, so its head cannot share the sliced embedding; turn slicing.tie_head off"
        )
