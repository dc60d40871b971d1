"""Fewer key-value heads in one attention layer: the heterogeneous layout's per-layer KV heads
(DeciLM's `n_heads_in_group`, which vLLM and llama.cpp read per layer).

A layer of `kv` KV heads may keep any divisor `k` of them: consecutive groups of kv/k KV heads
merge into one, whose key and value projections are the mean of theirs (the mean-pooling of
grouped-query attention's uptraining; RoPE rotates after the projection, so it commutes), and every
query head of the merged groups reads it. Query head h reads KV head h // (heads / k) after the
merge, as it read h // (heads / kv) before it, so no query head moves. The output projection is
then refitted to what the attention wrote before (`engine.kv_merge`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from compressor.models.families import ModelFamily
from compressor.models.heads import head_dim, kv_heads

KEY, VALUE = "k_proj", "v_proj"
"""The attention's key and value projections (Llama's names: DeciLM's blocks are Llama's)."""


def kv_options(config: PretrainedConfig) -> list[int]:
    """The KV-head counts a layer may keep below the model's own: its divisors, fewest first."""
    kv = kv_heads(config)
    return [k for k in range(1, kv) if kv % k == 0]


def layer_kv_heads(attention: nn.Module, config: PretrainedConfig) -> int:
    """How many KV heads `attention` holds now (0: it was removed)."""
    return attention.get_submodule(KEY).out_features // head_dim(config)


def kv_head_parameters(attention: nn.Module, config: PretrainedConfig) -> int:
    """The parameters one KV head holds in `attention`: its rows of the key and value projections."""
    return sum(
        head_dim(config) * (linear.in_features + (linear.bias is not None))
        for linear in (attention.get_submodule(KEY), attention.get_submodule(VALUE))
    )


def merge_kv_heads(attention: nn.Module, config: PretrainedConfig, kv: int) -> None:
    """Keep `kv` KV heads in `attention`, in place: each merged group's key and value rows become
    their mean, and `num_key_value_groups` says how many query heads read each (the output
    projection is left as it was)."""
    width, had = head_dim(config), layer_kv_heads(attention, config)
    if kv <= 0 or had % kv:
        raise ValueError(f"{had} KV heads cannot merge into {kv}")
    for name in (KEY, VALUE):
        linear = attention.get_submodule(name)
        weight = linear.weight.data.reshape(kv, had // kv, width, -1).mean(1).reshape(kv * width, -1)
        linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        if linear.bias is not None:
            bias = linear.bias.data.reshape(kv, had // kv, width).mean(1).reshape(-1)
            linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
        linear.out_features = kv * width
    for attribute, value in (
        ("num_key_value_groups", config.num_attention_heads // kv),
        ("num_key_value_heads", kv),
    ):
        if isinstance(getattr(attention, attribute, None), int):
            setattr(attention, attribute, value)


def set_output(attention: nn.Module, family: ModelFamily, weight: torch.Tensor) -> None:
    """The output projection's weight set to `weight` (the refit), in its dtype and device."""
    output = attention.get_submodule(family.attn_output)
    output.weight = nn.Parameter(weight.to(output.weight.device, output.weight.dtype).contiguous(), requires_grad=False)
