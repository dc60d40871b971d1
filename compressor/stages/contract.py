"""What a stage of a run is: the contract the built-in stages and a plugin's are written to.

A run is a list of `Stage`s (`stages.BUILTIN_STAGES`, a plugin's placed among them), each a
unit that declares what it reads (its recipe section and options), what it checks before any
weight loads (`check_device`, `check_plan`), what it costs (`memory`, its phases of the memory
plan; `seconds`, its phases of the time plan), what it hands on (fields of `base.RunState`) and whether the held-out guard judges it
(`guarded`: its `run` returns a `Candidate`, which the runner keeps only when the model as saved
is not worse). The runner is the loop over them; the engine below knows nothing of stages. This
module imports no transformers, so `compressor.plugin` can offer it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from compressor.plan.checks import Plan
    from compressor.plan.memory import Footprint
    from compressor.recipe.schema import Recipe
    from compressor.stages.base import RunState
    from compressor.stages.costs import Phase, TimedPhase, Work


@dataclass(frozen=True)
class Candidate:
    """A model a guarded stage proposes: kept only when the held-out guard finds the model as saved
    not worse than the one the stage received (`received_scale`: a stock tied head's diagonal
    for the received model, None where the saved conversion fits it)."""

    model: PreTrainedModel
    bases: dict[str, torch.Tensor]
    head_scale: torch.Tensor | None = None
    received_scale: torch.Tensor | None = None


class Stage:
    """One step of a run. Subclasses set the class attributes and override what they need; a
    plugin's stage (the `compressor_stages` hook) is written the same way and placed `after` a
    stage it follows."""

    name: ClassVar[str] = ""
    """The stage's name: in the guard's record, the fault point `stage:<name>` and a plugin's `after`."""
    timing: ClassVar[str | None] = None
    """The report's `timings` key for this stage's seconds (None: the stage keeps its own)."""
    section: ClassVar[str | None] = None
    """The recipe section the stage reads; the stage runs when the recipe has it (`wanted`)."""
    options: ClassVar[type | None] = None
    """The section's options class (a pydantic dataclass): a built-in stage's is its section's in
    `recipe.sections` (the recipe declares and checks it there); a plugin stage's is validated
    where its section is read."""
    after: ClassVar[str] = ""
    """A plugin stage: the name of the stage it follows."""
    changes_model: ClassVar[bool] = False
    """Whether the stage changes the pruned model (the run's `writes_as_it_goes` then holds back)."""
    guarded: ClassVar[bool] = False
    """Its `run` returns a `Candidate` the held-out guard judges (`run.runner`'s guard)."""
    checkpoint_key: ClassVar[str | None] = None
    """Where in the checkpoint the stage keeps progress that a resumed run reads (None: it redoes its work)."""

    def wanted(self, recipe: Recipe) -> bool:
        """The recipe asks for this stage (default: it has the stage's section)."""
        return self.section is None or section_of(recipe, self.section) is not None

    def runs(self, state: RunState) -> bool:
        """The stage has work in this run as it stands (default: `wanted`)."""
        return self.wanted(state.recipe)

    def check_device(self, recipe: Recipe, device: torch.device, save_model: bool) -> None:
        """What the stage asks of the device and of what the run keeps; a UserError when it cannot."""

    def check_plan(self, recipe: Recipe, plan: Plan, world: int) -> None:
        """The stage's preconditions against the plan and the launch (`world` processes), before any
        weight loads; a UserError when they do not hold."""

    def heldout_windows(self, recipe: Recipe, plan: Plan) -> int:
        """Held-out windows (after the calibration windows) the stage measures on; 0: none."""
        return 0

    def heldout_section(self, recipe: Recipe) -> str:
        """The section whose `heldout_windows` sets that count (what a refusal names)."""
        return self.section or self.name

    def memory(self, footprint: Footprint) -> list[Phase]:
        """The stage's phases of the memory plan (`plan.memory`), each with its host and device peak."""
        return []

    def memory_notes(self, footprint: Footprint) -> list[str]:
        """What the stage's memory leaves to others to fit (accelerate's placement), said after the phases."""
        return []

    def seconds(self, work: Work) -> list[TimedPhase] | None:
        """The stage's phases of the time plan (`plan.timing`), from the unit costs measured on one layer
        and the run's counts; None: the stage gives no estimate (the plan says so)."""
        return None

    def run(self, state: RunState) -> Candidate | None:
        raise NotImplementedError

    def adopt(self, state: RunState, candidate: Candidate) -> None:
        """The guard kept `candidate`: it becomes the model the next stages receive."""
        state.pruned, state.bases, state.head_scale = candidate.model, candidate.bases, candidate.head_scale


def section_of(recipe: Recipe, section: str) -> Any:
    """A recipe's section by name: a built-in one's field, or a plugin stage's (`Recipe.stages`)."""
    if section in recipe.stages:
        return recipe.stages[section]
    return getattr(recipe, section, None)


def changes_model_between(stages: tuple[Stage, ...], recipe: Recipe, first: str, last: str | None = None) -> bool:
    """Whether a stage the recipe asks for, after stage `first` and before `last` (the end when
    None), changes the model: what the split choice's adoption and a walk that writes as it goes
    both ask."""
    names = [stage.name for stage in stages]
    between = stages[names.index(first) + 1 : None if last is None else names.index(last)]
    return any(stage.changes_model and stage.wanted(recipe) for stage in between)
