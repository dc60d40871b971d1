"""The engine: fuse norms, then choose, rotate and slice one residual-stream site at a time.

Sites (see `compressor.models.sites`) are visited in stream order. Each site's basis is chosen from
activations of the model whose earlier sites are already sliced, so errors propagate forward
as in SliceGPT. Activations stay on the host and visit the device one batch at a time; the
device holds one layer. After each site the chosen basis goes to the checkpoint, so a killed
run replays finished sites (forward only, bases loaded) and continues. The engine asks the
pipeline's strategies for a basis and knows nothing else about them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from compressor import faults
from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore
from compressor.engine.allocation import loss_curve
from compressor.engine.bases import (
    apply_embedding_basis,
    apply_head_basis,
    apply_tied_head,
    as_sliced_model,
    close_site,
    open_site,
    prediction_error,
    reader_map,
    slicing_config,
)
from compressor.engine.calibration import LayerInputs, SecondMoment, capture_layer_inputs
from compressor.engine.checkpoint import Checkpoint, OnDisk, SavedSite, restore_rng
from compressor.engine.fisher import estimate_fisher
from compressor.engine.layerwise import visit_layers
from compressor.engine.parallel import Ranks
from compressor.engine.pooling import (
    GlobalPool,
    PipelineStep,
    Pooled,
    ProgressCallback,
    SiteChooser,
    SiteRecord,
    check_finite,
    required_statistics,
)
from compressor.engine.transforms import fuse_norms
from compressor.engine.written import StockTarget, WrittenModel
from compressor.errors import UserError
from compressor.models.families import ModelFamily
from compressor.models.layout import SlicedLayout, check_widths
from compressor.models.sites import EMBEDDING, layer_site_ids
from compressor.models.sliced import SlicedDecoderLayer
from compressor.models.stock import head_stream
from compressor.recipe.sections.sensitivity import SensitivityOptions


class WidthAllocator(Protocol):
    """Chooses every site's kept width from statistics of the original model (`compressor.engine.allocation`)."""

    requires: tuple[str, ...]

    def observe(self, site: str, C: torch.Tensor, H: torch.Tensor | None) -> None: ...

    def widths(self) -> dict[str, int]: ...

    def to_json(self, widths: Mapping[str, int]) -> dict[str, Any]: ...


@dataclass
class PruneResult:
    model: PreTrainedModel
    sites: list[SiteRecord]
    slicing: dict[str, Any]
    bases: Mapping[str, torch.Tensor]
    """Each site's kept directions V_s (d × k_s, float64, on the host), keyed by site id (a walk
    that writes as it goes leaves them in the checkpoint's files: `OnDisk`)."""
    readers: Mapping[str, torch.Tensor] | None = None
    """With `correct_readers`: each site's reader map R_s (d × k_s, float64, host; on disk like the bases)."""
    resumed_from: str | None = None
    """The first site this call chose after loading finished sites from a checkpoint."""
    loaded_sites: int = 0
    fisher_loaded: bool = False
    fisher: Mapping[str, torch.Tensor] | None = None
    """H by site (host, accumulation dtype) when the pipeline used it, so a caller can reuse it
    (a walk that writes as it goes leaves it in the checkpoint: `OnDisk`)."""
    fisher_source: str | None = None
    """Where H came from: "computed", "checkpoint", "given" (by the caller), or None (not used)."""
    widths: dict[str, int] = field(default_factory=dict)
    """The kept width of every site (given, or chosen by the allocator)."""
    allocation: dict[str, Any] | None = None
    """The allocator's record (budget, predicted loss, curves), when one chose the widths."""
    tokens_by_rank: list[int] = field(default_factory=list)
    """Calibration tokens each rank walked (one entry in a single process)."""
    head_moment: torch.Tensor | None = None
    """Global layout: C of the last site's stream (d × d, host), what the head reads."""
    fisher_seconds: float = 0.0
    """Time this call spent computing H (0 when H was given, loaded or not needed): work a
    sweep's runs share, reported apart from the prune time."""
    written_before: int = 0
    """`write_to`: layers a killed walk had written there, found committed and not written again."""
    stock: dict[str, Any] | None = None
    """`write_to` with one basis: the stock conversion's record (`models.stock.stock_record`), the
    model having been written as the original class."""
    walked: Pooled | None = None
    """Global layout with `WalkOptions.pool_walked`, a walk that loaded no site: every site's C as
    the sliced model makes it (SliceGPT's statistics: earlier sites sliced), pooled like the
    survey's, H as given."""


class _Walk:
    """The state of one walk down the model: the activation store, the basis the stored
    activations still have to be projected on, and the sites chosen or loaded so far."""

    def __init__(
        self,
        inputs: LayerInputs,
        device: torch.device,
        chooser: SiteChooser | None,
        widths: Mapping[str, int],
        saved: Mapping[str, SavedSite],
        checkpoint: Checkpoint | None,
        correct_readers: bool = False,
        shared: Collection[str] = (),
        copies: Mapping[str, str] | None = None,
        ranks: Ranks | None = None,
        bases_on_disk: bool = False,
    ) -> None:
        self.inputs, self.device, self.chooser, self.widths = inputs, device, chooser, widths
        self.ranks = ranks or Ranks()
        """Data-parallel: each site's C is summed over the ranks' batches before anything reads it."""
        self.saved, self.checkpoint, self.correct_readers = saved, checkpoint, correct_readers
        self.shared = set(shared)
        self.copies = dict(copies or {})
        """Sites that keep an earlier site's basis (site → that site), e.g. a tied head's."""
        on_disk = bases_on_disk and checkpoint is not None and checkpoint.writable
        self.readers: dict[str, torch.Tensor] | OnDisk = OnDisk() if on_disk else {}
        self.width = inputs.hidden.host(0).shape[-1]  # d: the stream is stored in full coordinates
        self.pending: torch.Tensor | None = None
        self.records: list[SiteRecord] = []
        self.bases: dict[str, torch.Tensor] | OnDisk = OnDisk() if on_disk else {}
        """Every basis so far: in memory, or (`bases_on_disk`, with a checkpoint this process
        writes) left in the checkpoint's site files and read when asked; a data-parallel rank that
        writes no checkpoint then keeps only the bases a later site copies. Readers alike."""
        self.drop_bases = bases_on_disk and not on_disk
        self.resumed_from: str | None = None

    def advance(
        self, site: str, block: Callable[..., torch.Tensor] | None, layer: int, measure: bool = False
    ) -> SecondMoment | None:
        """Push every batch through `block` (None: just read the stream); return C of the result
        unless the site is already finished (a replay needs the activations, not their
        statistics) and not to be `measure`d all the same."""
        if site in self.saved and block is None and not measure:
            return None  # nothing to compute and nothing to change
        moment = None if site in self.saved and not measure else SecondMoment(self.width, self.device)
        store = self.inputs.hidden
        for b in range(len(store)):
            hidden = store.get(b, self.device)
            if block is not None:
                if self.pending is not None:
                    hidden = hidden @ self.pending.to(hidden.dtype)
                hidden = block(hidden, **self.inputs.kwargs(b, layer, self.device))
                store.put(b, hidden)
            if moment is not None:
                moment.add(hidden, self.inputs.token_masks[b], self.inputs.token_counts[b])
        return None if moment is None else moment.sum_over(self.ranks)

    def look_ahead(self, block: Callable[..., torch.Tensor], layer: int) -> SecondMoment:
        """C after `block` run on the stored stream, which stays as it is: the statistics of the
        next site as the unsliced block would make them (the block must not be opened yet)."""
        moment = SecondMoment(self.width, self.device)
        store = self.inputs.hidden
        for b in range(len(store)):
            hidden = block(store.get(b, self.device), **self.inputs.kwargs(b, layer, self.device))
            moment.add(hidden, self.inputs.token_masks[b], self.inputs.token_counts[b])
        return moment.sum_over(self.ranks)

    def settle(
        self,
        site: str,
        moment: SecondMoment | None,
        pooled: Callable[[], list[tuple[str, SecondMoment]]] | None = None,
        given: Callable[[], Pooled] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The site's kept basis and what reads its stream (the basis, or with `correct_readers`
        its reader map): loaded from the checkpoint, or chosen now and checkpointed. `pooled`
        gives (only if the basis is chosen now) the C of later sites that will keep this basis;
        their statistics join this site's in the choice. `given` gives the whole problem instead
        (a global layout's: every site's statistics, pooled)."""
        if site in self.saved:
            entry = self.saved[site]
            saved = entry.basis
            if tuple(saved.shape) != (self.width, self.widths[site]):
                raise UserError(
                    f"the checkpoint's basis for {site} has shape {tuple(saved.shape)}, which this "
                    f"run's widths do not allow; rerun with --restart to discard the checkpoint"
                )
            if self.correct_readers and not entry.has_reader:
                raise UserError(f"the checkpoint has no reader map for {site}; rerun with --restart")
            self.records.append(SiteRecord.from_json(entry.record))
            restore_rng(entry.rng)
            self._keep(site, saved, entry.path)
            self.pending = basis = saved.to(self.device)
            reader = basis
            if self.correct_readers:
                saved_reader = entry.reader
                assert saved_reader is not None
                self._keep(site, saved_reader, entry.path, "reader")
                reader = saved_reader.to(self.device)
            return basis, reader
        assert moment is not None
        if self.saved and self.resumed_from is None:
            self.resumed_from = site
        if site in self.shared or site in self.copies:  # keeps an earlier site's basis: nothing to choose
            assert self.pending is not None and self.records
            source = self.copies.get(site, self.records[-1].name)
            basis = self.bases[source].to(self.device) if site in self.copies else self.pending
            record = SiteRecord(
                name=site,
                width=self.width,
                kept=self.widths[site],
                tokens=moment.tokens,
                steps=[{"strategy": "shared", "objectives": {"with": source}}],
            )
        else:
            assert self.chooser is not None
            problem = given() if given is not None else self.chooser.pool(site, moment, pooled() if pooled else ())
            basis, record = self.chooser.choose(self.widths[site], problem)
        reader = basis
        if self.correct_readers:
            C = moment.value()
            reader = reader_map(C, basis)
            record.correction = {
                "error_basis": prediction_error(C, basis, basis),
                "error_reader": prediction_error(C, basis, reader),
            }
        self.records.append(record)
        path = None
        if self.checkpoint is not None:
            path = self.checkpoint.save_site(
                len(self.records) - 1, site, basis, record.to_json(), reader if self.correct_readers else None
            )
        faults.reached(f"site:{site}")
        self._keep(site, basis, path)
        if self.correct_readers:
            self._keep(site, reader, path, "reader")
        self.pending = basis
        return basis, reader

    def _keep(self, site: str, tensor: torch.Tensor, path: Path | None, key: str = "basis") -> None:
        """Keep the site's basis (or reader map): its place in the checkpoint, or the tensor."""
        kept = self.bases if key == "basis" else self.readers
        if isinstance(kept, OnDisk) and path is not None:
            kept.places[site] = (path, key)
        elif not self.drop_bases or site in self.copies.values():
            kept[site] = tensor.to("cpu")


@dataclass
class _Prune:
    """What the phases of one `prune` call share: the model, its layout and the device it visits,
    how progress is said, the ranks and the checkpoint."""

    model: PreTrainedModel
    layout: SlicedLayout
    device: torch.device
    report: ProgressCallback
    ranks: Ranks
    checkpoint: Checkpoint | None
    tie_head: bool
    """The walk keeps the head tied (a per-site layout's tie; a global one ties at export)."""
    correct_readers: bool

    @property
    def family(self) -> ModelFamily:
        return self.layout.family

    @property
    def ids(self) -> list[str]:
        return list(self.layout.sites)

    @property
    def shared(self) -> tuple[str, ...]:
        return self.layout.reused

    @property
    def one_basis(self) -> bool:
        return self.layout.one_basis


@dataclass(frozen=True)
class WalkOptions:
    """How the walk runs, beside the layout it makes: where, what it does with the activations,
    how it estimates H, and two choices of the recipe's `slicing` that change no shape."""

    device: torch.device | str = "cpu"
    sensitivity: SensitivityOptions = field(default_factory=SensitivityOptions)
    seed: int = 0
    offload: str = "host"
    """"host": calibration activations in memory; "disk": memory-mapped files under `scratch`."""
    scratch: Path | None = None
    correct_readers: bool = False
    """What reads each site's stream reads it through the least-squares reader map (`bases.reader_map`)."""
    pooling: str = "trace"
    """How a global layout sums the sites' statistics (`GlobalPool`)."""
    write_to: Path | None = None
    """Write the sliced model there as the walk goes (`engine.written`): each layer when finished,
    then dropped from memory, the bases left in the checkpoint's files; the returned model's
    layers are read back from that folder when a pass needs them. With one basis (the global
    layout) the model is written as the original class (`models.stock`; a tied head by the
    diagonal fit: the symmetric fit rotates every layer after the walk, so it is not written so)."""
    max_shard_size: int | str = "50GB"
    """The written model's shards, split as `save_pretrained` splits them."""
    pool_walked: bool = False
    """Global layout: pool every site's C (and H) as the sliced model makes them, for
    `PruneResult.walked` (SliceGPT's statistics, `benchmarks/global_statistics.py`); off, the walk
    holds no d × d sums beyond the site it is on."""
    allocator: WidthAllocator | None = None
    """Chooses the widths of a layout without them, from the survey's statistics."""
    checkpoint: Checkpoint | None = None
    """Where H and every finished site are saved, and reused from."""
    fisher: Mapping[str, torch.Tensor] | None = None
    """H of this model, data, options and seed, given (a sweep's earlier run): not estimated again."""
    ranks: Ranks | None = None
    """The data-parallel group (by default the initialised `torch.distributed` one, if any)."""
    progress: ProgressCallback | None = None
    """Hears each phase and site as the walk reaches it."""
    survey: SurveyMemo | None = None
    """Keeps the survey of the original model for the next walk over the same model, data and H
    (a split choice's trials, then the run's walk): its statistics do not depend on the widths."""


@dataclass
class SurveyMemo:
    """A survey pass's result kept between walks of one model, calibration data and H that differ
    only in their widths (the splits of one budget): the survey's pooled statistics and a tied
    head's last-site C are the same for all of them, so the pass runs once. `key` names the sites,
    pooling, head and calibration tokens it was made for; a walk with another key surveys again
    (and keeps its own)."""

    key: tuple[Any, ...] | None = None
    survey: _Survey | None = None
    passes: int = 0
    """How many survey passes the walks sharing this memo ran (1 when it served them all)."""

    def recall(self, key: tuple[Any, ...]) -> _Survey | None:
        """A copy of the kept survey for `key` (the walk drops its own after the embedding's choice)."""
        if self.key != key or self.survey is None:
            return None
        pool = self.survey.pool
        return _Survey(None if pool is None else pool.copy(), list(self.survey.last))

    def keep(self, key: tuple[Any, ...], survey: _Survey) -> None:
        self.key, self.survey = key, _Survey(survey.pool, list(survey.last))
        self.passes += 1


@torch.no_grad()
def prune(
    model: PreTrainedModel,
    layout: SlicedLayout,
    batches: list[Batch],
    pipeline: Sequence[PipelineStep],
    options: WalkOptions = WalkOptions(),
) -> PruneResult:
    """Rotate and slice `model` in place into `layout` (built by `models.layout.sliced_layout` from
    a recipe, or `fixed_layout` from widths), then return it as a `sliced_*` model.

    Layers are moved to `options.device` one at a time and back, and calibration activations stay
    on the host (or on disk), so neither model nor activations need fit on the accelerator. H is
    estimated only when a strategy of the pipeline requires it, on the fused model before
    anything is sliced, unless the caller gives it (`fisher`: H of this model, data, options and
    seed, e.g. from an earlier run of a sweep). With a `checkpoint`, H and every finished site
    are saved there, and those already saved are reused (all of these, and `ranks`, `allocator`
    and `progress` below, are fields of `options`). With `correct_readers`, what reads each
    site's stream (the next block's input linears, the residual transition, the head) reads it
    through R_s = C_s·V_s(V_sᵀC_sV_s)⁻¹ instead of V_s. The layout's shared sites keep the
    previous site's basis, chosen there from both sites' statistics (the next block looked
    ahead), with no transition matrix into them. A tied head (per-site layout) keeps the
    embedding's basis and stays tied to the embedding (`bases.apply_tied_head`); that basis is
    chosen from both sites' statistics, the last site's C from a survey pass (below).

    A global layout keeps one basis everywhere (no transitions: the sliced model is the
    original architecture at a smaller width, see `compressor.models.stock`). It is chosen at the
    embedding, before the walk, from every site's C and H on the unsliced model (a survey pass),
    summed as `options.pooling` says; the walk then applies it site by site (and checkpoints it
    like any site), and measures the last site's C for the head (`PruneResult.head_moment`). The
    head is left untied (the stock export ties it).

    A layout without widths needs an `allocator`: a survey pass first runs the fused, unsliced
    model over the calibration windows and hands every site's C (and H) to it; its widths, saved
    in the checkpoint, then drive the walk. The survey costs one forward pass (run once for all
    its uses).

    Data-parallel (`ranks`, by default the initialised `torch.distributed` group, if any): each
    rank takes its share of `batches` (`Ranks.share`), sums every site's C and H with the other
    ranks before choosing, draws the labels a single process would draw for its batches, and so
    returns the same bases as one process over all batches (up to the order of the sums).
    """
    device = torch.device(options.device)
    allocator, checkpoint, fisher, progress = options.allocator, options.checkpoint, options.fisher, options.progress
    ranks = options.ranks or Ranks.current()
    local = ranks.share(batches)
    skipped = ranks.skipped_rows([batch.input_ids.numel() for batch in batches])  # other ranks' label draws
    report = progress or (lambda *_: None)
    run = _Prune(
        model,
        layout,
        device,
        report,
        ranks,
        checkpoint,
        tie_head=layout.tie_head and not layout.one_basis,  # a global layout's tie is the stock export's
        correct_readers=options.correct_readers,
    )
    _check_model(run)
    model.eval()
    model.requires_grad_(False)
    num_layers = model.config.num_hidden_layers
    family, ids = layout.family, list(layout.sites)
    widths = layout.widths
    if widths is None and allocator is None:
        raise ValueError("a layout without widths needs an allocator to choose them")
    allocation = checkpoint.load_allocation() if checkpoint is not None and widths is None else None
    if allocation is not None:
        widths = allocation["widths"]
    needed = required_statistics(pipeline) | (
        set(allocator.requires) if widths is None and allocator is not None else set()
    )
    saved = checkpoint.finished_sites() if checkpoint is not None else {}

    report("fusing norms", 0, num_layers)
    fuse_norms(model, family)
    report("capturing layer inputs", 0, num_layers)
    store = ActivationStore(device, options.offload, options.scratch)
    try:
        inputs = capture_layer_inputs(model, family, local, device, store)
        tokens_by_rank = ranks.gather_counts(sum(inputs.token_counts), device)
        faults.reached("capture")
        h = _Sensitivity(device)
        if "H" in needed and (len(saved) < len(ids) or widths is None):
            h = _estimate_sensitivity(
                run, inputs, fisher, options.sensitivity, options.seed, skipped, on_disk=options.write_to is not None
            )
        survey = _Survey(GlobalPool(options.pooling) if layout.one_basis and EMBEDDING not in saved else None)
        tied_choice = run.tie_head and EMBEDDING not in saved
        memo_key = _memo_key(run, options.pooling, tokens_by_rank)
        # a survey of given widths can be recalled and kept; an allocator's widths are its own
        memo = options.survey if widths is not None and (tied_choice or survey.pool is not None) else None
        recalled = memo.recall(memo_key) if memo is not None else None
        if recalled is not None:  # the same statistics an earlier walk's survey pass measured
            survey = _Survey(recalled.pool if survey.pool is not None else None, recalled.last if tied_choice else [])
        elif widths is None or tied_choice or survey.pool is not None:
            widths, chosen = _survey_original(run, inputs, h, survey, widths, allocator)
            if memo is not None:
                memo.keep(memo_key, survey)
            allocation = chosen or allocation  # widths from the checkpoint keep the record saved with them
            store.close()  # the survey moved the activations down the model: start again
            store = ActivationStore(device, options.offload, options.scratch)
            inputs = capture_layer_inputs(model, family, local, device, store)
        chooser = SiteChooser(pipeline, ids, h.values, report)
        output = _output(run, widths, options)
        walked = _walk_sites(
            run, inputs, h, chooser, widths, saved, survey, options.pooling, output, options.pool_walked
        )
    finally:
        store.close()
    slicing = _attach_head(run, widths, walked.reader)
    walk = walked.walk
    if output is not None:
        assert output.slicing == slicing, "the written shards were laid out for another slicing"
        stream = (
            head_stream(walked.head_moment, walk.bases[EMBEDDING])
            if output.stock is not None and output.stock.tie
            else None
        )
        pruned = output.finish(model, stream)
    else:
        pruned = as_sliced_model(model, family, slicing)
    return PruneResult(
        model=pruned,
        sites=walk.records,
        slicing=slicing,
        bases=walk.bases,
        readers=walk.readers if options.correct_readers else None,
        resumed_from=walk.resumed_from,
        loaded_sites=len(saved),
        fisher_loaded=h.loaded,
        fisher=h.values,
        fisher_source=h.source,
        widths=dict(widths),
        allocation=allocation,
        tokens_by_rank=tokens_by_rank,
        head_moment=walked.head_moment,
        fisher_seconds=h.seconds,
        written_before=output.written_before if output is not None else 0,
        stock=output.record if output is not None else None,
        walked=walked.pool.pooled() if walked.pool is not None and walked.pool.names == ids else None,
    )


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
    run = _Prune(model, layout, device, report, ranks, None, tie_head=False, correct_readers=False)
    _check_model(run)
    model.eval()
    model.requires_grad_(False)
    skipped = ranks.skipped_rows([batch.input_ids.numel() for batch in batches])
    report("fusing norms", 0, model.config.num_hidden_layers)
    fuse_norms(model, layout.family)
    store = ActivationStore(device, options.offload, options.scratch)
    members: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    survey = _Survey(GlobalPool(options.pooling))
    try:
        inputs = capture_layer_inputs(model, layout.family, ranks.share(batches), device, store)
        tokens_by_rank = ranks.gather_counts(sum(inputs.token_counts), device)
        h = _estimate_sensitivity(run, inputs, options.fisher, options.sensitivity, options.seed, skipped)
        assert h.values is not None

        def observe(site: str, moment: SecondMoment) -> None:
            C, H = moment.value(), h.at(site)
            assert survey.pool is not None and H is not None
            survey.pool.add(site, C, moment.tokens, H)
            members.append((site, C.to("cpu", torch.float32), H.to("cpu", torch.float32)))

        _survey(run, inputs, observe)
    finally:
        store.close()
    if options.survey is not None:
        options.survey.keep(_memo_key(run, options.pooling, tokens_by_rank), survey)
    report("predicting the residual widths' loss", 0, 1)
    layer_of = {
        site: layer for layer in range(model.config.num_hidden_layers) for site in layer_site_ids(layout.family, layer)
    }

    def losses(blocks: Collection[int]) -> dict[int, float]:
        (_, C0, H0), *rest = [member for member in members if layer_of.get(member[0]) not in blocks]
        return dict(zip(widths, loss_curve(C0, H0, list(widths), pooled=[(c, h) for _, c, h in rest])))

    others = {tuple(sorted(blocks)): losses(set(blocks)) for blocks in without}
    return SurveyLosses(losses(()), h.values, h.seconds, h.source, others)


def _memo_key(run: _Prune, pooling: str, tokens_by_rank: Sequence[int]) -> tuple[Any, ...]:
    """What a survey was made for (`SurveyMemo`): its sites, pooling, head and calibration tokens."""
    return (tuple(run.ids), pooling, run.one_basis, run.tie_head, tuple(tokens_by_rank))


# The phases of `prune`, in order; each is named as the progress line that announces it.


def _check_model(run: _Prune) -> None:
    """The layout was made for this model (its widths checked when it was made); a tied head
    needs a model whose head weight is its embedding weight."""
    model, layout = run.model, run.layout
    shape = (model.config.num_hidden_layers, model.config.hidden_size)
    if shape != (layout.config.num_hidden_layers, layout.config.hidden_size):
        raise ValueError(
            f"the layout is for {layout.config.num_hidden_layers} layers of width "
            f"{layout.config.hidden_size}, the model has {shape[0]} of width {shape[1]}"
        )
    if run.tie_head:
        head, embedding = model.get_submodule(layout.family.head), model.get_submodule(layout.family.embedding)
        if head.weight is not embedding.weight:
            raise ValueError("tie_head needs a model whose head weight is its embedding weight")


@dataclass
class _Sensitivity:
    """H as the walk uses it, and where it came from."""

    device: torch.device
    values: Mapping[str, torch.Tensor] | None = None
    loaded: bool = False
    source: str | None = None
    seconds: float = 0.0

    def at(self, site: str) -> torch.Tensor | None:
        return None if self.values is None else self.values[site].to(self.device, torch.float64)


def _estimate_sensitivity(
    run: _Prune,
    inputs: LayerInputs,
    given: Mapping[str, torch.Tensor] | None,
    options: SensitivityOptions | None,
    seed: int,
    skipped: Any,
    on_disk: bool = False,
) -> _Sensitivity:
    """ "estimating output sensitivity (H)": H from the checkpoint, else as the caller gave it,
    else computed on the fused, unsliced model (and checkpointed). `on_disk`: once checkpointed,
    each site's H is read from there when asked, not held (a walk that writes as it goes); a
    data-parallel rank above 0 reads it from rank 0's file once rank 0 has written it."""
    model, family, device, checkpoint, report = run.model, run.family, run.device, run.checkpoint, run.report
    h = _Sensitivity(device)
    on_disk = on_disk and checkpoint is not None
    if checkpoint is not None:
        h.values = checkpoint.fisher_on_disk() if on_disk else checkpoint.load_fisher()
    h.loaded = h.values is not None
    h.source = "checkpoint" if h.loaded else None
    if h.values is None and given is not None:
        h.values, h.source = dict(given), "given"
        if checkpoint is not None:
            checkpoint.save_fisher(h.values)
    if h.values is None:
        h.source = "computed"
        phase = "estimating output sensitivity (H)"

        def h_progress(done: int, total: int) -> None:
            report(phase, done, total)
            if done:  # mid-way through the pass, after its first chunk
                faults.reached("fisher")

        tick = time.perf_counter()
        h.values = estimate_fisher(
            model, family, inputs, options or SensitivityOptions(), device, seed, h_progress, run.ranks, skipped
        )
        h.seconds = time.perf_counter() - tick
        for name, value in h.values.items():
            check_finite("H", name, value)
        if checkpoint is not None:
            checkpoint.save_fisher(h.values)
    if on_disk and not h.loaded:  # just checkpointed (by rank 0): read back per site from there
        assert checkpoint is not None
        run.ranks.barrier()  # every rank's H is the same sum; rank 0's file is whole once it is here
        saved = checkpoint.fisher_on_disk()
        h.values = saved if saved is not None else h.values
    return h


@dataclass
class _Survey:
    """What a survey of the original model leaves for the walk: a global layout's pooled
    statistics, and (tied head) the last site's C for the embedding's choice."""

    pool: GlobalPool | None
    last: list[tuple[str, SecondMoment]] = field(default_factory=list)


def _survey_original(
    run: _Prune,
    inputs: LayerInputs,
    h: _Sensitivity,
    survey: _Survey,
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

    _survey(run, inputs, observe)
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


@dataclass
class _Walked:
    walk: _Walk
    reader: torch.Tensor
    """What reads the last site's stream: the head's input basis (or reader map)."""
    head_moment: torch.Tensor | None
    pool: GlobalPool | None
    """Global layout, nothing loaded: every site's statistics as the sliced model made them."""


def _walk_sites(
    run: _Prune,
    inputs: LayerInputs,
    h: _Sensitivity,
    chooser: SiteChooser,
    widths: Mapping[str, int],
    saved: Mapping[str, SavedSite],
    survey: _Survey,
    pooling: str,
    output: WrittenModel | None = None,
    pool_walked: bool = False,
) -> _Walked:
    """ "layer i/n": the embedding's basis, then every layer's sites in stream order, each chosen
    (or loaded) on the stream as the already sliced sites make it, and absorbed at once."""
    model, family, device, report, ids, one_basis = (
        run.model,
        run.family,
        run.device,
        run.report,
        run.ids,
        run.one_basis,
    )
    num_layers = model.config.num_hidden_layers
    walk = _Walk(
        inputs,
        device,
        chooser,
        widths,
        saved,
        run.checkpoint,
        run.correct_readers,
        run.shared,
        {ids[-1]: EMBEDDING} if run.tie_head else {},
        run.ranks,
        bases_on_disk=output is not None,
    )
    report(f"layer 0/{num_layers}: the embedding", 0, num_layers)
    first = walk.advance(EMBEDDING, None, 0)
    last = survey.last
    basis, previous = walk.settle(
        EMBEDDING, first, (lambda: last) if last else None, survey.pool.pooled if survey.pool is not None else None
    )
    survey.pool, survey.last, last = None, [], []  # chosen: the d × d sums are not held through the walk
    head_moment: torch.Tensor | None = None
    # the sites as the sliced model sees them (`WalkOptions.pool_walked`)
    walked = GlobalPool(pooling) if one_basis and not saved and pool_walked else None
    if walked is not None and first is not None:
        walked.add(EMBEDDING, first.value(), first.tokens, h.at(EMBEDDING))
    apply_embedding_basis(model, family, basis)
    del first, basis  # a d × d float64 sum and the embedding's basis: not held through the walk
    for index, layer in visit_layers(model, family, device):
        report(f"layer {index + 1}/{num_layers}", index, num_layers)
        assert isinstance(layer, SlicedDecoderLayer)
        sites = list(zip(layer.sites(family), layer_site_ids(family, index)))
        for position, (site, name) in enumerate(sites):
            open_site(layer, family, site, previous)
            ahead = next(((n, s.block) for s, n in sites[position + 1 : position + 2] if n in walk.shared), None)
            pooled = (
                None
                if ahead is None
                else (lambda ahead=ahead, index=index: [(ahead[0], walk.look_ahead(ahead[1], index))])
            )
            moment = walk.advance(name, site.block, index, measure=one_basis and name == ids[-1])
            if walked is not None and moment is not None:
                walked.add(name, moment.value(), moment.tokens, h.at(name))
            if one_basis and name == ids[-1]:
                assert moment is not None
                head_moment = moment.value().to("cpu")
            chosen, reader = walk.settle(name, moment, pooled)
            del moment  # not held while the next site is measured
            close_site(layer, family, site, previous, chosen, name in walk.shared)
            previous = reader
        if output is not None:
            output.write_layer(index, layer)
    report(f"layer {num_layers}/{num_layers}", num_layers, num_layers)
    return _Walked(walk, previous, head_moment, walked)


def _output(run: _Prune, widths: Mapping[str, int], options: WalkOptions) -> WrittenModel | None:
    """Where the walk writes the sliced model as it goes (`options.write_to`), laid out now that
    every width is known."""
    if options.write_to is None:
        return None
    checkpoint = run.checkpoint
    return WrittenModel(
        options.write_to,
        run.model,
        run.family,
        slicing_config(run.model, run.family, widths, run.shared, run.tie_head),
        progress=checkpoint.written_record if checkpoint is not None else None,
        max_shard_size=options.max_shard_size,
        writes=run.ranks.rank == 0,
        stock=StockTarget(run.layout.config, run.layout.tie_head) if run.one_basis else None,
    )


def _attach_head(run: _Prune, widths: Mapping[str, int], reader: torch.Tensor) -> dict[str, Any]:
    """The head reads the last site's kept coordinates (or stays tied to the sliced embedding);
    returns the sliced model's `slicing` config, taken before the head changes (its bias)."""
    model, family = run.model, run.family
    slicing = slicing_config(model, family, widths, run.shared, run.tie_head)
    if run.tie_head:
        apply_tied_head(model, family, reader)
    else:
        apply_head_basis(model, family, reader)
    return slicing


def _survey(run: _Prune, inputs: LayerInputs, observe: Callable[[str, SecondMoment], None]) -> None:
    """Run the fused, unsliced model over the calibration windows, handing each site's C to
    `observe` (the allocator's curves; a tied head's last site). The stored activations end at
    the last layer."""
    model, family, device, report = run.model, run.family, run.device, run.report
    survey = _Walk(inputs, device, None, {}, {}, None, ranks=run.ranks)
    num_layers = model.config.num_hidden_layers

    def seen(site: str, moment: SecondMoment | None) -> None:
        assert moment is not None
        observe(site, moment)

    seen(EMBEDDING, survey.advance(EMBEDDING, None, 0))
    for index, layer in visit_layers(model, family, device, read_only=True):
        report(f"surveying the original model: layer {index + 1}/{num_layers}", index, num_layers)
        for site, name in zip(layer.sites(family), layer_site_ids(family, index)):
            seen(name, survey.advance(name, site.block, index))
