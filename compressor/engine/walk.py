"""The engine: fuse norms, then choose, rotate and slice one residual-stream site at a time.

Sites (see `compressor.models.sites`) are visited in stream order. Each site's basis is chosen from
activations of the model whose earlier sites are already sliced, so errors propagate forward
as in SliceGPT. Activations stay on the host and visit the device one batch at a time; the
device holds one layer. After each site the chosen basis goes to the checkpoint, so a killed
run replays finished sites (forward only, bases loaded) and continues. The engine asks the
pipeline's strategies for a basis and knows nothing else about them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel

from compressor import faults
from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore
from compressor.engine.bases import (
    apply_embedding_basis,
    apply_head_basis,
    apply_tied_head,
    as_sliced_model,
    close_site,
    open_site,
    slicing_config,
)
from compressor.engine.calibration import LayerInputs, capture_layer_inputs
from compressor.engine.checkpoint import SavedSite
from compressor.engine.layerwise import visit_layers
from compressor.engine.parallel import Ranks
from compressor.engine.pooling import (
    GlobalPool,
    PipelineStep,
    SiteChooser,
    required_statistics,
)
from compressor.engine.sensitivity import Sensitivity, SensitivitySource, estimate_sensitivity
from compressor.engine.site_walk import SitePlan, SiteWalk
from compressor.engine.survey import Survey, survey_key, survey_original
from compressor.engine.transforms import fuse_norms
from compressor.engine.walk_options import PruneCall, PruneResult, WalkOptions, check_model
from compressor.engine.written import StockTarget, WriteOptions, WrittenModel
from compressor.models.layout import SlicedLayout
from compressor.models.sites import EMBEDDING, layer_site_ids
from compressor.models.sliced import SlicedDecoderLayer
from compressor.models.stock import head_stream


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
    run, local, skipped = _start(model, layout, batches, options)
    plan = _plan(run, pipeline, options)
    run.report("fusing norms", 0, model.config.num_hidden_layers)
    fuse_norms(model, layout.family)
    with _Activations(run, options, local) as activations:  # "capturing layer inputs"
        inputs = activations.capture()
        tokens_by_rank = run.ranks.gather_counts(sum(inputs.token_counts), run.device)
        faults.reached("capture")
        h = _sensitivity(run, inputs, plan, options, skipped)
        del inputs  # a survey captures them again (`activations.inputs`): not held through the walk
        survey, plan = _survey(run, activations, h, plan, options, tokens_by_rank)
        chooser = SiteChooser(pipeline, run.ids, h.values, run.report)
        output = _output(run, plan.kept, options)
        walk = _site_walk(run, activations.inputs, chooser, plan, output)
        walked = _walk_sites(run, walk, h, survey, output, options)
    return _result(run, plan, h, walked, output, tokens_by_rank)


# The phases of `prune`, in order; each is named as the progress line that announces it.


def _start(
    model: PreTrainedModel, layout: SlicedLayout, batches: list[Batch], options: WalkOptions
) -> tuple[PruneCall, list[Batch], list[list[int]]]:
    """What the phases share (`PruneCall`), this rank's batches and, before each, the rows of the
    other ranks' batches whose label draws it skips; the layout checked against the model, which
    is put in eval mode without gradients."""
    device = torch.device(options.device)
    ranks = options.ranks or Ranks.current()
    local = ranks.share(batches)
    skipped = ranks.skipped_rows([batch.input_ids.numel() for batch in batches])  # other ranks' label draws
    report = options.progress or (lambda *_: None)
    run = PruneCall(
        model,
        layout,
        device,
        report,
        ranks,
        options.checkpoint,
        tie_head=layout.tie_head and not layout.one_basis,  # a global layout's tie is the stock export's
        correct_readers=options.correct_readers,
    )
    check_model(run)
    model.eval()
    model.requires_grad_(False)
    return run, local, skipped


@dataclass(frozen=True)
class _Plan:
    """Where the walk's widths come from, and what it resumes: the layout's widths, or those an
    allocator chose in an earlier, killed run (with its record), or None (the survey's allocator
    chooses them); the statistics the pipeline and the allocator need; the finished sites."""

    widths: Mapping[str, int] | None
    allocation: dict[str, Any] | None
    needed: set[str]
    saved: Mapping[str, SavedSite]

    @property
    def kept(self) -> Mapping[str, int]:
        """The widths, once given, loaded or allocated (from the survey on)."""
        assert self.widths is not None
        return self.widths


def _plan(run: PruneCall, pipeline: Sequence[PipelineStep], options: WalkOptions) -> _Plan:
    """The widths given or checkpointed, the statistics needed, and the sites already finished."""
    allocator, checkpoint = options.allocator, run.checkpoint
    widths = run.layout.widths
    if widths is None and allocator is None:
        raise ValueError("a layout without widths needs an allocator to choose them")
    allocation = checkpoint.load_allocation() if checkpoint is not None and widths is None else None
    if allocation is not None:
        widths = allocation["widths"]
    needed = required_statistics(pipeline) | (
        set(allocator.requires) if widths is None and allocator is not None else set()
    )
    saved = checkpoint.finished_sites() if checkpoint is not None else {}
    return _Plan(widths, allocation, needed, saved)


class _Activations:
    """ "capturing layer inputs": the call's calibration activations, on the host (or on disk),
    captured, captured again after a survey pass has moved them down the model, and closed
    however the call ends (a context manager)."""

    def __init__(self, run: PruneCall, options: WalkOptions, batches: list[Batch]) -> None:
        self.run, self.options, self.batches = run, options, batches
        run.report("capturing layer inputs", 0, run.model.config.num_hidden_layers)
        self.store = ActivationStore(run.device, options.offload, options.scratch)
        self.inputs: LayerInputs
        """The activations as last captured."""

    def __enter__(self) -> _Activations:
        return self

    def __exit__(self, *exception: object) -> None:
        self.store.close()

    def capture(self) -> LayerInputs:
        """What the first layer receives of this rank's batches, in the store."""
        run = self.run
        self.inputs = capture_layer_inputs(run.model, run.family, self.batches, run.device, self.store)
        return self.inputs

    def recapture(self) -> LayerInputs:
        """The activations captured again in a new store, the old one closed first."""
        self.store.close()
        self.store = ActivationStore(self.run.device, self.options.offload, self.options.scratch)
        return self.capture()


def _sensitivity(
    run: PruneCall, inputs: LayerInputs, plan: _Plan, options: WalkOptions, skipped: list[list[int]]
) -> Sensitivity:
    """H, where a strategy or the allocator needs it and some site is still to be chosen (or the
    widths to be allocated): given, loaded or estimated (`estimate_sensitivity`); else none."""
    h = Sensitivity(run.device)
    if "H" in plan.needed and (len(plan.saved) < len(run.ids) or plan.widths is None):
        source = SensitivitySource(
            options.fisher, options.sensitivity, options.seed, on_disk=options.write_to is not None
        )
        h = estimate_sensitivity(run, inputs, source, skipped)
    return h


def _survey(
    run: PruneCall,
    activations: _Activations,
    h: Sensitivity,
    plan: _Plan,
    options: WalkOptions,
    tokens_by_rank: list[int],
) -> tuple[Survey, _Plan]:
    """The survey of the original model where the walk needs one (a global layout's pool or a tied
    head's last site, unless the checkpoint holds the embedding's choice; an allocator's widths):
    recalled from `options.survey`, or run (`survey_original`) and the activations captured again.
    Returns it, and the plan with the widths and allocation settled."""
    widths, allocation, saved = plan.widths, plan.allocation, plan.saved
    survey = Survey(GlobalPool(options.pooling) if run.one_basis and EMBEDDING not in saved else None)
    tied_choice = run.tie_head and EMBEDDING not in saved
    memo_key = survey_key(run, options.pooling, tokens_by_rank)
    # a survey of given widths can be recalled and kept; an allocator's widths are its own
    memo = options.survey if widths is not None and (tied_choice or survey.pool is not None) else None
    recalled = memo.recall(memo_key) if memo is not None else None
    if recalled is not None:  # the same statistics an earlier walk's survey pass measured
        survey = Survey(recalled.pool if survey.pool is not None else None, recalled.last if tied_choice else [])
    elif widths is None or tied_choice or survey.pool is not None:
        widths, chosen = survey_original(run, activations.inputs, h, survey, widths, options.allocator)
        if memo is not None:
            memo.keep(memo_key, survey)
        allocation = chosen or allocation  # widths from the checkpoint keep the record saved with them
        activations.recapture()  # the survey moved the activations down the model: start again
    return survey, replace(plan, widths=widths, allocation=allocation)


def _site_walk(
    run: PruneCall, inputs: LayerInputs, chooser: SiteChooser, plan: _Plan, output: WrittenModel | None
) -> SiteWalk:
    """The walk's state over the captured activations: the pipeline chooses every site not yet
    finished, but a shared site and a tied head (the last site keeps the embedding's basis);
    a walk that writes as it goes leaves its bases in the checkpoint's files."""
    site_plan = SitePlan(
        chooser,
        plan.kept,
        plan.saved,
        run.checkpoint,
        run.correct_readers,
        run.shared,
        {run.ids[-1]: EMBEDDING} if run.tie_head else {},
        bases_on_disk=output is not None,
    )
    return SiteWalk(inputs, run.device, site_plan, run.ranks)


@dataclass
class _Walked:
    """The walk's state between its sites, and what it leaves for the head and the result."""

    walk: SiteWalk
    reader: torch.Tensor
    """What reads the last site's stream so far: the next site's input basis (or reader map), at
    the end the head's."""
    head_moment: torch.Tensor | None
    pool: GlobalPool | None
    """Global layout, nothing loaded: every site's statistics as the sliced model made them."""


def _walk_sites(
    run: PruneCall,
    walk: SiteWalk,
    h: Sensitivity,
    survey: Survey,
    output: WrittenModel | None,
    options: WalkOptions,
) -> _Walked:
    """ "layer i/n": the embedding's basis, then every layer's sites in stream order, each chosen
    (or loaded) on the stream as the already sliced sites make it, and absorbed at once; each
    finished layer written (`output`)."""
    num_layers = run.model.config.num_hidden_layers
    run.report(f"layer 0/{num_layers}: the embedding", 0, num_layers)
    walked = _walk_embedding(run, walk, h, survey, options)
    for index, layer in visit_layers(run.model, run.family, run.device):
        run.report(f"layer {index + 1}/{num_layers}", index, num_layers)
        assert isinstance(layer, SlicedDecoderLayer)
        _walk_layer(run, walked, layer, index, h)
        if output is not None:
            output.write_layer(index, layer)
    run.report(f"layer {num_layers}/{num_layers}", num_layers, num_layers)
    return walked


def _walk_embedding(run: PruneCall, walk: SiteWalk, h: Sensitivity, survey: Survey, options: WalkOptions) -> _Walked:
    """The embedding's basis, chosen (with a tied head's last site, or a global layout's pooled
    survey) or loaded, and applied; the survey's sums are dropped then, not held through the walk."""
    first = walk.advance(EMBEDDING, None, 0)
    last = survey.last
    basis, previous = walk.settle(
        EMBEDDING, first, (lambda: last) if last else None, survey.pool.pooled if survey.pool is not None else None
    )
    survey.pool, survey.last, last = None, [], []  # chosen: the d × d sums are not held through the walk
    # the sites as the sliced model sees them (`WalkOptions.pool_walked`)
    pool = GlobalPool(options.pooling) if run.one_basis and not walk.saved and options.pool_walked else None
    if pool is not None and first is not None:
        pool.add(EMBEDDING, first.value(), first.tokens, h.at(EMBEDDING))
    apply_embedding_basis(run.model, run.family, basis)
    return _Walked(walk, previous, None, pool)


def _walk_layer(run: PruneCall, walked: _Walked, layer: SlicedDecoderLayer, index: int, h: Sensitivity) -> None:
    """Layer `index`'s sites in stream order: each opened on what reads the previous site, its C
    measured on the stream (with the next site's, unsliced, where that one keeps this basis),
    its basis settled, and closed."""
    walk, family, last_site = walked.walk, run.family, run.ids[-1]
    sites = list(zip(layer.sites(family), layer_site_ids(family, index)))
    for position, (site, name) in enumerate(sites):
        open_site(layer, family, site, walked.reader)
        ahead = next(((n, s.block) for s, n in sites[position + 1 : position + 2] if n in walk.shared), None)
        pooled = (
            None if ahead is None else (lambda ahead=ahead, index=index: [(ahead[0], walk.look_ahead(ahead[1], index))])
        )
        moment = walk.advance(name, site.block, index, measure=run.one_basis and name == last_site)
        if walked.pool is not None and moment is not None:
            walked.pool.add(name, moment.value(), moment.tokens, h.at(name))
        if run.one_basis and name == last_site:
            assert moment is not None
            walked.head_moment = moment.value().to("cpu")
        chosen, reader = walk.settle(name, moment, pooled)
        del moment  # not held while the next site is measured
        close_site(layer, family, site, walked.reader, chosen, name in walk.shared)
        walked.reader = reader


def _result(
    run: PruneCall,
    plan: _Plan,
    h: Sensitivity,
    walked: _Walked,
    output: WrittenModel | None,
    tokens_by_rank: list[int],
) -> PruneResult:
    """The head attached, the model finished (written, or as a `sliced_*` model), and what the
    call did."""
    pruned, slicing = _finish(run, plan.kept, walked, output)
    walk = walked.walk
    return PruneResult(
        model=pruned,
        sites=walk.records,
        slicing=slicing,
        bases=walk.bases,
        readers=walk.readers if run.correct_readers else None,
        resumed_from=walk.resumed_from,
        loaded_sites=len(plan.saved),
        fisher_loaded=h.loaded,
        fisher=h.values,
        fisher_source=h.source,
        widths=dict(plan.kept),
        allocation=plan.allocation,
        tokens_by_rank=tokens_by_rank,
        head_moment=walked.head_moment,
        fisher_seconds=h.seconds,
        written_before=output.written_before if output is not None else 0,
        stock=output.record if output is not None else None,
        walked=walked.pool.pooled() if walked.pool is not None and walked.pool.names == run.ids else None,
    )


def _finish(
    run: PruneCall, widths: Mapping[str, int], walked: _Walked, output: WrittenModel | None
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """The head attached (`_attach_head`), then the sliced model and its `slicing` config: the
    written one (`output`, a stock tied head fitted on the last site's C), or the one in memory."""
    slicing = _attach_head(run, widths, walked.reader)
    if output is None:
        return as_sliced_model(run.model, run.family, slicing), slicing
    assert output.slicing == slicing, "the written shards were laid out for another slicing"
    stream = (
        head_stream(walked.head_moment, walked.walk.bases[EMBEDDING])
        if output.stock is not None and output.stock.tie
        else None
    )
    return output.finish(run.model, stream), slicing


def _output(run: PruneCall, widths: Mapping[str, int], options: WalkOptions) -> WrittenModel | None:
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
        WriteOptions(
            progress=checkpoint.written_record if checkpoint is not None else None,
            max_shard_size=options.max_shard_size,
            writes=run.ranks.rank == 0,
            stock=StockTarget(run.layout.config, run.layout.tie_head) if run.one_basis else None,
        ),
    )


def _attach_head(run: PruneCall, widths: Mapping[str, int], reader: torch.Tensor) -> dict[str, Any]:
    """The head reads the last site's kept coordinates (or stays tied to the sliced embedding);
    returns the sliced model's `slicing` config, taken before the head changes (its bias)."""
    model, family = run.model, run.family
    slicing = slicing_config(model, family, widths, run.shared, run.tie_head)
    if run.tie_head:
        apply_tied_head(model, family, reader)
    else:
        apply_head_basis(model, family, reader)
    return slicing
