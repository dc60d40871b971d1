"""`keep-coordinates`: prune without rotating. Keep the residual coordinates that carry the
most energy diag(C) and drop the rest: the baseline that tells how much a rotation such as
`pca` actually buys.

An example of a third-party compressor plugin; see docs/writing-a-strategy.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from compressor.plugin import (
    Basis,
    SiteProblem,
    Strategy,
    StrategyOptionError,
    hookimpl,
    removed_energy,
)

ORDERS = ("energy", "index")


@dataclass(frozen=True)
class Options:
    """Parsed once per recipe step (at validation), then handed to every `select` call."""

    order: str = "energy"


class KeepCoordinates(Strategy):
    name = "keep-coordinates"
    description = "no rotation: keep the coordinates with the largest energy diag(C)"

    def parse_options(self, options: Mapping[str, Any]) -> Options:
        """Reject bad options here so a recipe fails before any model is loaded."""
        unknown = sorted(set(options) - {"order"})
        if unknown:
            raise StrategyOptionError(f"strategy '{self.name}' has no option '{unknown[0]}'; its only option is order")
        order = options.get("order", "energy")
        if not isinstance(order, str) or order not in ORDERS:
            raise StrategyOptionError(f"strategy '{self.name}': order must be energy or index, got {order!r}")
        return Options(order=order)

    def select(self, problem: SiteProblem, incoming: Basis | None, options: Options) -> Basis:
        """A permutation of the current basis: the standard one, or the previous step's."""
        C = problem.stats.C
        base = torch.eye(problem.width, dtype=torch.float64, device=C.device) if incoming is None else incoming.Q
        if options.order == "energy":
            # Energy of each basis direction; stable so ties keep index order.
            columns = torch.argsort(torch.diagonal(base.T @ C @ base), descending=True, stable=True)
        else:
            columns = torch.arange(problem.width, device=C.device)
        Q = base[:, columns]
        removed = removed_energy(C, Q[:, problem.keep :])
        total = float(torch.trace(C))
        return Basis(
            Q=Q,
            objectives={"removed_energy": removed, "removed_energy_fraction": removed / total if total > 0 else 0.0},
        )


@hookimpl
def compressor_strategies() -> list[Strategy]:
    return [KeepCoordinates()]
