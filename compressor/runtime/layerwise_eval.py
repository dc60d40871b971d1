"""Evaluation that fits where the walk fits.

Perplexity and KL(original ‖ pruned) computed layer by layer, for a run whose original is
streamed (`model.load: stream`) or whose lm-eval models are placed by accelerate: the original is
never whole on the device. Each model's final stream is computed with `engine.layerwise.final_streams`
(its own layers, unfused, with the arguments its forward gives them; a streamed original's read from
the shards one at a time), then each batch's logits from its own head, and the figures summed as
`evaluation.metrics.compare` sums them (`Tally`): the same operations on the same tensors as the
whole-model evaluation.

lm-eval tasks with `evaluation.device_map`: each model in turn loaded from its folder (the original's,
then the run's saved `model/`) with accelerate's `device_map` and `max_memory`, spread over the GPUs,
then host memory, then disk, and handed to lm-eval's HF model: what lm-eval's own `parallelize=True`
does, through the run's loader (which reads what the run read: local folders, the hub cache, a run
folder's safetensors only).
"""

from __future__ import annotations

import gc
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from compressor.data.batches import Batch
from compressor.engine.activations import held_on
from compressor.engine.layerwise import final_streams
from compressor.evaluation.metrics import Tally, log_probs_of, task_scores
from compressor.models.families import ModelFamily
from compressor.recipe.schema import Recipe
from compressor.recipe.sections.evaluation import EvaluationSpec
from compressor.recipe.sections.model import ModelSpec
from compressor.runtime.loading import load_model
from compressor.validation import replaced


def evaluates_layer_by_layer(recipe: Recipe) -> bool:
    """Perplexity and KL run layer by layer, the original never whole on the device: in a streamed
    run unless lm-eval tasks or throughput need both models whole, and wherever lm-eval's models
    are placed by accelerate (`evaluation.device_map`, which rules out throughput). Not after
    refinement or distillation: those stages hold the original whole already (the refined model
    is evaluated beside the unrefined one, the teacher is reused)."""
    spec = recipe.evaluation
    if spec is None or spec.throughput or recipe.refinement is not None or recipe.distillation is not None:
        return False
    return spec.device_map is not None or (recipe.model.load == "stream" and not spec.lm_eval)


@torch.no_grad()
def layerwise_compare(
    original: PreTrainedModel,
    pruned: PreTrainedModel,
    family: ModelFamily,
    batches: list[Batch],
    device: torch.device,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, float]]:
    """`compare`'s figures, with `original` (a streamed shell, or any model) and `pruned` run
    layer by layer, each head on `device` while its logits are formed."""
    streams = {
        "baseline": final_streams(original, family, batches, device),
        "pruned": final_streams(pruned, family, batches, device),
    }
    tally = Tally()
    with held_on(family.head_modules(original) + family.head_modules(pruned), device, read_only=True):
        for index, batch in enumerate(batches):
            reference, candidate = (
                log_probs_of(family.logits(model, streams[name][index].to(device)))
                for name, model in (("baseline", original), ("pruned", pruned))
            )
            tally.add(reference, candidate, batch, device)
            if progress:
                progress(index + 1, len(batches))
    return tally.result(True)


def placement_options(spec: EvaluationSpec, offload: Path, device: torch.device) -> dict[str, Any]:
    """`from_pretrained`'s accelerate arguments for `evaluation.device_map` (GPU numbers as
    integers); a run on the CPU keeps its models off any GPU (host memory, then disk)."""
    from accelerate.utils import get_max_memory

    limits: dict[Any, Any] | None = spec.max_memory
    if device.type == "cpu":
        limits = {k: v for k, v in (limits or get_max_memory()).items() if str(k) in ("cpu", "disk")}
    max_memory = None if limits is None else {int(k) if str(k).isdigit() else k: v for k, v in limits.items()}
    return {"device_map": spec.device_map, "max_memory": max_memory, "offload_folder": str(offload)}


def _device_name(where: Any) -> str:
    return f"cuda:{where}" if isinstance(where, int) else str(where)


def placed_bytes(model: PreTrainedModel) -> dict[str, int]:
    """Weight bytes per device as accelerate placed `model` (its `hf_device_map`; a tied weight once)."""
    placed: dict[str, int] = {}
    seen: set[int] = set()
    for name, where in model.hf_device_map.items():
        module = model.get_submodule(name) if name else model
        fresh = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        device = _device_name(where)
        placed[device] = placed.get(device, 0) + sum(p.numel() * p.element_size() for p in fresh)
    return placed


def execution_device(model: PreTrainedModel) -> torch.device:
    """Where a placed model takes its inputs: its first accelerator, else the host (accelerate's
    hooks bring host- and disk-held weights there when their module runs)."""
    for where in model.hf_device_map.values():
        if _device_name(where) not in ("cpu", "disk"):
            return torch.device(_device_name(where))
    return torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    """Where accelerate may put a placed model beside the GPUs and host memory (`placement_options`)."""

    offload: Path
    """The folder its offloaded weights are written to, removed when it is done."""
    device: torch.device
    """The run's device: a run on the CPU keeps its models off any GPU."""


def placed_task_scores(
    spec: ModelSpec,
    evaluation: EvaluationSpec,
    tokenizer: Any,
    seed: int,
    placement: Placement,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[dict[str, Any], dict[str, int]]:
    """lm-eval scores of the model `spec` names, placed by accelerate (`Placement`), and where its
    weights went (`placed_bytes`); its offloaded weights are removed when it is done."""
    assert evaluation.lm_eval
    offload = placement.offload
    model = load_model(replaced(spec, load="memory"), placement_options(evaluation, offload, placement.device))
    try:
        placed = placed_bytes(model)
        scores = task_scores(model, tokenizer, evaluation.lm_eval, execution_device(model), seed, progress)
    finally:
        del model
        gc.collect()
        shutil.rmtree(offload, ignore_errors=True)
    return scores, placed
