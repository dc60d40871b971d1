"""One parameter budget, two axes: the splits between the residual width and the MLP's width
that a run with `mlp:` but no `mlp.kept` chooses from (issue 34), and the expert and query-head
counts a run without `experts.kept` or `heads.kept` tries beside them, and the counts of
decoder blocks a run without `depth.removed` removes (issues 48, 49); with `slicing.kept` the one
split at that residual width (`stream_layout`).

Each candidate is a `SlicedLayout` that spends the budget: the MLP keeps m neurons and the
residual stream the widest width k the rest allows, then m is raised back to the most the budget
allows at that k (the layout's rounding of k would otherwise leave parameters unspent). The
first candidate is the residual width alone (m = the MLP's width), so a model whose MLP is dear
is never made worse by the choice. Computed from the config alone (no weights): `--dry-run`
lists them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from transformers import PretrainedConfig

from compressor.errors import UserError
from compressor.models.families import ModelFamily
from compressor.models.heads import heads_refusal, kept_heads, kv_heads, query_heads
from compressor.models.layout import LayoutRequest, SlicedLayout, mlp_neurons, sliced_layout


def split_layouts(
    config: PretrainedConfig,
    family: ModelFamily,
    families: Iterable[ModelFamily],
    request: LayoutRequest,
    *,
    min_kept: float,
    candidates: int,
) -> list[SlicedLayout]:
    """Up to `candidates` layouts under `request`'s budget (its `mlp_kept` unset): the residual
    width alone first, then wider residual widths, evenly spaced up to the widest whose MLP still
    keeps `min_kept` of its neurons, each with the most neurons (a multiple of the request's
    `mlp_round_to`) the budget leaves it."""
    assert request.mlp_kept is None, "the split chooses the MLP's width"
    families, mlp_round_to = list(families), request.mlp_round_to
    alone = sliced_layout(config, family, families, request)
    assert alone.widths is not None and alone.kept is not None, "splits are uniform widths: no allocator"
    width = mlp_neurons(config, family)
    low = min(width, max(mlp_round_to, math.ceil(min_kept * width / mlp_round_to) * mlp_round_to))
    step = alone.rounding["step"] if alone.rounding else request.round_to
    narrow = sliced_layout(
        config, family, families, dataclasses.replace(request, mlp_kept=low)
    )  # fewer parameters: it fits
    by_neurons: dict[int, int] = {}  # the widest residual width at each MLP width: it dominates
    for kept in range(alone.kept + step, config.hidden_size + 1, step):
        neurons = _most_neurons(alone, narrow, alone.uniform(kept), low, width, mlp_round_to)
        if low <= neurons < width:
            by_neurons[neurons] = kept
    frontier = _evenly(sorted(by_neurons, reverse=True), candidates - 1)  # ends at the widest stream
    splits = [alone]
    for neurons in frontier:
        layout = sliced_layout(config, family, families, dataclasses.replace(request, mlp_kept=neurons))
        assert layout.kept == by_neurons[neurons], "the parameter count is affine in the MLP's width"
        splits.append(layout)
    return splits


def stream_layout(
    config: PretrainedConfig,
    family: ModelFamily,
    families: Iterable[ModelFamily],
    stream: int,
    request: LayoutRequest,
) -> SlicedLayout:
    """The layout of `slicing.kept`: the residual width fixed at `stream`, the MLP keeping the most
    neurons (a multiple of the request's `mlp_round_to`) the budget leaves at that width: one split,
    nothing to choose. At the width the budget gives the residual axis alone it is that layout
    (every neuron)."""
    assert request.mlp_kept is None, "the budget chooses the MLP's width"
    families, mlp_round_to = list(families), request.mlp_round_to
    alone = sliced_layout(config, family, families, request)
    assert alone.kept is not None and alone.rounding is not None, "a fixed stream is a uniform width"
    d, step = config.hidden_size, alone.rounding["step"]
    if stream > d or stream % step:
        raise UserError(
            f"slicing.kept {stream}: give a multiple of {step} (slicing.round_to and what the saved class needs) "
            f"up to the hidden size {d}"
        )
    if stream == alone.kept:
        return alone
    if stream < alone.kept:
        raise UserError(
            f"slicing.kept {stream} is narrower than the {alone.kept} the budget keeps with every MLP neuron, so "
            f"the MLPs would have nothing to give; set slicing.kept to at least {alone.kept}, or lower the budget"
        )
    width = mlp_neurons(config, family)
    low = min(width, mlp_round_to)
    narrow = sliced_layout(config, family, families, dataclasses.replace(request, mlp_kept=low))
    neurons = _most_neurons(alone, narrow, alone.uniform(stream), low, width, mlp_round_to)
    if neurons < low:
        raise UserError(
            f"slicing.kept {stream}: even with {low} neuron(s) per MLP the model is over the budget at that width; "
            f"narrow slicing.kept, or raise the budget"
        )
    layout = sliced_layout(config, family, families, dataclasses.replace(request, mlp_kept=neurons))
    assert layout.kept is not None and layout.kept >= stream and layout.rounding is not None
    widths = layout.uniform(stream)  # the budget may allow a wider stream at these neurons: the recipe's stands
    rounding = {**layout.rounding, "width": stream, "params": layout.counted.count(widths)}
    return dataclasses.replace(layout, widths=widths, rounding=rounding)


def _most_neurons(
    alone: SlicedLayout, narrow: SlicedLayout, widths: dict[str, int], low: int, width: int, round_to: int
) -> int:
    """The most neurons (a multiple of `round_to`, at most `width`) the budget allows at residual
    `widths`: a model's parameters (and those a token uses) are affine in its MLP's width, so the
    counts with all neurons (`alone`'s polynomial) and with `low` (`narrow`'s) give every other."""
    limits = [(alone.counted, narrow.counted, alone.budget)]
    if alone.active_budget is not None:
        assert alone.counted_active is not None and narrow.counted_active is not None
        limits.append((alone.counted_active, narrow.counted_active, alone.active_budget))
    most = width
    for full_model, low_model, budget in limits:
        at_full, at_low = full_model.count(widths), low_model.count(widths)
        if at_full == at_low:  # no MLP parameters to give
            most = most if at_full <= budget else -1
        else:
            most = min(most, low + (budget - at_low) * (width - low) // (at_full - at_low))
    return min(width, most // round_to * round_to) if most >= 0 else -1


def expert_counts(total: int, top_k: int, min_kept: float, candidates: int) -> list[int]:
    """Up to `candidates` expert counts, evenly spaced from `total` (every expert, first) down to
    `min_kept` of them, never below `top_k` (the experts a token uses)."""
    low = max(top_k, math.ceil(min_kept * total))
    if candidates < 2 or low >= total:
        return [total]
    steps = min(candidates - 1, total - low)
    return sorted({total - round(i * (total - low) / steps) for i in range(steps + 1)}, reverse=True)


def head_counts(config: PretrainedConfig, family: ModelFamily, min_kept: float, candidates: int) -> list[int | None]:
    """Up to `candidates` query-head counts: every head (None) first, then the counts the family's
    class can hold (a multiple of the KV heads in grouped-query attention), evenly spaced from the
    largest below every head down to `min_kept` of them; refused in one line where the family's
    class cannot hold fewer heads."""
    refusal = heads_refusal(config, family)
    if refusal is not None:
        raise UserError(f"heads: {family.name} models cannot hold fewer query heads: {refusal}; remove heads")
    heads, groups = query_heads(config), kv_heads(config)
    step = groups if groups < heads else 1
    held = []
    for count in range(heads - step, 0, -step):
        if count < min_kept * heads:
            break
        try:
            held.append(kept_heads(config, family, count))
        except UserError:  # a count the config class refuses at this hidden size: the others may do
            continue
    return [None, *_evenly(held, candidates - 1)]


def depth_counts(layers: int, max_removed: int | None, candidates: int) -> list[int]:
    """Up to `candidates` counts of decoder blocks to remove: none (first), then counts evenly spaced
    up to `max_removed` (None: a quarter of the `layers`, at least one); refused in one line where
    no block would stay."""
    most = max(1, layers // 4) if max_removed is None else max_removed
    if most >= layers:
        raise UserError(
            f"depth.max_removed {most} removes every one of the model's {layers} blocks; remove at most {layers - 1}"
        )
    return [0, *_evenly(list(range(1, most + 1)), candidates - 1)]


def _evenly(items: list[int], count: int) -> list[int]:
    """At most `count` of `items`, evenly spaced and ending at the last (all when there are no more)."""
    if len(items) <= count:
        return items
    return [items[i] for i in sorted({round((i + 1) * len(items) / count) - 1 for i in range(count)})]
