"""The held-out guard: a step that changes the model (refinement, distillation) keeps its result
only when the model as saved is not worse on windows the step did not train on.

A step's own objective is measured on its own windows, and it can improve there while the model
that is saved gets worse (a refinement that optimised another head than the one saved, or one
that fits its few windows): the guard measures KL(original ‖ model as saved) on held-out windows
before and after the step, keeps the step's result only when that did not rise, and otherwise
hands back the model as the step received it, in one line and in the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class GuardRecord:
    """One guarded step: held-out KL (nats per token, the model as saved) before and after it."""

    step: str
    windows: int
    """Held-out windows measured (none of them trained on by the step)."""
    kl_before: float
    kl_after: float
    kept: bool
    """Whether the step's result was kept (its held-out KL is not above the received model's)."""

    @staticmethod
    def judge(step: str, windows: int, before: float, after: float) -> GuardRecord:
        return GuardRecord(step, windows, before, after, after <= before)

    def line(self) -> str:
        """What the run says about the step, in one line."""
        verdict = "kept" if self.kept else f"made it worse, so the model from before {self.step} is kept"
        return (
            f"{self.step}: held-out KL of the saved model {self.kl_before:.4f} -> {self.kl_after:.4f} "
            f"on {self.windows} windows it did not train on: {verdict}"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
