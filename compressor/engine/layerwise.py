"""The one way a pass goes through a model layer by layer: each decoder layer visits the device
while the pass works on it, then goes home.

Every layer-by-layer pass uses `visit_layers`: the walk and the survey (`engine.walk`), the H pass
going down and coming back up (`engine.fisher`), rebuilding a model from its bases
(`engine.bases.apply_bases`) and a cached teacher's targets (`training.distill`). So a layer's
weights reach the device in one place, and that is where weights streamed from disk attach: a pass
asks for layer i when it gets there, and a streamed model (`engine.streaming`) reads it from its
shards then, and gives it back after a pass that only ran it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from compressor.engine.activations import held_on
from compressor.engine.streaming import streamed
from compressor.models.families import ModelFamily


def decoder_layers(model: PreTrainedModel, family: ModelFamily) -> nn.ModuleList:
    return model.get_submodule(family.layers)


def visit_layers(
    model: PreTrainedModel,
    family: ModelFamily,
    device: torch.device,
    *,
    read_only: bool = False,
    reverse: bool = False,
) -> Iterator[tuple[int, nn.Module]]:
    """(index, layer) for every decoder layer, in stream order (`reverse`: last first), each on
    `device` while the caller holds it and back where it was after (`read_only`: the layer is
    only run, so its own host tensors come back and nothing is copied off the device)."""
    layers = decoder_layers(model, family)
    source = streamed(model)
    order = range(len(layers) - 1, -1, -1) if reverse else range(len(layers))
    for index in order:
        read = source is not None and source.materialise(model, index)
        with held_on([layers[index]], device, read_only=read_only):
            yield index, layers[index]
        if read and read_only:
            source.give_back(model, index)
        elif read:
            source.keep(index)
