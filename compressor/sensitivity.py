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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from compressor.calibration import LayerInputs
from compressor.families import ModelFamily

REDUCTIONS = ("sum", "mean")
ACCUMULATION_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class SensitivityOptions:
    """How H is estimated. `dtype` is the accumulation precision (the paper: float32)."""

    dtype: str = "float32"
    reduction: str = "sum"
    seed: int = 0


def site_activations(
    model: PreTrainedModel, family: ModelFamily, inputs: LayerInputs, batch: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Forward one captured batch through the fused model; return the residual stream at every
    site (embedding output, after each attention, after each MLP) and the logits."""
    hidden = inputs.hidden[batch].detach().requires_grad_(True)
    sites = [hidden]
    for i, layer in enumerate(model.get_submodule(family.layers)):
        hidden = layer.attention_block(hidden, **inputs.layer_kwargs[batch][i])
        sites.append(hidden)
        hidden = layer.mlp_block(hidden)
        sites.append(hidden)
    final = model.get_submodule(family.final_norm)(hidden)
    return sites, model.get_submodule(family.head)(final)


def sampled_log_likelihood(
    logits: torch.Tensor, mask: torch.Tensor, generator: torch.Generator, reduction: str
) -> torch.Tensor:
    """Σ (or mean) over counted positions of log p(y_t), y_t ~ p(· | prefix) drawn from the model."""
    log_probs = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    with torch.no_grad():
        flat = log_probs.detach().exp().reshape(-1, log_probs.shape[-1])
        labels = torch.multinomial(flat, 1, generator=generator).view(log_probs.shape[:-1])
    picked = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    total = (picked * mask).sum()
    return total / mask.sum().clamp_min(1) if reduction == "mean" else total


def estimate_fisher(
    model: PreTrainedModel,
    family: ModelFamily,
    inputs: LayerInputs,
    options: SensitivityOptions,
    device: torch.device,
) -> list[torch.Tensor]:
    """H for each of the 2L+1 sites (d × d, float64 on return), averaged over counted tokens.

    `inputs` are the captured inputs of the fused, unsliced model; counted tokens are those of
    `inputs.sensitivity_masks` (assistant tokens for chat data, all real tokens otherwise).
    """
    dtype = getattr(torch, options.dtype)
    layers = model.get_submodule(family.layers)
    head = model.get_submodule(family.head)
    homes = [next(layer.parameters()).device for layer in layers] + [head.weight.device]
    for part in (*layers, model.get_submodule(family.final_norm), head):
        part.to(device)
    generator = torch.Generator(device=device).manual_seed(options.seed)
    d = model.config.hidden_size
    totals = [torch.zeros(d, d, dtype=dtype, device=device) for _ in range(2 * len(layers) + 1)]
    tokens = 0
    try:
        for batch, mask in enumerate(inputs.sensitivity_masks):
            with torch.enable_grad():
                sites, logits = site_activations(model, family, inputs, batch)
                for site in sites[1:]:
                    site.retain_grad()
                objective = sampled_log_likelihood(logits, mask.to(logits.dtype), generator, options.reduction)
                objective.backward()
            for total, site in zip(totals, sites):
                g = site.grad[mask].to(dtype)
                total.addmm_(g.T, g)
            tokens += int(mask.sum())
    finally:
        for part, home in zip((*layers, head), homes):
            part.to(home)
    if tokens == 0:
        raise ValueError("no tokens were counted for the sensitivity statistics (empty sensitivity mask)")
    return [(total / tokens).to(torch.float64) for total in totals]
