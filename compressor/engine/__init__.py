"""The engine: the layer-by-layer walk that fuses norms, rotates and slices (`walk`), and what it
uses: activation storage (`activations`), calibration statistics (`calibration`), the H pass
(`fisher`), bases and their absorption into the weights (`bases`, `transforms`), width
allocation (`allocation`), refinement of the bases on the model's output (`refine`), the
resumable checkpoint (`checkpoint`) and data-parallel ranks (`parallel`). It knows no strategy
by name and no model family but through its description.

`compressor.engine` was one module before the package was split into rooms; its names still
resolve here (`from compressor.engine import prune`), forwarded to `walk`."""

from __future__ import annotations

from compressor._aliases import forwarding

__getattr__ = forwarding(__name__, "compressor.engine.walk")
