"""Saving: the folder users load (a global layout's saved as the original class and loaded back,
so what is evaluated is what users load), the tokenizer and the bases."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PreTrainedModel

from compressor.engine.bases import BASES_FILE, READERS_FILE, save_bases
from compressor.models.decilm import save_decilm
from compressor.models.export import write_remote_code
from compressor.models.sites import EMBEDDING
from compressor.models.stock import load_stock, save_own_class, to_stock
from compressor.models.towers import copy_processor_files, save_tower, text_fields
from compressor.run.costs import TimedPhase, Work
from compressor.run.loading import load_model, load_whole
from compressor.run.stages.base import RunState
from compressor.run.stages.contract import Stage
from compressor.validation import replaced


class Save(Stage):
    name = "saving model"
    timing = "save_s"

    def seconds(self, work: Work) -> list[TimedPhase]:
        return []  # reading, loading and writing files: not estimated, small beside the passes

    def run(self, state: RunState) -> None:
        save(state, state.save_model)


def save(state: RunState, save_model: bool) -> None:
    """ "saving model": the folder users load (a global layout's saved as the original class and
    loaded back, so what is evaluated is what users load), the tokenizer and the bases."""
    staging, pruned = state.staging, state.pruned
    state.progress("saving model" if save_model else "saving bases", 0, 1)
    if not state.checked.layout.residual:  # the original class with narrower MLPs
        pruned = save_mlp_alone(state, pruned, save_model)
    elif state.writes and state.one_basis:  # the walk wrote the stock model as it went
        state.stock = state.result.stock
    elif state.one_basis and state.distillation is None and state.checked.tower is not None:
        pruned, state.stock = to_stock(
            pruned,
            state.family,
            state.config,
            tie=state.checked.layout.tie_head,
            stream=state.head_stream(),
            scale=state.head_scale,
        )
        if save_model:  # the whole vision-language checkpoint, loaded back as users load it
            pruned = save_whole_tower(state, pruned, staging / "model", state.bases[EMBEDDING])
    elif state.one_basis and state.distillation is None:
        pruned, state.stock = to_stock(
            pruned,
            state.family,
            state.config,
            staging / "model" if save_model else None,
            tie=state.checked.layout.tie_head,
            stream=state.head_stream(),
            scale=state.head_scale,
        )
    elif state.one_basis and save_model:  # already the original class (distilled): saved and loaded back
        pruned.save_pretrained(staging / "model")
        pruned = load_stock(staging / "model", pruned)
    elif save_model:
        if not state.writes:  # else the walk wrote it, layer by layer
            pruned.save_pretrained(staging / "model")
        write_remote_code(staging / "model", state.family, state.config.model_type)
    state.pruned = pruned
    if save_model:
        state.tokenizer.save_pretrained(staging / "model")
        if state.checked.layout.experts is not None:
            write_expert_count(staging / "model" / "config.json", state.checked.layout.experts)
    if not state.checked.layout.residual:
        return  # no bases: the stream kept its own
    objectives = {site.name: site.steps for site in state.result.sites}
    metadata = {"objectives": json.dumps(objectives)}
    if state.refinement is not None:
        metadata["refinement"] = json.dumps(state.refinement.to_json())
    save_bases(state.bases, staging / BASES_FILE, metadata)
    if state.result.readers is not None:
        save_bases(state.result.readers, staging / READERS_FILE)


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")
"""What engines read a MoE config's expert count from: transformers 5 writes one of them (Qwen3-MoE
and Mixtral `num_local_experts`, Qwen2-MoE and OLMoE `num_experts`), vLLM reads `num_experts` for
Qwen3-MoE; a pruned model's config says the count under both."""


def write_expert_count(path: Path, experts: int) -> None:
    """`path` (a saved config.json) with the expert count under every key engines read (in a
    vision-language checkpoint's `text_config`, where its text model reads them)."""
    config = json.loads(path.read_text())
    text_fields(config).update(dict.fromkeys(EXPERT_COUNT_KEYS, experts))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_mlp_alone(state: RunState, pruned: PreTrainedModel, save_model: bool) -> PreTrainedModel:
    """A layout that prunes the MLP alone saves the original class, its config's MLP width the
    kept one, and loads it back (a vision-language checkpoint whole, its projector as it was)."""
    family, d = state.family, state.config.hidden_size
    assert family.mlp_width is not None and state.checked.layout.kept_stream is not None
    state.stock = {
        "norm_scale": 1.0,
        "stream_scale": 1.0,
        "embedding_factor": 1.0,
        "head": "unchanged",
        "hidden_size": d,
        "config": {family.mlp_width: getattr(state.config, family.mlp_width)},
        "residual": f"kept whole: {state.checked.layout.kept_stream}",
    }
    if not save_model:
        return pruned
    folder = state.staging / "model"
    if state.checked.tower is not None:  # the projector writes the stream as it was
        return save_whole_tower(state, pruned, folder, None)
    if state.mlp_widths is not None:  # slicing.layout: heterogeneous
        decilm = save_decilm(pruned, folder)
        state.stock["config"] = {"block_configs": decilm.block_configs}
        state.stock["class"] = "DeciLMForCausalLM"
        return load_stock(folder, pruned, remote_code=True)
    save_own_class(pruned, family, folder)
    return load_stock(folder, pruned)


def save_whole_tower(
    state: RunState, pruned: PreTrainedModel, folder: Path, basis: torch.Tensor | None
) -> PreTrainedModel:
    """A vision-language checkpoint saved whole (`models.towers.save_tower`): the original
    loaded again, its text tower replaced by `pruned`, its projector mapped into the pruned
    stream; returned as the run's text model, read back from the folder."""
    tower, spec = state.checked.tower, state.recipe.model
    assert tower is not None and state.stock is not None
    save_tower(
        load_whole(replaced(spec, load="memory")),
        tower,
        pruned,
        basis,
        state.stock["stream_scale"],
        folder,
    )
    state.stock["vision_language"] = {
        "class": type(pruned).__name__,
        "projector": tower.projector,
        "copied": copy_processor_files(spec.path, folder),
    }
    return load_model(replaced(spec, path=str(folder), revision=None, load="memory"))
