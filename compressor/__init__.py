"""compressor: residual-stream pruning (SliceGPT and output-aware variants) for HF transformers.

Importing the package registers the sliced architectures with the transformers Auto classes,
so `AutoModelForCausalLM.from_pretrained(run_dir / "model")` works. The registration happens
when transformers is imported (now, if it already is), so `import compressor` itself stays cheap
for the command line's help and recipe checks.
"""

from __future__ import annotations

import importlib
import sys

from compressor._post_import import after_import

__version__ = "0.3.0"


def _register_sliced_classes() -> None:
    # compressor.models.sliced registers the built-in families when it is imported; if it is being
    # imported right now (it imported transformers), it does so when it finishes.
    if "compressor.models.sliced" not in sys.modules:
        importlib.import_module("compressor.models.sliced")


after_import("transformers", _register_sliced_classes)
