"""One contract for every axis that keeps some of its units: MLP neurons, attention heads, routed
experts, whole decoder blocks, and a plugin's own axis.

An axis hands a selector a problem (a `UnitProblem`: `keep` of its `units`, each a `unit` the
axis names, with whatever statistics the axis measures) and gets back a `UnitChoice`: the units
that stay (or, with `RemovedUnits`, the ones that go, as a depth selector names them). Every
selector is a `UnitSelector` of one unit, registers through the `compressor_selectors` hook (or
its axis's own older hook) and is looked up by unit and name, so the registry, the recipe checks
and `compress strategies` treat every axis alike. `checked_choice` is the one check of what a
selector returned: the count, each unit once and within range, then the axis's own rule
(`UnitProblem.refusal`: heads per KV group, protected experts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from compressor.errors import UserError


class UnitProblem(ABC):
    """What every axis's problem says: keep `keep` of `units` units, each a `unit` (a word: "neuron")."""

    unit: ClassVar[str]
    keep: int
    """How many of the units stay (a field of the axis's dataclass, or a property)."""

    @property
    @abstractmethod
    def units(self) -> int:
        """How many units the problem chooses among."""

    def where(self) -> str:
        """Where the problem is, for a refusal's line ("layer 3")."""
        layer = getattr(self, "layer", None)
        return "" if layer is None else f"layer {layer}"

    def refusal(self, kept: torch.Tensor) -> str | None:
        """What is wrong with `kept` (sorted, distinct, in range, `keep` of them) beyond the count,
        by the axis's own rule; None when nothing is."""
        del kept
        return None


@dataclass
class UnitChoice:
    """The kept units (indices into the problem's units, any order) and the selector's own figures."""

    kept: Any
    """A tensor or sequence of ints."""
    objectives: dict[str, Any] = field(default_factory=dict)


@dataclass
class RemovedUnits:
    """A choice stated by the units that go (indices, any order; the order a greedy selector
    removed them in is its own business) and the selector's own figures."""

    removed: Any
    objectives: dict[str, Any] = field(default_factory=dict)


P = TypeVar("P", bound=UnitProblem)


class UnitSelector(ABC, Generic[P]):
    """Chooses which of a problem's units stay. `unit` names the units it chooses among (the
    problems it takes); `requires` names the statistics it cannot do without, in the axis's words
    ("H", "outputs", "measure"); a selector that can use them but does without leaves it empty."""

    unit: ClassVar[str]
    name: ClassVar[str]
    description: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def select(self, problem: P) -> UnitChoice | RemovedUnits: ...


def checked_choice(
    choice: UnitChoice | RemovedUnits, selector: UnitSelector[Any], problem: UnitProblem
) -> torch.Tensor:
    """The units `choice` keeps as sorted indices, or one line naming what the selector got wrong."""
    at = problem.where()
    where = f"{problem.unit} selector '{selector.name}'" + (f" at {at}" if at else "")
    if isinstance(choice, RemovedUnits):
        removed = _indices(choice.removed, problem.units - problem.keep, problem.units, problem.unit, where)
        kept = torch.ones(problem.units, dtype=torch.bool)
        kept[removed] = False
        indices = torch.nonzero(kept).flatten()
    else:
        indices = _indices(choice.kept, problem.keep, problem.units, problem.unit, where)
    refusal = problem.refusal(indices)
    if refusal is not None:
        raise UserError(f"{where} {refusal}")
    return indices


def _indices(values: Any, count: int, size: int, unit: str, where: str) -> torch.Tensor:
    """`count` distinct indices in 0..size-1, sorted, or one line naming what is wrong."""
    indices = torch.as_tensor(values, dtype=torch.long).flatten().cpu()
    distinct = len(torch.unique(indices))
    if len(indices) != count or distinct != count:
        raise UserError(f"{where} returned {distinct} distinct {unit}s; it must return {count}")
    if count and (int(indices.min()) < 0 or int(indices.max()) >= size):
        raise UserError(f"{where} returned a {unit} outside 0..{size - 1}")
    return torch.sort(indices).values


def top_k(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The indices of the `keep` largest scores, ascending (ties broken by the lower index)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return torch.sort(order[:keep]).values
