"""The sliced model written while the walk goes: each layer's tensors go to the output's shards as
soon as its last site is closed, and the layer leaves memory.

The walk knows every site's width before it starts, so the sliced model's shell (`bases.sliced_shell`,
on the meta device) gives every tensor's name, shape and dtype, and the shards are laid out then
(`engine.shards`). A finished layer is written and put on the meta device; the embedding, the final
norm and the head, which stay resident, are written at the end, then the config, then the index.
With a checkpoint, what was written is recorded there: a killed walk replays its finished sites
(forward only) and writes only the layers not yet committed. The walk returns the sliced model as
a streamed model over the written folder (`engine.streaming`), so evaluation reads it layer by layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from compressor import faults
from compressor.engine.bases import as_sliced_model, sliced_shell
from compressor.engine.shards import ShardWriter
from compressor.engine.streaming import attach_streamed
from compressor.models.families import ModelFamily


def saved_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """What `save_pretrained` writes of `model`: its state, a tied weight once (under its first name)."""
    unique = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return {name: tensor for name, tensor in model.state_dict().items() if name in unique}


class WrittenModel:
    """The shards of the sliced model `slicing` makes of `model`, in `folder`, written layer by
    layer. `progress`: the checkpoint's record of what was written (None: nothing resumes);
    `writes=False` (a data-parallel rank other than the first): layers are dropped, not written."""

    def __init__(
        self,
        folder: Path,
        model: PreTrainedModel,
        family: ModelFamily,
        slicing: dict[str, Any],
        *,
        progress: Path | None = None,
        max_shard_size: int | str = "50GB",
        writes: bool = True,
    ) -> None:
        self.folder, self.family, self.slicing = folder, family, slicing
        shell = sliced_shell(model, family, slicing)
        self.writer = (
            ShardWriter(folder, saved_tensors(shell), progress=progress, max_shard_size=max_shard_size)
            if writes
            else None
        )
        layers = model.config.num_hidden_layers
        self.written_before = sum(not self._missing(index) for index in range(layers)) if writes else 0
        """Layers a killed walk had written and committed: replayed, not written again."""

    def _prefix(self, index: int) -> str:
        return f"{self.family.layers}.{index}."

    def write_layer(self, index: int, layer: nn.Module) -> None:
        """Write the finished layer (unless an earlier, killed walk did) and drop it to the meta device."""
        missing = self._missing(index)
        if missing:
            assert self.writer is not None
            prefix = self._prefix(index)
            state = {prefix + name: tensor for name, tensor in layer.state_dict().items()}
            self.writer.write({name: state[name] for name in missing})
            faults.reached(f"writing:{index}")  # its bytes in the shard, not yet committed
            self.writer.commit()
            faults.reached(f"written:{index}")
        layer.to("meta")

    def _missing(self, index: int) -> list[str]:
        """The layer's planned tensors not yet written (none where this process writes nothing)."""
        if self.writer is None:
            return []
        prefix = self._prefix(index)
        return self.writer.missing(name for name in self.writer.planned if name.startswith(prefix))

    def finish(self, model: PreTrainedModel) -> PreTrainedModel:
        """Write what is left (embedding, final norm, head), the config and the index; return the
        sliced model, its layers streamed from the written shards."""
        sliced = as_sliced_model(model, self.family, self.slicing)
        if self.writer is not None:
            state = sliced.state_dict()
            self.writer.write({name: state[name] for name in self.writer.missing()})
            self.writer.finish()
            sliced.config.save_pretrained(self.folder)
            if sliced.can_generate():
                sliced.generation_config.save_pretrained(self.folder)
            attach_streamed(sliced, self.folder, self.family, sliced.dtype)
        return sliced
