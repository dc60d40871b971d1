"""Output-sensitivity statistics: H = E[g gᵀ], the Fisher of the output KL with respect to the
residual activation at every pruning site, from labels sampled from the model itself.

For each calibration batch: one forward pass of the (fused, still unsliced) model, one label
sampled per counted position from the model's own predictive distribution, the sampled
log-probabilities summed (or averaged) over the counted positions, and **one** backward pass.
The gradient at token i then sums the score of every later output it influences; since the
labels are independent given the input, E[g gᵀ] is exactly the Fisher of the joint output
distribution with respect to x_i (cross terms vanish in expectation). No parameter gradient is
kept: weights are frozen and only the first layer's input requires a gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from compressor.calibration import LayerInputs
from compressor.families import ModelFamily, optional_module

REDUCTIONS = ("sum", "mean")
ACCUMULATION_DTYPES = ("float32", "float64")
AUTOCAST_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class SensitivityOptions:
    """How H is estimated. `dtype` is the accumulation precision (the paper: float32);
    `autocast`, if set, runs the forward and backward passes of the H estimate (only) in that
    lower precision: faster where the hardware has it, at a measured cost in accuracy."""

    dtype: str = "float32"
    reduction: str = "sum"
    seed: int = 0
    autocast: str | None = None


SiteEdit = Callable[[int, torch.Tensor], torch.Tensor]
"""(site index, residual stream) → the stream the rest of the model sees (for diagnostics)."""


def site_activations(
    model: PreTrainedModel, family: ModelFamily, inputs: LayerInputs, batch: int, edit: SiteEdit | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Forward one captured batch through the fused model; return the residual stream at every
    site (embedding output, after each attention, after each MLP) and the logits. `edit`, if
    given, replaces the stream at each site (e.g. to measure the KL of a perturbation)."""
    hidden = inputs.hidden[batch].detach().requires_grad_(edit is None)
    sites = [hidden]

    def visit(stream: torch.Tensor) -> torch.Tensor:
        return stream if edit is None else edit(len(sites) - 1, stream)

    hidden = visit(hidden)
    for i, layer in enumerate(model.get_submodule(family.layers)):
        for site in layer.sites(family):
            hidden = site.block(hidden, **inputs.layer_kwargs[batch][i])
            sites.append(hidden)
            hidden = visit(hidden)
    hidden = model.get_submodule(family.final_norm)(hidden)
    projection = optional_module(model, family.output_projection)  # OPT's project_out, when present
    logits = model.get_submodule(family.head)(hidden if projection is None else projection(hidden))
    cap = getattr(model.config, family.logit_softcapping, None) if family.logit_softcapping else None
    return sites, logits if cap is None else torch.tanh(logits / cap) * cap


def sample_labels(probs: torch.Tensor, generator: torch.Generator, block: int = 128) -> torch.Tensor:
    """One label per row of `probs` (rows summing to 1), by inverse-CDF sampling in two levels.

    A row's CDF is searched first over block sums, then inside the chosen block: the same draw
    as a search of the full CDF (up to rounding), without a sequential scan of the whole
    vocabulary, which costs more than the softmax itself at LLM vocabulary sizes.
    """
    rows, vocab = probs.shape
    whole = vocab // block * block
    sums = probs[:, :whole].view(rows, -1, block).sum(-1)
    if whole < vocab:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True)], dim=-1)
    block_cdf = sums.cumsum(-1)
    draws = torch.rand(rows, 1, generator=generator, device=probs.device, dtype=probs.dtype) * block_cdf[:, -1:]
    chosen = torch.searchsorted(block_cdf, draws).clamp_max(sums.shape[-1] - 1)
    before = torch.nn.functional.pad(block_cdf[:, :-1], (1, 0))  # the CDF where each block starts
    offset = draws - before.gather(-1, chosen)
    columns = chosen * block + torch.arange(block, device=probs.device)
    inside = probs.gather(-1, columns.clamp_max(vocab - 1)).masked_fill_(columns >= vocab, 0)
    within = torch.searchsorted(inside.cumsum(-1), offset).clamp_max(block - 1)
    return (chosen * block + within).clamp_max(vocab - 1).view(-1)


def sampled_score(
    logits: torch.Tensor, mask: torch.Tensor, generator: torch.Generator, reduction: str
) -> torch.Tensor:
    """∂/∂logits of Σ (or mean) over counted positions of log p(y_t), y_t ~ p(· | prefix).

    That gradient is mask·(onehot(y) − p), so it is formed directly and in place: one softmax
    serves both the sampling and the gradient, and no log-softmax graph is built.
    """
    flat = logits.detach().reshape(-1, logits.shape[-1])
    probs = torch.softmax(flat, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    labels = sample_labels(probs, generator)
    weight = mask.reshape(-1, 1).to(probs.dtype)
    if reduction == "mean":
        weight = weight / weight.sum().clamp_min(1)
    score = probs.mul_(weight.neg()).scatter_add_(-1, labels.unsqueeze(-1), weight)
    return score.view(logits.shape).to(logits.dtype)


@contextmanager
def _held_on(parts: list[nn.Module], device: torch.device) -> Iterator[None]:
    """Put the parts the H pass uses on `device`, and each back where it was afterwards."""
    homes = [None if p is None else p.device for p in (next(part.parameters(), None) for part in parts)]
    try:
        for part in parts:
            part.to(device)
        yield
    finally:
        for part, home in zip(parts, homes):
            if home is not None:  # a part without parameters (a fused norm) has no home to go back to
                part.to(home)


def estimate_fisher(
    model: PreTrainedModel,
    family: ModelFamily,
    inputs: LayerInputs,
    options: SensitivityOptions,
    device: torch.device,
) -> list[torch.Tensor]:
    """H for each site (2L+1, or L+1 for parallel blocks; d × d, float64 on return), averaged
    over counted tokens.

    `inputs` are the captured inputs of the fused, unsliced model; counted positions are those of
    `inputs.sensitivity_masks` (for chat data, the positions that predict an assistant token;
    all real tokens otherwise). Their outputs make up the sampled objective, and their gradients
    are accumulated. With `reduction: mean` each batch's objective is divided by its own count.
    """
    dtype = getattr(torch, options.dtype)
    lowered = getattr(torch, options.autocast) if options.autocast else None
    layers = model.get_submodule(family.layers)
    parts = [*layers, model.get_submodule(family.final_norm), model.get_submodule(family.head)]
    projection = optional_module(model, family.output_projection)
    if projection is not None:
        parts.append(projection)
    generator = torch.Generator(device=device).manual_seed(options.seed)
    d = model.config.hidden_size
    per_layer = family.sites_per_layer
    totals = [torch.zeros(d, d, dtype=dtype, device=device) for _ in range(per_layer * len(layers) + 1)]
    tokens = 0
    with _held_on(parts, device):
        for batch, mask in enumerate(inputs.sensitivity_masks):
            with torch.enable_grad(), torch.autocast(device.type, dtype=lowered, enabled=lowered is not None):
                sites, logits = site_activations(model, family, inputs, batch)
                for site in sites[1:]:
                    site.retain_grad()
                logits.backward(sampled_score(logits, mask, generator, options.reduction))
            for total, site in zip(totals, sites):
                g = site.grad[mask].to(dtype)
                total.addmm_(g.T, g)
            tokens += int(mask.sum())
    if tokens == 0:
        raise ValueError("no tokens were counted for the sensitivity statistics (empty sensitivity mask)")
    return [(total / tokens).to(torch.float64) for total in totals]
