"""Checks on the trained reference model in ../shared (random weights prove nothing about quality)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compressor.data.text import batches_of, load_records, token_windows
from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.evaluation.metrics import compare
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor.models.sites import site_widths
from compressor_plugins.pca import PCA


def _setup(shared: Path, sparsity: float):
    path = shared / "models" / "ref-llama"
    tokenizer = AutoTokenizer.from_pretrained(path)
    calib = batches_of(
        token_windows(
            load_records({"path": "json", "data_files": str(shared / "corpus" / "calib.jsonl")}), tokenizer, 256, 16
        ),
        8,
    )
    valid = batches_of(
        token_windows(
            load_records({"path": "json", "data_files": str(shared / "corpus" / "valid.jsonl")}), tokenizer, 256, 16
        ),
        8,
    )
    original = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    d, layers = model.config.hidden_size, model.config.num_hidden_layers
    widths = site_widths(family_for("llama"), layers, d, kept_width(d, sparsity, 8), slice_head=False)
    pruned = prune(model, fixed_layout(model.config, family_for("llama"), widths), calib, [PipelineStep(PCA())]).model
    return compare(original, pruned, valid, torch.device("cpu"))


def test_width_preserving_fusion_leaves_the_reference_model_unchanged(needs_shared: Path) -> None:
    """SliceGPT's own fusion moves this model by KL 0.0007 (it centres the embeddings); ours must not."""
    metrics = _setup(needs_shared, 0.0)
    assert metrics["pruned"]["kl"] < 1e-6
    assert abs(metrics["pruned"]["ppl"] - metrics["baseline"]["ppl"]) < 1e-3 * metrics["baseline"]["ppl"]


def test_pca_at_25_percent_keeps_the_reference_model_close(needs_shared: Path) -> None:
    """Not a benchmark (that is benchmarks/pca_sparsity_sweep.py): a guard against gross regressions."""
    metrics = _setup(needs_shared, 0.25)
    assert 0 < metrics["pruned"]["kl"] < 0.05
    assert metrics["pruned"]["ppl"] < 1.1 * metrics["baseline"]["ppl"]
