"""Choosing one basis: the strategy pipeline (`PipelineStep`, `SiteChooser`), the statistics it
is chosen from (`Pooled`: one site's, or several sites' that keep one basis, `GlobalPool`: every
site's, for a global layout), the checks on what goes in and comes out, and the site's record.

The walk (`engine.walk`) decides when and where a basis is chosen; this module only how.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from compressor.engine.calibration import SecondMoment
from compressor.errors import UserError
from compressor.strategies.contract import Basis, SiteProblem, SiteStatistics, Strategy

ProgressCallback = Callable[[str, int, int], None]
"""Called as (phase description, steps done, steps in total)."""


@dataclass(frozen=True)
class PipelineStep:
    strategy: Strategy
    options: Any = None


@dataclass
class SiteRecord:
    """What happened at one site, for the report (and the checkpoint)."""

    name: str
    width: int
    kept: int
    tokens: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    correction: dict[str, float] | None = None
    """With corrected readers: the relative least-squares error of reading the stream back from
    its kept coordinates, through the basis and through the reader map."""
    pooled_with: list[str] = field(default_factory=list)
    """Later sites that keep this site's basis, whose statistics were added to its own to choose it."""

    def to_json(self) -> dict[str, Any]:
        value = {
            "name": self.name,
            "width": self.width,
            "kept": self.kept,
            "tokens": self.tokens,
            "strategy": "+".join(s["strategy"] for s in self.steps),
            "steps": self.steps,
        }
        if self.pooled_with:
            value["pooled_with"] = self.pooled_with
        return value if self.correction is None else {**value, "correction": self.correction}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> SiteRecord:
        return cls(
            name=value["name"],
            width=value["width"],
            kept=value["kept"],
            tokens=value["tokens"],
            steps=list(value["steps"]),
            correction=value.get("correction"),
            pooled_with=list(value.get("pooled_with", [])),
        )


STATISTICS = ("C", "H")
"""Statistics the engine can provide: C = E[x xᵀ] (always) and H = E[g gᵀ] (on request)."""


def required_statistics(pipeline: Sequence[PipelineStep]) -> set[str]:
    needed = {r for step in pipeline for r in step.strategy.requires}
    unknown = sorted(needed - set(STATISTICS))
    if unknown:
        raise UserError(
            f"the pipeline needs statistics this engine cannot compute: {', '.join(unknown)} "
            f"(available: {', '.join(STATISTICS)})"
        )
    return needed


def refuse_without_h(setting: str, selector: Any, pipeline: Sequence[PipelineStep]) -> None:
    """A selector (`setting`: the recipe key that names it) that requires H runs only where the
    pipeline estimates H: else one line naming the fix."""
    if selector is not None and "H" in selector.requires and "H" not in required_statistics(pipeline):
        raise UserError(
            f"{setting} '{selector.name}' needs the output sensitivity H, which only a pipeline with a "
            f"strategy that requires it (e.g. sensitivity) estimates; choose another selector or add one"
        )


@dataclass
class Pooled:
    """The statistics one basis is chosen from: one site's, or the sum over the sites that keep it."""

    names: list[str]
    """The site the basis is chosen at, then the others that keep it."""
    C: torch.Tensor
    tokens: int
    H: torch.Tensor | None = None


POOLING = ("trace", "sum")
"""How a global basis weighs the sites: each site's C and H divided by its trace (every site
counts alike), or raw sums (the sites with the most energy decide)."""


class GlobalPool:
    """Every site's C and H, summed as they are observed into one problem (`slicing.layout:
    global`); no site's d × d statistic is kept past its turn."""

    def __init__(self, pooling: str) -> None:
        if pooling not in POOLING:
            raise ValueError(f"pooling must be one of {POOLING}")
        self.pooling = pooling
        self.names: list[str] = []
        self.C: torch.Tensor | None = None
        self.H: torch.Tensor | None = None
        self.tokens = 0

    def _weighted(self, value: torch.Tensor) -> torch.Tensor:
        value = value.to(torch.float64)
        return value / torch.trace(value) if self.pooling == "trace" else value

    def add(self, site: str, C: torch.Tensor, tokens: int, H: torch.Tensor | None) -> None:
        check_finite("C", site, C)
        C = self._weighted(C)
        self.C = C if self.C is None else self.C + C
        if H is not None:
            H = self._weighted(H.to(C.device))
            self.H = H if self.H is None else self.H + H
        self.names.append(site)
        self.tokens = max(self.tokens, tokens)  # every site sees the same tokens

    def pooled(self) -> Pooled:
        assert self.C is not None, "no site observed"
        return Pooled(self.names, self.C, self.tokens, self.H)

    def copy(self) -> GlobalPool:
        """The same sums in tensors of their own (a strategy may edit the statistics it is handed)."""
        copied = GlobalPool(self.pooling)
        copied.names, copied.tokens = list(self.names), self.tokens
        copied.C = None if self.C is None else self.C.clone()
        copied.H = None if self.H is None else self.H.clone()
        return copied


class SiteChooser:
    """Runs the strategy pipeline at a site and checks what comes back."""

    def __init__(
        self,
        pipeline: Sequence[PipelineStep],
        sites: Sequence[str],
        fisher: Mapping[str, torch.Tensor] | None = None,
        report: ProgressCallback | None = None,
    ) -> None:
        self.pipeline = list(pipeline)
        self.sites = list(sites)
        self.fisher = fisher
        self.report = report or (lambda *_: None)

    def pool(self, site: str, moment: SecondMoment, others: Sequence[tuple[str, SecondMoment]] = ()) -> Pooled:
        """The site's statistics, summed with those of later sites that will keep its basis
        (`others`, with their C): one site whose tokens are those of every member."""
        C = moment.value()
        for _, other in others:
            C = C + other.value()
        names = [site, *(name for name, _ in others)]
        H = None if self.fisher is None else sum(self.fisher[name].to(C.device, torch.float64) for name in names)
        return Pooled(names, C, moment.tokens, H)

    def choose(self, keep: int, pooled: Pooled) -> tuple[torch.Tensor, SiteRecord]:
        """The kept columns (d × keep, float64, on C's device) of the basis the pipeline chooses
        from `pooled` at its first site, and that site's record."""
        site, C = pooled.names[0], pooled.C
        check_finite("C", site, C)
        width = C.shape[0]
        names = pooled.names
        extra = {} if pooled.H is None else {"H": pooled.H.to(C.device, torch.float64)}
        stats = SiteStatistics(C=C, tokens=pooled.tokens, extra=extra)
        problem = SiteProblem(name=site, index=self.sites.index(site), width=width, keep=keep, stats=stats)
        record = SiteRecord(name=site, width=width, kept=keep, tokens=pooled.tokens, pooled_with=names[1:])
        basis: Basis | None = None
        where = f"site {problem.index + 1}/{len(self.sites)} ({site})"
        for step in self.pipeline:
            problem.progress = lambda done, total, phase=f"{where}: {step.strategy.name}": self.report(
                phase, done, total
            )
            basis = step.strategy.select(problem, basis, step.options)
            check_basis(basis, width, step.strategy.name, site)
            record.steps.append({"strategy": step.strategy.name, "objectives": dict(basis.objectives)})
        assert basis is not None
        return basis.kept(keep).to(C.device).contiguous(), record  # not a view holding all d columns


FIXES = {
    "C": "the activations overflow or the weights hold NaN or Inf: load the model in float32 (model.dtype) "
    "or check its weights",
    "H": "the output gradients overflow: set sensitivity.dtype: float64 and leave sensitivity.autocast off, "
    "or load the model in float32",
}


def check_finite(statistic: str, site: str, value: torch.Tensor) -> None:
    """A site's statistic must be finite: NaN or Inf would reach the eigendecomposition (which
    fails far from the cause) or, worse, the chosen basis. Stops the run naming the site."""
    if not bool(torch.isfinite(value).all()):
        raise UserError(f"{statistic} at site {site} holds NaN or Inf: {FIXES[statistic]}")


def check_basis(basis: Basis, width: int, strategy: str, site: str) -> None:
    """A strategy's basis is d×d float64, finite and orthogonal, or the run stops in one line
    naming the strategy (a plugin's bug, for its authors), before it reaches any weight."""
    q = basis.Q
    fault = None
    if q.shape != (width, width) or q.dtype != torch.float64:
        fault = f"a {tuple(q.shape)} {q.dtype} basis; expected ({width}, {width}) float64"
    elif not bool(torch.isfinite(q).all()):
        fault = "a basis holding NaN or Inf"
    else:
        gram = q.T @ q  # QᵀQ − I formed in place: one d × d temporary, not four
        gram.diagonal().sub_(1)
        error = gram.abs_().max().item()
        del gram
        if error > 1e-6:
            fault = f"a non-orthogonal basis (|QᵀQ − I| = {error:.2e})"
    if fault is not None:
        raise UserError(
            f"strategy '{strategy}' returned {fault} at site {site}: a bug in the strategy; report it "
            f"to its plugin's authors, or leave it out of the pipeline"
        )
