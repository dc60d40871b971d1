"""Query heads as a pruning axis: per attention layer, keep `keep` query heads (the same number in
every KV group) and refit the output projection to what the dropped heads wrote.

The MLP axis's machinery (`engine.neurons`, `engine.refit`) with a head, a block of `head_dim`
inputs of the output projection, in place of a neuron. Layers are visited in stream order, on the
model as already pruned. At a layer, the output projection's input z (every head's output side by
side) is measured over the calibration tokens: C = E[z zᵀ] in float64 and each head's
importance (Minitron's: the L2 over windows of the mean ‖z_h‖ over a window's positions). A
selector (a plugin, `strategies.head_contract.HeadSelector`) chooses the kept heads S; the query
projection keeps their rows (and a multi-head model their key and value rows), and the output
projection becomes W' = (W·C[:,S] + δ·W[:,S])·(C[S,S] + δI)⁻¹ over S's coordinates
(`refit.refit_down`): the least-squares map from the kept heads to what every head wrote. The
layer then runs again, pruned, to give the next layer its input. A layer that holds another kind
of token mixer (Qwen3.5's linear attention) keeps it whole. Data-parallel (`ranks`) as the MLP
axis: the statistics summed over ranks before choosing. Nothing is checkpointed: a run killed here
runs the stage again to the same heads (it is deterministic).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from compressor import faults
from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore
from compressor.engine.calibration import LayerInputs, SecondMoment, capture_layer_inputs
from compressor.engine.layerwise import decoder_layers, visit_layers
from compressor.engine.mlp_widths import weighted_error
from compressor.engine.parallel import Ranks
from compressor.engine.refit import RefitTarget, output_error, refit_down
from compressor.errors import UserError
from compressor.models.families import ModelFamily
from compressor.models.heads import drop_heads, head_dim, kv_heads, query_heads
from compressor.models.sliced import layer_attention
from compressor.strategies.head_contract import HeadChoice, HeadProblem, HeadSelector
from compressor.strategies.units import checked_choice

Progress = Callable[[str, int, int], None]


@dataclass
class HeadRecord:
    """What happened at one attention layer, for the report."""

    layer: int
    heads: int
    kept: list[int]
    tokens: int
    selector: str
    refit: bool
    error_dropped: float
    """E‖W z − W[:,S] z_S‖² / E‖W z‖² on the calibration tokens: the kept heads' weights as they were."""
    error_refit: float | None
    """The same with the refitted output projection (None without the refit)."""
    objectives: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HeadOptions:
    """The settings every heads pass shares (`prune_heads`, `head_count_curves`): how heads are
    chosen and the output projection refitted, on what, where the pass runs and what it reports
    to, in one object rather than a dozen keywords (defaults: the recipe's)."""

    selector: HeadSelector
    device: torch.device | str = "cpu"
    refit: bool = True
    """Refit the output projection to the kept heads (else keep their weights as they were)."""
    damping: float = 1e-2
    """δ of the refit, as a share of the mean diagonal of C."""
    sensitivity: Mapping[int, torch.Tensor] | None = None
    """G by layer index (H of the stream each attention writes to, in the model's current
    coordinates), for selectors that use it and the curves' weighed errors."""
    progress: Progress | None = None
    store: ActivationStore | None = None
    ranks: Ranks | None = None
    """The data-parallel group (default: the initialised process group, if any)."""


@torch.no_grad()
def prune_heads(
    model: PreTrainedModel, family: ModelFamily, batches: list[Batch], keep: int, options: HeadOptions
) -> list[HeadRecord]:
    """Keep `keep` query heads in every attention layer of `model`, in place (see the module
    docstring and `HeadOptions`). The model's config is not changed: the caller sets it
    (`models.heads.set_heads`)."""
    selector, sensitivity = options.selector, options.sensitivity
    device = torch.device(options.device)
    ranks = options.ranks or Ranks.current()
    report = options.progress or (lambda *_: None)
    if "H" in selector.requires and sensitivity is None:
        raise UserError(f"head selector '{selector.name}' needs the output sensitivity H, which this run has not")
    config = model.config
    heads, groups, width = query_heads(config), kv_heads(config), head_dim(config)
    model.eval()
    layers = len(decoder_layers(model, family))
    inputs = capture_layer_inputs(model, family, ranks.share(batches), device, options.store or ActivationStore(device))
    records: list[HeadRecord] = []
    try:
        for index, layer in visit_layers(model, family, device):
            report(f"attention heads: layer {index + 1}/{layers}", index, layers)
            attention = layer_attention(family, layer)
            if attention is not None:
                G = None if sensitivity is None else sensitivity[index]
                at = _AtLayer(layer, inputs, _Shape(index, keep, heads, groups, width), device, ranks, G)
                records.append(_prune_layer(at, attention, family, options))
            inputs.advance(layer, index, device)  # the pruned layer gives the next one its input
            faults.reached(f"heads:{index}")
        report(f"attention heads: layer {layers}/{layers}", layers, layers)
    finally:
        inputs.hidden.close()
    return records


@dataclass(frozen=True)
class _Shape:
    """One attention layer's place and head counts: `kv` its KV heads (as many as `heads` in
    multi-head attention, where each query head is its own group)."""

    layer: int
    keep: int
    heads: int
    kv: int
    head_dim: int


@dataclass(frozen=True)
class _AtLayer:
    """One attention layer as a pass reaches it, what the per-layer helpers share: the decoder
    layer, the stored batches it runs on, its shape, the device, the ranks and G where it writes."""

    layer: nn.Module
    inputs: LayerInputs
    shape: _Shape
    device: torch.device
    ranks: Ranks
    G: torch.Tensor | None = None


def _prune_layer(at: _AtLayer, attention: nn.Module, family: ModelFamily, options: HeadOptions) -> HeadRecord:
    """Measure, choose and cut one attention layer's heads (see the module docstring)."""
    selector, refit = options.selector, options.refit
    output = attention.get_submodule(family.attn_output)
    problem = _problem(at, output, options.damping)
    C, W = problem.C, problem.down
    choice, kept = _chosen(problem, selector, at.ranks)
    columns = problem.columns(kept)
    goal = RefitTarget.output(W, C)
    plain = W[:, columns]
    refitted = refit_down(W, C, columns, problem.damping) if refit else None
    record = HeadRecord(
        layer=problem.layer,
        heads=problem.heads,
        kept=kept.tolist(),
        tokens=problem.tokens,
        selector=selector.name,
        refit=refit,
        error_dropped=output_error(goal, C, columns, plain),
        error_refit=None if refitted is None else output_error(goal, C, columns, refitted),
        objectives=dict(choice.objectives),
    )
    drop_heads(attention, family, problem.heads, at.shape.kv, kept, refitted if refitted is not None else plain)
    return record


def _problem(at: _AtLayer, output: nn.Linear, damping: float, advance: bool = False) -> HeadProblem:
    """One attention layer's selector problem, measured on the stored batches (`advance`: each
    batch then replaced by the layer's output, the layer being left as it is)."""
    shape, device, G = at.shape, at.device, at.G
    moment, window_norms = _measure(at, output, advance)
    moment.sum_over(at.ranks)
    at.ranks.sum_(window_norms)
    C = moment.value()
    return HeadProblem(
        layer=shape.layer,
        keep=shape.keep,
        heads=shape.heads,
        groups=shape.kv if shape.kv < shape.heads else 1,
        head_dim=shape.head_dim,
        C=C,
        activation=window_norms.sqrt(),
        down=output.weight.detach().to(device, torch.float64),
        damping=damping * float(torch.diagonal(C).mean()),
        G=None if G is None else G.to(device, torch.float64),
        tokens=moment.tokens,
    )


def _chosen(problem: HeadProblem, selector: HeadSelector, ranks: Ranks) -> tuple[HeadChoice, torch.Tensor]:
    """The selector's choice and its kept heads, the same on every process."""
    choice = selector.select(problem)
    kept = checked_choice(choice, selector, problem).to(problem.C.device)
    if not ranks.agree(kept):
        raise RuntimeError(
            f"layer {problem.layer}: the processes chose different heads from the same statistics "
            f"(selector '{selector.name}' is not deterministic across devices)"
        )
    return choice, kept


@torch.no_grad()
def head_count_curves(
    model: PreTrainedModel, family: ModelFamily, batches: list[Batch], counts: Sequence[int], options: HeadOptions
) -> dict[int, dict[int, float]]:
    """Each attention layer's predicted error at each of `counts` query heads kept, measured on
    `model` unpruned in one pass (the model is not changed): the selector's heads and the output
    projection refitted as `prune_heads` would, the error Tr[G·E[(Wz − W'z_S)(…)ᵀ]] where the
    attention writes (`mlp_widths.weighted_error`; with G = H by layer, half the predicted KL).
    Keyed by layer index (a layer without attention has none)."""
    selector, refit, sensitivity = options.selector, options.refit, options.sensitivity
    device, ranks = torch.device(options.device), options.ranks or Ranks.current()
    report = options.progress or (lambda *_: None)
    config = model.config
    heads, groups, width = query_heads(config), kv_heads(config), head_dim(config)
    model.eval()
    layers = len(decoder_layers(model, family))
    inputs = capture_layer_inputs(model, family, ranks.share(batches), device, options.store or ActivationStore(device))
    curves: dict[int, dict[int, float]] = {}
    try:
        for index, layer in visit_layers(model, family, device):
            report(f"head count curves: layer {index + 1}/{layers}", index, layers)
            attention = layer_attention(family, layer)
            if attention is None:  # another token mixer: nothing cut, the batches advanced
                inputs.advance(layer, index, device)
                continue
            output = attention.get_submodule(family.attn_output)
            G = None if sensitivity is None else sensitivity[index]
            at = _AtLayer(layer, inputs, _Shape(index, 0, heads, groups, width), device, ranks, G)
            problem = _problem(at, output, options.damping, advance=True)
            curves[index], W = {}, problem.down
            for count in counts:
                counted = dataclasses.replace(problem, keep=count)
                _, kept = _chosen(counted, selector, ranks)
                columns = counted.columns(kept)
                down = refit_down(W, problem.C, columns, problem.damping) if refit else W[:, columns]
                curves[index][count] = weighted_error(W, problem.C, columns, down, problem.G)
        report(f"head count curves: layer {layers}/{layers}", layers, layers)
    finally:
        inputs.hidden.close()
    return curves


def _measure(at: _AtLayer, output: nn.Linear, advance: bool = False) -> tuple[SecondMoment, torch.Tensor]:
    """Run the layer on every stored batch: C of the output projection's input, and the sum over
    windows of each head's squared mean ‖z_h‖ over the window's real positions (`advance`: each
    batch then replaced by the layer's output)."""
    layer, inputs, shape, device = at.layer, at.inputs, at.shape, at.device
    moment = SecondMoment(output.in_features, device)
    window_norms = torch.zeros(shape.heads, dtype=torch.float64, device=device)
    current: dict[str, Any] = {}

    def record(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        z, mask = args[0], current["mask"]
        moment.add(z, mask, current["count"])
        norms = z.to(torch.float64).unflatten(-1, (shape.heads, shape.head_dim)).norm(dim=-1)  # (B, T, heads)
        real = mask.to(z.device, torch.float64).unsqueeze(-1)
        means = (norms * real).sum(1) / real.sum(1).clamp_min(1.0)  # (B, heads)
        window_norms.add_((means**2).sum(0))

    handle = output.register_forward_pre_hook(record)
    try:
        for b in range(len(inputs)):
            current["mask"], current["count"] = inputs.token_masks[b].to(device), inputs.token_counts[b]
            out = inputs.output(layer, b, shape.layer, device)
            if advance:
                inputs.hidden.put(b, out)
    finally:
        handle.remove()
    return moment, window_norms
