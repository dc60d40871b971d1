"""The engine: the layer-by-layer walk that fuses norms, rotates and slices (`walk`), and what it
uses: activation storage (`activations`), calibration statistics (`calibration`), the H pass
(`fisher`), bases and their absorption into the weights (`bases`, `transforms`), width
allocation (`allocation`), refinement of the bases on the model's output (`refine`), the
resumable checkpoint (`checkpoint`) and data-parallel ranks (`parallel`). It knows no strategy
by name and no model family but through its description."""
