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
most) and its down-projection column norms as the activation (so does `magnitude`). The router
is untouched, so no token changes its experts. A shared expert (Qwen2-MoE's, Qwen3.5-MoE's) keeps
its own width (`mlp.shared_kept`) as a dense MLP does, from every counted token weighed by its
gate s = σ(g·x): C = E[s² h hᵀ]. There is no error feedback: each refit reproduces its own
expert's output.

Layers are visited by `engine.neurons.prune_mlp`, which calls `prune_expert_widths` for a layer
whose MLP is a `RoutedExperts` block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from compressor.engine.calibration import LayerPass
from compressor.engine.experts import feed_counted
from compressor.engine.parallel import Ranks
from compressor.engine.refit import (
    NeuronRecord,
    RefitTarget,
    SharedExpertRecord,
    choose_neurons,
    drop_neurons,
    output_error,
    refit_down,
)
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


@dataclass(frozen=True)
class ExpertWidthOptions:
    """How each expert's neurons are chosen and its down projection refitted: `prune_mlp`'s
    settings as a layer of routed experts reads them (defaults: the recipe's)."""

    selector: NeuronSelector
    refit: bool = True
    damping: float = 1e-2
    """δ of the refit, as a share of the mean diagonal of each expert's C."""


@torch.no_grad()
def prune_expert_widths(
    at: LayerPass, block: RoutedExperts, keep: int | None, shared_keep: int | None, options: ExpertWidthOptions
) -> NeuronRecord:
    """Keep `keep` neurons in every routed expert of layer `at.index`'s `block` (None: all) and
    `shared_keep` in its shared expert (None: all), in place (see the module docstring); `at.layer`
    runs on the stored batches `at.inputs` to measure the block's input, and `at.G` weighs the
    selectors' problems. Returns the layer's record; the caller runs the pruned layer to give the
    next one its input."""
    index, device, ranks = at.index, at.device, at.ranks
    width = block.experts[0].down_proj.in_features
    if keep is not None and not 0 < keep <= width:
        raise UserError(f"mlp: cannot keep {keep} of the {width} neurons of layer {index}'s experts")
    shared = None if shared_keep is None else SharedMoments.of(block, index, shared_keep, device)
    stats = _ExpertWidthMoments(len(block.experts), width, device) if keep is not None else None
    counted = [0]

    def add(x: torch.Tensor) -> None:
        counted[0] += x.shape[0]
        for moments in (stats, shared):
            if moments is not None:
                moments.add(block, x)

    feed_counted(at, block, add)
    tokens = ranks.sum_count(counted[0], device)
    if tokens == 0:
        raise ValueError("no calibration tokens were counted (all positions masked)")
    at = replace(at, G=None if at.G is None else at.G.to(device, torch.float64))
    routed = _Narrowed()
    if stats is not None and keep is not None:
        routed = _narrow_routed(at, block, stats.sum_over(ranks), keep, options)
    shared_record = None
    if shared is not None and shared_keep is not None:
        shared_record = _narrow_shared(at, block, shared.sum_over(ranks), shared_keep, options)
    return NeuronRecord(
        layer=index,
        width=width,
        kept=width if keep is None else keep,
        tokens=tokens,
        selector=options.selector.name,
        refit=options.refit,
        error_dropped=routed.share(routed.dropped),
        error_refit=routed.refit_share(options.refit),
        objectives={"experts": routed.objectives} if any(routed.objectives) else {},
        experts=len(block.experts),
        fewest_tokens=None if stats is None else int(stats.routed.min()),
        shared_expert=shared_record,
    )


def _narrow_routed(
    at: LayerPass, block: RoutedExperts, stats: _ExpertWidthMoments, keep: int, options: ExpertWidthOptions
) -> _Narrowed:
    """Every routed expert of the block cut to `keep` neurons from its summed `stats`, in place, and
    what that cost the block's output (summed over the experts in order)."""
    routed = _Narrowed()
    for number, expert in enumerate(block.experts):
        W = expert.down_proj.weight.detach().to(at.device, torch.float64)
        problem = stats.problem(number, at.index, keep, W, options.damping, at.G)
        routed.add(narrow(problem, [expert.gate_up_proj], expert.down_proj, options, at.ranks))
    return routed


def _narrow_shared(
    at: LayerPass, block: RoutedExperts, shared: SharedMoments, keep: int, options: ExpertWidthOptions
) -> SharedExpertRecord:
    """The block's shared expert cut to `keep` neurons from its summed moments, in place, and its record."""
    expert = block.shared_expert
    assert expert is not None
    problem = shared.problem(at.index, keep, expert.down_proj.weight, options.damping, at.G)
    one = narrow(problem, [expert.gate_proj, expert.up_proj], expert.down_proj, options, at.ranks)
    return SharedExpertRecord(problem.width, keep, one.share(one.dropped), one.refit_share(options.refit))


class _Narrowed:
    """What narrowing experts cost the block's output: the energy E‖t‖² the kept neurons' targets
    carried, and the error the plain and the refitted kept weights leave (summed over experts)."""

    def __init__(self) -> None:
        self.energy = self.dropped = self.refitted = 0.0
        self.objectives: list[dict[str, Any]] = []

    def add(self, other: _Narrowed) -> None:
        self.energy += other.energy
        self.dropped += other.dropped
        self.refitted += other.refitted
        self.objectives += other.objectives

    def share(self, error: float) -> float:
        return error / self.energy if self.energy > 0 else 0.0

    def refit_share(self, refit: bool) -> float | None:
        return self.share(self.refitted) if refit else None


def narrow(
    problem: NeuronProblem, readers: list[nn.Linear], writer: nn.Linear, options: ExpertWidthOptions, ranks: Ranks
) -> _Narrowed:
    """One expert's MLP cut to the selector's kept neurons, in place, its down projection refitted
    (or the kept weights as they were), and what that cost its weighed output."""
    selector, refit = options.selector, options.refit
    W = problem.down
    choice, kept = choose_neurons(selector, problem, ranks)
    plain = W[:, kept]
    fitted = refit_down(W, problem.C, kept, problem.damping) if refit else None
    done = _Narrowed()
    done.objectives.append(dict(choice.objectives))
    if problem.tokens:  # an unrouted expert adds nothing to the block's output on these tokens
        goal = RefitTarget.output(W, problem.C)
        done.energy = goal.energy
        done.dropped = goal.energy * output_error(goal, problem.C, kept, plain)
        if fitted is not None:
            done.refitted = goal.energy * output_error(goal, problem.C, kept, fitted)
    drop_neurons(readers, writer, kept, fitted if fitted is not None else plain)
    return done


class SharedMoments:
    """A shared expert's Σ s² h hᵀ and Σ s |h| over every counted token, s its gate σ(g·x) (1 for a
    shared expert without a gate): the block writes s·W h, so dropping its neurons costs the block
    E[s²‖W h − W' h_S‖²], the dense refit with C = E[s² h hᵀ]."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.total = torch.zeros(width, width, dtype=torch.float64, device=device)
        self.magnitude = torch.zeros(width, dtype=torch.float64, device=device)
        self.tokens = 0

    @classmethod
    def of(cls, block: RoutedExperts, index: int, keep: int, device: torch.device) -> SharedMoments:
        if block.shared_expert is None:
            raise UserError(f"mlp.shared_kept: layer {index}'s MoE block has no shared expert; remove mlp.shared_kept")
        width = block.shared_expert.down_proj.in_features
        if not 0 < keep <= width:
            raise UserError(f"mlp: cannot keep {keep} of the {width} neurons of layer {index}'s shared expert")
        return cls(width, device)

    def add(self, block: RoutedExperts, x: torch.Tensor) -> None:
        """Counted tokens `x` (n × d) through the shared expert's input projections and its gate."""
        expert = block.shared_expert
        assert expert is not None
        h = expert.act_fn(expert.gate_proj(x)) * expert.up_proj(x)
        if block.shared_expert_gate is not None:
            h = torch.sigmoid(block.shared_expert_gate(x)) * h  # in the model's dtype, as the block applies it
        h = h.to(torch.float64)
        self.total.addmm_(h.T, h)
        self.magnitude += h.abs().sum(0)
        self.tokens += x.shape[0]

    def sum_over(self, ranks: Ranks) -> SharedMoments:
        for total in (self.total, self.magnitude):
            ranks.sum_(total)
        self.tokens = ranks.sum_count(self.tokens, self.total.device)
        return self

    def problem(
        self, layer: int, keep: int, down: torch.Tensor, damping: float, G: torch.Tensor | None
    ) -> NeuronProblem:
        """The shared expert's neuron problem: a dense MLP's, with its output weighed by its gate."""
        C = self.total / self.tokens
        return NeuronProblem(
            layer=layer,
            keep=keep,
            C=C,
            activation=self.magnitude / self.tokens,
            down=down.detach().to(C.device, torch.float64),
            damping=damping * float(torch.diagonal(C).mean()),
            G=G,
            tokens=self.tokens,
        )
