"""`mlp`: every MLP keeps the layout's neurons (`engine.neurons.prune_mlp`), chosen on the model
as the walk and refinement left it, weighed by H in each MLP's stream coordinates where the walk
estimated it; the model's config, and every later conversion, says the new width."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedModel

from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore
from compressor.engine.calibration import capture_layer_inputs
from compressor.engine.checkpoint import Checkpoint
from compressor.engine.fisher import estimate_fisher
from compressor.engine.layerwise import decoder_layers
from compressor.engine.mlp_reconstruct import CHECK_EVERY, CHUNK_ROWS, ReconstructSettings
from compressor.engine.mlp_widths import Allocation, WidthCurve, allocate
from compressor.engine.neurons import CurveOptions, MlpOptions, NeuronRecord, mlp_linears, mlp_width_curves, prune_mlp
from compressor.engine.parallel import Ranks
from compressor.engine.transforms import fuse_norms
from compressor.engine.walk_options import PruneResult
from compressor.engine.width_search import SearchSettings, assembled, evolve
from compressor.errors import UserError
from compressor.evaluation.metrics import kl_to_references, model_log_probs
from compressor.models.decilm import FFN_STEP
from compressor.models.families import ModelFamily
from compressor.models.heads import head_dim, kv_heads, remove_attention
from compressor.models.kv_heads import (
    kv_head_parameters,
    kv_options,
    layer_kv_heads,
    merge_kv_heads,
    set_output,
)
from compressor.models.layout import expert_count, mlp_neurons, set_mlp_widths, shared_expert_neurons
from compressor.models.sites import layer_site_ids
from compressor.models.sliced import layer_attention
from compressor.recipe.schema import Recipe
from compressor.recipe.sections.mlp import MlpSpec, ReconstructSpec
from compressor.reports.report_model import MlpReport, WidthSearchRecord
from compressor.runtime.staging import SCRATCH_FOLDER
from compressor.stages.base import Progress, RunState, on_device
from compressor.stages.contract import Stage
from compressor.stages.costs import TimedPhase, Work

if TYPE_CHECKING:
    from compressor.plan.checks import Plan
    from compressor.plan.memory import Footprint
    from compressor.stages.costs import Phase


class PruneMlp(Stage):
    name = "MLP neurons"
    timing = "mlp_s"
    section = "mlp"
    options = MlpSpec
    changes_model = True

    def runs(self, state: RunState) -> bool:
        return state.checked.layout.prunes_mlp and not state.adopted  # adopted: the trial's

    def check_plan(self, recipe: Recipe, plan: Plan, world: int) -> None:
        if recipe.mlp is not None and recipe.mlp.merge_kv_heads and not kv_options(plan.layout.config):
            raise UserError(
                "mlp.merge_kv_heads: this model's attentions hold one key-value head each, so there is none to "
                "merge; remove mlp.merge_kv_heads"
            )
        family = plan.layout.family
        if (
            recipe.mlp is not None
            and recipe.mlp.reconstruct is not None
            and (family.experts is not None or family.build_mlp is not None)
        ):
            what = "routed experts" if family.experts is not None else "linears of the decoder layer, not one module"
            raise UserError(
                f"mlp.reconstruct trains each dense MLP module, and {family.name}'s MLPs are {what}; "
                "remove mlp.reconstruct"
            )
        if recipe.slicing.layout == "heterogeneous" and world > 1:
            raise UserError(
                "slicing.layout: heterogeneous allocates the MLP widths in one process; launch one process, "
                "or set slicing.layout: global"
            )

    def heldout_windows(self, recipe: Recipe, plan: Plan) -> int:
        """`mlp.search`: the windows each allocation of the heterogeneous layout is measured on."""
        spec = recipe.mlp
        if spec is None or spec.search is None or recipe.slicing.layout != "heterogeneous":
            return 0
        return spec.heldout_windows

    def check_device(self, recipe: Recipe, device: torch.device, save_model: bool) -> None:
        if not save_model:
            raise UserError(
                "mlp: a run that prunes the MLP saves its model (bases.safetensors cannot rebuild the pruned MLPs); "
                "set save_models: true, or remove mlp"
            )

    def memory(self, footprint: Footprint) -> list[Phase]:
        settings, fp = footprint.settings, footprint
        if settings.mlp_feedback is None or not fp.f:
            return []
        family = fp.layout.family
        feedback = settings.mlp_feedback > 0 and family.mlp_post_norm is None and family.experts is None
        copies = 2 if feedback else 1  # the reference stream, where feedback applies (`prune_mlp`)
        # one layer, one batch's stream and MLP activation, and at the peak three f×f float64 matrices
        # (C, C + δI and its inverse while obs inverts it), the down projection and its refit (d×f float64)
        tokens = fp.batch * fp.seq_len
        device = fp.measured["layer"] + 3 * tokens * fp.d * fp.item + 2 * tokens * fp.f * fp.item
        device += 3 * fp.f * fp.f * 8 + 3 * fp.d * fp.f * 8
        if fp.layout.family.experts is not None:  # and every kept routed expert's C (f × f float64) at once
            device += (fp.layout.experts or expert_count(fp.layout.config, fp.layout.family)) * fp.f * fp.f * 8
        if fp.layout.shared_width is not None:  # the shared expert's C, its inverse and one batch's activations
            shared = shared_expert_neurons(fp.layout.config, family)
            device += 3 * shared * shared * 8 + 2 * fp.d * shared * 8 + tokens * shared * (3 * fp.item + 16)
        recipe = fp.recipe
        refits = 0  # `mlp.merge_kv_heads`: every layer's refitted output projection per count, until the allocation
        if recipe is not None and recipe.mlp is not None and recipe.mlp.merge_kv_heads:
            config = fp.layout.config
            device += kv_merge_bytes(config, tokens, fp.item)
            refits = (
                fp.layers * len(kv_options(config)) * fp.d * config.num_attention_heads * head_dim(config) * fp.item
            )
        pairs = 0  # `mlp.reconstruct`: every token's MLP input and target (float32, host), twice while they
        # are joined, and the held-out share's copy; on the device the float32 weights 7 times (themselves,
        # gradient, Adam's two moments, the best kept and the one replacing it, a step's temporaries), L,
        # and a step's batch (or a held-out chunk) through the MLP with its gradients
        rebuild = recipe.mlp.reconstruct if recipe is not None and recipe.mlp is not None else None
        if rebuild is not None:
            pairs = settings.samples * fp.seq_len * 2 * fp.d * 4 * 9 // 4
            rows, kept = max(rebuild.batch_tokens, CHUNK_ROWS), fp.layout.mlp_width or fp.f
            device += 7 * mlp_weights(family, fp.d, kept) * 4 + 4 * fp.d * fp.d
            device += 2 * rows * (2 * fp.d + 3 * kept) * 4
        phases = []
        if recipe is not None and recipe.slicing.layout == "heterogeneous" and settings.mlp_feedback is not None:
            assert recipe.mlp is not None
            if recipe.mlp.allocate_by == "fisher":  # `stream_fishers`: H on a fused copy of the model
                totals = (2 * fp.layers + 1) * fp.d * fp.d * fp.h_item
                host = 2 * fp.weights + fp.store + fp.positions + fp.stored + totals
                phases.append(fp.phase("H pass on a fused copy (MLP widths)", host, fp.measured["fisher"], fp.disk))
            if recipe.mlp.search is not None:
                phases.append(search_phase(fp, recipe.mlp))
        return phases + [
            fp.phase(
                "mlp (one layer at a time)",
                fp.walked + copies * fp.store + fp.positions + refits + pairs,
                device,
                f"{fp.disk}, or mlp.feedback: 0 (one copy of the stream)"
                + (", or no mlp.reconstruct (its tokens' pairs)" if pairs else ""),
            )
        ]

    def seconds(self, work: Work) -> list[TimedPhase]:
        if work.adopts_trial:  # the chosen trial's MLP stage is within the split's time
            return []
        return work.over_candidates(lambda layout: mlp_seconds(work, layout, work.tokens))

    def run(self, state: RunState) -> None:
        layout = state.checked.layout
        assert state.pruned is not None and state.result is not None and layout.prunes_mlp
        given = None
        if state.recipe.slicing.layout == "heterogeneous":
            given = allocate_layers(state)
        walked, scratch = Walked.of(state), state.staging / SCRATCH_FOLDER
        settings = MlpStageSettings(state.device, state.progress, scratch, state.ranks, state.mlp_widths, given)
        state.neurons, state.mlp_weighed_by_h = prune_mlps(
            state.recipe, state.checked, state.pruned, state.calibration, walked, settings
        )
        state.unrefined = None  # it kept every neuron: beside the pruned model its KL would mix the two steps
        state.config = layout.mlp_config(state.config)


def search_phase(fp: Footprint, spec: MlpSpec) -> Phase:
    """`mlp.search`: every layer's solution at each width of the grid below its own (kept neurons
    and a d × m down projection in the model's dtype) and the original's float32 log-probabilities
    of every window on the host; the model whole on the device with a batch's outputs, as the depth
    stage's measured removals count them, and a candidate's cut MLP weights beside the originals."""
    step = math.lcm(FFN_STEP, spec.round_to)
    below = sum(range(step, fp.f, step))
    solutions = fp.layers * below * (fp.d * fp.item + 8)
    references = spec.heldout_windows * fp.seq_len * fp.vocab * 4
    outputs = 5 * fp.batch * fp.seq_len * fp.vocab * 4
    cut = fp.layers * 3 * fp.d * fp.f * fp.item  # a candidate's cut MLP weights beside the originals, at most
    return fp.phase(
        "mlp.search: measured allocations (the model whole on the device)",
        fp.weights + fp.store + solutions + references,
        fp.weights + cut + outputs,
        "fewer mlp.heldout_windows, or no mlp.search",
        whole_model=True,
    )


def kv_merge_bytes(config: Any, tokens: int, item: int) -> int:
    """`mlp.merge_kv_heads` in the width curves' pass: a merged copy of the attention per KV-head
    count, its two A × A float64 moments and the shared one (A = heads × head_dim), and one batch's
    z and z' rows in float64."""
    counts, width, d = kv_options(config), config.num_attention_heads * head_dim(config), config.hidden_size
    copy_bytes = (2 * d * width + 2 * d * kv_heads(config) * head_dim(config)) * item
    return len(counts) * (copy_bytes + 2 * width * width * 8 + 2 * tokens * width * 8) + width * width * 8


def mlp_weights(family: ModelFamily, d: int, width: int) -> int:
    """The weights of one MLP `width` neurons wide, counted as one d × width matrix per linear of
    the family's (a fused gate_up counted once: an estimate's unit, not a parameter count)."""
    return len((*family.mlp_inputs, family.mlp_output)) * d * width


def mlp_seconds(work: Work, layout: Any, tokens: int) -> list[TimedPhase]:
    """The MLP stage on `tokens` calibration tokens: a pass layer by layer (the pruned stream and, with
    `mlp.feedback`, the unpruned one; each MLP's input C and the refit's moments) and the selector at
    every layer; the heterogeneous layout's H on a fused copy and its width curves, a pass more
    (and with `mlp.merge_kv_heads` a merged attention per KV-head count, counted as a layer's forward);
    `mlp.reconstruct`'s steps and held-out checks."""
    if not layout.prunes_mlp:
        return []
    costs, layers = work.costs, layout.config.num_hidden_layers
    streams = 2 if work.recipe.mlp is not None and work.recipe.mlp.feedback else 1
    per_token = streams * costs.layer_forward + 2 * costs.moment_mlp
    seconds = tokens * layers * per_token + layers * costs.neurons
    rebuild = work.recipe.mlp.reconstruct if work.recipe.mlp is not None else None
    if rebuild is not None:  # each step a forward and backward of the pruned MLP: its share of the timed layer
        config, family, d = layout.config, layout.family, layout.config.hidden_size
        attention = 2 * d * head_dim(config) * (config.num_attention_heads + kv_heads(config))
        timed = mlp_weights(family, d, mlp_neurons(config, family)) + attention  # the original's layer (`UnitCosts`)
        share = mlp_weights(family, layout.kept or d, layout.mlp_width or 1) / timed
        checks = (rebuild.steps // CHECK_EVERY + 2) * tokens * float(rebuild.heldout) * costs.layer_forward
        steps = rebuild.steps * rebuild.batch_tokens * (costs.layer_forward + costs.layer_backward)
        seconds += layers * share * (steps + checks)
    if work.recipe.slicing.layout == "heterogeneous":
        seconds += tokens * (layers * (costs.layer_backward + costs.layer_forward) + costs.head_backward)
        if work.recipe.mlp is not None and work.recipe.mlp.merge_kv_heads:
            seconds += tokens * layers * len(kv_options(layout.config)) * costs.layer_forward
        if work.recipe.mlp is not None and work.recipe.mlp.search is not None:  # the original's pass, then each
            seconds += work.heldout.get(PruneMlp.name, 0) * (work.recipe.mlp.search + 1) * costs.model_forward(layers)
    return [TimedPhase("MLP neurons", seconds, "mlp_s")]


def mlp_report(state: RunState) -> MlpReport:
    """The report's `mlp`: what the stage kept, how it chose, and the split choice's record."""
    spec, checked = state.recipe.mlp, state.checked
    assert spec is not None and checked.selector is not None
    width, shared = mlp_neurons(checked.layout.config, state.family), checked.layout.shared_width
    return MlpReport(
        kept=checked.layout.mlp_width or width,
        of=width,
        **(
            {}
            if shared is None
            else {"shared_kept": shared, "shared_of": shared_expert_neurons(checked.layout.config, state.family)}
        ),
        selector=checked.selector.name,
        refit=spec.refit,
        damping=spec.damping,
        feedback=state.neurons[0].feedback if state.neurons else spec.feedback,
        weighed_by_h=state.mlp_weighed_by_h,
        layers=state.neurons,
        **({} if state.split is None else {"split": state.split}),
        **(
            {}
            if state.mlp_widths is None
            else {"widths": state.mlp_widths, "width_errors": [curve.errors for curve in state.width_curves]}
        ),
        **(
            {}
            if state.attention_removed is None
            else {
                "attention_removed": state.attention_removed,
                "attention_errors": [curve.attention for curve in state.width_curves],
            }
        ),
        **(
            {}
            if state.kv_heads is None
            else {
                "kv_heads": state.kv_heads,
                "kv_errors": [{m.kv: m.error for m in curve.kv_merges} for curve in state.width_curves],
                "kv_units": state.kv_units,
            }
        ),
        **(
            {}
            if state.attention_removed is None and state.kv_heads is None
            else {"attention_units": state.attention_units}
        ),
        **({} if state.width_search is None else {"search": state.width_search}),
    )


@dataclasses.dataclass(frozen=True)
class Walked:
    """What the walk left that H of each block's stream is read from (`stream_sensitivity`): its
    result (H, the reader maps), its checkpoint (H saved by a resumed walk) and the sites' bases."""

    result: PruneResult
    checkpoint: Checkpoint
    bases: Mapping[str, torch.Tensor]

    @classmethod
    def of(cls, state: RunState) -> Walked:
        """The run's walk, as the stages after it see it."""
        assert state.result is not None
        return cls(state.result, state.checkpoint, state.bases)


@dataclasses.dataclass(frozen=True)
class MlpStageSettings:
    """Where and how this rank runs the MLP stage (the stage's state's, or a follower's own), and the
    heterogeneous layout's allocation if one was made: `prune_mlps`'s settings beside the model and walk."""

    device: torch.device
    progress: Progress
    scratch: Path
    """Where the calibration activations go with `activations: disk`."""
    ranks: Ranks
    widths: list[int] | None = None
    """Layer i keeps `widths[i]` (the heterogeneous layout's allocation), in place of the layout's width."""
    sensitivity: Mapping[int, torch.Tensor] | None = None
    """The H that allocation estimated, in place of the walk's."""


def prune_mlps(
    recipe: Recipe,
    checked: Plan,
    pruned: PreTrainedModel,
    calibration: list[Batch],
    walked: Walked,
    settings: MlpStageSettings,
) -> tuple[list[NeuronRecord], bool]:
    """The MLP stage, the same call on every rank: each MLP of `pruned` keeps the layout's neurons (or
    `settings.widths`, with `settings.sensitivity`: see `MlpStageSettings`), chosen on the model as
    the walk (and refinement) left it, weighed by H in each MLP's stream coordinates where the walk
    estimated it; its config says the new width. Returns the layers' records and whether H weighed the choice."""
    spec, layout, selector, family = recipe.mlp, checked.layout, checked.selector, checked.layout.family
    assert spec is not None and layout.prunes_mlp and selector is not None
    device, given = settings.device, settings.sensitivity
    sensitivity = stream_sensitivity(family, layout.config, walked, device) if given is None else given
    options = MlpOptions(
        selector,
        device,
        refit=spec.refit,
        damping=spec.damping,
        feedback=spec.feedback,
        sensitivity=sensitivity,
        progress=settings.progress,
        store=ActivationStore(device, recipe.activations, settings.scratch),
        ranks=settings.ranks,
        reconstruct=None if spec.reconstruct is None else reconstruct_settings(spec.reconstruct),
    )
    keep = layout.mlp_width if settings.widths is None else settings.widths
    records = prune_mlp(pruned, family, calibration, keep, options, shared_keep=layout.shared_width)
    set_mlp_widths(pruned.config, family, layout.mlp_width, layout.shared_width)
    return records, sensitivity is not None


def reconstruct_settings(spec: ReconstructSpec) -> ReconstructSettings:
    """The recipe's `mlp.reconstruct` as the engine reads it."""
    return ReconstructSettings(
        steps=spec.steps, lr=float(spec.lr), batch_tokens=spec.batch_tokens, heldout=float(spec.heldout)
    )


def allocate_layers(state: RunState) -> dict[int, torch.Tensor] | None:
    """The heterogeneous layout's MLP widths (`engine.mlp_widths`): the uniform plan's neurons,
    redistributed over the layers in DeciLM's steps by each layer's predicted error, and with
    `mlp.remove_attention` the attentions the allocation removes (gone from `state.pruned` before
    the MLPs are pruned, so each MLP is refitted on the stream without them), and with
    `mlp.merge_kv_heads` the layers it gives fewer KV heads (merged and refitted likewise first).
    Sets the widths, the curves, the removed attentions and the KV heads on `state`; returns H
    where each MLP writes (`allocate_by: fisher`), which the neuron selector then uses."""
    spec, layout, selector = state.recipe.mlp, state.checked.layout, state.checked.selector
    assert spec is not None and layout.mlp_width is not None and selector is not None and state.pruned is not None
    step = math.lcm(FFN_STEP, spec.round_to)
    windows = state.measuring_windows.get(PruneMlp.name, []) if spec.search is not None else []
    adjusts = spec.remove_attention or spec.merge_kv_heads
    fisher = None if spec.allocate_by == "energy" else stream_fishers(state, adjusts)
    layers = decoder_layers(state.pruned, state.family)
    written = {i: None if fisher is None else fisher[1][i] for i in range(len(layers))} if adjusts else None
    attention = written if spec.remove_attention else None
    counts = kv_options(state.pruned.config) if spec.merge_kv_heads else []
    units_at: dict[int, int] = {}
    if adjusts:
        grain = KV_GRAIN if spec.merge_kv_heads else step
        state.attention_units = attention_units(state.pruned, state.family, grain)
        units_at = merged_units(state.pruned, state.family, counts, grain)
    options = MlpOptions(
        selector,
        state.device,
        refit=spec.refit,
        damping=spec.damping,
        sensitivity=None if fisher is None else fisher[0],
        progress=state.progress,
        store=ActivationStore(state.device, state.recipe.activations, state.staging / SCRATCH_FOLDER),
        ranks=state.ranks,
    )
    measures = CurveOptions(attention=attention, kv_counts=counts, kv_weights=written, keep_solutions=bool(windows))
    curves = mlp_width_curves(state.pruned, state.family, state.calibration, step, options, measures)
    references = original_outputs(state, windows)  # the model unchanged still; after H and the curves' pass
    adjustable = sum(curve.attention is not None or bool(curve.kv_merges) for curve in curves)
    total = layout.mlp_width * len(curves) + state.attention_units * adjustable
    allocation = allocate(curves, total, state.attention_units, units_at)
    _adjust_attentions(state, layers, curves, allocation)
    if windows:
        allocation = dataclasses.replace(allocation, widths=search_widths(state, curves, allocation.widths, references))
    state.mlp_widths, state.width_curves = allocation.widths, [without_refits(curve) for curve in curves]
    state.attention_removed = allocation.attention_removed if spec.remove_attention else None
    state.kv_heads = kv_heads_kept(state.pruned, state.family) if spec.merge_kv_heads else None
    state.kv_units = units_at
    return None if fisher is None else fisher[0]


def _adjust_attentions(
    state: RunState, layers: nn.ModuleList, curves: list[WidthCurve], allocation: Allocation
) -> None:
    """The attentions the allocation removes, and those it gives fewer KV heads (merged, their output
    projection the merge's refit), changed in `state.pruned` before its MLPs are pruned."""
    for index in allocation.attention_removed:
        attention_module = layer_attention(state.family, layers[index])
        assert attention_module is not None
        remove_attention(attention_module, state.family)
    for index, kv in allocation.kv_heads.items():
        attention_module = layer_attention(state.family, layers[index])
        assert attention_module is not None
        merge = next(merge for merge in curves[index].kv_merges if merge.kv == kv)
        merge_kv_heads(attention_module, state.pruned.config, kv)
        set_output(attention_module, state.family, merge.output)


def original_outputs(state: RunState, windows: list[Batch]) -> list[torch.Tensor]:
    """The model's own log-probabilities on `windows`, on the host (the search's reference)."""
    assert state.pruned is not None
    if not windows:
        return []
    state.progress("MLP width search: the original's outputs", 0, 1)
    with on_device(state.pruned, state.device):
        references = [model_log_probs(state.pruned, batch, state.device).cpu() for batch in windows]
    state.progress("MLP width search: the original's outputs", 1, 1)
    return references


def search_widths(
    state: RunState, curves: list[WidthCurve], start: list[int], references: list[torch.Tensor]
) -> list[int]:
    """`mlp.search`: the widths of lowest measured KL from the predicted `start` (`engine.width_search`),
    the model as the allocation left its attentions, each MLP assembled from its curve's solutions;
    the search's record goes on `state`."""
    spec, model, windows = state.recipe.mlp, state.pruned, state.measuring_windows[PruneMlp.name]
    assert spec is not None and spec.search is not None and model is not None
    layers = decoder_layers(model, state.family)
    mlps = [mlp_linears(layer, state.family) for layer in layers]
    grids = [sorted(curve.errors) for curve in curves]
    solutions = [curve.solutions for curve in curves]

    def fitness(widths: list[int]) -> float:
        with assembled(mlps, solutions, widths):
            return kl_to_references(references, model, windows, state.device)

    def progress(done: int, total: int) -> None:
        state.progress("MLP width search: measuring allocations", done, total)

    with on_device(model, state.device):
        result = evolve(start, grids, fitness, SearchSettings(spec.search, seed=state.recipe.seed), progress=progress)
    tokens = sum(int(batch.attention_mask.sum()) for batch in windows)
    state.width_search = WidthSearchRecord(
        measured=result.measured,
        accepted=result.accepted,
        windows=sum(len(batch.input_ids) for batch in windows),
        tokens=tokens,
        predicted=list(start),
        predicted_kl=result.start_kl,
        kl=result.kl,
    )
    return result.widths


def attention_units(model: PreTrainedModel, family: ModelFamily, step: int) -> int:
    """A layer's attention parameters counted in MLP neurons (each neuron's row of the input
    linears and column of the output one), rounded down to `step` (the allocation's, or `KV_GRAIN`
    where KV heads may merge, whose savings are finer): removing an attention gives the MLPs at
    most what it held (its norm, left out, is a margin)."""
    _, held, per_neuron = _attention_worth(model, family)
    return held // per_neuron // step * step


def _attention_worth(model: PreTrainedModel, family: ModelFamily) -> tuple[nn.Module, int, int]:
    """The first layer's attention, its parameters, and the parameters one MLP neuron holds (its
    row of the input linears and column of the output one)."""
    layer = decoder_layers(model, family)[0]
    attention = layer_attention(family, layer)
    assert attention is not None
    inputs, output = mlp_linears(layer, family)
    per_neuron = sum(linear.in_features + (linear.bias is not None) for linear in inputs) + output.out_features
    return attention, sum(parameter.numel() for parameter in attention.parameters()), per_neuron


KV_GRAIN = 16
"""With `mlp.merge_kv_heads`, an attention's worth in neurons is rounded to this (down as it was, up
merged): the allocation's dynamic programme then runs over 16-neuron units, not single neurons."""


def merged_units(model: PreTrainedModel, family: ModelFamily, counts: list[int], grain: int) -> dict[int, int]:
    """What a layer's attention counts as in the allocation at each KV-head count of `counts`: its
    parameters at that count in MLP neurons, rounded up to `grain` (with `attention_units` rounded
    down, the MLPs get at most what a merge saves)."""
    attention, held, per_neuron = _attention_worth(model, family)
    had, per_head = layer_kv_heads(attention, model.config), kv_head_parameters(attention, model.config)
    return {kv: -(-(held - (had - kv) * per_head) // (per_neuron * grain)) * grain for kv in counts}


def without_refits(curve: WidthCurve) -> WidthCurve:
    """`curve` with its KV merges' refitted output projections and its width solutions dropped
    (applied or not chosen): the report keeps their errors, and host memory need not keep a d × A
    matrix per count and layer."""
    if not curve.kv_merges and not curve.solutions:
        return curve
    kept = tuple(dataclasses.replace(merge, output=torch.empty(0)) for merge in curve.kv_merges)
    return dataclasses.replace(curve, kv_merges=kept, solutions={})


def kv_heads_kept(model: PreTrainedModel, family: ModelFamily) -> list[int]:
    """Each layer's KV heads as the allocation left them (0: its attention removed)."""
    found = []
    for layer in decoder_layers(model, family):
        attention = layer_attention(family, layer)
        found.append(0 if attention is None else layer_kv_heads(attention, model.config))
    return found


def stream_fishers(state: RunState, attention: bool) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """H (`engine.fisher`) where each layer's MLP writes, and with `attention` where its attention
    writes (else none: each is d × d), on the model as loaded: a layout that keeps the stream whole has no walk to estimate it, and the width
    curves need it to compare layers. The estimate runs on a norm-fused copy (the stream is the
    same; the copy is dropped after)."""
    assert state.pruned is not None
    state.progress("estimating output sensitivity (H)", 0, 1)
    fused = copy.deepcopy(state.pruned)
    fuse_norms(fused, state.family)
    store = ActivationStore(state.device, state.recipe.activations, state.staging / SCRATCH_FOLDER)
    inputs = capture_layer_inputs(fused, state.family, state.calibration, state.device, store)
    try:
        fisher = estimate_fisher(fused, state.family, inputs, state.recipe.sensitivity, state.device, state.recipe.seed)
    finally:
        inputs.hidden.close()
        del fused
    layers = range(state.pruned.config.num_hidden_layers)
    sites = [layer_site_ids(state.family, i) for i in layers]
    written = {i: fisher[sites[i][0]] for i in layers} if attention else {}
    return {i: fisher[sites[i][-1]] for i in layers}, written


def stream_sensitivity(
    family: ModelFamily, config: Any, walked: Walked, device: torch.device, block: str = "mlp"
) -> StreamSensitivity | None:
    """H of the stream each layer's MLP (`block` "attention": its attention) writes to, in the
    coordinates the block writes it (RᵀHR with R what reads the site's kept coordinates: its
    basis, or its reader map with corrected readers); None when the walk did not estimate H, or
    where the block's output does not land in the stream directly (a norm after the block)."""
    result, checkpoint, bases = walked.result, walked.checkpoint, walked.bases
    fisher = result.fisher
    if fisher is None:  # a resumed walk with every site saved needs no H, but this stage does
        fisher = checkpoint.load_fisher()
    post_norm = family.attn_post_norm if block == "attention" else family.mlp_post_norm
    if fisher is None or post_norm is not None:
        return None
    readers = result.readers or {}
    position = 0 if block == "attention" else -1  # a parallel layer's one site is both
    sites = [layer_site_ids(family, i)[position] for i in range(config.num_hidden_layers)]
    return StreamSensitivity(fisher, {i: readers.get(site, bases[site]) for i, site in enumerate(sites)}, sites, device)


class StreamSensitivity(Mapping[int, torch.Tensor]):
    """RᵀHR of each layer's MLP stream (d × d H, R d × k), computed on the device when the MLP
    stage reaches that layer, so no layer's k × k matrix waits in host memory for its turn."""

    def __init__(
        self,
        fisher: Mapping[str, torch.Tensor],
        readers: dict[int, torch.Tensor],
        sites: list[str],
        device: torch.device,
    ) -> None:
        self.fisher, self.readers, self.sites, self.device = fisher, readers, sites, device

    def __getitem__(self, layer: int) -> torch.Tensor:
        R = self.readers[layer].to(self.device, torch.float64)
        return R.T @ self.fisher[self.sites[layer]].to(self.device, torch.float64) @ R

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.sites)))

    def __len__(self) -> int:
        return len(self.sites)
