"""The run's choice of a split of one budget between the residual width and the MLP's width
(`mlp` without `kept`): each candidate of the plan (`models.split`) is pruned as the run would
prune it (walk, then MLP) and measured, KL(original ‖ the model as it would be saved) on held-out
windows of the calibration dataset; the lowest wins. Measuring, not predicting, because the two
axes' second-order estimates (the strategies' objectives, OBS's ΔE) are sums over sites that
ignore how the cuts interact, while the measurement is the quantity users are given (ModelOpt's
search scores its best candidates the same way). The residual width alone (every expert, every
neuron) is the first candidate wherever the budget allows it, so the choice then never makes a
model worse on these windows than pruning the residual alone; `experts` and `heads` without `kept`
add each expert and head count's splits (`plan.checks`). `mlp.measure_best` measures only the
splits predicted best (`stages.split_prediction`); the residual width alone is then among
them only where it is predicted among the best.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from compressor import faults
from compressor.errors import UserError
from compressor.models.layout import SlicedLayout, mlp_neurons
from compressor.reports.report import without_blocks
from compressor.reports.report_model import SplitCandidate, SplitRecord
from compressor.runtime.loading import Resources


def choose(
    splits: Sequence[SlicedLayout],
    measure: Callable[[int, SlicedLayout], float],
    windows: int,
    progress: Callable[[str, int, int], None],
    measured: Sequence[int] | None = None,
    predicted: Sequence[float] | None = None,
) -> SplitRecord:
    """Measure every split (`measure(index, layout)` → held-out KL), or those of `measured` alone,
    and keep the lowest; ties go to the earlier candidate (more of the MLP kept). `predicted`: each
    split's predicted KL, recorded beside it."""
    indices = list(range(len(splits))) if measured is None else list(measured)
    kls: dict[int, float] = {}
    for step, index in enumerate(indices):
        progress("choosing the split of the budget", step, len(indices))
        kls[index] = measure(index, splits[index])
        faults.reached(f"split:{index}")
    progress("choosing the split of the budget", len(indices), len(indices))
    candidates = []
    for index, layout in enumerate(splits):
        assert layout.widths is not None and layout.kept is not None
        candidates.append(
            SplitCandidate(
                width=layout.kept,
                mlp_kept=layout.mlp_width or mlp_neurons(layout.config, layout.family),
                params=layout.params.count(layout.widths),
                heldout_kl=kls.get(index),
                experts=layout.experts,
                heads=layout.heads,
                removed_blocks=list(layout.removed_blocks) or None,
                active_params=None if layout.active is None else layout.active.count(layout.widths),
                predicted_kl=None if predicted is None else predicted[index],
            )
        )
    finite = [i for i, kl in kls.items() if math.isfinite(kl)]
    if not finite:
        raise UserError(
            "no split of the budget gave a finite KL on the held-out windows (the model's outputs "
            "overflow once pruned); lower the cut, or prune the residual width alone (remove mlp and experts)"
        )
    chosen = min(finite, key=lambda i: (kls[i], i))  # a non-finite KL never wins
    return SplitRecord(windows=windows, candidates=candidates, chosen=chosen)


def split_label(layout: SlicedLayout) -> str:
    """`width 504, MLP 1160` (`, 6 experts`, `, 6 heads`, `, without blocks 4, 5`): one candidate,
    in the run's progress."""
    mlp = "all" if layout.mlp_width is None else str(layout.mlp_width)
    experts = "" if layout.experts is None else f", {layout.experts} experts"
    heads = "" if layout.heads is None else f", {layout.heads} heads"
    return f"width {layout.kept}, MLP {mlp}{experts}{heads}{without_blocks(layout.removed_blocks)}"


class KeptFisher(Resources):
    """A run's resources that keep H once computed, so the splits' trial walks and the run's walk
    share one H pass; everything else is the given resources'."""

    def __init__(self, inner: Resources) -> None:
        self.inner = inner
        self.kept: dict[str, dict[str, torch.Tensor]] = {}

    def tokenizer(self, spec: Any) -> Any:
        return self.inner.tokenizer(spec)

    def batches(self, spec: Any, tokenizer: Any, where: str) -> Any:
        return self.inner.batches(spec, tokenizer, where)

    def model(self, spec: Any) -> Any:
        return self.inner.model(spec)

    def fisher(self, key: str) -> dict[str, torch.Tensor] | None:
        kept = self.kept.get(key)
        if kept is None:
            return self.inner.fisher(key)
        return {site: h.clone() for site, h in kept.items()}  # a plugin may edit its H

    def keep_fisher(self, key: str, fisher: dict[str, torch.Tensor]) -> None:
        self.kept.setdefault(key, fisher)
        self.inner.keep_fisher(key, fisher)

    def baseline_tasks(self, key: str) -> dict[str, Any] | None:
        return self.inner.baseline_tasks(key)

    def keep_baseline_tasks(self, key: str, scores: dict[str, Any]) -> None:
        self.inner.keep_baseline_tasks(key, scores)
