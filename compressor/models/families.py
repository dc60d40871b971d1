"""Model families: where each part of a decoder-only transformer lives, described in one place.

The engine and the sliced model classes only ever reach a model's parts through a
`ModelFamily`, so supporting a new architecture means adding a description here, not
touching the engine.

This module's source travels with every saved per-site model (`models.export` writes it into
`modeling_sliced.py` beside `models.sliced`), so from `compressor` it imports only
`compressor.errors.UserError` (the generated file defines its own), in one-line imports at the
top; everything else comes from the standard library, torch and transformers
(`tests/models/test_export.py` checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from compressor.errors import UserError
from compressor.models.experts import RoutedExperts, fused_experts_state, gpt_oss_experts_state, unfuse_experts

STOCK_UNKNOWN = (
    "its description does not say that its own class can hold one residual basis (ModelFamily.stock_refusal)"
)
LAYER_NORM = "its LayerNorm subtracts the mean over the kept width, which a rotated, sliced stream does not keep"


QUERY = "q_proj"
"""The attention's query projection, where the family has it apart (`ModelFamily.attn_inputs`): the
linear that loses rows when query heads go (`models.heads`)."""


@dataclass(frozen=True)
class TokenMixer:
    """A decoder layer's attention-like block: its path in the layer, the linears (relative to it)
    that read the stream through the layer's first norm, and the one that writes its output."""

    path: str
    inputs: tuple[str, ...]
    output: str
    unused: tuple[str, ...] = ()
    """Layer arguments the family's own layer does not pass to this block (Qwen3.5's linear
    attention takes no position embeddings): a sliced layer leaves them out too."""


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
    attn_norm: str | None = "input_layernorm"
    """None (with `mlp_norm`): the block reads the raw stream, no norm before it (OLMo 2)."""
    attention: str = "self_attn"
    attn_inputs: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    attn_output: str = "o_proj"
    mlp_norm: str | None = "post_attention_layernorm"
    mlp: str = "mlp"
    mlp_inputs: tuple[str, ...] = ("gate_proj", "up_proj")
    mlp_output: str = "down_proj"
    mlp_width: str | None = "intermediate_size"
    """Config attribute of the MLP's intermediate width (the neurons `mlp:` prunes); None: not
    described, so the family's MLP width is not pruned."""
    experts: str | None = None
    """Config attribute of the routed experts' count in each MoE layer (the experts `experts:`
    prunes); None: the family has none."""
    shared_expert_width: str | None = None
    """Config attribute of the shared expert's intermediate width (Qwen2-MoE's, Qwen3.5-MoE's), which
    `mlp.shared_kept` prunes apart from the routed experts'; None, or absent from a model's config:
    no shared expert."""
    experts_per_token: str = "num_experts_per_tok"
    """Config attribute of how many experts each token is routed to."""
    routed_experts: str = "experts"
    """The MoE block's child that holds the routed experts: of its parameters a token uses only
    `experts_per_token` in `experts` (what active parameters count; the router and a shared expert
    are used whole)."""
    norm_eps: str = "rms_norm_eps"
    norm_offset: float = 0.0
    """The norm multiplies by (offset + weight): 0 for Llama, 1 for Gemma's (1 + w)."""
    logit_softcapping: str | None = None
    """Config attribute of a cap c applied as c·tanh(logits / c) after the head (Gemma2)."""
    logits_divisor: str | None = None
    """Config attribute of a divisor the model applies to the logits after the head (Granite)."""
    residual_multiplier: str | None = None
    """Config attribute of a factor on every block's output before the residual add (Granite):
    fusion folds it into the blocks' writers, and a stock model is saved with it set to 1."""
    other_mixers: tuple[TokenMixer, ...] = ()
    """Blocks a layer may hold in place of `attention` (Qwen3.5's linear attention on its
    `linear_attention` layers), each found by its path in the layer: a hybrid model's layers
    differ in what reads and writes the stream."""
    layer_norm: bool = False
    """LayerNorm family (mean and bias): every writer to the stream is centred and the norms'
    affine parts are folded into the next linears, which turns it into the RMSNorm form exactly."""
    extra_embeddings: tuple[str, ...] = ()
    """Further embeddings added to the token embeddings before the first layer (learned positions)."""
    build_mlp: Callable[[nn.Module], nn.Module] | None = None
    """For layers whose MLP linears sit on the layer itself: builds the MLP module from the layer."""
    refuse: Callable[[Any], str | None] | None = None
    """Given a model config, the reason this family cannot prune it (None when it can)."""
    prepare: Callable[[nn.Module], None] | None = None
    """Rewrites modules into the forms the engine handles, before anything else (Conv1D → Linear,
    fused experts → `RoutedExperts`)."""
    own_state: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """Undoes `prepare` on a state dict: its keys as the family's own class loads them (a stock save)."""
    positional_args: tuple[str, ...] = ()
    """Names of the arguments the model passes to each layer by position after the hidden states."""
    input_projection: str | None = None
    output_projection: str | None = None
    """Optional linears between the token embedding and the stream, and between the final norm
    and the head (OPT's project_in / project_out, present when word_embed_proj_dim differs)."""
    parallel: bool = False
    """Attention and MLP read one norm and write to the stream together (Phi-2): one site per layer."""
    head_width_is_embedding_width: bool = False
    """The model reshapes its output to the embedding's width (GPT-2), so the head input must be
    sliced like the embedding (slicing.slice_head: true)."""
    attn_post_norm: str | None = None
    mlp_post_norm: str | None = None
    """Norms applied to a block's output before the residual add (Gemma2). Their RMS is taken
    over the full width, so the block's output linear keeps width d and a separate writer
    V_newᵀ·diag(scale) (d → kept) follows the weightless norm: exact, at d·kept extra weights."""
    scaled_embedding: bool = False
    """The model multiplies the token embeddings by √hidden_size (Gemma), so a stock model of width
    k multiplies by √k where the original multiplied by √d."""
    stock_refusal: str | None = STOCK_UNKNOWN
    """Why the family's own class cannot hold a model pruned with one residual basis
    (`slicing.layout: global`, saved as the original architecture by `compressor.models.stock`); None
    when it can: pre-norm RMSNorm blocks whose state-dict keys the sliced model keeps."""

    def layouts(self) -> tuple[str, ...]:
        """The `slicing.layout` values a run of this family can save: `global` (the original class)
        where it can prune some axis stock (`stock_axes`)."""
        return ("per_site", "global") if self.stock_axes() else ("per_site",)

    def stock_axes(self) -> tuple[str, ...]:
        """What a global layout (saved as the original class) can prune: the residual width where the
        class can hold one rotated basis, the MLP's width wherever it is described (a class whose
        stream cannot be rotated keeps it whole: `models.mlp_only`), the routed experts beside a
        rotated stream."""
        residual = ("residual",) if self.stock_refusal is None else ()
        experts = ("experts",) if residual and self.experts is not None else ()  # beside a rotated stream
        return residual + (("mlp",) if self.mlp_width is not None else ()) + experts

    def mlp_readers(self, mlp: nn.Module) -> list[nn.Module]:
        """The linears that read the stream into this layer's MLP: a routed MoE's router and every
        expert's input projections (`RoutedExperts.readers`), else the family's `mlp_inputs`."""
        if isinstance(mlp, RoutedExperts):
            return mlp.readers()
        return [mlp.get_submodule(path) for path in self.mlp_inputs]

    def mlp_writers(self, mlp: nn.Module) -> list[nn.Module]:
        """The linears that write this layer's MLP output into the stream (every expert's down
        projection, for a routed MoE)."""
        if isinstance(mlp, RoutedExperts):
            return mlp.writers()
        return [mlp.get_submodule(self.mlp_output)]

    def mixers(self) -> tuple[TokenMixer, ...]:
        """Every attention-like block a layer of this family may hold; the first is `attention`."""
        return (TokenMixer(self.attention, self.attn_inputs, self.attn_output), *self.other_mixers)

    def mixer_of(self, layer: nn.Module) -> TokenMixer:
        """The block this (original) decoder layer holds: the first whose path it has."""
        for mixer in self.mixers():
            if optional_module(layer, mixer.path) is not None:
                return mixer
        raise ValueError(f"{self.name}: the layer holds none of {', '.join(m.path for m in self.mixers())}")

    def mixer_named(self, path: str) -> TokenMixer:
        """The block stored at `path` (a sliced layer records it)."""
        return next(mixer for mixer in self.mixers() if mixer.path == path)

    def head_modules(self, model: nn.Module) -> list[nn.Module]:
        """What turns the last site's stream into logits, in order: final norm, output projection
        (where the model has one), head."""
        projection = optional_module(model, self.output_projection)
        return [
            model.get_submodule(self.final_norm),
            *([projection] if projection is not None else []),
            model.get_submodule(self.head),
        ]

    def logits(
        self,
        model: nn.Module,
        hidden: Any,
        before_cap: Callable[[Any], Any] | None = None,
        head: Callable[[Any], Any] | None = None,
    ) -> Any:
        """The model's logits from the stream after the last layer: the head modules (or `head`,
        which replaces them: a stock model's tied head), then the family's divisor and logit
        soft-cap c·tanh(logits / c) where it has them. The H pass and every diagnostic forward go
        through here, so they compute what the model computes. `before_cap` maps the head's output
        first (refinement's tied head)."""
        for module in [head] if head is not None else self.head_modules(model):
            hidden = module(hidden)
        if before_cap is not None:
            hidden = before_cap(hidden)
        divisor = getattr(model.config, self.logits_divisor) if self.logits_divisor else None
        if divisor is not None:
            hidden = hidden / divisor
        cap = getattr(model.config, self.logit_softcapping, None) if self.logit_softcapping else None
        return hidden if cap is None else torch.tanh(hidden / cap) * cap


class FeedForward(nn.Module):
    """fc1 → activation → fc2, gathered from a layer that holds them directly (OPT)."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, activation: nn.Module) -> None:
        super().__init__()
        self.fc1, self.fc2, self.activation = fc1, fc2, activation

    def forward(self, hidden_states: Any) -> Any:
        return self.fc2(self.activation(self.fc1(hidden_states)))


def _opt_mlp(layer: nn.Module) -> nn.Module:
    return FeedForward(layer.fc1, layer.fc2, layer.activation_fn)


def _opt_refusal(config: Any) -> str | None:
    if not config.do_layer_norm_before:
        return "OPT with layer norms after the blocks (do_layer_norm_before: false, e.g. opt-350m) is not supported"
    return None


def optional_module(model: nn.Module, path: str | None) -> nn.Module | None:
    """The module at `path`, or None where the family has none or this model leaves it unset."""
    if path is None:
        return None
    try:
        return model.get_submodule(path)
    except AttributeError:  # e.g. OPT sets project_in = None when no projection is needed
        return None


def stream_writers(model: nn.Module, family: ModelFamily) -> tuple[nn.Module | None, list[nn.Module]]:
    """What writes the stream before the first layer: the input projection (None without one) and
    the embeddings added to the stream directly (the token embedding, unless a projection carries
    it, and learned positions)."""
    projection = optional_module(model, family.input_projection)
    paths = ((family.embedding,) if projection is None else ()) + family.extra_embeddings
    return projection, [model.get_submodule(path) for path in paths]


def is_routed_parameter(family: ModelFamily, name: str) -> bool:
    """`name` (a parameter's path) lies under a layer's routed experts (`ModelFamily.routed_experts`)."""
    return family.experts is not None and f".{family.mlp}.{family.routed_experts}." in f".{name}"


def stream_reader(model: nn.Module, family: ModelFamily) -> nn.Module:
    """What reads the stream after the final norm: the output projection, or the head."""
    return optional_module(model, family.output_projection) or model.get_submodule(family.head)


def _conv1d_to_linear(model: nn.Module) -> None:
    """Replace GPT-2's Conv1D (y = x·W + b, W stored in × out) with the equivalent nn.Linear."""
    from transformers.pytorch_utils import Conv1D

    for name, module in list(model.named_modules()):
        if isinstance(module, Conv1D):
            weight = module.weight
            linear = nn.Linear(
                weight.shape[0], weight.shape[1], bias=module.bias is not None, device=weight.device, dtype=weight.dtype
            )
            linear.weight.data = weight.data.T.contiguous() if weight.device.type != "meta" else linear.weight.data
            if module.bias is not None:
                linear.bias.data = module.bias.data
            model.set_submodule(name, linear)


def _gpt2_refusal(config: Any) -> str | None:
    if getattr(config, "add_cross_attention", False):
        return "GPT-2 with cross-attention (add_cross_attention: true) is not supported"
    return None


LLAMA = ModelFamily(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3", "smollm3"),  # SmolLM3: NoPE on some layers
    stock_refusal=None,
)
PHI3 = ModelFamily(
    name="phi3", model_types=("phi3",), attn_inputs=("qkv_proj",), mlp_inputs=("gate_up_proj",), stock_refusal=None
)
GEMMA = ModelFamily(name="gemma", model_types=("gemma",), norm_offset=1.0, scaled_embedding=True, stock_refusal=None)
GEMMA2 = ModelFamily(
    name="gemma2",
    model_types=("gemma2",),
    norm_offset=1.0,
    mlp_norm="pre_feedforward_layernorm",
    logit_softcapping="final_logit_softcapping",
    attn_post_norm="post_attention_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
    scaled_embedding=True,
    stock_refusal="its norms after each block's output take the RMS over the full width",
)
GEMMA3 = ModelFamily(
    name="gemma3",
    model_types=("gemma3_text",),  # sliding and full attention layers (their RoPE bases reach each layer)
    norm_offset=1.0,
    mlp_norm="pre_feedforward_layernorm",
    logit_softcapping="final_logit_softcapping",
    attn_post_norm="post_attention_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
    scaled_embedding=True,
    stock_refusal=GEMMA2.stock_refusal,
)
OLMO2 = ModelFamily(
    name="olmo2",
    model_types=("olmo2", "olmo3"),  # no norm before a block, one after it; QK-norm over the whole projection
    attn_norm=None,
    mlp_norm=None,
    attn_post_norm="post_attention_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
    stock_refusal=GEMMA2.stock_refusal,
)
GRANITE = ModelFamily(
    name="granite",
    model_types=("granite",),  # embedding and attention multipliers stay where the model applies them
    residual_multiplier="residual_multiplier",
    logits_divisor="logits_scaling",
    stock_refusal=None,
)
QWEN3_5 = ModelFamily(
    name="qwen3_5",
    model_types=("qwen3_5_text",),
    norm_offset=1.0,  # (1 + w) norms
    other_mixers=(
        TokenMixer(
            "linear_attn",
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
            "out_proj",
            unused=("position_embeddings", "position_ids"),
        ),
    ),  # Gated DeltaNet on the `linear_attention` layers; full attention (gated q) on the others
    stock_refusal=None,
)
MOE = ModelFamily(
    name="moe",
    model_types=("qwen3_moe", "qwen2_moe"),  # Qwen2-MoE: a shared expert and its sigmoid gate
    mlp_width="moe_intermediate_size",  # every routed expert's (dense layers and a shared expert keep theirs)
    experts="num_experts",  # every MoE config maps it (Qwen3-MoE's to num_local_experts)
    shared_expert_width="shared_expert_intermediate_size",  # Qwen2-MoE's (a Qwen3-MoE config has none)
    prepare=unfuse_experts,
    own_state=fused_experts_state,
    stock_refusal=None,
)
MIXTRAL = replace(
    MOE, name="mixtral", model_types=("mixtral",), mlp_width="intermediate_size", shared_expert_width=None
)
OLMOE = replace(
    MOE,
    name="olmoe",
    model_types=("olmoe",),
    mlp_width="intermediate_size",
    shared_expert_width=None,
    stock_refusal="its q_norm and k_norm are sized by hidden_size, which a stock model of width k would change",
)
GPT_OSS = replace(
    MOE,
    name="gpt_oss",
    model_types=("gpt_oss",),  # router bias, fused experts transposed and interleaved with biases, attention sinks
    mlp_width="intermediate_size",
    shared_expert_width=None,
    own_state=gpt_oss_experts_state,
)
QWEN3_5_MOE = replace(
    QWEN3_5,
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe_text",),  # Qwen3.5's hybrid layers, each MLP a routed MoE with a gated shared expert
    mlp_width="moe_intermediate_size",
    experts="num_experts",
    shared_expert_width="shared_expert_intermediate_size",
    prepare=unfuse_experts,
    own_state=fused_experts_state,
)

OPT = ModelFamily(
    name="opt",
    model_types=("opt",),
    base_model="model.decoder",
    embedding="model.decoder.embed_tokens",
    layers="model.decoder.layers",
    final_norm="model.decoder.final_layer_norm",
    attn_norm="self_attn_layer_norm",
    attn_output="out_proj",
    mlp_norm="final_layer_norm",
    mlp_inputs=("fc1",),
    mlp_output="fc2",
    mlp_width="ffn_dim",
    layer_norm=True,
    extra_embeddings=("model.decoder.embed_positions",),
    build_mlp=_opt_mlp,
    refuse=_opt_refusal,
    stock_refusal=LAYER_NORM,
    input_projection="model.decoder.project_in",
    output_projection="model.decoder.project_out",
)

GPT2 = ModelFamily(
    name="gpt2",
    model_types=("gpt2",),
    base_model="transformer",
    embedding="transformer.wte",
    layers="transformer.h",
    final_norm="transformer.ln_f",
    attention="attn",
    attn_norm="ln_1",
    attn_inputs=("c_attn",),
    attn_output="c_proj",
    mlp_norm="ln_2",
    mlp_inputs=("c_fc",),
    mlp_output="c_proj",
    mlp_width=None,  # n_inner, usually null (4 × n_embd)
    norm_eps="layer_norm_epsilon",
    layer_norm=True,
    extra_embeddings=("transformer.wpe",),
    prepare=_conv1d_to_linear,
    positional_args=("cache", "attention_mask", "encoder_hidden_states"),
    refuse=_gpt2_refusal,
    head_width_is_embedding_width=True,
    stock_refusal=LAYER_NORM,
)

PHI = ModelFamily(
    name="phi",
    model_types=("phi",),
    final_norm="model.final_layernorm",
    attn_output="dense",
    mlp_norm="input_layernorm",
    mlp_inputs=("fc1",),
    mlp_output="fc2",
    norm_eps="layer_norm_eps",
    layer_norm=True,
    parallel=True,
    stock_refusal=LAYER_NORM,
)

BUILTIN_FAMILIES: tuple[ModelFamily, ...] = (
    LLAMA,
    PHI3,
    GEMMA,
    GEMMA2,
    GEMMA3,
    OLMO2,
    GRANITE,
    QWEN3_5,
    QWEN3_5_MOE,
    MOE,
    MIXTRAL,
    GPT_OSS,
    OLMOE,
    OPT,
    GPT2,
    PHI,
)


NOT_YET: dict[str, str] = {
    "deepseek_v3": "its router scores by sigmoid with a correction bias and picks experts within groups "
    "(n_group, topk_group), which RoutedExperts does not reproduce yet, and its attention is multi-head latent",
}
"""Model types known and not described yet, each with why: the refusal says it, not only that the
type is missing (issue 48 names these families)."""


def family_for(model_type: str, families: Mapping[str, ModelFamily] | None = None) -> ModelFamily:
    """The family that describes `model_type` (among `families`, by model_type; default: the
    built-ins), or a UserError naming the supported ones (and, for a type in `NOT_YET`, why not)."""
    known = families if families is not None else {t: f for f in BUILTIN_FAMILIES for t in f.model_types}
    if model_type in known:
        return known[model_type]
    why = f" yet: {NOT_YET[model_type]}" if model_type in NOT_YET else ""
    raise UserError(
        f"model_type '{model_type}' is not supported{why}; supported model types: {', '.join(sorted(known))} "
        f"(a plugin can add a family: see docs/adding-a-model-family.md)"
    )
