"""Active parameters, the parameters one token uses (issue 48, item 5): the layout's polynomial
against models built and counted, `target_active_params` as a budget beside `target_params`, the
splits the run measures within both, and the expert counts it tries."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from compressor.errors import UserError
from compressor.models.budget import layout_config
from compressor.models.experts import Expert, is_fused_experts
from compressor.models.families import BUILTIN_FAMILIES, family_for
from compressor.models.layout import LayoutRequest, sliced_layout, with_experts, with_mlp_width
from compressor.models.sliced import apply_slicing_layout
from compressor.models.split import expert_counts, split_layouts
from compressor.models.stock import stock_config
from tests.conftest import COMMON, FAMILY_CONFIGS, MOE_FAMILIES

MOE = MOE_FAMILIES


def _config(name: str) -> PretrainedConfig:
    return AutoConfig.for_model(**{**COMMON, **FAMILY_CONFIGS[name]})


def _used(model: torch.nn.Module, experts: int, top_k: int) -> int:
    """Counted on a built model: every parameter once, the routed experts' (the fused experts of
    each transformers sparse-MoE block, or the sliced class's `Expert` modules) at top_k of their E."""
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for m in model.modules() if is_fused_experts(m) for p in m.experts.parameters())
    routed += sum(p.numel() for m in model.modules() if isinstance(m, Expert) for p in m.parameters())
    assert routed and routed % experts == 0
    return total - routed + routed * top_k // experts


@pytest.mark.parametrize(
    ("name", "layout"),
    [(name, "per_site") for name in MOE] + [(name, "global") for name in MOE if name != "olmoe"],  # a global
)  # OLMoE keeps its stream whole (`models.mlp_only`), where the run refuses an active target
def test_the_active_polynomial_counts_what_a_token_uses_at_any_widths(name: str, layout: str) -> None:
    """For 3 kept experts of narrower width at random widths (one width for a global layout), the
    layout's active count equals a count of the model built so; the original's, the original's."""
    config, family = _config(name), family_for(name)
    width = int(getattr(config, family.mlp_width))
    request = LayoutRequest(layout=layout, slice_head=True, target_params=0.9, experts=3, mlp_kept=width // 2)
    plan = sliced_layout(config, family, BUILTIN_FAMILIES, request)
    assert plan.active is not None
    top_k = config.num_experts_per_tok
    with torch.device("meta"):
        original = AutoModelForCausalLM.from_config(config)
    assert plan.active.original == _used(original, getattr(config, family.experts), top_k)
    reduced = with_experts(with_mlp_width(config, family, width // 2), family, 3)
    rng = random.Random(0)
    for _ in range(3):
        if layout == "global":
            kept = rng.randrange(8, config.hidden_size + 1, 8)
            widths = plan.uniform(kept)
            with torch.device("meta"):
                built = AutoModelForCausalLM.from_config(stock_config(reduced, family, kept, tied=plan.tie_head))
        else:
            widths = {site: rng.randrange(8, config.hidden_size + 1, 8) for site in plan.sites}
            with torch.device("meta"):
                built = AutoModelForCausalLM.from_config(reduced)
            apply_slicing_layout(built, family, layout_config(built, family, widths))
        assert plan.active.count(widths) == _used(built, 3, top_k)
        assert plan.params.count(widths) == sum(p.numel() for p in built.parameters())


@pytest.mark.parametrize(
    "targets", [{"target_active_params": 0.7}, {"target_params": 0.9, "target_active_params": 0.7}]
)
def test_the_widest_width_within_both_targets(targets: dict) -> None:
    """The run keeps the widest width within every target given; one step wider breaks one."""
    config, family = _config("qwen3_moe"), family_for("qwen3_moe")
    plan = sliced_layout(
        config, family, BUILTIN_FAMILIES, LayoutRequest(slice_head=True, round_to=8, experts=3, **targets)
    )
    assert plan.active is not None and plan.active_budget == int(0.7 * plan.active.original) and plan.kept is not None
    assert plan.active.count(plan.widths) <= plan.active_budget and plan.params.count(plan.widths) <= plan.budget
    wider = plan.uniform(plan.kept + 8)
    assert plan.active.count(wider) > plan.active_budget or plan.params.count(wider) > plan.budget


def test_the_splits_fit_both_targets_with_the_residual_alone_first() -> None:
    config, family = _config("mixtral"), family_for("mixtral")
    slicing = LayoutRequest(slice_head=True, round_to=8, target_params=0.9, target_active_params=0.6, mlp_round_to=8)
    splits = split_layouts(config, family, BUILTIN_FAMILIES, slicing, min_kept=0.25, candidates=4)
    assert splits[0].mlp_width is None and len(splits) >= 2
    for split in splits:
        assert split.active is not None and split.active_budget is not None
        assert split.params.count(split.widths) <= split.budget
        assert split.active.count(split.widths) <= split.active_budget
    for split in splits[1:]:  # the most neurons at its width: 8 more break a target
        assert split.mlp_width is not None
        more = sliced_layout(config, family, BUILTIN_FAMILIES, replace(slicing, mlp_kept=split.mlp_width + 8))
        assert more.kept is not None and more.kept < split.kept


def test_a_model_without_routed_experts_has_no_active_target() -> None:
    config, family = _config("llama"), family_for("llama")
    assert sliced_layout(config, family, BUILTIN_FAMILIES, LayoutRequest(target_params=0.8)).active is None
    with pytest.raises(UserError, match="every parameter is active\\); give target_params instead"):
        sliced_layout(config, family, BUILTIN_FAMILIES, LayoutRequest(target_active_params=0.8))


def test_an_active_target_no_width_reaches_names_the_target() -> None:
    config, family = _config("qwen3_moe"), family_for("qwen3_moe")
    with pytest.raises(UserError, match="parameters per token .* raise target_active_params to at least"):
        sliced_layout(config, family, BUILTIN_FAMILIES, LayoutRequest(target_active_params=0.01))


@pytest.mark.parametrize(
    ("total", "top_k", "min_kept", "candidates", "counts"),
    [
        (8, 2, 0.5, 3, [8, 6, 4]),
        (8, 2, 0.25, 4, [8, 6, 4, 2]),
        (8, 2, 0.1, 3, [8, 5, 2]),  # never below top-k
        (4, 2, 0.5, 5, [4, 3, 2]),  # no more counts than there are
        (4, 4, 0.5, 3, [4]),
    ],
)
def test_expert_counts_run_from_every_expert_down_to_min_kept(
    total: int, top_k: int, min_kept: float, candidates: int, counts: list[int]
) -> None:
    assert expert_counts(total, top_k, min_kept, candidates) == counts
