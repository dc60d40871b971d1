"""Exact parameter counts of sliced models from a config alone, and the widths a budget allows.

A sliced model's parameter count is a polynomial in its site widths k_s:

    P(k) = constant + Σ_s linear_s·k_s + Σ_(s,t) k_s·k_t

where the last sum runs over the residual transitions (a k_t × k_s matrix between consecutive
sites s, t; none where a site reuses the previous site's basis) and, for a head kept tied to
the embedding, the map from the last site to the embedding's width. `param_model` reads the
constant and every coefficient off one sliced model built on the meta device (no memory) with
each site's width set to a distinct marker, so the count is exact for any family the sliced
architecture supports, head and transitions included, and no family is described twice.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from compressor.errors import UserError
from compressor.models.families import ModelFamily, is_routed_parameter, stream_reader
from compressor.models.sites import layout, site_ids
from compressor.models.sliced import apply_slicing_layout

MARKER = 7_000_003
"""Widths of the marker model start here: far above any real dimension (vocabularies, MLPs)."""


@dataclass(frozen=True)
class ParamModel:
    """P(widths) of one model's sliced variants (see the module docstring)."""

    sites: tuple[str, ...]
    constant: int
    linear: Mapping[str, int]
    transitions: tuple[tuple[str, str], ...]
    original: int
    """Parameters of the original model (tied weights once)."""
    hidden_size: int
    embedding: int = 0
    """Parameters of the original's token (and position) embeddings: a small model's budget is
    mostly these (the plan reports their share)."""
    embedding_constant: int = 0
    embedding_linear: Mapping[str, int] = field(default_factory=dict)
    """The embedding tables' share of `constant` and `linear` (their parameters at any widths)."""
    routed_constant: int = 0
    routed_linear: Mapping[str, int] = field(default_factory=dict)
    """The routed experts' share of `constant` and `linear` (`families.is_routed_parameter`): of
    these a token uses top_k in every layer's experts (`active`)."""
    routed: int = 0
    """Parameters of the original's routed experts."""

    def count(self, widths: Mapping[str, int]) -> int:
        return (
            self.constant
            + sum(self.linear[s] * widths[s] for s in self.sites)
            + sum(widths[s] * widths[t] for s, t in self.transitions)
        )

    def transition_params(self, widths: Mapping[str, int]) -> int:
        return sum(widths[s] * widths[t] for s, t in self.transitions)

    def active(self, top_k: int, experts: int, original_experts: int) -> ParamModel:
        """The polynomial of the parameters one token uses (`target_active_params`): this model's
        routed experts (`experts` per layer) count `top_k` of `experts`, the original's (`routed`,
        `original_experts` per layer) `top_k` of theirs; the router and everything else counts whole.
        Exact: every routed expert of a layer has the same shape, so each share divides evenly."""

        def used(routed: int, of: int) -> int:
            share, rest = divmod(routed * top_k, of)
            assert not rest, "every routed expert has the same parameters"
            return share

        return dataclasses.replace(
            self,
            constant=self.constant - self.routed_constant + used(self.routed_constant, experts),
            linear={
                s: self.linear[s] - self.routed_linear.get(s, 0) + used(self.routed_linear.get(s, 0), experts)
                for s in self.sites
            },
            original=self.original - self.routed + used(self.routed, original_experts),
            routed_constant=used(self.routed_constant, experts),
            routed_linear={s: used(n, experts) for s, n in self.routed_linear.items()},
            routed=used(self.routed, original_experts),
        )

    def without_embedding(self) -> ParamModel:
        """The polynomial of the non-embedding parameters (`budget: non_embedding`): the same model
        less its token and position tables, which a small model's budget is mostly made of. A head
        tied to the embedding is the embedding; an untied head counts."""
        return dataclasses.replace(
            self,
            constant=self.constant - self.embedding_constant,
            linear={s: self.linear[s] - self.embedding_linear.get(s, 0) for s in self.sites},
            original=self.original - self.embedding,
            embedding=0,
            embedding_constant=0,
            embedding_linear={},
        )


def meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """The model of `config` on the meta device: shapes without memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) parameters once


def layout_config(
    model: torch.nn.Module,
    family: ModelFamily,
    widths: Mapping[str, int],
    shared: Collection[str] = (),
    tied: bool = False,
) -> dict:
    """The `slicing` entry `apply_slicing_layout` builds `widths` from, for an original model."""
    final_norm = model.get_submodule(family.final_norm)
    shape = layout(family, model.config.num_hidden_layers, widths, shared)
    value = {
        "hidden_size": model.config.hidden_size,
        "embedding": shape.embedding,
        "attn": shape.attn,
        "mlp": shape.mlp,
        "norm_eps": 1e-6,
        "reader_bias": stream_reader(model, family).bias is not None or getattr(final_norm, "bias", None) is not None,
    }
    if any(shape.attn_shared) or any(shape.mlp_shared):
        value.update(attn_shared=shape.attn_shared, mlp_shared=shape.mlp_shared)
    if tied:
        value["tied_head"] = True
    return value


def param_model(
    config: PretrainedConfig, family: ModelFamily, shared: Collection[str] = (), tied: bool = False
) -> ParamModel:
    """The exact parameter polynomial of `config`'s sliced variants; `shared` names the sites that
    reuse the previous site's basis (no transition into them); `tied`: the head stays tied to the
    embedding (a map from the last site's width to the embedding's replaces it)."""
    return _param_model(config.to_json_string(), family, tuple(sorted(shared)), tied)


@lru_cache(maxsize=16)
def _param_model(config_json: str, family: ModelFamily, shared: tuple[str, ...], tied: bool) -> ParamModel:
    config = AutoConfig.for_model(**json.loads(config_json))
    ids = site_ids(family, config.num_hidden_layers)
    model = meta_model(config)
    original, routed = _count(model), routed_params(model, family)
    embedding = sum(table.numel() for table in embedding_tables(model, family))
    markers = {MARKER + 1009 * index: site for index, site in enumerate(ids)}
    widths = {site: width for width, site in markers.items()}
    apply_slicing_layout(model, family, layout_config(model, family, widths, shared, tied))
    tables = {id(table) for table in embedding_tables(model, family)}
    constant, linear, transitions = 0, dict.fromkeys(ids, 0), []
    embedding_constant, embedding_linear = 0, dict.fromkeys(ids, 0)
    routed_constant, routed_linear = 0, dict.fromkeys(ids, 0)
    for name, parameter in model.named_parameters():
        in_experts = is_routed_parameter(family, name)
        dims = [markers.get(int(size), int(size)) for size in parameter.shape]
        marked = [d for d in dims if isinstance(d, str)]
        rest = 1
        for d in dims:
            if isinstance(d, int):
                if d >= MARKER:
                    raise RuntimeError(f"{name}: dimension {d} is neither a site width nor a fixed size")
                rest *= d
        if not marked:
            constant += rest
            embedding_constant += rest if id(parameter) in tables else 0
            routed_constant += rest if in_experts else 0
        elif len(marked) == 1:
            linear[marked[0]] += rest
            embedding_linear[marked[0]] += rest if id(parameter) in tables else 0
            routed_linear[marked[0]] += rest if in_experts else 0
        else:
            pair = tuple(sorted(marked, key=ids.index))
            consecutive = ids.index(pair[1]) == ids.index(pair[0]) + 1
            if len(marked) != 2 or rest != 1 or not (consecutive or (tied and pair == (ids[0], ids[-1]))):
                raise RuntimeError(f"{name} {tuple(parameter.shape)}: not a transition between consecutive sites")
            transitions.append(pair)  # a pair twice is two matrices (a one-layer model's shortcut and tied map)
    return ParamModel(
        sites=tuple(ids),
        constant=constant,
        linear=linear,
        transitions=tuple(sorted(transitions, key=lambda p: ids.index(p[0]))),
        original=original,
        hidden_size=config.hidden_size,
        embedding=embedding,
        embedding_constant=embedding_constant,
        embedding_linear=embedding_linear,
        routed_constant=routed_constant,
        routed_linear=routed_linear,
        routed=routed,
    )


def routed_params(model: torch.nn.Module, family: ModelFamily) -> int:
    """Parameters of `model`'s routed experts (0 for a family without them)."""
    return sum(p.numel() for name, p in model.named_parameters() if is_routed_parameter(family, name))


def embedding_tables(model: torch.nn.Module, family: ModelFamily) -> list[torch.nn.Parameter]:
    """The token (and position) embedding tables of `model`, original or sliced."""
    return [model.get_submodule(path).weight for path in (family.embedding, *family.extra_embeddings)]


def widest_uniform(
    params: ParamModel,
    budget: int,
    round_to: int,
    uniform: Callable[[int], dict[str, int]],
    active: tuple[ParamModel, int] | None = None,
) -> dict[str, int]:
    """The widest uniform widths, `uniform(kept)` for a multiple `kept` of `round_to`, whose sliced
    model has at most `budget` parameters (and, with `active`, at most its budget of parameters per
    token by its polynomial); a UserError naming the limit even the narrowest breaks."""
    limits = [(params, budget, "target_params")] + ([(active[0], active[1], "target_active_params")] if active else [])
    kept = params.hidden_size - params.hidden_size % round_to
    while kept > 0:
        widths = uniform(kept)
        if all(model.count(widths) <= most for model, most, _ in limits):
            return widths
        kept -= round_to
    narrowest = uniform(round_to)
    model, most, key = next(limit for limit in limits if limit[0].count(narrowest) > limit[1])
    smallest = model.count(narrowest)
    what = "parameters per token" if key == "target_active_params" else "parameters"
    reachable = math.ceil(1000 * smallest / model.original) / 1000
    fix = (
        f"raise {key} to at least {reachable:g}, or "
        if reachable <= 1
        else "no target is reachable while the head's input is kept whole: "
    )
    raise UserError(
        f"no uniform width reaches {most:,} {what} ({most / model.original:.1%} of the original's): the "
        f"narrowest model (width {round_to}) has {smallest:,} ({smallest / model.original:.1%}); "
        f"{fix}set slicing.slice_head: true (or, for a tied model, slicing.tie_head: true)"
    )
