"""Saving: the folder users load, in the format the plan chose (`stages.exporters`), the tokenizer
and the bases."""

from __future__ import annotations

import json
from pathlib import Path

from compressor.engine.bases import BASES_FILE, READERS_FILE, save_bases
from compressor.models.towers import text_fields
from compressor.stages.base import RunState
from compressor.stages.contract import Stage
from compressor.stages.costs import TimedPhase, Work


class Save(Stage):
    name = "saving model"
    timing = "save_s"

    def seconds(self, work: Work) -> list[TimedPhase]:
        return []  # reading, loading and writing files: not estimated, small beside the passes

    def run(self, state: RunState) -> None:
        save(state, state.save_model)


def save(state: RunState, save_model: bool) -> None:
    """ "saving model": the folder users load, in the format the plan chose (`stages.exporters`: the
    original class read back, so what is evaluated is what users load; the per-site class; DeciLM;
    a vision-language checkpoint whole), the tokenizer and the bases."""
    staging = state.staging
    state.progress("saving model" if save_model else "saving bases", 0, 1)
    state.pruned = state.checked.exporter.save(state, staging / "model" if save_model else None)
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
