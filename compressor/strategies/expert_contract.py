"""What a Mixture-of-Experts expert selector sees and returns: the contract of the expert axis.

The engine (`engine.experts`) hands a selector one `ExpertProblem` per MoE layer: what the
calibration tokens did with each routed expert (how many were routed to it, REAP's gate-weighted
output norm, the largest output coordinate it wrote), and, for a selector that `requires`
"outputs", a sample of tokens with the router's probabilities over every expert and the Gram
matrix of every expert's output on each (weighed by the output sensitivity H of the stream the
block writes to, when the run estimated it). The selector returns which `keep` experts stay; the
layer's router loses the others' rows and each token re-picks its top-k among the rest. It is the
units contract (`strategies.units`) with the expert as its unit: selectors register through the
`compressor_selectors` hook (or the older `compressor_expert_selectors`) and know nothing about
model families.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from compressor.strategies.units import UnitChoice, UnitProblem, UnitSelector


@dataclass
class ExpertProblem(UnitProblem):
    """One MoE layer: keep `keep` of its `experts` routed experts (each token uses `top_k`).

    Per expert (length E): `tokens` routed (token, expert) pairs over the counted calibration
    tokens; `gate` the sum of their routing weights; `reap` REAP's score, the mean over the tokens
    routed to it of weight·‖output‖₂ (0 for an expert no token chose); `peak` the largest |output
    coordinate| it wrote on a routed token (where massive activations come from); `protected`
    experts the recipe keeps whatever the scores say (REAP's super experts). With "outputs" in
    `requires`: `probabilities` (T × E, float64) the router's softmax of T sampled tokens,
    `gram` (T × E × E, float64) ⟨f_i, G f_j⟩ of the experts' outputs on each (G = H of the stream
    the block writes to, or the identity), and `normalise`: whether the family renormalises the
    top-k weights (else each kept weight is the softmax over the experts left)."""

    layer: int
    keep: int
    top_k: int
    normalise: bool
    tokens: torch.Tensor
    gate: torch.Tensor
    reap: torch.Tensor
    peak: torch.Tensor
    protected: torch.Tensor
    counted: int = 0
    probabilities: torch.Tensor | None = None
    gram: torch.Tensor | None = None
    weighed_by_h: bool = False

    unit: ClassVar[str] = "expert"

    @property
    def experts(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def units(self) -> int:
        return self.experts

    def refusal(self, kept: torch.Tensor) -> str | None:
        """Protected (super) experts stay."""
        dropped = sorted(set(torch.nonzero(self.protected).flatten().tolist()) - set(kept.tolist()))
        if dropped:
            return (
                f"removed protected (super) expert(s) {dropped}; a selector keeps them (keep_highest does), "
                "or set experts.protect_super: false"
            )
        return None


ExpertChoice = UnitChoice
"""The kept experts (indices into the layer's E, any order) and the selector's own figures."""


class ExpertSelector(UnitSelector[ExpertProblem]):
    """Chooses which of a layer's routed experts stay. `requires` names the statistics it cannot do
    without ("outputs": the problem's `probabilities` and `gram`, which cost the engine a pass of
    every sampled token through every expert)."""

    unit: ClassVar[str] = "expert"


def keep_highest(scores: torch.Tensor, problem: ExpertProblem) -> torch.Tensor:
    """The `keep` experts with the highest scores, protected ones first (ties to the lower index)."""
    ranked = scores.to(torch.float64).clone()
    ranked[problem.protected] = torch.inf
    order = torch.sort(ranked, descending=True, stable=True).indices
    return torch.sort(order[: problem.keep]).values


def routing_weights(P: torch.Tensor, removed: torch.Tensor, top_k: int, normalise: bool) -> torch.Tensor:
    """Each token's weight on every expert (C × T × E) when the experts `removed` (C × E) are gone:
    top-k of the probabilities left, renormalised over the k, or (without `normalise`) the softmax
    over the experts left, which is the probability over what is left's sum."""
    left = P[None].masked_fill(removed[:, None, :], 0.0)
    top, chosen = torch.topk(left, top_k, dim=-1)
    total = top.sum(-1, keepdim=True) if normalise else left.sum(-1, keepdim=True)
    return torch.zeros_like(left).scatter_(-1, chosen, top / total.clamp_min(1e-300))
