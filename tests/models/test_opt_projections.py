"""OPT with project_in / project_out (word_embed_proj_dim ≠ hidden_size): the projections write
and read the stream, so they are rotated and sliced while the embedding and head keep their width."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor_plugins.pca import PCA
from tests.conftest import copy_model, max_relative_logit_error, random_batches, tiny_model, widths_for


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_opt_projections_rotate_exactly_slice_and_reload(padded: bool, tmp_path: Path) -> None:
    original = tiny_model("opt", word_embed_proj_dim=32)
    decoder = original.model.decoder
    assert decoder.project_in is not None and decoder.project_out is not None
    family, config = family_for("opt"), original.config
    batches = random_batches(config.vocab_size, padded=padded)
    d = config.hidden_size

    rotated = prune(
        copy_model(original),
        fixed_layout(original.config, family, widths_for("opt", config, d, True)),
        batches,
        [PipelineStep(PCA())],
    )
    assert max_relative_logit_error(original, rotated.model, batches) <= 1e-4

    pruned = prune(
        copy_model(original),
        fixed_layout(original.config, family, widths_for("opt", config, kept_width(d, 0.25, 8), True)),
        batches,
        [PipelineStep(PCA())],
    ).model
    sliced = pruned.model.decoder
    assert sliced.embed_tokens.weight.shape == (config.vocab_size, 32)  # embedding keeps its own width
    assert sliced.project_in.out_features == 48 and sliced.project_out.in_features == 48
    assert pruned.lm_head.in_features == 32
    pruned.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    prompt = batches[0].input_ids[-1:, -6:]
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(pruned.generate(prompt, **settings), reloaded.generate(prompt, **settings))
