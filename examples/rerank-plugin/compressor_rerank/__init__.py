"""`rerank`: remove PCA's directions by their output-aware cost instead of their energy.

In C's eigenbasis (eigenvalues λᵢ, eigenvectors vᵢ), removing a set U of eigenvectors costs
Tr(UᵀCU·UᵀHU) = Σᵢ λᵢ·hᵢ with hᵢ = vᵢᵀHvᵢ, because UᵀCU is then diagonal. So removing the
`remove` eigenvectors with the smallest λᵢ·hᵢ minimises the paper's objective over every choice
of eigenvectors, PCA's own choice (the smallest λᵢ) included: the loss is never above PCA's
(up to rounding). The option `power` scores λᵢ·hᵢᵖ instead: 1 is that minimum, 0 is PCA.
"""

from __future__ import annotations

from typing import Annotated

import torch

from compressor.plugin import (
    FORBID,
    Basis,
    Number,
    SiteProblem,
    Strategy,
    complete_basis,
    coupled_loss,
    described,
    eigh_descending,
    frobenius_normalised,
    hookimpl,
    options,
    removed_energy,
)


@options(frozen=True, config=FORBID)
class RerankOptions:
    """A pipeline step's options: every key but `strategy`, checked before anything loads."""

    power: Annotated[Number, described("the exponent of vᵀHv in each direction's score λ·(vᵀHv)ᵖ; 0 is pca", ge=0)] = (
        1.0
    )


class Rerank(Strategy):
    name = "rerank"
    description = "remove the eigenvectors of C with the smallest λ·(vᵀHv)ᵖ (power 1: least Tr(UᵀCU·UᵀHU) among them)"
    requires = ("C", "H")  # asks the engine for H: problem.stats.extra["H"]
    option_class = RerankOptions  # the default parse_options validates a step against it

    def select(self, problem: SiteProblem, incoming: Basis | None, options: RerankOptions) -> Basis:
        # C and H on one scale (‖·‖_F = 1), so the losses compare across sites and with `sensitivity`'s.
        C = frobenius_normalised(problem.stats.C)
        H = frobenius_normalised(problem.stats.extra["H"])
        energy, vectors = eigh_descending(C)  # PCA's basis: columns by energy, largest first
        sensitivity = torch.einsum("ij,ik,kj->j", vectors, H, vectors)  # hᵢ = vᵢᵀHvᵢ, one per column
        score = energy.clamp(min=0) * sensitivity.clamp(min=0) ** options.power
        order = torch.argsort(score, descending=True, stable=True)  # power 0: PCA's own order
        removed = vectors[:, order[problem.keep :]]  # d × (width − keep)
        Q = complete_basis(removed)  # any removed U → an orthogonal Q with U's span last
        loss, loss_pca = coupled_loss(C, H, removed), coupled_loss(C, H, vectors[:, problem.keep :])
        total = float(torch.trace(problem.stats.C))
        return Basis(
            Q=Q,
            objectives={
                "loss": loss,
                "loss_pca": loss_pca,
                "loss_ratio_to_pca": loss / loss_pca if loss_pca > 0 else 1.0,
                "swapped": int((order[problem.keep :] < problem.keep).sum()),  # removed directions PCA keeps
                "removed_energy_fraction": removed_energy(problem.stats.C, Q[:, problem.keep :]) / total
                if total > 0
                else 0.0,
            },
        )


@hookimpl
def compressor_strategies() -> list[Strategy]:
    return [Rerank()]
