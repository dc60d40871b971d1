"""The heterogeneous layout's saved format: DeciLM (`DeciLMForCausalLM`, `model_type: nemotron-nas`).

A stock Llama holds one MLP width for every layer; DeciLM holds one per layer (`block_configs`),
and vLLM (`nemotron_nas`) and llama.cpp (`deci`) serve it. The model the run prunes stays a Llama
in memory whose MLPs differ in width (a width of 0 writes nothing: the FFN is removed); `save_decilm`
writes it as DeciLM with this package's own configuration and modelling code beside the weights
(transformers loads the folder with `trust_remote_code=True`), after proving that the DeciLM class
takes its state dict whole. The engines' limits decide what the format can hold: every FFN width
is a multiple of 256 (they compute it from `ffn_mult`, rounding up to 256), and `head_dim` is
`hidden_size / num_attention_heads` (llama.cpp's converter derives it so), which is why the
heterogeneous layout keeps the residual stream whole (`models.mlp_only`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from compressor.errors import UserError
from compressor.models.decilm.configuration_decilm import DeciLMConfig, ffn_mult, ffn_width
from compressor.models.decilm.modeling_decilm import DeciLMForCausalLM
from compressor.models.families import family_for
from compressor.models.heads import attention_removed
from compressor.models.kv_heads import layer_kv_heads

FFN_STEP = 256
"""vLLM and llama.cpp round a DeciLM FFN's width up to a multiple of this."""

FAMILIES = ("llama",)
"""Families whose blocks are DeciLM's (Llama's modules, RMSNorm before each half, no biases on the MLP)."""

__all__ = [
    "FAMILIES",
    "FFN_STEP",
    "DeciLMConfig",
    "DeciLMForCausalLM",
    "decilm_config",
    "decilm_refusal",
    "save_decilm",
]


def decilm_refusal(config: PretrainedConfig) -> str | None:
    """Why a model of this config cannot be saved as DeciLM; None when it can."""
    if config.model_type not in FAMILIES:
        return f"its blocks are Llama's and {config.model_type} blocks are not"
    heads, d = config.num_attention_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or d // heads
    if heads * head_dim != d:
        return (
            f"llama.cpp's DeciLM converter derives head_dim from hidden_size / num_attention_heads, and this "
            f"model has {heads} heads of {head_dim} at hidden size {d}"
        )
    if getattr(config, "mlp_bias", False):
        return "the engines' DeciLM FFN has no biases, and this model's MLP has them"
    return None


def _blocks(
    config: PretrainedConfig, widths: Sequence[int], removed: Sequence[int], kv_heads: Sequence[int] | None
) -> list[dict[str, Any]]:
    heads, kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    if len(removed) == len(widths) and not any(widths):
        raise ValueError("every attention and every FFN removed leaves no block")
    layer_kv = list(kv_heads) if kv_heads is not None else [kv] * len(widths)
    if any(k and heads % k for k in layer_kv):
        raise ValueError(f"{heads} query heads cannot share KV heads {layer_kv} evenly")
    blocks = []
    for index, width in enumerate(widths):
        if width % FFN_STEP:
            raise ValueError(f"layer {index}'s MLP width {width} is not a multiple of {FFN_STEP}")
        ffn = (
            {"no_op": True, "ffn_mult": None}
            if width == 0
            else {"no_op": False, "ffn_mult": ffn_mult(width, config.hidden_size)}
        )
        assert width == 0 or ffn_width(ffn["ffn_mult"], config.hidden_size) == width
        attention = (
            {"no_op": True, "replace_with_linear": False, "n_heads_in_group": None}
            if index in removed
            else {"no_op": False, "replace_with_linear": False, "n_heads_in_group": heads // layer_kv[index]}
        )
        blocks.append({"attention": attention, "ffn": ffn})
    return blocks


def decilm_config(
    config: PretrainedConfig,
    widths: Sequence[int],
    removed: Sequence[int] = (),
    kv_heads: Sequence[int] | None = None,
) -> DeciLMConfig:
    """The DeciLM configuration of a Llama `config` whose layer i's MLP keeps `widths[i]` neurons,
    whose layers `removed` have no attention, and whose layer i keeps `kv_heads[i]` key-value
    heads (None: the config's in every layer)."""
    if len(widths) != config.num_hidden_layers:
        raise ValueError(f"{len(widths)} MLP widths for {config.num_hidden_layers} layers")
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "hidden_act")
    keep += ("max_position_embeddings", "rms_norm_eps", "attention_bias", "attention_dropout", "mlp_bias")
    keep += ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
    values = {key: getattr(config, key) for key in keep if getattr(config, key, None) is not None}
    rope = getattr(config, "rope_parameters", None)
    decilm = DeciLMConfig(
        **values,
        head_dim=config.hidden_size // config.num_attention_heads,
        rope_parameters=dict(rope) if rope else None,
        block_configs=_blocks(config, widths, removed, kv_heads),
        architectures=["DeciLMForCausalLM"],
    )
    decilm.dtype = getattr(config, "dtype", None)
    return decilm


def _widths(model: PreTrainedModel) -> list[int]:
    return [layer.mlp.down_proj.in_features for layer in model.model.layers]


def _kv_heads(model: PreTrainedModel) -> list[int]:
    return [layer_kv_heads(layer.self_attn, model.config) for layer in model.model.layers]


def removed_attentions(model: PreTrainedModel) -> list[int]:
    """The layers of the Llama `model` whose attention was removed (it holds no head)."""
    family = family_for(model.config.model_type)
    return [i for i, layer in enumerate(model.model.layers) if attention_removed(layer.self_attn, family)]


def decilm_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The Llama's state dict without the removed FFNs (width 0), the removed attentions, and the
    norms before them."""
    state = {}
    ffn = {i for i, width in enumerate(_widths(model)) if width == 0}
    attention = set(removed_attentions(model))
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            layer = int(parts[2])
            if layer in ffn and parts[3] in ("mlp", "post_attention_layernorm"):
                continue
            if layer in attention and parts[3] in ("self_attn", "input_layernorm"):
                continue
        state[name] = tensor
    return state


def save_decilm(model: PreTrainedModel, folder: Path) -> DeciLMConfig:
    """Write `model` (a Llama whose MLPs may differ in width, and whose attentions may be removed
    or hold fewer KV heads) to `folder` as DeciLM, with the
    configuration and modelling code beside the weights, after loading its state dict whole into
    the DeciLM class on the meta device."""
    refusal = decilm_refusal(model.config)
    if refusal is not None:
        raise UserError(f"slicing.layout: heterogeneous saves DeciLM: {refusal}; use slicing.layout: global")
    config = decilm_config(model.config, _widths(model), removed_attentions(model), _kv_heads(model))
    with torch.device("meta"):
        decilm = DeciLMForCausalLM(config)
    state = decilm_state(model)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing, unexpected = decilm.load_state_dict(state, strict=False, assign=True)
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"the DeciLM class does not take the pruned state dict: missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)}"
        )
    _rebuild_buffers(decilm)
    if config.tie_word_embeddings:
        decilm.tie_weights()
    decilm.generation_config = model.generation_config
    DeciLMConfig.register_for_auto_class()
    DeciLMForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    decilm.save_pretrained(folder)
    return config


def _rebuild_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (RoPE's inverse frequencies) stay on the meta device after a load:
    the saved folder does not hold them, so the rotary module is rebuilt on the host."""
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config.layer_config(0))
