"""Arcee (AFM) support for compressor, as a third-party plugin.

Arcee's decoder is Llama's with an ungated MLP (up_proj → ReLU² → down_proj), so its
description differs from Llama's in one field: the MLP reads the stream through `up_proj` only.
"""

from __future__ import annotations

from compressor.plugin import ModelFamily, hookimpl, register_family

ARCEE = ModelFamily(name="arcee", model_types=("arcee",), mlp_inputs=("up_proj",))

# Registering the sliced_arcee classes at import means `import compressor_arcee_family` is all a
# user needs before AutoModelForCausalLM.from_pretrained(<pruned arcee model>).
register_family(ARCEE)


@hookimpl
def compressor_model_families() -> list[ModelFamily]:
    return [ARCEE]
