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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
    """One layer's predicted error at each width of the grid (0: the FFN removed), and of removing
    its attention (None: the attention stays)."""

    layer: int
    errors: dict[int, float]
    attention: float | None = None


@dataclass(frozen=True)
class Allocation:
    """One MLP width per layer, and the layers whose attention goes."""

    widths: list[int]
    attention_removed: list[int]


def allocate(curves: Sequence[WidthCurve], total: int, attention_units: int = 0) -> Allocation:
    """One width per layer from its curve, and where a curve says what removing the attention
    costs, whether it goes; the widths plus `attention_units` per kept removable attention sum to
    at most `total`, with the least summed error (exact: dynamic programming over the common step).
    `total` counts every removable attention as kept."""
    options = [_options(curve, attention_units) for curve in curves]
    step = math.gcd(*(units for layer in options for units, _, _ in layer)) or 1
    units = total // step
    if sum(min(units for units, _, _ in layer) for layer in options) > total:
        counted = "" if not attention_units else f" (each attention that may go counted as {attention_units} of them)"
        raise UserError(
            f"the MLP widths cannot fit {total} neurons{counted} over {len(curves)} layers; raise the budget"
        )
    inf = float("inf")
    best = [0.0] + [inf] * units  # best[u]: least error of the layers so far within u units
    choices: list[list[tuple[int, tuple[int, bool]]]] = []
    for layer in options:
        new, pick = [inf] * (units + 1), [(0, (-1, True))] * (units + 1)
        for u in range(units + 1):
            for cost, error, choice in layer:
                need = cost // step
                if need <= u and best[u - need] + error < new[u]:
                    new[u], pick[u] = best[u - need] + error, (need, choice)
        best = new
        choices.append(pick)
    u = min(range(units + 1), key=lambda v: (best[v], v))
    picked: list[tuple[int, bool]] = []
    for pick in reversed(choices):
        need, choice = pick[u]
        picked.append(choice)
        u -= need
    picked.reverse()
    return Allocation(
        widths=[width for width, _ in picked],
        attention_removed=[i for i, (_, attention) in enumerate(picked) if not attention],
    )


def _options(curve: WidthCurve, attention_units: int) -> list[tuple[int, float, tuple[int, bool]]]:
    """A layer's choices as (units, error, (width, attention kept)): a kept removable attention
    costs `attention_units` (an attention that cannot go costs nothing here: the total leaves it out)."""
    removable = curve.attention is not None and attention_units > 0
    kept = [(w + (attention_units if removable else 0), e, (w, True)) for w, e in curve.errors.items()]
    if not removable:
        return kept
    assert curve.attention is not None
    return kept + [(w, e + curve.attention, (w, False)) for w, e in curve.errors.items()]


def width_grid(width: int, step: int) -> list[int]:
    """The widths a layer of `width` neurons may keep: 0, then every multiple of `step` up to it."""
    if width % step:
        raise UserError(
            f"the MLP's width {width} is not a multiple of {step}, the step DeciLM's engines round FFN widths to; "
            f"this model cannot be saved with per-layer widths"
        )
    return list(range(0, width + 1, step))
