"""Widths under one parameter budget: the exact parameter count of a sliced model from its config,
per-site widths by a dynamic program on loss curves, `target_params`, and bases shared by
consecutive sites (no transition between them)."""

from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import compressor.engine.allocation
from compressor.cli import main
from compressor.engine.allocation import Choice, CurveAllocator, groups_of, loss_curve, solve
from compressor.engine.bases import apply_bases, load_bases
from compressor.engine.checkpoint import Checkpoint
from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.errors import UserError
from compressor.evaluation.metrics import parameter_count
from compressor.models.budget import ParamModel, _count, layout_config, meta_model, param_model, widest_uniform
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor.models.sites import layer_site_ids, site_ids, site_widths
from compressor.models.sliced import apply_slicing_layout
from compressor.strategies.contract import DEFAULT_TAUS, coupled_loss, eigh_descending, frobenius_normalised
from compressor_plugins.pca import PCA
from compressor_plugins.sensitivity import Sensitivity
from tests.conftest import (
    COMMON,
    FAMILY_CONFIGS,
    copy_model,
    max_relative_logit_error,
    random_batches,
    save_tiny_checkpoint,
    tiny_model,
)
from tests.run.test_cli import write_recipe

# Shapes of real models (random weights are never built: counting happens on the meta device).
LARGE = {
    "135M tied": LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "8B": LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}


def sliced_params(config, family, widths, shared=(), tied=False) -> int:
    """The oracle for ParamModel: a sliced model built on the meta device, its parameters counted."""
    return sliced_counts(config, family, widths, shared, tied)[0]


def sliced_counts(config, family, widths, shared=(), tied=False) -> tuple[int, int]:
    """All the sliced model's parameters, and those outside its token and position tables."""
    model = meta_model(config)
    apply_slicing_layout(model, family, layout_config(model, family, widths, shared, tied))
    tables = sum(model.get_submodule(path).weight.numel() for path in (family.embedding, *family.extra_embeddings))
    return _count(model), _count(model) - tables


def _config(name: str):
    return AutoConfig.for_model(**{**COMMON, **FAMILY_CONFIGS[name]})


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_the_parameter_polynomial_counts_every_sliced_model_exactly(name: str) -> None:
    config = _config(name)
    family = family_for(config.model_type)
    ids = site_ids(family, config.num_hidden_layers)
    rng = random.Random(name)
    for trial in range(4):
        widths = {site: rng.choice([8, 16, 24, 40, 64]) for site in ids}
        shared = [site for site in ids[1:] if trial and rng.random() < 0.5]
        for site in shared:
            widths[site] = widths[ids[ids.index(site) - 1]]
        params = param_model(config, family, shared)
        everything, non_embedding = sliced_counts(config, family, widths, shared)
        assert params.count(widths) == everything
        assert params.without_embedding().count(widths) == non_embedding < everything
    assert param_model(config, family).original == sum(p.numel() for p in tiny_model(name).parameters())
    model = tiny_model(name)
    tables = sum(model.get_submodule(path).weight.numel() for path in (family.embedding, *family.extra_embeddings))
    assert param_model(config, family).without_embedding().original == _count(model) - tables


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_tied_head_is_embedding_and_an_untied_one_is_not(name: str) -> None:
    config = AutoConfig.for_model(**{**COMMON, **FAMILY_CONFIGS[name], "tie_word_embeddings": True})
    family = family_for(config.model_type)
    widths = {site: 40 for site in site_ids(family, config.num_hidden_layers)}
    tied, untied = param_model(config, family, tied=True), param_model(config, family)
    assert tied.without_embedding().count(widths) == sliced_counts(config, family, widths, tied=True)[1]
    # The untied head (vocabulary x the last site) is not an embedding table: it counts.
    head = config.vocab_size * 40
    assert untied.without_embedding().count(widths) - tied.without_embedding().count(widths) == head - 40 * 40


def test_the_8b_shape_counts_as_llama_31_8b() -> None:
    params = param_model(LARGE["8B"], family_for("llama"))
    assert params.original == 8_030_261_248  # Llama-3.1-8B's published parameter count
    widths = site_widths(family_for("llama"), 32, 4096, 4096, slice_head=True)
    transitions = 64 * 4096**2  # rotating without slicing adds one d × d matrix per site after the first
    norm_scales = 65 * 4096  # and fuses every RMSNorm scale into the linears it feeds
    assert params.count(widths) == params.original + transitions - norm_scales


def _brute_force(params, choices, budget, tie_ends):
    best = None
    for combo in itertools.product(*(range(len(c.widths)) for c in choices)):
        if tie_ends and choices[0].widths[combo[0]] != choices[-1].widths[combo[-1]]:
            continue
        widths = {s: c.widths[i] for c, i in zip(choices, combo) for s in c.sites}
        if params.count(widths) <= budget:
            loss = sum(c.losses[i] for c, i in zip(choices, combo))
            if best is None or loss < best[0] - 1e-12:
                best = (loss, widths)
    return best


@pytest.mark.parametrize("tie_ends", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_the_dynamic_program_finds_the_best_allocation_within_the_budget(tie_ends: bool, shared: bool) -> None:
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
    )
    family = family_for("llama")
    shared_sites = [layer_site_ids(family, i)[-1] for i in range(2)] if shared else []
    params = param_model(config, family, shared_sites)
    options = [8, 16, 24, 32]
    for trial in range(12):
        rng = random.Random(trial)
        choices = [
            Choice(group, options, sorted((rng.random() for _ in options), reverse=True))
            for group in groups_of(params, shared_sites)
        ]
        budget = params.count(site_widths(family, 2, 32, rng.choice([16, 24]), True)) - rng.randrange(0, 2000)
        expected = _brute_force(params, choices, budget, tie_ends)
        widths, solver = solve(params, choices, budget, tie_ends)
        assert solver == "exact"
        loss = sum(c.losses[c.widths.index(widths[c.sites[0]])] for c in choices)
        assert params.count(widths) <= budget
        assert loss == pytest.approx(expected[0], abs=1e-12)


@pytest.mark.parametrize("case", ["llama", "gemma2", "phi", "opt", "135M tied", "8B"])
def test_the_allocation_meets_the_budget_within_one_step(case: str) -> None:
    config = LARGE.get(case) or _config(case)
    family = family_for(config.model_type)
    d, layers, step = config.hidden_size, config.num_hidden_layers, 8 if config.hidden_size < 1024 else 128
    slice_head = family.head_width_is_embedding_width or case != "llama"
    uniform = site_widths(family, layers, d, kept_width(d, 0.25, 8), slice_head)
    params = param_model(config, family)
    budget = params.count(uniform)
    grid = list(range(d // 2, d + 1, step))
    choices = {s: grid for s in params.sites}
    if not slice_head:
        choices[params.sites[-1]] = [d]
    allocator = CurveAllocator(params, budget, choices, tie_ends=family.head_width_is_embedding_width)
    rng = random.Random(case)
    for site in params.sites:  # strictly decreasing curves of different steepness
        scale, power = rng.uniform(0.2, 5.0), rng.uniform(1.0, 2.5)
        allocator.curves[(site,)] = [scale * (d - w + 1) ** power for w in choices[site]]
    widths = allocator.widths()
    assert params.count(widths) == sliced_params(config, family, widths) <= budget
    assert allocator.predicted(widths) <= allocator.predicted(uniform) + 1e-9
    for site in params.sites:  # no site could keep one step more and still fit: the budget is used up
        if widths[site] + step <= max(choices[site]) and not family.head_width_is_embedding_width:
            wider = {**widths, site: widths[site] + step}
            assert params.count(wider) > budget


def test_loss_curves_are_the_best_candidates_predicted_kl() -> None:
    generator = torch.Generator().manual_seed(0)
    A, B = (torch.randn(16, 40, generator=generator, dtype=torch.float64) for _ in range(2))
    C, H = A @ A.T / 40, B @ B.T / 40
    widths = [4, 8, 12, 16]
    curve = loss_curve(C, H, widths)
    candidates = [eigh_descending(C)[1]] + [
        eigh_descending(tau * frobenius_normalised(C) + frobenius_normalised(H) / tau)[1] for tau in DEFAULT_TAUS
    ]
    best = [min(0.5 * coupled_loss(C, H, Q[:, k:]) for Q in candidates) for k in range(17)]
    for width, value in zip(widths, curve):  # the best candidate at this width or any narrower one
        assert value == pytest.approx(min(best[: width + 1]), rel=1e-9, abs=1e-12)
    assert curve == sorted(curve, reverse=True) and curve[-1] == 0.0
    assert curve[0] > 0


def _synthetic(constant: int, transitions: bool) -> ParamModel:
    """Four sites with small width costs under a large constant (a big vocabulary's embedding)."""
    sites = ("embedding", "a", "b", "c")
    pairs = tuple(zip(sites, sites[1:])) if transitions else ()
    return ParamModel(
        sites=sites,
        constant=constant,
        linear=dict(zip(sites, (70, 90, 90, 80))),
        transitions=pairs,
        original=constant + 10_000,
        hidden_size=32,
    )


def _loss(choices: list[Choice], widths: dict[str, int]) -> float:
    return sum(c.losses[c.widths.index(widths[c.sites[0]])] for c in choices)


def test_a_large_constant_still_finds_an_allocation_that_fits() -> None:
    """Cost buckets (1/2^17 of the budget) wider than a width step keep each bucket's cheapest
    point too: here the bucket's lowest-loss point (the embedding at 16) passes the early check
    (which leaves out the transition out of the current site) but cannot complete; only the
    cheaper point of its bucket (the embedding at 8) can."""
    params = _synthetic(2_000_000_000, transitions=True)
    options = [8, 16, 24, 32]
    rng = random.Random(1)
    choices = [Choice([s], options, sorted((rng.random() for _ in options), reverse=True)) for s in params.sites]
    narrowest = dict.fromkeys(params.sites, 8)
    budget = params.count(narrowest) + 70 * 8 + 8 * 8 - 30  # the embedding at 16 and its transition, nearly
    widths, _ = solve(params, choices, budget)
    assert params.count(widths) <= budget
    expected = _brute_force(params, choices, budget, False)
    assert _loss(choices, widths) == pytest.approx(expected[0], abs=1e-12)
    with pytest.raises(ValueError, match="no allocation"):
        solve(params, choices, params.count(narrowest) - 1)


@pytest.mark.parametrize("transitions", [True, False])
def test_the_lagrangian_solver_is_near_the_best_allocation(transitions: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced (as on deep models): within the budget, and at most one width step's loss above the
    brute-force optimum on convex curves."""
    monkeypatch.setattr(compressor.engine.allocation, "WORK_LIMIT", 0)
    params = _synthetic(1_000, transitions)
    options = [8, 16, 24, 32]
    for trial in range(12):
        rng = random.Random(trial)
        choices = []
        for site in params.sites:  # convex, decreasing
            scale, power = rng.uniform(0.2, 5.0), rng.uniform(1.0, 2.5)
            choices.append(Choice([site], options, [scale * (33 - w) ** power for w in options]))
        budget = params.count(dict.fromkeys(params.sites, rng.choice([16, 24]))) + rng.randrange(0, 300)
        expected = _brute_force(params, choices, budget, False)
        widths, solver = solve(params, choices, budget)
        assert solver == "lagrangian" and params.count(widths) <= budget
        step = max(a - b for c in choices for a, b in zip(c.losses, c.losses[1:]))
        assert expected[0] - 1e-9 <= _loss(choices, widths) <= expected[0] + step


@pytest.mark.parametrize("name", ["opt", "phi"])
def test_a_pruned_model_with_per_site_widths_has_the_predicted_parameters(name: str) -> None:
    """The families with projections around the stream (OPT) and one site per layer (Phi)."""
    original = tiny_model(name)
    family = family_for(name)
    config = original.config
    ids = site_ids(family, config.num_hidden_layers)
    rng = random.Random(name)
    widths = {site: rng.choice([24, 40, 56]) for site in ids}
    if family.head_width_is_embedding_width:
        widths[ids[-1]] = widths["embedding"]
    result = prune(
        copy_model(original),
        fixed_layout(original.config, family, widths),
        random_batches(config.vocab_size),
        [PipelineStep(PCA())],
    )
    assert parameter_count(result.model) == param_model(config, family).count(widths)


def test_widest_uniform_is_the_widest_under_the_target() -> None:
    config = LARGE["135M tied"]
    family = family_for("llama")
    params = param_model(config, family)

    def uniform(kept: int) -> dict[str, int]:
        return site_widths(family, 30, 576, kept, True)

    budget = int(0.75 * params.original)
    widths = widest_uniform(params, budget, 8, uniform)
    assert params.count(widths) <= budget < params.count(uniform(widths["embedding"] + 8))
    shared = [layer_site_ids(family, i)[-1] for i in range(30)]
    with_sharing = widest_uniform(param_model(config, family, shared), budget, 8, uniform)
    assert with_sharing["embedding"] > widths["embedding"]  # fewer transitions buy width


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_shared_bases_drop_the_transition_and_rebuild_exactly(name: str) -> None:
    original = tiny_model(name)
    family = family_for(name)
    config = original.config
    shared = [layer_site_ids(family, i)[-1] for i in range(config.num_hidden_layers)]
    batches = random_batches(config.vocab_size, padded=True)
    full = site_widths(family, config.num_hidden_layers, config.hidden_size, config.hidden_size, True)
    rotated = prune(
        copy_model(original), fixed_layout(original.config, family, full, shared=shared), batches, [PipelineStep(PCA())]
    )
    assert max_relative_logit_error(original, rotated.model, batches) < 1e-5  # exact without slicing
    widths = site_widths(family, config.num_hidden_layers, config.hidden_size, 48, True)
    steps = [PipelineStep(Sensitivity(), Sensitivity().parse_options({}))]
    result = prune(copy_model(original), fixed_layout(original.config, family, widths, shared=shared), batches, steps)
    for layer in result.model.get_submodule(family.layers):
        assert layer.mlp_shortcut is None and layer.attn_shortcut is not None
    assert parameter_count(result.model) == param_model(config, family, shared).count(widths)
    assert all(torch.equal(result.bases[s], result.bases[layer_site_ids(family, i)[0]]) for i, s in enumerate(shared))
    assert [r.steps[0]["strategy"] for r in result.sites if r.name in shared] == ["shared"] * len(shared)
    rebuilt = apply_bases(copy_model(original), family, result.bases)
    assert max_relative_logit_error(result.model, rebuilt, batches) == 0.0


class _Seen(PCA):
    """PCA that keeps the statistics each site's choice was given."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    requires = ("C", "H")

    def select(self, problem, incoming, options):
        self.seen[problem.name] = (problem.stats.C.clone(), problem.stats.extra["H"].clone())
        return super().select(problem, incoming, options)


def test_a_shared_basis_is_chosen_from_every_member_s_statistics() -> None:
    """At full width the walk's stream is the fused model's, so the attention site's choice sees
    C_attn + C_mlp (the MLP's looked ahead) and H_attn + H_mlp."""
    original = tiny_model("llama")
    family = family_for("llama")
    config = original.config
    layers = config.num_hidden_layers
    batches = random_batches(config.vocab_size, padded=True)
    full = site_widths(family, layers, config.hidden_size, config.hidden_size, True)
    ids = site_ids(family, layers)
    generator = torch.Generator().manual_seed(0)
    fisher = {}
    for site in ids:
        A = torch.randn(config.hidden_size, config.hidden_size, generator=generator, dtype=torch.float64)
        fisher[site] = A @ A.T
    alone, pooled = _Seen(), _Seen()
    prune(
        copy_model(original),
        fixed_layout(original.config, family, full),
        batches,
        [PipelineStep(alone)],
        WalkOptions(fisher=fisher),
    )
    shared = [layer_site_ids(family, i)[-1] for i in range(layers)]
    result = prune(
        copy_model(original),
        fixed_layout(original.config, family, full, shared=shared),
        batches,
        [PipelineStep(pooled)],
        WalkOptions(fisher=fisher),
    )
    assert sorted(pooled.seen) == sorted(set(ids) - set(shared))
    for i in range(layers):
        attn, mlp = layer_site_ids(family, i)
        C, H = pooled.seen[attn]
        expected = alone.seen[attn][0] + alone.seen[mlp][0]
        assert (C - expected).abs().max() <= 1e-5 * expected.abs().max()
        assert torch.equal(H, fisher[attn] + fisher[mlp])
        record = next(r for r in result.sites if r.name == attn)
        assert record.pooled_with == [mlp] and record.to_json()["pooled_with"] == [mlp]


def test_a_tied_head_s_basis_is_chosen_from_the_embedding_and_the_last_site() -> None:
    """At full width: the embedding's choice sees C and H of the embedding and of the last site
    (from the survey pass), the last site chooses nothing."""
    family = family_for("qwen2")
    original = tiny_model("qwen2")  # tied
    config = original.config
    batches = random_batches(config.vocab_size, padded=True)
    full = site_widths(family, config.num_hidden_layers, config.hidden_size, config.hidden_size, True)
    ids = site_ids(family, config.num_hidden_layers)
    fisher = {site: torch.eye(config.hidden_size, dtype=torch.float64) * (i + 1) for i, site in enumerate(ids)}
    alone, tied = _Seen(), _Seen()
    prune(
        tiny_model("qwen2"),
        fixed_layout(config, family, full),
        batches,
        [PipelineStep(alone)],
        WalkOptions(fisher=fisher),
    )
    result = prune(
        tiny_model("qwen2"),
        fixed_layout(config, family, full, tie_head=True),
        batches,
        [PipelineStep(tied)],
        WalkOptions(fisher=fisher),
    )
    assert sorted(tied.seen) == sorted(ids[:-1])
    C, H = tied.seen["embedding"]
    expected = alone.seen["embedding"][0] + alone.seen[ids[-1]][0]
    assert (C - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(H, fisher["embedding"] + fisher[ids[-1]])
    assert result.sites[0].pooled_with == [ids[-1]]
    assert max_relative_logit_error(original, result.model, batches) < 1e-5


def test_a_shared_group_s_loss_curve_adds_its_members_losses() -> None:
    generator = torch.Generator().manual_seed(1)
    pairs = []
    for _ in range(2):
        A, B = (torch.randn(12, 30, generator=generator, dtype=torch.float64) for _ in range(2))
        pairs.append((A @ A.T / 30, B @ B.T / 30))
    widths = [3, 6, 9, 12]
    curve = loss_curve(*pairs[0], widths, pooled=[pairs[1]])
    C, H = pairs[0][0] + pairs[1][0], pairs[0][1] + pairs[1][1]
    candidates = [eigh_descending(C)[1]] + [
        eigh_descending(tau * frobenius_normalised(C) + frobenius_normalised(H) / tau)[1] for tau in DEFAULT_TAUS
    ]
    best = [min(sum(0.5 * coupled_loss(c, h, Q[:, k:]) for c, h in pairs) for Q in candidates) for k in range(13)]
    for width, value in zip(widths, curve):
        assert value == pytest.approx(min(best[: width + 1]), rel=1e-9, abs=1e-12)


class _Counting(CurveAllocator):
    def observe(self, site, C, H):
        self.observed = getattr(self, "observed", 0) + 1
        super().observe(site, C, H)


def test_an_allocated_walk_uses_its_widths_and_resumes_without_a_second_survey(tmp_path: Path) -> None:
    original = tiny_model("llama")
    family = family_for("llama")
    config = original.config
    params = param_model(config, family)
    d = config.hidden_size
    budget = params.count(site_widths(family, 2, d, 48, True))
    choices = dict.fromkeys(params.sites, list(range(32, d + 1, 8)))
    steps = [PipelineStep(Sensitivity(), Sensitivity().parse_options({}))]
    batches = random_batches(config.vocab_size, padded=True)
    checkpoint = Checkpoint(tmp_path / "checkpoint")
    checkpoint.start({"test": "1"})
    first_allocator = _Counting(params, budget, choices)
    first = prune(
        copy_model(original),
        fixed_layout(original.config, family, None),
        batches,
        steps,
        WalkOptions(checkpoint=checkpoint, allocator=first_allocator),
    )
    assert first_allocator.observed == len(params.sites)
    assert first.widths == first_allocator.widths()  # the walk kept what the allocator chose
    assert [r.kept for r in first.sites] == [first.widths[s] for s in params.sites]
    assert parameter_count(first.model) == params.count(first.widths) <= budget
    assert first.allocation["widths"] == first.widths and first.allocation["budget"] == budget
    again_allocator = _Counting(params, budget, choices)
    again = prune(
        copy_model(original),
        fixed_layout(original.config, family, None),
        batches,
        steps,
        WalkOptions(checkpoint=checkpoint, allocator=again_allocator),
    )
    assert not hasattr(again_allocator, "observed") and again.loaded_sites == len(params.sites)
    assert max_relative_logit_error(first.model, again.model, batches) == 0.0


def test_a_resumed_tied_allocation_that_surveys_again_keeps_the_saved_allocation(tmp_path: Path) -> None:
    """Killed after allocation.json, before the embedding's site: the survey runs again for the tied
    head's C, but the widths and their record (solver, curves) come from the checkpoint."""
    original = tiny_model("qwen2")
    family = family_for("qwen2")
    params = param_model(original.config, family, [], True)
    grid = list(range(8, original.config.hidden_size + 1, 8))

    def allocator() -> CurveAllocator:
        return CurveAllocator(params, int(0.8 * params.original), dict.fromkeys(params.sites, grid), tie_ends=True)

    batches = random_batches(original.config.vocab_size)
    layout = fixed_layout(original.config, family, None, tie_head=True)
    checkpoint = Checkpoint(tmp_path / "checkpoint")
    checkpoint.start({"test": "1"})
    first = prune(
        original, layout, batches, [PipelineStep(PCA())], WalkOptions(checkpoint=checkpoint, allocator=allocator())
    )
    for site in checkpoint.sites_folder.glob("*.safetensors"):
        site.unlink()
    again = prune(
        tiny_model("qwen2"),
        layout,
        batches,
        [PipelineStep(PCA())],
        WalkOptions(checkpoint=checkpoint, allocator=allocator()),
    )
    assert again.loaded_sites == 0 and again.widths == first.widths
    assert again.allocation == json.loads(json.dumps(first.allocation))


def test_target_params_on_a_tied_model_keeps_at_most_that_share(tmp_path: Path) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "tied", "qwen2")  # tie_word_embeddings: true
    assert AutoModelForCausalLM.from_pretrained(checkpoint).config.tie_word_embeddings
    transitions = {}
    for way, changes in {
        "uniform": {},
        "shared": {"slicing": {"shared_bases": True}},
        "curves": {"allocation": {"method": "curves", "min_kept": 0.25}, "pipeline": [{"strategy": "sensitivity"}]},
    }.items():
        folder = tmp_path / way
        folder.mkdir()
        # its head is as large as its embedding, so a 75% model must slice the head's input too
        changes = {**changes, "slicing": {"slice_head": True, **changes.get("slicing", {})}}
        recipe = write_recipe(folder, checkpoint, sparsity=None, target_params=0.75, **changes)
        assert main(["run", str(recipe)]) == 0
        report = json.loads((folder / "out" / "report.json").read_text())
        reloaded = AutoModelForCausalLM.from_pretrained(folder / "out" / "model")
        assert parameter_count(reloaded) == report["params"]["pruned"] == report["allocation"]["predicted_params"]
        assert report["params"]["ratio"] <= 0.75
        transitions[way] = report["allocation"]["transition_params"]
        if way == "shared":  # only the attention sites carry a transition: half as many matrices
            assert transitions["shared"] < transitions["uniform"]
            bases = load_bases(folder / "out" / "bases.safetensors")
            assert torch.equal(bases["layers.0.mlp"], bases["layers.0.attn"])


@pytest.mark.parametrize("name", ["qwen2", "gemma2"])
def test_a_tied_head_stays_tied_exactly_without_slicing_and_rebuilds(name: str, tmp_path: Path) -> None:
    family = family_for(name)
    original = tiny_model(name)
    config = original.config
    batches = random_batches(config.vocab_size, padded=True)
    full = site_widths(family, config.num_hidden_layers, config.hidden_size, config.hidden_size, True)
    rotated = prune(tiny_model(name), fixed_layout(config, family, full, tie_head=True), batches, [PipelineStep(PCA())])
    assert max_relative_logit_error(original, rotated.model, batches) < 1e-5  # the least-squares map is exact
    widths = site_widths(family, config.num_hidden_layers, config.hidden_size, 48, True)
    result = prune(
        tiny_model(name), fixed_layout(config, family, widths, tie_head=True), batches, [PipelineStep(PCA())]
    )
    model = result.model
    assert model.get_submodule(family.head).weight is model.get_submodule(family.embedding).weight
    assert torch.equal(result.bases[site_ids(family, config.num_hidden_layers)[-1]], result.bases["embedding"])
    assert parameter_count(model) == param_model(config, family, tied=True).count(widths)
    assert parameter_count(model) < param_model(config, family).count(widths)  # no second vocabulary matrix
    rebuilt = apply_bases(tiny_model(name), family, result.bases)
    assert max_relative_logit_error(model, rebuilt, batches) == 0.0
    model.save_pretrained(tmp_path / "model")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="eager").eval()
    assert reloaded.get_submodule(family.head).weight is reloaded.get_submodule(family.embedding).weight
    assert parameter_count(reloaded) == parameter_count(model)
    assert max_relative_logit_error(model, reloaded, batches) < 1e-5


def test_tie_head_refuses_an_untied_model_before_changing_it() -> None:
    """The layout refuses a tie on an untied config; the walk refuses a tied layout for a model
    instance whose head was untied since (before touching a weight)."""
    family = family_for("qwen2")
    model = tiny_model("qwen2")  # tie_word_embeddings: true
    widths = site_widths(family, model.config.num_hidden_layers, model.config.hidden_size, 48, True)
    untied = tiny_model("llama")  # tie_word_embeddings: false
    llama_widths = site_widths(
        family_for("llama"), untied.config.num_hidden_layers, untied.config.hidden_size, 48, True
    )
    with pytest.raises(UserError, match="head is untied"):
        fixed_layout(untied.config, family_for("llama"), llama_widths, tie_head=True)
    layout = fixed_layout(model.config, family, widths, tie_head=True)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match="tie_head needs"):
        prune(model, layout, random_batches(model.config.vocab_size), [PipelineStep(PCA())])
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_target_params_with_a_tied_head_and_its_refusals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tied = save_tiny_checkpoint(tmp_path / "tied", "qwen2")
    folder = tmp_path / "run"
    folder.mkdir()
    recipe = write_recipe(folder, tied, sparsity=None, target_params=0.75, slicing={"tie_head": True})
    assert main(["run", str(recipe)]) == 0
    report = json.loads((folder / "out" / "report.json").read_text())
    assert report["params"]["ratio"] <= 0.75 and report["params"]["pruned"] == report["allocation"]["predicted_params"]
    reloaded = AutoModelForCausalLM.from_pretrained(folder / "out" / "model")
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    untied = save_tiny_checkpoint(tmp_path / "untied", "llama")
    capsys.readouterr()  # what saving printed (transformers' shard bar, where nothing has quieted it yet)
    for checkpoint, changes, message in [
        (untied, {"slicing": {"tie_head": True}}, "this model's head is untied"),
        (tied, {"sparsity": None, "target_params": 0.01}, "no uniform width reaches"),
        (tied, {"target_params": 0.5}, "give one of sparsity"),
        (tied, {"allocation": {"method": "evolution"}}, "allocation.method must be one of"),
        (tied, {"allocation": {"method": "curves", "step": 12}}, "allocation.step must be a positive multiple"),
        (untied, {"allocation": {"method": "curves", "min_kept": 0.99}}, "below the narrowest allocation"),
    ]:
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        bad.mkdir()
        assert main(["run", str(write_recipe(bad, checkpoint, **changes))]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not (bad / "out").exists()


def test_shared_bases_with_the_head_input_kept_whole(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, slicing={"shared_bases": True})
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    kept = {site["name"]: site["kept"] for site in report["sites"]}
    assert kept["layers.1.mlp"] == 64 and kept["layers.0.mlp"] == kept["layers.0.attn"] >= 48
    assert report["allocation"]["shared_sites"] == ["layers.0.mlp"]
    assert report["params"]["pruned"] <= report["allocation"]["budget"]


def test_an_unreachable_budget_names_the_fraction_that_is_reachable(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The refusal's "raise target_params to at least f": f plans, a little less is refused again."""
    tied = save_tiny_checkpoint(tmp_path / "tied", "qwen2")
    capsys.readouterr()

    def dry_run(target: float) -> tuple[int, str]:
        folder = tmp_path / f"at-{target}"
        folder.mkdir()
        recipe = write_recipe(folder, tied, sparsity=None, target_params=target, slicing={"tie_head": True})
        code = main(["run", str(recipe), "--dry-run"])
        captured = capsys.readouterr()
        return code, captured.err.strip() + captured.out

    code, error = dry_run(0.01)
    assert code == 2 and len(error.splitlines()) == 1
    reachable = float(error.split("raise target_params to at least ")[1].split(",")[0])
    assert dry_run(reachable)[0] == 0
    assert dry_run(round(reachable - 0.002, 3))[0] == 2


def test_a_per_site_budget_that_unties_an_embedding_heavy_head_names_the_tied_width(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    tied = save_tiny_checkpoint(tmp_path / "tied", "qwen2")  # vocabulary 8192 x width 64: most of the model

    def plan_of(folder: str, **slicing) -> str:
        (tmp_path / folder).mkdir()
        recipe = write_recipe(tmp_path / folder, tied, sparsity=None, target_params=0.75, slicing=slicing)
        assert main(["run", str(recipe), "--dry-run"]) == 0
        return capsys.readouterr().out

    untied, kept_tied = plan_of("default", slice_head=True), plan_of("tied-head", slice_head=True, tie_head=True)
    width = int(kept_tied.split("kept width ")[1].split(";")[0].split()[0])
    assert "set slicing.tie_head: true (this per-site layout unties the head" in untied
    assert f"tied, the budget keeps width {width})" in untied
    assert "slicing.tie_head" not in kept_tied
