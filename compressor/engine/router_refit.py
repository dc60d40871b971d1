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
    held = torch.arange(x.shape[0], device=device) % HELD_OUT == HELD_OUT - 1
    if steps == 0 or bool(held.all()) or not bool(held.any()):
        before = _Tokens(held, x, target, gram, kept, block).cost(weight, bias)
        return RouterRefit(before, before, 0, False)
    fit = _Tokens(~held, x, target, gram, kept, block)
    logits = fit.logits(weight, bias)
    scales = torch.ones(len(kept), dtype=torch.float64, device=device)
    scales, offsets = _search(
        lambda a, b: fit.cost_of(logits * a + b), scales, torch.zeros_like(scales), bias is not None, steps
    )
    # the refitted rows as the router stores them (its dtype rounds them), priced on the held-out tokens
    stored_weight = (weight * scales[:, None]).to(router.weight.dtype)
    stored_bias = None if bias is None else (bias * scales + offsets).to(router.bias.dtype)
    check = _Tokens(held, x, target, gram, kept, block)
    before = check.cost(weight, bias)
    after = check.cost(stored_weight.to(torch.float64), None if stored_bias is None else stored_bias.to(torch.float64))
    applied = after < before
    if applied:
        router.weight = nn.Parameter(stored_weight.to(router.weight.device), requires_grad=False)
        if stored_bias is not None:
            router.bias = nn.Parameter(stored_bias.to(router.bias.device), requires_grad=False)
    return RouterRefit(before, after, steps, applied)


class _Tokens:
    """Some of the sampled tokens, with what the refit's cost needs of them precomputed: with w'
    the pruned router's weights over the K kept experts and t the original's over all E, the
    output change cᵀΓc = w'ᵀ Γ_KK w' − 2 w'ᵀ (Γt)_K + tᵀΓt, so a trial costs O(T·K²) and no copy
    of the T × E × E Gram."""

    def __init__(
        self,
        rows: torch.Tensor,
        x: torch.Tensor,
        target: torch.Tensor,
        gram: torch.Tensor,
        kept: torch.Tensor,
        block: RoutedExperts,
    ) -> None:
        self.x, self.top_k, self.normalise = x[rows], block.top_k, block.normalise
        t, G = target[rows], gram[rows]
        self.gram_kept = G[:, kept][:, :, kept]  # T × K × K
        self.cross = torch.einsum("tkf,tf->tk", G[:, kept], t)  # (Γt)_K, T × K
        self.constant = float(torch.einsum("te,tef,tf->", t, G, t))
        self.energy = max(self.constant, 1e-30)  # the block's output energy on these tokens, under G

    def logits(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.x @ weight.T + (0 if bias is None else bias)

    def cost(self, weight: torch.Tensor, bias: torch.Tensor | None) -> float:
        return self.cost_of(self.logits(weight, bias))

    def cost_of(self, logits: torch.Tensor) -> float:
        """The output change of routing by `logits` (T × K), a share of the block's output energy."""
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = torch.zeros_like(logits).scatter(1, chosen, weights)
        quadratic = torch.einsum("tk,tkl,tl->", routed, self.gram_kept, routed)
        return float(quadratic - 2 * (routed * self.cross).sum() + self.constant) / self.energy


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
