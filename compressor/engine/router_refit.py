"""A router refit after expert pruning: the kept rows of a MoE layer's router rescaled (and its
bias shifted, where it has one) so that the block, with its experts fewer, writes what it wrote
with all of them.

When experts go, each token re-picks its top-k among the rest and its weights renormalise (or,
without renormalisation, grow): the router was trained for experts that are gone. With the block
writing y = Σ_e w_e(x)·f_e(x) and the experts themselves untouched, the change of its output on a
token is Σ_e c_e f_e with c = w'(x) − w(x) (the pruned router's weights against the original's,
over every expert), so its cost under G (H of the stream the block writes to: the KL's
second-order term; the identity without it) is cᵀ Γ c with Γ_ef = ⟨f_e, G f_f⟩, the Gram matrix
the output-aware selector already takes on its token sample.

The cost is piecewise smooth: moving a logit changes which experts a token picks, in jumps, and
gradient steps on the router's rows raised it on calibration models (measured: Adam on every
row made it worse on the tokens it fitted). So the refit searches a few numbers that every
family's router can store: one scale per kept row (a temperature per expert, W_e ← a_e·W_e) and,
where the router has a bias (gpt-oss), one offset per expert; a coordinate search tries each up
and down, keeps what lowers the cost, and halves its steps when nothing does. The sample's last
quarter is held out: the refit is kept only where it lowers the cost there too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from compressor.models.experts import RoutedExperts
from compressor.strategies.expert_contract import routing_weights

HELD_OUT = 4
"""One sampled token in this many is held out to accept or refuse the refit."""


@dataclass(frozen=True)
class RouterRefit:
    """What a refit did at one layer: the held-out cost before and after (a share of the block's
    output energy on those tokens), the search's rounds and whether the refit was kept."""

    before: float
    after: float
    steps: int
    applied: bool

    def as_dict(self) -> dict[str, float | int | bool]:
        return {"before": self.before, "after": self.after, "steps": self.steps, "applied": self.applied}


def refit_router(
    block: RoutedExperts,
    kept: torch.Tensor,
    inputs: torch.Tensor,
    probabilities: torch.Tensor,
    gram: torch.Tensor,
    steps: int,
) -> RouterRefit:
    """Refit `block`'s router (already cut to the experts `kept`, ascending indices into the
    original E) on the sampled tokens `inputs` (T × d), whose original router probabilities over
    every expert are `probabilities` (T × E) and whose experts' output Gram matrices under G are
    `gram` (T × E × E), for at most `steps` rounds of the coordinate search. In place; returns what
    it did."""
    router = block.router
    device = gram.device
    x = inputs.to(device, torch.float64)
    kept = kept.to(device)
    nothing = torch.zeros(1, probabilities.shape[1], dtype=torch.bool, device=device)
    target = routing_weights(probabilities.to(device, torch.float64), nothing, block.top_k, block.normalise)[0]
    weight = router.weight.detach().to(device, torch.float64)
    bias = None if router.bias is None else router.bias.detach().to(device, torch.float64)
    logits = x @ weight.T + (0 if bias is None else bias)  # T × K, as the cut router gives them
    energy = torch.einsum("te,tef,tf->t", target, gram, target)
    held = torch.arange(x.shape[0], device=device) % HELD_OUT == HELD_OUT - 1

    def cost(rows: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> float:
        weights, chosen = torch.topk(torch.softmax(logits[rows] * scales + offsets, dim=-1), block.top_k, dim=-1)
        if block.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        change = torch.zeros_like(target[rows]).scatter(1, kept[chosen], weights) - target[rows]
        return float(torch.einsum("te,tef,tf->", change, gram[rows], change) / energy[rows].sum().clamp_min(1e-30))

    scales = torch.ones(len(kept), dtype=torch.float64, device=device)
    offsets = torch.zeros_like(scales)
    before = cost(held, scales, offsets)
    if steps == 0 or bool(held.all()) or not bool(held.any()):
        return RouterRefit(before, before, 0, False)
    scales, offsets = _search(lambda a, b: cost(~held, a, b), scales, offsets, bias is not None, steps)
    after = cost(held, scales, offsets)
    applied = after < before
    if applied:
        like = router.weight
        router.weight = nn.Parameter((weight * scales[:, None]).to(like.device, like.dtype), requires_grad=False)
        if bias is not None:
            shifted = bias * scales + offsets
            router.bias = nn.Parameter(shifted.to(router.bias.device, router.bias.dtype), requires_grad=False)
    return RouterRefit(before, after, steps, applied)


def _search(
    cost: Callable[[torch.Tensor, torch.Tensor], float],
    scales: torch.Tensor,
    offsets: torch.Tensor,
    with_offsets: bool,
    rounds: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A coordinate search on `cost`, `rounds` times: all scales at once (×e^±step), then every
    row's scale and, `with_offsets`, its offset (±step), each move tried from the best so far and
    kept where it lowers the cost; a round that keeps none halves the steps."""
    best = cost(scales, offsets)
    steps = {"scale": 0.25, "offset": 0.5}

    def moved(kind: str, row: int | None, sign: float) -> tuple[torch.Tensor, torch.Tensor]:
        if kind == "offset":
            shifted = offsets.clone()
            shifted[row] += sign * steps["offset"]
            return scales, shifted
        factor = math.exp(sign * steps["scale"])
        if row is None:
            return scales * factor, offsets
        rescaled = scales.clone()
        rescaled[row] *= factor
        return rescaled, offsets

    coordinates = [("scale", None)] + [("scale", row) for row in range(len(scales))]
    coordinates += [("offset", row) for row in range(len(scales))] if with_offsets else []
    for _ in range(rounds):
        improved = False
        for kind, row in coordinates:
            for sign in (1.0, -1.0):
                candidate = moved(kind, row, sign)
                value = cost(*candidate)
                if value < best:
                    best, (scales, offsets), improved = value, candidate, True
                    break
        if not improved:
            steps = {kind: step / 2 for kind, step in steps.items()}
    return scales, offsets
