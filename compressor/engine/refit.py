"""The least-squares refit of a pruned MLP's output projection, shared by every MLP the neuron axis
prunes (a dense MLP, `engine.neurons`; each routed expert, `engine.expert_width`), and its record: from the
moments C = E[h hᵀ] of the projection's input and X = E[t hᵀ] of its target, the damped refit to
a kept set of neurons, the error it leaves, and the linears cut to the kept rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from compressor.engine.mlp_reconstruct import ReconstructionRecord
from compressor.engine.parallel import Ranks
from compressor.errors import UserError
from compressor.strategies.neuron_contract import NeuronChoice, NeuronProblem, NeuronSelector
from compressor.strategies.units import checked_choice


@dataclass
class SharedExpertRecord:
    """A layer's shared expert narrowed (`mlp.shared_kept`): its neurons kept of its width, and the
    relative errors of its gate-weighed output, E[s²‖W h − W' h_S‖²] / E[s²‖W h‖²] (see `NeuronRecord`)."""

    width: int
    kept: int
    error_dropped: float
    error_refit: float | None


@dataclass
class NeuronRecord:
    """What happened at one layer's MLP, for the report."""

    layer: int
    width: int
    kept: int
    tokens: int
    selector: str
    refit: bool
    error_dropped: float
    """Relative least-squares error against the refit's target t with the kept neurons' weights as
    they were: E‖t − W[:,S] h_S‖² / E‖t‖² on the calibration tokens (t = W h for "output")."""
    error_refit: float | None
    """The same with the refitted weights W' (None without the refit)."""
    objectives: dict[str, Any] = field(default_factory=dict)
    feedback: float = 0.0
    """The error feedback α the refit's target carried (0: the layer's own MLP output)."""
    experts: int = 0
    """The routed experts that each kept `kept` of their `width` neurons (0: a dense MLP). The
    errors are then Σ_e E[1{x→e} w_e² ‖error_e‖²] / Σ_e E[1{x→e} w_e² ‖W_e h_e‖²]: each expert's
    weighed error summed, which leaves out the cross terms between a token's experts (and the
    shared expert), so it is not the block's own relative output error."""
    fewest_tokens: int | None = None
    """In a Mixture-of-Experts layer, the fewest calibration tokens routed to one expert (None: its
    routed experts kept their width)."""
    shared_expert: SharedExpertRecord | None = None
    """The layer's shared expert, where `mlp.shared_kept` narrowed it."""
    reconstruction: ReconstructionRecord | None = None
    """`mlp.reconstruct`: the kept weights trained after the refit (`engine.mlp_reconstruct`)."""


@dataclass
class RefitTarget:
    """What the down projection's refit reproduces, by its moments with the activation h:
    `cross` X = E[t hᵀ] (d × f, float64) and `energy` E‖t‖²."""

    cross: torch.Tensor
    energy: float

    @classmethod
    def output(cls, down: torch.Tensor, C: torch.Tensor) -> RefitTarget:
        """t = W h, what the f neurons wrote."""
        return cls(down @ C, float(torch.trace(down @ C @ down.T)))

    def full_map(self, down: torch.Tensor, C: torch.Tensor, damping: float) -> torch.Tensor:
        """W* = (X + δW)(C + δI)⁻¹: the full-width map the damped refit aims at; refitting W* to the
        kept neurons (`refit_down`) is the damped least-squares fit of the target. W itself when
        the target is the layer's own output."""
        damped = C.clone()
        damped.diagonal().add_(damping)
        return torch.linalg.solve(damped, (self.cross + damping * down).T).T


def refit_down(down: torch.Tensor, C: torch.Tensor, kept: torch.Tensor, damping: float) -> torch.Tensor:
    """W' = (W·C[:,S] + δ·W[:,S])·(C[S,S] + δI)⁻¹ (float64): the down projection that best
    reproduces, from the kept neurons alone, what every neuron wrote on the calibration tokens,
    with a ridge δ towards the kept neurons' own weights (so keeping every neuron changes nothing,
    and it is the refit the `obs` selector's downdates make)."""
    C_SS = C[kept][:, kept] + damping * torch.eye(len(kept), dtype=C.dtype, device=C.device)
    rhs = down @ C[:, kept] + damping * down[:, kept]  # d × m
    return torch.linalg.solve(C_SS, rhs.T).T  # C_SS is symmetric: (C_SS⁻¹ rhsᵀ)ᵀ = rhs C_SS⁻¹


def output_error(target: RefitTarget, C: torch.Tensor, kept: torch.Tensor, kept_down: torch.Tensor) -> float:
    """E‖t − W' h_S‖² / E‖t‖² from the moments alone (W' reads the kept neurons)."""
    cross = float((target.cross[:, kept] * kept_down).sum())
    own = float(torch.trace(kept_down @ C[kept][:, kept] @ kept_down.T))
    return (target.energy - 2 * cross + own) / target.energy if target.energy > 0 else 0.0


def drop_neurons(inputs: list[nn.Linear], output: nn.Linear, kept: torch.Tensor, down: torch.Tensor) -> None:
    """Keep rows `kept` of each input linear (of each f-row block of a fused one) and set the
    output linear's weight to `down` (d × m), in place, in each module's dtype and device."""
    width = output.in_features
    for linear in inputs:
        blocks = linear.out_features // width
        rows = torch.cat([kept + block * width for block in range(blocks)]).to(linear.weight.device)
        linear.weight = nn.Parameter(linear.weight.data[rows].clone(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.data[rows].clone(), requires_grad=False)
        linear.out_features = len(rows)
    output.weight = nn.Parameter(down.to(output.weight.device, output.weight.dtype).contiguous(), requires_grad=False)
    output.in_features = len(kept)


def choose_neurons(selector: NeuronSelector, problem: NeuronProblem, ranks: Ranks) -> tuple[NeuronChoice, torch.Tensor]:
    """The selector's choice for `problem` and its kept neurons (sorted, on the problem's device),
    checked, and the same on every rank (data-parallel: each chose alone from summed statistics)."""
    choice = selector.select(problem)
    kept = checked_choice(choice, selector, problem).to(problem.C.device)
    if not ranks.agree(kept):
        where = f"layer {problem.layer}" + ("" if problem.expert is None else f", expert {problem.expert}")
        raise RuntimeError(
            f"{where}: the processes chose different neurons from the same statistics "
            f"(selector '{selector.name}' is not deterministic across devices)"
        )
    return choice, kept


def choose_neurons_at(
    selector: NeuronSelector, problem: NeuronProblem, widths: Sequence[int], ranks: Ranks
) -> dict[int, torch.Tensor]:
    """The selector's kept neurons at each of `widths` (`NeuronSelector.select_widths`: one path
    where its choices nest), each checked and the same on every rank."""
    kept = {}
    for width, choice in selector.select_widths(problem, widths).items():
        at = dataclasses.replace(problem, keep=width)
        kept[width] = checked_choice(choice, selector, at).to(problem.C.device)
        if not ranks.agree(kept[width]):
            raise RuntimeError(
                f"layer {problem.layer}: the processes chose different neurons from the same statistics "
                f"(selector '{selector.name}' is not deterministic across devices)"
            )
    if sorted(kept) != sorted(set(widths)):
        raise UserError(f"neuron selector '{selector.name}' chose at widths {sorted(kept)}, not {sorted(set(widths))}")
    return kept
