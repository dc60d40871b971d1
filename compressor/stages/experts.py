"""`experts`: every Mixture-of-Experts layer keeps the recipe's count of routed experts
(`engine.experts.prune_experts`), chosen on the model as the walk and refinement left it, an
output-aware selector weighed by H of each block's stream where the walk estimated it; the
model's config, and every later conversion, says the new count. Each layer's fewest routed tokens
per expert go in the report, with a warning where statistics rest on too few; with
`experts.router_refit` each pruned router is refitted (`engine.router_refit`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from compressor.engine.activations import ActivationStore
from compressor.engine.experts import OUTPUT_ELEMENTS, ExpertOptions, ExpertRecord, prune_experts, windows_for
from compressor.errors import UserError
from compressor.models.layout import expert_count, with_experts
from compressor.recipe.schema import Recipe
from compressor.recipe.sections.experts import ExpertsSpec
from compressor.reports.report_model import ExpertsReport
from compressor.runtime.staging import SCRATCH_FOLDER
from compressor.stages.base import RunState
from compressor.stages.contract import Stage
from compressor.stages.costs import TimedPhase, Work
from compressor.stages.mlp import Walked, stream_sensitivity

if TYPE_CHECKING:
    import torch

    from compressor.models.layout import SlicedLayout
    from compressor.plan.checks import Plan
    from compressor.plan.memory import Footprint
    from compressor.stages.costs import Phase


class PruneExperts(Stage):
    name = "experts"
    timing = "experts_s"
    section = "experts"
    options = ExpertsSpec
    changes_model = True

    def runs(self, state: RunState) -> bool:
        return state.checked.layout.experts is not None and not state.adopted  # adopted: the trial's

    def check_plan(self, recipe: Recipe, plan: Plan, world: int) -> None:
        if world > 1:  # the ranks above 0 (`run.follower`) do not follow this stage yet
            raise UserError("experts runs in one process: remove experts from the recipe, or launch one process")

    def check_device(self, recipe: Recipe, device: torch.device, save_model: bool) -> None:
        if not save_model:
            raise UserError(
                "experts: a run that prunes experts saves its model (bases.safetensors cannot rebuild the "
                "removed experts); set save_models: true, or remove experts"
            )

    def memory(self, footprint: Footprint) -> list[Phase]:
        fp = footprint
        if fp.settings.experts_sample is None:
            return []
        experts = expert_count(fp.layout.config, fp.layout.family)
        # one layer, one batch's stream, a chunk of the sample through every expert (its outputs and their
        # G-weighed copy, `OUTPUT_ELEMENTS` float64 each) and the sample's probabilities and Gram (T × E × E)
        device = fp.measured["layer"] + 3 * fp.batch * fp.seq_len * fp.d * fp.item
        if fp.settings.experts_sample:
            device += 2 * OUTPUT_ELEMENTS * 8 + fp.settings.experts_sample * experts * (experts + 1) * 8
        return [fp.phase("experts (one layer at a time)", fp.walked + fp.store + fp.positions, device, fp.disk)]

    def seconds(self, work: Work) -> list[TimedPhase]:
        """A pass layer by layer (each expert's routed tokens, the selector's scores), twice where an
        output-aware sample goes through every expert; the router refit's search is not counted."""
        if work.adopts_trial:
            return []

        def experts(layout: SlicedLayout) -> list[TimedPhase]:
            passes = 2 * work.layer_pass(layers=layout.config.num_hidden_layers)
            return [] if layout.experts is None else [TimedPhase("experts", passes, "experts_s")]

        return work.over_candidates(experts)

    def run(self, state: RunState) -> None:
        spec, layout = state.recipe.experts, state.checked.layout
        selector = state.checked.expert_selector
        assert spec is not None and layout.experts is not None and selector is not None
        assert state.pruned is not None and state.result is not None
        sensitivity = None
        if "outputs" in selector.requires or spec.router_refit:
            sensitivity = stream_sensitivity(state.family, layout.config, Walked.of(state), state.device)
        options = ExpertOptions(
            selector,
            state.device,
            super_ratio=spec.super_ratio if spec.protect_super else None,
            sample_tokens=spec.sample_tokens,
            router_steps=spec.router_steps if spec.router_refit else 0,
            sensitivity=sensitivity,
            progress=state.progress,
            store=ActivationStore(state.device, state.recipe.activations, state.staging / SCRATCH_FOLDER),
            ranks=state.ranks,
        )
        state.experts = prune_experts(state.pruned, state.family, state.calibration, layout.experts, options)
        state.unrefined = None  # it kept every expert: beside the pruned model its KL would mix the two steps
        setattr(state.pruned.config, state.family.experts, layout.experts)
        state.config = with_experts(state.config, state.family, layout.experts)
        windows = sum(len(batch.input_ids) for batch in state.calibration)
        for line in sparse_expert_warnings(state.experts, spec.min_tokens, windows):
            state.warnings.append(line)
            state.warn(line)


def sparse_expert_warnings(records: list[ExpertRecord], min_tokens: int, windows: int) -> list[str]:
    """One line for the layers where some expert saw fewer than `min_tokens` calibration tokens,
    saying how many windows would reach it (at the rate the fewest-seen expert was routed)."""
    thin = [record for record in records if record.fewest_tokens < min_tokens]
    if not thin:
        return []
    worst = min(thin, key=lambda record: record.fewest_tokens)
    if worst.fewest_tokens == 0:
        return [
            f"experts: in {len(thin)} of {len(records)} MoE layers some expert was routed no calibration token "
            f"(layer {worst.layer}), so nothing was measured of it; more or more varied calibration windows "
            f"(calibration.num_samples, now {windows}) may reach it"
        ]
    return [
        f"experts: in {len(thin)} of {len(records)} MoE layers some expert saw fewer than {min_tokens} calibration "
        f"tokens (fewest: {worst.fewest_tokens}, layer {worst.layer}), so its statistics are noisy; about "
        f"{windows_for(min_tokens, worst.fewest_tokens, windows)} calibration windows (calibration.num_samples, "
        f"now {windows}) would give it {min_tokens}"
    ]


def experts_report(state: RunState) -> ExpertsReport:
    """The report's `experts`: what the stage kept and how it chose, per layer."""
    spec, checked = state.recipe.experts, state.checked
    assert spec is not None and checked.expert_selector is not None
    total = expert_count(checked.layout.config, state.family)
    return ExpertsReport(
        kept=checked.layout.experts or total,  # None: the split chosen keeps every expert (no layers)
        of=total,
        selector=checked.expert_selector.name,
        protect_super=spec.protect_super,
        fewest_tokens=min((record.fewest_tokens for record in state.experts), default=0),
        layers=state.experts,
        split=state.split if state.recipe.mlp is None else None,
    )
