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
from compressor.engine.checkpoint import (
    DISTILLATION_FOLDER,
    FINGERPRINT_FILE,
    Checkpoint,
    json_digest,
    tensor_digest,
)
from compressor.errors import UserError
from compressor.recipe.reading import dotted
from compressor.recipe.schema import Recipe
from compressor.reports.report_model import DecodeBudget
from compressor.runtime.staging import CHECKPOINT_FOLDER, staging_folder


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
    return (
        recipe.distillation is not None
        and trained.get("settings") != distillation_fingerprint(recipe)
        and checkpoint.has_distillation_progress()
    )


RECIPE_VALUES_FILE = "recipe.json"
"""Beside the checkpoint's fingerprint: the recipe values it digests, so a changed recipe can be
told key by key."""


def check_interrupted(output: Path, recipe: Recipe, restart: bool) -> None:
    """An interrupted run to `output` started with another recipe is refused before any weights
    load, naming the keys that changed; `restart` discards it."""
    if not restart and interrupted_with_another_recipe(output, recipe):
        changed = changed_keys(output, recipe)
        which = f" ({', '.join(changed)} changed)" if changed else ""
        raise UserError(
            f"an interrupted run in {staging_folder(output)} was started with a different recipe{which}; "
            f"rerun with --restart to discard its progress, or choose another --output"
        )


def save_recipe_values(checkpoint: Checkpoint, recipe: Recipe) -> None:
    """The fingerprinted recipe values, written beside the fingerprint (`changed_keys` reads them)."""
    if checkpoint.writable:
        (checkpoint.folder / RECIPE_VALUES_FILE).write_text(json.dumps(fingerprinted(recipe), indent=2) + "\n")


def changed_keys(output: Path, recipe: Recipe) -> list[str]:
    """The dotted recipe keys whose values differ from those the interrupted run to `output` was
    started with ([] where that run kept no values)."""
    try:
        saved = json.loads((staging_folder(output) / CHECKPOINT_FOLDER / RECIPE_VALUES_FILE).read_text())
    except (OSError, ValueError):
        return []
    before, after = dotted(saved), dotted(json.loads(json.dumps(fingerprinted(recipe))))
    return sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))


def progress_summary(output: Path) -> str | None:
    """What an interrupted run to `output` left (None: nothing to resume): where, how many sites,
    H, the allocation, distillation's last step."""
    checkpoint = Checkpoint(staging_folder(output) / CHECKPOINT_FOLDER)
    if not (checkpoint.folder / FINGERPRINT_FILE).is_file() or not checkpoint.has_progress():
        return None
    parts = [f"{len(checkpoint.site_files())} finished site(s)"]
    if checkpoint.has_fisher():
        parts.append("H")
    step = checkpoint.distillation_step()
    if step is not None:
        parts.append(f"distillation at step {step}")
    return f"{checkpoint.folder} holds {', '.join(parts)}"


def recipe_fingerprint(recipe: Recipe) -> str:
    """What in the recipe decides the pruned model, with this package's version. Left out: where
    the output goes, evaluation, where model and data come from (their contents are fingerprinted
    instead) and settings that change memory use but not results (activations, H chunking), so
    a run killed for lack of memory can resume with other ones. The checkpoint holds the walk
    only, so `refinement` (after the walk, never checkpointed) is left out too: a killed run may
    resume with other refinement settings. `distillation` has its own checkpoint and fingerprint
    (`distillation_fingerprint`, with the student and its data)."""
    return json_digest(fingerprinted(recipe))


def fingerprinted(recipe: Recipe) -> dict[str, Any]:
    """The recipe values `recipe_fingerprint` digests."""
    values = recipe.to_dict()
    for key in ("output", "evaluation", "activations", "threads", "refinement", "distillation", *recipe.stages):
        values.pop(key, None)  # a plugin stage's section too: it runs after the walk, which is all the checkpoint holds
    values["model"].pop("path", None)
    values["model"].pop("revision", None)
    values["model"].pop("load", None)  # memory or streamed: the same weights, bit for bit
    values["calibration"].pop("dataset", None)
    for key in ("chunk", "recompute"):
        values["sensitivity"].pop(key, None)
    if values.get("budget") == "all":  # the default, as before the key existed: older checkpoints still resume
        values.pop("budget")
    for key in ("depth", "heads", "target_decode"):  # likewise
        if values.get(key) is None:
            values.pop(key, None)
    if isinstance(values.get("mlp"), dict) and values["mlp"].get("shared_kept") is None:  # likewise
        values["mlp"].pop("shared_kept", None)
    if isinstance(values.get("mlp"), dict) and not values["mlp"].get("remove_attention"):  # likewise
        values["mlp"].pop("remove_attention", None)
    if isinstance(values.get("mlp"), dict) and not values["mlp"].get("merge_kv_heads"):  # likewise
        values["mlp"].pop("merge_kv_heads", None)
    values["compressor"] = compressor.__version__
    return values


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
    return json_digest(
        {
            "distillation": values,
            "walk": recipe_fingerprint(recipe),
            "refinement": refinement,
            "compressor": compressor.__version__,
        }
    )


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
    return json_digest(
        {
            "model": model_fingerprint,
            "data": data_fingerprint,
            "sensitivity": options,
            "seed": recipe.seed,
            "attention": recipe.model.attn_implementation,
            "device": device.type,
            "compressor": compressor.__version__,
        }
    )


def baseline_tasks_key(
    suites: list[Any], model_fingerprint: str, recipe: Recipe, tokenizer: Any, device: torch.device
) -> str:
    """What the original model's lm-eval scores depend on: the model, its tokenizer's chat
    template, the device type, the seed and each suite (settings, lm-eval version, local task
    and data files' bytes)."""
    if not suites:
        return ""
    from compressor.evaluation.harness import suite_digest

    return json_digest(
        {
            "model": model_fingerprint,
            "seed": recipe.seed,
            "device": device.type,
            "chat_template": str(getattr(tokenizer, "chat_template", None)),
            "attention": recipe.model.attn_implementation,
            "suites": [suite_digest(suite) for suite in suites],
        }
    )


DECODE_FILE = "decode_budget.json"
"""In the checkpoint folder: the budgets `target_decode`'s search found (`plan.decode_budget`), with
the recipe's fingerprint: timings differ from one measurement to the next, and a resumed run must
plan at the widths its checkpoint holds."""


def stored_decode_budget(output: Path, recipe: Recipe) -> DecodeBudget | None:
    """The budgets an interrupted run to `output` found with this recipe (None: none kept, or another recipe's)."""
    try:
        saved = json.loads((staging_folder(output) / CHECKPOINT_FOLDER / DECODE_FILE).read_text())
        if saved.get("recipe") != recipe_fingerprint(recipe):
            return None
        return DecodeBudget.model_validate({**saved["budget"], "reused": True})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep_decode_budget(folder: Path, recipe: Recipe, record: DecodeBudget) -> None:
    """The budgets into the checkpoint `folder`, for a resumed run to plan at the same widths."""
    folder.mkdir(parents=True, exist_ok=True)
    values = {"recipe": recipe_fingerprint(recipe), "budget": record.model_dump(exclude={"reused"})}
    (folder / DECODE_FILE).write_text(json.dumps(values, indent=2) + "\n")
