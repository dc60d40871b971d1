"""Ranking the splits of the budget before any is pruned (`mlp.measure_best`): each split's KL is
predicted from the second-order estimates the run already makes, so that only the best few are
pruned and measured.

The prediction of a split (residual width k, MLP width m) is the sum of two local estimates on
the fused, unsliced model, both in nats of KL through H (the Fisher of the output at the stream):
- the residual width's, ½·Σ_s Tr(UᵀC_sU·UᵀH_sU) over every site for the removed directions U of
  the best candidate basis of the summed statistics (`engine.survey.survey_losses`: the survey a
  global walk runs first, kept for the trials' walks, so it costs no pass of its own);
- the MLP's, ½·Σ_l Tr[H_l·E[δ_l δ_lᵀ]] over the layers, δ_l the error layer l's MLP writes when
  the run's neuron selector keeps m neurons and the down projection is refitted
  (`engine.neurons.mlp_width_curves` at the candidates' widths: one pass layer by layer);
- with `heads` open, the attention's alike: the error each attention writes when the run's head
  selector keeps h heads and the output projection is refitted, weighed by H where it writes
  (`engine.heads.head_count_curves`: one more pass);
- with `depth` open, a candidate without blocks adds the measured KL of the model without them
  alone (the depth stage's), and its other terms are summed over the blocks it keeps (the residual
  width's basis chosen from their sites alone).

Both ignore how the cuts interact (each is measured on the model without the other), which is why
the best predicted splits are then measured, not taken.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore
from compressor.engine.heads import HeadOptions, head_count_curves
from compressor.engine.neurons import CurveOptions, MlpOptions, mlp_width_curves
from compressor.engine.survey import SurveyLosses, survey_losses
from compressor.engine.walk_options import WalkOptions
from compressor.models.layout import SlicedLayout, mlp_neurons
from compressor.models.sites import layer_site_ids
from compressor.runtime.staging import SCRATCH_FOLDER
from compressor.stages.base import Progress, RunState


@dataclass(frozen=True)
class Prediction:
    """Each split's predicted KL (in the plan's order), the residual survey's result and the time
    spent predicting (less H's)."""

    kls: list[float]
    survey: SurveyLosses
    seconds: float


def predict_splits(
    state: RunState, splits: tuple[SlicedLayout, ...], calibration: list[Batch], fisher_key: str
) -> Prediction:
    """Every split's predicted KL on `calibration` (the windows its trial would be pruned on), with
    H kept under `fisher_key` (`state.resources`) for the trials' walks and `state.survey` holding
    the survey they recall."""
    recipe, family, device = state.recipe, state.family, state.device
    tick = time.perf_counter()
    model = state.model_to_prune()  # fused by the survey and measured, then dropped

    def progress(phase: str, done: int, total: int) -> None:
        state.progress(f"predicting the splits: {phase}", done, total)

    options = WalkOptions(
        device=device,
        sensitivity=recipe.sensitivity,
        seed=recipe.seed,
        offload=recipe.activations,
        scratch=state.staging / SCRATCH_FOLDER,
        pooling=recipe.slicing.pooling,
        fisher=state.resources.fisher(fisher_key),
        ranks=state.ranks,
        progress=progress,
        survey=state.survey,
    )
    own = tuple(state.removed_blocks)  # the model predicted on: a candidate without other blocks has its own
    without = sorted({split.removed_blocks for split in splits} - {own})
    widths = sorted({split.kept or 0 for split in splits})
    residual = survey_losses(model, splits[0], calibration, widths, options, without=without)
    state.resources.keep_fisher(fisher_key, dict(residual.fisher))
    full = mlp_neurons(splits[0].config, family)
    layers = model.config.num_hidden_layers
    mlp = _mlp_losses(state, model, splits, calibration, residual, progress)
    heads = _head_losses(state, model, splits, calibration, residual, progress)
    del model
    removal = _removal_losses(state, without)
    kls = []
    for split in splits:
        kept = [i for i in range(layers) if split.removed_blocks == own or i not in split.removed_blocks]
        stream = residual.losses if split.removed_blocks == own else residual.without[split.removed_blocks]
        at_heads = heads.get(split.heads, [0.0] * layers)
        kls.append(
            removal.get(split.removed_blocks, 0.0)
            + stream[split.kept or 0]
            + sum(mlp[split.mlp_width or full][i] + at_heads[i] for i in kept)
        )
    return Prediction(kls, residual, time.perf_counter() - tick - residual.seconds)


def _removal_losses(state: RunState, without: list[tuple[int, ...]]) -> dict[tuple[int, ...], float]:
    """`depth` without `removed`: the measured KL of the model without each candidate's blocks alone
    (the depth stage's, on its held-out windows)."""
    if not without:
        return {}
    assert state.depth is not None and state.depth.candidates is not None
    kls = {tuple(candidate.removed): candidate.heldout_kl for candidate in state.depth.candidates}
    assert all(kls.get(blocks) is not None for blocks in without), "the depth stage measures each count for this"
    return {blocks: float(kls[blocks] or 0.0) for blocks in without}


def _mlp_losses(
    state: RunState,
    model: Any,
    splits: tuple[SlicedLayout, ...],
    calibration: list[Batch],
    residual: SurveyLosses,
    progress: Progress,
) -> dict[int, list[float]]:
    """Half the H-weighted output error of each MLP, layer by layer, at each width the splits keep
    (zero at the full width)."""
    recipe, family, device = state.recipe, state.family, state.device
    spec, selector = recipe.mlp, state.checked.selector
    assert spec is not None and selector is not None
    full = mlp_neurons(splits[0].config, family)
    narrowed = sorted({split.mlp_width for split in splits if split.mlp_width is not None and split.mlp_width < full})
    layers = model.config.num_hidden_layers
    mlp: dict[int, list[float]] = {full: [0.0] * layers}  # each layer's, by width
    if not narrowed:
        return mlp
    written = {i: residual.fisher[layer_site_ids(family, i)[-1]] for i in range(layers)}  # where each MLP writes
    options = MlpOptions(
        selector,
        device,
        refit=spec.refit,
        damping=spec.damping,
        sensitivity=written,
        progress=progress,
        store=ActivationStore(device, recipe.activations, state.staging / SCRATCH_FOLDER),
        ranks=state.ranks,
    )
    curves = mlp_width_curves(model, family, calibration, 1, options, CurveOptions(widths=narrowed))
    mlp.update({width: [0.5 * curve.errors[width] for curve in curves] for width in narrowed})
    return mlp


def _head_losses(
    state: RunState,
    model: Any,
    splits: tuple[SlicedLayout, ...],
    calibration: list[Batch],
    residual: SurveyLosses,
    progress: Progress,
) -> dict[int, list[float]]:
    """Half the H-weighted output error of each attention, layer by layer, at each head count the
    splits keep (none where every head stays)."""
    counts = sorted({split.heads for split in splits if split.heads is not None})
    spec, selector = state.recipe.heads, state.checked.head_selector
    if not counts:
        return {}
    assert spec is not None and selector is not None
    family, device = state.family, state.device
    written = {i: residual.fisher[layer_site_ids(family, i)[0]] for i in range(model.config.num_hidden_layers)}
    options = HeadOptions(
        selector,
        device,
        refit=spec.refit,
        damping=spec.damping,
        sensitivity=written,
        progress=progress,
        store=ActivationStore(device, state.recipe.activations, state.staging / SCRATCH_FOLDER),
        ranks=state.ranks,
    )
    curves = head_count_curves(model, family, calibration, counts, options)
    layers = model.config.num_hidden_layers
    return {count: [0.5 * curves[i][count] if i in curves else 0.0 for i in range(layers)] for count in counts}


def best_predicted(kls: list[float], count: int) -> list[int]:
    """The indices of the `count` lowest predictions, in the plan's order (ties: the earlier)."""
    ranked = sorted(range(len(kls)), key=lambda index: (kls[index], index))
    return sorted(ranked[:count])
