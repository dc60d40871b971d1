"""Perplexity and KL(original ‖ pruned) computed layer by layer, for a run whose original is
streamed (`model.load: stream`): the original is never whole in memory. Each model's final
stream is computed with `engine.layerwise.final_streams` (the original's layers read from the
shards one at a time, fused as the walk sees them), then each batch's logits from its head,
and the figures summed as `evaluation.metrics.compare` sums them (`Tally`). The fused original
computes the original's function to float round-off, so the figures equal the whole-model ones
to that precision."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from compressor.data.batches import Batch
from compressor.engine.layerwise import final_streams
from compressor.engine.transforms import fuse_norms
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
    """`compare`'s figures, with `original` (a streamed shell, or any unfused model: it is fused
    here, in place) and `pruned` run layer by layer."""
    fuse_norms(original, family)
    streams = {
        "baseline": final_streams(original, family, batches, device),
        "pruned": final_streams(pruned, family, batches, device),
    }
    tally = Tally()
    for index, batch in enumerate(batches):
        reference, candidate = (
            log_probs_of(family.logits(model, streams[name][index].to(device)))
            for name, model in (("baseline", original), ("pruned", pruned))
        )
        tally.add(reference, candidate, batch, device)
        if progress:
            progress(index + 1, len(batches))
    return tally.result(True)
