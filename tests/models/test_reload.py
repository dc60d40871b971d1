"""A saved pruned model reloads through AutoModelForCausalLM and behaves exactly like the in-memory one."""

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
from tests.conftest import FAMILY_CONFIGS, copy_model, random_batches, tiny_model, widths_for


@pytest.mark.parametrize("family_name", sorted(FAMILY_CONFIGS))
def test_saved_model_reloads_and_generates_identically(family_name: str, tmp_path: Path) -> None:
    original = tiny_model(family_name)
    config = original.config
    d = config.hidden_size
    slice_head = family_for(family_name).head_width_is_embedding_width  # GPT-2 needs it; others test without
    widths = widths_for(family_name, config, kept_width(d, 0.25, 8), slice_head=slice_head)
    pruned = prune(
        copy_model(original),
        fixed_layout(original.config, family_for(family_name), widths),
        random_batches(config.vocab_size),
        [PipelineStep(PCA())],
    ).model
    pruned.save_pretrained(tmp_path)
    # Same attention kernel as the in-memory model, so "identical" can mean bit-identical.
    reloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation=pruned.config._attn_implementation
    ).eval()
    assert type(reloaded) is type(pruned)
    assert reloaded.config.slicing == pruned.config.slicing

    ids = random_batches(config.vocab_size, count=1, padded=True)[0]
    with torch.no_grad():
        expected = pruned(input_ids=ids.input_ids, attention_mask=ids.attention_mask).logits
        actual = reloaded(input_ids=ids.input_ids, attention_mask=ids.attention_mask).logits
    assert torch.equal(expected, actual)

    prompt = ids.input_ids[:1, -8:]
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    in_memory = pruned.generate(prompt, use_cache=True, **settings)
    from_disk = reloaded.generate(prompt, use_cache=True, **settings)
    without_cache = reloaded.generate(prompt, use_cache=False, **settings)
    assert in_memory.shape[1] == prompt.shape[1] + 12
    assert torch.equal(in_memory, from_disk)
    assert torch.equal(from_disk, without_cache)
