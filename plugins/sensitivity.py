"""`sensitivity`: the paper's output-aware choice. For each τ of a grid, the bottom-k eigenvectors
of M_τ = τC + τ⁻¹H (C and H Frobenius-normalised, float64) are a candidate removed subspace U;
keep the candidate with the smallest L(U) = Tr(UᵀCU·UᵀHU). With H = I every candidate is the PCA
subspace; for k = 1 a fine grid spanning small and large τ reaches the exact minimum
(Proposition 1). The default grid is the paper's; the report compares the choice with PCA."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compressor.plugins import hookimpl
from compressor.strategy import (
    Basis,
    SiteProblem,
    Strategy,
    StrategyOptionError,
    coupled_loss,
    eigh_descending,
    frobenius_normalised,
)

DEFAULT_TAUS = (1.0, 7.0, 10.0, 30.0, 70.0)


@dataclass(frozen=True)
class TauGrid:
    taus: tuple[float, ...] = DEFAULT_TAUS


def parse_taus(value: Any, strategy: str) -> tuple[float, ...]:
    if (not isinstance(value, Sequence) or isinstance(value, str) or not value
            or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in value)):
        raise StrategyOptionError(f"strategy '{strategy}': taus must be a non-empty list of positive numbers, got {value!r}")
    return tuple(float(t) for t in value)


class Sensitivity(Strategy):
    name = "sensitivity"
    description = "output-aware: bottom eigenvectors of τC + H/τ over a τ grid, best Tr(UᵀCU·UᵀHU) kept"
    requires = ("C", "H")

    def parse_options(self, options: Mapping[str, Any]) -> TauGrid:
        unknown = sorted(set(options) - {"taus"})
        if unknown:
            raise StrategyOptionError(f"strategy '{self.name}' has no option '{unknown[0]}'; its only option is taus")
        return TauGrid(parse_taus(options["taus"], self.name)) if "taus" in options else TauGrid()

    def select(self, problem: SiteProblem, incoming: Basis | None, options: TauGrid) -> Basis:
        C = frobenius_normalised(problem.stats.C)
        H = frobenius_normalised(problem.stats.extra["H"].to(C))
        keep = problem.keep
        candidates = []
        for tau in options.taus:
            _, vectors = eigh_descending(tau * C + H / tau)
            candidates.append((coupled_loss(C, H, vectors[:, keep:]), tau, vectors))
        loss, tau, vectors = min(candidates, key=lambda c: c[0])
        _, pca_vectors = eigh_descending(C)
        pca_loss = coupled_loss(C, H, pca_vectors[:, keep:])
        return Basis(Q=vectors, objectives={
            "loss": loss,
            "tau": tau,
            "loss_pca": pca_loss,
            "loss_ratio_to_pca": loss / pca_loss if pca_loss > 0 else 1.0,
            "candidates": [{"tau": t, "loss": value} for value, t, _ in candidates],
        })


@hookimpl
def compressor_strategies() -> list[Strategy]:
    return [Sensitivity()]
