"""The walk's phase "estimating output sensitivity (H)": H from the checkpoint, as the caller gave
it, or computed by the layer-wise pass (`engine.fisher`) on the fused, unsliced model, and
checkpointed."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from compressor import faults
from compressor.engine.calibration import LayerInputs
from compressor.engine.fisher import FisherCall, estimate_fisher
from compressor.engine.pooling import (
    check_finite,
)
from compressor.engine.walk_options import PruneCall
from compressor.recipe.sections.sensitivity import SensitivityOptions


@dataclass
class Sensitivity:
    """H as the walk uses it, and where it came from."""

    device: torch.device
    values: Mapping[str, torch.Tensor] | None = None
    loaded: bool = False
    source: str | None = None
    seconds: float = 0.0

    def at(self, site: str) -> torch.Tensor | None:
        return None if self.values is None else self.values[site].to(self.device, torch.float64)


@dataclass(frozen=True)
class SensitivitySource:
    """Where the walk's H comes from when the checkpoint has none: as the caller gave it, else
    computed with these options and seed; and whether it is then held or read from the checkpoint."""

    given: Mapping[str, torch.Tensor] | None = None
    """H of this model, data, options and seed, given (a sweep's earlier run): not estimated again."""
    options: SensitivityOptions | None = None
    """The H pass's options (None: the defaults)."""
    seed: int = 0
    on_disk: bool = False
    """Once checkpointed, each site's H is read from there when asked, not held (a walk that writes
    as it goes); a data-parallel rank above 0 reads it from rank 0's file once rank 0 has written it."""


def estimate_sensitivity(run: PruneCall, inputs: LayerInputs, source: SensitivitySource, skipped: Any) -> Sensitivity:
    """ "estimating output sensitivity (H)": H from the checkpoint, else as the caller gave it,
    else computed on the fused, unsliced model (and checkpointed); `source` says how (`SensitivitySource`)."""
    model, family, device, checkpoint, report = run.model, run.family, run.device, run.checkpoint, run.report
    given, options, seed = source.given, source.options, source.seed
    h = Sensitivity(device)
    on_disk = source.on_disk and checkpoint is not None
    if checkpoint is not None:
        h.values = checkpoint.fisher_on_disk() if on_disk else checkpoint.load_fisher()
    h.loaded = h.values is not None
    h.source = "checkpoint" if h.loaded else None
    if h.values is None and given is not None:
        h.values, h.source = dict(given), "given"
        if checkpoint is not None:
            checkpoint.save_fisher(h.values)
    if h.values is None:
        h.source = "computed"
        phase = "estimating output sensitivity (H)"

        def h_progress(done: int, total: int) -> None:
            report(phase, done, total)
            if done:  # mid-way through the pass, after its first chunk
                faults.reached("fisher")

        tick = time.perf_counter()
        call = FisherCall(h_progress, run.ranks, skipped)
        h.values = estimate_fisher(model, family, inputs, options or SensitivityOptions(), device, seed, call)
        h.seconds = time.perf_counter() - tick
        for name, value in h.values.items():
            check_finite("H", name, value)
        if checkpoint is not None:
            checkpoint.save_fisher(h.values)
    if on_disk and not h.loaded:  # just checkpointed (by rank 0): read back per site from there
        assert checkpoint is not None
        run.ranks.barrier()  # every rank's H is the same sum; rank 0's file is whole once it is here
        saved = checkpoint.fisher_on_disk()
        h.values = saved if saved is not None else h.values
    return h
