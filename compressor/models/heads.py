"""Query heads as a pruning axis: how many a model has, which classes can hold fewer, the config
that says so, and the heads taken out of one attention module in place.

A layer keeps the same number of query heads in every KV group (the heads that share one key and
value head: head h reads KV head h // (heads / kv_heads)), so the model stays grouped-query
attention with `num_attention_heads` = kept and `head_dim` written explicitly. Where every query
head has its own KV head (multi-head attention) a KV head goes with its query head. The family's
own class must build its attention from `num_attention_heads` and `head_dim` and hold nothing
else that spans the heads together: this is measured on the meta device (`heads_refusal`), not
listed per family, so OLMo 2's query norm over every head, or a class computing
hidden_size / heads, is refused by what it builds.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig

from compressor.errors import UserError
from compressor.models.budget import meta_model
from compressor.models.families import QUERY, ModelFamily
from compressor.models.sliced import layer_attention


def query_heads(config: PretrainedConfig) -> int:
    return int(config.num_attention_heads)


def kv_heads(config: PretrainedConfig) -> int:
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def head_dim(config: PretrainedConfig) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def kept_heads(config: PretrainedConfig, family: ModelFamily, kept: float) -> int:
    """The query heads every attention layer keeps: `kept` itself, or (below 1) that fraction of
    them rounded down to a whole number per KV group; refused in one line where it cannot be."""
    heads, groups = query_heads(config), kv_heads(config)
    grouped = groups < heads  # else multi-head attention: a KV head goes with its query head
    step = groups if grouped else 1
    count = int(kept) if kept >= 1 else int(kept * heads) // step * step
    if not 0 < count < heads:
        raise UserError(f"heads.kept {kept:g}: keep from 1 to {heads - 1} of the {heads} query heads")
    if grouped and count % groups:
        raise UserError(
            f"heads.kept {count}: every one of the {groups} KV groups keeps the same number of its "
            f"{heads // groups} query heads, so keep a multiple of {groups}"
        )
    refusal = heads_refusal(config, family)
    if refusal is not None:
        raise UserError(f"heads: {family.name} models cannot hold fewer query heads: {refusal}; remove heads")
    try:  # the config class's own validation (LlamaConfig wants hidden_size a multiple of the heads)
        type(config).from_dict(with_heads(config, count).to_dict())
    except Exception as error:  # noqa: BLE001 (transformers raises several kinds)
        raise UserError(
            f"heads.kept {count}: {type(config).__name__} refuses {count} heads at hidden_size {config.hidden_size} "
            f"({str(error).splitlines()[0][:120]}); keep a count that divides {config.hidden_size}"
        ) from None
    return count


def with_heads(config: PretrainedConfig, heads: int) -> PretrainedConfig:
    """`config` with `heads` query heads (and as many KV heads in multi-head attention), `head_dim`
    written out."""
    changed = copy.deepcopy(config)
    set_heads(changed, heads)
    return changed


def set_heads(config: PretrainedConfig, heads: int) -> None:
    """`with_heads` in place (the run's model's own config at the end of the stage)."""
    width, multi_head = head_dim(config), kv_heads(config) == query_heads(config)
    config.head_dim = width
    config.num_attention_heads = heads
    if multi_head and hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = heads


def heads_refusal(config: PretrainedConfig, family: ModelFamily) -> str | None:
    """Why the family's class cannot hold fewer query heads of this config (None: it can), from the
    attention it builds on the meta device with fewer heads."""
    if QUERY not in family.attn_inputs:
        return "its attention computes queries in one linear with keys and values"
    heads, groups = query_heads(config), kv_heads(config)
    fewer = heads - groups if groups < heads else heads - 1  # one head fewer in every KV group
    whole, smaller = _first_attention(config, family), _first_attention(with_heads(config, fewer), family)
    if whole is None or smaller is None:
        return "no layer holds its attention"
    for name in (QUERY, family.attn_output):
        linear, before = smaller.get_submodule(name), whole.get_submodule(name)
        size, was = (
            (linear.out_features, before.out_features) if name == QUERY else (linear.in_features, before.in_features)
        )
        if size * heads != was * fewer:
            return "its attention does not read head_dim from the config (it divides the hidden size by the heads)"
    linears = {id(p) for m in smaller.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    before_shapes = {name: p.shape for name, p in whole.named_parameters()}
    for name, parameter in smaller.named_parameters():
        if id(parameter) in linears or parameter.shape == before_shapes[name]:
            continue
        if (
            "." in name or parameter.shape[0] != fewer or before_shapes[name][0] != heads
        ):  # a direct per-head one is cut
            return f"its attention's {name} spans every head together"
    return None


def _first_attention(config: PretrainedConfig, family: ModelFamily) -> nn.Module | None:
    layers = meta_model(config).get_submodule(family.layers)
    return next((a for a in (layer_attention(family, layer) for layer in layers) if a is not None), None)


def drop_heads(
    attention: nn.Module, family: ModelFamily, heads: int, kv: int, kept: torch.Tensor, down: torch.Tensor
) -> None:
    """Keep query heads `kept` (sorted indices) of `attention`'s `heads`, in place: the query
    projection's rows of each kept head (a gated query's 2·head_dim rows too), its KV heads' rows
    in multi-head attention (`kv` == `heads`), a per-head parameter's entries (gpt-oss's sinks),
    and the output projection's weight set to `down` (d × kept·head_dim)."""
    output = attention.get_submodule(family.attn_output)
    width = output.in_features // heads
    multi_head = kv == heads
    for name in family.attn_inputs if multi_head else (QUERY,):
        linear = attention.get_submodule(name)
        _keep_rows(linear, kept, linear.out_features // heads)
    for name, parameter in list(attention.named_parameters(recurse=False)):
        if parameter.dim() >= 1 and parameter.shape[0] == heads:
            setattr(
                attention, name, nn.Parameter(parameter.data[kept.to(parameter.device)].clone(), requires_grad=False)
            )
    output.weight = nn.Parameter(down.to(output.weight.device, output.weight.dtype).contiguous(), requires_grad=False)
    output.in_features = len(kept) * width
    new_kv = len(kept) if multi_head else kv
    for attribute, value in (
        ("num_key_value_groups", len(kept) // new_kv),
        ("num_heads", len(kept)),
        ("num_attention_heads", len(kept)),
        ("num_key_value_heads", new_kv),
    ):
        if isinstance(getattr(attention, attribute, None), int):
            setattr(attention, attribute, value)


def remove_attention(attention: nn.Module, family: ModelFamily) -> None:
    """Remove `attention` in place (DeciLM's `no_op` attention): every projection keeps no head and
    the output projection no bias, so it writes nothing to the stream and holds no parameters. Its
    KV cache layer stays empty (length 0): a model that reads the cache's length from that layer
    must be given positions (the saved DeciLM reads it from its first kept attention)."""
    none = torch.zeros(0, dtype=torch.long)
    for name in family.attn_inputs:
        _keep_rows(attention.get_submodule(name), none, 1)
    output = attention.get_submodule(family.attn_output)
    output.weight = nn.Parameter(output.weight.data[:, :0].clone(), requires_grad=False)
    output.bias = None
    output.in_features = 0


def attention_removed(attention: nn.Module, family: ModelFamily) -> bool:
    """Whether `attention` was removed by `remove_attention`."""
    return attention.get_submodule(family.attn_output).in_features == 0


def _keep_rows(linear: nn.Linear, kept: torch.Tensor, rows: int) -> None:
    offsets = torch.arange(rows)
    index = (kept.cpu().reshape(-1, 1) * rows + offsets).flatten().to(linear.weight.device)
    linear.weight = nn.Parameter(linear.weight.data[index].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[index].clone(), requires_grad=False)
    linear.out_features = len(index)
