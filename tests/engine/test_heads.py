"""The heads axis on tiny random models: removing query heads with nothing else pruned gives exactly
the original with those heads' output silenced, the refit is least squares, each family whose
class can hold fewer heads reloads as its own class with `head_dim` and the new head count."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.engine.heads import HeadOptions, prune_heads
from compressor.errors import UserError
from compressor.models.heads import heads_refusal, kept_heads, set_heads
from compressor.models.sliced import layer_attention
from compressor.strategies.head_contract import HeadChoice, HeadProblem, HeadSelector
from compressor.strategies.registry import PluginRegistry
from tests.conftest import FAMILY_CONFIGS, copy_model, max_relative_logit_error, random_batches, tiny_model

REGISTRY = PluginRegistry()
HOLDS_FEWER_HEADS = [
    name
    for name in FAMILY_CONFIGS
    if heads_refusal(tiny_model(name).config, REGISTRY.families()[tiny_model(name).config.model_type].item) is None
]


class Fixed(HeadSelector):
    """Keeps the heads it is given: the test decides, the engine cuts."""

    name = "fixed"

    def __init__(self, kept: list[int]) -> None:
        self.kept = kept

    def select(self, problem: HeadProblem) -> HeadChoice:
        return HeadChoice(torch.tensor(self.kept))


def _family(model):
    return REGISTRY.families()[model.config.model_type].item


def _silenced(model, family, removed: list[int]):
    """The original with the removed heads' output projection columns zeroed: the model without them."""
    reference = copy_model(model)
    width = model.config.head_dim
    for layer in reference.get_submodule(family.layers):
        attention = layer_attention(family, layer)
        if attention is None:
            continue
        weight = attention.get_submodule(family.attn_output).weight
        for head in removed:
            weight.data[:, head * width : (head + 1) * width] = 0
    return reference


@pytest.mark.parametrize("name", HOLDS_FEWER_HEADS)
def test_removing_heads_unrefitted_is_the_model_without_them(name, tmp_path):
    model = tiny_model(name)
    family = _family(model)
    batches = random_batches(model.config.vocab_size, count=2, padded=True)
    reference = _silenced(model, family, removed=[0, 3])
    prune_heads(model, family, batches, 2, HeadOptions(Fixed([1, 2]), refit=False))
    set_heads(model.config, 2)
    assert max_relative_logit_error(reference, model, batches) < 1e-5
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded) is type(model)
    assert reloaded.config.num_attention_heads == 2 and reloaded.config.head_dim == 16
    assert max_relative_logit_error(reference, reloaded, batches) < 1e-5


def test_the_refit_is_least_squares_on_what_every_head_wrote():
    model = tiny_model("llama")
    family = _family(model)
    batches = random_batches(model.config.vocab_size, count=2)
    original = copy_model(model)
    captured: dict[int, torch.Tensor] = {}
    layer0 = layer_attention(family, original.model.layers[0])
    hook = layer0.o_proj.register_forward_pre_hook(lambda _, args: captured.setdefault(len(captured), args[0]))
    with torch.no_grad():
        for batch in batches:
            original(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    hook.remove()
    Z = torch.cat([z.reshape(-1, z.shape[-1]) for z in captured.values()]).double()
    W = layer0.o_proj.weight.detach().double()
    records = prune_heads(model, family, batches, 2, HeadOptions(Fixed([0, 3]), damping=1e-9))
    columns = torch.cat([torch.arange(0, 16), torch.arange(48, 64)])
    solution = torch.linalg.lstsq(Z[:, columns], Z @ W.T).solution.T  # min ‖Z Wᵀ − Z_S W'ᵀ‖
    assert torch.allclose(model.model.layers[0].self_attn.o_proj.weight.double(), solution.float().double(), atol=1e-4)
    assert records[0].error_refit < records[0].error_dropped


def test_the_head_count_curves_are_the_stages_output_error_and_leave_the_model_alone():
    """`head_count_curves` (the splits' prediction): at the first layer, whose input no pruning
    changed, the error at a count is the heads stage's refitted output error there (the stage
    reports it relative to E‖Wz‖²); it falls with the count, is zero with every head, is weighed
    by G where given, and the model is unchanged."""
    from compressor.engine.heads import head_count_curves

    model = tiny_model("llama")
    family = _family(model)
    batches = random_batches(model.config.vocab_size, count=2, padded=True)
    obs = REGISTRY.head_selector("norm")
    curves = head_count_curves(model, family, batches, [2, 4], HeadOptions(obs))
    assert sorted(curves) == list(range(model.config.num_hidden_layers))
    for errors in curves.values():
        assert errors[2] > abs(errors[4]) and abs(errors[4]) < 1e-6 * errors[2]
    original = copy_model(model)
    captured: list[torch.Tensor] = []
    masks = [batch.attention_mask.bool() for batch in batches]
    layer0 = layer_attention(family, original.model.layers[0])
    hook = layer0.o_proj.register_forward_hook(lambda _m, _a, out: captured.append(out[masks[len(captured)]]))
    with torch.no_grad():
        for batch in batches:
            original(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    hook.remove()
    energy = float(torch.cat(captured).double().pow(2).sum(-1).mean())  # E‖Wz‖² on the counted tokens
    records = prune_heads(copy_model(model), family, batches, 2, HeadOptions(obs))
    assert curves[0][2] == pytest.approx(records[0].error_refit * energy, rel=1e-4)
    G = {i: 2.0 * torch.eye(model.config.hidden_size, dtype=torch.float64) for i in curves}
    weighed = head_count_curves(model, family, batches, [2], HeadOptions(obs, sensitivity=G))
    assert [weighed[i][2] for i in curves] == pytest.approx([2.0 * curves[i][2] for i in curves], rel=1e-9)
    assert max_relative_logit_error(original, model, batches) == 0


def test_a_multi_head_model_loses_its_kv_heads_with_its_query_heads():
    model = tiny_model("llama", num_key_value_heads=4)
    family = _family(model)
    batches = random_batches(model.config.vocab_size)
    reference = _silenced(model, family, removed=[0, 1])
    assert kept_heads(model.config, family, 2) == 2  # no grouping to respect
    prune_heads(model, family, batches, 2, HeadOptions(Fixed([2, 3]), refit=False))
    set_heads(model.config, 2)
    assert model.config.num_key_value_heads == 2
    assert max_relative_logit_error(reference, model, batches) < 1e-5


@pytest.mark.parametrize(
    ("name", "kept", "message"),
    [
        ("llama", 3, "keep a multiple of 2"),
        ("llama", 4, "keep from 1 to 3 of the 4 query heads"),
        ("phi3", 2, "computes queries in one linear"),
        ("opt", 2, "does not read head_dim"),
        ("olmo2", 2, "q_norm.weight spans every head"),
    ],
)
def test_heads_that_cannot_go_are_refused_in_one_line(name, kept, message):
    model = tiny_model(name)
    with pytest.raises(UserError, match=message):
        kept_heads(model.config, _family(model), kept)


def test_a_selector_that_breaks_the_groups_is_refused():
    model = tiny_model("llama")
    batches = random_batches(model.config.vocab_size)
    with pytest.raises(UserError, match=r"kept \[2, 0\] heads per KV group"):
        prune_heads(model, _family(model), batches, 2, HeadOptions(Fixed([0, 1])))


def test_a_model_with_one_kv_head_keeps_it_and_loses_query_heads():
    """Multi-query attention (Gemma's small models): one group, any count below the heads."""
    model = tiny_model("llama", num_key_value_heads=1)
    family = _family(model)
    batches = random_batches(model.config.vocab_size)
    reference = _silenced(model, family, removed=[0, 2])
    assert kept_heads(model.config, family, 0.5) == 2
    prune_heads(model, family, batches, 2, HeadOptions(Fixed([1, 3]), refit=False))
    set_heads(model.config, 2)
    assert model.config.num_key_value_heads == 1
    assert max_relative_logit_error(reference, model, batches) < 1e-5


def test_a_count_the_config_class_refuses_is_one_line():
    """LlamaConfig wants hidden_size a multiple of num_attention_heads: 6 of 8 heads at hidden 64 is refused."""
    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    with pytest.raises(UserError, match="heads.kept 6: LlamaConfig refuses 6 heads at hidden_size 64"):
        kept_heads(model.config, _family(model), 6)
    assert kept_heads(model.config, _family(model), 4) == 4
