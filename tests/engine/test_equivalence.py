"""A rotation with nothing removed must reproduce the original model's logits (per family: the
conformance suite, `tests/models/test_family_conformance.py`); the guards of that check."""

from __future__ import annotations

import torch

from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout
from compressor.strategies.contract import Basis, SiteProblem, Strategy
from compressor_plugins.pca import PCA
from tests.conftest import copy_model, random_batches, tiny_model, widths_for


class RandomRotation(Strategy):
    """A dense random orthogonal basis: rotation must be exact for any basis, not just PCA's."""

    name = "random-rotation"

    def select(self, problem: SiteProblem, incoming: Basis | None, options: object) -> Basis:
        generator = torch.Generator().manual_seed(problem.index)
        q, _ = torch.linalg.qr(torch.randn(problem.width, problem.width, generator=generator, dtype=torch.float64))
        return Basis(Q=q)


def test_rotation_is_not_the_identity() -> None:
    """Guard for the test above: the bases really change the weights."""
    original = tiny_model("llama")
    d = original.config.hidden_size
    result = prune(
        copy_model(original),
        fixed_layout(original.config, family_for("llama"), widths_for("llama", original.config, d, slice_head=True)),
        random_batches(128),
        [PipelineStep(PCA())],
    )
    before = original.model.embed_tokens.weight
    after = result.model.model.embed_tokens.weight
    assert after.shape == before.shape
    assert (after - before).abs().max() > 1e-2


def test_fusion_does_not_centre_rmsnorm_models() -> None:
    """SliceGPT mean-centres embeddings of RMSNorm models; that changes the function, we must not."""
    original = tiny_model("llama")
    d = original.config.hidden_size
    result = prune(
        copy_model(original),
        fixed_layout(original.config, family_for("llama"), widths_for("llama", original.config, d, slice_head=True)),
        random_batches(128),
        [PipelineStep(RandomRotation())],
    )
    rotated_back = result.model.model.embed_tokens.weight.double()
    # Row norms are preserved by an orthogonal change of basis; centring would shrink them.
    assert torch.allclose(rotated_back.norm(dim=1), original.model.embed_tokens.weight.double().norm(dim=1), atol=1e-5)
