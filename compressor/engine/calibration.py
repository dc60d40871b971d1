"""Calibration plumbing: capture what every decoder layer receives, accumulate C = E[x xᵀ].

Captured inputs are kept off the device (`ActivationStore`): hidden states, masks and the
layers' keyword arguments go to the device one batch at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore, held_on, to_device
from compressor.engine.parallel import Ranks
from compressor.models.families import ModelFamily


@dataclass
class LayerInputs:
    """Per batch, on the host: the first layer's hidden states, each layer's keyword arguments
    (masks and position embeddings may differ between layers), the mask of real tokens
    and the mask of tokens counted for sensitivity statistics."""

    hidden: ActivationStore
    layer_kwargs: list[list[dict[str, Any]]]
    token_masks: list[torch.Tensor]
    sensitivity_masks: list[torch.Tensor]
    token_counts: list[int] = field(default_factory=list)
    sensitivity_counts: list[int] = field(default_factory=list)
    """How many positions each mask counts, read once on the host (so no device sync, and no
    data-dependent shape where every position counts)."""

    def __len__(self) -> int:
        return len(self.token_masks)

    def kwargs(self, batch: int, layer: int, device: torch.device) -> dict[str, Any]:
        """Layer `layer`'s keyword arguments for batch `batch`, on `device`."""
        return to_device(self.layer_kwargs[batch][layer], device)

    def output(self, layer: nn.Module, batch: int, index: int, device: torch.device) -> torch.Tensor:
        """Decoder layer `index`'s output stream on batch `batch` (its hidden states, not a cache)."""
        out = layer(self.hidden.get(batch, device), **self.kwargs(batch, index, device))
        return out[0] if isinstance(out, tuple) else out

    def advance(self, layer: nn.Module, index: int, device: torch.device) -> None:
        """Replace every stored batch by decoder layer `index`'s output on it: the next layer's input."""
        for batch in range(len(self)):
            self.hidden.put(batch, self.output(layer, batch, index, device))


class _Recorder(nn.Module):
    """Stands in for a decoder layer: records its arguments and passes the stream through."""

    def __init__(self, sink: list[tuple[torch.Tensor, dict[str, Any]]], positional_args: tuple[str, ...]) -> None:
        super().__init__()
        self.sink = sink
        self.positional_args = positional_args

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.sink.append((hidden_states, {**dict(zip(self.positional_args, args)), **kwargs}))
        return hidden_states


_DROPPED_KWARGS = ("cache", "past_key_values", "use_cache")


@torch.no_grad()
def capture_layer_inputs(
    model: PreTrainedModel,
    family: ModelFamily,
    batches: list[Batch],
    device: torch.device,
    store: ActivationStore | None = None,
) -> LayerInputs:
    """Run the model's own forward with every layer replaced by a recorder.

    This costs one embedding lookup per batch and captures exactly the arguments the model
    would pass to each layer (`use_cache=False`), whatever mask or rotary scheme it uses. The
    parts before the first layer run on `device` and go back where they were; what is captured
    goes to `store` (default: held in host memory).
    """
    base = model.get_submodule(family.base_model)
    layers: nn.ModuleList = model.get_submodule(family.layers)
    parts = [child for child in base.children() if child is not layers]
    originals = list(layers)
    sink: list[tuple[torch.Tensor, dict[str, Any]]] = []
    host = torch.device("cpu")
    captured = LayerInputs(
        hidden=store if store is not None else ActivationStore(device),
        layer_kwargs=[],
        token_masks=[],
        sensitivity_masks=[],
    )
    try:
        for index in range(len(originals)):
            layers[index] = _Recorder(sink, family.positional_args)
        with held_on(parts, device, read_only=True):
            for batch in batches:
                sink.clear()
                mask = batch.attention_mask.to(device)
                base(input_ids=batch.input_ids.to(device), attention_mask=mask, use_cache=False)
                captured.hidden.append(sink[0][0])
                memo: dict[int, Any] = {}  # layers share their masks and position embeddings: one host copy each
                captured.layer_kwargs.append(
                    [
                        to_device({k: v for k, v in kwargs.items() if k not in _DROPPED_KWARGS}, host, memo)
                        for _, kwargs in sink
                    ]
                )
                real = batch.attention_mask.bool()
                captured.token_masks.append(real)
                counted = batch.attention_mask if batch.sensitivity_mask is None else batch.sensitivity_mask
                captured.sensitivity_masks.append(counted.bool() & real)
                captured.token_counts.append(int(real.sum()))
                captured.sensitivity_counts.append(int(captured.sensitivity_masks[-1].sum()))
    finally:
        for index, layer in enumerate(originals):
            layers[index] = layer
    return captured


def counted_rows(hidden: torch.Tensor, mask: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """The positions of `hidden` (…, d) that `mask` counts, as (count, d). Where `count` says
    every position counts (text windows), a reshape: the same rows, without a gather."""
    if count is not None and count == mask.numel():
        return hidden.reshape(-1, hidden.shape[-1])
    return hidden[mask.to(hidden.device)]


class SecondMoment:
    """Running E[x xᵀ] over the real (unmasked) tokens, accumulated in float64."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.total = torch.zeros(width, width, dtype=torch.float64, device=device)
        self.tokens = 0
        self._mean: torch.Tensor | None = None

    def add(self, hidden: torch.Tensor, token_mask: torch.Tensor, count: int | None = None) -> None:
        if self._mean is not None:
            raise RuntimeError("a second moment cannot grow after its value was taken")
        x = counted_rows(hidden, token_mask, count).to(torch.float64)
        self.total.addmm_(x.T, x)
        self.tokens += x.shape[0]

    def sum_over(self, ranks: Ranks) -> SecondMoment:
        """The sum and count over every rank's batches (data-parallel calibration), in place."""
        ranks.sum_(self.total)
        self.tokens = ranks.sum_count(self.tokens, self.total.device)
        return self

    def value(self) -> torch.Tensor:
        """The sum over the token count, divided in place the first time: a d × d float64 matrix
        fewer while a basis is chosen from it (callers read it, never change it)."""
        if self._mean is None:
            if self.tokens == 0:
                raise ValueError("no calibration tokens were counted (all positions masked)")
            self._mean = self.total.div_(self.tokens)
        return self._mean


@dataclass(frozen=True)
class LayerPass:
    """One decoder layer as a layer-by-layer pass reaches it: what the per-layer helpers of the
    MLP and expert axes share, in place of the same six arguments to each."""

    layer: nn.Module
    family: ModelFamily
    inputs: LayerInputs
    """The stored batches the layer runs on (its input, as the layers before it left the stream)."""
    index: int
    device: torch.device
    ranks: Ranks
    """The data-parallel group its statistics are summed over."""
    G: torch.Tensor | None = None
    """H of the stream the layer's block writes to, where the pass weighs by it."""
