"""The heterogeneous layout's format (issue 49, item 3): a Llama whose MLPs differ in width, one of
them removed, written as DeciLM with this project's own configuration and modelling code, reloads
with trust_remote_code and gives the same logits and the same greedy generation (through the KV
cache); its block_configs say each width as the engines compute it; removed attentions (the
first layer's among them) are `no_op` blocks with the logits and generation of the model whose
attention there writes nothing; what DeciLM cannot hold is refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from compressor.engine.refit import drop_neurons
from compressor.errors import UserError
from compressor.models.decilm import decilm_config, decilm_refusal, save_decilm
from compressor.models.decilm.configuration_decilm import ffn_mult, ffn_width
from compressor.models.families import family_for
from compressor.models.heads import attention_removed, remove_attention
from compressor.models.kv_heads import merge_kv_heads, set_output
from tests.conftest import max_relative_logit_error, random_batches, tiny_model


def _narrowed(widths: list[int], **overrides) -> torch.nn.Module:
    """A tiny Llama whose layer i keeps its MLP's first `widths[i]` neurons (0: it writes nothing)."""
    model = tiny_model("llama", intermediate_size=512, num_hidden_layers=len(widths), **overrides)
    for layer, width in zip(model.model.layers, widths, strict=True):
        mlp, kept = layer.mlp, torch.arange(width)
        drop_neurons([mlp.gate_proj, mlp.up_proj], mlp.down_proj, kept, mlp.down_proj.weight.data[:, kept])
    return model


def test_a_llama_with_per_layer_widths_reloads_as_decilm_with_the_same_logits(tmp_path: Path) -> None:
    model = _narrowed([256, 0, 512])
    save_decilm(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "nemotron-nas" and config["architectures"] == ["DeciLMForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_decilm.DeciLMForCausalLM"
    assert (tmp_path / "modeling_decilm.py").is_file() and (tmp_path / "configuration_decilm.py").is_file()
    ffns = [block["ffn"] for block in config["block_configs"]]
    assert [f["no_op"] for f in ffns] == [False, True, False]
    assert [ffn_width(f["ffn_mult"], 64) for f in ffns if not f["no_op"]] == [256, 512]
    groups = {block["attention"]["n_heads_in_group"] for block in config["block_configs"]}
    assert groups == {2}  # 4 query heads over 2 KV heads
    saved = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(saved).__name__ == "DeciLMForCausalLM"
    assert not any("layers.1.mlp" in name or "layers.1.post_attention" in name for name, _ in saved.named_parameters())
    assert max_relative_logit_error(model, saved, random_batches(model.config.vocab_size, padded=True)) < 1e-6
    prompt = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(saved.generate(prompt, max_new_tokens=6, do_sample=False), expected)


@pytest.mark.parametrize("bias", [False, True])
def test_removed_attentions_are_no_op_blocks_with_the_logits_of_a_model_whose_attention_writes_nothing(
    bias: bool, tmp_path: Path
) -> None:
    model, family = _narrowed([512, 256, 512], attention_bias=bias), family_for("llama")
    expected = copy.deepcopy(model)
    for index in (0, 2):  # the first: the cache's length must come from another layer
        remove_attention(model.model.layers[index].self_attn, family)
        written = expected.model.layers[index].self_attn.o_proj
        written.weight.data.zero_()
        if bias:  # nothing written: the output projection's bias goes too
            written.bias.data.zero_()
    assert [attention_removed(layer.self_attn, family) for layer in model.model.layers] == [True, False, True]
    batches = random_batches(model.config.vocab_size, padded=True)
    assert max_relative_logit_error(expected, model, batches) == 0  # in memory: no head, nothing written
    save_decilm(model, tmp_path)
    blocks = json.loads((tmp_path / "config.json").read_text())["block_configs"]
    assert [b["attention"]["no_op"] for b in blocks] == [True, False, True]
    assert [b["attention"]["n_heads_in_group"] for b in blocks] == [None, 2, None]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    names = [name for name, _ in saved.named_parameters()]
    assert not any(n.startswith(("model.layers.0.self_attn", "model.layers.0.input_layernorm")) for n in names)
    assert any(n.startswith("model.layers.1.self_attn") for n in names)
    assert max_relative_logit_error(expected, saved, batches) < 1e-6
    prompt = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    greedy = expected.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(saved.generate(prompt, max_new_tokens=6, do_sample=False), greedy)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), greedy)
    with torch.no_grad():  # a step through the cache without positions given (as `throughput` decodes)
        cached = saved(input_ids=greedy[:, :-1], use_cache=True).cache
        step = saved(input_ids=greedy[:, -1:], cache=cached, use_cache=True).logits[:, -1]
        whole = expected(input_ids=greedy).logits[:, -1]
    assert torch.allclose(step, whole, atol=1e-5, rtol=1e-5)


def test_layers_with_their_own_kv_heads_reload_with_the_same_logits_and_generation(tmp_path: Path) -> None:
    """Per-layer KV heads (`mlp.merge_kv_heads`): n_heads_in_group per block, and the cache of
    layers of different KV widths through generation."""
    model = _narrowed([512, 256, 512], num_attention_heads=4, num_key_value_heads=4)
    generator = torch.Generator().manual_seed(1)
    for index, kv in ((0, 1), (2, 2)):
        attention = model.model.layers[index].self_attn
        merge_kv_heads(attention, model.config, kv)
        set_output(attention, family_for("llama"), torch.randn(64, 64, generator=generator) * 0.1)
    save_decilm(model, tmp_path)
    blocks = json.loads((tmp_path / "config.json").read_text())["block_configs"]
    assert [b["attention"]["n_heads_in_group"] for b in blocks] == [4, 1, 2]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    assert [layer.self_attn.k_proj.out_features for layer in saved.model.layers] == [16, 64, 32]
    batches = random_batches(model.config.vocab_size, padded=True)
    assert max_relative_logit_error(model, saved, batches) < 1e-6
    prompt = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    greedy = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(saved.generate(prompt, max_new_tokens=6, do_sample=False), greedy)


def test_a_tied_model_stays_tied() -> None:
    model = _narrowed([256, 512], tie_word_embeddings=True)
    assert decilm_config(model.config, [256, 512]).tie_word_embeddings


def test_ffn_mult_gives_back_every_width_the_engines_round_to() -> None:
    for hidden in (64, 576, 2048, 4096, 8192):
        for width in range(256, 8 * hidden + 1, 256):
            assert ffn_width(ffn_mult(width, hidden), hidden) == width
    with pytest.raises(ValueError, match="multiple of 256"):
        ffn_mult(300, 64)


def test_what_decilm_cannot_hold_is_refused_in_one_line(tmp_path: Path) -> None:
    assert decilm_refusal(tiny_model("llama").config) is None
    assert "qwen3 blocks are not" in decilm_refusal(tiny_model("qwen3").config)
    wider = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4, head_dim=32)
    assert "head_dim from hidden_size" in decilm_refusal(wider)
    with pytest.raises(UserError, match="use slicing.layout: global"):
        save_decilm(tiny_model("qwen3"), tmp_path)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        decilm_config(tiny_model("llama", num_hidden_layers=1).config, [128])
