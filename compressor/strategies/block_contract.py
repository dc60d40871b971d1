"""What a depth selector sees and returns: the contract of the depth axis (whole decoder blocks).

The engine (`engine.depth`) hands a selector one `BlockProblem`: how many of the model's decoder
blocks go, each block's influence (ShortGPT's 1 − cos of its input and output stream over the
calibration tokens: a block that barely turns the stream changes least by going), and, for a
selector that `requires` "measure", a function that measures KL(original ‖ the model without a
set of blocks) on held-out windows, a forward pass of the model over them per call. The selector
returns the blocks removed; the engine takes them out of the model and renumbers the rest. It is
the units contract (`strategies.units`) with the block as its unit, a choice stated by what goes
(`BlockChoice`, `units.RemovedUnits`) or, as any axis's, by what stays: selectors register through
the `compressor_selectors` hook (or the older `compressor_block_selectors`) and know nothing about
model families or weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from compressor.strategies.units import RemovedUnits, UnitProblem, UnitSelector


@dataclass
class BlockProblem(UnitProblem):
    """Remove `remove` of the model's `blocks` decoder blocks. `influence[i]`: block i's mean
    1 − cos(x_in, x_out) over the counted calibration tokens. `measure(removed)`: the held-out KL
    of the original model without the blocks `removed` (None unless the selector requires
    "measure"); `measured` records every call's result, keyed by the sorted blocks. `shortlist`:
    the recipe's bound on a measuring selector's work, the lowest-influence blocks it measures at
    each step (None: every block left)."""

    blocks: int
    remove: int
    influence: list[float]
    measure: Callable[[Sequence[int]], float] | None = None
    measured: dict[tuple[int, ...], float] = field(default_factory=dict)
    shortlist: int | None = None

    unit: ClassVar[str] = "block"

    @property
    def units(self) -> int:
        return self.blocks

    @property
    def keep(self) -> int:  # type: ignore[override]  # what stays, from the count that goes
        return self.blocks - self.remove

    def where(self) -> str:
        return ""


BlockChoice = RemovedUnits
"""The blocks removed (indices into the original's blocks, any order) and the selector's own figures."""


class BlockSelector(UnitSelector[BlockProblem]):
    """Chooses which decoder blocks go. `requires` names what it cannot do without ("measure": the
    problem's `measure`, which costs the engine the original whole on the device and a forward
    pass over the held-out windows per call)."""

    unit: ClassVar[str] = "block"


def lowest(scores: Sequence[float], count: int, among: Sequence[int] | None = None) -> list[int]:
    """The `count` blocks (of `among`, default all) with the lowest scores, ascending by score
    (ties to the lower index)."""
    candidates = range(len(scores)) if among is None else among
    return sorted(candidates, key=lambda i: (scores[i], i))[:count]
