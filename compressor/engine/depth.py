"""What each decoder block does to the stream, for choosing blocks to remove (the depth axis,
issue 49; `models.depth` removes them): ShortGPT's block influence, 1 − cos(x_in, x_out) of a
block's input and output stream, the mean over the counted calibration tokens. A block whose output
is nearly its input (influence near 0) changes least by going.

Layers are visited one at a time on the stored stream (`engine.layerwise`), as the other passes do,
so the model never needs to fit on the device whole.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import PreTrainedModel

from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore
from compressor.engine.calibration import capture_layer_inputs, counted_rows
from compressor.engine.layerwise import visit_layers
from compressor.models.families import ModelFamily


@torch.no_grad()
def block_influence(
    model: PreTrainedModel,
    family: ModelFamily,
    batches: list[Batch],
    device: torch.device | str = "cpu",
    store: ActivationStore | None = None,
) -> list[float]:
    """Every decoder block's influence 1 − cos(x_in, x_out) (see the module docstring), in order."""
    device = torch.device(device)
    model.eval()
    inputs = capture_layer_inputs(model, family, batches, device, store or ActivationStore(device))
    scores: list[float] = []
    try:
        for index, layer in visit_layers(model, family, device, read_only=True):
            total, count = 0.0, 0
            for b in range(len(inputs)):
                x = inputs.hidden.get(b, device)
                out = layer(x, **inputs.kwargs(b, index, device))
                y = out[0] if isinstance(out, tuple) else out
                mask, counted = inputs.token_masks[b].to(device), inputs.token_counts[b]
                cos = F.cosine_similarity(
                    counted_rows(x, mask, counted).double(), counted_rows(y, mask, counted).double(), dim=-1
                )
                total += float((1 - cos).sum())
                count += cos.shape[0]
                inputs.hidden.put(b, y)
            scores.append(total / max(count, 1))
    finally:
        inputs.hidden.close()
    return scores
