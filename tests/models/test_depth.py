"""Whole blocks removed (issue 49, depth): the model without them is exactly the original with those
blocks skipped (`skipping`, which the measuring selector runs), on every family; its config reloads it in the family's own class with every
per-layer setting trimmed; the KV cache follows the renumbered blocks; bad removals in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.errors import UserError
from compressor.models.depth import depth_config, remove_blocks, skipping
from compressor.models.families import family_for
from tests.conftest import COMMON, FAMILY_CONFIGS, copy_model, random_batches, tiny_model

BATCHES = random_batches(COMMON["vocab_size"], count=1, batch=2, length=12)
REMOVED = [1, 2]


def _deep(name: str, **overrides):
    """The family's tiny model with 4 blocks: each per-layer list of its 2-block config repeated,
    each list of block indices repeated two blocks on."""
    values = dict(FAMILY_CONFIGS[name])
    extra = {"num_hidden_layers": 4}
    for key, value in values.items():
        if key in ("layer_types", "no_rope_layers") and isinstance(value, list):
            extra[key] = value * 2
        elif key == "mlp_only_layers":
            extra[key] = value + [i + 2 for i in value]
    return tiny_model(name, **{**extra, **overrides})


def _logits(model: torch.nn.Module) -> torch.Tensor:
    batch = BATCHES[0]
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_the_model_without_blocks_is_the_original_skipping_them_and_reloads_in_its_own_class(name: str) -> None:
    family = family_for(FAMILY_CONFIGS[name]["model_type"])
    original = _deep(name)
    with skipping(original, family, REMOVED):  # what a measuring depth selector runs
        expected = _logits(original)
    assert not torch.allclose(expected, _logits(original))  # the skipped blocks did something, and the hooks are gone
    before = copy.deepcopy(original.config)  # the copy below shares it, and the removal changes it
    pruned = copy_model(original)
    kept = remove_blocks(pruned, family, REMOVED)
    assert kept == [0, 3] and pruned.config.num_hidden_layers == 2
    assert torch.equal(_logits(pruned), expected)
    config = depth_config(before, REMOVED)
    for key in ("layer_types", "no_rope_layers"):
        if isinstance(getattr(before, key, None), list):
            assert getattr(config, key) == [getattr(before, key)[i] for i in kept]
    stock = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    stock.load_state_dict(pruned.state_dict())  # strict: the same modules, renumbered
    assert torch.equal(_logits(stock), expected)


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_5_text"])
def test_cached_decoding_follows_the_renumbered_blocks(name: str) -> None:
    """Each kept block's attention (or linear attention) writes its own cache slot: decoding the
    last token from the cache of the others gives the full forward's logits."""
    family = family_for(FAMILY_CONFIGS[name]["model_type"])
    model = _deep(name)
    remove_blocks(model, family, REMOVED)
    ids = BATCHES[0].input_ids
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[:, -1]
        prefix = model(input_ids=ids[:, :-1], use_cache=True)
        step = model(input_ids=ids[:, -1:], past_key_values=prefix.past_key_values, use_cache=True).logits[:, -1]
    assert torch.allclose(step, full, atol=1e-5, rtol=1e-4)


def test_a_sparse_step_pattern_the_kept_blocks_break_is_written_out_as_dense_blocks() -> None:
    """Qwen-MoE: with decoder_sparse_step 2, blocks 1 and 3 are sparse; without block 0 the kept
    blocks 1, 2, 3 are sparse, dense, sparse, which only mlp_only_layers can say."""
    family = family_for("qwen3_moe")
    original = tiny_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2)
    expected_kinds = [type(original.model.layers[i].mlp).__name__ for i in (1, 2, 3)]
    assert expected_kinds[0] == expected_kinds[2] != expected_kinds[1]
    config = depth_config(copy.deepcopy(original.config), [0])
    assert config.decoder_sparse_step == 1 and config.mlp_only_layers == [1]
    pruned = copy_model(original)
    remove_blocks(pruned, family, [0])
    stock = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    assert [type(layer.mlp).__name__ for layer in stock.model.layers] == expected_kinds
    stock.load_state_dict(pruned.state_dict())
    assert torch.equal(_logits(stock), _logits(pruned))


@pytest.mark.parametrize(
    ("removed", "message"),
    [
        ([0, 1, 2, 3], "depth: removing all 4 blocks leaves no model; remove fewer"),
        ([4], "depth: block 4 is not among the 4 blocks (0 to 3)"),
        ([-1], "depth: block -1 is not among the 4 blocks (0 to 3)"),
    ],
)
def test_impossible_removals_are_refused_in_one_line(removed: list[int], message: str) -> None:
    model = _deep("llama")
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        remove_blocks(model, family_for("llama"), removed)
    assert model.config.num_hidden_layers == 4 and len(model.model.layers) == 4  # untouched


def test_an_unknown_per_layer_setting_is_refused_rather_than_left_untrimmed() -> None:
    model = _deep("llama")
    config = copy.deepcopy(model.config)
    config.attention_windows = [8, 8, 16, 16]  # one entry per block, meaning unknown here
    with pytest.raises(UserError, match="llama configs have attention_windows, a list of one entry per block"):
        depth_config(config, [1])


def test_block_influence_is_one_minus_the_cosine_of_each_block_s_input_and_output() -> None:
    """Against the model's own hidden states (inner blocks: the last one's output is normed there),
    and a block whose writers are zero (its output is its input) scores 0, the least."""
    from compressor.engine.depth import block_influence

    family = family_for("llama")
    model = _deep("llama")
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
    batches = random_batches(COMMON["vocab_size"], count=2, batch=2, length=12, padded=True)
    scores = block_influence(model, family, batches)
    total, count = torch.zeros(4, dtype=torch.float64), 0
    with torch.no_grad():
        for batch in batches:
            states = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
            mask = batch.attention_mask.bool()
            for i in range(3):
                x, y = states.hidden_states[i][mask].double(), states.hidden_states[i + 1][mask].double()
                total[i] += (1 - torch.nn.functional.cosine_similarity(x, y, dim=-1)).sum()
            count += int(mask.sum())
    assert scores[:3] == pytest.approx((total[:3] / count).tolist(), rel=1e-6, abs=1e-9)
    assert scores[2] == pytest.approx(0.0, abs=1e-9) and min(range(4), key=scores.__getitem__) == 2
    assert all(score > 1e-3 for i, score in enumerate(scores) if i != 2)
