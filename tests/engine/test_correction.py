"""Reader correction: what reads a site's stream reads R = C·V(VᵀCV)⁻¹ (the least-squares
prediction of the full stream from its kept coordinates) instead of V. Identity for PCA, never a
larger least-squares error, exact to rebuild, and resumable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compressor.engine.bases import apply_bases, prediction_error, reader_map
from compressor.engine.checkpoint import Checkpoint
from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor_plugins.pca import PCA
from compressor_plugins.sensitivity import Sensitivity
from tests.conftest import copy_model, max_relative_logit_error, random_batches, tiny_model, widths_for


def _spd(d: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    A = torch.randn(d, 3 * d, generator=generator, dtype=torch.float64) * torch.linspace(
        0.1, 3, 3 * d, dtype=torch.float64
    )
    return A @ A.T / (3 * d)


def test_the_reader_map_is_the_basis_for_pca_and_optimal_otherwise() -> None:
    C, k = _spd(24), 16
    eigenvalues, eigenvectors = torch.linalg.eigh(C)
    top = eigenvectors[:, -k:]
    assert torch.allclose(reader_map(C, top), top, atol=1e-10)
    generator = torch.Generator().manual_seed(1)
    V = torch.linalg.qr(torch.randn(24, k, generator=generator, dtype=torch.float64))[0]
    R = reader_map(C, V)
    assert prediction_error(C, top, top) == pytest.approx(float(eigenvalues[:-k].sum() / eigenvalues.sum()))
    assert prediction_error(C, V, R) < 0.9 * prediction_error(C, V, V)
    for _ in range(5):  # the least-squares optimum: any other map predicts worse
        other = R + 1e-3 * torch.randn(R.shape, generator=generator, dtype=torch.float64)
        assert prediction_error(C, V, other) > prediction_error(C, V, R)


def _prune(original, name: str, pipeline, correct: bool, checkpoint: Checkpoint | None = None):
    family = family_for(name)
    widths = widths_for(
        name,
        original.config,
        kept_width(original.config.hidden_size, 0.25, 8),
        slice_head=family.head_width_is_embedding_width,
    )
    batches = random_batches(original.config.vocab_size, padded=True)
    return prune(
        copy_model(original),
        fixed_layout(original.config, family, widths),
        batches,
        pipeline,
        WalkOptions(correct_readers=correct, checkpoint=checkpoint),
    ), batches


@pytest.mark.parametrize("name", ["llama", "opt"])
def test_correction_changes_nothing_for_pca(name: str) -> None:
    original = tiny_model(name)
    plain, batches = _prune(original, name, [PipelineStep(PCA())], correct=False)
    corrected, _ = _prune(original, name, [PipelineStep(PCA())], correct=True)
    assert plain.readers is None
    for site, basis in corrected.bases.items():
        assert torch.allclose(corrected.readers[site], basis, atol=1e-8)
    assert max_relative_logit_error(plain.model, corrected.model, batches) < 1e-5


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_corrected_readers_predict_the_stream_better_and_rebuild_exactly(name: str) -> None:
    original = tiny_model(name)
    steps = [PipelineStep(Sensitivity(), Sensitivity().parse_options({}))]
    result, batches = _prune(original, name, steps, correct=True)
    for record in result.sites:
        assert record.correction["error_reader"] <= record.correction["error_basis"] + 1e-12
    assert any(r.correction["error_reader"] < 0.99 * r.correction["error_basis"] for r in result.sites)
    rebuilt = apply_bases(copy_model(original), family_for(name), result.bases, readers=result.readers)
    assert max_relative_logit_error(result.model, rebuilt, batches) == 0.0
    without = apply_bases(copy_model(original), family_for(name), result.bases)
    assert max_relative_logit_error(result.model, without, batches) > 1e-4  # the readers do matter


def test_a_corrected_walk_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    original = tiny_model("llama")
    steps = [PipelineStep(Sensitivity(), Sensitivity().parse_options({}))]
    checkpoint = Checkpoint(tmp_path / "checkpoint")
    checkpoint.start({"test": "1"})
    first, batches = _prune(original, "llama", steps, correct=True, checkpoint=checkpoint)
    again, _ = _prune(original, "llama", steps, correct=True, checkpoint=checkpoint)
    assert again.loaded_sites == len(first.sites)
    assert all(torch.equal(again.readers[s], first.readers[s]) for s in first.readers)
    assert max_relative_logit_error(first.model, again.model, batches) == 0.0
