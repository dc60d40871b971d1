"""Model families: where each part of a decoder-only transformer lives, described in one place.

The engine and the sliced model classes only ever reach a model's parts through a
`ModelFamily`, so supporting a new architecture means adding a description here, not
touching the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from compressor.errors import UserError


@dataclass(frozen=True)
class ModelFamily:
    """Module paths of a pre-norm decoder with RMSNorm, relative to the causal-LM model.

    `attention`, `mlp` and the norms are relative to one decoder layer; the input and
    output linears are relative to their attention or MLP module, so they stay valid once
    the layer is wrapped. "Inputs" read the residual stream (through the norm); the
    "output" linear writes to it.
    """

    name: str
    model_types: tuple[str, ...]
    base_model: str = "model"
    embedding: str = "model.embed_tokens"
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    head: str = "lm_head"
    attn_norm: str = "input_layernorm"
    attention: str = "self_attn"
    attn_inputs: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    attn_output: str = "o_proj"
    mlp_norm: str = "post_attention_layernorm"
    mlp: str = "mlp"
    mlp_inputs: tuple[str, ...] = ("gate_proj", "up_proj")
    mlp_output: str = "down_proj"
    norm_eps: str = "rms_norm_eps"
    norm_offset: float = 0.0
    """The norm multiplies by (offset + weight): 0 for Llama, 1 for Gemma's (1 + w)."""
    logit_softcapping: str | None = None
    """Config attribute of a cap c applied as c·tanh(logits / c) after the head (Gemma2)."""
    attn_post_norm: str | None = None
    mlp_post_norm: str | None = None
    """Norms applied to a block's output before the residual add (Gemma2). Their RMS is taken
    over the full width, so the block's output linear keeps width d and a separate writer
    V_newᵀ·diag(scale) (d → kept) follows the weightless norm: exact, at d·kept extra weights."""


LLAMA = ModelFamily(name="llama", model_types=("llama", "mistral", "qwen2", "qwen3"))
PHI3 = ModelFamily(name="phi3", model_types=("phi3",), attn_inputs=("qkv_proj",), mlp_inputs=("gate_up_proj",))
GEMMA = ModelFamily(name="gemma", model_types=("gemma",), norm_offset=1.0)
GEMMA2 = ModelFamily(name="gemma2", model_types=("gemma2",), norm_offset=1.0, mlp_norm="pre_feedforward_layernorm",
                     logit_softcapping="final_logit_softcapping",
                     attn_post_norm="post_attention_layernorm", mlp_post_norm="post_feedforward_layernorm")

BUILTIN_FAMILIES: tuple[ModelFamily, ...] = (LLAMA, PHI3, GEMMA, GEMMA2)


def family_for(model_type: str, families: Mapping[str, ModelFamily] | None = None) -> ModelFamily:
    """The family that describes `model_type` (among `families`, by model_type; default: the
    built-ins), or a UserError naming the supported ones."""
    known = families if families is not None else {t: f for f in BUILTIN_FAMILIES for t in f.model_types}
    if model_type in known:
        return known[model_type]
    raise UserError(
        f"model_type '{model_type}' is not supported; supported model types: {', '.join(sorted(known))} "
        f"(a plugin can add a family: see docs/adding-a-model-family.md)"
    )
