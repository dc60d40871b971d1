"""Per-layer MLP widths under one neuron budget: the heterogeneous layout's allocation.

A stock model keeps one MLP width in every layer; DeciLM (`models.decilm`) keeps one per layer, so
the neurons a budget allows can go where they matter. Each layer's curve is the error its MLP's
output takes at every width of a grid (the engines' multiples of 256, and 0: the FFN removed):
the layer's selector chooses the kept neurons at each width, the down projection is refitted as the
MLP stage refits it, and the error is measured where the MLP writes, Tr[G·E[(Wh − W'h_S)(…)ᵀ]],
from the moments C = E[h hᵀ] alone. With G = H (the Fisher of the output KL at the stream the MLP
writes) every layer's error is in the same unit, half the predicted KL, so the curves compare
across layers; without H, G = I and they compare stream energies. `allocate` then picks one
width per layer minimising the summed error under the total (a multiple-choice knapsack on the
grid, exact by dynamic programming). The curves are measured on the unpruned model in one pass.

A layer's attention can join the allocation (DeciLM's `no_op` attention): its curve then also holds
the error of removing it, Tr[G·E[a aᵀ]] with a what the attention writes and G = H where it writes
(the same unit), and keeping it costs its parameters counted in neurons; removing it gives them to
the MLPs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from compressor.engine.kv_merge import KvMerge
from compressor.engine.width_search import WidthSolution
from compressor.errors import UserError


def weighted_error(
    down: torch.Tensor, C: torch.Tensor, kept: torch.Tensor, kept_down: torch.Tensor, G: torch.Tensor | None
) -> float:
    """Tr[G·E[(W h − W' h_S)(W h − W' h_S)ᵀ]] from C = E[h hᵀ]: the error where the MLP writes when
    only `kept` neurons stay and `kept_down` (d × |S|) reads them (G None: the identity)."""
    C_S = C[:, kept]
    error = down @ C @ down.T - down @ C_S @ kept_down.T
    error = error - kept_down @ C_S.T @ down.T + kept_down @ C[kept][:, kept] @ kept_down.T
    return float(torch.trace(error) if G is None else (G * error).sum())


@dataclass(frozen=True)
class WidthCurve:
    """One layer's predicted error at each width of the grid (0: the FFN removed), of removing its
    attention (None: the attention stays), and of each fewer KV-head count it may keep; with
    `solutions`, the kept neurons and refitted down projection at each width below the layer's own
    (`engine.width_search` assembles models from them)."""

    layer: int
    errors: dict[int, float]
    attention: float | None = None
    kv_merges: tuple[KvMerge, ...] = ()
    solutions: dict[int, WidthSolution] = field(default_factory=dict)


@dataclass(frozen=True)
class Allocation:
    """One MLP width per layer, the layers whose attention goes, and those that keep fewer KV heads."""

    widths: list[int]
    attention_removed: list[int]
    kv_heads: dict[int, int] = field(default_factory=dict)


REMOVED = 0
"""An attention state of `_options`: the attention goes (a positive one: that many KV heads; None: as it was)."""


def allocate(
    curves: Sequence[WidthCurve], total: int, attention_units: int = 0, kv_units: Mapping[int, int] | None = None
) -> Allocation:
    """One width per layer from its curve, and where a curve says what removing the attention (or
    merging its KV heads) costs, whether it does; the widths plus what each adjustable attention
    counts as (`attention_units` as it was, `kv_units[k]` at k KV heads, nothing removed) sum to at
    most `total`, with the least summed error (exact: dynamic programming over the common step).
    `total` counts every adjustable attention as kept."""
    options = [_options(curve, attention_units, kv_units or {}) for curve in curves]
    step = math.gcd(*(units for layer in options for units, _, _ in layer)) or 1
    units = total // step
    if sum(min(units for units, _, _ in layer) for layer in options) > total:
        counted = (
            "" if not attention_units else f" (each attention that may change counted as {attention_units} of them)"
        )
        raise UserError(
            f"the MLP widths cannot fit {total} neurons{counted} over {len(curves)} layers; raise the budget"
        )
    best = torch.full((units + 1,), math.inf, dtype=torch.float64)
    best[0] = 0.0  # best[u]: least error of the layers so far using exactly u units
    picks: list[torch.Tensor] = []
    for layer in options:
        new = torch.full_like(best, math.inf)
        pick = torch.zeros(units + 1, dtype=torch.int16)  # an option's index: a layer has hundreds at most
        for o, (cost, error, _) in enumerate(layer):
            need = cost // step
            if need > units:
                continue
            candidate = torch.full_like(best, math.inf)
            candidate[need:] = best[: units + 1 - need] + error
            better = candidate < new  # strictly: the first option of equal error stays
            new, pick = (
                torch.where(better, candidate, new),
                torch.where(better, torch.tensor(o, dtype=torch.int16), pick),
            )
        best = new
        picks.append(pick)
    u = int(torch.argmin(best))  # the fewest units of the least error
    picked: list[tuple[int, int | None]] = []
    for layer, pick in zip(reversed(options), reversed(picks)):
        cost, _, choice = layer[int(pick[u])]
        picked.append(choice)
        u -= cost // step
    picked.reverse()
    return Allocation(
        widths=[width for width, _ in picked],
        attention_removed=[i for i, (_, state) in enumerate(picked) if state == REMOVED],
        kv_heads={i: state for i, (_, state) in enumerate(picked) if state},
    )


def _options(
    curve: WidthCurve, attention_units: int, kv_units: Mapping[int, int]
) -> list[tuple[int, float, tuple[int, int | None]]]:
    """A layer's choices as (units, error, (width, attention state)): an adjustable attention kept
    as it was costs `attention_units`, one at k KV heads `kv_units[k]` (and its merge's error), a
    removed one nothing (and its removal's error); an attention that cannot change costs nothing
    here (the total leaves it out)."""
    states: list[tuple[int, float, int | None]] = []
    if attention_units > 0 and (curve.attention is not None or curve.kv_merges):
        states.append((attention_units, 0.0, None))
        states += [(kv_units[merge.kv], merge.error, merge.kv) for merge in curve.kv_merges]
        if curve.attention is not None:
            states.append((0, curve.attention, REMOVED))
    else:
        states.append((0, 0.0, None))
    return [(w + units, e + error, (w, state)) for units, error, state in states for w, e in curve.errors.items()]


def width_grid(width: int, step: int) -> list[int]:
    """The widths a layer of `width` neurons may keep: 0, then every multiple of `step` up to it."""
    if width % step:
        raise UserError(
            f"the MLP's width {width} is not a multiple of {step}, the step DeciLM's engines round FFN widths to; "
            f"this model cannot be saved with per-layer widths"
        )
    return list(range(0, width + 1, step))
