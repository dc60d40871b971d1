"""The layer-wise H pass computes the same H as a backward pass through the whole model."""

from __future__ import annotations

import pytest
import torch

from compressor.engine.calibration import LayerInputs, capture_layer_inputs
from compressor.engine.fisher import estimate_fisher, sampled_score, site_activations
from compressor.engine.transforms import fuse_norms
from compressor.models.families import ModelFamily, family_for
from compressor.models.sites import site_ids
from compressor.recipe.sections.sensitivity import SensitivityOptions
from tests.conftest import FAMILY_CONFIGS, random_batches, tiny_model

CASES = [(name, {}) for name in sorted(FAMILY_CONFIGS)] + [("opt", {"word_embed_proj_dim": 32})]


def whole_model_fisher(model, family: ModelFamily, inputs: LayerInputs, seed: int) -> dict[str, torch.Tensor]:
    """The reference: one forward and one backward pass through the whole model per batch,
    gradients read at every site; labels drawn from the same generator in the same order."""
    generator = torch.Generator().manual_seed(seed)
    ids = site_ids(family, model.config.num_hidden_layers)
    totals = {
        site: torch.zeros(model.config.hidden_size, model.config.hidden_size, dtype=torch.float64) for site in ids
    }
    tokens = 0
    for batch in range(len(inputs)):
        mask = inputs.sensitivity_masks[batch]
        with torch.enable_grad():
            sites, logits = site_activations(model, family, inputs, batch)
            for site in sites[1:]:
                site.retain_grad()
            logits.backward(sampled_score(logits, mask, generator, "sum"))
        for name, site in zip(ids, sites):
            g = site.grad[mask].double()
            totals[name] += g.T @ g
        tokens += int(mask.sum())
    return {site: total / tokens for site, total in totals.items()}


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "kept-graphs"])
@pytest.mark.parametrize(
    ("family_name", "overrides"), CASES, ids=[name + ("-projections" if extra else "") for name, extra in CASES]
)
def test_layerwise_h_equals_whole_model_h(family_name: str, overrides: dict, recompute: bool) -> None:
    model = tiny_model(family_name, **overrides).double()
    family = family_for(family_name)
    fuse_norms(model, family)
    # unpadded: eager attention overflows float64's padding mask (-1.8e308) into NaN in transformers
    batches = random_batches(model.config.vocab_size, count=3)
    inputs = capture_layer_inputs(model, family, batches, torch.device("cpu"))
    expected = whole_model_fisher(model, family, inputs, seed=7)
    # chunks of 2 batches (8 sequences): layer inputs of several batches held, and a last short chunk
    options = SensitivityOptions(dtype="float64", chunk=8, recompute=recompute)
    actual = estimate_fisher(model, family, inputs, options, torch.device("cpu"), seed=7)
    assert list(actual) == list(expected)
    for site, h in expected.items():
        assert h.abs().max() > 0
        error = (torch.linalg.matrix_norm(actual[site] - h) / torch.linalg.matrix_norm(h)).item()
        assert error <= 1e-10, f"{site}: relative error {error:.2e}"


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "kept-graphs"])
def test_layerwise_h_counts_only_real_tokens_of_padded_batches(recompute: bool) -> None:
    """Padded rows (float32): masks reach every layer, and only counted positions are summed."""
    model = tiny_model("llama")
    family = family_for("llama")
    fuse_norms(model, family)
    inputs = capture_layer_inputs(model, family, random_batches(128, count=3, padded=True), torch.device("cpu"))
    inputs.sensitivity_masks[1][:, :5] = False  # e.g. a chat's user turn
    inputs.sensitivity_counts[1] = int(inputs.sensitivity_masks[1].sum())
    expected = whole_model_fisher(model, family, inputs, seed=3)
    options = SensitivityOptions(dtype="float64", chunk=8, recompute=recompute)
    actual = estimate_fisher(model, family, inputs, options, torch.device("cpu"), seed=3)
    for site, h in expected.items():
        assert torch.isfinite(actual[site]).all()
        assert (torch.linalg.matrix_norm(actual[site] - h) / torch.linalg.matrix_norm(h)).item() <= 1e-5


def test_h_does_not_depend_on_the_chunking() -> None:
    model = tiny_model("llama")
    family = family_for("llama")
    fuse_norms(model, family)
    inputs = capture_layer_inputs(model, family, random_batches(128, count=3), torch.device("cpu"))

    def h(**options) -> dict[str, torch.Tensor]:
        return estimate_fisher(model, family, inputs, SensitivityOptions(**options), torch.device("cpu"), seed=2)

    one, all_at_once, kept = h(chunk=1, recompute=True), h(chunk=100, recompute=True), h(recompute=False)
    for site in one:  # the same operations on the same values, in another order of batches and layers
        assert torch.equal(one[site], all_at_once[site]) and torch.equal(one[site], kept[site])
