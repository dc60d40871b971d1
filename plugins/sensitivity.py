"""`sensitivity`: the paper's output-aware choice. For each τ of a grid, the bottom-k eigenvectors
of M_τ = τC + τ⁻¹H (C and H Frobenius-normalised, float64) are a candidate removed subspace U;
keep the candidate with the smallest L(U) = Tr(UᵀCU·UᵀHU). With H = I every candidate is the PCA
subspace; for k = 1 a fine grid spanning small and large τ reaches the exact minimum
(Proposition 1). The default grid is the paper's; the report compares the choice with PCA.

Two options go past the paper (both off by default, so the default is the paper's method):
`include_pca` adds the PCA subspace (τ → ∞) as a candidate, so the choice never has a larger
objective than PCA's; `refine: N` spends N more eigendecompositions on a golden-section search
of log τ between the best grid point's neighbours (beyond the grid's ends, a decade out)."""

from __future__ import annotations

import math
from typing import Annotated, Any

import torch
from pydantic import StrictBool, StrictInt

from compressor.plugin import (
    DEFAULT_TAUS,
    FORBID,
    Basis,
    Number,
    SiteProblem,
    Strategy,
    coupled_loss,
    coupled_losses,
    described,
    eigh_descending,
    frobenius_normalised,
    hookimpl,
    options,
    tau_candidates,
)

PositiveNumber = Annotated[Number, described("a positive number", gt=0)]


@options(frozen=True, config=FORBID)
class TauGrid:
    taus: Annotated[tuple[PositiveNumber, ...], described("a non-empty list of positive numbers", min_length=1)] = (
        DEFAULT_TAUS
    )
    include_pca: StrictBool = False
    refine: Annotated[StrictInt, described("a whole number of extra τ values", ge=0)] = 0


class Sensitivity(Strategy):
    name = "sensitivity"
    description = "output-aware: bottom eigenvectors of τC + H/τ over a τ grid, best Tr(UᵀCU·UᵀHU) kept"
    requires = ("C", "H")
    option_class = TauGrid

    def select(self, problem: SiteProblem, incoming: Basis | None, options: TauGrid) -> Basis:
        C = frobenius_normalised(problem.stats.C)
        H = frobenius_normalised(problem.stats.extra["H"].to(C))
        keep = problem.keep
        # progress counts eigendecompositions: the grid's and PCA's (one batch), then each refined τ
        total, done = len(options.taus) + 1 + options.refine, len(options.taus) + 1
        problem.progress(0, total)

        def candidate(tau: float) -> tuple[float, float, torch.Tensor]:
            nonlocal done
            _, vectors = eigh_descending(tau * C + H / tau)
            found = coupled_loss(C, H, vectors[:, keep:]), tau, vectors
            done += 1
            problem.progress(done, total)
            return found

        bases = tau_candidates(C, H, options.taus)  # the grid's and PCA's, in one batch
        *losses, pca_loss = coupled_losses(C, H, bases[:, :, keep:]).tolist()  # one sync for all of them
        problem.progress(done, total)
        candidates = list(zip(losses, options.taus, bases[:-1]))
        pca_vectors = bases[-1]
        refined = _golden_section(
            candidate, sorted(options.taus), min(candidates, key=lambda c: c[0])[1], options.refine
        )
        pool = candidates + refined + ([(pca_loss, math.inf, pca_vectors)] if options.include_pca else [])
        loss, tau, vectors = min(pool, key=lambda c: c[0])
        return Basis(
            Q=vectors.clone(),
            objectives={  # not a view holding every candidate
                "loss": loss,
                "tau": tau if math.isfinite(tau) else None,  # None: the PCA subspace won (include_pca)
                "chose_pca": not math.isfinite(tau),
                "loss_pca": pca_loss,
                "loss_ratio_to_pca": loss / pca_loss if pca_loss > 0 else 1.0,
                "candidates": [{"tau": t, "loss": value} for value, t, _ in candidates],
                "refined": [{"tau": t, "loss": value} for value, t, _ in refined],
            },
        )


def _golden_section(
    candidate: Any, grid: list[float], best: float, evaluations: int
) -> list[tuple[float, float, torch.Tensor]]:
    """`evaluations` more candidates, placed by golden-section search on log τ over the bracket
    between the best grid τ's neighbours (a decade beyond the grid's ends). The loss need not be
    unimodal there; the search only ever adds candidates, so the choice cannot get worse."""
    if evaluations < 1:
        return []
    index = grid.index(best)
    low = math.log(grid[index - 1] if index > 0 else best / 10)
    high = math.log(grid[index + 1] if index + 1 < len(grid) else best * 10)
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    found = [candidate(math.exp(a))]
    if evaluations > 1:
        found.append(candidate(math.exp(b)))
    fa, fb = found[0][0], found[-1][0]
    while len(found) < evaluations:
        if fa <= fb:  # the minimum lies in [low, b]
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            found.append(candidate(math.exp(a)))
            fa = found[-1][0]
        else:  # in [a, high]
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            found.append(candidate(math.exp(b)))
            fb = found[-1][0]
    return found


@hookimpl
def compressor_strategies() -> list[Strategy]:
    return [Sensitivity()]
