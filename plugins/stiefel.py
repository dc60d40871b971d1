"""`stiefel`: refine the incoming removed subspace by minimising L(U) = Tr(UᵀCU·UᵀHU) directly on
the Stiefel manifold (geoopt's Riemannian Adam), from the closed-form Euclidean gradient
2CU(UᵀHU) + 2HU(UᵀCU). Chains after `sensitivity` (or `pca`); never returns a worse L than it
received. The paper runs 10,000 steps per site and finds the gain small."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import geoopt
import torch

from compressor.plugins import hookimpl
from compressor.strategy import (
    Basis,
    SiteProblem,
    Strategy,
    StrategyOptionError,
    complete_basis,
    coupled_loss,
    eigh_descending,
    frobenius_normalised,
)


@dataclass(frozen=True)
class Schedule:
    """`steps` at most; stop early after `patience` steps without a relative gain of `tolerance`."""

    steps: int = 10_000
    lr: float = 1e-3
    patience: int = 500
    tolerance: float = 1e-6


# option: (type, lower bound, bound allowed)
_LIMITS = {"steps": (int, 1, True), "lr": (float, 0.0, False), "patience": (int, 1, True), "tolerance": (float, 0.0, True)}


def loss_and_gradient(C: torch.Tensor, H: torch.Tensor, U: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Tr(UᵀCU·UᵀHU) and its Euclidean gradient 2CU(UᵀHU) + 2HU(UᵀCU), sharing the products."""
    CU, HU = C @ U, H @ U
    A, B = U.T @ CU, U.T @ HU
    return float((A * B).sum()), 2 * (CU @ B + HU @ A)  # Tr(AB) = Σ A∘B for symmetric B


class Stiefel(Strategy):
    name = "stiefel"
    description = "refine the incoming removed subspace: minimise Tr(UᵀCU·UᵀHU) on the Stiefel manifold"
    requires = ("C", "H")

    def parse_options(self, options: Mapping[str, Any]) -> Schedule:
        values = {}
        for key, value in options.items():
            if key not in _LIMITS:
                raise StrategyOptionError(f"strategy '{self.name}' has no option '{key}'; options: {', '.join(_LIMITS)}")
            kind, low, inclusive = _LIMITS[key]
            wanted = "an integer" if kind is int else "a number"
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
                raise StrategyOptionError(f"strategy '{self.name}': {key} must be {wanted}, got {value!r}")
            if value < low or (value == low and not inclusive):
                bound = f"at least {low}" if inclusive else f"above {low}"
                raise StrategyOptionError(f"strategy '{self.name}': {key} must be {bound}, got {value!r}")
            values[key] = kind(value)
        return Schedule(**values)

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
