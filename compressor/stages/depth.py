"""`depth`: whole decoder blocks removed before the walk (issue 49). The selector chooses on the
original model: every block's influence (`engine.depth.block_influence`), and for a measuring
selector the held-out KL of the original without a set of blocks (`models.depth.skipping`, a
forward pass per set). The blocks go from the model the walk prunes and from every fresh copy a
later stage loads (`RunState.model_to_prune`); the plan is made again for the model without them
(`checks.replan`: its sites, config and widths, the budget still the original's). The choice is
checkpointed, so a resumed run removes the same blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore
from compressor.engine.depth import block_influence
from compressor.errors import ProgressKept, UserError
from compressor.evaluation.metrics import kl_to_references, model_log_probs
from compressor.models.depth import remove_blocks, skipping
from compressor.recipe.schema import Recipe
from compressor.recipe.sections.depth import DepthSpec
from compressor.reports.report_model import DepthCandidate, DepthReport
from compressor.runtime.staging import SCRATCH_FOLDER
from compressor.stages.base import RunState
from compressor.stages.contract import Stage
from compressor.stages.costs import TimedPhase, Work
from compressor.strategies.block_contract import BlockProblem, BlockSelector
from compressor.strategies.units import checked_choice

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from compressor.plan.checks import Plan
    from compressor.plan.memory import Footprint
    from compressor.stages.costs import Phase


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
        """A measuring selector's windows; with `depth` open and `mlp.measure_best`, the windows each
        count's removal is measured on for the prediction, whatever the selector."""
        if recipe.depth is None or plan.block_selector is None:
            return 0
        return recipe.depth.heldout_windows if measures(recipe, plan, plan.block_selector) else 0

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

    def seconds(self, work: Work) -> list[TimedPhase]:
        """The influence pass, and the measured removals: the original's outputs on the windows once,
        then each set of blocks measured (a greedy selector's path: `measurements`)."""
        spec, selector = work.recipe.depth, work.checked.block_selector
        assert spec is not None and selector is not None
        layers = work.original_layers
        influence = work.layer_pass(layers=layers)
        windows = work.heldout.get(self.name, 0)
        if not windows:
            return [TimedPhase("depth: block influence", influence, "depth_s")]
        counts = [spec.removed] if spec.removed is not None else open_counts(work.checked)
        most = BlockProblem(blocks=layers, remove=max(counts), influence=[], shortlist=spec.shortlist)
        passes = measurements(most) if "measure" in selector.requires else len(counts)
        model = work.costs.model_forward
        measured = windows * (model(layers) + passes * model(layers - max(counts) // 2))
        return [TimedPhase("depth: block influence and measured removals", influence + measured, "depth_s")]

    def run(self, state: RunState) -> None:
        spec, selector = state.recipe.depth, state.checked.block_selector
        assert spec is not None and selector is not None and state.model is not None
        counts = [spec.removed] if spec.removed is not None else open_counts(state.checked)
        saved = state.checkpoint.load_depth()
        if saved is not None:
            state.depth = DepthReport.model_validate(saved)
            if state.depth.selector != selector.name or chosen_counts(state.depth) != counts:
                raise ProgressKept(
                    f"the interrupted run in {state.staging} removed blocks {state.depth.removed} with another "
                    f"depth setting; rerun with --restart"
                )
        else:
            state.depth = choose_blocks(state, counts)
            state.checkpoint.save_depth(state.depth.model_dump(exclude_unset=True))
        if spec.removed is None:  # every count's blocks: the split choice measures each, and removes the chosen
            assert state.depth.candidates is not None
            sets = [(), *(tuple(candidate.removed) for candidate in state.depth.candidates)]
            state.checked = state.checked.replanned(state.recipe, (), sets)
            return
        removed = state.depth.removed
        remove_blocks(state.model, state.family, removed)
        state.removed_blocks = list(removed)
        state.checked = state.checked.replanned(state.recipe, tuple(removed))
        state.config = state.checked.layout.config


def measures(recipe: Recipe, checked: Plan, selector: BlockSelector) -> bool:
    """The stage measures removals on held-out windows: for a selector that requires it, or, with
    `depth` open and `mlp.measure_best` (as the plan decided it), each count's blocks for the split
    prediction."""
    assert recipe.depth is not None
    predicts = recipe.depth.removed is None and checked.measure_best is not None
    return "measure" in selector.requires or predicts


def open_counts(checked: Plan) -> list[int]:
    """`depth` without `removed`: the block counts above none that the plan's candidates remove."""
    return sorted({len(split.removed_blocks) for split in checked.splits} - {0})


def chosen_counts(depth: DepthReport) -> list[int]:
    """The block counts a (saved) choice was made for: its candidates', or its one count."""
    if depth.candidates is None:
        return [len(depth.removed)]
    return [len(candidate.removed) for candidate in depth.candidates]


def choose_blocks(state: RunState, counts: list[int]) -> DepthReport:
    """The selector's choice on the original model for each of `counts` (one count: the blocks the
    run removes; several, `depth` open: each candidate's, measurements shared between them), checked,
    with what it was chosen from."""
    spec, selector = state.recipe.depth, state.checked.block_selector
    assert spec is not None and selector is not None and state.model is not None
    state.progress("depth: block influence", 0, 1)
    store = ActivationStore(state.device, state.recipe.activations, state.staging / SCRATCH_FOLDER)
    influence = block_influence(state.model, state.family, state.calibration, state.device, store)
    layers = len(influence)
    measured: dict[tuple[int, ...], float] = {}
    windows = state.measuring_windows.get(PruneDepth.name, [])
    home = next(state.model.parameters()).device
    original = state.model.to(state.device) if windows else None  # the original: measured in place, hooks only
    reference: list[torch.Tensor | None] = [None] * len(windows)
    problems = [
        BlockProblem(blocks=layers, remove=count, influence=influence, measured=measured, shortlist=spec.shortlist)
        for count in counts
    ]
    total = measurements(problems[-1]) if "measure" in selector.requires else len(counts)
    removals = Removals(original, windows, measured, total, reference) if original is not None else None

    def measure(blocks: Sequence[int]) -> float:
        assert removals is not None
        return measured_kl(state, removals, blocks)

    chosen: list[DepthCandidate] = []
    try:
        for problem in problems:
            problem.measure = measure if original is not None else None
            choice = selector.select(problem)
            kept = checked_choice(choice, selector, problem).tolist()
            removed = [block for block in range(problem.blocks) if block not in kept]
            # the selector's own measurement where it made it (else one pass)
            heldout = problem.measure(removed) if problem.measure is not None else None
            chosen.append(DepthCandidate(removed=removed, heldout_kl=heldout, objectives=choice.objectives))
    finally:
        for problem in problems:
            problem.measure = None
        state.model.to(home)  # measured in place on the device: back where the run keeps it
    report = DepthReport(
        removed=[] if spec.removed is None else chosen[0].removed,
        of=layers,
        selector=selector.name,
        influence=influence,
        heldout_windows=sum(len(batch.input_ids) for batch in windows) if original is not None else 0,
        measurements=len(measured),
    )
    if spec.removed is None:
        return report.model_copy(update={"candidates": chosen})
    return report.model_copy(update={"heldout_kl": chosen[0].heldout_kl, "objectives": chosen[0].objectives})


@dataclass(frozen=True)
class Removals:
    """What the depth stage's measurements of removed blocks share: the original and its held-out
    windows, every KL measured so far, and the original's own log-probabilities (filled once)."""

    original: PreTrainedModel
    """Measured in place, hooks only."""
    windows: list[Batch]
    measured: dict[tuple[int, ...], float]
    """The KL of each set of removed blocks measured so far (sorted block indices)."""
    total: int
    """The progress bar's length."""
    reference: list[torch.Tensor | None]
    """The original's log-probabilities on each window, on the host (None until first needed)."""


def measured_kl(state: RunState, removals: Removals, blocks: Sequence[int]) -> float:
    """KL(original ‖ original without `blocks`) on the windows, recorded in `removals.measured`."""
    original, windows, measured, reference = removals.original, removals.windows, removals.measured, removals.reference
    key = tuple(sorted({int(i) for i in blocks}))
    if key not in measured:
        state.progress("depth: measuring removals", len(measured), removals.total)
        for index, batch in enumerate(windows):
            if reference[index] is None:  # the original's own, once
                reference[index] = model_log_probs(original, batch, state.device).cpu()
        with skipping(original, state.family, key):
            measured[key] = kl_to_references(cast(list[torch.Tensor], reference), original, windows, state.device)
    return measured[key]


def measurements(problem: BlockProblem) -> int:
    """The forward passes a greedy measuring selector makes (its progress bar's length), and the final set's."""
    left = range(problem.blocks, problem.blocks - problem.remove, -1)
    return sum(left if problem.shortlist is None else (min(n, problem.shortlist) for n in left))
