"""Built-in MLP neuron selectors (issue 34): which of a layer's intermediate neurons stay.

- `magnitude` (Minitron-style): the neurons with the largest activation, the L2 norm over windows
  of the mean |h| over a window's positions (Minitron scores the first linear's output; this
  scores the down projection's input, the activation the refit reads).
- `leverage` (MoDeGPT): the largest ridge leverage scores [C(C + δI)⁻¹]_jj, how much of the span
  of the calibration activations each neuron carries.
- `obs` (output-aware, the paper's idea applied to neurons): greedy optimal-brain-surgeon removal.
  Removing neuron j and refitting the rest costs ΔE_j = w_jᵀ G w_j / [(C_SS + δI)⁻¹]_jj, w_j its
  down-projection column as refitted so far and G the output sensitivity H of the stream the MLP
  writes to (the identity when the run has no H: then it is the least-squares output error).
  Neurons go in blocks (1/32 of those to remove at a time), each followed by the exact refit of
  the others and the downdate of the inverse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from compressor.plugin import NeuronChoice, NeuronProblem, NeuronSelector, hookimpl, top_k

BLOCKS = 32
"""`obs` removes the neurons in this many blocks (fewer when fewer go)."""


class Magnitude(NeuronSelector):
    name = "magnitude"
    description = "Minitron-style: keep the neurons with the largest activation (L2 over windows of mean |h|)"

    def select(self, problem: NeuronProblem) -> NeuronChoice:
        return NeuronChoice(top_k(problem.activation, problem.keep))


class Leverage(NeuronSelector):
    name = "leverage"
    description = "MoDeGPT: keep the neurons with the largest ridge leverage [C(C + δI)⁻¹]_jj"

    def select(self, problem: NeuronProblem) -> NeuronChoice:
        C = problem.C
        scores = torch.diagonal(torch.linalg.solve(_damped(C, problem.damping), C))
        kept = top_k(scores, problem.keep)
        total = float(scores.sum())
        return NeuronChoice(kept, {"kept_leverage_share": float(scores[kept].sum()) / total if total > 0 else 0.0})


class OptimalBrainSurgeon(NeuronSelector):
    name = "obs"
    description = "output-aware: greedy OBS removal, cost w_jᵀ H w_j / [(C_SS + δI)⁻¹]_jj with the refit"

    def select(self, problem: NeuronProblem) -> NeuronChoice:
        return self.select_widths(problem, [problem.keep])[problem.keep]

    def select_widths(self, problem: NeuronProblem, widths: Sequence[int]) -> dict[int, NeuronChoice]:
        """One greedy path down to the narrowest of `widths`, its blocks sized by that width (one
        width: exactly `select`'s), the neurons left recorded as it reaches each wider one."""
        C, W, f = problem.C, problem.down.clone(), problem.width
        P = torch.linalg.inv(_damped(C, problem.damping))
        alive = torch.ones(f, dtype=torch.bool, device=C.device)
        stops = sorted(set(widths), reverse=True)
        left = f
        block = max(1, math.ceil((f - stops[-1]) / BLOCKS))
        predicted = 0.0
        choices = {}
        for stop in stops:
            while left > stop:
                GW = W if problem.G is None else problem.G @ W
                scores = (W * GW).sum(0) / torch.diagonal(P).clamp_min(1e-300)
                scores[~alive] = math.inf
                size = min(block, left - stop)
                R = torch.topk(scores, size, largest=False).indices
                P_RR = P[R][:, R]
                W_R = W[:, R]
                predicted += float(torch.trace(torch.linalg.solve(P_RR, W_R.T) @ (GW[:, R])))
                step = torch.linalg.solve(P_RR, P[R])  # P_RR⁻¹ P_R,: (b × f)
                W.addmm_(W_R, step, alpha=-1)  # the others refitted to what R wrote; W[:, R] becomes 0
                P.addmm_(P[:, R], step, alpha=-1)  # the inverse of the damped C over the neurons left (in place)
                alive[R] = False
                left -= size
            objectives = {"predicted_loss": predicted, "sensitivity": "H" if problem.G is not None else "none"}
            choices[stop] = NeuronChoice(torch.nonzero(alive).flatten(), objectives)
        return choices


def _damped(C: torch.Tensor, damping: float) -> torch.Tensor:
    """C + δI, without an f × f identity beside it."""
    damped = C.clone()
    damped.diagonal().add_(damping)
    return damped


@hookimpl
def compressor_selectors() -> list[NeuronSelector]:
    return [Magnitude(), Leverage(), OptimalBrainSurgeon()]
