"""compressor: residual-stream pruning (SliceGPT and output-aware variants) for HF transformers.

Importing the package registers the sliced architectures with the transformers Auto
classes, so `AutoModelForCausalLM.from_pretrained(run_dir / "model")` works.
"""

from compressor.modeling import register_builtin_families

__version__ = "0.1.0"

register_builtin_families()
