"""A data-parallel run's ranks above 0: the same walk, MLP stage and distillation as rank 0, each on
its share of the data, their statistics summed with the others'; rank 0 writes everything."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from compressor.engine.checkpoint import Checkpoint
from compressor.engine.parallel import Ranks
from compressor.models.sites import EMBEDDING
from compressor.models.stock import head_stream, to_stock
from compressor.plan.checks import Plan
from compressor.plan.memory import writes_as_it_goes
from compressor.recipe.schema import Recipe
from compressor.runtime.loading import Resources
from compressor.runtime.staging import CHECKPOINT_FOLDER, staging_folder
from compressor.stages.base import Progress
from compressor.stages.data import distillation_data
from compressor.stages.distil import distil_student
from compressor.stages.mlp import MlpStageSettings, Walked, prune_mlps
from compressor.stages.walk import prune_as_recipe, rotated_for_a_tied_head, rotates_for_a_tied_head


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
    checkpoint = Checkpoint(staging_folder(Path(recipe.output)) / CHECKPOINT_FOLDER, writable=False)
    layout, config = checked.layout, checked.layout.config
    with tempfile.TemporaryDirectory(prefix=f"compress-rank{ranks.rank}-") as scratch:
        written = (
            staging_folder(Path(recipe.output)) / "model"
            if writes_as_it_goes(recipe, layout, stages=checked.stages)
            else None
        )
        result = prune_as_recipe(
            model,
            recipe,
            checked,
            calibration,
            device,
            report_progress,
            checkpoint,
            Path(scratch),
            None,
            ranks,
            written,
        )
        if recipe.distillation is None and not layout.prunes_mlp:
            return None
        pruned, bases, scale = result.model, result.bases, None
        if rotates_for_a_tied_head(recipe, checked):  # as rank 0's walk does, so every rank prunes one model
            pruned, bases, scale = rotated_for_a_tied_head(result, resources.model(recipe.model), layout.family, device)
        if layout.prunes_mlp:  # every rank measures its share, C summed: the same neurons everywhere
            settings = MlpStageSettings(device, report_progress, Path(scratch), ranks)
            prune_mlps(recipe, checked, pruned, calibration, Walked(result, checkpoint, bases), settings)
            config = layout.mlp_config(config)
    if recipe.distillation is not None:  # every rank trains its share; rank 0 saves
        if layout.one_basis:
            pruned, _ = to_stock(
                pruned,
                layout.family,
                config,
                tie=layout.tie_head,
                stream=head_stream(result.head_moment, bases[EMBEDDING]),
                scale=scale,
            )
        distil_student(
            recipe,
            checked.layout.family,
            pruned,
            rows,
            staging_folder(Path(recipe.output)),
            device,
            None,
            Resources(),
            report_progress,
            ranks,
        )
    return None
