"""Weights streamed from a model's safetensors shards: the model is a shell on the meta device, and
each decoder layer is read from disk (`safe_open`, tensor by tensor) only when a pass reaches it.

`streamed_model(folder, dtype)` builds the shell: every parameter outside the decoder layers (the
embedding, the final norm, the head) is read at once and stays; the layers stay on the meta device,
their buffers real. `fuse_norms` then runs as on any model (on the meta layers it is shapes only).
`visit_layers` asks the model's `StreamedWeights` for layer i when a pass gets there: it reads the
layer's raw tensors, fuses its norms exactly as `fuse_norms` did for an in-memory model (the same
float64 products on the same tensors, so the result is bit-identical), and puts it in place. A pass
that only runs the layer (the H pass, a survey) gives it back afterwards, and it returns to the
meta device; a pass that changes it (the walk) keeps it. Reads are counted per tensor (`reads`).
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from compressor.errors import UserError
from compressor.models.families import ModelFamily

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_ATTRIBUTE = "_compressor_streamed"


class ShardIndex:
    """Which shard holds each tensor of a safetensors checkpoint (its index, or its one file)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (folder / SINGLE_FILE).is_file():
            with safe_open(str(folder / SINGLE_FILE), framework="pt") as shard:
                weight_map = {name: SINGLE_FILE for name in shard.keys()}  # noqa: SIM118 (not a dict)
        else:
            raise UserError(
                f"model folder '{folder}' has no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}): streaming "
                f"reads safetensors shards; save the model with save_pretrained, or set model.load: memory"
            )
        missing = sorted({file for file in weight_map.values() if not (folder / file).is_file()})
        if missing:
            raise UserError(f"model folder '{folder}' lacks the shard(s) its index names: {', '.join(missing)}")
        self.weight_map = weight_map
        self._handles: dict[str, tuple[Any, set[str]]] = {}
        """Open shards, each with the names it holds."""

    def read(self, name: str) -> torch.Tensor:
        """One tensor, copied out of its shard. An open shard stays mapped (the pages read count in
        the resident set) until `close`: a layer's reader closes it after each tensor."""
        file = self.weight_map.get(name)
        if file is None:
            raise UserError(f"model folder '{self.folder}' has no tensor '{name}' in its safetensors index")
        if file not in self._handles:
            handle = safe_open(str(self.folder / file), framework="pt", device="cpu")
            self._handles[file] = handle, set(handle.keys())
        handle, names = self._handles[file]
        if name not in names:
            raise UserError(
                f"shard '{file}' of model folder '{self.folder}' lacks tensor '{name}' that its index names"
            )
        return handle.get_tensor(name)

    def close(self) -> None:
        """Unmap every open shard."""
        self._handles.clear()


class StreamedWeights:
    """A streamed model's decoder layers: read, fused and put in place when a pass reaches them."""

    def __init__(self, index: ShardIndex, family: ModelFamily, raw_layers: list[nn.Module], dtype: torch.dtype) -> None:
        self.index, self.family, self.dtype = index, family, dtype
        self.raw_layers = raw_layers
        """Each layer as the config builds it, unfused, on the meta device: what a read fills."""
        self.shells: dict[int, nn.Module] = {}
        """The fused layer on the meta device, put back when a read-only pass is done with it."""
        self.reads: Counter[str] = Counter()
        self.resident = 0
        self.peak_resident = 0
        """Layers read and not yet given back by read-only passes, and the most at once."""

    def materialise(self, model: PreTrainedModel, index: int) -> bool:
        """Put layer `index` in place, read from the shards (and fused, when the model's norms were:
        `fuse_norms` wrapped its shell); False when it already is."""
        from compressor.engine.transforms import fuse_layer

        layers = model.get_submodule(self.family.layers)
        if not any(p.is_meta for p in layers[index].parameters()):
            return False
        self.shells[index] = layers[index]
        raw = copy.deepcopy(self.raw_layers[index])
        prefix = f"{self.family.layers}.{index}."
        for name, _ in list(raw.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            module = raw.get_submodule(owner) if owner else raw
            tensor = self.index.read(prefix + name).to(self.dtype)
            self.index.close()  # unmapped after each tensor: the pages read do not add up to a layer
            self.reads[prefix + name] += 1
            module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        fused = not isinstance(layers[index], type(raw))  # the shell went through fuse_norms
        layers[index] = fuse_layer(raw, self.family, model.config.hidden_size) if fused else raw
        self.resident += 1
        self.peak_resident = max(self.peak_resident, self.resident)
        return True

    def give_back(self, model: PreTrainedModel, index: int) -> None:
        """A read-only pass is done with layer `index`: back to the meta device."""
        model.get_submodule(self.family.layers)[index] = self.shells.pop(index)
        self.resident -= 1

    def keep(self, index: int) -> None:
        """A pass changed layer `index`: it stays (its meta shell is dropped)."""
        self.shells.pop(index, None)
        self.resident -= 1


def streamed(model: nn.Module) -> StreamedWeights | None:
    """The model's streamed weights, or None for a model held in memory."""
    return getattr(model, _ATTRIBUTE, None)


def cannot_stream(family: ModelFamily) -> str | None:
    """Why a model of `family` cannot be streamed layer by layer (None: it can)."""
    if family.prepare is None:
        return None
    return (
        f"model family '{family.name}' rewrites its modules before fusion ({family.prepare.__name__}), which "
        f"streaming does not do layer by layer yet: set model.load: memory"
    )


def streamed_model(
    folder: str | Path,
    family: ModelFamily,
    dtype: torch.dtype,
    config: PretrainedConfig | None = None,
    **options: Any,
) -> PreTrainedModel:
    """The model of `folder` (safetensors) as a shell: everything but its decoder layers read now,
    the layers on the meta device until a pass reaches them. `config`: the folder's, when the
    caller has read it already; `options` go to `from_config`."""
    from accelerate import init_empty_weights

    folder = Path(folder)
    reason = cannot_stream(family)
    if reason is not None:
        raise UserError(reason)
    index = ShardIndex(folder)
    config = config if config is not None else AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **options)
    model.eval().requires_grad_(False)
    prefix = f"{family.layers}."
    for name, _param in list(model.named_parameters(remove_duplicate=False)):
        if name.startswith(prefix):
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if name in index.weight_map:
            module._parameters[leaf] = nn.Parameter(index.read(name).to(dtype), requires_grad=False)
        elif not getattr(config, "tie_word_embeddings", False):
            raise UserError(f"model folder '{folder}' has no tensor '{name}' in its safetensors weights")
    index.close()
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    attach_streamed(model, index, family, dtype)
    return model


def attach_streamed(
    model: PreTrainedModel, source: ShardIndex | str | Path, family: ModelFamily, dtype: torch.dtype
) -> None:
    """From now on `model`'s decoder layers (on the meta device) are read from `source`'s shards
    when a pass reaches them: an original's shell, or a sliced model written as its walk went."""
    index = source if isinstance(source, ShardIndex) else ShardIndex(Path(source))
    layers = model.get_submodule(family.layers)
    setattr(model, _ATTRIBUTE, StreamedWeights(index, family, [copy.deepcopy(layer) for layer in layers], dtype))
