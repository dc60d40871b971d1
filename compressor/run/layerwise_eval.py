"""Perplexity and KL(original ‖ pruned) computed layer by layer, for a run whose original is
streamed (`model.load: stream`): the original is never whole in memory. Each model's final
stream is computed with `engine.layerwise.final_streams` (its own layers, unfused, with the
arguments its forward gives them; the original's read from the shards one at a time), then each
batch's logits from its own head, and the figures summed as `evaluation.metrics.compare` sums
them (`Tally`): the same operations on the same tensors as the whole-model evaluation."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from compressor.data.batches import Batch
from compressor.engine.activations import held_on
from compressor.engine.layerwise import final_streams
from compressor.evaluation.metrics import Tally, log_probs_of
from compressor.models.families import ModelFamily
from compressor.recipe.schema import Recipe


def evaluates_layer_by_layer(recipe: Recipe) -> bool:
    """A streamed run evaluates perplexity and KL layer by layer, the original never whole in
    memory, unless lm-eval tasks or throughput need it whole."""
    spec = recipe.evaluation
    return recipe.model.load == "stream" and spec is not None and not spec.lm_eval and not spec.throughput


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
