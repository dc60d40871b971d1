"""Routed experts as a pruning axis (issue 48, items 2 and 3): the statistics see every expert,
keeping every expert changes nothing, a model with fewer experts is the family's own class with a
smaller count, and each selector removes what it should on constructed problems."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.engine.experts import ExpertOptions, ExpertRecord, protected_experts, prune_experts
from compressor.engine.transforms import fuse_norms
from compressor.errors import UserError
from compressor.models.experts import RoutedExperts
from compressor.models.families import family_for
from compressor.models.layout import with_experts
from compressor.plugin import ExpertChoice, ExpertProblem, ExpertSelector, hookimpl, routing_weights
from compressor.strategies.registry import PluginRegistry
from compressor_plugins.experts import Frequency, OutputAware, Reap
from tests.conftest import COMMON, MOE_FAMILIES, copy_model, max_relative_logit_error, random_batches, tiny_model

MOE = MOE_FAMILIES
BATCHES = random_batches(COMMON["vocab_size"], count=2, batch=2, length=16)


def _fused(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    original = tiny_model(name)
    model = copy_model(original)
    fuse_norms(model, family_for(name))
    return original, model


def _blocks(model: torch.nn.Module) -> list[RoutedExperts]:
    return [module for module in model.modules() if isinstance(module, RoutedExperts)]


@pytest.mark.parametrize("name", MOE)
def test_keeping_every_expert_changes_nothing_and_the_counts_see_every_routed_token(name: str) -> None:
    original, model = _fused(name)
    experts = len(_blocks(model)[0].experts)
    records = prune_experts(model, family_for(name), BATCHES, experts, ExpertOptions(Frequency()))
    assert max_relative_logit_error(original, model, BATCHES) < 1e-5
    tokens = sum(batch.input_ids.numel() for batch in BATCHES)
    assert len(records) == len(_blocks(model))
    for record, block in zip(records, _blocks(model), strict=True):
        assert sum(record.tokens) == tokens * block.top_k  # every routed (token, expert) pair, none twice
        assert record.kept == list(range(experts)) and record.fewest_tokens == min(record.tokens)


@pytest.mark.parametrize("name", MOE)
def test_a_model_with_fewer_experts_is_the_family_s_own_class_with_a_smaller_count(name: str) -> None:
    """Renormalised routers (Qwen3-MoE, Mixtral) re-pick; OLMoE's softmax over the experts left is
    what its own class computes with fewer experts too; Qwen2-MoE's shared expert stays as it was;
    gpt-oss's router bias loses the removed experts' entries."""
    _, model = _fused(name)
    family = family_for(name)
    records = prune_experts(model, family, BATCHES, 3, ExpertOptions(Reap(), super_ratio=None))
    assert all(len(record.kept) == 3 for record in records)
    config = with_experts(model.config, family, 3)
    stock = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    missing, unexpected = stock.load_state_dict(family.own_state(model.state_dict()), strict=False)
    assert not unexpected and all(key.endswith("norm.weight") for key in missing)  # fused: the norms are ones
    assert stock.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 3
    assert max_relative_logit_error(model, stock, BATCHES) < 1e-5


def test_the_output_sample_is_the_same_in_any_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every expert's output on the sample is taken a chunk of tokens at a time (its memory bounded
    whatever the model): the choice and its figures do not depend on the chunk."""
    import compressor.engine.experts as engine_experts

    figures = []
    for elements in (1 << 25, 3 * 4 * COMMON["hidden_size"]):  # everything at once; 3 tokens at a time
        monkeypatch.setattr(engine_experts, "OUTPUT_ELEMENTS", elements)
        _, model = _fused("qwen2_moe")
        records = prune_experts(
            model, family_for("qwen2_moe"), BATCHES, 2, ExpertOptions(OutputAware(), super_ratio=None)
        )
        figures.append([(record.kept, record.objectives["output_change"]) for record in records])
    assert [kept for kept, _ in figures[0]] == [kept for kept, _ in figures[1]]
    assert all(
        a == pytest.approx(b, rel=1e-5) for (_, a), (_, b) in zip(figures[0], figures[1], strict=True)
    )  # float32 experts


def test_an_unprepared_model_s_fused_experts_are_refused_not_measured_by_passing_them() -> None:
    """A block whose experts a hook cannot see (transformers' fused kernels) gives no statistics:
    the stage says so rather than pruning on none."""
    model = tiny_model("qwen3_moe")
    with pytest.raises(UserError, match="no routed-experts layer"):
        prune_experts(model, family_for("qwen3_moe"), BATCHES, 3, ExpertOptions(Frequency()))


@pytest.mark.parametrize("normalise", [True, False])
def test_the_output_selector_s_routing_is_the_router_s_with_those_experts_gone(normalise: bool) -> None:
    _, model = _fused("qwen3_moe")
    block = _blocks(model)[0]
    block.normalise = normalise
    x = torch.randn(40, COMMON["hidden_size"])
    P = torch.softmax(block.router(x).double(), dim=-1)
    removed = torch.tensor([[False, True, False, False]])
    predicted = routing_weights(P, removed, block.top_k, normalise)[0]
    block.keep_experts(torch.tensor([0, 2, 3]))
    chosen, weights = block.route(x)
    actual = torch.zeros(40, 3, dtype=torch.float64).scatter_(-1, chosen, weights.double())
    assert torch.allclose(predicted[:, [0, 2, 3]], actual, atol=1e-6)
    assert predicted[:, 1].abs().max() == 0


def _problem(tokens, reap, peak=None, keep=3, top_k=1, P=None, gram=None, protected=None) -> ExpertProblem:
    E = len(tokens)
    peak = torch.ones(E, dtype=torch.float64) if peak is None else torch.tensor(peak, dtype=torch.float64)
    return ExpertProblem(
        layer=0,
        keep=keep,
        top_k=top_k,
        normalise=True,
        tokens=torch.tensor(tokens),
        gate=torch.tensor(tokens, dtype=torch.float64),
        reap=torch.tensor(reap, dtype=torch.float64),
        peak=peak,
        protected=torch.zeros(E, dtype=torch.bool) if protected is None else torch.tensor(protected),
        probabilities=P,
        gram=gram,
    )


def _outputs_problem(keep: int, twins: bool = True) -> ExpertProblem:
    """Four experts, each token routed to one (top-1). Experts 0 and 3 write the same output
    (`twins`; else orthogonal ones) and are each other's second choice, chosen by most tokens;
    expert 2 writes 100 times more and is chosen by few; expert 1 by none."""
    outputs = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 100.0, 0], [1.0, 0, 0, 0]], dtype=torch.float64)
    if not twins:
        outputs[3] = torch.tensor([0, 0, 0, 1.0])
    preferences = [(0, 3)] * 28 + [(3, 0)] * 28 + [(2, 0)] * 8  # (first, second) choice of each token
    logits = torch.zeros(len(preferences), 4, dtype=torch.float64)
    for token, (first, second) in enumerate(preferences):
        logits[token, first], logits[token, second] = 3.0, 2.0
    P = torch.softmax(logits, dim=-1)
    gram = (outputs @ outputs.T).expand(len(preferences), 4, 4).clone()
    tokens = torch.bincount(torch.tensor([first for first, _ in preferences]), minlength=4)
    return _problem(tokens.tolist(), [1.0, 0.0, 100.0, 1.0], keep=keep, P=P, gram=gram)


def test_an_expert_no_token_uses_goes_first_under_every_selector() -> None:
    problem = _outputs_problem(keep=3, twins=False)
    assert problem.tokens[1] == 0
    for selector in (Frequency(), Reap(), OutputAware()):
        kept = selector.select(problem).kept.tolist()
        assert 1 not in kept and len(kept) == 3, selector.name


def test_the_expert_whose_removal_changes_the_output_most_goes_last() -> None:
    """Expert 2 is rarely chosen but nothing else writes what it writes: frequency drops it;
    the output-aware selector drops one of the two experts that stand in for each other."""
    problem = _outputs_problem(keep=2)
    choice = OutputAware().select(problem)
    assert 2 in choice.kept.tolist() and choice.objectives["output_change"] == pytest.approx(0.0, abs=1e-12)
    assert Frequency().select(problem).kept.tolist() == [0, 3]


def test_protected_experts_stay_whatever_the_scores_say() -> None:
    problem = _outputs_problem(keep=2)
    problem.protected = torch.tensor([False, True, False, False])
    for selector in (Frequency(), Reap(), OutputAware()):
        assert 1 in selector.select(problem).kept.tolist(), selector.name


def test_super_experts_are_those_far_above_the_median_routed_peak() -> None:
    peak = torch.tensor([1.0, 1.2, 0.9, 30.0, 1.1], dtype=torch.float64)
    assert protected_experts(peak, 10.0).tolist() == [False, False, False, True, False]
    assert not protected_experts(peak, None).any()
    unrouted = torch.tensor([0.0, 0.0, 0.0, 30.0, 1.1, 1.0], dtype=torch.float64)  # most experts never chosen
    tokens = torch.tensor([0, 0, 0, 5, 7, 9])
    assert protected_experts(unrouted, 10.0, tokens).tolist() == [False, False, False, True, False, False]


def test_the_output_sample_spans_the_calibration_set() -> None:
    """With fewer sampled tokens than counted ones, every n-th token is taken, not the first ones."""
    from compressor.engine.experts import _ExpertMoments

    _, model = _fused("mixtral")
    block = _blocks(model)[0]
    stats = _ExpertMoments(len(block.experts), torch.device("cpu"), sample=10, G=None, counted=100)
    x = torch.randn(100, COMMON["hidden_size"])
    for part in x.split(30):  # batches of 30, 30, 30, 10 tokens
        stats.add(block, part)
    expected = torch.softmax(block.router(x[::10]).double(), dim=-1)
    assert stats.sampled == 10 and torch.allclose(torch.cat(stats.probabilities), expected)


class EveryOther(ExpertSelector):
    name = "every-other-expert"
    description = "keeps the even experts (a third party's selector)"

    def select(self, problem: ExpertProblem) -> ExpertChoice:
        return ExpertChoice(torch.arange(0, problem.experts, 2)[: problem.keep])


class ThirdParty:
    @hookimpl
    def compressor_expert_selectors(self) -> list[ExpertSelector]:
        return [EveryOther()]


def test_a_third_party_expert_selector_registers_and_prunes() -> None:
    registry = PluginRegistry(extra_plugins=[ThirdParty()])
    assert {"frequency", "reap", "output", "every-other-expert"} <= set(registry.expert_selectors())
    selector = registry.expert_selector("every-other-expert")
    _, model = _fused("mixtral")
    records = prune_experts(model, family_for("mixtral"), BATCHES, 2, ExpertOptions(selector, super_ratio=None))
    assert all(record.kept == [0, 2] and record.selector == "every-other-expert" for record in records)
    with pytest.raises(UserError, match="unknown expert selector 'reep'.*reap"):
        registry.expert_selector("reep")


def test_a_selector_that_drops_a_protected_expert_is_refused() -> None:
    class Careless(ExpertSelector):
        name = "careless"

        def select(self, problem: ExpertProblem) -> ExpertChoice:
            return ExpertChoice(torch.arange(problem.keep))

    _, model = _fused("mixtral")
    with pytest.raises(UserError, match="removed protected"):
        prune_experts(model, family_for("mixtral"), BATCHES, 2, ExpertOptions(Careless(), super_ratio=1.0 + 1e-9))


def test_expert_record_round_trips_for_the_report() -> None:
    record = ExpertRecord(layer=0, experts=4, kept=[0, 2], selector="reap", tokens=[3, 0, 5, 1], fewest_tokens=0)
    assert record.fewest_tokens == 0 and record.kept == [0, 2]
