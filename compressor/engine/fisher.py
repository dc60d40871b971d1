"""Output-sensitivity statistics: H = E[g gᵀ], the Fisher of the output KL with respect to the
residual activation at every pruning site, from labels sampled from the model itself.

For each calibration batch: one forward pass of the (fused, still unsliced) model, one label
sampled per counted position from the model's own predictive distribution, the sampled
log-probabilities summed (or averaged) over the counted positions, and **one** backward pass.
The gradient at token i then sums the score of every later output it influences; since the
labels are independent given the input, E[g gᵀ] is exactly the Fisher of the joint output
distribution with respect to x_i (cross terms vanish in expectation). No parameter gradient is
kept: weights are frozen and only the stream requires a gradient.

The pass runs layer by layer so that the device never holds more than one layer (and the head):
forward through each layer for a chunk of batches, keeping every layer's input on the host;
then the head samples labels and scores them; then backward one layer at a time, recomputing
the layer from its stored input (on an accelerator) or reusing its kept graph (on CPU, where
the device is the host) and carrying the gradient with respect to the stream down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from compressor.engine.activations import held_on, to_host
from compressor.engine.calibration import LayerInputs, counted_rows
from compressor.engine.layerwise import decoder_layers, visit_layers
from compressor.engine.parallel import Ranks
from compressor.models.families import ModelFamily
from compressor.models.sites import layer_site_ids, site_ids
from compressor.recipe.sections.sensitivity import ACCUMULATION_DTYPES, AUTOCAST_DTYPES, REDUCTIONS, SensitivityOptions

__all__ = [
    "ACCUMULATION_DTYPES",
    "AUTOCAST_DTYPES",
    "FisherCall",
    "HeadOptions",
    "REDUCTIONS",
    "SensitivityOptions",
    "estimate_fisher",
    "site_activations",
]

SiteEdit = Callable[[int, torch.Tensor], torch.Tensor]
"""(site index, residual stream) → the stream the rest of the model sees (for diagnostics)."""


@dataclass(frozen=True)
class HeadOptions:
    """How `site_activations` makes the logits where the model's own head is not the one wanted."""

    before_cap: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Maps the head's output (`ModelFamily.logits`)."""
    head: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Replaces the model's own head (the final stream → logits: a stock model's tied head,
    `refine.StockTiedHead`)."""


def site_activations(
    model: PreTrainedModel,
    family: ModelFamily,
    inputs: LayerInputs,
    batch: int,
    edit: SiteEdit | None = None,
    head: HeadOptions = HeadOptions(),
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Forward one captured batch through the whole fused model (a diagnostic: the model must fit
    where it is); return the residual stream at every site, in `site_ids` order, and the logits.
    `edit`, if given, replaces the stream at each site (e.g. to measure the KL of a perturbation);
    `head` changes how the final stream becomes logits (`HeadOptions`)."""
    device = model.get_submodule(family.head).weight.device
    hidden = inputs.hidden.get(batch, device).detach().requires_grad_(edit is None)
    sites = [hidden]

    def visit(stream: torch.Tensor) -> torch.Tensor:
        return stream if edit is None else edit(len(sites) - 1, stream)

    hidden = visit(hidden)
    for i, layer in enumerate(model.get_submodule(family.layers)):
        kwargs = inputs.kwargs(batch, i, device)
        for site in layer.sites(family):
            hidden = site.block(hidden, **kwargs)
            sites.append(hidden)
            hidden = visit(hidden)
    return sites, family.logits(model, hidden, head.before_cap, head.head)


def _uniform_draws(rows: int, generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """One uniform draw per row: all the randomness a batch's labels take (skipping another
    rank's batch makes exactly this call, so the generator stays where one process has it)."""
    return torch.rand(rows, 1, generator=generator, device=like.device, dtype=like.dtype)


def sample_labels(probs: torch.Tensor, generator: torch.Generator, block: int = 128) -> torch.Tensor:
    """One label per row of `probs` (rows summing to 1), by inverse-CDF sampling in two levels.

    A row's CDF is searched first over block sums, then inside the chosen block: the same draw
    as a search of the full CDF (up to rounding), without a sequential scan of the whole
    vocabulary, which costs more than the softmax itself at LLM vocabulary sizes.
    """
    rows, vocab = probs.shape
    whole = vocab // block * block
    sums = probs[:, :whole].view(rows, -1, block).sum(-1)
    if whole < vocab:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True)], dim=-1)
    block_cdf = sums.cumsum(-1)
    draws = _uniform_draws(rows, generator, probs) * block_cdf[:, -1:]
    chosen = torch.searchsorted(block_cdf, draws).clamp_max(sums.shape[-1] - 1)
    before = torch.nn.functional.pad(block_cdf[:, :-1], (1, 0))  # the CDF where each block starts
    offset = draws - before.gather(-1, chosen)
    columns = chosen * block + torch.arange(block, device=probs.device)
    inside = probs.gather(-1, columns.clamp_max(vocab - 1)).masked_fill_(columns >= vocab, 0)
    within = torch.searchsorted(inside.cumsum(-1), offset).clamp_max(block - 1)
    return (chosen * block + within).clamp_max(vocab - 1).view(-1)


def sampled_score(
    logits: torch.Tensor,
    mask: torch.Tensor,
    generator: torch.Generator,
    reduction: str,
    skipped: Sequence[int] = (),
) -> torch.Tensor:
    """∂/∂logits of Σ (or mean) over counted positions of log p(y_t), y_t ~ p(· | prefix).

    That gradient is mask·(onehot(y) − p), so it is formed directly and in place: one softmax
    serves both the sampling and the gradient, and no log-softmax graph is built. `skipped`
    gives the rows of batches scored elsewhere (other ranks) since the last call: their draws
    are made and discarded first, so every batch gets the labels a single process gives it.
    """
    flat = logits.detach().reshape(-1, logits.shape[-1])
    probs = torch.softmax(flat, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    for rows in skipped:  # one call per batch, as sample_labels draws (a GPU generator's offset rounds per call)
        _uniform_draws(rows, generator, probs)
    labels = sample_labels(probs, generator)
    weight = mask.reshape(-1, 1).to(probs.dtype)
    if reduction == "mean":
        weight = weight / weight.sum().clamp_min(1)
    score = probs.mul_(weight.neg()).scatter_add_(-1, labels.unsqueeze(-1), weight)
    return score.view(logits.shape).to(logits.dtype)


def _chunks(inputs: LayerInputs, samples: int) -> list[range]:
    """Consecutive batches grouped so a group holds about `samples` sequences (at least one batch)."""
    groups, start, rows = [], 0, 0
    for index, mask in enumerate(inputs.token_masks):
        if index > start and rows + mask.shape[0] > samples:
            groups.append(range(start, index))
            start, rows = index, 0
        rows += mask.shape[0]
    if len(inputs):
        groups.append(range(start, len(inputs)))
    return groups


def native_bfloat16(device: torch.device) -> bool:
    """Whether `device` computes bfloat16 in hardware: a CUDA GPU that supports it, or a CPU with
    AVX512-BF16 or AMX tiles (elsewhere torch emulates it, several times slower than float32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def autocast_dtype(setting: str | None, device: torch.device) -> torch.dtype | None:
    """`sensitivity.autocast` on `device`: None (full precision), a dtype, or for `auto`
    bfloat16 where it is native and None elsewhere."""
    if setting == "auto":
        return torch.bfloat16 if native_bfloat16(device) else None
    return getattr(torch, setting) if setting else None


@dataclass(frozen=True)
class FisherCall:
    """How one process takes part in the H pass beyond the model, data and seed: who hears its
    progress, and, data-parallel, its ranks and the label draws of the other ranks' batches."""

    progress: Callable[[int, int], None] | None = None
    """Hears (chunks done, chunks in all) as the pass goes."""
    ranks: Ranks | None = None
    """Data-parallel: `inputs` holds this rank's batches, and the sums and token counts are added
    over the ranks, so every rank returns the H a single process computes over all batches (up to
    the order of the sums)."""
    skipped: Sequence[Sequence[int]] = ()
    """Data-parallel: `skipped[b]`, the rows of the other ranks' batches that come before this
    rank's batch b (their label draws are skipped)."""


def estimate_fisher(
    model: PreTrainedModel,
    family: ModelFamily,
    inputs: LayerInputs,
    options: SensitivityOptions,
    device: torch.device,
    seed: int = 0,
    call: FisherCall = FisherCall(),
) -> dict[str, torch.Tensor]:
    """H for each site (keyed by site id; d × d in the accumulation dtype, on the host), averaged
    over counted tokens. Labels are drawn from a generator on `device` seeded with `seed`, batch
    by batch in order, so the result does not depend on how batches are chunked or whether
    layers are recomputed (a CPU and a GPU generator draw different labels). `call`: the
    progress, and a data-parallel rank's share (`FisherCall`).

    `inputs` are the captured inputs of the fused, unsliced model; counted positions are those of
    `inputs.sensitivity_masks` (for chat data, the positions that predict an assistant token;
    all real tokens otherwise). Their outputs make up the sampled objective, and their gradients
    are accumulated. With `reduction: mean` each batch's objective is divided by its own count.
    """
    h = _HPass(model, family, inputs, device, options, _Labels(seed, call.skipped))
    progress = call.progress
    # Chunks exist to make layer moves rare; where the device is the host there are none to save,
    # and one batch at a time keeps the kept graphs (and memory traffic) small.
    chunks = _chunks(inputs, options.chunk if h.recompute else 1)
    if progress is not None:
        progress(0, len(chunks))
    for done, chunk in enumerate(chunks):
        stream, graphs = h.down(chunk)
        grads = h.at_the_head(chunk, stream.pop())
        h.up(chunk, stream, graphs, grads)
        if progress is not None:
            progress(done + 1, len(chunks))
    ranks = call.ranks or Ranks()
    if ranks.world > 1:
        for total in h.totals.values():  # one site at a time: NCCL sums on the device
            total.copy_(ranks.sum_(total.to(device)))
        h.tokens = ranks.sum_count(h.tokens, device)
    if h.tokens == 0:
        raise ValueError("no tokens were counted for the sensitivity statistics (empty sensitivity mask)")
    return {site: total / h.tokens for site, total in h.totals.items()}


Graphs = list[list[tuple[torch.Tensor, list[torch.Tensor]] | None]]
"""Per layer, per batch of a chunk: the layer's input and its sites' outputs with their autograd
graph (kept when layers are not recomputed going back up)."""


@dataclass(frozen=True)
class _Labels:
    """What the H pass's label draws depend on besides the data: the seed of their generator, and
    the rows of other ranks' batches whose draws it skips (`FisherCall.skipped`)."""

    seed: int
    skipped: Sequence[Sequence[int]]


class _HPass:
    """The H pass's state over one call: the model, the captured inputs, the label generator, the
    running Σ g·gᵀ by site and the counted tokens. Each chunk of batches goes `down` the layers,
    gets its labels sampled `at_the_head`, and comes back `up` carrying ∂/∂stream."""

    def __init__(
        self,
        model: PreTrainedModel,
        family: ModelFamily,
        inputs: LayerInputs,
        device: torch.device,
        options: SensitivityOptions,
        labels: _Labels,
    ) -> None:
        self.model, self.family, self.inputs, self.device = model, family, inputs, device
        recompute = options.recompute if options.recompute is not None else device.type != "cpu"
        self.options, self.recompute, self.skipped = options, recompute, labels.skipped
        self.lowered = autocast_dtype(options.autocast, device)
        self.generator = torch.Generator(device=device).manual_seed(labels.seed)
        d = model.config.hidden_size
        self.ids = site_ids(family, len(decoder_layers(model, family)))
        dtype = getattr(torch, options.dtype)
        self.totals = {site: torch.zeros(d, d, dtype=dtype) for site in self.ids}
        self.tokens = 0

    def precision(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=self.lowered) if self.lowered is not None else nullcontext()

    def run_layer(self, layer: Any, index: int, hidden: torch.Tensor, batch: int) -> list[torch.Tensor]:
        """The stream after each of the layer's sites."""
        outputs, kwargs = [], self.inputs.kwargs(batch, index, self.device)
        for block in layer.sites(self.family):
            hidden = block.block(hidden, **kwargs)
            outputs.append(hidden)
        return outputs

    def down(self, chunk: range) -> tuple[list[list[torch.Tensor]], Graphs]:
        """Forward: every layer's input, for every batch of the chunk, kept on the host (and the
        graphs, when layers are not recomputed); the last entry is the final stream."""
        stream = [[self.inputs.hidden.host(b) for b in chunk]]
        graphs: Graphs = []
        for index, layer in visit_layers(self.model, self.family, self.device, read_only=True):
            outputs, kept = [], []
            with torch.set_grad_enabled(not self.recompute), self.precision():
                for k, batch in enumerate(chunk):
                    x = stream[index][k].to(self.device, non_blocking=True).detach().requires_grad_(not self.recompute)
                    sites = self.run_layer(layer, index, x, batch)
                    kept.append(None if self.recompute else (x, sites))
                    outputs.append(to_host(sites[-1]))
            stream.append(outputs)
            graphs.append(kept)
        return stream, graphs

    def at_the_head(self, chunk: range, final: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sample labels from the model's own logits, form the score, and take its gradient with
        respect to the last site's stream (accumulated there); returns it per batch, on the host."""
        inputs, device, last = self.inputs, self.device, self.ids[-1]
        grads = []
        visiting = held_on(self.family.head_modules(self.model), device, read_only=True)
        with visiting, _accumulators(self.totals, [last], device) as acc:
            for k, batch in enumerate(chunk):
                mask = inputs.sensitivity_masks[batch].to(device)
                x = final[k].to(device).detach().requires_grad_()
                with torch.enable_grad(), self.precision():
                    logits = self.family.logits(self.model, x)
                    skipped = self.skipped[batch] if self.skipped else ()
                    score = sampled_score(logits, mask, self.generator, self.options.reduction, skipped)
                    (grad,) = torch.autograd.grad(logits, [x], score)
                count = inputs.sensitivity_counts[batch]
                acc.add(last, grad, mask, count)
                grads.append(to_host(grad))
                self.tokens += count
        return grads

    def up(self, chunk: range, stream: list[list[torch.Tensor]], graphs: Graphs, grads: list[torch.Tensor]) -> None:
        """Backward, one layer at a time, carrying the gradient with respect to the stream down
        and accumulating it at every site the layer writes and the one it reads."""
        inputs, device, ids = self.inputs, self.device, self.ids
        for index, layer in visit_layers(self.model, self.family, device, read_only=True, reverse=True):
            own = layer_site_ids(self.family, index)
            below = ids[ids.index(own[0]) - 1]  # the site this layer reads
            with _accumulators(self.totals, [*own[:-1], below], device) as acc:
                for k, batch in enumerate(chunk):
                    mask = inputs.sensitivity_masks[batch].to(device)
                    with torch.enable_grad(), self.precision():
                        if self.recompute:
                            x = stream[index][k].to(device, non_blocking=True).detach().requires_grad_()
                            sites = self.run_layer(layer, index, x, batch)
                        else:
                            x, sites = graphs[index][k]  # type: ignore[misc]
                            graphs[index][k] = None  # the graph is freed once used
                        # only the stream's gradients: never the weights', whatever their requires_grad
                        *inner, grad = torch.autograd.grad(
                            sites[-1], [*sites[:-1], x], grads[k].to(device, non_blocking=True)
                        )
                    count = inputs.sensitivity_counts[batch]
                    for site, tensor in zip(own[:-1], inner):
                        acc.add(site, tensor, mask, count)
                    acc.add(below, grad, mask, count)
                    grads[k] = to_host(grad)
            stream.pop()


class _Accumulator:
    """Running Σ g·gᵀ over counted positions for a few sites, on the device."""

    def __init__(self, totals: dict[str, torch.Tensor]) -> None:
        self.totals = totals

    def add(self, site: str, grad: torch.Tensor, mask: torch.Tensor, count: int) -> None:
        total = self.totals[site]
        g = counted_rows(grad, mask, count).to(total.dtype)
        total.addmm_(g.T, g)


@contextmanager
def _accumulators(totals: dict[str, torch.Tensor], sites: list[str], device: torch.device) -> Iterator[_Accumulator]:
    """The totals of `sites` on `device` while one layer (or the head) is worked on; back on the host after."""
    held = {site: totals[site].to(device) for site in sites}
    yield _Accumulator(held)
    for site, total in held.items():
        if total is not totals[site]:
            totals[site].copy_(total)
