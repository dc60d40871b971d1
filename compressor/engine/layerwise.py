"""The one way a pass goes through a model layer by layer: each decoder layer visits the device
while the pass works on it, then goes home.

Every layer-by-layer pass uses `visit_layers`: the walk and the survey (`engine.walk`), the H pass
going down and coming back up (`engine.fisher`), rebuilding a model from its bases
(`engine.bases.apply_bases`) and a cached teacher's targets (`training.distill`). So a layer's
weights reach the device in one place, and that is where weights streamed from disk will attach:
a pass asks for layer i when it gets there, and whatever holds the weights (host memory today)
provides them. `run_stored` is the step most passes take on a visiting layer: every stored batch
of activations through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from compressor.engine.activations import ActivationStore, held_on
from compressor.models.families import ModelFamily

Progress = Callable[[int, int], None]
"""Called as (layers done, layers in total) before each layer is visited."""


def decoder_layers(model: PreTrainedModel, family: ModelFamily) -> nn.ModuleList:
    return model.get_submodule(family.layers)


def visit_layers(
    model: PreTrainedModel,
    family: ModelFamily,
    device: torch.device,
    *,
    read_only: bool = False,
    reverse: bool = False,
    progress: Progress | None = None,
) -> Iterator[tuple[int, nn.Module]]:
    """(index, layer) for every decoder layer, in stream order (`reverse`: last first), each on
    `device` while the caller holds it and back where it was after (`read_only`: the layer is
    only run, so its own host tensors come back and nothing is copied off the device)."""
    layers = decoder_layers(model, family)
    order = range(len(layers) - 1, -1, -1) if reverse else range(len(layers))
    for done, index in enumerate(order):
        if progress is not None:
            progress(done, len(layers))
        with held_on([layers[index]], device, read_only=read_only):
            yield index, layers[index]


def run_stored(store: ActivationStore, device: torch.device, step: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
    """Every stored batch b through `step(b, hidden)` on `device`, its result stored in its place."""
    for b in range(len(store)):
        store.put(b, step(b, store.get(b, device)))
