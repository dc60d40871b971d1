"""What an MLP neuron selector sees and returns: the contract of the second pruning axis.

The engine (`engine.neurons`) hands a selector one `NeuronProblem` per decoder layer (per routed
expert in a Mixture-of-Experts layer, `engine.expert_width`): statistics
of the MLP's intermediate activation h (the f neurons the down projection reads) over the
calibration tokens, the down projection's weight (what each neuron writes to the stream), and,
when the run has it, the output sensitivity H of the stream the MLP writes to. The selector
returns which `keep` neurons stay. It is the units contract (`strategies.units`) with the neuron
as its unit: selectors register through the `compressor_selectors` hook (or the older
`compressor_neuron_selectors`), as strategies do, and know nothing about model families or weights
beyond the problem.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from compressor.strategies.units import UnitChoice, UnitProblem, UnitSelector, top_k


@dataclass
class NeuronProblem(UnitProblem):
    """One layer's MLP: keep `keep` of its `width` intermediate neurons.

    `C` is E[h hᵀ] (f × f, float64) over the counted calibration tokens, measured with the earlier
    layers already pruned. `activation` is Minitron's importance of each neuron: the L2 norm over
    windows of the mean |h| over a window's positions (f, float64). `down` is the down projection's
    weight W (d × f, float64): neuron j writes W[:, j]·h_j. `G` is E[g gᵀ] (d × d, float64) of the
    output KL's gradient at the stream the MLP writes to, in the stream's current coordinates, when
    the run estimated it (None otherwise). `damping` is the absolute δ of the refit that follows
    the choice, W' = (W·C[:,S] + δ·W[:,S])·(C[S,S] + δI)⁻¹ (`engine.neurons.refit_down`).
    """

    layer: int
    keep: int
    C: torch.Tensor
    activation: torch.Tensor
    down: torch.Tensor
    damping: float
    G: torch.Tensor | None = None
    tokens: int = 0
    expert: int | None = None
    """The routed expert of a Mixture-of-Experts layer this problem is (None: the layer's dense MLP,
    or its shared expert, a dense MLP every token uses whose C and `activation` are weighed by its gate).
    Each expert is its own problem: C and `activation` over every counted token, zero where the
    token was not routed to it, the routed ones weighed by their routing weight (`tokens`: how
    many were routed to it); `down` is the expert's down projection."""

    unit: ClassVar[str] = "neuron"

    @property
    def width(self) -> int:
        return int(self.C.shape[0])

    @property
    def units(self) -> int:
        return self.width

    def where(self) -> str:
        return f"layer {self.layer}" + ("" if self.expert is None else f", expert {self.expert}")


NeuronChoice = UnitChoice
"""The kept neurons (indices into the layer's f, any order) and the selector's own figures."""


class NeuronSelector(UnitSelector[NeuronProblem]):
    """Chooses which of an MLP's neurons stay. `requires` names the statistics it cannot do
    without ("H": the problem's `G`); a selector that can use G but does without leaves it empty."""

    unit: ClassVar[str] = "neuron"

    def select_widths(self, problem: NeuronProblem, widths: Sequence[int]) -> dict[int, NeuronChoice]:
        """A choice at each of `widths` (each from 1 to the problem's width; `problem.keep` is
        ignored): one `select` per width. A selector whose choices nest (a greedy removal, each
        narrower set inside the wider) may walk one path for all of them; the splits' prediction
        asks for several widths at once (`engine.neurons.mlp_width_curves`)."""
        return {width: self.select(dataclasses.replace(problem, keep=width)) for width in widths}


__all__ = ["NeuronChoice", "NeuronProblem", "NeuronSelector", "top_k"]
