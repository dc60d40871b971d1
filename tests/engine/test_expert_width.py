"""The routed experts' width as the MLP axis (issue 48, item 4): keeping every neuron changes
nothing, each expert's statistics are the tokens routed to it weighed by their routing weights,
the refit's reported error is the error it leaves on those tokens, and a model whose experts are
narrower is the family's own class with a smaller `moe_intermediate_size`; a shared expert's
width likewise, from every token weighed by its gate (`shared_expert_intermediate_size`)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.engine.neurons import MlpOptions, prune_mlp
from compressor.errors import UserError
from compressor.models.experts import RoutedExperts, fused_experts_state
from compressor.models.families import family_for
from compressor.models.layout import mlp_neurons, with_mlp_width
from compressor.plugin import NeuronChoice, NeuronProblem, NeuronSelector
from compressor_plugins.neurons import Magnitude
from compressor_plugins.neurons import OptimalBrainSurgeon as ObsSelector
from tests.conftest import COMMON, FAMILY_CONFIGS, max_relative_logit_error, random_batches, tiny_model
from tests.engine.test_experts import MOE, _blocks, _fused

BATCHES = random_batches(COMMON["vocab_size"], count=2, batch=2, length=16)


class _Recorder(NeuronSelector):
    """Keeps the first neurons and remembers every problem it was given."""

    name = "recorder"

    def __init__(self) -> None:
        self.problems: list[NeuronProblem] = []

    def select(self, problem: NeuronProblem) -> NeuronChoice:
        self.problems.append(problem)
        return NeuronChoice(torch.arange(problem.keep))


@pytest.mark.parametrize("name", MOE)
def test_keeping_every_expert_neuron_changes_nothing(name: str) -> None:
    original, model = _fused(name)
    family = family_for(name)
    width = mlp_neurons(model.config, family)
    assert width == _blocks(model)[0].experts[0].down_proj.in_features  # the family names the experts' width
    records = prune_mlp(model, family, BATCHES, width, MlpOptions(ObsSelector(), feedback=0.5))
    assert max_relative_logit_error(original, model, BATCHES) < 1e-5
    assert len(records) == len(_blocks(model))  # the tiny Qwen3-MoE's dense layer keeps its width, unrecorded
    tokens = sum(batch.input_ids.numel() for batch in BATCHES)
    for record in records:
        assert record.experts == 4 and record.tokens == tokens and record.feedback == 0.0
        assert record.error_refit == pytest.approx(0.0, abs=1e-9)


def test_each_expert_s_statistics_are_its_routed_tokens_weighed_by_their_weights() -> None:
    """C_e = E[1{x→e} w² h hᵀ] and the activation E[1{x→e} w |h|] over every counted token,
    computed here from the block's own routing on layer 0's input (nothing before it is pruned)."""
    _, model = _fused("qwen3_moe")
    block = _blocks(model)[0]
    x = torch.cat([_block_input(model, block, batch) for batch in BATCHES])
    chosen, weights = block.route(x)
    expected = []
    for e, expert in enumerate(block.experts):
        routed = (chosen == e).any(-1)
        w = (weights * (chosen == e)).sum(-1)[routed].double()
        h = expert.activation(x[routed]).double() * w[:, None]
        expected.append((int(routed.sum()), h.T @ h / x.shape[0], h.abs().sum(0) / x.shape[0]))
    recorder = _Recorder()
    records = prune_mlp(model, family_for("qwen3_moe"), BATCHES, 16, MlpOptions(recorder, refit=False))
    problems = [problem for problem in recorder.problems if problem.layer == 0]
    assert [problem.expert for problem in problems] == [0, 1, 2, 3]
    for problem, (tokens, C, activation) in zip(problems, expected, strict=True):
        assert problem.tokens == tokens > 0
        assert torch.allclose(problem.C, C, rtol=1e-5, atol=1e-12)
        assert torch.allclose(problem.activation, activation, rtol=1e-5, atol=1e-12)
    assert sum(tokens for tokens, _, _ in expected) == x.shape[0] * block.top_k
    assert records[0].fewest_tokens == min(tokens for tokens, _, _ in expected)


def _block_input(model: torch.nn.Module, block: RoutedExperts, batch) -> torch.Tensor:
    """What `block` reads on `batch` (tokens × d)."""
    captured = {}
    handle = block.register_forward_pre_hook(lambda _, args: captured.setdefault("x", args[0]))
    try:
        with torch.no_grad():
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    finally:
        handle.remove()
    return captured["x"].reshape(-1, captured["x"].shape[-1])


def test_the_reported_error_is_what_the_pruned_experts_leave_on_their_routed_tokens() -> None:
    """error_refit = Σ_t Σ_{e∋t} w²‖W_e h − W'_e h_S‖² / Σ_t Σ_{e∋t} w²‖W_e h‖², measured on layer 0's
    input with the pruned experts, and the refit leaves less than the kept weights as they were."""
    _, model = _fused("qwen2_moe")
    block = _blocks(model)[0]
    x = torch.cat([_block_input(model, block, batch) for batch in BATCHES])
    chosen, weights = block.route(x)
    before = [copy.deepcopy(expert) for expert in block.experts]
    records = prune_mlp(model, family_for("qwen2_moe"), BATCHES, 12, MlpOptions(Magnitude()))
    error = energy = 0.0
    for e, (old, new) in enumerate(zip(before, block.experts, strict=True)):
        routed = (chosen == e).any(-1)
        w = (weights * (chosen == e)).sum(-1)[routed].double()[:, None]
        target = old(x[routed]).double() * w
        error += float(((target - new(x[routed]).double() * w) ** 2).sum())
        energy += float((target**2).sum())
    assert records[0].error_refit == pytest.approx(error / energy, rel=1e-4)
    assert records[0].error_refit < records[0].error_dropped
    assert block.experts[0].gate_up_proj.out_features == 24 and block.experts[0].down_proj.in_features == 12
    assert block.shared_expert.down_proj.in_features == 48  # the shared expert keeps its width


def test_an_expert_no_token_reached_keeps_its_largest_writers_as_they_were() -> None:
    """No statistics: C_e = I, so the output-aware choice keeps the neurons whose down columns are
    longest and the refit leaves their weights as they were."""
    _, model = _fused("mixtral")
    before = []
    for block in _blocks(model):
        router = block.router
        block.router = torch.nn.Linear(router.in_features, router.out_features, dtype=router.weight.dtype)
        block.router.weight.data, block.router.bias.data = router.weight.data, torch.tensor([0.0, 0.0, 0.0, -1e4])
        block.router.requires_grad_(False)
        before.append(block.experts[3].down_proj.weight.clone())
    records = prune_mlp(model, family_for("mixtral"), BATCHES, 8, MlpOptions(ObsSelector(), refit=True))
    for record, block, down in zip(records, _blocks(model), before, strict=True):
        assert record.fewest_tokens == 0
        longest = torch.sort(torch.topk(down.norm(dim=0), 8).indices).values
        assert torch.equal(block.experts[3].down_proj.weight, down[:, longest])


def test_a_narrower_expert_model_is_the_family_s_own_class_with_a_smaller_width() -> None:
    for name in ("qwen3_moe", "mixtral"):
        _, model = _fused(name)
        family = family_for(name)
        prune_mlp(model, family, BATCHES, 8, MlpOptions(ObsSelector()))
        config = with_mlp_width(model.config, family, 8)
        stock = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        missing, unexpected = stock.load_state_dict(fused_experts_state(model.state_dict()), strict=False)
        assert not unexpected and all(key.endswith("norm.weight") for key in missing)
        assert stock.model.layers[0].mlp.experts.down_proj.shape[-1] == 8
        assert max_relative_logit_error(model, stock, BATCHES) < 1e-5


def test_keeping_more_neurons_than_an_expert_has_is_refused() -> None:
    _, model = _fused("qwen3_moe")
    with pytest.raises(UserError, match="cannot keep 33 of the 32 neurons of layer 0's experts"):
        prune_mlp(model, family_for("qwen3_moe"), BATCHES, 33, MlpOptions(Magnitude()))


def test_fused_experts_the_family_has_not_prepared_stop_the_stage_instead_of_being_skipped() -> None:
    model = tiny_model("qwen3_moe")  # its experts still the fused tensors of transformers' class
    with pytest.raises(RuntimeError, match="layer 0's experts are fused"):
        prune_mlp(model, family_for("qwen3_moe"), BATCHES, 16, MlpOptions(Magnitude()))


def test_an_expert_no_token_reached_scores_its_neurons_by_what_they_would_write() -> None:
    """Magnitude reads the activation, which an unrouted expert has not: it gets the down
    projection's column norms, so magnitude keeps the same neurons OBS does there."""
    from compressor.engine.expert_width import _ExpertWidthMoments

    moments = _ExpertWidthMoments(2, 6, torch.device("cpu"))
    moments.tokens, moments.routed[0] = 10, 10.0
    down = torch.randn(4, 6, dtype=torch.float64)
    problem = moments.problem(1, 0, 3, down, 1e-2, None)
    assert problem.tokens == 0 and torch.equal(problem.C, torch.eye(6, dtype=torch.float64))
    assert torch.equal(problem.activation, down.norm(dim=0))
    kept = Magnitude().select(problem).kept
    assert set(kept.tolist()) == set(torch.topk(down.norm(dim=0), 3).indices.tolist())


SHARED = [name for name in MOE if "shared_expert_intermediate_size" in FAMILY_CONFIGS[name]]


@pytest.mark.parametrize("name", SHARED)
def test_keeping_every_shared_expert_neuron_changes_nothing_and_the_routed_experts_keep_their_width(name: str) -> None:
    original, model = _fused(name)
    width = _blocks(model)[0].shared_expert.down_proj.in_features
    records = prune_mlp(model, family_for(name), BATCHES, None, MlpOptions(ObsSelector()), shared_keep=width)
    assert max_relative_logit_error(original, model, BATCHES) < 1e-5
    for record, block in zip(records, _blocks(model), strict=True):
        assert record.kept == record.width == block.experts[0].down_proj.in_features  # routed experts untouched
        assert record.error_dropped == 0.0 and record.fewest_tokens is None
        assert record.shared_expert.width == record.shared_expert.kept == width
        assert record.shared_expert.error_refit == pytest.approx(0.0, abs=1e-9)


@torch.no_grad()
def test_the_shared_expert_s_statistics_are_every_token_weighed_by_its_gate() -> None:
    """C = E[σ(g·x)² h hᵀ] and the activation E[σ(g·x) |h|] over every counted token: the block
    writes σ(g·x)·W h, so a token the gate mostly closes weighs less."""
    _, model = _fused("qwen2_moe")
    block = _blocks(model)[0]
    x = torch.cat([_block_input(model, block, batch) for batch in BATCHES])
    expert = block.shared_expert
    h = (torch.sigmoid(block.shared_expert_gate(x)) * expert.act_fn(expert.gate_proj(x)) * expert.up_proj(x)).double()
    recorder = _Recorder()
    records = prune_mlp(
        model, family_for("qwen2_moe"), BATCHES, None, MlpOptions(recorder, refit=False), shared_keep=20
    )
    problem = next(problem for problem in recorder.problems if problem.layer == 0)
    assert len(recorder.problems) == len(records)  # one problem per layer: no routed expert's
    assert problem.expert is None and problem.tokens == x.shape[0] and problem.keep == 20
    assert torch.allclose(problem.C, h.T @ h / x.shape[0], rtol=1e-5, atol=1e-12)
    assert torch.allclose(problem.activation, h.abs().sum(0) / x.shape[0], rtol=1e-5, atol=1e-12)
    assert expert.gate_proj.out_features == expert.up_proj.out_features == expert.down_proj.in_features == 20


@torch.no_grad()
def test_the_shared_expert_s_reported_error_is_what_its_gated_output_loses() -> None:
    """error_refit = Σ_t σ²‖W h − W' h_S‖² / Σ_t σ²‖W h‖² on layer 0's input, below the kept
    weights' own error, with the routed experts narrowed beside it."""
    _, model = _fused("qwen2_moe")
    block = _blocks(model)[0]
    x = torch.cat([_block_input(model, block, batch) for batch in BATCHES])
    before = copy.deepcopy(block.shared_expert)
    gate = torch.sigmoid(block.shared_expert_gate(x)).double()
    records = prune_mlp(model, family_for("qwen2_moe"), BATCHES, 16, MlpOptions(Magnitude()), shared_keep=24)
    target = before(x).double() * gate
    error = float(((target - block.shared_expert(x).double() * gate) ** 2).sum()) / float((target**2).sum())
    shared = records[0].shared_expert
    assert shared.error_refit == pytest.approx(error, rel=1e-4)
    assert shared.error_refit < shared.error_dropped
    assert records[0].kept == 16 and block.experts[0].down_proj.in_features == 16


@pytest.mark.parametrize("name", SHARED)
def test_a_narrower_shared_expert_model_is_the_family_s_own_class_with_a_smaller_shared_width(name: str) -> None:
    _, model = _fused(name)
    family = family_for(name)
    prune_mlp(model, family, BATCHES, 16, MlpOptions(ObsSelector()), shared_keep=24)
    config = with_mlp_width(model.config, family, 16, 24)
    assert config.shared_expert_intermediate_size == 24 and config.moe_intermediate_size == 16
    stock = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    missing, unexpected = stock.load_state_dict(fused_experts_state(model.state_dict()), strict=False)
    assert not unexpected and all(key.endswith("norm.weight") for key in missing)
    assert max_relative_logit_error(model, stock, BATCHES) < 1e-5


def test_a_shared_width_is_refused_where_there_is_no_shared_expert_or_too_few_neurons() -> None:
    _, model = _fused("qwen3_moe")
    with pytest.raises(UserError, match="layer 0's MoE block has no shared expert; remove mlp.shared_kept"):
        prune_mlp(model, family_for("qwen3_moe"), BATCHES, None, MlpOptions(Magnitude()), shared_keep=8)
    _, model = _fused("qwen2_moe")
    with pytest.raises(UserError, match="cannot keep 49 of the 48 neurons of layer 0's shared expert"):
        prune_mlp(model, family_for("qwen2_moe"), BATCHES, None, MlpOptions(Magnitude()), shared_keep=49)
