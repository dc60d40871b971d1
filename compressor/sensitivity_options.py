"""The H pass's settings, apart from its code, so that checking a recipe needs no model stack."""

from __future__ import annotations

from dataclasses import dataclass

REDUCTIONS = ("sum", "mean")
ACCUMULATION_DTYPES = ("float32", "float64")
AUTOCAST_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class SensitivityOptions:
    """How H is estimated. `dtype` is the accumulation precision (the paper: float32);
    `autocast`, if set, runs the forward and backward passes of the H estimate (only) in that
    lower precision: faster where the hardware has it, at a measured cost in accuracy.
    `chunk` is how many calibration sequences go down the layers together when layers are
    recomputed: their inputs to every layer are held on the host at once (≈ (L + 1) · chunk ·
    seq_len · d values); without recomputation the pass goes one batch at a time.
    `recompute` (default: on an accelerator, not on CPU) recomputes each layer in the backward
    sweep instead of keeping its graph, so the device holds one layer's graph for one batch."""

    dtype: str = "float32"
    reduction: str = "sum"
    autocast: str | None = None
    chunk: int = 32
    recompute: bool | None = None
