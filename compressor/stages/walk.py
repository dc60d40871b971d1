"""The walk: `engine.prune` on the plan's layout (its H kept for a sweep and for the run's other
walks), a stock tied head's symmetric fit, or, for a layout that keeps the stream whole, no walk."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from compressor.data.batches import Batch
from compressor.engine.bases import apply_bases
from compressor.engine.checkpoint import Checkpoint
from compressor.engine.parallel import Ranks
from compressor.engine.survey import SurveyMemo
from compressor.engine.walk import prune
from compressor.engine.walk_options import PruneResult, WalkOptions
from compressor.errors import UserError
from compressor.models.families import ModelFamily
from compressor.models.sites import EMBEDDING
from compressor.models.stock import head_stream, tied_rotation
from compressor.recipe.schema import Recipe
from compressor.runtime.staging import SCRATCH_FOLDER
from compressor.stages.base import Progress, RunState
from compressor.stages.contract import Stage
from compressor.stages.costs import TimedPhase, Work
from compressor.stages.split_choice import KeptFisher

if TYPE_CHECKING:
    from compressor.models.layout import SlicedLayout
    from compressor.plan.checks import Plan
    from compressor.plan.memory import Footprint
    from compressor.stages.costs import Phase


class Walk(Stage):
    name = "walk"
    changes_model = True
    checkpoint_key = "sites"

    def check_device(self, recipe: Recipe, device: torch.device, save_model: bool) -> None:
        if device.type != "cpu" and recipe.sensitivity.recompute is False:
            raise UserError(
                "sensitivity.recompute: false keeps every layer's graph, and so every layer, on the device; "
                "it is for CPU runs: leave it unset (or true) on a GPU"
            )

    def check_plan(self, recipe: Recipe, plan: Plan, world: int) -> None:
        if world > 1 and not plan.layout.residual:
            raise UserError(
                "a global layout that prunes the MLP alone runs in one process (it has no walk to share); "
                "launch one process"
            )

    def memory(self, footprint: Footprint) -> list[Phase]:
        """Capturing the layer inputs, the H pass, and the walk, each layer by layer."""
        fp = footprint
        capture_device = fp.vocab * fp.d * fp.item + 2 * fp.batch * fp.seq_len * fp.d * fp.item  # embedding, a batch
        phases = [
            fp.phase("capture", fp.held + fp.store + fp.positions, capture_device, f"{fp.disk}, or {fp.smaller_batch}")
        ]
        if fp.needs_h:
            phases.append(
                fp.phase(
                    "H pass (layer by layer)",
                    fp.held + fp.store + fp.positions + fp.stored + fp.totals,
                    fp.measured["fisher"],
                    f"a smaller sensitivity.chunk (now {fp.chunk}), {fp.disk}",
                )
            )
        # one basis: the survey's pooled C and H (the basis is chosen from them at the walk's start, on
        # the device), the final stream's C (for the head) on the host
        one_basis = fp.layout.one_basis
        pools = 2 * fp.d * fp.d * 8 if one_basis else 0
        head_moment = fp.d * fp.d * 8 if one_basis else 0
        advice = (
            ", or a walk that writes each sliced layer as it goes (no refinement, mlp or distillation, "
            "evaluation.throughput: false; a global tied head: slicing.tied_fit: diagonal)"
        )
        phases.append(
            fp.phase(
                "walk (one layer at a time, each written when sliced)" if fp.writes else "walk (one layer at a time)",
                fp.walk_host + head_moment,
                fp.measured["walk"] + pools,
                f"{fp.disk}, or {fp.smaller_batch}" + (advice if fp.streaming and not fp.writes else ""),
            )
        )
        return phases

    def seconds(self, work: Work) -> list[TimedPhase]:
        if work.adopts_trial:  # the chosen trial's walk and H are within the split's time
            return []
        return work.over_candidates(lambda layout: walk_seconds(work, layout, work.tokens, with_h=True))

    def run(self, state: RunState) -> None:
        if not state.adopted:  # else the chosen split's trial walk is the run's
            walk(state)
        if isinstance(state.resources, KeptFisher):
            state.resources.kept.clear()  # the walk's result holds H from here on


WALK_PASS = 1.5
"""A walk's pass through a layer, in layer forwards: each site's projections and C beside the block."""


def needs_h(checked: Plan) -> bool:
    """The walk estimates H: a strategy of the pipeline or the allocator requires it."""
    from compressor.engine.pooling import required_statistics  # noqa: PLC0415

    allocator = set(checked.allocator.requires) if checked.allocator is not None else set()
    return "H" in required_statistics(checked.pipeline) | allocator


def walk_seconds(work: Work, layout: SlicedLayout, tokens: int, with_h: bool) -> list[TimedPhase]:
    """The walk of `layout` on `tokens` calibration tokens: H (`with_h`, where the pipeline needs it),
    a survey of the original where one basis, a tied head or an allocator asks for one, and the walk:
    a pass per layer and a basis per site."""
    if not layout.residual:
        return []
    costs, layers = work.costs, layout.config.num_hidden_layers
    phases = []
    moments = 2 * costs.moment_stream  # a layer's two sites' C (and in the H pass their H)
    if with_h and needs_h(work.checked):
        h = tokens * (layers * (costs.layer_backward + moments) + costs.head_backward)
        phases.append(TimedPhase("H pass", h, "fisher_s"))
    surveys = layout.one_basis or layout.tie_head or work.checked.allocator is not None
    per_layer = WALK_PASS * costs.layer_forward + moments
    if surveys:
        per_layer += costs.layer_forward + moments
    walked = tokens * layers * per_layer + (2 * layers + 1) * costs.basis
    phases.append(TimedPhase("walk", walked, "prune_s"))
    return phases


def walk(state: RunState) -> None:
    """`engine.prune` on the plan's layout; H kept for a sweep (and for the run's other walks)."""
    recipe, device = state.recipe, state.device
    if not state.checked.layout.residual:
        keep_stream(state)
        return
    h_key = state.fisher_key()
    state.ranks.barrier()  # the other ranks read the checkpoint once its fingerprint is checked
    tick = time.perf_counter()
    settings = WalkStageSettings(
        device,
        state.progress,
        state.checkpoint,
        state.staging / SCRATCH_FOLDER,
        state.ranks,
        fisher=state.resources.fisher(h_key),
        write_to=state.staging / "model" if state.writes else None,
        survey=state.survey,
    )
    state.result = prune_as_recipe(state.model, recipe, state.checked, state.calibration, settings)
    state.survey = None  # the last walk that could recall it
    if state.result.fisher is not None:
        state.resources.keep_fisher(h_key, state.result.fisher)
    state.pruned, state.bases = state.result.model, state.result.bases
    if rotates_for_a_tied_head(recipe, state.checked):
        state.progress("fitting the tied head", 0, 1)
        state.pruned, state.bases, state.head_scale = rotated_for_a_tied_head(
            state.result, state.model_to_prune(), state.family, device
        )
        state.head_fit = "symmetric"
    seconds = state.result.fisher_seconds
    state.timings["fisher_s"] = max(state.timings.get("fisher_s", 0.0), seconds)  # shared work
    state.timings["prune_s"] = time.perf_counter() - tick - seconds


def keep_stream(state: RunState) -> None:
    """A layout that prunes the MLP alone (`models.mlp_only`): no walk; the original model, whole
    in memory, is what the MLP stage prunes, every site at its full width."""
    if state.recipe.model.load == "stream":  # a streamed shell's layers are read by a walk only
        state.model = state.resources.whole_model(state.recipe.model)
    assert state.model is not None and state.checked.layout.widths is not None
    if state.family.prepare is not None:  # fused experts → RoutedExperts, whose experts the MLP stage prunes
        state.family.prepare(state.model)
    state.result = PruneResult(
        model=state.model,
        sites=[],
        slicing={},
        bases={},
        widths=dict(state.checked.layout.widths),
        tokens_by_rank=[sum(int(batch.attention_mask.sum()) for batch in state.calibration)],
    )
    state.pruned, state.bases = state.model, {}
    state.timings["prune_s"] = 0.0


@dataclass(frozen=True)
class WalkStageSettings:
    """Where and how this rank walks (the stage's state's, or a follower's own): `prune_as_recipe`'s
    settings beside the model, the recipe, its plan and the calibration batches."""

    device: torch.device
    progress: Progress
    checkpoint: Checkpoint
    scratch: Path
    """Where the calibration activations go with `activations: disk`."""
    ranks: Ranks
    fisher: dict[str, torch.Tensor] | None = None
    """H given (a sweep's earlier run, a split's trial): not estimated again."""
    write_to: Path | None = None
    """The sliced model written there as the walk goes, by rank 0."""
    survey: SurveyMemo | None = None
    """The survey of the original model, kept for the next walk over it (`engine.survey.SurveyMemo`)."""


def prune_as_recipe(
    model: PreTrainedModel,
    recipe: Recipe,
    checked: Plan,
    calibration: list[Batch],
    settings: WalkStageSettings,
) -> PruneResult:
    """The walk as the recipe asks for it: the same call on every rank of a data-parallel run."""
    options = WalkOptions(
        device=settings.device,
        sensitivity=recipe.sensitivity,
        seed=recipe.seed,
        offload=recipe.activations,
        scratch=settings.scratch,
        correct_readers=recipe.slicing.correct_readers,
        pooling=recipe.slicing.pooling,
        write_to=settings.write_to,
        allocator=checked.allocator,
        checkpoint=settings.checkpoint,
        fisher=settings.fisher,
        ranks=settings.ranks,
        progress=settings.progress,
        survey=settings.survey,
    )
    return prune(model, checked.layout, calibration, checked.pipeline, options)


def stock_tied(checked: Plan) -> bool:
    """Saved as the original class with its head tied (its final norm's diagonal fitted or learned)."""
    layout = checked.layout
    return layout.one_basis and layout.tie_head


def rotates_for_a_tied_head(recipe: Recipe, checked: Plan) -> bool:
    return stock_tied(checked) and recipe.slicing.tied_fit == "symmetric"


def rotated_for_a_tied_head(
    result: PruneResult, original: PreTrainedModel, family: ModelFamily, device: torch.device
) -> tuple[PreTrainedModel, dict[str, torch.Tensor], torch.Tensor]:
    """A stock tied head (`slicing.tied_fit: symmetric`): the walk's basis V becomes V·R, R the
    rotation whose final-norm diagonal D fits the untied head best (`stock.tied_rotation`); the
    sliced model rebuilt from `original` with it, the rotated bases, and D."""
    sliced = result.model
    R, scale = tied_rotation(
        sliced.get_submodule(family.embedding).weight,
        sliced.get_submodule(family.head).weight,
        head_stream(result.head_moment, result.bases[EMBEDDING]),
    )
    # One basis: every site the same tensor, so sites stay shared bit for bit. A fresh copy: a resumed
    # walk's basis is read from a file, and BLAS may round a product of differently aligned memory differently.
    rotated = result.bases[EMBEDDING].clone(memory_format=torch.contiguous_format) @ R
    bases = {site: rotated for site in result.bases}
    return apply_bases(original, family, bases, device, keep_tied=False), bases, scale
