"""The engine: the layer-by-layer walk that fuses norms, rotates and slices (`walk`), and what it
uses: activation storage (`activations`), calibration statistics (`calibration`), the H pass
(`fisher`), bases and their absorption into the weights (`bases`, `transforms`), width
allocation (`allocation`), refinement of the bases on the model's output (`refine`), the
resumable checkpoint (`checkpoint`) and data-parallel ranks (`parallel`). It knows no strategy
by name and no model family but through its description.

`compressor.engine` was one module before the package was split into rooms; its names still
resolve here (`from compressor.engine import prune`), forwarded to `walk`."""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # the import system's probes: nothing to forward
        raise AttributeError(name)
    try:
        return getattr(importlib.import_module("compressor.engine.walk"), name)
    except AttributeError:
        raise AttributeError(f"module 'compressor.engine' has no attribute {name!r}") from None
