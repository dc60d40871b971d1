"""Built-in attention-head selectors (issue 49): which query heads of a layer stay, the same
number in every KV group.

- `norm` (Minitron): the heads whose output z_h (what the head hands the output projection) has
  the largest norm, the L2 over windows of the mean ‖z_h‖ over a window's positions.
- `obs` (output-aware, the neuron axis's `obs` with a head's block of `head_dim` columns in place
  of a neuron): greedy optimal-brain-surgeon removal. Removing head R and refitting the others
  costs ΔE_R = Tr[(P_RR)⁻¹ W_Rᵀ G W_R], P = (C + δI)⁻¹ over the heads left, W_R the head's
  output-projection columns as refitted so far and G the output sensitivity H of the stream the
  attention writes to (the identity without H: then it is the least-squares output error). One
  head goes per step, the cheapest of the groups that still hold more than they keep, followed by
  the exact refit of the others and the block downdate of P.
"""

from __future__ import annotations

import math

import torch

from compressor.plugin import HeadChoice, HeadProblem, HeadSelector, hookimpl, top_per_group


class OutputNorm(HeadSelector):
    name = "norm"
    description = "Minitron: keep the heads whose output has the largest norm (L2 over windows of mean ‖z_h‖)"

    def select(self, problem: HeadProblem) -> HeadChoice:
        return HeadChoice(top_per_group(problem.activation, problem))


class HeadSurgeon(HeadSelector):
    name = "obs"
    description = "output-aware: greedy OBS removal of whole heads, cost Tr[(P_RR)⁻¹ W_Rᵀ H W_R] with the refit"

    def select(self, problem: HeadProblem) -> HeadChoice:
        C, W = problem.C, problem.down.clone()
        P = C.clone()
        P.diagonal().add_(problem.damping)
        P = torch.linalg.inv(P)
        alive = torch.ones(problem.heads, dtype=torch.bool)
        left = torch.full((problem.groups,), problem.heads // problem.groups)
        predicted, order = 0.0, []
        for _ in range(problem.heads - problem.keep):
            GW = W if problem.G is None else problem.G @ W
            costs = torch.full((problem.heads,), math.inf, dtype=torch.float64)
            for head in range(problem.heads):
                if alive[head] and left[problem.group_of(head)] > problem.per_group:
                    R = problem.columns(torch.tensor([head], device=C.device))
                    costs[head] = float(torch.trace(torch.linalg.solve(P[R][:, R], W[:, R].T @ GW[:, R])))
            head = int(torch.argmin(costs))
            R = problem.columns(torch.tensor([head], device=C.device))
            predicted += float(costs[head])
            step = torch.linalg.solve(P[R][:, R], P[R])  # P_RR⁻¹ P_R,:
            W.addmm_(W[:, R], step, alpha=-1)  # the others refitted to what R wrote; W[:, R] becomes 0
            P.addmm_(P[:, R], step, alpha=-1)  # the inverse over the heads left
            alive[head] = False
            left[problem.group_of(head)] -= 1
            order.append(head)
        kept = torch.nonzero(alive).flatten()
        return HeadChoice(
            kept,
            {
                "predicted_loss": predicted,
                "removed_in_order": order,
                "sensitivity": "H" if problem.G is not None else "none",
            },
        )


@hookimpl
def compressor_selectors() -> list[HeadSelector]:
    return [OutputNorm(), HeadSurgeon()]
