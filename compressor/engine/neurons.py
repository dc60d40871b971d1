"""The MLP's width as a pruning axis: per layer, keep `keep` of the `f` intermediate neurons and
refit the down projection to what the dropped ones wrote, and part of what earlier layers lost.

Layers are visited in stream order (`visit_layers`), on the model as already pruned before each
one, as the walk visits residual sites. At a layer, the down projection's input h is measured over
the calibration tokens (a pre-hook on that linear while the whole layer runs): C = E[h hᵀ] in
float64, and each neuron's activation (Minitron's importance). A selector (a plugin,
`strategies.neuron_contract.NeuronSelector`) chooses the kept set S. The input linears keep their
rows in S (a fused gate_up projection the rows of S in each half), and the down projection W
becomes W' = (W·C[:,S] + δ·W[:,S])·(C[S,S] + δI)⁻¹: the least-squares map from the kept neurons to
what all f wrote, on the calibration tokens, damped towards the kept weights (δ = `damping`·mean
diag C; damped towards zero instead, as W·C[:,S]·(C[S,S] + δI)⁻¹, keeping every neuron would not
give the model back). The layer then runs again, pruned, to
give the next layer its input. C is f × f per layer, built on the run's device and dropped after.

Error feedback (`feedback` α, 0 to 1): a reference copy of the stream runs through the layers
unpruned beside the pruned one, and the down projection is fitted to t = W·h + α·e, e the layer's
output on the reference stream minus its output on the pruned one. At α = 0 that is the formula
above (what this layer's neurons wrote); at α = 1 it is the stream the layer wrote before the stage
began, so each MLP also takes back everything the layers before it lost, as sequential layer-wise
reconstruction does; in between, a part of it (a full correction fits calibration noise too). With
X = E[t hᵀ] (d × f; W·C at α = 0) the refit is (X[:,S] + δ·W[:,S])·(C[S,S] + δI)⁻¹, and selectors
see as `down` the full-width map W* = (X + δW)(C + δI)⁻¹, which writes what every neuron should, so
OBS's costs price the new target exactly. Feedback needs the MLP's output added to the stream as
it is (no norm after the MLP, e.g. Gemma2's): elsewhere the stage runs without it. It costs one more
pass of each layer and a second copy of the calibration stream.
Data-parallel (`ranks`), each rank measures its share of the batches and C, the activations and
the token count are summed over the ranks before choosing, so every rank keeps the same neurons and
refits the same weights (up to the order of the sums).
A Mixture-of-Experts layer (its MLP a `RoutedExperts` block) narrows every routed expert instead,
and its shared expert where one is given a width (`engine.expert_width`), without feedback; a dense layer of an MoE model keeps its width (the
family's MLP width is the experts').
Nothing here is checkpointed: a run killed in this stage reloads the walk's sites from its
checkpoint and runs the stage again, to the same neurons and weights (it is deterministic).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from compressor import faults
from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore
from compressor.engine.calibration import LayerPass, SecondMoment, capture_layer_inputs, counted_rows
from compressor.engine.expert_width import ExpertWidthOptions, prune_expert_widths
from compressor.engine.kv_merge import KvMeasure, KvMerge
from compressor.engine.layerwise import decoder_layers, visit_layers
from compressor.engine.mlp_reconstruct import ReconstructSettings, TokenPairs, reconstruct_mlp
from compressor.engine.mlp_widths import WidthCurve, weighted_error, width_grid
from compressor.engine.parallel import Ranks
from compressor.engine.refit import (
    NeuronRecord,
    RefitTarget,
    choose_neurons,
    choose_neurons_at,
    drop_neurons,
    output_error,
    refit_down,
)
from compressor.engine.width_search import WidthSolution
from compressor.errors import UserError
from compressor.models.experts import RoutedExperts, is_fused_experts
from compressor.models.families import ModelFamily
from compressor.models.sliced import layer_attention, layer_mlp
from compressor.strategies.neuron_contract import NeuronProblem, NeuronSelector

Progress = Callable[[str, int, int], None]


def mlp_linears(layer: nn.Module, family: ModelFamily) -> tuple[list[nn.Linear], nn.Linear]:
    """The layer's MLP input linears (they compute h) and its output linear (it reads h)."""
    mlp = layer_mlp(family, layer)
    inputs = [mlp.get_submodule(path) for path in family.mlp_inputs]
    output = mlp.get_submodule(family.mlp_output)
    if not all(isinstance(m, nn.Linear) for m in (*inputs, output)):
        raise UserError(f"{family.name}: the MLP's linears are not nn.Linear, so its neurons cannot be pruned")
    return inputs, output  # type: ignore[return-value]


class _MlpMoment:
    """Running C = E[h hᵀ] and per-window mean |h| of the down projection's input, and, for the
    error feedback, Σ e hᵀ and Σ ‖e‖² of the layer's output error e against the reference stream."""

    def __init__(self, width: int, device: torch.device, stream_width: int | None = None) -> None:
        self.moment = SecondMoment(width, device)
        self.window_means = torch.zeros(width, dtype=torch.float64, device=device)
        self.error_cross = (
            None if stream_width is None else torch.zeros(stream_width, width, dtype=torch.float64, device=device)
        )
        self.error_energy = torch.zeros((), dtype=torch.float64, device=device)

    def sum_over(self, ranks: Ranks) -> _MlpMoment:
        """Every rank's statistics summed (data-parallel calibration), in place."""
        self.moment.sum_over(ranks)
        ranks.sum_(self.window_means)
        if self.error_cross is not None:
            ranks.sum_(self.error_cross)
            ranks.sum_(self.error_energy)
        return self

    def add_error(self, h: torch.Tensor, error: torch.Tensor, mask: torch.Tensor, count: int) -> None:
        assert self.error_cross is not None
        h = counted_rows(h.reshape(*mask.shape, h.shape[-1]), mask, count).to(torch.float64)
        e = counted_rows(error, mask, count).to(torch.float64)
        self.error_cross.addmm_(e.T, h)
        self.error_energy += (e * e).sum()

    def target(self, W: torch.Tensor, C: torch.Tensor, feedback: float) -> RefitTarget:
        """The moments of t = W h + α e (C already divided by the token count)."""
        output = RefitTarget.output(W, C)
        if self.error_cross is None or feedback == 0:
            return output
        cross = self.error_cross * (feedback / self.moment.tokens)  # α E[e hᵀ]
        energy = (
            output.energy + 2 * float((W * cross).sum()) + feedback**2 * float(self.error_energy) / self.moment.tokens
        )
        return RefitTarget(output.cross + cross, energy)

    def add(self, h: torch.Tensor, mask: torch.Tensor, count: int) -> None:
        if h.dim() == 2:  # an MLP that flattens the batch's positions (OPT): back to (B, T, f)
            h = h.reshape(*mask.shape, h.shape[-1])
        self.moment.add(h, mask, count)
        real = mask.to(h.device, torch.float64).unsqueeze(-1)  # (B, T, 1)
        means = (h.abs().to(torch.float64) * real).sum(1) / real.sum(1).clamp_min(1.0)  # (B, f)
        self.window_means += (means**2).sum(0)


@dataclasses.dataclass(frozen=True)
class MlpOptions:
    """The settings every MLP pass shares (`prune_mlp`, `mlp_width_curves`): how neurons are chosen
    and refitted, on what, where the pass runs and what it reports to, in one object rather than a
    dozen keywords (defaults: the recipe's)."""

    selector: NeuronSelector
    device: torch.device | str = "cpu"
    refit: bool = True
    """Refit the down projection to the kept neurons (else keep their weights as they were)."""
    damping: float = 1e-2
    """δ of the refit, as a share of the mean diagonal of C (see the module docstring)."""
    feedback: float = 0.5
    """`prune_mlp`: the share α of the stream's error the refit takes back, from 0 to 1 (see the
    module docstring); the width curves measure without it."""
    sensitivity: Mapping[int, torch.Tensor] | None = None
    """G by layer index (H of the stream each MLP writes to, in the model's current coordinates),
    for selectors that use it and the curves' weighed errors."""
    progress: Progress | None = None
    store: ActivationStore | None = None
    ranks: Ranks | None = None
    """The data-parallel group (default: the initialised process group, if any): its ranks share
    the batches as the walk does."""
    reconstruct: ReconstructSettings | None = None
    """`prune_mlp`: each dense MLP's kept weights are then trained on its refit's target
    (`engine.mlp_reconstruct`)."""


@dataclasses.dataclass(frozen=True)
class _Measuring:
    """What measuring a dense MLP records beside C: the error feedback's share α and the reference
    stream it reads, and the token pairs a reconstruction trains on (none of them: the plain refit)."""

    feedback: float = 0.0
    reference: ActivationStore | None = None
    pairs: TokenPairs | None = None


_PLAIN = _Measuring()


@torch.no_grad()
def prune_mlp(
    model: PreTrainedModel,
    family: ModelFamily,
    batches: list[Batch],
    keep: int | Sequence[int] | None,
    options: MlpOptions,
    *,
    shared_keep: int | None = None,
) -> list[NeuronRecord]:
    """Keep `keep` intermediate neurons in every layer's MLP of `model` (a sequence: layer i keeps
    `keep[i]`, 0 removing its output; every routed expert's in an
    MoE layer; None there: their width stays), and `shared_keep` in every shared expert (None: all),
    in place (see the module docstring and `MlpOptions`). Returns one record per layer. The
    model's config is not changed: the caller sets its MLP width where the saved class reads it."""
    feedback = options.feedback
    if not 0 <= feedback <= 1:
        raise UserError(f"mlp.feedback {feedback:g}: give a share of the stream's error from 0 to 1")
    feedback = feedback if family.mlp_post_norm is None and family.experts is None else 0.0
    device = torch.device(options.device)
    ranks = options.ranks or Ranks.current()
    local = ranks.share(batches)
    report = options.progress or (lambda *_: None)
    selector, sensitivity = options.selector, options.sensitivity
    if "H" in selector.requires and sensitivity is None:
        raise UserError(f"neuron selector '{selector.name}' needs the output sensitivity H, which this run has not")
    model.eval()
    layers = len(decoder_layers(model, family))
    inputs = capture_layer_inputs(model, family, local, device, options.store or ActivationStore(device))
    reference = inputs.hidden.sibling() if feedback else None  # the stream as it was, run through unpruned layers
    for b in range(len(inputs) if reference is not None else 0):
        reference.append(inputs.hidden.host(b))
    records: list[NeuronRecord] = []
    try:
        for index, layer in visit_layers(model, family, device):
            report(f"MLP neurons: layer {index + 1}/{layers}", index, layers)
            G = None if sensitivity is None else sensitivity[index]
            at = LayerPass(layer, family, inputs, index, device, ranks, G)
            record = _prune_layer(at, keep, shared_keep, options, _Measuring(feedback, reference))
            if record is not None:
                records.append(record)
            _next_inputs(at)  # the pruned layer gives the next one its input
            faults.reached(f"mlp:{index}")
        report(f"MLP neurons: layer {layers}/{layers}", layers, layers)
    finally:
        inputs.hidden.close()
        if reference is not None:
            reference.close()
    return records


def _prune_layer(
    at: LayerPass,
    keep: int | Sequence[int] | None,
    shared_keep: int | None,
    options: MlpOptions,
    measuring: _Measuring,
) -> NeuronRecord | None:
    """One layer's MLP pruned as `prune_mlp` does, and its record; None for a dense layer of an MoE
    model (Qwen3-MoE's mlp_only_layers), which keeps its width: the config's is the experts'."""
    mlp = layer_mlp(at.family, at.layer)
    if isinstance(mlp, RoutedExperts):
        assert keep is None or isinstance(keep, int), "routed experts keep one width in every layer"
        return prune_expert_widths(
            at, mlp, keep, shared_keep, ExpertWidthOptions(options.selector, options.refit, options.damping)
        )
    if is_fused_experts(mlp):
        raise RuntimeError(f"layer {at.index}'s experts are fused: the family's prepare has not run on the model")
    if at.family.experts is not None:
        return None
    assert keep is not None, "a dense MLP's width is given"
    kept = keep if isinstance(keep, int) else keep[at.index]
    reconstruct = options.reconstruct
    pairs = TokenPairs(layer_mlp(at.family, at.layer)) if reconstruct is not None and kept > 0 else None
    dense = _prune_dense(at, kept, options, dataclasses.replace(measuring, pairs=pairs))
    if pairs is not None and reconstruct is not None:  # H weighs it where the MLP's output meets the stream
        weighing = at.G if at.family.mlp_post_norm is None else None
        dense.reconstruction = reconstruct_mlp(pairs, weighing, reconstruct, at.index, at.device, at.ranks)
    return dense


def _measure(at: LayerPass, output: nn.Linear, measuring: _Measuring = _PLAIN, advance: bool = False) -> _MlpMoment:
    """Run the layer on every stored batch, measuring the down projection's input. With a
    `measuring.reference` stream the layer, not yet pruned, also runs on it: its output there
    becomes the reference for the next layer, and its difference from the output on the pruned
    stream is the error e that feedback adds. `advance`: each stored batch is then replaced by the
    layer's output (the next layer's input), for a caller that leaves the layer as it is.
    `measuring.pairs`: each counted token's MLP input and target (its output plus
    `measuring.feedback` times the error) are kept."""
    layer, inputs, index, device = at.layer, at.inputs, at.index, at.device
    reference, pairs, feedback = measuring.reference, measuring.pairs, measuring.feedback
    stats = _MlpMoment(output.in_features, device, None if reference is None else output.out_features)
    current: dict[str, Any] = {"measuring": True}

    def record(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if current["measuring"]:
            stats.add(args[0], current["mask"], current["count"])
            if reference is not None:  # kept for the error's cross moment with h
                current["h"] = args[0]

    def keep_pair(_: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        if current["measuring"] and pairs is not None:
            pairs.add(args[0], _stream(out), current["mask"], current["count"])

    handle = output.register_forward_pre_hook(record)
    pair_handle = None if pairs is None else pairs.module.register_forward_hook(keep_pair)
    try:
        for b in range(len(inputs)):
            mask, count = inputs.token_masks[b].to(device), inputs.token_counts[b]
            current["mask"], current["count"] = mask, count
            out = inputs.output(layer, b, index, device)
            if advance:
                inputs.hidden.put(b, out)
            if reference is None:
                continue
            current["measuring"] = False
            reference_out = _stream(layer(reference.get(b, device), **inputs.kwargs(b, index, device)))
            current["measuring"] = True
            error = reference_out - out
            stats.add_error(current.pop("h"), error, mask, count)
            if pairs is not None and feedback:
                pairs.add_error(b, error, mask, count, feedback)
            reference.put(b, reference_out)
    finally:
        handle.remove()
        if pair_handle is not None:
            pair_handle.remove()
    return stats


def _next_inputs(
    at: LayerPass, output: nn.Module | None = None, merges: KvMeasure | None = None
) -> SecondMoment | None:
    """Replace each stored batch by the layer's output on it (the next layer's input); with an
    `output` module, E[a aᵀ] of what it writes over the counted tokens (and `merges` told each
    batch's counted tokens, its hooks measuring as the layer runs)."""
    layer, inputs, index, device = at.layer, at.inputs, at.index, at.device
    written = None if output is None else SecondMoment(output.out_features, device)
    current: dict[str, Any] = {}

    def record(_: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        assert written is not None
        written.add(out, current["mask"], current["count"])

    handle = None if output is None else output.register_forward_hook(record)
    try:
        for b in range(len(inputs)):
            if written is not None:  # the counted tokens of the batch the hook sees
                current["mask"], current["count"] = inputs.token_masks[b].to(device), inputs.token_counts[b]
            if merges is not None:
                merges.batch(inputs.token_masks[b].to(device), inputs.token_counts[b])
            inputs.hidden.put(b, inputs.output(layer, b, index, device))
    finally:
        if handle is not None:
            handle.remove()
    return written


def _removal_error(written: torch.Tensor, G: torch.Tensor | None, device: torch.device) -> float:
    """Tr[G·E[a aᵀ]] from `written` = E[a aᵀ], a what a block writes to the stream: the error
    there when the block is removed (G None: the identity)."""
    return float(torch.trace(written) if G is None else (G.to(device, torch.float64) * written).sum())


def _stream(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _dense_problem(
    at: LayerPass, keep: int, damping: float, measuring: _Measuring = _PLAIN, advance: bool = False
) -> tuple[NeuronProblem, RefitTarget, torch.Tensor]:
    """One dense MLP's problem, measured on the stored batches: the selector's view, what the refit
    reproduces, and the down projection W (d × f, float64). `measuring`, `advance`: as `_measure`'s."""
    device, feedback, G = at.device, measuring.feedback, at.G
    _, output = mlp_linears(at.layer, at.family)
    width = output.in_features
    if not 0 <= keep <= width:
        raise UserError(f"mlp: cannot keep {keep} of the {width} neurons of layer {at.index}'s MLP")
    stats = _measure(at, output, measuring, advance).sum_over(at.ranks)
    if stats.moment.tokens == 0:
        raise ValueError("no calibration tokens were counted (all positions masked)")
    C = stats.moment.value()  # divided in place: f × f float64 is large
    W = output.weight.detach().to(device, torch.float64)
    delta = damping * float(torch.diagonal(C).mean())
    goal = stats.target(W, C, feedback)
    problem = NeuronProblem(
        layer=at.index,
        keep=keep,
        C=C,
        activation=stats.window_means.sqrt(),
        down=goal.full_map(W, C, delta) if feedback else W,
        damping=delta,
        G=None if G is None else G.to(device, torch.float64),
        tokens=stats.moment.tokens,
    )
    return problem, goal, W


def _kept_and_down(
    problem: NeuronProblem, selector: NeuronSelector, refit: bool, ranks: Ranks
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None]:
    """The selector's objectives, the kept neurons and the refitted down projection (None without
    refit); keeping none removes the MLP's output (the heterogeneous layout's removed FFN)."""
    if problem.keep == 0:
        return {}, torch.zeros(0, dtype=torch.long, device=problem.C.device), None
    choice, kept = choose_neurons(selector, problem, ranks)
    return dict(choice.objectives), kept, refit_down(problem.down, problem.C, kept, problem.damping) if refit else None


def _prune_dense(at: LayerPass, keep: int, options: MlpOptions, measuring: _Measuring) -> NeuronRecord:
    """Keep `keep` of one dense MLP's neurons, chosen and refitted (see the module docstring);
    `measuring.pairs` records its inputs and the refit's target per token on the way."""
    selector, refit, feedback = options.selector, options.refit, measuring.feedback
    linears, output = mlp_linears(at.layer, at.family)
    width = output.in_features
    problem, goal, W = _dense_problem(at, keep, options.damping, measuring)
    C = problem.C
    objectives, kept, refitted = _kept_and_down(problem, selector, refit, at.ranks)
    plain = W[:, kept]
    record = NeuronRecord(
        layer=at.index,
        width=width,
        kept=keep,
        tokens=problem.tokens,
        selector=selector.name,
        refit=refit,
        error_dropped=output_error(goal, C, kept, plain),
        error_refit=None if refitted is None else output_error(goal, C, kept, refitted),
        objectives=objectives,
        feedback=feedback,
    )
    drop_neurons(linears, output, kept, refitted if refitted is not None else plain)
    return record


@dataclasses.dataclass(frozen=True)
class CurveOptions:
    """What `mlp_width_curves` measures beyond each dense MLP's error on the grid: other widths,
    the attention's removal and KV merges, the solutions a search assembles models from."""

    widths: Sequence[int] | None = None
    """At these widths alone, in place of the grid (one selector path: `NeuronSelector.select_widths`)."""
    attention: Mapping[int, torch.Tensor | None] | None = None
    """Per layer, G where its attention writes, or None for the identity: each curve also holds the
    error of removing the layer's attention."""
    kv_counts: Sequence[int] = ()
    """Each curve also holds the error of keeping each of these KV-head counts (`engine.kv_merge`;
    the refit damped as the MLP's)."""
    kv_weights: Mapping[int, torch.Tensor | None] | None = None
    """G where each attention writes, weighing the KV merges (else `attention`'s)."""
    keep_solutions: bool = False
    """Each curve also keeps every width's kept neurons and down projection, in the layer's dtype
    on the host (`engine.width_search` assembles models from them)."""


@torch.no_grad()
def mlp_width_curves(
    model: PreTrainedModel,
    family: ModelFamily,
    batches: list[Batch],
    step: int,
    options: MlpOptions,
    measures: CurveOptions | None = None,
) -> list[WidthCurve]:
    """Each dense MLP's predicted error at 0 and every multiple of `step` neurons
    (`engine.mlp_widths`), and what `measures` asks for beside it (`CurveOptions`), measured on
    `model` unpruned, in one pass; the model is not changed (`options.feedback` is not used)."""
    measures = CurveOptions() if measures is None else measures
    device, ranks = torch.device(options.device), options.ranks or Ranks.current()
    report = options.progress or (lambda *_: None)
    model.eval()
    layers = len(decoder_layers(model, family))
    inputs = capture_layer_inputs(model, family, ranks.share(batches), device, options.store or ActivationStore(device))
    curves: list[WidthCurve] = []
    try:
        for index, layer in visit_layers(model, family, device):
            report(f"MLP width curves: layer {index + 1}/{layers}", index, layers)
            G = None if options.sensitivity is None else options.sensitivity[index]
            at = LayerPass(layer, family, inputs, index, device, ranks, G)
            curves.append(_width_curve(at, model.config, step, options, measures))
        report(f"MLP width curves: layer {layers}/{layers}", layers, layers)
    finally:
        inputs.hidden.close()
    return curves


def _width_curve(at: LayerPass, config: Any, step: int, options: MlpOptions, measures: CurveOptions) -> WidthCurve:
    """One layer's curve, measured on the stored batches, which it leaves advanced to the next
    layer's input (one pass; a second, measuring the attention, where the curve holds its errors)."""
    advance = not (measures.attention is not None or bool(measures.kv_counts))
    problem, _, W = _dense_problem(at, 0, options.damping, advance=advance)
    errors, solutions = _width_errors(at, problem, W, step, options, measures)
    del problem
    removal, kv = _attention_errors(at, config, options.damping, measures, advance)
    return WidthCurve(at.index, errors, removal, kv, solutions)


def _width_errors(
    at: LayerPass, problem: NeuronProblem, W: torch.Tensor, step: int, options: MlpOptions, measures: CurveOptions
) -> tuple[dict[int, float], dict[int, WidthSolution]]:
    """The layer's weighed error at each width of the grid (or `measures.widths`), and with
    `measures.keep_solutions` each narrower width's kept neurons and down projection."""
    selector, refit, ranks = options.selector, options.refit, at.ranks
    errors, solutions = {}, {}
    dtype = mlp_linears(at.layer, at.family)[1].weight.dtype
    if measures.widths is None:
        for width in width_grid(problem.width, step):
            _, kept, refitted = _kept_and_down(dataclasses.replace(problem, keep=width), selector, refit, ranks)
            down = refitted if refitted is not None else W[:, kept]
            errors[width] = weighted_error(W, problem.C, kept, down, problem.G)
            if measures.keep_solutions and width < problem.width:
                solutions[width] = WidthSolution(kept.cpu(), down.to("cpu", dtype))
    else:  # one selector path for every width (`NeuronSelector.select_widths`)
        for width, kept in choose_neurons_at(selector, problem, measures.widths, ranks).items():
            down = refit_down(problem.down, problem.C, kept, problem.damping) if refit else W[:, kept]
            errors[width] = weighted_error(W, problem.C, kept, down, problem.G)
            if measures.keep_solutions and width < problem.width:
                solutions[width] = WidthSolution(kept.cpu(), down.to("cpu", dtype))
    return errors, solutions


def _attention_errors(
    at: LayerPass, config: Any, damping: float, measures: CurveOptions, advance: bool
) -> tuple[float | None, tuple[KvMerge, ...]]:
    """Where the curve measures the attention (not `advance`), the layer's second pass, unpruned,
    advancing the stored batches: the error of removing its attention, and of each KV merge."""
    attention, kv_counts = measures.attention, measures.kv_counts
    attended = layer_attention(at.family, at.layer) if not advance else None
    output = None if attended is None or attention is None else attended.get_submodule(at.family.attn_output)
    merges = None if attended is None or not kv_counts else KvMeasure(attended, at.family, config, kv_counts)
    try:
        written = None if advance else _next_inputs(at, output, merges)  # unpruned
    finally:
        if merges is not None:
            merges.close()
    removal = None
    if written is not None:
        assert attention is not None
        removal = _removal_error(written.sum_over(at.ranks).value(), attention[at.index], at.device)
    weights = measures.kv_weights if measures.kv_weights is not None else attention
    G_written = None if weights is None else weights[at.index]
    kv = () if merges is None else tuple(merges.results(G_written, damping, at.ranks))
    return removal, kv
