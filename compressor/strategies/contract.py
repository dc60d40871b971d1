"""What a selection strategy sees and returns. This module is the whole contract with plugins.

The engine hands a strategy one `SiteProblem` per pruning site (its statistics and how many
directions to keep) and the basis chosen by the previous step of the pipeline, if any; the
strategy returns a `Basis`. Strategies know nothing about model families or weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from compressor.errors import UserError
from compressor.validation import check


class StrategyOptionError(ValueError):
    """A strategy option in a recipe is unknown or has a bad value (message says which)."""


@dataclass
class SiteStatistics:
    """Statistics of the residual stream at one site, over the counted calibration tokens.

    `C` is E[x xᵀ] in float64: the uncentred second moment (no mean is given), measured with
    earlier sites already sliced. `extra` holds further d×d float64 statistics by name (e.g. "H",
    E[g gᵀ] of the output KL's gradient), present when a strategy in the pipeline `requires`
    them. Where sites share one basis (`slicing.shared_bases`, `slicing.layout: global`), the
    problem is pooled: C and H are sums over its member sites (each divided by its trace under
    global trace pooling), and `SiteProblem.name` is the first member's. Read them, never change
    them in place: the engine reads the same tensors after the strategy (clone one to edit it).
    """

    C: torch.Tensor
    tokens: int
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def _no_progress(done: int, total: int) -> None:
    pass


@dataclass
class SiteProblem:
    """One site to prune: keep `keep` of `width` directions.

    `progress(done, total)` moves the run's progress bar (with its time estimate) for a strategy
    whose work at one site is long (an optimiser's steps, a search over many candidates): call it
    every so often; it costs nothing when nobody watches.
    """

    name: str
    index: int
    width: int
    keep: int
    stats: SiteStatistics
    progress: Callable[[int, int], None] = field(default=_no_progress, repr=False, compare=False)

    @property
    def remove(self) -> int:
        return self.width - self.keep


@dataclass
class Basis:
    """An orthogonal d×d basis (float64) whose first `keep` columns are the kept directions.

    `objectives` are the strategy's own figures for the report (JSON-serialisable values).
    """

    Q: torch.Tensor
    objectives: dict[str, Any] = field(default_factory=dict)

    def kept(self, keep: int) -> torch.Tensor:
        return self.Q[:, :keep]

    def removed(self, keep: int) -> torch.Tensor:
        return self.Q[:, keep:]


class Strategy(ABC):
    """A way of choosing a site's basis. Subclass it and return instances from the
    `compressor_strategies` hook of a plugin."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ("C",)
    option_class: ClassVar[type | None] = None
    """Its options as a pydantic dataclass (`@compressor.validation.options(config=FORBID)`): the
    default `parse_options` validates a step's options against it (and the recipe's JSON schema
    shows them). None: the strategy takes no options."""

    def parse_options(self, options: Mapping[str, Any]) -> Any:
        """Check the recipe options of a pipeline step; return what `select` receives.

        Raise `StrategyOptionError` with a message naming the bad option. The default validates
        them against `option_class`, or accepts none where there is no such class.
        """
        if self.option_class is None:
            if options:
                raise StrategyOptionError(f"strategy '{self.name}' takes no options, got: {', '.join(sorted(options))}")
            return None
        try:
            return check(self.option_class, options)
        except UserError as error:
            raise StrategyOptionError(f"strategy '{self.name}': {error}") from None

    @abstractmethod
    def select(self, problem: SiteProblem, incoming: Basis | None, options: Any) -> Basis:
        """Return the basis for `problem`; `incoming` is the previous pipeline step's."""


def eigh_descending(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues and eigenvectors of a symmetric matrix in float64, largest first."""
    values, vectors = torch.linalg.eigh(matrix.to(torch.float64))
    return values.flip(-1), vectors.flip(-1)


def removed_energy(C: torch.Tensor, removed: torch.Tensor) -> float:
    """Tr(UᵀCU): activation energy discarded with the directions `removed` (the SliceGPT loss)."""
    return float(torch.trace(removed.T @ C @ removed))


def frobenius_normalised(matrix: torch.Tensor) -> torch.Tensor:
    """`matrix / ‖matrix‖_F` (unchanged if zero): puts C and H on one scale before mixing them.
    Decided on the matrix's device, with no read-back of the norm to the host."""
    norm = torch.linalg.matrix_norm(matrix)
    return matrix / torch.where(norm > 0, norm, torch.ones_like(norm))


def coupled_loss(C: torch.Tensor, H: torch.Tensor, removed: torch.Tensor) -> float:
    """L(U) = Tr(UᵀCU · UᵀHU): the paper's output-aware cost of removing the directions U."""
    return float(coupled_losses(C, H, removed))


def coupled_losses(C: torch.Tensor, H: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """L(U) for U (d×k) or a stack of them (n×d×k), as a tensor where U is (no host sync):
    Tr(AB) = Σ A∘Bᵀ, A = UᵀCU and B = UᵀHU."""
    A = removed.mT @ C @ removed
    B = removed.mT @ H @ removed
    return (A * B.mT).sum((-2, -1))


DEFAULT_TAUS = (1.0, 7.0, 10.0, 30.0, 70.0)
"""The paper's τ grid: the `sensitivity` strategy's default and the width allocator's."""


def tau_candidates(C: torch.Tensor, H: torch.Tensor, taus: Sequence[float]) -> torch.Tensor:
    """Bases (n×d×d, columns largest eigenvalue first) of the τ-search: the eigenvectors of
    τC + H/τ for each τ, then those of C (the PCA basis, τ → ∞), from one batched float64
    eigendecomposition on C's device: no round trip to the host between candidates."""
    C, H = C.to(torch.float64), H.to(torch.float64)
    scale = torch.tensor(list(taus), dtype=torch.float64, device=C.device)[:, None, None]
    return eigh_descending(torch.cat([scale * C + H / scale, C[None]]))[1]


def complete_basis(removed: torch.Tensor) -> torch.Tensor:
    """An orthogonal d×d basis whose last k columns span `removed` (d×k) and whose first d−k
    span its orthogonal complement."""
    d, k = removed.shape
    u, _ = torch.linalg.qr(removed.to(torch.float64))
    if k == 0:
        return torch.eye(d, dtype=torch.float64, device=removed.device)
    complement = torch.eye(d, dtype=torch.float64, device=removed.device) - u @ u.T
    _, vectors = eigh_descending(complement)
    return torch.cat([vectors[:, : d - k], u], dim=1)
