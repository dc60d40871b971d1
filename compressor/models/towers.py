"""Vision-language checkpoints, pruned through their text tower.

A vision-language model (Qwen3.5's `Qwen3_5ForConditionalGeneration`, Gemma 3 4B and up) is a
language model whose stream receives, besides the token embeddings, image features from a
multimodal projector scattered into the image tokens' positions. The run takes the language
model out as its family's own causal-LM class (the same modules, no copy: `text_model`), prunes
it like any text model on text calibration data, and puts it back (`save_tower`): the projector
writes the stream as the embedding does, so its output is mapped into the pruned stream with the
embedding's basis and the stock stream scale (y -> c·Vᵀy); the vision encoder is untouched, and the
folder is the whole checkpoint, which plain transformers loads as its own class.

Only a global layout is saved this way (the original classes at a smaller width). A tower whose
class ties something else to the text width (Mistral 3's projector runs at it), or whose text
family cannot hold a rotated stream (Gemma 3), keeps the stream whole and prunes the text MLPs
alone (`models.mlp_only`); its projector is then saved as it was.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from compressor.errors import UserError


@dataclass(frozen=True)
class TextTower:
    """Where a vision-language class keeps its language model, head and projector output."""

    model_types: tuple[str, ...]
    projector: str
    """The linear (or bare weight) whose output is written into the stream at image tokens."""
    projector_transposed: bool = False
    """The projector is a bare (features × stream) weight used as x @ W (Gemma 3), not a linear."""
    language_model: str = "model.language_model"
    head: str = "lm_head"
    width_keys: tuple[str, ...] = ()
    """Config keys (dotted, from the top config) that hold the stream width besides
    text_config.hidden_size: set to the pruned width on saving (Qwen3.5's merger output)."""
    keeps_stream: str | None = None
    """Why this class cannot hold a narrower text stream, so a global layout keeps it whole and
    prunes the MLPs alone (None: it can, where the text family can)."""


BUILTIN_TOWERS: tuple[TextTower, ...] = (
    TextTower(
        ("qwen3_5", "qwen3_5_moe"), "model.visual.merger.linear_fc2", width_keys=("vision_config.out_hidden_size",)
    ),
    TextTower(("gemma3",), "model.multi_modal_projector.mm_input_projection_weight", projector_transposed=True),
    TextTower(
        ("mistral3",),
        "model.multi_modal_projector.linear_2",
        keeps_stream="its projector's hidden layer is as wide as the text model (text_config.hidden_size), "
        "which no rotation of the stream absorbs",
    ),
)

MULTIMODAL_KEYS = ("vision_config", "audio_config")


def tower_for(config: PretrainedConfig) -> TextTower | None:
    """The tower description of a vision-language config, None for a text model; a multimodal
    config that no description covers is refused in one line naming it."""
    for tower in BUILTIN_TOWERS:
        if config.model_type in tower.model_types:
            return tower
    if getattr(config, "text_config", None) is not None and any(
        getattr(config, key, None) is not None for key in MULTIMODAL_KEYS
    ):
        known = sorted(t for tower in BUILTIN_TOWERS for t in tower.model_types)
        raise UserError(
            f"model_type '{config.model_type}' ({', '.join(config.architectures or ['a multimodal class'])}) is a "
            f"vision-language checkpoint whose multimodal projector compressor does not describe, so its text "
            f"tower cannot be pruned; vision-language model types it can prune: {', '.join(known)}"
        )
    return None


def text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """A config.json's fields the text model reads: its `text_config` in a vision-language
    checkpoint, else the whole file (for code that reads the file without transformers)."""
    text = raw.get("text_config")
    return text if isinstance(text, dict) else raw


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config as its family's causal-LM class reads it: the text config, tied
    as the vision-language class ties its head (its top config says)."""
    text = copy.deepcopy(config.text_config)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    text.architectures = [causal_lm_class(text).__name__]
    return text


def causal_lm_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    return AutoModelForCausalLM._model_mapping[type(config)]


def text_model(whole: PreTrainedModel, tower: TextTower) -> PreTrainedModel:
    """The vision-language model's language model and head as its family's causal-LM class: the
    same modules (no copy), in a shell built on the meta device; the vision parts are dropped."""
    config = text_config(whole.config)
    config._attn_implementation = whole.config._attn_implementation
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    setattr(model, model.base_model_prefix, whole.get_submodule(tower.language_model))
    _set(model, "lm_head", whole.get_submodule(tower.head))
    if config.tie_word_embeddings:
        model.tie_weights()
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left:
        raise RuntimeError(f"{type(model).__name__} kept tensors the vision-language model does not hold: {left}")
    model.generation_config = whole.generation_config
    return model.eval()


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


@torch.no_grad()
def save_tower(
    whole: PreTrainedModel,
    tower: TextTower,
    pruned: PreTrainedModel,
    basis: torch.Tensor | None,
    scale: float,
    folder: Path,
) -> None:
    """Write the whole checkpoint into `folder`: `whole` (the original vision-language model, changed
    in place) with the pruned text model (the original class at width k) as its language model
    and head, and the projector's output mapped into the pruned stream, W -> c·VᵀW (`basis` V,
    d × k, the embedding's; `scale` c, the stock stream scale; None: the stream was kept whole,
    and so is the projector)."""
    _set(whole, tower.language_model, pruned.get_submodule(pruned.base_model_prefix))
    _set(whole, tower.head, pruned.get_submodule("lm_head"))
    k = int(pruned.config.hidden_size)
    text = copy.deepcopy(pruned.config)
    text.architectures = None
    whole.config.text_config = text
    whole.config.tie_word_embeddings = bool(pruned.config.tie_word_embeddings)
    for key in tower.width_keys:
        owner, _, name = key.rpartition(".")
        setattr(getattr(whole.config, owner), name, k)
    if basis is not None:
        _project(whole, tower, basis, scale)
    whole.save_pretrained(folder)


def _project(whole: PreTrainedModel, tower: TextTower, basis: torch.Tensor, scale: float) -> None:
    """The projector writes c·Vᵀy where it wrote y."""
    if tower.projector_transposed:
        parent, _, name = tower.projector.rpartition(".")
        owner = whole.get_submodule(parent)
        weight = getattr(owner, name)
        V = basis.to(weight.device, torch.float64)
        setattr(owner, name, nn.Parameter((weight.double() @ V * scale).to(weight.dtype), requires_grad=False))
        return
    linear = whole.get_submodule(tower.projector)
    V = basis.to(linear.weight.device, torch.float64)
    rotated = nn.Linear(linear.in_features, V.shape[1], bias=linear.bias is not None)
    rotated.weight = nn.Parameter((V.T @ linear.weight.double() * scale).to(linear.weight.dtype), requires_grad=False)
    if linear.bias is not None:
        rotated.bias = nn.Parameter((V.T @ linear.bias.double() * scale).to(linear.bias.dtype), requires_grad=False)
    _set(whole, tower.projector, rotated)


PROCESSOR_FILES = ("*processor*.json", "chat_template*", "*.jinja", "special_tokens_map.json")


def copy_processor_files(source: str, folder: Path) -> list[str]:
    """The image processor's and chat template's files of a local checkpoint, copied beside the
    saved model (the tokenizer is saved by the run), so the folder is a whole checkpoint."""
    copied: list[str] = []
    if not Path(source).is_dir():
        return copied
    for pattern in PROCESSOR_FILES:
        for path in Path(source).glob(pattern):
            if not (folder / path.name).exists():
                shutil.copy2(path, folder / path.name)
                copied.append(path.name)
    return copied
