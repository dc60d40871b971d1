"""The survey of the original model: every site's C (and H) of the fused, unsliced model, for a
global layout's pooled statistics, the allocator's widths and a tied head's choice
(`survey_original`, a phase of `prune`); kept for the split choice's other walks of the same model
and data (`SurveyMemo`); and alone, a global layout's predicted KL at each width before any walk
(`survey_losses`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from compressor import faults
from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore
from compressor.engine.allocation import loss_curve
from compressor.engine.calibration import LayerInputs, SecondMoment, capture_layer_inputs
from compressor.engine.layerwise import visit_layers
from compressor.engine.parallel import Ranks
from compressor.engine.pooling import (
    GlobalPool,
)
from compressor.engine.sensitivity import Sensitivity, SensitivitySource, estimate_sensitivity
from compressor.engine.site_walk import SiteWalk
from compressor.engine.transforms import fuse_norms
from compressor.engine.walk_options import PruneCall, WalkOptions, WidthAllocator, check_model
from compressor.models.layout import SlicedLayout, check_widths
from compressor.models.sites import EMBEDDING, layer_site_ids


@dataclass
class SurveyMemo:
    """A survey pass's result kept between walks of one model, calibration data and H that differ
    only in their widths (the splits of one budget): the survey's pooled statistics and a tied
    head's last-site C are the same for all of them, so the pass runs once. `key` names the sites,
    pooling, head and calibration tokens it was made for; a walk with another key surveys again
    (and keeps its own)."""

    key: tuple[Any, ...] | None = None
    survey: Survey | None = None
    passes: int = 0
    """How many survey passes the walks sharing this memo ran (1 when it served them all)."""

    def recall(self, key: tuple[Any, ...]) -> Survey | None:
        """A copy of the kept survey for `key` (the walk drops its own after the embedding's choice)."""
        if self.key != key or self.survey is None:
            return None
        pool = self.survey.pool
        return Survey(None if pool is None else pool.copy(), list(self.survey.last))

    def keep(self, key: tuple[Any, ...], survey: Survey) -> None:
        self.key, self.survey = key, Survey(survey.pool, list(survey.last))
        self.passes += 1


@dataclass(frozen=True)
class SurveyLosses:
    """What `survey_losses` found: the predicted KL at each residual width asked for, and H."""

    losses: dict[int, float]
    fisher: Mapping[str, torch.Tensor]
    seconds: float
    """Time spent computing H (0 when given): shared work, reported apart."""
    fisher_source: str | None
    """Where H came from, as `PruneResult.fisher_source` says."""
    without: dict[tuple[int, ...], dict[int, float]] = field(default_factory=dict)
    """For each set of decoder blocks asked for, the same prediction over the sites of the other
    blocks alone (the basis chosen from their statistics): the model without those blocks, as far
    as the survey of the model with them can say."""


@torch.no_grad()
def survey_losses(
    model: PreTrainedModel,
    layout: SlicedLayout,
    batches: list[Batch],
    widths: Sequence[int],
    options: WalkOptions = WalkOptions(),
    without: Sequence[Collection[int]] = (),
) -> SurveyLosses:
    """A global layout's predicted KL of keeping each of `widths` dimensions of the stream, before
    any walk: the survey pass a global walk starts with (every site's C with H on the fused,
    unsliced `model`, which is left fused), then ½·Σ_s Tr(UᵀC_sU·UᵀH_sU) over the sites for the
    best candidate basis of the summed statistics at each width (`allocation.loss_curve`, the
    `curves` allocator's prediction); for each set of blocks in `without`, the same over the other
    blocks' sites. The survey goes to `options.survey` and H is returned, so
    the walks that follow pass over the model once less and estimate no H. Holds every site's C
    and H on the host until the curve is drawn (2·d² floats per site)."""
    if not layout.one_basis:
        raise ValueError("survey_losses predicts one basis kept everywhere: a global layout")
    device, ranks = torch.device(options.device), options.ranks or Ranks.current()
    report = options.progress or (lambda *_: None)
    run = PruneCall(model, layout, device, report, ranks, None, tie_head=False, correct_readers=False)
    check_model(run)
    model.eval()
    model.requires_grad_(False)
    skipped = ranks.skipped_rows([batch.input_ids.numel() for batch in batches])
    report("fusing norms", 0, model.config.num_hidden_layers)
    fuse_norms(model, layout.family)
    store = ActivationStore(device, options.offload, options.scratch)
    members: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    survey = Survey(GlobalPool(options.pooling))
    try:
        inputs = capture_layer_inputs(model, layout.family, ranks.share(batches), device, store)
        tokens_by_rank = ranks.gather_counts(sum(inputs.token_counts), device)
        source = SensitivitySource(options.fisher, options.sensitivity, options.seed)
        h = estimate_sensitivity(run, inputs, source, skipped)
        assert h.values is not None

        def observe(site: str, moment: SecondMoment) -> None:
            C, H = moment.value(), h.at(site)
            assert survey.pool is not None and H is not None
            survey.pool.add(site, C, moment.tokens, H)
            members.append((site, C.to("cpu", torch.float32), H.to("cpu", torch.float32)))

        survey_pass(run, inputs, observe)
    finally:
        store.close()
    if options.survey is not None:
        options.survey.keep(survey_key(run, options.pooling, tokens_by_rank), survey)
    report("predicting the residual widths' loss", 0, 1)
    layer_of = {
        site: layer for layer in range(model.config.num_hidden_layers) for site in layer_site_ids(layout.family, layer)
    }

    def losses(blocks: Collection[int]) -> dict[int, float]:
        (_, C0, H0), *rest = [member for member in members if layer_of.get(member[0]) not in blocks]
        return dict(zip(widths, loss_curve(C0, H0, list(widths), pooled=[(c, h) for _, c, h in rest])))

    others = {tuple(sorted(blocks)): losses(set(blocks)) for blocks in without}
    return SurveyLosses(losses(()), h.values, h.seconds, h.source, others)


def survey_key(run: PruneCall, pooling: str, tokens_by_rank: Sequence[int]) -> tuple[Any, ...]:
    """What a survey was made for (`SurveyMemo`): its sites, pooling, head and calibration tokens."""
    return (tuple(run.ids), pooling, run.one_basis, run.tie_head, tuple(tokens_by_rank))


@dataclass
class Survey:
    """What a survey of the original model leaves for the walk: a global layout's pooled
    statistics, and (tied head) the last site's C for the embedding's choice."""

    pool: GlobalPool | None
    last: list[tuple[str, SecondMoment]] = field(default_factory=list)


def survey_original(
    run: PruneCall,
    inputs: LayerInputs,
    h: Sensitivity,
    survey: Survey,
    widths: Mapping[str, int] | None,
    allocator: WidthAllocator | None,
) -> tuple[Mapping[str, int], dict[str, Any] | None]:
    """ "surveying the original model": every site's C (and H) of the fused, unsliced model goes to
    the global pool, the allocator (which then chooses the widths, checkpointed) and a tied head's
    choice. Returns the widths and the allocation's record (None when the widths were given)."""
    ids, tie_head, checkpoint = run.ids, run.tie_head, run.checkpoint

    def observe(site: str, moment: SecondMoment) -> None:
        if survey.pool is not None:
            survey.pool.add(site, moment.value(), moment.tokens, h.at(site))
        if widths is None:
            assert allocator is not None
            allocator.observe(site, moment.value(), h.at(site))
        if tie_head and site == ids[-1]:
            survey.last.append((site, moment))

    survey_pass(run, inputs, observe)
    if widths is not None:
        return widths, None
    assert allocator is not None
    widths = allocator.widths()
    check_widths(run.family, ids, widths, run.shared, tie_head)
    allocation = {"widths": widths, **allocator.to_json(widths)}
    if checkpoint is not None:
        checkpoint.save_allocation(allocation)
    faults.reached("allocation")
    return widths, allocation


def survey_pass(run: PruneCall, inputs: LayerInputs, observe: Callable[[str, SecondMoment], None]) -> None:
    """Run the fused, unsliced model over the calibration windows, handing each site's C to
    `observe` (the allocator's curves; a tied head's last site). The stored activations end at
    the last layer."""
    model, family, device, report = run.model, run.family, run.device, run.report
    survey = SiteWalk(inputs, device, ranks=run.ranks)
    num_layers = model.config.num_hidden_layers

    def seen(site: str, moment: SecondMoment | None) -> None:
        assert moment is not None
        observe(site, moment)

    seen(EMBEDDING, survey.advance(EMBEDDING, None, 0))
    for index, layer in visit_layers(model, family, device, read_only=True):
        report(f"surveying the original model: layer {index + 1}/{num_layers}", index, num_layers)
        for site, name in zip(layer.sites(family), layer_site_ids(family, index)):
            seen(name, survey.advance(name, site.block, index))
