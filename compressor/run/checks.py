"""Checks before any work: the recipe against the model's config and family (the sliced layout,
the budget, the strategies' options, the distillation settings), loading no weights."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from compressor.engine.allocation import CurveAllocator
from compressor.engine.pooling import PipelineStep, required_statistics
from compressor.errors import UserError
from compressor.models.families import family_for
from compressor.models.layout import SlicedLayout, sliced_layout
from compressor.models.mlp_only import kept_stream, mlp_only_layout
from compressor.models.split import split_layouts
from compressor.models.towers import TextTower, text_config, tower_for
from compressor.recipe.schema import Recipe
from compressor.run.loading import load_config
from compressor.strategies.neuron_contract import NeuronSelector
from compressor.strategies.registry import PluginRegistry


@dataclass(frozen=True)
class Plan:
    """Everything a run decides from the recipe and the model's config alone (no weights): the
    sliced layout (`compressor.models.layout`), the strategies and the allocator."""

    layout: SlicedLayout
    pipeline: list[PipelineStep]
    allocator: CurveAllocator | None = None
    selector: NeuronSelector | None = None
    """`mlp`'s neuron selector (None without `mlp`)."""
    warnings: tuple[str, ...] = ()
    """What a run goes on with but its user should know (`budget_warnings`)."""
    splits: tuple[SlicedLayout, ...] = ()
    """`mlp` without `kept`: the splits of the budget the run measures (`models.split`), the
    residual width alone first (`layout`, until the run has chosen)."""
    tower: TextTower | None = None
    """A vision-language checkpoint: the text tower the run prunes (`models.towers`)."""

    @property
    def chooses_split(self) -> bool:
        """The run measures splits and keeps one (a single split, the residual width alone, is no choice)."""
        return len(self.splits) > 1


def check_device_settings(recipe: Recipe, device: torch.device, save_model: bool = True) -> None:
    """What the recipe asks of the device it runs on and of what it keeps, checked by the run and
    its dry run alike (the dry run said "recipe OK" to a float16 distillation on a CPU, which the
    run then refused). `save_model=False`: a sweep that keeps only the bases."""
    if device.type != "cpu" and recipe.sensitivity.recompute is False:
        raise UserError(
            "sensitivity.recompute: false keeps every layer's graph, and so every layer, on the device; "
            "it is for CPU runs: leave it unset (or true) on a GPU"
        )
    if recipe.distillation is not None:
        if not save_model:
            raise UserError(
                "distillation changes the weights, which bases alone cannot rebuild: save the models "
                "(a sweep's save_models: true), or remove distillation"
            )
        if device.type == "cpu" and recipe.distillation.precision == "float16":
            raise UserError(
                "distillation.precision: float16 has no mixed precision on CPU; use bfloat16 or float32 (or auto)"
            )
    if recipe.mlp is not None and not save_model:
        raise UserError(
            "mlp: a run that prunes the MLP saves its model (bases.safetensors cannot rebuild the pruned MLPs); "
            "set save_models: true, or remove mlp"
        )


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


def plan(recipe: Recipe, registry: PluginRegistry) -> Plan:
    """Read the model's config and check family, layout, widths and strategy options; load no weights."""
    config = load_config(recipe.model)
    tower = tower_for(config)
    if tower is not None:
        check_tower(recipe, config, tower)
        config = text_config(config)
    families = {model_type: entry.family for model_type, entry in registry.families().items()}
    family = family_for(config.model_type, families)
    reason = family.refuse(config) if family.refuse is not None else None
    if reason:
        raise UserError(reason)
    check_attention(recipe, config)
    check_positions(recipe, config)
    slicing = recipe.slicing
    options = dict(
        layout=slicing.layout,
        slice_head=slicing.slice_head,
        tie_head=slicing.tie_head,
        shared_bases=slicing.shared_bases,
        round_to=slicing.round_to,
        sparsity=recipe.sparsity,
        target_params=recipe.target_params,
        allocated=recipe.allocation.method == "curves",
        counts=recipe.budget,
    )
    mlp = recipe.mlp
    splits: tuple[SlicedLayout, ...] = ()
    reason = kept_stream(family, slicing.layout, tower)
    if reason is not None:
        layout = mlp_only_layout(
            config,
            family,
            reason,
            pruned_mlp=mlp is not None,
            sparsity=recipe.sparsity,
            target_params=recipe.target_params,
            mlp_kept=mlp.kept if mlp is not None else None,
            mlp_round_to=mlp.round_to if mlp is not None else 1,
            min_kept=mlp.min_kept if mlp is not None else 0.0,
            counts=recipe.budget,
        )
        check_mlp_alone(recipe, layout)
    elif mlp is not None and mlp.kept is None:
        if recipe.allocation.method == "curves":
            raise UserError(
                "mlp without mlp.kept chooses the split of the budget at uniform widths, but allocation.method "
                "curves chooses widths per site; fix mlp.kept, or remove allocation"
            )
        splits = tuple(
            split_layouts(
                config,
                family,
                families.values(),
                min_kept=mlp.min_kept,
                candidates=mlp.candidates,
                mlp_round_to=mlp.round_to,
                **options,
            )
        )
        layout = splits[0]
    else:
        layout = sliced_layout(
            config,
            family,
            families.values(),
            mlp_kept=mlp.kept if mlp is not None else None,
            mlp_round_to=mlp.round_to if mlp is not None else 1,
            **options,
        )
    allocator = curve_allocator(recipe, layout) if recipe.allocation.method == "curves" else None
    pipeline = []
    for step in recipe.pipeline:
        strategy = registry.strategy(step.strategy)
        pipeline.append(PipelineStep(strategy, strategy.parse_options(step.options)))
    computed = required_statistics(pipeline)  # a chain needing what the engine cannot compute stops here
    selector = registry.selector(recipe.mlp.selector) if recipe.mlp is not None else None
    if selector is not None and "H" in selector.requires and not layout.residual:
        raise UserError(
            f"mlp.selector '{selector.name}' needs the output sensitivity H, which a run that keeps the "
            f"residual stream (this stock {config.model_type}) does not estimate; choose another selector"
        )
    if selector is not None and "H" in selector.requires and "H" not in computed:
        raise UserError(
            f"mlp.selector '{selector.name}' needs the output sensitivity H, which only a pipeline with a "
            f"strategy that requires it (e.g. sensitivity) estimates; choose another selector or add one"
        )
    check_evaluation_tasks(recipe)
    if recipe.distillation is not None:
        check_distillation(recipe, layout)
    checked = Plan(layout, pipeline, allocator, selector, splits=splits, tower=tower)
    return dataclasses.replace(checked, warnings=tuple(budget_warnings(recipe, checked)))


def heldout_windows(recipe: Recipe, checked: Plan) -> dict[str, int]:
    """The held-out windows a run reads after its calibration windows, by the section that reads
    them: refinement's guard, and the split choice of `mlp` without `kept`."""
    windows = {}
    if recipe.refinement is not None:
        windows["refinement"] = recipe.refinement.heldout_windows
    if checked.chooses_split and recipe.mlp is not None:
        windows["mlp"] = recipe.mlp.heldout_windows
    return windows


WIDE_LOSS = 0.5
"""Keeping less than this share of the hidden width (or of the parameters) warns: past it,
pruning the residual stream alone costs a large part of the model's quality."""


def budget_warnings(recipe: Recipe, checked: Plan) -> list[str]:
    """A budget that keeps under half the width runs, with a warning that names what it keeps; an
    `mlp` whose budget leaves no split but the residual width alone, with one that says so."""
    warnings = []
    if not checked.layout.residual:
        warnings.append(
            f"slicing.layout: global keeps a {checked.layout.config.model_type} model's residual stream whole "
            f"and prunes its MLPs alone, so the pipeline's strategies "
            f"({' + '.join(step.strategy for step in recipe.pipeline)}), which choose residual bases, do not run"
        )
    if len(checked.splits) == 1 and checked.layout.kept == checked.layout.config.hidden_size:
        warnings.append(
            "mlp: the budget keeps the whole residual width, so there is no split to choose and the MLP keeps "
            "every neuron; to prune the MLP within this budget, fix mlp.kept"
        )
    elif len(checked.splits) == 1:
        warnings.append(
            "mlp: the budget leaves no wider residual stream whose MLPs keep mlp.min_kept of their neurons, "
            "so the run prunes the residual width alone; lower mlp.min_kept to let the MLP give more"
        )
    d = checked.layout.config.hidden_size
    if checked.layout.kept is not None and checked.layout.kept < WIDE_LOSS * d:
        what = f"keeps {checked.layout.kept} of {d} dimensions of the residual stream"
    elif checked.layout.kept is None and checked.layout.budget < WIDE_LOSS * checked.layout.counted.original:
        what = f"keeps {checked.layout.budget / checked.layout.counted.original:.0%} of the parameters"
    else:
        return warnings
    budget = f"sparsity {recipe.sparsity}" if recipe.sparsity is not None else f"target_params {recipe.target_params}"
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
    ):
        return ""
    try:
        tied = sliced_layout(
            layout.config,
            layout.family,
            [layout.family],
            layout=recipe.slicing.layout,
            tie_head=True,
            round_to=recipe.slicing.round_to,
            sparsity=recipe.sparsity,
            target_params=recipe.target_params,
            mlp_kept=layout.mlp_width,
            counts=recipe.budget,
        )
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


def curve_allocator(recipe: Recipe, layout: SlicedLayout) -> CurveAllocator:
    """The `curves` allocator for this recipe: widths on the allocation grid, from `min_kept` of
    the hidden width up to all of it (the last site stays whole unless `slice_head`)."""
    spec = recipe.allocation
    params, budget, hidden_size = layout.counted, layout.budget, layout.config.hidden_size
    step = spec.step or recipe.slicing.round_to
    low = max(step, math.ceil(spec.min_kept * hidden_size / step) * step)
    grid = sorted(set(range(low, hidden_size + 1, step)) | {hidden_size})
    choices = {site: grid for site in params.sites}
    if not (recipe.slicing.slice_head or layout.tie_head):
        choices[params.sites[-1]] = [hidden_size]
    narrowest = params.count({site: min(widths) for site, widths in choices.items()})
    if narrowest > budget:
        raise UserError(
            f"the budget of {budget:,} parameters ({budget / params.original:.1%} of the original) is "
            f"below the narrowest allocation allowed ({narrowest:,}, every site at "
            f"allocation.min_kept={spec.min_kept}); lower allocation.min_kept"
        )
    return CurveAllocator(
        params,
        budget,
        choices,
        list(layout.shared),
        tie_ends=layout.family.head_width_is_embedding_width or layout.tie_head,
    )


def check_distillation(recipe: Recipe, layout: SlicedLayout) -> None:
    """What the distillation section names exists: its LoRA targets among the student's linear
    layers (the student built on the meta device: the original class for a global layout, else the
    sliced one with its transitions), its extra TrainingArguments among transformers' and valid
    there; its device is one the Trainer can be given."""
    from compressor.models.sliced import apply_slicing_layout
    from compressor.training.distill import check_target_modules, check_training_arguments, linear_names, trainer_keys

    spec = recipe.distillation
    assert spec is not None
    trainer_keys(spec)
    check_training_arguments(spec)
    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(layout.config)
    if not layout.one_basis:
        apply_slicing_layout(student, layout.family, layout.slicing_config(student))
    check_target_modules(spec, linear_names(student))
    index = torch.device(recipe.device).index if recipe.device.startswith("cuda:") else None
    if index not in (None, 0) and "LOCAL_RANK" not in os.environ:
        raise UserError(
            f"distillation trains on the device accelerate assigns (the first visible GPU); instead of "
            f"device: {recipe.device}, set device: cuda and CUDA_VISIBLE_DEVICES={index}"
        )


def check_evaluation_tasks(recipe: Recipe) -> None:
    """The recipe's lm-eval task names exist (lm-eval is imported only when there are some)."""
    if recipe.evaluation is not None and recipe.evaluation.lm_eval is not None:
        from compressor.evaluation.harness import check_suites

        check_suites(recipe.evaluation.lm_eval)
