"""`stiefel`: refine the incoming removed subspace by minimising L(U) = Tr(UᵀCU·UᵀHU) directly on
the Stiefel manifold (geoopt's Riemannian Adam), from the closed-form Euclidean gradient
2CU(UᵀHU) + 2HU(UᵀCU). Chains after `sensitivity` (or `pca`); never returns a worse L than it
received. The paper runs 10,000 steps per site and finds the gain small."""

from __future__ import annotations

from typing import Annotated

import geoopt
import torch
from pydantic import StrictInt

from compressor.plugins import hookimpl
from compressor.strategy import (
    Basis,
    SiteProblem,
    Strategy,
    complete_basis,
    coupled_loss,
    eigh_descending,
    frobenius_normalised,
)
from compressor.validation import FORBID, Number, described, options


@options(frozen=True, config=FORBID)
class Schedule:
    """`steps` at most; stop early after `patience` steps without a relative gain of `tolerance`."""

    steps: Annotated[StrictInt, described("Riemannian Adam steps at most", ge=1)] = 10_000
    lr: Annotated[Number, described("the step size", gt=0)] = 1e-3
    patience: Annotated[StrictInt, described("steps without gain before stopping", ge=1)] = 500
    tolerance: Annotated[Number, described("the relative gain that counts", ge=0)] = 1e-6


def loss_and_gradient(C: torch.Tensor, H: torch.Tensor, U: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Tr(UᵀCU·UᵀHU) and its Euclidean gradient 2CU(UᵀHU) + 2HU(UᵀCU), sharing the products."""
    CU, HU = C @ U, H @ U
    A, B = U.T @ CU, U.T @ HU
    return float((A * B).sum()), 2 * (CU @ B + HU @ A)  # Tr(AB) = Σ A∘B for symmetric B


class Stiefel(Strategy):
    name = "stiefel"
    description = "refine the incoming removed subspace: minimise Tr(UᵀCU·UᵀHU) on the Stiefel manifold"
    requires = ("C", "H")
    option_class = Schedule

    def select(self, problem: SiteProblem, incoming: Basis | None, options: Schedule) -> Basis:
        C = frobenius_normalised(problem.stats.C)
        H = frobenius_normalised(problem.stats.extra["H"].to(C))
        start = incoming.Q if incoming is not None else eigh_descending(C)[1]
        start_removed = start[:, problem.keep:]
        start_loss = coupled_loss(C, H, start_removed)
        if problem.remove == 0:
            return Basis(Q=start, objectives={"loss_before": start_loss, "loss_after": start_loss, "steps": 0})
        U = geoopt.ManifoldParameter(start_removed.clone(), manifold=geoopt.Stiefel())
        optimiser = geoopt.optim.RiemannianAdam([U], lr=options.lr)
        best_loss, best, since_gain, steps = start_loss, start_removed, 0, 0
        for steps in range(1, options.steps + 1):
            loss, U.grad = loss_and_gradient(C, H, U.data)  # loss of the point about to be moved
            if loss < best_loss * (1 - options.tolerance):
                best_loss, best, since_gain = loss, U.data.clone(), 0
            else:
                since_gain += 1
                if since_gain >= options.patience:
                    break
            optimiser.step()
        if coupled_loss(C, H, U.data) < best_loss:
            best = U.data.clone()
        Q = complete_basis(best)
        final_loss = coupled_loss(C, H, Q[:, problem.keep:])
        if final_loss > start_loss:  # re-orthonormalising can cost a rounding error: keep the start
            Q, final_loss = start, start_loss
        return Basis(Q=Q, objectives={"loss_before": start_loss, "loss_after": final_loss, "steps": steps})


@hookimpl
def compressor_strategies() -> list[Strategy]:
    return [Stiefel()]
