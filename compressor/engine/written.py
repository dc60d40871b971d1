"""The sliced model written while the walk goes: each layer's tensors go to the output's shards as
soon as its last site is closed, and the layer leaves memory.

The walk knows every site's width before it starts, so the sliced model's shell (`bases.sliced_shell`,
on the meta device) gives every tensor's name, shape and dtype, and the shards are laid out then
(`engine.shards`). A finished layer is written and put on the meta device; the embedding, the final
norm and the head, which stay resident, are written at the end, then the config, then the index.
With a checkpoint, what was written is recorded there: a killed walk replays its finished sites
(forward only) and writes only the layers not yet committed. The walk returns the sliced model as
a streamed model over the written folder (`engine.streaming`), so evaluation reads it layer by layer.

A walk with one basis (the global layout) is written as the original class at the kept width
(`models.stock`): each layer as the sliced walk leaves it, with its norms' stock weights; the
embedding, the final norm (a tied head's diagonal fitted on the final stream, `stock.tied_scale`)
and the head at the end, as `stock.save_stock` writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from compressor import faults
from compressor.engine.bases import as_sliced_model, sliced_shell
from compressor.engine.shards import ShardWriter
from compressor.engine.streaming import attach_streamed, streamed_model
from compressor.models.families import ModelFamily
from compressor.models.stock import stock_layer, stock_model_config, stock_record, stock_shell, stock_state


def saved_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """What `save_pretrained` writes of `model`: its state, a tied weight once (under its first name)."""
    unique = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return {name: tensor for name, tensor in model.state_dict().items() if name in unique}


@dataclass(frozen=True)
class StockTarget:
    """Write the walk's model as the original class (`models.stock`): the original's config, and
    whether the head stays tied (its final norm's diagonal fitted when the walk ends)."""

    original: PretrainedConfig
    tie: bool


@dataclass(frozen=True)
class WriteOptions:
    """How the walk's model is written, beside what it is: the checkpoint's record of what was
    written (None: nothing resumes), the shards' size, whether this process writes (a
    data-parallel rank other than the first drops its layers) and the stock class to write it as."""

    progress: Path | None = None
    max_shard_size: int | str = "50GB"
    writes: bool = True
    stock: StockTarget | None = None


class WrittenModel:
    """The shards of the sliced model `slicing` makes of `model`, in `folder`, written layer by
    layer, as `options` says (`WriteOptions`: by default nothing resumes, every layer is written,
    as the `sliced_*` model)."""

    def __init__(
        self,
        folder: Path,
        model: PreTrainedModel,
        family: ModelFamily,
        slicing: dict[str, Any],
        options: WriteOptions | None = None,
    ) -> None:
        options = options or WriteOptions()
        stock, writes = options.stock, options.writes
        self.folder, self.family, self.slicing, self.stock = folder, family, slicing, stock
        self.dtype = model.get_submodule(family.embedding).weight.dtype
        shell = sliced_shell(model, family, slicing)
        if stock is not None:  # the original class at the kept width, on the meta device
            shell = stock_shell(stock_model_config(shell, family, stock.original, stock.tie)).to(self.dtype)
        self.shell = shell
        """What is written (on the meta device): the `sliced_*` model, or the stock one."""
        self.record: dict[str, Any] | None = None
        """The stock conversion's record (`stock.stock_record`), once `finish` has written it."""
        self.writer = (
            ShardWriter(folder, saved_tensors(shell), progress=options.progress, max_shard_size=options.max_shard_size)
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
            if self.stock is not None:
                d, k = self.slicing["hidden_size"], self.slicing["embedding"]
                state.update(stock_layer(self.family, index, layer, d, k))
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

    def finish(self, model: PreTrainedModel, stream: torch.Tensor | None = None) -> PreTrainedModel:
        """Write what is left (embedding, final norm, head), the config and the index; return the
        model, its layers streamed from the written shards. `stream`: the final stream's second
        moment in kept coordinates, which a stock tied head's diagonal is fitted on."""
        sliced = as_sliced_model(model, self.family, self.slicing)
        if self.writer is None:
            return sliced
        if self.stock is None:
            state = sliced.state_dict()
            self.writer.write({name: state[name] for name in self.writer.missing()})
            self.writer.finish()
            sliced.config.save_pretrained(self.folder)
            if sliced.can_generate():
                sliced.generation_config.save_pretrained(self.folder)
            attach_streamed(sliced, self.folder, self.family, sliced.dtype)
            return sliced
        state, record = stock_state(sliced, self.family, self.stock.tie, stream)
        self.writer.write({name: state[name] for name in self.writer.missing()})
        self.writer.finish()
        shell = self.shell
        self.record = stock_record(record, shell.config, self.family)
        shell.config.dtype = str(self.dtype).removeprefix("torch.")  # what `save_pretrained` records of
        shell.config.architectures = [type(shell).__name__]  # the model it saves, whatever the config said
        shell.config.save_pretrained(self.folder)
        if shell.can_generate():
            sliced.generation_config.save_pretrained(self.folder)
        attention = model.config._attn_implementation
        return streamed_model(self.folder, self.family, self.dtype, attn_implementation=attention)
