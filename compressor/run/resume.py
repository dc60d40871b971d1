"""What makes a run resumable: the fingerprints of the recipe, data, H and distillation settings
that a checkpoint must match, and the check that an interrupted run used this recipe."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

import compressor
from compressor.data.batches import Batch
from compressor.engine.checkpoint import DISTILLATION_FOLDER, FINGERPRINT_FILE, Checkpoint, json_digest, tensor_digest
from compressor.errors import UserError
from compressor.recipe.schema import Recipe
from compressor.run.staging import CHECKPOINT_FOLDER, staging_folder


def interrupted_with_another_recipe(output: Path, recipe: Recipe) -> bool:
    """Whether an interrupted run to `output` left progress made with another recipe (its model
    and data are checked once loaded, by `Checkpoint.start`)."""
    checkpoint = Checkpoint(staging_folder(output) / CHECKPOINT_FOLDER)
    try:
        saved = json.loads((checkpoint.folder / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return False
    if saved.get("recipe") != recipe_fingerprint(recipe) and checkpoint.has_progress():
        return True
    try:
        trained = json.loads((checkpoint.folder / DISTILLATION_FOLDER / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (recipe.distillation is not None and trained.get("settings") != distillation_fingerprint(recipe)
            and checkpoint.has_distillation_progress())


def check_interrupted(output: Path, recipe: Recipe, restart: bool) -> None:
    """An interrupted run to `output` started with another recipe is refused before any weights
    load; `restart` discards it."""
    if not restart and interrupted_with_another_recipe(output, recipe):
        raise UserError(f"an interrupted run in {staging_folder(output)} was started with a different recipe; "
                        f"rerun with --restart to discard its progress, or choose another --output")


def recipe_fingerprint(recipe: Recipe) -> str:
    """What in the recipe decides the pruned model, with this package's version. Left out: where
    the output goes, evaluation, where model and data come from (their contents are fingerprinted
    instead) and settings that change memory use but not results (activations, H chunking), so
    a run killed for lack of memory can resume with other ones. The checkpoint holds the walk
    only, so `refinement` (after the walk, never checkpointed) is left out too: a killed run may
    resume with other refinement settings. `distillation` has its own checkpoint and fingerprint
    (`distillation_fingerprint`, with the student and its data)."""
    values = recipe.to_dict()
    for key in ("output", "evaluation", "activations", "refinement", "distillation"):
        values.pop(key, None)
    values["model"].pop("path", None)
    values["model"].pop("revision", None)
    values["calibration"].pop("dataset", None)
    for key in ("chunk", "recompute"):
        values["sensitivity"].pop(key, None)
    values["compressor"] = compressor.__version__
    return json_digest(values)


DISTILLATION_MEMORY_KEYS = ("gradient_checkpointing", "teacher")
"""Distillation settings that change memory use, not results: a resumed stage may change them."""


def distillation_fingerprint(recipe: Recipe) -> str:
    """What decides the distillation stage's result besides its data (fingerprinted apart, once
    read): its settings, the walk's recipe fingerprint and the refinement settings that made its
    student (inputs, not the student's bits: a GPU's refinement need not repeat them exactly)."""
    assert recipe.distillation is not None
    values = {k: v for k, v in dataclasses.asdict(recipe.distillation).items() if k not in DISTILLATION_MEMORY_KEYS}
    values["dataset"] = None  # its contents are fingerprinted instead
    refinement = dataclasses.asdict(recipe.refinement) if recipe.refinement is not None else None
    return json_digest({"distillation": values, "walk": recipe_fingerprint(recipe), "refinement": refinement,
                        "compressor": compressor.__version__})


def data_fingerprint(batches: list[Batch]) -> str:
    tensors = []
    for batch in batches:
        tensors += [batch.input_ids, batch.attention_mask]
        if batch.sensitivity_mask is not None:
            tensors.append(batch.sensitivity_mask)
    return tensor_digest(tensors)


def fisher_key(recipe: Recipe, model_fingerprint: str, data_fingerprint: str, device: torch.device) -> str:
    """What H depends on: the model (and how it computes: attention kernel, device type), the
    calibration tokens, the H pass's result-deciding options and the seed of its label sampling."""
    options = {k: v for k, v in dataclasses.asdict(recipe.sensitivity).items() if k not in ("chunk", "recompute")}
    return json_digest({"model": model_fingerprint, "data": data_fingerprint, "sensitivity": options,
                        "seed": recipe.seed, "attention": recipe.model.attn_implementation,
                        "device": device.type, "compressor": compressor.__version__})


def baseline_tasks_key(suites: list[Any], model_fingerprint: str, recipe: Recipe, tokenizer: Any,
                       device: torch.device) -> str:
    """What the original model's lm-eval scores depend on: the model, its tokenizer's chat
    template, the device type, the seed and each suite (settings, lm-eval version, local task
    and data files' bytes)."""
    if not suites:
        return ""
    from compressor.evaluation.harness import suite_digest

    return json_digest({"model": model_fingerprint, "seed": recipe.seed, "device": device.type,
                        "chat_template": str(getattr(tokenizer, "chat_template", None)),
                        "attention": recipe.model.attn_implementation,
                        "suites": [suite_digest(suite) for suite in suites]})
