"""The report: report.json, report.md, the recipe as run, and the plots (distillation's curve,
the split choice's candidates)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import yaml

import compressor
from compressor.engine.fisher import autocast_dtype
from compressor.evaluation.metrics import parameter_count
from compressor.evaluation.plots import SplitCounts, distillation_figure, split_figure
from compressor.evaluation.throughput import model_size
from compressor.recipe.schema import Recipe
from compressor.reports.report import write_markdown
from compressor.reports.report_model import (
    Allocation,
    DepthReport,
    Environment,
    Loading,
    Metrics,
    ModelInfo,
    ModelSize,
    Parallel,
    Params,
    Resume,
    RunReport,
    Site,
    Sizes,
    SplitRecord,
    Step,
)
from compressor.stages.base import RunState
from compressor.stages.contract import Stage
from compressor.stages.costs import TimedPhase, Work
from compressor.stages.experts import experts_report
from compressor.stages.heads import heads_report
from compressor.stages.mlp import mlp_report


class WriteReport(Stage):
    name = "report"

    def seconds(self, work: Work) -> list[TimedPhase]:
        return []  # reading, loading and writing files: not estimated, small beside the passes

    def run(self, state: RunState) -> None:
        state.timings["total_s"] = time.perf_counter() - state.started
        state.report = write_report(state)


def write_report(state: RunState) -> RunReport:
    """report.json, report.md, the recipe as run, and the distillation curve's plot."""
    report, recipe, staging = assembled_report(state), state.recipe, state.staging
    report.write(staging / "report.json")
    (staging / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    write_markdown(report, staging / "report.md")
    if state.distillation is not None:
        distillation_figure({"held-out KL": state.distillation.curve}).savefig(
            staging / "distillation.png", dpi=120, bbox_inches="tight"
        )
    if state.split is not None:
        write_split_figure(state.split, report, staging / "split.png")
    return report


def _model_info(state: RunState) -> ModelInfo:
    """The original model as the report names it (its layers before any block was removed)."""
    config = state.config
    return ModelInfo(
        path=state.recipe.model.path,
        model_type=config.model_type,
        family=state.family.name,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers + len(state.removed_blocks),  # the original's
        dtype=state.recipe.model.dtype,
    )


def assembled_report(state: RunState) -> RunReport:
    """The run's `report.json`, assembled from what the stages handed on."""
    recipe, checked, result = state.recipe, state.checked, state.result
    layout = checked.layout
    pruned_params = parameter_count(state.pruned)
    fisher_source = state.split_fisher_source or result.fisher_source
    return RunReport(
        compressor=compressor.__version__,
        model=_model_info(state),
        sparsity=recipe.sparsity,
        target_params=recipe.target_params,
        target_active_params=recipe.target_active_params,
        **({} if state.decode is None else {"decode": state.decode}),
        kept_width=layout.kept,
        layout=recipe.slicing.layout,
        stock=state.stock
        if state.stock is None or state.stock["head"] != "tied"
        else {**state.stock, "tied_fit": state.head_fit},
        rounding=layout.rounding,
        allocation=_allocation(state),
        seed=recipe.seed,
        parallel=Parallel(world_size=state.ranks.world, tokens_by_rank=result.tokens_by_rank),
        pipeline=[Step(strategy=s.strategy, options=s.options) for s in recipe.pipeline],
        slicing=recipe.slicing,
        fingerprint=state.fingerprint,
        resumed_from=result.resumed_from,
        resume=Resume(sites_loaded=result.loaded_sites, fisher_loaded=fisher_source == "checkpoint"),
        loading=Loading(
            load=recipe.model.load, written_as_it_goes=state.writes, layers_written_before=result.written_before
        ),
        fisher_source=fisher_source,
        fisher_autocast=_autocast_name(recipe, state.device) if result.fisher_source is not None else None,
        refinement=state.refinement,
        guards=list(state.guards),
        distillation=state.distillation,
        stages=state.extra,
        **({} if recipe.mlp is None else {"mlp": mlp_report(state)}),
        **({} if recipe.heads is None else {"heads": heads_report(state)}),
        **({} if recipe.experts is None else {"experts": experts_report(state)}),
        **({} if state.depth is None else {"depth": depth_report(state)}),
        metrics=Metrics.model_validate(state.metrics),
        params=Params(
            baseline=state.baseline_params, pruned=pruned_params, ratio=pruned_params / state.baseline_params
        ),
        active_params=_active_params(state),
        size=Sizes(baseline=ModelSize(**state.baseline_size), pruned=ModelSize(**model_size(state.pruned))),
        speed=state.speed,
        warnings=list(checked.warnings) + state.warnings,
        sites=[Site.model_validate(site.to_json()) for site in result.sites],
        timings=state.timings,
        estimate=state.estimate,
        environment=Environment.here(state.device),
    )


def depth_report(state: RunState) -> DepthReport:
    """The report's `depth`: the stage's record, with the split choice's where no other section holds it
    (`depth` the only count left open)."""
    assert state.depth is not None
    recipe = state.recipe
    holds_split = recipe.mlp is None and recipe.experts is None and recipe.heads is None
    return state.depth.model_copy(update={"split": state.split}) if holds_split else state.depth


def write_split_figure(split: SplitRecord, report: RunReport, path: Path) -> None:
    """`split.png`: the measured candidates' held-out KL (`mlp.measure_best` leaves some out)."""
    candidates = split.candidates
    measured = [i for i, c in enumerate(candidates) if c.heldout_kl is not None]
    points = [(c.width, c.mlp_kept, c.params, c.heldout_kl or 0.0) for c in (candidates[i] for i in measured)]
    counts = [candidates[i].experts for i in measured]
    heads = [candidates[i].heads for i in measured]
    of = report.mlp.of if report.mlp is not None else candidates[0].mlp_kept  # no mlp: all kept
    chosen, model = measured.index(split.chosen), Path(report.model.path).name
    by_heads = heads if any(count is not None for count in (c.heads for c in candidates)) else None
    blocks = [len(candidates[i].removed_blocks or []) for i in measured]
    by_blocks = blocks if len({len(c.removed_blocks or []) for c in candidates}) > 1 else None
    by_counts = SplitCounts(counts if report.experts else None, by_heads, by_blocks)
    split_figure(points, chosen, of, model, by_counts).savefig(path, dpi=120, bbox_inches="tight")


def _active_params(state: RunState) -> Params | None:
    """Parameters per token, the original's and the pruned model's (a model with routed experts)."""
    layout, result = state.checked.layout, state.result
    assert result is not None
    if layout.active is None:
        return None
    pruned = layout.active.count(result.widths)
    return Params(baseline=layout.active.original, pruned=pruned, ratio=pruned / layout.active.original)


def _allocation(state: RunState) -> Allocation:
    """The report's allocation: the budget, the widths' predicted count, and the allocator's record."""
    recipe, layout, result = state.recipe, state.checked.layout, state.result
    assert result is not None
    return Allocation.model_validate(
        {
            "method": recipe.allocation.method,
            "budget": layout.budget,
            "predicted_params": layout.counted.count(result.widths),
            "transition_params": layout.params.transition_params(result.widths),
            "shared_sites": list(layout.shared),
            # the allocator's record: its method ("curves"), solver, predicted KL and curves
            **{k: v for k, v in (result.allocation or {}).items() if k not in ("widths", "budget", "params")},
        }
    )


def _autocast_name(recipe: Recipe, device: torch.device) -> str:
    """The autocast H's passes ran under on this device (`sensitivity.autocast`, `auto` resolved; off:
    the model's own dtype)."""
    lowered = autocast_dtype(recipe.sensitivity.autocast, device)
    return "off" if lowered is None else str(lowered).removeprefix("torch.")
