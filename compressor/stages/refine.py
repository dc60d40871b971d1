"""`refinement`: the bases moved together on the output KL (a stock tied head's diagonal with
them), applied to a fresh original when they lowered the objective; the runner's held-out guard
keeps the result only when the model as saved is not worse."""

from __future__ import annotations

from typing import TYPE_CHECKING

from compressor.engine.bases import apply_bases
from compressor.engine.refine import RefinementRun, refine_bases
from compressor.errors import UserError
from compressor.models.stock import fitted_tied_scale
from compressor.recipe.schema import Recipe
from compressor.recipe.sections.refinement import RefinementSpec
from compressor.stages.base import RunState
from compressor.stages.contract import Candidate, Stage
from compressor.stages.costs import TimedPhase, Work
from compressor.stages.walk import stock_tied

if TYPE_CHECKING:
    from compressor.plan.checks import Plan
    from compressor.plan.memory import Footprint
    from compressor.stages.costs import Phase


class Refine(Stage):
    name = "refinement"
    timing = "refine_s"
    section = "refinement"
    options = RefinementSpec
    changes_model = True
    guarded = True

    def check_plan(self, recipe: Recipe, plan: Plan, world: int) -> None:
        if world > 1:
            raise UserError("refinement runs in one process: remove refinement from the recipe, or launch one process")

    def heldout_windows(self, recipe: Recipe, plan: Plan) -> int:
        assert recipe.refinement is not None
        return recipe.refinement.heldout_windows

    def seconds(self, work: Work) -> list[TimedPhase]:
        """Each epoch over its windows: the original's outputs, the sliced model's forward and backward;
        then the guard's held-out KL of both models."""
        spec = work.recipe.refinement
        assert spec is not None
        calibration = work.recipe.calibration
        tokens = (spec.windows or calibration.num_samples) * calibration.seq_len * spec.epochs
        costs, layers = work.costs, work.layers
        step = costs.model_forward(work.original_layers) + layers * costs.layer_backward + costs.head_backward
        guard = work.measured_kl(work.heldout.get(self.name, 0))
        return [TimedPhase("refinement", tokens * step + 2 * guard, "refine_s")]

    def memory(self, footprint: Footprint) -> list[Phase]:
        if not footprint.settings.refinement:
            return []
        weights, bases = footprint.weights, footprint.bases
        return [
            footprint.phase(
                "refinement (the whole model on the device)",
                2 * weights + bases,
                weights + bases,
                "refinement: null, or a device with more memory",
                whole_model=True,
            )
        ]

    def run(self, state: RunState) -> Candidate | None:
        recipe = state.recipe
        assert recipe.refinement is not None
        received_scale = state.head_scale
        if stock_tied(state.checked) and received_scale is None:
            received_scale = fitted_tied_scale(state.pruned, state.family, state.head_stream())
        refined = refine_bases(
            state.resources.whole_model(recipe.model),
            state.family,
            state.calibration,
            state.bases,
            recipe.refinement,
            RefinementRun(state.device, recipe.seed, state.progress, state.keep_tied, received_scale),
        )
        state.refinement = refined.record
        if refined.record.kept != "refined":
            return None
        state.progress("applying refined bases", 0, 1)
        candidate = apply_bases(
            state.resources.model(recipe.model), state.family, refined.bases, state.device, keep_tied=state.keep_tied
        )
        return Candidate(candidate, refined.bases, refined.head_scale, received_scale)

    def adopt(self, state: RunState, candidate: Candidate) -> None:
        """The refined model replaces the walk's, which is evaluated beside it as it would be saved."""
        state.unrefined = state.as_saved(state.pruned, candidate.received_scale)
        super().adopt(state, candidate)
        state.head_fit += ", then refined"
