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
from dataclasses import dataclass
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
from compressor.engine.site_walk import SiteWalk
from compressor.engine.survey import Survey, survey_key, survey_original
from compressor.engine.transforms import fuse_norms
from compressor.engine.walk_options import PruneCall, PruneResult, WalkOptions, check_model
from compressor.engine.written import StockTarget, WrittenModel
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
    device = torch.device(options.device)
    allocator, checkpoint, fisher, progress = options.allocator, options.checkpoint, options.fisher, options.progress
    ranks = options.ranks or Ranks.current()
    local = ranks.share(batches)
    skipped = ranks.skipped_rows([batch.input_ids.numel() for batch in batches])  # other ranks' label draws
    report = progress or (lambda *_: None)
    run = PruneCall(
        model,
        layout,
        device,
        report,
        ranks,
        checkpoint,
        tie_head=layout.tie_head and not layout.one_basis,  # a global layout's tie is the stock export's
        correct_readers=options.correct_readers,
    )
    check_model(run)
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
        h = Sensitivity(device)
        if "H" in needed and (len(saved) < len(ids) or widths is None):
            source = SensitivitySource(fisher, options.sensitivity, options.seed, on_disk=options.write_to is not None)
            h = estimate_sensitivity(run, inputs, source, skipped)
        survey = Survey(GlobalPool(options.pooling) if layout.one_basis and EMBEDDING not in saved else None)
        tied_choice = run.tie_head and EMBEDDING not in saved
        memo_key = survey_key(run, options.pooling, tokens_by_rank)
        # a survey of given widths can be recalled and kept; an allocator's widths are its own
        memo = options.survey if widths is not None and (tied_choice or survey.pool is not None) else None
        recalled = memo.recall(memo_key) if memo is not None else None
        if recalled is not None:  # the same statistics an earlier walk's survey pass measured
            survey = Survey(recalled.pool if survey.pool is not None else None, recalled.last if tied_choice else [])
        elif widths is None or tied_choice or survey.pool is not None:
            widths, chosen = survey_original(run, inputs, h, survey, widths, allocator)
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


# The phases of `prune`, in order; each is named as the progress line that announces it.


@dataclass
class _Walked:
    walk: SiteWalk
    reader: torch.Tensor
    """What reads the last site's stream: the head's input basis (or reader map)."""
    head_moment: torch.Tensor | None
    pool: GlobalPool | None
    """Global layout, nothing loaded: every site's statistics as the sliced model made them."""


def _walk_sites(
    run: PruneCall,
    inputs: LayerInputs,
    h: Sensitivity,
    chooser: SiteChooser,
    widths: Mapping[str, int],
    saved: Mapping[str, SavedSite],
    survey: Survey,
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
    walk = SiteWalk(
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
        progress=checkpoint.written_record if checkpoint is not None else None,
        max_shard_size=options.max_shard_size,
        writes=run.ranks.rank == 0,
        stock=StockTarget(run.layout.config, run.layout.tie_head) if run.one_basis else None,
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
