"""`heads`: every attention layer keeps the layout's query heads (`engine.heads.prune_heads`),
chosen on the model as the walk, refinement and the experts stage left it, weighed by H in each
attention's stream coordinates where the walk estimated it; before the MLP stage, so that the
MLPs are fitted to what the pruned attention writes. The model's config, and every later
conversion, says the new head count with an explicit `head_dim`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from compressor.engine.activations import ActivationStore
from compressor.engine.heads import HeadOptions, prune_heads
from compressor.engine.pooling import refuse_without_h
from compressor.errors import UserError
from compressor.models.heads import head_dim, query_heads, set_heads, with_heads
from compressor.recipe.schema import Recipe
from compressor.recipe.sections.heads import HeadsSpec
from compressor.reports.report_model import HeadsReport
from compressor.runtime.staging import SCRATCH_FOLDER
from compressor.stages.base import RunState
from compressor.stages.contract import Stage
from compressor.stages.costs import TimedPhase, Work
from compressor.stages.mlp import Walked, stream_sensitivity

if TYPE_CHECKING:
    from compressor.plan.checks import Plan
    from compressor.plan.memory import Footprint
    from compressor.stages.costs import Phase


class PruneHeads(Stage):
    name = "attention heads"
    timing = "heads_s"
    section = "heads"
    options = HeadsSpec
    changes_model = True

    def runs(self, state: RunState) -> bool:
        return state.checked.layout.heads is not None and not state.adopted  # adopted: the trial's

    def check_plan(self, recipe: Recipe, plan: Plan, world: int) -> None:
        if world > 1:
            raise UserError("heads runs in one process: remove heads from the recipe, or launch one process")
        if plan.tower is not None:
            raise UserError(
                "heads: a vision-language checkpoint is saved whole as its own class, whose text tower keeps "
                "every head here; remove heads"
            )
        refuse_without_h("heads.selector", plan.head_selector, plan.pipeline)

    def check_device(self, recipe: Recipe, device: torch.device, save_model: bool) -> None:
        if not save_model:
            raise UserError(
                "heads: a run that prunes heads saves its model (bases.safetensors cannot rebuild the pruned "
                "attention); set save_models: true, or remove heads"
            )

    def memory(self, footprint: Footprint) -> list[Phase]:
        fp = footprint
        chooses = fp.recipe is not None and fp.recipe.heads is not None and fp.recipe.heads.kept is None
        if fp.layout.heads is None and not chooses:  # `heads: {}`: the plan's first split keeps every head
            return []
        config = fp.layout.config
        n = query_heads(config) * head_dim(config)  # the output projection's input width
        tokens = fp.batch * fp.seq_len
        # one layer, one batch's stream and attention output, C, C + δI and its inverse (n × n float64),
        # the output projection and its refit (d × n float64)
        device = fp.measured["layer"] + 3 * tokens * fp.d * fp.item + 2 * tokens * n * fp.item
        device += 3 * n * n * 8 + 3 * fp.d * n * 8
        return [fp.phase("heads (one layer at a time)", fp.walked + fp.store + fp.positions, device, fp.disk)]

    def seconds(self, work: Work) -> list[TimedPhase]:
        if work.adopts_trial:  # the chosen trial's heads are within the split's time
            return []
        return work.over_candidates(lambda layout: heads_seconds(work, layout, work.tokens))

    def run(self, state: RunState) -> None:
        layout, spec, selector = state.checked.layout, state.recipe.heads, state.checked.head_selector
        assert state.pruned is not None and state.result is not None
        assert layout.heads is not None and spec is not None and selector is not None
        family = layout.family
        sensitivity = stream_sensitivity(family, layout.config, Walked.of(state), state.device, block="attention")
        options = HeadOptions(
            selector,
            state.device,
            refit=spec.refit,
            damping=spec.damping,
            sensitivity=sensitivity,
            progress=state.progress,
            store=ActivationStore(state.device, state.recipe.activations, state.staging / SCRATCH_FOLDER),
            ranks=state.ranks,
        )
        state.heads = prune_heads(state.pruned, family, state.calibration, layout.heads, options)
        state.heads_weighed_by_h = sensitivity is not None
        set_heads(state.pruned.config, layout.heads)
        state.unrefined = None  # it kept every head: beside the pruned model its KL would mix the two steps
        state.config = with_heads(state.config, layout.heads)


def heads_report(state: RunState) -> HeadsReport:
    """The report's `heads`: what the stage kept and how it chose."""
    spec, checked = state.recipe.heads, state.checked
    assert spec is not None and checked.head_selector is not None
    of = query_heads(checked.layout.config)
    holds_split = state.recipe.mlp is None and state.recipe.experts is None
    return HeadsReport(
        kept=checked.layout.heads or of,  # None: the split chosen keeps every head (no layers)
        of=of,
        head_dim=head_dim(checked.layout.config),
        selector=checked.head_selector.name,
        refit=spec.refit,
        damping=spec.damping,
        weighed_by_h=state.heads_weighed_by_h,
        layers=state.heads,
        split=state.split if holds_split else None,
    )


def heads_seconds(work: Work, layout: Any, tokens: int) -> list[TimedPhase]:
    """The heads stage on `tokens` calibration tokens: a pass layer by layer (each output projection's
    input C, the projection refitted) and the selector at every layer."""
    if layout.heads is None:
        return []
    layers = layout.config.num_hidden_layers
    per_token = 1.5 * work.costs.layer_forward + 2 * work.costs.moment_stream  # the projection's input C, refit
    seconds = tokens * layers * per_token + layers * work.costs.heads
    return [TimedPhase("attention heads", seconds, "heads_s")]
