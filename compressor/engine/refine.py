"""End-to-end refinement: move every site's kept directions to lower the model's true output KL.

The walk chooses each site's basis from local statistics (C, H) and a per-site proxy of the
output KL. This step starts from the walk's bases and minimises KL(original ‖ pruned) itself,
on the calibration windows, over all sites jointly: each V_s lives on the Stiefel manifold
(geoopt's Riemannian Adam) and the original weights stay frozen, so the result is again a set of
bases of the same widths, applied exactly by `bases.apply_bases` (same structure, same
parameter count).

Why a projected forward is the pruned model: a sliced model's block reads z = Vᵀx through a
weightless RMSNorm that divides by the original width, and ‖z‖ = ‖V z‖, so the sliced model
computes exactly what the fused original computes when the stream is replaced by V Vᵀ x after
every site (`fisher.site_activations` with an edit). Gradients flow to every V through
those projections.

The teacher's log-probabilities are computed once and kept on the host: the `top_k` most
probable tokens per position plus the remaining mass as one bin (an exact KL between the two
(k+1)-bin distributions, a lower bound of the full KL), or the whole distribution (`top_k: 0`,
tokens × vocabulary floats on the host). The objective over the refinement's windows (all
calibration windows, or `windows` of them) is measured before and after; the refined bases are
returned only if it went down, otherwise the received ones. That is a guarantee on this
in-sample objective, not on held-out text: the runner's held-out guard (`reports.guard`) decides
whether the refined model is kept.

The model optimised is the model that is saved. A one-basis model saved as the original class
with its head tied (`stock.save_stock(tie=True)`) computes its logits as E·V·diag(D)·Vᵀn: the
embedding's kept directions, scaled by the final norm's diagonal D. That head is not the untied
head W·diag(g)·V refinement would otherwise optimise, and D fitted for the received basis does
not fit a moved one: `StockTiedHead` makes D a parameter learned with the basis, and the
refined D is what the stock conversion writes (`Refined.head_scale`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import geoopt
import torch
from torch import nn
from transformers import PreTrainedModel

from compressor.data.batches import Batch
from compressor.engine.bases import shared_sites, tied_head
from compressor.engine.calibration import LayerInputs, capture_layer_inputs
from compressor.engine.fisher import HeadOptions, site_activations
from compressor.engine.transforms import fuse_norms
from compressor.errors import UserError
from compressor.models.families import ModelFamily
from compressor.models.sites import site_ids
from compressor.recipe.sections.refinement import RefinementSpec

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class RefinementRecord:
    """What the refinement did, for the report. KLs are the objective (nats per counted token,
    over the refinement's windows) with the teacher truncated to `options["top_k"]` (0: exact)."""

    steps: int
    calibration_kl_before: float
    calibration_kl_refined: float
    calibration_kl_after: float
    """Of the bases returned: the refined ones, or the received ones if refining did not help."""
    kept: str
    """"refined", or "received" when the refined bases did not lower the objective."""
    seconds: float
    options: dict[str, Any]
    """The recipe's refinement settings."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def rebatch(batches: list[Batch], size: int, windows: int | None = None) -> list[Batch]:
    """The same windows in batches of `size` (the refinement's step size need not be the walk's);
    with `windows`, only that many of them, evenly spaced through the calibration set."""
    width = max(b.input_ids.shape[1] for b in batches)

    def joined(name: str) -> torch.Tensor | None:
        """Batches padded to one width on the right (chat batches are padded per batch; pads
        appended after the real tokens change nothing before them under a causal mask)."""
        parts = [getattr(b, name) for b in batches]
        if any(p is None for p in parts):
            return None
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

    ids, mask, counted = joined("input_ids"), joined("attention_mask"), joined("sensitivity_mask")
    assert ids is not None and mask is not None
    if windows is not None and windows < ids.shape[0]:
        chosen = torch.linspace(0, ids.shape[0] - 1, windows).round().long()
        ids, mask, counted = ids[chosen], mask[chosen], None if counted is None else counted[chosen]
    return [
        Batch(ids[i : i + size], mask[i : i + size], None if counted is None else counted[i : i + size])
        for i in range(0, ids.shape[0], size)
    ]


@dataclass
class TeacherTarget:
    """One batch's teacher: log-probabilities of the kept tokens and of the rest (one bin), or of
    the whole vocabulary (`indices` None). Only the counted positions are kept, in row-major order."""

    values: torch.Tensor
    indices: torch.Tensor | None
    tail: torch.Tensor | None

    @staticmethod
    def cat(parts: list[TeacherTarget], device: torch.device | None = None) -> TeacherTarget:
        """Several batches' (or rows') targets as one, in order, on `device`."""

        def joined(name: str) -> torch.Tensor | None:
            tensors = [getattr(part, name) for part in parts]
            return None if tensors[0] is None else torch.cat(tensors).to(device)

        values = joined("values")
        assert values is not None
        return TeacherTarget(values, joined("indices"), joined("tail"))


def _bins(logits: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of the `indices` tokens and of all the others together, from logits,
    without a log-softmax over the vocabulary. The rest is its own logsumexp (not 1 − the kept
    mass, which loses a small remainder to float32 cancellation)."""
    total = logits.logsumexp(-1, keepdim=True)
    kept = logits.gather(-1, indices) - total
    rest = logits.scatter(-1, indices, float("-inf")).logsumexp(-1) - total.squeeze(-1)
    return kept, rest


def teacher_target(logits: torch.Tensor, mask: torch.Tensor, top_k: int, host: bool = True) -> TeacherTarget:
    """The teacher's bins at the positions `mask` counts (on the host unless `host` is False)."""
    logits = logits[mask].float()
    move = (lambda t: t.cpu()) if host else (lambda t: t)
    if top_k == 0 or top_k >= logits.shape[-1]:
        return TeacherTarget(move(torch.log_softmax(logits, dim=-1)), None, None)
    indices = logits.topk(top_k, dim=-1).indices
    values, tail = _bins(logits, indices)
    return TeacherTarget(move(values), move(indices), move(tail))


def kl_to_target(target: TeacherTarget, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ over counted positions of KL(teacher ‖ student), on the teacher's bins."""
    logits = logits[mask].float()
    values = target.values.to(logits.device)
    if target.indices is None:
        return (values.exp() * (values - torch.log_softmax(logits, dim=-1))).sum()
    kept, rest = _bins(logits, target.indices.to(logits.device))
    tail = target.tail.to(logits.device)
    return (values.exp() * (values - kept)).sum() + (tail.exp() * (tail - rest)).sum()


class TiedHead:
    """The logits of a tied head kept tied (`bases.apply_tied_head`): the sliced embedding E·V₀
    with the least-squares map M = (E·V₀)⁺·W·V_last after the final norm gives P·(W·V_last·n), P
    the orthogonal projector onto the columns of E·V₀; so the untied pruned model's logits,
    projected. Computed as E·V₀·G⁻¹·V₀ᵀ·(Eᵀ·logits), with G = V₀ᵀ(EᵀE)V₀ (k₀ × k₀) and EᵀE
    fixed, at the cost of two head-sized products."""

    def __init__(self, embedding: torch.Tensor) -> None:
        self.embedding = embedding
        E = embedding.to(torch.float64)
        self.gram = E.T @ E

    def __call__(self, logits: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        V = basis.to(torch.float64)
        G = V.T @ self.gram.to(V.device) @ V
        E = self.embedding.to(dtype)
        coordinates = (logits.to(dtype) @ E) @ V.to(dtype)  # (tokens, k₀): V₀ᵀEᵀ·logits
        solved = torch.linalg.solve(G, coordinates.to(torch.float64).mT).mT.to(dtype)
        return ((solved @ V.T.to(dtype)) @ E.T).to(logits.dtype)


class StockTiedHead:
    """The head of a one-basis model saved as the original class with its head tied: the final
    (weightless, fused) norm's output n, then E·V·diag(D)·Vᵀn, E the embedding, V the basis and D
    the stock final norm's scale in the sliced model's terms (`stock.stock_state`). D is an
    ordinary parameter (`scale`), learned beside the basis."""

    def __init__(self, embedding: torch.Tensor, final_norm: nn.Module, scale: torch.Tensor) -> None:
        self.embedding = embedding
        self.final_norm = final_norm
        self.scale = nn.Parameter(scale.to(embedding.device, torch.float64).clone())

    def __call__(self, hidden: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        V = basis.to(dtype)
        kept = (self.final_norm(hidden).to(dtype) @ V) * self.scale.to(dtype)  # (tokens, k): diag(D)·Vᵀn
        return (kept @ (self.embedding.to(dtype) @ V).T).to(hidden.dtype)


class Refined(NamedTuple):
    """What refinement returns: the bases, its record, and a stock tied head's learned scale D
    (None for every other head)."""

    bases: dict[str, torch.Tensor]
    record: RefinementRecord
    head_scale: torch.Tensor | None = None


def _student_logits(
    model: PreTrainedModel,
    family: ModelFamily,
    inputs: LayerInputs,
    batch: int,
    bases: list[torch.Tensor],
    tied: TiedHead | StockTiedHead | None = None,
) -> torch.Tensor:
    """Logits of the pruned model that `bases` (in `site_ids` order) define: the fused original
    with the stream projected on each site's kept directions, and its head as it is saved (a
    tied head's projection, or a stock tied head)."""

    def project(site: int, stream: torch.Tensor) -> torch.Tensor:
        """In float32 at least: V rounded to bfloat16 is no longer orthonormal, V Vᵀ no projector."""
        dtype = torch.promote_types(stream.dtype, torch.float32)
        basis = bases[site].to(dtype)
        return ((stream.to(dtype) @ basis) @ basis.T).to(stream.dtype)

    if isinstance(tied, StockTiedHead):
        stock = HeadOptions(head=lambda n: tied(n, bases[-1]))
        return site_activations(model, family, inputs, batch, project, stock)[1]
    before_cap = None if tied is None else (lambda logits: tied(logits, bases[0]))
    return site_activations(model, family, inputs, batch, project, HeadOptions(before_cap))[1]


@dataclass(frozen=True)
class RefinementRun:
    """How one refinement runs beside the recipe's settings (`RefinementSpec`): where, with which
    seed, who hears it, and the head the refined model is saved with."""

    device: torch.device | str = "cpu"
    """Where the model runs: it must fit there whole."""
    seed: int = 0
    """Seeds the order the calibration batches are visited in."""
    progress: Progress | None = None
    keep_tied: bool | None = None
    """As in `bases.apply_bases` (None: the bases say whether the head stayed tied)."""
    stock_tied_scale: torch.Tensor | None = None
    """A one-basis model to be saved with its head tied, and its final norm's scale D as fitted for
    the received basis (`stock.fitted_tied_scale`); D is learned too."""


def refine_bases(
    model: PreTrainedModel,
    family: ModelFamily,
    batches: list[Batch],
    bases: Mapping[str, torch.Tensor],
    options: RefinementSpec,
    run: RefinementRun = RefinementRun(),
) -> Refined:
    """Refined bases (float64, same shapes) and what happened. `model` is the *original* model,
    which this consumes (its norms are fused in place); `run` says where and how (`RefinementRun`)."""
    started = time.perf_counter()
    device = torch.device(run.device)
    report = run.progress or (lambda *_: None)
    model.eval()
    model.requires_grad_(False)
    tied = tied_head(model, family, bases) if run.keep_tied is None else run.keep_tied  # before fusing, which unties
    fuse_norms(model, family)
    model.to(device)
    report("refinement: capturing layer inputs", 0, 1)
    inputs = capture_layer_inputs(model, family, rebatch(batches, options.batch_size, options.windows), device)
    embedding = model.get_submodule(family.embedding).weight.detach()
    head: TiedHead | StockTiedHead | None = TiedHead(embedding) if tied else None
    if run.stock_tied_scale is not None:
        if tied or len(set(shared_sites(site_ids(family, model.config.num_hidden_layers), bases))) != len(bases) - 1:
            raise ValueError("a stock tied head needs one basis at every site and the sliced model's head untied")
        head = StockTiedHead(embedding, model.get_submodule(family.final_norm), run.stock_tied_scale)
    try:
        return _refine(_Student(model, family, inputs, head, report, device), bases, options, run.seed, started)
    finally:
        inputs.hidden.close()


class _Student:
    """The pruned model as refinement moves it: the fused original over the captured windows on
    `device`, its stream projected on the bases (`_student_logits`), its head as saved; and who
    hears the steps."""

    def __init__(
        self,
        model: PreTrainedModel,
        family: ModelFamily,
        inputs: LayerInputs,
        tied: TiedHead | StockTiedHead | None,
        report: Progress,
        device: torch.device,
    ) -> None:
        self.model, self.family, self.inputs, self.tied, self.report = model, family, inputs, tied, report
        self.device = device
        self.masks = [m.to(device) for m in inputs.sensitivity_masks]

    def kl(self, targets: list[TeacherTarget], batch: int, bases: list[torch.Tensor]) -> torch.Tensor:
        """Σ over the batch's counted positions of KL(teacher ‖ the model `bases` define)."""
        logits = _student_logits(self.model, self.family, self.inputs, batch, bases, self.tied)
        return kl_to_target(targets[batch], logits, self.masks[batch])

    def objective(self, current: list[torch.Tensor], targets: list[TeacherTarget], phase: str) -> float:
        """The mean KL per counted token over every window (reported as `phase`)."""
        total = 0.0
        for b in range(len(self.inputs)):
            total += float(self.kl(targets, b, current))
            self.report(phase, b + 1, len(self.inputs))
        return total / sum(self.inputs.sensitivity_counts)

    def teacher(self, top_k: int) -> list[TeacherTarget]:
        """The original's bins on every window (the stream left as it is)."""
        targets = []
        for b in range(len(self.inputs)):
            logits = site_activations(self.model, self.family, self.inputs, b, lambda _, stream: stream)[1]
            targets.append(teacher_target(logits, self.masks[b], top_k))
            self.report("refinement: teacher log-probabilities", b + 1, len(self.inputs))
        return targets


def _refine(
    student: _Student, bases: Mapping[str, torch.Tensor], options: RefinementSpec, seed: int, started: float
) -> Refined:
    """The teacher's targets, the KL before, the descent and the KL after: the refined bases if
    they lowered it, else the received ones."""
    model, family, inputs, tied = student.model, student.family, student.inputs, student.tied
    ids = site_ids(family, model.config.num_hidden_layers)
    counted = sum(inputs.sensitivity_counts)
    if counted == 0:
        raise UserError(
            "refinement: its calibration windows have no counted tokens (e.g. no assistant tokens); "
            "raise refinement.windows or leave it unset"
        )
    received = [bases[site].to(student.device, torch.float64) for site in ids]
    with torch.no_grad():
        targets = student.teacher(options.top_k)
        before = student.objective(received, targets, "refinement: KL before")

    params, learned = _parameters(ids, bases, received, tied)
    scale = tied.scale if isinstance(tied, StockTiedHead) else None
    received_scale = None if scale is None else scale.detach().clone()
    if scale is not None:
        learned.append(scale)
    steps = _descend(student, targets, params, geoopt.optim.RiemannianAdam(learned, lr=options.lr), options, seed)
    refined = [p.detach() for p in params]
    with torch.no_grad():
        after = student.objective(refined, targets, "refinement: KL after")
    keep = after < before
    chosen = refined if keep else received
    if scale is not None and not keep:
        with torch.no_grad():
            scale.copy_(received_scale)
    record = RefinementRecord(
        steps=steps,
        calibration_kl_before=before,
        calibration_kl_refined=after,
        calibration_kl_after=after if keep else before,
        kept="refined" if keep else "received",
        seconds=time.perf_counter() - started,
        options=asdict(options),
    )
    return Refined(
        {site: v.to("cpu", torch.float64).contiguous() for site, v in zip(ids, chosen)},
        record,
        None if scale is None else scale.detach().to("cpu", torch.float64),
    )


def _parameters(
    ids: list[str],
    bases: Mapping[str, torch.Tensor],
    received: list[torch.Tensor],
    tied: TiedHead | StockTiedHead | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each site's basis as a point on the Stiefel manifold, and the distinct ones to learn: a site
    that shares the previous site's basis shares its parameter, and a tied head's last site the
    embedding's."""
    shared = set(shared_sites(ids, bases))
    params: list[torch.Tensor] = []
    for site, v in zip(ids, received):  # a site that shares the previous site's basis shares its parameter
        params.append(params[-1] if site in shared else geoopt.ManifoldParameter(v.clone(), manifold=geoopt.Stiefel()))
    if isinstance(tied, TiedHead):  # the last site keeps the embedding's basis
        params[-1] = params[0]
    learned: list[torch.Tensor] = list({id(p): p for p in params}.values())
    return params, learned


def _descend(
    student: _Student,
    targets: list[TeacherTarget],
    params: list[torch.Tensor],
    optimiser: torch.optim.Optimizer,
    options: RefinementSpec,
    seed: int,
) -> int:
    """Riemannian Adam on the KL, one batch a step in an order drawn from `seed`, every batch once
    an epoch; returns the steps taken."""
    inputs = student.inputs
    generator = torch.Generator().manual_seed(seed)
    steps = max(1, round(options.epochs * len(inputs)))
    order: list[int] = []
    with torch.enable_grad():
        for step in range(steps):
            if not order:
                order = torch.randperm(len(inputs), generator=generator).tolist()
            b = order.pop()
            optimiser.zero_grad()
            loss = student.kl(targets, b, params)
            (loss / max(inputs.sensitivity_counts[b], 1)).backward()
            optimiser.step()
            student.report("refinement: Riemannian Adam on the KL", step + 1, steps)
    return steps
