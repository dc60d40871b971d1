"""The sliced architecture: a decoder whose residual stream has a different width at every site.

A sliced model keeps its family's attention and MLP modules (with resized input and output
linears) and wraps them in `SlicedDecoderLayer`, which adds the transition matrices
(`V_nextᵀ V_prev`) on the residual path and uses weightless norms (their scales were fused
into the following linears). Each family gets a `sliced_<model_type>` config and model
class, registered with the transformers Auto classes on `import compressor`, so a saved
pruned model reloads with `AutoModelForCausalLM.from_pretrained`.

This module's source travels with every saved per-site model (`models.export` writes it, after
`models.families`, into `modeling_sliced.py`), so from `compressor` it imports only names
defined in `compressor.models.families`, in one-line imports at the top; everything else comes
from the standard library, torch, transformers and huggingface_hub
(`tests/models/test_export.py` checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from compressor.models.families import BUILTIN_FAMILIES, ModelFamily, TokenMixer, stream_reader, stream_writers

SLICED_PREFIX = "sliced_"
PRIMARY_MIXER = "self_attn"
"""Where a sliced layer keeps the family's `attention` block (as it always has, e.g. GPT-2's `attn`)."""


class WeightlessRMSNorm(nn.Module):
    """RMSNorm without scale, normalising by the model's original hidden width.

    The scale is folded into the next linears. Dividing by the original width (not the
    sliced one) keeps the output identical when nothing is sliced and keeps the
    magnitude right when the removed directions carried little energy.
    """

    def __init__(self, reference_width: int, eps: float) -> None:
        super().__init__()
        self.reference_width = reference_width
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.promote_types(dtype, torch.float32))
        variance = x.pow(2).sum(-1, keepdim=True) / self.reference_width
        return (x * torch.rsqrt(variance + self.eps)).to(dtype)

    def extra_repr(self) -> str:
        return f"reference_width={self.reference_width}, eps={self.eps}"


class Site(NamedTuple):
    """One residual-stream site of a layer: the block that produces it, the linears that read
    the stream into that block, the linears that write its output, and the attribute holding
    the residual transition that carries the stream past it."""

    block: Callable[..., torch.Tensor]
    readers: list[nn.Linear]
    writers: list[nn.Linear]
    shortcut: str


class LayerForm(NamedTuple):
    """How the family's layer runs its blocks, which its sliced layer keeps: the attention-like
    block's attribute name and type, the arguments it takes by position, and whether attention and
    MLP read the same normed input in parallel."""

    attention_name: str = "self_attn"
    attention_type: str | None = None
    positional_args: tuple[str, ...] = ()
    parallel: bool = False


class SlicedDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm decoder layer whose residual stream changes basis (and width) at each site.
    (A `GradientCheckpointingLayer`, so training with gradient checkpointing recomputes it.)

    `attn_shortcut` maps the layer input (basis of the previous site) to the basis after
    attention; `mlp_shortcut` maps that to the basis after the MLP. A shortcut of None is
    the identity (the engine sets both as it works on the layer). The attention-like
    block is stored as `self_attn`, or under its own name where the family has several kinds
    (`LayerForm.attention_name`: Qwen3.5's `linear_attn`), so a hybrid layer keeps its original keys.
    `writers`: (output norm, writer linear) of "attn" and "mlp" where the family normalises block
    outputs (Gemma2: a weightless norm, then the writer linear).
    """

    def __init__(
        self,
        attention: nn.Module,
        mlp: nn.Module,
        attn_norm: nn.Module,
        mlp_norm: nn.Module,
        form: LayerForm,
        writers: dict[str, tuple[nn.Module, nn.Linear]] | None = None,
    ) -> None:
        super().__init__()
        self.positional_args = form.positional_args
        self.parallel = form.parallel
        self.attention_name = form.attention_name
        setattr(self, form.attention_name, attention)
        self.mlp = mlp
        self.input_layernorm = attn_norm
        self.post_attention_layernorm = mlp_norm
        self.attn_shortcut: nn.Linear | None = None
        self.mlp_shortcut: nn.Linear | None = None
        self.attn_output_norm, self.attn_writer = (writers or {}).get("attn") or (None, None)
        self.mlp_output_norm, self.mlp_writer = (writers or {}).get("mlp") or (None, None)
        if form.attention_type is not None:
            self.attention_type = form.attention_type
        self.unused_arguments: tuple[str, ...] = ()
        """Layer arguments its block does not take (`TokenMixer.unused`), set by `wrap_layer`."""

    @property
    def attention(self) -> nn.Module:
        """The layer's attention-like block, whatever it is called."""
        return getattr(self, self.attention_name)

    def mixer(self, family: ModelFamily) -> TokenMixer:
        """The family's description of this layer's attention-like block."""
        return family.mixers()[0] if self.attention_name == PRIMARY_MIXER else family.mixer_named(self.attention_name)

    def _mix(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The attention-like block's output (attention returns (output, weights); linear attention the output)."""
        out = self.attention(
            hidden_states=hidden_states, **{k: v for k, v in kwargs.items() if k not in self.unused_arguments}
        )
        return _first(out)

    def _feed_forward(self, normed: torch.Tensor) -> torch.Tensor:
        """The MLP's output (gpt-oss's MoE block returns (output, router scores))."""
        return _first(self.mlp(normed))

    @staticmethod
    def _shortcut(linear: nn.Linear | None, x: torch.Tensor) -> torch.Tensor:
        return x if linear is None else linear(x)

    @staticmethod
    def _write(norm: nn.Module | None, writer: nn.Linear | None, out: torch.Tensor) -> torch.Tensor:
        return out if writer is None else writer(norm(out))

    def attention_block(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        residual = self._shortcut(self.attn_shortcut, hidden_states)
        attn_out = self._mix(self.input_layernorm(hidden_states), **kwargs)
        return residual + self._write(self.attn_output_norm, self.attn_writer, attn_out)

    def mlp_block(self, hidden_states: torch.Tensor, **_: Any) -> torch.Tensor:
        """(Layer keyword arguments are accepted and unused, so every block is called alike.)"""
        residual = self._shortcut(self.mlp_shortcut, hidden_states)
        mlp_out = self._feed_forward(self.post_attention_layernorm(hidden_states))
        return residual + self._write(self.mlp_output_norm, self.mlp_writer, mlp_out)

    def sites(self, family: ModelFamily) -> list[Site]:
        """The layer's sites in order: after attention and after the MLP, or one for a parallel block."""
        attn_readers = [self.attention.get_submodule(p) for p in self.mixer(family).inputs]
        mlp_readers = family.mlp_readers(self.mlp)
        attn_writers, mlp_writers = self.writers("attn", family), self.writers("mlp", family)
        if self.parallel:
            return [Site(self.parallel_block, attn_readers + mlp_readers, attn_writers + mlp_writers, "attn_shortcut")]
        return [
            Site(self.attention_block, attn_readers, attn_writers, "attn_shortcut"),
            Site(self.mlp_block, mlp_readers, mlp_writers, "mlp_shortcut"),
        ]

    def writers(self, block: str, family: ModelFamily) -> list[nn.Linear]:
        """The linears that write `block`'s ("attn" or "mlp") output into the residual stream (a
        routed MoE's: every expert's down projection)."""
        own = self.attn_writer if block == "attn" else self.mlp_writer
        if own is not None:
            return [own]
        if block == "attn":
            return [self.attention.get_submodule(self.mixer(family).output)]
        return family.mlp_writers(self.mlp)

    def parallel_block(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Phi-2 style: attention and MLP read one norm; both outputs join the residual."""
        residual = self._shortcut(self.attn_shortcut, hidden_states)
        normed = self.input_layernorm(hidden_states)
        attn_out = self._mix(normed, **kwargs)
        return (
            residual
            + self._write(self.attn_output_norm, self.attn_writer, attn_out)
            + self._write(self.mlp_output_norm, self.mlp_writer, self._feed_forward(normed))
        )

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.update(zip(self.positional_args, args))  # families that pass layer arguments by position
        if self.parallel:
            return self.parallel_block(hidden_states, **kwargs)
        return self.mlp_block(self.attention_block(hidden_states, **kwargs))


def _first(out: Any) -> Any:
    """A block's output where it returns a pair (output, weights or scores)."""
    return out[0] if isinstance(out, tuple) else out


def _resize(module: nn.Module, **features: int) -> None:
    """Give a linear (in_features/out_features) or an embedding (embedding_dim) new widths, in
    place: the module keeps its class and buffers (e.g. Gemma's embedding scale). The new
    weights are uninitialised; they come from a checkpoint or from the engine."""
    for name, value in features.items():
        setattr(module, name, value)
    weight = module.weight
    shape = (
        (module.out_features, module.in_features)
        if isinstance(module, nn.Linear)
        else (module.num_embeddings, module.embedding_dim)
    )
    module.weight = nn.Parameter(torch.empty(shape, dtype=weight.dtype, device=weight.device), requires_grad=False)
    bias = getattr(module, "bias", None)
    if bias is not None and bias.shape[0] != module.out_features:
        module.bias = nn.Parameter(
            torch.empty(module.out_features, dtype=bias.dtype, device=bias.device), requires_grad=False
        )


def layer_mlp(family: ModelFamily, layer: nn.Module) -> nn.Module:
    """The MLP module of a decoder layer, wrapped by the engine (`SlicedDecoderLayer`) or as the family has it."""
    return layer.mlp if isinstance(layer, SlicedDecoderLayer) else family_mlp(family, layer)


def layer_attention(family: ModelFamily, layer: nn.Module) -> nn.Module | None:
    """The layer's attention, wrapped or as the family has it; None where the layer holds another
    kind of token mixer (Qwen3.5's linear attention)."""
    if isinstance(layer, SlicedDecoderLayer):
        return layer.attention if layer.attention_name == PRIMARY_MIXER else None
    return layer.get_submodule(family.attention) if family.mixer_of(layer).path == family.attention else None


def family_mlp(family: ModelFamily, layer: nn.Module) -> nn.Module:
    """The layer's MLP module (built from the layer's own linears where the family says so)."""
    return family.build_mlp(layer) if family.build_mlp is not None else layer.get_submodule(family.mlp)


def wrap_layer(
    family: ModelFamily,
    layer: nn.Module,
    reference_width: int,
    attn_eps: float | None,
    mlp_eps: float | None,
    writers: dict[str, tuple[nn.Module, nn.Linear]] | None = None,
) -> SlicedDecoderLayer:
    """Turn a family's decoder layer into a `SlicedDecoderLayer` sharing its modules.

    The norms are replaced by weightless ones: call only after their scales were fused.
    `writers` holds (output norm, writer linear) per block for families with output norms.
    """
    mixer = family.mixer_of(layer)
    form = LayerForm(
        attention_name=PRIMARY_MIXER if mixer.path == family.attention else mixer.path,
        attention_type=getattr(layer, "attention_type", None),
        positional_args=family.positional_args,
        parallel=family.parallel,
    )
    sliced = SlicedDecoderLayer(
        attention=layer.get_submodule(mixer.path),
        mlp=family_mlp(family, layer),
        attn_norm=stream_norm(family.attn_norm, reference_width, attn_eps),
        mlp_norm=stream_norm(family.mlp_norm, reference_width, mlp_eps),
        form=form,
        writers=writers,
    )
    sliced.unused_arguments = mixer.unused
    return sliced


def stream_norm(path: str | None, reference_width: int, eps: float | None) -> nn.Module:
    """What a sliced layer reads a block's input through: a weightless RMSNorm, or nothing where
    the family has no norm there (OLMo 2 normalises block outputs, not inputs)."""
    return nn.Identity() if path is None else WeightlessRMSNorm(reference_width, float(eps))


def apply_slicing_layout(model: PreTrainedModel, family: ModelFamily, slicing: dict[str, Any]) -> None:
    """Reshape a freshly built model into the sliced layout described by `slicing`.

    `slicing` holds `hidden_size` (original width), `embedding` (width after the embedding),
    `attn` and `mlp` (width after each layer's attention and MLP), and optionally `attn_shared`
    and `mlp_shared` (per layer: that site reuses the previous site's basis, so no transition
    matrix leads into it), and `tied_head` (the head shares the embedding's weights and reads
    a map of the last site's stream, a `Linear` after the final norm). Weights are left
    uninitialised: they come from a checkpoint or from the engine.
    """
    d = slicing["hidden_size"]
    no_attn_shortcut = slicing.get("attn_shared") or [False] * len(slicing["attn"])
    no_mlp_shortcut = slicing.get("mlp_shared") or [False] * len(slicing["mlp"])
    if family.prepare is not None:
        family.prepare(model)
    eps = float(slicing["norm_eps"]) if "norm_eps" in slicing else float(getattr(model.config, family.norm_eps))
    embedding = model.get_submodule(family.embedding)
    projection, embeddings = stream_writers(model, family)
    if projection is not None:
        _resize(projection, out_features=slicing["embedding"])
    for writer in embeddings:
        _resize(writer, embedding_dim=slicing["embedding"])
    layers = model.get_submodule(family.layers)
    width_in = slicing["embedding"]
    for index, (width_attn, width_mlp) in enumerate(zip(slicing["attn"], slicing["mlp"])):
        layer = layers[index]
        mixer = family.mixer_of(layer)
        attention, mlp = layer.get_submodule(mixer.path), family_mlp(family, layer)
        for path in mixer.inputs:
            _resize(attention.get_submodule(path), in_features=width_in)
        mlp_reads = width_in if family.parallel else width_attn  # a parallel MLP reads the layer input
        for linear in family.mlp_readers(mlp):
            _resize(linear, in_features=mlp_reads)
        writers = {}
        for block, post_norm, outputs, width in (
            ("attn", family.attn_post_norm, [attention.get_submodule(mixer.output)], width_attn),
            ("mlp", family.mlp_post_norm, family.mlp_writers(mlp), width_mlp),
        ):
            if post_norm is None:
                for output in outputs:
                    _resize(output, out_features=width)
            else:  # the block keeps width d; a writer after the output norm slices
                writer = nn.Linear(d, width, bias=False, device=embedding.weight.device, dtype=embedding.weight.dtype)
                writers[block] = (WeightlessRMSNorm(d, eps), writer)
        sliced = wrap_layer(family, layer, d, eps, eps, writers)
        dtype, device = embedding.weight.dtype, embedding.weight.device
        if not no_attn_shortcut[index]:  # a site that reuses the previous site's basis carries the stream as is
            sliced.attn_shortcut = nn.Linear(width_in, width_attn, bias=False, device=device, dtype=dtype)
        if not family.parallel and not no_mlp_shortcut[index]:  # a parallel layer has one site: one transition
            sliced.mlp_shortcut = nn.Linear(width_attn, width_mlp, bias=False, device=device, dtype=dtype)
        layers[index] = sliced
        width_in = width_mlp
    _slice_head(model, family, slicing, width_in, eps)


def _slice_head(
    model: PreTrainedModel, family: ModelFamily, slicing: dict[str, Any], width_in: int, eps: float
) -> None:
    """The final norm weightless at width d and the head reading the last site's `width_in` (or, tied,
    the embedding read through a small map after the norm)."""
    d, embedding = slicing["hidden_size"], model.get_submodule(family.embedding)
    reader = stream_reader(model, family)
    if slicing.get("tied_head"):  # the head is the embedding; a small map after the norm feeds it
        dtype, device = embedding.weight.dtype, embedding.weight.device
        mixer = nn.Linear(
            width_in, slicing["embedding"], bias=bool(slicing.get("reader_bias")), device=device, dtype=dtype
        )
        model.set_submodule(family.final_norm, nn.Sequential(WeightlessRMSNorm(d, eps), mixer))
        reader.in_features, reader.bias = slicing["embedding"], None
        reader.weight = embedding.weight
        return
    model.set_submodule(family.final_norm, WeightlessRMSNorm(d, eps))
    _resize(reader, in_features=width_in)
    if slicing.get("reader_bias") and reader.bias is None:  # LayerNorm families fold the final norm's bias here
        reader.bias = nn.Parameter(
            torch.empty(reader.out_features, dtype=reader.weight.dtype, device=reader.weight.device),
            requires_grad=False,
        )


def sliced_model_type(model_type: str) -> str:
    return SLICED_PREFIX + model_type


def _make_sliced_classes(family: ModelFamily, model_type: str) -> tuple[type, type]:
    """Config and causal-LM classes for `sliced_<model_type>`, subclassing the originals."""
    config_base = CONFIG_MAPPING[model_type]
    model_base = AutoModelForCausalLM._model_mapping[config_base]
    type_name = sliced_model_type(model_type)

    @strict
    class SlicedConfig(config_base):  # type: ignore[valid-type, misc]
        model_type = type_name
        slicing: dict | None = None

    SlicedConfig.__name__ = SlicedConfig.__qualname__ = f"Sliced{config_base.__name__}"

    def __init__(self: PreTrainedModel, config: PretrainedConfig) -> None:
        model_base.__init__(self, config)
        apply_slicing_layout(self, family, config.slicing)

    recorded = dict(getattr(model_base, "_can_record_outputs", None) or {})
    if "hidden_states" in recorded:
        recorded["hidden_states"] = SlicedDecoderLayer
    model_cls = type(
        f"Sliced{model_base.__name__}",
        (model_base,),
        {
            "config_class": SlicedConfig,
            "__init__": __init__,
            "_no_split_modules": ["SlicedDecoderLayer"],
            "_tied_weights_keys": getattr(model_base, "_tied_weights_keys", None),  # used when slicing.tied_head
            "_can_record_outputs": recorded,
            "__module__": __name__,
        },
    )
    return SlicedConfig, model_cls


_SLICED_CLASSES: dict[str, tuple[type, type]] = {}


def register_family(family: ModelFamily) -> None:
    """Register `sliced_<type>` configs and models for every model type of `family`."""
    for model_type in family.model_types:
        type_name = sliced_model_type(model_type)
        if type_name in _SLICED_CLASSES:
            continue
        config_cls, model_cls = _make_sliced_classes(family, model_type)
        AutoConfig.register(type_name, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
        _SLICED_CLASSES[type_name] = (config_cls, model_cls)


def sliced_classes(model_type: str) -> tuple[type, type]:
    """(config class, model class) of the sliced variant of `model_type`."""
    return _SLICED_CLASSES[sliced_model_type(model_type)]


def register_builtin_families() -> None:
    for family in BUILTIN_FAMILIES:
        register_family(family)


if __name__ == "compressor.models.sliced":  # the copy written into saved folders registers nothing
    register_builtin_families()
