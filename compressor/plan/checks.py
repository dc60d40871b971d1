"""Checks before any work: the recipe against the model's config and family (the sliced layout,
the budget, the strategies' options, the distillation settings), loading no weights."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PretrainedConfig

from compressor.engine.allocation import CurveAllocator
from compressor.engine.pooling import PipelineStep, refuse_without_h, required_statistics
from compressor.engine.streaming import cannot_stream
from compressor.errors import UserError
from compressor.models.axes import AXES, Axis
from compressor.models.decilm import decilm_refusal
from compressor.models.families import family_for
from compressor.models.layout import LayoutRequest, SlicedLayout, expert_count, sliced_layout
from compressor.models.mlp_only import kept_stream, mlp_only_layout
from compressor.models.split import depth_counts, expert_counts, head_counts, split_layouts, stream_layout
from compressor.models.towers import TextTower, text_config, tower_for
from compressor.plan.refusals import (
    budget_warnings,
    check_attention,
    check_mlp_alone,
    check_positions,
    check_tower,
    refuse_beside_a_kept_stream,
)
from compressor.recipe.schema import Recipe
from compressor.runtime.loading import load_config
from compressor.stages.contract import Stage
from compressor.stages.exporters import Exporter, model_exporter
from compressor.stages.order import BUILTIN_STAGES, run_order
from compressor.stages.split import fixing_keys, open_sections, resolved_choice
from compressor.strategies.block_contract import BlockSelector
from compressor.strategies.expert_contract import ExpertSelector
from compressor.strategies.head_contract import HeadSelector
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
    expert_selector: ExpertSelector | None = None
    """`experts`' selector (None without `experts`)."""
    stages: tuple[Stage, ...] = BUILTIN_STAGES
    """The run's stages in order, a plugin's among them (`stages.run_order`)."""
    block_selector: BlockSelector | None = None
    """`depth`'s selector (None without `depth`)."""
    head_selector: HeadSelector | None = None
    """`heads`' selector (None without `heads`)."""
    removed_blocks: tuple[int, ...] = ()
    """The decoder blocks the layout is without (`depth`): until the depth stage chooses, the last
    `depth.removed` of them, which the stage's choice replaces (`replan`)."""
    families: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The registered families by model_type, for `replan`."""
    decode_budgets: dict[str, dict[int | None, float]] | None = None
    """`target_decode`: the parameter budget (a fraction of the original's) of each candidate, by its
    group (`group_key`) and its place in the group, found by timing models of their shapes
    (`plan.decode_budget`); None: the recipe's."""
    measure_best: int | None = None
    """`mlp.measure_best` decided (`auto` resolved by `stages.split.resolved_choice`): how many
    splits, those predicted best, are measured; None: every split, unpredicted."""
    screen_windows: int | None = None
    """`mlp.screen_windows` decided likewise: the calibration windows each split is pruned on while
    choosing; None: every window (the chosen trial kept)."""
    exporter: Exporter | None = None
    """What the run saves its model as (`stages.exporters.model_exporter`), chosen with the layout."""
    axes: tuple[Axis, ...] = AXES
    """Every axis a run can prune, a plugin's among them (`PluginRegistry.axes`)."""

    def plugin_axes(self, recipe: Recipe) -> tuple[Axis, ...]:
        """The plugins' axes `recipe` opens: those whose stage's section it has."""
        return tuple(axis for axis in self.axes if axis not in AXES and axis.section in recipe.stages)

    @property
    def chooses_split(self) -> bool:
        """The run measures splits and keeps one (a single split, the residual width alone, is no choice)."""
        return len(self.splits) > 1

    @property
    def may_choose_split(self) -> bool:
        """`chooses_split` now, or once `depth` has chosen its blocks: blocks of different sizes (dense
        and MoE, two kinds of attention) may leave the plan made again more than one split."""
        return self.chooses_split or (bool(self.removed_blocks) and bool(self.splits))

    def replanned(
        self, recipe: Recipe, removed: tuple[int, ...], removed_sets: Sequence[tuple[int, ...]] | None = None
    ) -> Plan:
        """This plan for the model without the blocks `removed` (`replan`): what the depth stage asks of
        the plan it was handed, without importing the module that imports the stages."""
        return replan(recipe, self, removed, removed_sets)


def refuse_disallowed_plugin_axes(recipe: Recipe, checked: Plan) -> None:
    """One line for a plugin axis's section on a model its `allows` refuses (the built-in axes'
    sections refuse what they do not allow themselves)."""
    family, model_type = checked.layout.family, checked.layout.config.model_type
    for axis in checked.plugin_axes(recipe):
        if not axis.allows(family, model_type):
            raise UserError(
                f"{axis.section}: the {family.name} family ({model_type}) does not allow the axis '{axis.key}' "
                f"({axis.name}); remove {axis.section} (`compress families` lists each model type's axes)"
            )


def _pipeline(recipe: Recipe, registry: PluginRegistry) -> list[PipelineStep]:
    """The recipe's strategies with their options; a chain needing what the engine cannot compute stops here."""
    pipeline = []
    for step in recipe.pipeline:
        strategy = registry.strategy(step.strategy)
        pipeline.append(PipelineStep(strategy, strategy.parse_options(step.options)))
    required_statistics(pipeline)
    return pipeline


def _neuron_selector(
    recipe: Recipe, registry: PluginRegistry, layout: SlicedLayout, pipeline: list[PipelineStep]
) -> NeuronSelector | None:
    """`mlp`'s selector, refused where it needs H and the run does not estimate it."""
    selector = registry.selector(recipe.mlp.selector) if recipe.mlp is not None else None
    estimates_h = (
        recipe.slicing.layout == "heterogeneous" and recipe.mlp is not None and recipe.mlp.allocate_by == "fisher"
    )
    if selector is not None and "H" in selector.requires and not layout.residual and not estimates_h:
        raise UserError(
            f"mlp.selector '{selector.name}' needs the output sensitivity H, which a run that keeps the "
            f"residual stream (this {recipe.slicing.layout} {layout.config.model_type}) does not estimate; "
            "choose another selector"
        )
    if layout.residual:
        refuse_without_h("mlp.selector", selector, pipeline)
    return selector


def check_device_settings(
    recipe: Recipe, device: torch.device, save_model: bool = True, stages: tuple[Stage, ...] = BUILTIN_STAGES
) -> None:
    """What the recipe's stages ask of the device it runs on and of what it keeps (`Stage.check_device`),
    checked by the run and its dry run alike (the dry run said "recipe OK" to a float16 distillation
    on a CPU, which the run then refused). `save_model=False`: a sweep that keeps only the bases."""
    for stage in stages:
        if stage.wanted(recipe):
            stage.check_device(recipe, device, save_model)


def launched_processes() -> int:
    """The processes `torchrun` launched this run in (its WORLD_SIZE; 1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def plan(recipe: Recipe, registry: PluginRegistry, decode_budgets: Budgets | None = None) -> Plan:
    """Read the model's config and check family, layout, widths and strategy options; load no weights.
    `decode_budgets`: with `target_decode`, each candidate's parameter budget as the decode search
    found it (`plan.decode_budget`); without them such a plan is its ceiling (`target_params` or
    every parameter), what the search starts from and what a sweep checks."""
    config = load_config(recipe.model)
    tower = tower_for(config)
    if tower is not None:
        check_tower(recipe, config, tower)
        config = text_config(config)
    families = {model_type: entry.item for model_type, entry in registry.families().items()}
    family = family_for(config.model_type, families)
    reason = family.refuse(config) if family.refuse is not None else None
    if reason:
        raise UserError(reason)
    check_attention(recipe, config)
    check_positions(recipe, config)
    if recipe.model.load == "stream" and (reason := cannot_stream(family)) is not None:
        raise UserError(reason)
    removed = planned_blocks(recipe, config)
    layout, splits = _layout(recipe, _Planned(config, family, families, tower), removed, budgets=decode_budgets)
    allocator = curve_allocator(recipe, layout) if recipe.allocation.method == "curves" else None
    pipeline = _pipeline(recipe, registry)
    selector = _neuron_selector(recipe, registry, layout, pipeline)
    stages = run_order(registry.stages())
    expert_selector = registry.expert_selector(recipe.experts.selector) if recipe.experts is not None else None
    block_selector = registry.block_selector(recipe.depth.selector) if recipe.depth is not None else None
    head_selector = registry.head_selector(recipe.heads.selector) if recipe.heads is not None else None
    checked = Plan(
        layout,
        pipeline,
        allocator,
        selector,
        splits=splits,
        tower=tower,
        stages=stages,
        expert_selector=expert_selector,
        block_selector=block_selector,
        head_selector=head_selector,
        removed_blocks=removed,
        families=families,
        axes=registry.axes(),
        decode_budgets=None if decode_budgets is None else {key: dict(value) for key, value in decode_budgets.items()},
        exporter=model_exporter(recipe, layout, tower),
    )
    refuse_disallowed_plugin_axes(recipe, checked)
    checked = resolved_choice(recipe, checked)
    world = launched_processes()
    for stage in stages:  # each stage's own preconditions, against the plan and the launch
        if not stage.wanted(recipe):
            continue
        if world > 1 and stage not in BUILTIN_STAGES:  # the ranks above 0 follow the built-in stages only
            raise UserError(
                f"plugin stage '{stage.name}' runs in one process: remove {stage.section or stage.name} "
                f"from the recipe, or launch one process"
            )
        stage.check_plan(recipe, checked, world)
    return dataclasses.replace(checked, warnings=tuple(budget_warnings(recipe, checked)))


def planned_blocks(recipe: Recipe, config: PretrainedConfig) -> tuple[int, ...]:
    """The blocks the plan counts as removed before the depth stage has chosen: the last
    `depth.removed` (the count is what the budget needs; the stage replans with its choice, which
    for a model whose blocks differ in size may move the widths). Refused when none would stay."""
    if recipe.depth is None or recipe.depth.removed is None:  # open: each candidate's own (`_splits`)
        return ()
    layers = int(config.num_hidden_layers)
    if recipe.depth.removed >= layers:
        raise UserError(
            f"depth.removed {recipe.depth.removed} removes every one of the model's {layers} blocks; "
            f"remove at most {layers - 1}"
        )
    return tuple(range(layers - recipe.depth.removed, layers))


def replan(
    recipe: Recipe, checked: Plan, removed: tuple[int, ...], removed_sets: Sequence[tuple[int, ...]] | None = None
) -> Plan:
    """`checked` for the model without the blocks `removed` (the depth stage's choice): the same
    recipe's layout, splits and allocator on that model's config, the budget still the original's.
    `removed_sets`: `depth` without `removed`, the blocks each candidate count removes (the stage's
    choice for each; the first none), each with its splits."""
    layout, splits = _relayout(recipe, checked, removed, removed_sets, checked.decode_budgets)
    allocator = curve_allocator(recipe, layout) if recipe.allocation.method == "curves" else None
    replanned = dataclasses.replace(checked, layout=layout, splits=splits, allocator=allocator, removed_blocks=removed)
    return resolved_choice(recipe, replanned)  # the splits may be others now


def plan_config(recipe: Recipe, checked: Plan) -> PretrainedConfig:
    """The config `checked` was made on: the model's, or its text tower's."""
    config = load_config(recipe.model)
    return config if checked.tower is None else text_config(config)


def _relayout(
    recipe: Recipe,
    checked: Plan,
    removed: tuple[int, ...],
    removed_sets: Sequence[tuple[int, ...]] | None = None,
    budgets: Budgets | None = None,
    only: str | None = None,
) -> tuple[SlicedLayout, tuple[SlicedLayout, ...]]:
    """`_layout` for the model `checked` was made on."""
    planned = _Planned(plan_config(recipe, checked), checked.layout.family, checked.families, checked.tower)
    return _layout(recipe, planned, removed, removed_sets, budgets=budgets, only=only)


@dataclass(frozen=True)
class _Planned:
    """The model a plan is made on, as its layout reads it: its config (a tower's text config),
    its family among the registry's, and its text tower where it has one."""

    config: PretrainedConfig
    family: Any
    families: dict[str, Any]
    tower: TextTower | None


def _layout(
    recipe: Recipe,
    planned: _Planned,
    removed: tuple[int, ...] = (),
    removed_sets: Sequence[tuple[int, ...]] | None = None,
    budgets: Budgets | None = None,
    only: str | None = None,
) -> tuple[SlicedLayout, tuple[SlicedLayout, ...]]:
    """The run's layout from the recipe and the config, and the splits of the budget it measures
    (`mlp` without `kept`; else none): the MLP alone where the family keeps its stream whole;
    without the decoder blocks `removed` (`depth`), or, with `depth` open, each candidate without
    its own of `removed_sets` (before the depth stage has chosen: the last blocks of each count).
    `budgets`: `target_decode`'s parameter budget of each candidate, by group (`group_key`) and place
    in it; `only`: that group's candidates alone (the decode search's probes)."""
    slicing, config, family = recipe.slicing, planned.config, planned.family
    request = layout_request(recipe, removed)
    mlp = recipe.mlp
    splits: tuple[SlicedLayout, ...] = ()
    reason = kept_stream(family, slicing.layout, planned.tower)
    if reason is not None:
        refuse_beside_a_kept_stream(recipe, config, reason)
    if recipe.target_active_params is not None and recipe.allocation.method == "curves":
        raise UserError(
            "target_active_params: allocation.method curves allocates widths under target_params alone; "
            "give target_params, or remove allocation"
        )
    if slicing.layout == "heterogeneous":
        refusal = decilm_refusal(config)
        if refusal is not None:
            raise UserError(f"slicing.layout: heterogeneous saves DeciLM: {refusal}; use slicing.layout: global")
    if reason is not None:
        target = _only_target(group_targets(recipe, budgets, group_key((), None, None)))
        layout = mlp_only_layout(
            config,
            family,
            reason,
            replace(request, target_params=target),
            pruned_mlp=mlp is not None,
            min_kept=mlp.min_kept if mlp is not None else 0.0,
        )
        check_mlp_alone(recipe, layout)
    elif open_sections(recipe):
        if removed_sets is None:
            removed_sets = planned_block_sets(recipe, config) or (removed,)
        splits = _splits(recipe, planned, request, removed_sets, budgets, only)
        layout = splits[0]
    else:
        target = _only_target(group_targets(recipe, budgets, group_key(removed, request.experts, request.heads)))
        layout = sliced_layout(config, family, planned.families.values(), replace(request, target_params=target))
    return layout, splits


def layout_request(recipe: Recipe, removed: tuple[int, ...] = ()) -> LayoutRequest:
    """What the recipe asks of the layout (`models.layout.LayoutRequest`), without the decoder
    blocks `removed`."""
    slicing, mlp = recipe.slicing, recipe.mlp
    return LayoutRequest(
        layout=slicing.layout,
        slice_head=slicing.slice_head,
        tie_head=slicing.tie_head,
        shared_bases=slicing.shared_bases,
        round_to=slicing.round_to,
        sparsity=recipe.sparsity,
        target_params=recipe.target_params,
        target_active_params=recipe.target_active_params,
        allocated=recipe.allocation.method == "curves",
        mlp_kept=mlp.kept if mlp is not None else None,
        mlp_round_to=mlp.round_to if mlp is not None else 1,
        shared_kept=mlp.shared_kept if mlp is not None else None,
        experts=recipe.experts.kept if recipe.experts is not None else None,
        counts=recipe.budget,
        removed_blocks=removed,
        heads=recipe.heads.kept if recipe.heads is not None else None,
    )


def group_key(blocks: Sequence[int], experts: int | None, heads: float | None) -> str:
    """One combination of the counts a candidate fixes (decoder blocks removed, routed experts,
    query heads), named: the candidates that share it differ only in how they split one parameter
    budget between the residual width and the MLP's, so a `target_decode` budget is found per group."""
    parts = [f"{len(blocks)} blocks removed" if blocks else "every block"]
    if experts is not None:
        parts.append(f"{experts} experts")
    if heads is not None:
        parts.append(f"heads {heads:g}")
    return ", ".join(parts)


Budgets = Mapping[str, Mapping[int | None, float]]
"""`target_decode`'s budgets: each candidate's `target_params`, by group (`group_key`) and its place
among the group's splits at that budget (a place or a group the target leaves no width is absent;
None: every split at that budget, the search's probe)."""


def group_targets(recipe: Recipe, budgets: Budgets | None, key: str) -> dict[int | None, float | None]:
    """The `target_params` a candidate group is planned at, by place: the recipe's for the whole group
    (None: every split); with `target_decode` each candidate's decode budget, or before the search has
    found them the ceiling it starts from."""
    if recipe.target_decode is None:
        return {None: recipe.target_params}
    if budgets is None:
        return {None: recipe.target_params or 1.0}
    return dict(budgets.get(key, {}))


def _only_target(targets: dict[int | None, float | None]) -> float | None:
    """The one target of a group that has one candidate."""
    assert len(targets) == 1, "a group without splits has one candidate"
    return next(iter(targets.values()))


def candidate_places(recipe: Recipe) -> int:
    """How many candidates a group may hold: the MLP's splits (`mlp.candidates`), or one."""
    return recipe.mlp.candidates if recipe.mlp is not None and recipe.mlp.kept is None else 1


def candidate_groups(recipe: Recipe, checked: Plan) -> list[str]:
    """The candidate groups (`group_key`) of a plan: each combination of removed-block count, expert
    count and head count the run may measure (one where none is open)."""
    config = plan_config(recipe, checked)
    family = checked.layout.family
    if kept_stream(family, recipe.slicing.layout, checked.tower) is not None:
        return [group_key((), None, None)]
    if not open_sections(recipe):
        experts = recipe.experts.kept if recipe.experts is not None else None
        heads = recipe.heads.kept if recipe.heads is not None else None
        return [group_key(checked.removed_blocks, experts, heads)]
    removed_sets = planned_block_sets(recipe, config) or (checked.removed_blocks,)
    keys = [group_key(*combination) for combination in _combinations(recipe, config, family, removed_sets)]
    return list(dict.fromkeys(keys))


def group_layouts(recipe: Recipe, checked: Plan, key: str, target_params: float) -> list[SlicedLayout]:
    """The candidates of group `key` all at `target_params` (the decode search's probe); refused in
    one line where the budget leaves them no width."""
    layout, splits = _relayout(recipe, checked, checked.removed_blocks, budgets={key: {None: target_params}}, only=key)
    return list(splits) or [layout]


def planned_block_sets(recipe: Recipe, config: PretrainedConfig) -> tuple[tuple[int, ...], ...]:
    """The blocks each candidate removes before the depth stage has chosen them, with `depth` open:
    the last blocks of each count `models.split.depth_counts` spaces (none first); else none."""
    spec = recipe.depth
    if spec is None or spec.removed is not None:
        return ()
    layers = int(config.num_hidden_layers)
    return tuple(
        tuple(range(layers - count, layers)) for count in depth_counts(layers, spec.max_removed, spec.candidates)
    )


def _splits(
    recipe: Recipe,
    planned: _Planned,
    request: LayoutRequest,
    removed_sets: Sequence[tuple[int, ...]],
    budgets: Budgets | None = None,
    only: str | None = None,
) -> tuple[SlicedLayout, ...]:
    """The candidates the run measures when `mlp`, `experts`, `heads` or `depth` leaves its count
    open: for each set of removed blocks (`removed_sets`: the one the plan has, or with `depth` open
    each candidate count's), each expert count (`experts.kept`, or the counts
    `models.split.expert_counts` spaces) and each head count (`heads.kept`, or
    `models.split.head_counts`), the MLP's splits of the budget (`mlp` without `kept`) or the one
    layout its fixed width leaves; every block, expert and head kept first (None), so the first
    candidate prunes the residual width alone (or with the fixed MLP). `budgets` and `only`: as `_layout`'s."""
    if recipe.allocation.method == "curves":
        keys = fixing_keys(recipe)
        raise UserError(
            f"without {keys} the run chooses the split of the budget at uniform widths, but allocation.method "
            f"curves chooses widths per site; fix {keys}, or remove allocation"
        )
    splits: list[SlicedLayout] = []
    refusal: UserError | None = None
    combinations = _combinations(recipe, planned.config, planned.family, removed_sets, request.heads)
    for blocks, count, head_count in combinations:
        key = group_key(blocks, count, head_count)
        if only is not None and key != only:
            continue
        targets = group_targets(recipe, budgets, key)
        for place, target in targets.items():  # one target for the group, or (target_decode) one each
            fixed = replace(request, experts=count, heads=head_count, removed_blocks=blocks, target_params=target)
            try:
                layouts = _candidate_layouts(recipe, planned, fixed)
            except UserError as error:  # this count cannot meet the budget at any width: the others may
                refusal = error  # the last, the fewest experts: the most reachable, what a refusal names
                continue
            splits += layouts if place is None else layouts[place : place + 1]
    if not splits:
        assert refusal is not None
        raise refusal
    return tuple(splits)


def _candidate_layouts(recipe: Recipe, planned: _Planned, request: LayoutRequest) -> list[SlicedLayout]:
    """The layouts one combination of counts offers: the MLP's splits of the budget (`mlp` without
    `kept`), the one split at `slicing.kept`, or the one layout a fixed MLP width leaves."""
    mlp, config, family, families = recipe.mlp, planned.config, planned.family, planned.families.values()
    if mlp is not None and mlp.kept is None and recipe.slicing.kept is not None:
        return [stream_layout(config, family, families, recipe.slicing.kept, request)]
    if mlp is not None and mlp.kept is None:
        return split_layouts(config, family, families, request, min_kept=mlp.min_kept, candidates=mlp.candidates)
    return [sliced_layout(config, family, families, request)]


def _combinations(
    recipe: Recipe,
    config: PretrainedConfig,
    family: Any,
    removed_sets: Sequence[tuple[int, ...]],
    fixed_heads: float | None = None,
) -> list[tuple[tuple[int, ...], int | None, float | None]]:
    """Each (removed blocks, expert count, head count) the candidates of an open choice combine,
    every expert and head kept first (None)."""
    experts = recipe.experts
    counts: list[int | None] = [None]
    if (
        experts is not None
        and experts.kept is None
        and recipe.target_params is None
        and recipe.sparsity is None
        and recipe.target_decode is None
    ):
        raise UserError(
            "experts: with target_active_params alone the run has no expert count to choose: removing experts "
            "frees memory but none of a token's parameters except router rows, and only those are counted; "
            "fix experts.kept, or add target_params"
        )
    if experts is not None and experts.kept is not None:
        counts = [experts.kept]
    elif experts is not None:
        total = expert_count(config, family)
        top_k = int(getattr(config, family.experts_per_token, None) or total)
        counts = [
            None if count == total else count
            for count in expert_counts(total, top_k, experts.min_kept, experts.candidates)
        ]
    heads: list[float | None] = [recipe.heads.kept if recipe.heads is not None else fixed_heads]
    if recipe.heads is not None and recipe.heads.kept is None:
        spec = recipe.heads
        heads = [*head_counts(config, family, spec.min_kept, spec.candidates)]
    return list(itertools.product(removed_sets, counts, heads))


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
