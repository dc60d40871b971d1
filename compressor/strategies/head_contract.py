"""What an attention-head selector sees and returns: the contract of the heads axis.

The engine (`engine.heads`) hands a selector one `HeadProblem` per attention layer: the statistics
of the attention's output projection input z (every query head's output, `head_dim` coordinates
each, side by side) over the calibration tokens, the output projection's weight (what each head
writes to the stream), and, when the run has it, the output sensitivity H of the stream the
attention writes to. The selector returns which heads stay: the same number in every KV group
(the heads that share one key and value head), so the layer stays grouped-query attention with
fewer query heads. A head is to this axis what a neuron is to the MLP's: a block of `head_dim`
inputs of the output projection instead of one. It is the units contract (`strategies.units`)
with the head as its unit: selectors register through the `compressor_selectors` hook (or the
older `compressor_head_selectors`) and know nothing about model families or weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from compressor.strategies.units import UnitChoice, UnitProblem, UnitSelector, top_k


@dataclass
class HeadProblem(UnitProblem):
    """One attention layer: keep `keep` of the `heads` query heads, `keep / groups` in each of the
    `groups` KV groups (group g holds heads g·heads/groups to (g+1)·heads/groups − 1).

    `C` is E[z zᵀ] (heads·head_dim square, float64) of the output projection's input over the
    counted calibration tokens, head h's coordinates at h·head_dim to (h+1)·head_dim − 1, measured
    with the earlier layers already pruned. `activation` is Minitron's importance of each head: the
    L2 norm over windows of the mean over a window's positions of ‖z_h‖ (heads, float64). `down` is
    the output projection's weight W (d × heads·head_dim, float64). `G` is E[g gᵀ] (d × d) of the
    output KL's gradient at the stream the attention writes to, in the stream's current coordinates,
    when the run estimated it (None otherwise). `damping` is the absolute δ of the refit that
    follows, as for neurons (`engine.refit.refit_down` on the kept heads' coordinates)."""

    layer: int
    keep: int
    heads: int
    groups: int
    head_dim: int
    C: torch.Tensor
    activation: torch.Tensor
    down: torch.Tensor
    damping: float
    G: torch.Tensor | None = None
    tokens: int = 0

    unit: ClassVar[str] = "head"

    @property
    def units(self) -> int:
        return self.heads

    @property
    def per_group(self) -> int:
        """Heads every KV group keeps."""
        return self.keep // self.groups

    def group_of(self, head: int) -> int:
        return head // (self.heads // self.groups)

    def columns(self, heads: torch.Tensor) -> torch.Tensor:
        """The output projection's input coordinates of `heads` (ascending heads → ascending columns)."""
        offsets = torch.arange(self.head_dim, device=heads.device)
        return (heads.reshape(-1, 1) * self.head_dim + offsets).flatten()

    def refusal(self, kept: torch.Tensor) -> str | None:
        """Every KV group keeps `per_group` heads, so the layer stays grouped-query attention."""
        per_group = torch.bincount(kept // (self.heads // self.groups), minlength=self.groups)
        if bool((per_group != self.per_group).any()):
            return f"kept {per_group.tolist()} heads per KV group; every group keeps {self.per_group}"
        return None


HeadChoice = UnitChoice
"""The kept heads (indices into the layer's query heads, any order) and the selector's figures."""


class HeadSelector(UnitSelector[HeadProblem]):
    """Chooses which of an attention layer's query heads stay, the same number per KV group.
    `requires` names the statistics it cannot do without ("H": the problem's `G`)."""

    unit: ClassVar[str] = "head"


def top_per_group(scores: torch.Tensor, problem: HeadProblem) -> torch.Tensor:
    """The `per_group` highest-scoring heads of every KV group, ascending (ties: the lower index)."""
    size = problem.heads // problem.groups
    kept = [top_k(scores[g * size : (g + 1) * size], problem.per_group) + g * size for g in range(problem.groups)]
    return torch.cat(kept)  # each group's ascending, the groups in order
