"""Reading data: every window the run reads, tokenised before any weight loads (a data problem
found before the walk costs nothing): calibration, evaluation, the distillation's rows, and the
held-out windows the guard, the split choice and a measuring depth selector measure on."""

from __future__ import annotations

from typing import Any

from compressor.recipe.schema import Recipe
from compressor.runtime.loading import heldout_batches
from compressor.stages.base import RunState
from compressor.stages.contract import Stage
from compressor.stages.costs import TimedPhase, Work


class ReadData(Stage):
    name = "tokenising data"
    timing = "data_s"

    def seconds(self, work: Work) -> list[TimedPhase]:
        return []  # reading, loading and writing files: not estimated, small beside the passes

    def run(self, state: RunState) -> None:
        recipe, resources = state.recipe, state.resources
        state.progress("tokenising data", 0, 1)
        state.tokenizer = resources.tokenizer(recipe.model)
        state.calibration = resources.batches(recipe.calibration, state.tokenizer, "calibration")
        state.evaluation = (
            resources.batches(recipe.evaluation, state.tokenizer, "evaluation") if recipe.evaluation else None
        )
        state.distillation_rows = distillation_data(recipe, state.tokenizer)
        for stage, count in heldout_counts(recipe, state.checked):
            windows = heldout_batches(recipe.calibration, state.tokenizer, count, stage.heldout_section(recipe))
            if not stage.guarded:
                state.measuring_windows[stage.name] = windows  # the split choice's own, a depth selector's
            elif len(windows) > len(state.heldout):
                state.heldout = windows  # the guard's: as many as the guarded stage that asks most


def heldout_counts(recipe: Recipe, checked: Any) -> list[tuple[Stage, int]]:
    """The held-out windows a run reads after its calibration windows, by the stage that measures
    on them: a guarded stage's guard (refinement's, a plugin's), the split choice of `mlp` without `kept`."""
    counts = [(stage, stage.heldout_windows(recipe, checked)) for stage in checked.stages if stage.wanted(recipe)]
    return [(stage, count) for stage, count in counts if count]


def distillation_data(recipe: Recipe, tokenizer: Any) -> Any:
    """The distillation stage's windows (None without one)."""
    if recipe.distillation is None:
        return None
    from compressor.training.teachers import distillation_data as read

    return read(recipe.distillation, tokenizer)
