"""What a stage's costs are written in: a phase of the memory plan (`Phase`), a phase of the time
plan (`TimedPhase`) and what every time estimate reads (`Work`: the unit costs measured on one layer
and the run's counts). The plans (`plan.memory`, `plan.timing`) add the stages' phases up; the stages
import only this module, never the plans, so no stage imports what imports the stages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compressor.plan.checks import Plan
    from compressor.recipe.schema import Recipe


GiB = 2**30


def size(count: int) -> str:
    """Bytes as a person reads them: GiB, or MiB below one GiB."""
    return f"{count / GiB:.1f} GiB" if count >= GiB else f"{count / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Phase:
    """One phase's peak: bytes in host memory and on the device (None: the device is the host)."""

    name: str
    host: int
    device: int | None
    fix: str
    """What makes this phase smaller, said in the refusal when it is the one that does not fit."""


@dataclass(frozen=True)
class UnitCosts:
    """Seconds measured on this device for this model's shape (`measure_costs`)."""

    layer_forward: float
    """Per token: one decoder layer's forward, no gradient."""
    layer_backward: float
    """Per token: one decoder layer's forward and the backward to its input (the H pass recomputes each layer)."""
    layer_call: float
    """One decoder layer called on a single token (a decoding step's floor)."""
    head_forward: float
    """Per token: the head's matmul and log-softmax over the vocabulary."""
    head_backward: float
    """Per token: the same with its backward (the H pass's sampled labels)."""
    basis: float
    """Per site: the pipeline's strategies choosing a basis at the stream's width."""
    neurons: float
    """Per layer: the `mlp` selector choosing its neurons at the MLP's width (0 without `mlp`)."""
    heads: float
    """Per layer: the `heads` selector choosing query heads (0 without `heads`)."""
    moment_stream: float = 0.0
    """Per token: a site's second moment E[x xᵀ] at the stream's width, accumulated in float64."""
    moment_mlp: float = 0.0
    """Per token: the same at the MLP's width (its input's C, `mlp`)."""
    untimed: tuple[str, ...] = ()
    """What could not be timed on a synthetic problem (a plugin's strategy that refuses one): counted as 0."""

    def model_forward(self, layers: int) -> float:
        """Per token: the whole model's forward and log-probabilities (evaluation, a held-out KL)."""
        return layers * self.layer_forward + self.head_forward


@dataclass(frozen=True)
class TimedPhase:
    """One phase of the time plan: its name, its estimated seconds and the report's `timings` key it
    is measured under (None: inside another's)."""

    name: str
    seconds: float | None
    """None: not estimated (lm-eval's tasks)."""
    key: str | None = None


@dataclass(frozen=True)
class Work:
    """What every stage's time estimate reads: the unit costs and the counts of the run."""

    costs: UnitCosts
    recipe: Recipe
    checked: Plan
    layers: int
    """Decoder layers of the model the walk prunes (without blocks `depth` removes)."""
    original_layers: int
    tokens: int
    """Calibration tokens (windows × tokens per window)."""
    evaluation_tokens: int
    heldout: dict[str, int] = field(default_factory=dict)
    """Held-out tokens each measuring stage reads, by stage name."""
    adopts_trial: bool = False
    """The run will adopt the chosen split's trial (`stages.split.adopts`): its walk, experts, heads and
    MLP stage are then within the choice's time, not again after it."""

    @property
    def sites(self) -> int:
        return 2 * self.layers + 1

    def layer_pass(self, tokens: int | None = None, layers: int | None = None) -> float:
        """A pass over `tokens` (default: the calibration's) through every layer, forward only."""
        return (
            (self.tokens if tokens is None else tokens)
            * (self.layers if layers is None else layers)
            * (self.costs.layer_forward)
        )

    def over_candidates(self, phases: Callable[[Any], list[TimedPhase]]) -> list[TimedPhase]:
        """`phases(layout)` of the run's layout, or where the run chooses among splits (the choice not
        yet made) their mean over the candidates, phase by phase."""
        layouts = self.checked.splits if self.checked.may_choose_split else (self.checked.layout,)
        each = [phases(layout) for layout in layouts]
        named: dict[str, list[TimedPhase]] = {}
        for found in each:
            for phase in found:
                named.setdefault(phase.name, []).append(phase)
        return [
            TimedPhase(name, sum(p.seconds or 0.0 for p in found) / len(each), found[0].key)
            for name, found in named.items()
        ]

    def measured_kl(self, tokens: int, layers: int | None = None) -> float:
        """KL of a model to the original on `tokens` held-out tokens: both models' forward passes."""
        return tokens * (
            self.costs.model_forward(self.original_layers) + self.costs.model_forward(layers or self.layers)
        )


def duration(seconds: float) -> str:
    """`48 s`, `3 min 10 s`, `2 h 05 min`: a time a person reads at a glance."""
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def decode_seconds(costs: UnitCosts, layers: int, batch: int, steps: int) -> float:
    """`steps` decoding steps of `batch` sequences through `layers` layers: each step a call per layer
    (at least its single-token floor) and the head."""
    per_layer = max(costs.layer_call, batch * costs.layer_forward)
    return steps * (layers * per_layer + batch * costs.head_forward)
