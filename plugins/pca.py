"""`pca`: SliceGPT's choice. Keep the top eigenvectors of C = E[x xᵀ], remove the bottom ones,
which minimises the discarded activation energy Tr(UᵀCU)."""

from __future__ import annotations

from typing import Any

import torch

from compressor.plugin import (
    Basis,
    SiteProblem,
    Strategy,
    eigh_descending,
    hookimpl,
    removed_energy,
)


class PCA(Strategy):
    name = "pca"
    description = "SliceGPT: remove the bottom eigenvectors of C = E[x xᵀ] (uncentred PCA)"

    def select(self, problem: SiteProblem, incoming: Basis | None, options: Any) -> Basis:
        C = problem.stats.C
        _, vectors = eigh_descending(C)
        total = float(torch.trace(C))
        removed = removed_energy(C, vectors[:, problem.keep :])
        return Basis(
            Q=vectors,
            objectives={"removed_energy": removed, "removed_energy_fraction": removed / total if total > 0 else 0.0},
        )


@hookimpl
def compressor_strategies() -> list[Strategy]:
    return [PCA()]
