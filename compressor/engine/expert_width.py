"""The routed experts' width as the MLP axis of a Mixture-of-Experts layer: every expert keeps the
same `keep` of its f neurons (one `moe_intermediate_size` for every expert, as the family's class
reads it), each expert chosen and refitted as a dense MLP is (`engine.refit`), from the tokens the
router sends it, weighed by their routing weights.

The block writes Σ_e w_e(x)·W_e h_e(x) over each token's experts, so what pruning expert e costs
the block's output is E[1{x→e}·w_e²·‖W_e h_e − W'_e h_{e,S}‖²] over the counted tokens: the dense
refit with C_e = E[1{x→e} w_e² h_e h_eᵀ], the mean over every counted token (an expert that sees
fewer tokens weighs less in the layer's error), and the selector's `activation` the mean of
1{x→e}·w_e·|h_e|. G is H of the stream the block writes to, the same for every expert. An expert
no calibration token reached has no statistics: its problem takes C_e = I (under which the refit
is the kept weights as they were, and an output-aware selector keeps the neurons that write the
most) and its down-projection column norms as the activation (so does `magnitude`). The router is untouched, so no token changes its experts, and a shared expert keeps its
width. There is no error feedback: each refit reproduces its own expert's output.

Layers are visited by `engine.neurons.prune_mlp`, which calls `prune_expert_widths` for a layer
whose MLP is a `RoutedExperts` block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compressor.engine.calibration import LayerInputs
from compressor.engine.experts import feed_counted
from compressor.engine.parallel import Ranks
from compressor.engine.refit import NeuronRecord, RefitTarget, choose_neurons, drop_neurons, output_error, refit_down
from compressor.errors import UserError
from compressor.models.experts import RoutedExperts
from compressor.strategies.neuron_contract import NeuronProblem, NeuronSelector


class _ExpertWidthMoments:
    """Per expert, Σ w² h hᵀ and Σ w |h| over the tokens routed to it, and the routed count."""

    def __init__(self, experts: int, width: int, device: torch.device) -> None:
        self.total = torch.zeros(experts, width, width, dtype=torch.float64, device=device)
        self.magnitude = torch.zeros(experts, width, dtype=torch.float64, device=device)
        self.routed = torch.zeros(experts, dtype=torch.float64, device=device)
        self.tokens = 0

    def add(self, block: RoutedExperts, x: torch.Tensor) -> None:
        """Counted tokens `x` (n × d) through the block's router and each expert's input projections."""
        self.tokens += x.shape[0]
        for index, token, weight in block.dispatch(x):
            h = block.experts[index].activation(x[token]).to(torch.float64) * weight.to(torch.float64)[:, None]
            self.total[index].addmm_(h.T, h)
            self.magnitude[index] += h.abs().sum(0)
            self.routed[index] += len(token)

    def sum_over(self, ranks: Ranks) -> _ExpertWidthMoments:
        for total in (self.total, self.magnitude, self.routed):
            ranks.sum_(total)
        self.tokens = ranks.sum_count(self.tokens, self.total.device)
        return self

    def problem(
        self, index: int, layer: int, keep: int, down: torch.Tensor, damping: float, G: torch.Tensor | None
    ) -> NeuronProblem:
        """Expert `index`'s neuron problem (C_e = I where no token reached it)."""
        width = self.total.shape[-1]
        routed = int(self.routed[index])
        if routed:
            C, activation = self.total[index] / self.tokens, self.magnitude[index] / self.tokens
        else:  # what each neuron would write, for a selector that scores activations
            C, activation = torch.eye(width, dtype=torch.float64, device=self.total.device), down.norm(dim=0)
        return NeuronProblem(
            layer=layer,
            keep=keep,
            C=C,
            activation=activation,
            down=down,
            damping=damping * float(torch.diagonal(C).mean()),
            G=G,
            tokens=routed,
            expert=index,
        )


@torch.no_grad()
def prune_expert_widths(
    layer: nn.Module,
    block: RoutedExperts,
    inputs: LayerInputs,
    index: int,
    keep: int,
    selector: NeuronSelector,
    device: torch.device,
    G: torch.Tensor | None,
    ranks: Ranks,
    refit: bool = True,
    damping: float = 1e-2,
) -> NeuronRecord:
    """Keep `keep` neurons in every routed expert of layer `index`'s `block`, in place (see the
    module docstring); `layer` runs on the stored batches `inputs` to measure the block's input.
    Returns the layer's record; the caller runs the pruned layer to give the next one its input."""
    width = block.experts[0].down_proj.in_features
    if not 0 < keep <= width:
        raise UserError(f"mlp: cannot keep {keep} of the {width} neurons of layer {index}'s experts")
    stats = _measure(layer, block, inputs, index, device).sum_over(ranks)
    if stats.tokens == 0:
        raise ValueError("no calibration tokens were counted (all positions masked)")
    G = None if G is None else G.to(device, torch.float64)
    energy = dropped = refitted_error = 0.0
    objectives: list[dict[str, Any]] = []
    for number, expert in enumerate(block.experts):
        W = expert.down_proj.weight.detach().to(device, torch.float64)
        problem = stats.problem(number, index, keep, W, damping, G)
        choice, kept = choose_neurons(selector, problem, ranks)
        plain = W[:, kept]
        fitted = refit_down(W, problem.C, kept, problem.damping) if refit else None
        if problem.tokens:  # an unrouted expert adds nothing to the block's output on these tokens
            goal = RefitTarget.output(W, problem.C)
            energy += goal.energy
            dropped += goal.energy * output_error(goal, problem.C, kept, plain)
            if fitted is not None:
                refitted_error += goal.energy * output_error(goal, problem.C, kept, fitted)
        objectives.append(dict(choice.objectives))
        drop_neurons([expert.gate_up_proj], expert.down_proj, kept, fitted if fitted is not None else plain)
    share = (lambda total: total / energy) if energy > 0 else (lambda _: 0.0)
    return NeuronRecord(
        layer=index,
        width=width,
        kept=keep,
        tokens=stats.tokens,
        selector=selector.name,
        refit=refit,
        error_dropped=share(dropped),
        error_refit=share(refitted_error) if refit else None,
        objectives={"experts": objectives} if any(objectives) else {},
        experts=len(block.experts),
        fewest_tokens=int(stats.routed.min()),
    )


def _measure(
    layer: nn.Module, block: RoutedExperts, inputs: LayerInputs, index: int, device: torch.device
) -> _ExpertWidthMoments:
    """What the layer's block's experts read from the counted tokens of every stored batch."""
    stats = _ExpertWidthMoments(len(block.experts), block.experts[0].down_proj.in_features, device)
    feed_counted(layer, block, inputs, index, device, lambda x: stats.add(block, x))
    return stats
