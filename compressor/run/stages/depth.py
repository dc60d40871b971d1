"""`depth`: whole decoder blocks removed before the walk (issue 49). The selector chooses on the
original model: every block's influence (`engine.depth.block_influence`), and for a measuring
selector the held-out KL of the original without a set of blocks (`models.depth.skipping`, a
forward pass per set). The blocks go from the model the walk prunes and from every fresh copy a
later stage loads (`RunState.model_to_prune`); the plan is made again for the model without them
(`checks.replan`: its sites, config and widths, the budget still the original's). The choice is
checkpointed, so a resumed run removes the same blocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore
from compressor.engine.depth import block_influence
from compressor.errors import ProgressKept, UserError
from compressor.evaluation.metrics import Tally, model_log_probs
from compressor.models.depth import kept_blocks, remove_blocks, skipping
from compressor.recipe.schema import Recipe
from compressor.recipe.sections.depth import DepthSpec
from compressor.run.report_model import DepthReport
from compressor.run.stages.base import RunState
from compressor.run.stages.contract import Stage
from compressor.run.staging import SCRATCH_FOLDER
from compressor.strategies.block_contract import BlockProblem

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from compressor.run.checks import Plan
    from compressor.run.memory import Footprint, Phase


class PruneDepth(Stage):
    name = "depth"
    timing = "depth_s"
    section = "depth"
    options = DepthSpec
    changes_model = True
    checkpoint_key = "depth"

    def check_plan(self, recipe: Recipe, plan: Plan, world: int) -> None:
        if world > 1:
            raise UserError("depth runs in one process: remove depth from the recipe, or launch one process")
        if recipe.model.load == "stream":
            raise UserError(
                "depth: a streamed model reads its layers by their original place, which removing blocks "
                "moves; set model.load: memory, or remove depth"
            )
        if recipe.refinement is not None:
            raise UserError(
                "depth: refinement rebuilds the pruned model from the original, blocks and all; remove "
                "refinement, or remove depth"
            )
        if plan.tower is not None:
            raise UserError(
                "depth: a vision-language checkpoint is saved whole as its own class, whose text tower "
                "keeps every block here; remove depth"
            )

    def check_device(self, recipe: Recipe, device: torch.device, save_model: bool) -> None:
        if not save_model:
            raise UserError(
                "depth: a run that removes blocks saves its model (bases.safetensors cannot rebuild the model "
                "without them); set save_models: true, or remove depth"
            )

    def heldout_windows(self, recipe: Recipe, plan: Plan) -> int:
        measures = plan.block_selector is not None and "measure" in plan.block_selector.requires
        return recipe.depth.heldout_windows if recipe.depth is not None and measures else 0

    def memory(self, footprint: Footprint) -> list[Phase]:
        fp = footprint
        phases = [
            fp.phase(
                "depth: block influence (one layer at a time)",
                fp.held + fp.store,
                fp.measured["layer"],
                f"{fp.disk}, or {fp.smaller_batch}",
            )
        ]
        if fp.settings.depth_windows:
            # the original's float32 log-probabilities of every window kept on the host; on the device a
            # batch's logits, both log-probabilities and the KL's temporaries, as the evaluation counts them
            references = fp.settings.depth_windows * fp.seq_len * fp.vocab * 4
            outputs = 5 * fp.batch * fp.seq_len * fp.vocab * 4
            phases.append(
                fp.phase(
                    "depth: measured removals (the model whole on the device, and its outputs on the windows)",
                    fp.weights + fp.store + references,
                    fp.weights + outputs,
                    "depth.selector: influence (no measurement), or a machine with more memory",
                    whole_model=True,
                )
            )
        return phases

    def run(self, state: RunState) -> None:
        spec, selector = state.recipe.depth, state.checked.block_selector
        assert spec is not None and selector is not None and state.model is not None
        saved = state.checkpoint.load_depth()
        if saved is not None:
            state.depth = DepthReport.model_validate(saved)
            if state.depth.selector != selector.name or len(state.depth.removed) != spec.removed:
                raise ProgressKept(
                    f"the interrupted run in {state.staging} removed blocks {state.depth.removed} with another "
                    f"depth setting; rerun with --restart"
                )
        else:
            state.depth = choose_blocks(state, spec)
            state.checkpoint.save_depth(state.depth.model_dump())
        removed = state.depth.removed
        remove_blocks(state.model, state.family, removed)
        state.removed_blocks = list(removed)
        from compressor.run.checks import replan  # noqa: PLC0415 (checks imports the stages)

        state.checked = replan(state.recipe, state.checked, tuple(removed))
        state.config = state.checked.layout.config


def choose_blocks(state: RunState, spec: DepthSpec) -> DepthReport:
    """The selector's choice on the original model, checked, with what it was chosen from."""
    selector = state.checked.block_selector
    assert selector is not None and state.model is not None
    state.progress("depth: block influence", 0, 1)
    store = ActivationStore(state.device, state.recipe.activations, state.staging / SCRATCH_FOLDER)
    influence = block_influence(state.model, state.family, state.calibration, state.device, store)
    layers = len(influence)
    problem = BlockProblem(blocks=layers, remove=spec.removed, influence=influence, shortlist=spec.shortlist)
    windows = state.measuring_windows.get(PruneDepth.name, [])
    home = next(state.model.parameters()).device
    if "measure" in selector.requires:  # the model not yet pruned is the original: measured in place, hooks only
        original = state.model.to(state.device)
        reference: list[torch.Tensor | None] = [None] * len(windows)
        problem.measure = lambda blocks: measured_kl(state, original, windows, problem, blocks, reference)
    try:
        choice = selector.select(problem)
        removed = sorted({int(i) for i in choice.removed})
        if len(removed) != spec.removed or len(choice.removed) != spec.removed:
            raise UserError(
                f"depth selector '{selector.name}' chose {len(choice.removed)} blocks ({choice.removed}) where "
                f"depth.removed is {spec.removed}, each once; fix the selector"
            )
        kept_blocks(state.model.config, removed)  # every index within the model
        # the selector's own measurement where it made it (else one pass)
        heldout = problem.measure(removed) if problem.measure is not None else None
    finally:
        problem.measure = None
        state.model.to(home)  # measured in place on the device: back where the run keeps it
    return DepthReport(
        removed=removed,
        of=layers,
        selector=selector.name,
        influence=influence,
        heldout_windows=sum(len(batch.input_ids) for batch in windows) if heldout is not None else 0,
        measurements=len(problem.measured),
        heldout_kl=heldout,
        objectives=choice.objectives,
    )


def measured_kl(
    state: RunState,
    original: PreTrainedModel,
    windows: list[Batch],
    problem: BlockProblem,
    blocks: Sequence[int],
    reference: list[torch.Tensor | None],
) -> float:
    """KL(original ‖ original without `blocks`) on `windows`, recorded in `problem.measured`."""
    key = tuple(sorted({int(i) for i in blocks}))
    if key not in problem.measured:
        state.progress("depth: measuring removals", len(problem.measured), measurements(problem))
        tally = Tally()
        for index, batch in enumerate(windows):
            own = reference[index]
            if own is None:  # the original's own, once
                own = reference[index] = model_log_probs(original, batch, state.device).cpu()
            with skipping(original, state.family, key):
                candidate = model_log_probs(original, batch, state.device)
            tally.add(own.to(state.device), candidate, batch, state.device)
        problem.measured[key] = tally.result(True)["pruned"]["kl"]
    return problem.measured[key]


def measurements(problem: BlockProblem) -> int:
    """The forward passes a greedy measuring selector makes (its progress bar's length), and the final set's."""
    left = range(problem.blocks, problem.blocks - problem.remove, -1)
    return sum(left if problem.shortlist is None else (min(n, problem.shortlist) for n in left))
