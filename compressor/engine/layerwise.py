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

import ctypes
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore, held_on, to_host
from compressor.engine.calibration import capture_layer_inputs
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
        try:
            with held_on([layers[index]], device, read_only=read_only):
                yield index, layers[index]
        finally:  # also when the pass raises or stops early: a read layer never stays behind
            if read and read_only:
                source.give_back(model, index)
            elif read:
                source.keep(index)
            if source is not None:
                return_freed_memory()


def return_freed_memory() -> None:
    """Give the heap's free pages back to the operating system (glibc's `malloc_trim`), so a
    streamed pass's resident memory is what it holds, not the most it ever held. A no-op where
    the C library has no such call."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


@torch.no_grad()
def final_streams(
    model: PreTrainedModel, family: ModelFamily, batches: list[Batch], device: torch.device
) -> list[torch.Tensor]:
    """Each batch's stream after the last decoder layer, on the host, computed layer by layer: the
    model's own layers with the arguments its forward gives them (`capture_layer_inputs`), so a
    streamed model holds one layer at a time. The head is the caller's (`family.logits`)."""
    store = ActivationStore(device)
    inputs = capture_layer_inputs(model, family, batches, device, store)
    for index, layer in visit_layers(model, family, device, read_only=True):
        for batch in range(len(batches)):
            out = layer(store.get(batch, device), **inputs.kwargs(batch, index, device))
            store.put(batch, to_host(out[0] if isinstance(out, tuple) else out))
    return [store.host(batch) for batch in range(len(batches))]
