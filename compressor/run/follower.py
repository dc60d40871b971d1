"""A data-parallel run's ranks above 0: the same walk, MLP stage and distillation as rank 0, each on
its share of the data, their statistics summed with the others'; rank 0 writes everything."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from compressor.engine.checkpoint import Checkpoint
from compressor.engine.parallel import Ranks
from compressor.models.stock import to_stock
from compressor.plan.checks import Plan
from compressor.plan.memory import writes_as_it_goes
from compressor.recipe.schema import Recipe
from compressor.runtime.loading import Resources
from compressor.runtime.staging import CHECKPOINT_FOLDER, staging_folder
from compressor.stages.base import Progress, RunState
from compressor.stages.data import distillation_data
from compressor.stages.distil import distil_student
from compressor.stages.mlp import MlpStageSettings, Walked, prune_mlps
from compressor.stages.walk import (
    WalkStageSettings,
    prune_as_recipe,
    rotated_for_a_tied_head,
    rotates_for_a_tied_head,
)


def follow(
    recipe: Recipe, checked: Plan, device: torch.device, ranks: Ranks, resources: Resources, report_progress: Progress
) -> None:
    """A data-parallel run's rank above 0: the walk on its share of the calibration batches, its
    statistics summed with the others'; rank 0 writes the run folder and the checkpoint, which
    this rank only reads (to resume where rank 0 does)."""
    torch.manual_seed(recipe.seed)
    tokenizer = resources.tokenizer(recipe.model)
    calibration = resources.batches(recipe.calibration, tokenizer, "calibration")
    rows = distillation_data(recipe, tokenizer)
    model = resources.model(recipe.model)
    ranks.barrier()  # rank 0 has prepared the staging folder and checked the checkpoint's fingerprint
    staging = staging_folder(Path(recipe.output))
    checkpoint = Checkpoint(staging / CHECKPOINT_FOLDER, writable=False)
    # what this rank's stages share, as rank 0's do (its distillation loads the teacher afresh)
    state = RunState(
        staging, recipe, checked, device, checkpoint, report_progress, Resources(), ranks, distillation_rows=rows
    )
    layout = checked.layout
    with tempfile.TemporaryDirectory(prefix=f"compress-rank{ranks.rank}-") as scratch:
        written = staging / "model" if writes_as_it_goes(recipe, layout, stages=checked.stages) else None
        walking = WalkStageSettings(device, report_progress, checkpoint, Path(scratch), ranks, write_to=written)
        state.result = result = prune_as_recipe(model, recipe, checked, calibration, walking)
        if recipe.distillation is None and not layout.prunes_mlp:
            return None
        state.pruned, state.bases = result.model, result.bases
        if rotates_for_a_tied_head(recipe, checked):  # as rank 0's walk does, so every rank prunes one model
            original = resources.model(recipe.model)
            state.pruned, state.bases, state.head_scale = rotated_for_a_tied_head(
                result, original, layout.family, device
            )
        if layout.prunes_mlp:  # every rank measures its share, C summed: the same neurons everywhere
            settings = MlpStageSettings(device, report_progress, Path(scratch), ranks)
            prune_mlps(recipe, checked, state.pruned, calibration, Walked(result, checkpoint, state.bases), settings)
            state.config = layout.mlp_config(state.config)
    if recipe.distillation is not None:  # every rank trains its share; rank 0 saves
        _distil_share(state)
    return None


def _distil_share(state: RunState) -> None:
    """This rank's share of the distillation, on the student as rank 0 trains it (a global
    layout's converted to the original class first); rank 0 saves the result."""
    layout = state.checked.layout
    if layout.one_basis:
        state.pruned, _ = to_stock(
            state.pruned,
            layout.family,
            state.config,
            tie=layout.tie_head,
            stream=state.head_stream(),
            scale=state.head_scale,
        )
    distil_student(state)
