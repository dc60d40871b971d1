"""Routed experts as a pruning axis: every Mixture-of-Experts layer keeps the same `keep` experts
(no stock loader takes a different count per layer), chosen by a selector (a plugin,
`strategies.expert_contract.ExpertSelector`) from what the calibration tokens did with each.

Layers are visited in stream order (`visit_layers`) on the model as already pruned before each
one, as the MLP stage visits them. At a layer, the MoE block's input x is taken over the counted
calibration tokens (a pre-hook on the `RoutedExperts` block while the whole layer runs); for
each token the block's own router gives its experts and weights, and each expert runs on the
tokens routed to it: the counts, REAP's weight·‖output‖ and the largest output coordinate follow.
A selector that requires "outputs" also gets, for up to `sample_tokens` tokens (every n-th counted
token, so the sample spans the calibration set), the router's probabilities over every expert and
the Gram matrix ⟨f_i, G f_j⟩ of every expert's output (every sampled token through every expert,
E/k times the block's own work on them), G the output sensitivity H of the stream the block
writes to where the run estimated it. Experts whose largest output coordinate is `super_ratio`
times the median routed expert's are protected (REAP's
super experts, which carry the model's massive activations). The router then loses the other
experts' rows (`RoutedExperts.keep_experts`), optionally refitted on the same sample
(`engine.router_refit`, `router_steps`), and the layer runs again, pruned, to give the next
layer its input. Nothing here is checkpointed: a run killed in this stage runs it again, to the
same experts (it is deterministic).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from compressor import faults
from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore
from compressor.engine.calibration import LayerPass, capture_layer_inputs, counted_rows
from compressor.engine.layerwise import decoder_layers, visit_layers
from compressor.engine.parallel import Ranks
from compressor.engine.router_refit import refit_router
from compressor.errors import UserError
from compressor.models.experts import RoutedExperts
from compressor.models.families import ModelFamily
from compressor.models.sliced import layer_mlp
from compressor.strategies.expert_contract import ExpertProblem, ExpertSelector
from compressor.strategies.units import checked_choice

Progress = Callable[[str, int, int], None]

OUTPUT_ELEMENTS = 1 << 25
"""An output-aware selector's sample runs through every expert this many output numbers (tokens ×
experts × width, float64) at a time: 256 MiB, whatever the model's experts and width."""


@dataclass
class ExpertRecord:
    """What happened at one MoE layer, for the report."""

    layer: int
    experts: int
    kept: list[int]
    selector: str
    tokens: list[int]
    """Routed (token, expert) pairs per expert, over the calibration tokens (every rank's)."""
    fewest_tokens: int
    """The fewest any expert saw: statistics of an expert rest on this many tokens."""
    protected: list[int] = field(default_factory=list)
    objectives: dict[str, Any] = field(default_factory=dict)
    router: dict[str, Any] | None = None
    """The router refit's held-out cost before and after, where the run refitted it (`engine.router_refit`)."""


class _ExpertMoments:
    """Per-expert sums over the counted tokens, and the sample an output-aware selector reads."""

    def __init__(
        self,
        experts: int,
        device: torch.device,
        sample: int,
        G: torch.Tensor | None,
        counted: int = 0,
        keep_inputs: bool = False,
    ) -> None:
        zeros = lambda: torch.zeros(experts, dtype=torch.float64, device=device)  # noqa: E731
        self.tokens, self.gate, self.reap_sum, self.peak = zeros(), zeros(), zeros(), zeros()
        self.sample, self.G = sample, G
        self.stride = max(1, -(-counted // sample)) if sample else 1
        """Every stride-th counted token is sampled, so the sample spans the calibration set."""
        self.keep_inputs = keep_inputs
        self.inputs: list[torch.Tensor] = []
        """The sampled tokens themselves (the router refit's), copied: a view would keep every batch alive."""
        self.probabilities: list[torch.Tensor] = []
        self.gram: list[torch.Tensor] = []
        self.sampled = 0
        self.seen = 0

    def add(self, block: RoutedExperts, x: torch.Tensor) -> None:
        """Tokens `x` (n × d, the counted ones) through the block's router and experts."""
        for index, token, weight in block.dispatch(x):
            out = block.experts[index](x[token]).to(torch.float64)
            gate = weight.to(torch.float64)
            self.tokens[index] += len(token)
            self.gate[index] += gate.sum()
            self.reap_sum[index] += (gate * out.norm(dim=-1)).sum()
            self.peak[index] = torch.maximum(self.peak[index], out.abs().max())
        offset = (-self.seen) % self.stride  # the first of these tokens that is a stride-th counted one
        self.seen += x.shape[0]
        picked = x[offset :: self.stride][: max(self.sample - self.sampled, 0)]
        take = picked.shape[0]
        chunk = max(1, OUTPUT_ELEMENTS // (len(block.experts) * block.experts[0].down_proj.out_features))
        for start in range(0, take, chunk):  # every expert's output on a chunk of tokens at a time
            part = picked[start : start + chunk]
            if self.keep_inputs:
                self.inputs.append(part.clone())
            logits = block.router(part).to(torch.float64)
            self.probabilities.append(torch.softmax(logits, dim=-1))
            outputs = torch.stack([expert(part).to(torch.float64) for expert in block.experts], dim=1)  # T × E × d
            weighed = outputs if self.G is None else outputs @ self.G
            self.gram.append(torch.einsum("ted,tfd->tef", weighed, outputs))
        self.sampled += take

    def sum_over(self, ranks: Ranks) -> _ExpertMoments:
        for total in (self.tokens, self.gate, self.reap_sum):
            ranks.sum_(total)
        ranks.max_(self.peak)
        return self


def protected_experts(
    peak: torch.Tensor, super_ratio: float | None, tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """Experts whose largest output coordinate is at least `super_ratio` times the median routed
    expert's (REAP's super experts; an expert no token chose has no peak to compare); none when
    `super_ratio` is None."""
    routed = peak if tokens is None else peak[tokens > 0]
    if super_ratio is None or routed.numel() == 0:
        return torch.zeros_like(peak, dtype=torch.bool)
    return peak >= super_ratio * routed.median().clamp_min(1e-30)


def moe_block(layer: nn.Module, family: ModelFamily) -> RoutedExperts | None:
    """The layer's routed-experts block (None: a dense layer, e.g. Qwen3-MoE's `mlp_only_layers`)."""
    mlp = layer_mlp(family, layer)
    return mlp if isinstance(mlp, RoutedExperts) else None


@dataclass(frozen=True)
class ExpertOptions:
    """How `prune_experts` chooses, and where it runs: its settings beside the model and what it
    keeps, in one object rather than a dozen keywords (defaults: the recipe's)."""

    selector: ExpertSelector
    device: torch.device | str = "cpu"
    super_ratio: float | None = 10.0
    """Experts whose largest output coordinate is this many times the median routed expert's are
    protected (REAP's super experts); None protects none."""
    sample_tokens: int = 2048
    """The output sample's tokens, for a selector that requires "outputs" (and the router refit)."""
    router_steps: int = 0
    """> 0: each pruned router is refitted on the output sample (`engine.router_refit`)."""
    sensitivity: Mapping[int, torch.Tensor] | None = None
    """G by layer index: H of the stream each block writes to, in the model's current coordinates."""
    progress: Progress | None = None
    store: ActivationStore | None = None
    ranks: Ranks | None = None
    """The data-parallel group (by default the initialised process group, if any)."""


@torch.no_grad()
def prune_experts(
    model: PreTrainedModel, family: ModelFamily, batches: list[Batch], keep: int, options: ExpertOptions
) -> list[ExpertRecord]:
    """Keep `keep` routed experts in every MoE layer of `model`, in place (see the module
    docstring and `ExpertOptions`). Returns one record per MoE layer; the config is the caller's."""
    selector, router_steps, sensitivity = options.selector, options.router_steps, options.sensitivity
    device = torch.device(options.device)
    ranks = options.ranks or Ranks.current()
    outputs = "outputs" in selector.requires or router_steps > 0
    if outputs and ranks.world > 1:
        what = f"expert selector '{selector.name}'" if router_steps == 0 else "experts.router_refit"
        raise UserError(
            f"{what} reads every rank's sampled tokens, which a data-parallel run does not gather yet; "
            f"run it in one process" + ("" if router_steps else ", or choose frequency or reap")
        )
    local = ranks.share(batches)
    report = options.progress or (lambda *_: None)
    model.eval()
    layers = len(decoder_layers(model, family))
    inputs = capture_layer_inputs(model, family, local, device, options.store or ActivationStore(device))
    records: list[ExpertRecord] = []
    try:
        for index, layer in visit_layers(model, family, device):
            report(f"experts: layer {index + 1}/{layers}", index, layers)
            block = moe_block(layer, family)
            if block is not None:
                G = None if sensitivity is None or not outputs else sensitivity[index].to(device, torch.float64)
                at = LayerPass(layer, family, inputs, index, device, ranks, G)
                stats = _measure(at, block, options.sample_tokens if outputs else 0, router_steps > 0)
                record = _choose(at, block, stats.sum_over(ranks), keep, options)
                if router_steps > 0:
                    record.router = _refit(block, stats, record.kept, router_steps)
                records.append(record)
            inputs.advance(layer, index, device)  # the pruned layer (or a dense one) gives the next one its input
            faults.reached(f"experts:{index}")
        report(f"experts: layer {layers}/{layers}", layers, layers)
    finally:
        inputs.hidden.close()
    if not records:
        raise UserError("experts: the model has no routed-experts layer to prune; remove experts from the recipe")
    return records


def _choose(
    at: LayerPass, block: RoutedExperts, stats: _ExpertMoments, keep: int, options: ExpertOptions
) -> ExpertRecord:
    """The selector's `keep` experts of the layer's block from its summed statistics, the block cut
    to them in place, and the layer's record."""
    index, selector, ranks = at.index, options.selector, at.ranks
    experts = len(block.experts)
    if not block.top_k <= keep <= experts:
        raise UserError(
            f"experts: cannot keep {keep} of layer {index}'s {experts} experts (each token uses {block.top_k})"
        )
    if int(stats.tokens.sum()) == 0:
        raise ValueError("no calibration tokens were counted (all positions masked)")
    protected = protected_experts(stats.peak, options.super_ratio, stats.tokens)
    if int(protected.sum()) > keep:
        raise UserError(
            f"experts: layer {index} has {int(protected.sum())} super experts to protect but keeps {keep}; "
            f"keep more experts, raise experts.super_ratio, or set experts.protect_super: false"
        )
    problem = ExpertProblem(
        layer=index,
        keep=keep,
        top_k=block.top_k,
        normalise=block.normalise,
        tokens=stats.tokens.to(torch.long),
        gate=stats.gate,
        reap=stats.reap_sum / stats.tokens.clamp_min(1),
        peak=stats.peak,
        protected=protected,
        counted=int(stats.tokens.sum()) // block.top_k,
        probabilities=torch.cat(stats.probabilities) if stats.probabilities else None,
        gram=torch.cat(stats.gram) if stats.gram else None,
        weighed_by_h=stats.G is not None,
    )
    choice = selector.select(problem)
    kept = checked_choice(choice, selector, problem)
    if not ranks.agree(kept):
        raise RuntimeError(
            f"layer {index}: the processes chose different experts from the same statistics "
            f"(selector '{selector.name}' is not deterministic across devices)"
        )
    block.keep_experts(kept)
    tokens = problem.tokens.tolist()
    return ExpertRecord(
        layer=index,
        experts=experts,
        kept=kept.tolist(),
        selector=selector.name,
        tokens=tokens,
        fewest_tokens=min(tokens),
        protected=torch.nonzero(protected).flatten().tolist(),
        objectives=dict(choice.objectives),
    )


def _refit(block: RoutedExperts, stats: _ExpertMoments, kept: list[int], steps: int) -> dict[str, Any] | None:
    """The kept router rows refitted on the layer's output sample (None without a sample)."""
    if not stats.gram:
        return None
    device = stats.gram[0].device
    gram = torch.cat(stats.gram)
    stats.gram.clear()  # one copy of the sample's Gram at a time
    refit = refit_router(
        block,
        torch.as_tensor(kept, dtype=torch.long, device=device),
        torch.cat(stats.inputs),
        torch.cat(stats.probabilities),
        gram,
        steps,
    )
    return refit.as_dict()


def _measure(at: LayerPass, block: RoutedExperts, sample: int, keep_inputs: bool = False) -> _ExpertMoments:
    """What the layer's MoE block's experts do with the counted tokens of every stored batch (the
    output sample weighed by `at.G`)."""
    inputs = at.inputs
    counted = sum(inputs.token_counts[b] for b in range(len(inputs)))
    stats = _ExpertMoments(len(block.experts), at.device, sample, at.G, counted, keep_inputs)
    feed_counted(at, block, lambda x: stats.add(block, x))
    return stats


def feed_counted(at: LayerPass, block: nn.Module, add: Callable[[torch.Tensor], None]) -> None:
    """Run the layer on every stored batch up to `block`, handing `add` the counted tokens (each
    batch's mask) of its input, n × d; the block and what follows it do not run (nothing reads
    their output here)."""
    layer, inputs, index, device = at.layer, at.inputs, at.index, at.device
    current: dict[str, Any] = {}

    def record(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x, mask = args[0], current["mask"]
        add(counted_rows(x.reshape(*mask.shape, x.shape[-1]), mask, current["count"]))
        raise _BlockReached

    handle = block.register_forward_pre_hook(record)
    try:
        for b in range(len(inputs)):
            current["mask"], current["count"] = inputs.token_masks[b].to(device), inputs.token_counts[b]
            try:
                layer(inputs.hidden.get(b, device), **inputs.kwargs(b, index, device))
            except _BlockReached:
                continue
            raise RuntimeError(f"layer {index} never called its MoE block")
    finally:
        handle.remove()


class _BlockReached(Exception):
    """Raised by `feed_counted`'s hook once the block's input is taken: the rest of the layer is not needed."""


def windows_for(tokens: int, fewest: int, windows: int) -> int:
    """The calibration windows that would give an expert seen `fewest` times (in `windows`) `tokens`."""
    return math.ceil(windows * tokens / max(fewest, 1))
