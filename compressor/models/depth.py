"""Whole decoder blocks removed (the depth axis, issue 49): the model without them, in place, and the
config its own class reloads it from, with every per-layer setting trimmed to the blocks kept;
`skipping` computes the same model without changing it, to measure a removal before choosing it.

A block reads the stream and adds to it, so removing block i leaves the model that skips it: the
next block reads what block i read. Nothing is refitted here; which blocks go is a selector's
choice. The config keeps the family's class: `num_hidden_layers` is the blocks kept, per-layer
lists (`layer_types`, SmolLM3's `no_rope_layers`) keep the kept blocks' entries, and lists of
layer indices (Qwen-MoE's `mlp_only_layers`) are renumbered; a sparse-step pattern
(`decoder_sparse_step`) that the kept blocks no longer follow is written out as `mlp_only_layers`.
A config with another list of one entry per layer is refused: its meaning is unknown here, and a
silently untrimmed list would load a different model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from transformers import PretrainedConfig

from compressor.errors import UserError
from compressor.models.families import ModelFamily

PER_LAYER = ("layer_types", "no_rope_layers")
"""Config lists with one entry per decoder block, in order."""
LAYER_INDICES = ("mlp_only_layers",)
"""Config lists of decoder-block indices."""


def kept_blocks(config: PretrainedConfig, removed: Iterable[int]) -> list[int]:
    """The blocks left when `removed` go, ascending; refused where an index is out of range or
    every block would go."""
    layers = int(config.num_hidden_layers)
    gone = sorted({int(i) for i in removed})
    outside = [i for i in gone if not 0 <= i < layers]
    if outside:
        raise UserError(f"depth: block {outside[0]} is not among the {layers} blocks (0 to {layers - 1})")
    kept = [i for i in range(layers) if i not in gone]
    if not kept:
        raise UserError(f"depth: removing all {layers} blocks leaves no model; remove fewer")
    return kept


def depth_config(config: PretrainedConfig, removed: Iterable[int]) -> PretrainedConfig:
    """A copy of `config` for the model without the blocks `removed` (see the module docstring)."""
    kept = kept_blocks(config, removed)
    layers = int(config.num_hidden_layers)
    unknown = [
        key
        for key, value in config.to_dict().items()
        if isinstance(value, list) and len(value) == layers and key not in PER_LAYER + LAYER_INDICES
    ]
    if unknown:
        raise UserError(
            f"depth: {config.model_type} configs have {', '.join(unknown)}, a list of one entry per block "
            f"that this version does not know how to trim; keep every block (remove depth)"
        )
    changed = copy.deepcopy(config)
    dense = _dense_blocks(config)
    changed.num_hidden_layers = len(kept)
    for key in PER_LAYER:
        value = getattr(config, key, None)
        if isinstance(value, list):
            setattr(changed, key, [value[i] for i in kept])
    if dense is not None:  # the dense blocks among the kept ones, written out
        changed.mlp_only_layers = [new for new, old in enumerate(kept) if old in dense]
        changed.decoder_sparse_step = 1
    return changed


def _dense_blocks(config: PretrainedConfig) -> set[int] | None:
    """Qwen-MoE's blocks whose MLP is dense (in `mlp_only_layers`, or off the `decoder_sparse_step`
    pattern); None for a config without the two keys."""
    step = getattr(config, "decoder_sparse_step", None)
    listed = getattr(config, "mlp_only_layers", None)
    if step is None and listed is None:
        return None
    experts = int(getattr(config, "num_experts", 0) or 0)
    step = int(step or 1)
    return {
        i
        for i in range(int(config.num_hidden_layers))
        if i in (listed or []) or not (experts > 0 and (i + 1) % step == 0)
    }


def remove_blocks(model: nn.Module, family: ModelFamily, removed: Iterable[int]) -> list[int]:
    """Remove the decoder blocks `removed` from `model`, in place: its layer list keeps the others,
    every module that knows its block's index (`layer_idx`, which the KV cache reads) is renumbered,
    and its config says what `depth_config` says. Returns the kept blocks' original indices."""
    config = model.config
    removed = list(removed)
    new_config = depth_config(config, removed)
    kept = kept_blocks(config, removed)
    layers = model.get_submodule(family.layers)
    kept_layers = nn.ModuleList(layers[i] for i in kept)
    for new, layer in enumerate(kept_layers):
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new
    parent, _, name = family.layers.rpartition(".")
    model.get_submodule(parent).register_module(name, kept_layers)
    config.num_hidden_layers = new_config.num_hidden_layers  # the model's own config, which its modules share
    for key in ("decoder_sparse_step", *PER_LAYER, *LAYER_INDICES):
        if getattr(new_config, key, None) is not None:
            setattr(config, key, getattr(new_config, key))
    return kept


@contextmanager
def skipping(model: nn.Module, family: ModelFamily, blocks: Iterable[int]) -> Iterator[None]:
    """Within the block, `model` computes as if the decoder blocks `blocks` were removed: each
    hands on the stream it read (what `remove_blocks` makes of it, without changing the model;
    for measuring a removal before choosing it, with no cache)."""
    layers = model.get_submodule(family.layers)
    handles = [layers[i].register_forward_hook(_hand_on_input, with_kwargs=True) for i in sorted(set(blocks))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _hand_on_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """A forward hook: the block's output replaced by its input stream."""
    hidden = args[0] if args else kwargs["hidden_states"]
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
