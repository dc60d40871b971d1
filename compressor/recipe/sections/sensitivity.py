"""The H pass's settings, apart from its code, so that checking a recipe needs no model stack."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import StrictBool, StrictInt

from compressor.recipe.sections.contract import Section
from compressor.validation import FORBID, described, options

Reduction = Literal["sum", "mean"]
AccumulationDtype = Literal["float32", "float64"]
AutocastDtype = Literal["auto", "bfloat16", "float16"]
REDUCTIONS = get_args(Reduction)
ACCUMULATION_DTYPES = get_args(AccumulationDtype)
AUTOCAST_DTYPES = get_args(AutocastDtype)


@options(frozen=True, config=FORBID)
class SensitivityOptions:
    """How H is estimated. `dtype` is the accumulation precision (the paper: float32);
    `autocast`, if set, runs the forward and backward passes of the H estimate (only) in that
    lower precision: faster where the hardware has it, at a measured cost in accuracy; `auto` is
    bfloat16 only where the device computes it natively (a CUDA GPU with bf16, a CPU with
    AVX512-BF16 or AMX), full precision elsewhere (emulated bf16 is several times slower).
    `chunk` is how many calibration sequences go down the layers together when layers are
    recomputed: their inputs to every layer are held on the host at once (≈ (L + 1) · chunk ·
    seq_len · d values); without recomputation the pass goes one batch at a time.
    `recompute` (default: on an accelerator, not on CPU) recomputes each layer in the backward
    sweep instead of keeping its graph, so the device holds one layer's graph for one batch."""

    dtype: AccumulationDtype = "float32"
    reduction: Reduction = "sum"
    autocast: AutocastDtype | None = None
    chunk: Annotated[StrictInt, described("sequences per layer visit", ge=1)] = 32
    recompute: StrictBool | None = None


SECTION = Section("sensitivity", SensitivityOptions)
