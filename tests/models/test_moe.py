"""Mixture-of-Experts layers (issue 48, item 1): a family's fused experts become `RoutedExperts`
(the router and every expert as linears), which computes what the family's block computes under
each of transformers' experts implementations, lets a hook on an expert see exactly the tokens
routed to it, and goes back into the fused tensors for a stock save. The conformance suite runs
every MoE family through rotation, per-site and global runs and reloads."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.engine.transforms import fuse_norms
from compressor.models.experts import RoutedExperts, is_fused_experts, unfuse_experts
from compressor.models.families import family_for
from tests.conftest import (
    COMMON,
    FAMILY_CONFIGS,
    MOE_FAMILIES,
    copy_model,
    max_relative_logit_error,
    random_batches,
    tiny_model,
)

MOE = MOE_FAMILIES
BATCHES = random_batches(COMMON["vocab_size"], count=2, batch=2, length=16)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("name", MOE)
def test_routed_experts_compute_what_each_experts_implementation_computes(name: str, implementation: str) -> None:
    original = tiny_model(name)
    original.set_experts_implementation(implementation)
    assert original.config._experts_implementation == implementation
    fused = copy_model(original)
    fuse_norms(fused, family_for(name))
    assert any(isinstance(module, RoutedExperts) for module in fused.modules())
    assert not any(is_fused_experts(module) for module in fused.modules())
    assert max_relative_logit_error(original, fused, BATCHES) < 1e-5


@pytest.mark.parametrize("name", MOE)
def test_a_hook_on_an_expert_sees_exactly_the_tokens_routed_to_it(name: str) -> None:
    """Statistics per expert are what calibration needs (a grouped kernel would pass them by)."""
    model = tiny_model(name)
    unfuse_experts(model)
    block = next(module for module in model.modules() if isinstance(module, RoutedExperts))
    seen = torch.zeros(len(block.experts), dtype=torch.long)
    routed = torch.zeros_like(seen)

    def count(index: int):
        return lambda module, inputs: seen.__setitem__(index, seen[index] + inputs[0].shape[0])

    for index, expert in enumerate(block.experts):
        expert.gate_up_proj.register_forward_pre_hook(count(index))

    def route(module: RoutedExperts, inputs: tuple[torch.Tensor]) -> None:
        chosen, _ = module.route(inputs[0].reshape(-1, inputs[0].shape[-1]))
        routed.add_(torch.bincount(chosen.flatten(), minlength=len(seen)))

    block.register_forward_pre_hook(route)
    with torch.no_grad():
        model(input_ids=BATCHES[0].input_ids)
    tokens = BATCHES[0].input_ids.numel()
    assert torch.equal(seen, routed) and int(seen.sum()) == tokens * block.top_k
    assert (seen > 0).sum() >= 2


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_routed_experts_go_back_into_the_family_s_fused_tensors(name: str) -> None:
    """gpt-oss's experts are transposed with gate and up interleaved, and carry biases."""
    original = tiny_model(name)
    unfused = copy_model(original)
    unfuse_experts(unfused)
    state = family_for(name).own_state(unfused.state_dict())
    assert state.keys() == original.state_dict().keys()
    assert all(torch.equal(state[key], value) for key, value in original.state_dict().items())
    restored = AutoModelForCausalLM.from_config(original.config, attn_implementation="eager").eval()
    restored.load_state_dict(state)
    assert max_relative_logit_error(original, restored, BATCHES) == 0


def test_the_tiny_moe_configs_route_to_several_of_several_experts() -> None:
    """The conformance suite's MoE configs exercise routing (more experts than each token uses)."""
    for name in MOE:
        config = FAMILY_CONFIGS[name]
        experts = config.get("num_experts", config.get("num_local_experts"))
        assert experts > config["num_experts_per_tok"] >= 2


def test_a_family_naming_a_missing_experts_per_token_key_is_refused_in_one_line() -> None:
    """A plugin family whose `experts_per_token` is not in the config: a clear line, not an AttributeError."""
    from dataclasses import replace

    from compressor.errors import UserError
    from compressor.models.layout import kept_experts

    family = replace(family_for("qwen3_moe"), experts_per_token="experts_per_token")
    config = tiny_model("qwen3_moe").config
    assert kept_experts(config, family_for("qwen3_moe"), 3) == 3
    with pytest.raises(UserError, match="the config has no 'experts_per_token'"):
        kept_experts(config, family, 3)
