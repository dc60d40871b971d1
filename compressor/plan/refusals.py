"""What the plan refuses and warns about, past what each recipe section checks alone: settings a
layout cannot run with (a stream kept whole, a vision-language checkpoint, windows past the
model's positions, an attention implementation it lacks), and budgets that keep so little that
the run should say so."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import AutoModelForCausalLM, PretrainedConfig

from compressor.errors import UserError
from compressor.models.layout import LayoutRequest, SlicedLayout, sliced_layout
from compressor.models.towers import TextTower
from compressor.recipe.schema import Recipe
from compressor.reports.report import budget_label
from compressor.stages.split import open_sections

if TYPE_CHECKING:
    from compressor.plan.checks import Plan


def check_attention(recipe: Recipe, config: PretrainedConfig) -> None:
    """The recipe's attention kernel is one the model's class has (Gemma 2 has no sdpa attention
    in transformers 5): refused here, in one line, rather than by transformers at loading."""
    if recipe.model.attn_implementation != "sdpa":
        return
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if model_class is not None and not getattr(model_class, "_supports_sdpa", True):
        raise UserError(
            f"model.attn_implementation: sdpa: {model_class.__name__} has no sdpa attention in this "
            f"transformers; set model.attn_implementation: eager"
        )


def refuse_beside_a_kept_stream(recipe: Recipe, config: PretrainedConfig, reason: str) -> None:
    """What a layout that keeps the stream whole (`models.mlp_only`) does not run with yet, in one line."""
    if recipe.experts is not None:
        raise UserError(
            f"experts: a {recipe.slicing.layout} {config.model_type} keeps its stream whole ({reason}), which "
            f"expert pruning does not run with yet; set slicing.layout: per_site"
        )
    if recipe.depth is not None:
        raise UserError(
            f"depth: a {recipe.slicing.layout} {config.model_type} keeps its stream whole ({reason}), where blocks are "
            f"not removed yet; set slicing.layout: per_site, or remove depth"
        )
    if recipe.heads is not None:
        raise UserError(
            f"heads: a {recipe.slicing.layout} {config.model_type} keeps its stream whole ({reason}), where heads "
            f"are not pruned yet; set slicing.layout: per_site, or remove heads"
        )
    if recipe.mlp is not None and recipe.mlp.shared_kept is not None:
        raise UserError(
            f"mlp.shared_kept: a {recipe.slicing.layout} {config.model_type} keeps its stream whole ({reason}), where "
            f"shared experts are not pruned yet; set slicing.layout: per_site, or remove mlp.shared_kept"
        )
    if recipe.target_active_params is not None:
        raise UserError(
            f"target_active_params: a {recipe.slicing.layout} {config.model_type} keeps its stream whole ({reason}), "
            f"where only target_params is counted yet; give target_params, or set slicing.layout: per_site"
        )
    if recipe.slicing.kept not in (None, config.hidden_size):
        raise UserError(
            f"slicing.kept {recipe.slicing.kept}: a {recipe.slicing.layout} {config.model_type} keeps its stream "
            f"whole ({reason}), {config.hidden_size} wide; remove slicing.kept, or set slicing.layout: per_site"
        )


WIDE_LOSS = 0.5
"""Keeping less than this share of the hidden width (or of the parameters) warns: past it,
pruning the residual stream alone costs a large part of the model's quality."""


def budget_warnings(recipe: Recipe, checked: Plan) -> list[str]:
    """A budget that keeps under half the width runs, with a warning that names what it keeps; an
    `mlp` whose budget leaves no split but the residual width alone, with one that says so."""
    warnings = []
    if not checked.layout.residual:
        warnings.append(
            f"slicing.layout: {recipe.slicing.layout} keeps a {checked.layout.config.model_type} model's residual "
            f"stream whole "
            f"and prunes its MLPs alone, so the pipeline's strategies "
            f"({' + '.join(step.strategy for step in recipe.pipeline)}), which choose residual bases, do not run"
        )
    open_experts = "experts" in open_sections(recipe)
    if open_experts and checked.layout.residual and checked.splits and checked.splits[0].experts is not None:
        warnings.append(
            "experts: no width meets the budget with every expert kept, so the run measures fewer experts only "
            "(the residual width alone is not among the candidates)"
        )
    if open_experts and len({split.experts for split in checked.splits}) == 1:
        warnings.append(
            "experts: the budget leaves one expert count to measure, so the run does not choose it; lower "
            "experts.min_kept or raise the target to give it more"
        )
    one_split = len(checked.splits) == 1 and "mlp" in open_sections(recipe) and recipe.slicing.kept is None
    besides = "" if checked.layout.shared_width is None else " (and the shared experts' fixed width)"
    if one_split and checked.layout.kept == checked.layout.config.hidden_size:
        warnings.append(
            "mlp: the budget keeps the whole residual width, so there is no split to choose and the MLP keeps "
            f"every neuron{besides and ' but the shared experts narrow'}; to prune the MLP within this budget, "
            "fix mlp.kept"
        )
    elif one_split:
        warnings.append(
            "mlp: the budget leaves no wider residual stream whose MLPs keep mlp.min_kept of their neurons, "
            f"so the run prunes the residual width alone{besides}; lower mlp.min_kept to let the MLP give more"
        )
    d = checked.layout.config.hidden_size
    if checked.layout.kept is not None and checked.layout.kept < WIDE_LOSS * d:
        what = f"keeps {checked.layout.kept} of {d} dimensions of the residual stream"
    elif checked.layout.kept is None and checked.layout.budget < WIDE_LOSS * checked.layout.counted.original:
        what = f"keeps {checked.layout.budget / checked.layout.counted.original:.0%} of the parameters"
    else:
        return warnings
    budget = budget_label(recipe.sparsity, recipe.target_params, recipe.target_active_params)
    return [
        *warnings,
        f"{budget} {what}: expect a large loss of quality (the report's KL and perplexity say how large); "
        f"consider removing less{_tied_head_advice(recipe, checked)}",
    ]


def _tied_head_advice(recipe: Recipe, checked: Plan) -> str:
    """A per-site layout unties a tied model's head (a second vocabulary × width matrix), which an
    embedding-heavy model pays for with most of its width: name the width a tied head keeps."""
    layout = checked.layout
    if (
        recipe.slicing.tie_head is not None
        or layout.one_basis
        or layout.kept is None
        or not getattr(layout.config, "tie_word_embeddings", False)
        or checked.removed_blocks  # its config is the model without them: the budget's reference is not
    ):
        return ""
    try:
        request = LayoutRequest(
            layout=recipe.slicing.layout,
            tie_head=True,
            round_to=recipe.slicing.round_to,
            sparsity=recipe.sparsity,
            target_params=recipe.target_params,
            target_active_params=recipe.target_active_params,
            mlp_kept=layout.mlp_width,
            shared_kept=layout.shared_width,
            experts=layout.experts,
            counts=recipe.budget,
            heads=layout.heads,
        )
        tied = sliced_layout(layout.config, layout.family, [layout.family], request)
    except UserError:  # this family's head cannot stay tied
        return ""
    if tied.kept is None or tied.kept <= layout.kept:
        return ""
    return (
        f", or set slicing.tie_head: true (this per-site layout unties the head, a second "
        f"{layout.config.vocab_size} × width matrix; tied, the budget keeps width {tied.kept})"
    )


def check_mlp_alone(recipe: Recipe, layout: SlicedLayout) -> None:
    """A layout that keeps the residual stream (`models.mlp_only`) has no bases to refine, allocate
    or share: those settings are refused rather than silently unused."""
    name = layout.config.model_type
    for present, setting in (
        (recipe.refinement is not None, "refinement"),
        (recipe.allocation.method == "curves", "allocation.method: curves"),
        (recipe.slicing.shared_bases, "slicing.shared_bases"),
    ):
        if present:
            raise UserError(
                f"{setting} moves residual bases, which a stock {name} does not have (its global layout prunes "
                f"the MLP's width alone); remove {setting}, or set slicing.layout: per_site"
            )


def check_tower(recipe: Recipe, config: PretrainedConfig, tower: TextTower) -> None:
    """A vision-language checkpoint is saved whole as its own class: a global layout, in memory,
    with no distillation (its student would be the text model alone)."""
    name = ", ".join(config.architectures or [config.model_type])
    if recipe.slicing.layout != "global":
        raise UserError(
            f"{name} is a vision-language checkpoint, saved whole as its own class, which holds one residual "
            f"basis only; set slicing.layout: global"
        )
    for present, setting in (
        (recipe.model.load == "stream", "model.load: stream"),
        (recipe.distillation is not None, "distillation"),
    ):
        if present:
            raise UserError(f"{name}: a vision-language checkpoint is pruned in memory without {setting}; remove it")


def check_positions(recipe: Recipe, config: PretrainedConfig) -> None:
    """Windows longer than the model's positions would be scored past what it was trained on (its
    perplexity then means nothing): refused, naming the limit."""
    positions = getattr(config, "max_position_embeddings", None)
    for where, spec in (("calibration", recipe.calibration), ("evaluation", recipe.evaluation)):
        if spec is not None and isinstance(positions, int) and spec.seq_len > positions:
            raise UserError(
                f"{where}.seq_len is {spec.seq_len}, beyond the model's {positions} positions "
                f"(max_position_embeddings); set {where}.seq_len to {positions} or less"
            )
