"""The engine: fuse norms, then choose, rotate and slice one residual-stream site at a time.

Sites, in order: the embedding output, then after attention and after the MLP of every
layer (2L + 1 sites). Each site's basis is chosen from activations of the model whose
earlier sites are already sliced, so errors propagate forward as in SliceGPT. The engine
asks the pipeline's strategies for a basis and knows nothing else about them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from compressor.calibration import Batch, LayerInputs, SecondMoment, capture_layer_inputs
from compressor.errors import UserError
from compressor.families import ModelFamily, stream_reader, stream_writers
from compressor.modeling import SlicedDecoderLayer, sliced_classes
from compressor.sensitivity import SensitivityOptions, estimate_fisher
from compressor.strategy import Basis, SiteProblem, SiteStatistics, Strategy
from compressor.transforms import fuse_norms, rotate_embedding, rotate_inputs, rotate_output, transition

ProgressCallback = Callable[[str, int, int], None]
"""Called as (phase description, steps done, steps in total)."""


@dataclass(frozen=True)
class PipelineStep:
    strategy: Strategy
    options: Any = None


@dataclass
class SiteRecord:
    """What happened at one site, for the report."""

    name: str
    width: int
    kept: int
    tokens: int
    steps: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "width": self.width, "kept": self.kept, "tokens": self.tokens,
                "strategy": "+".join(s["strategy"] for s in self.steps), "steps": self.steps}


@dataclass
class PruneResult:
    model: PreTrainedModel
    sites: list[SiteRecord]
    slicing: dict[str, Any]


def kept_width(hidden_size: int, sparsity: float, round_to: int) -> int:
    """Width kept at a sliced site: d − sparsity·d, floored to a multiple of `round_to` (as SliceGPT)."""
    kept = int((1.0 - sparsity) * hidden_size)
    kept -= kept % round_to
    if kept <= 0:
        raise UserError(
            f"sparsity {sparsity} leaves no width to keep at hidden size {hidden_size} "
            f"(kept widths are multiples of slicing.round_to={round_to}); lower the sparsity"
        )
    return kept


def site_widths(hidden_size: int, num_layers: int, kept: int, slice_head: bool, per_layer: int = 2) -> list[int]:
    """Kept width of each of the per_layer·L + 1 sites; the last one stays full unless `slice_head`."""
    widths = [kept] * (per_layer * num_layers + 1)
    if not slice_head:
        widths[-1] = hidden_size
    return widths


def site_names(num_layers: int, per_layer: int = 2) -> list[str]:
    names = ["embedding"]
    for i in range(num_layers):
        names += [f"layers.{i}"] if per_layer == 1 else [f"layers.{i}.attn", f"layers.{i}.mlp"]
    return names


STATISTICS = ("C", "H")
"""Statistics the engine can provide: C = E[x xᵀ] (always) and H = E[g gᵀ] (on request)."""


def required_statistics(pipeline: Sequence[PipelineStep]) -> set[str]:
    needed = {r for step in pipeline for r in step.strategy.requires}
    unknown = sorted(needed - set(STATISTICS))
    if unknown:
        raise UserError(f"the pipeline needs statistics this engine cannot compute: {', '.join(unknown)} "
                        f"(available: {', '.join(STATISTICS)})")
    return needed


class _SiteSelector:
    """Runs the strategy pipeline at each site and checks what comes back."""

    def __init__(self, pipeline: Sequence[PipelineStep], device: torch.device) -> None:
        self.pipeline = list(pipeline)
        self.device = device
        self.fisher: list[torch.Tensor] | None = None
        self.records: list[SiteRecord] = []

    def select(self, name: str, width: int, keep: int, moment: SecondMoment) -> torch.Tensor:
        """The kept columns (d × keep, float64) of the basis the pipeline chooses."""
        extra = {} if self.fisher is None else {"H": self.fisher[len(self.records)]}
        stats = SiteStatistics(C=moment.value(), tokens=moment.tokens, extra=extra)
        problem = SiteProblem(name=name, index=len(self.records), width=width, keep=keep, stats=stats)
        record = SiteRecord(name=name, width=width, kept=keep, tokens=moment.tokens)
        basis: Basis | None = None
        for step in self.pipeline:
            basis = step.strategy.select(problem, basis, step.options)
            _check_basis(basis, width, step.strategy.name, name)
            record.steps.append({"strategy": step.strategy.name, "objectives": dict(basis.objectives)})
        self.records.append(record)
        assert basis is not None
        return basis.kept(keep).to(self.device)


def _check_basis(basis: Basis, width: int, strategy: str, site: str) -> None:
    q = basis.Q
    if q.shape != (width, width) or q.dtype != torch.float64:
        raise RuntimeError(f"strategy '{strategy}' returned a {tuple(q.shape)} {q.dtype} basis at {site}; "
                           f"expected ({width}, {width}) float64")
    error = (q.T @ q - torch.eye(width, dtype=q.dtype, device=q.device)).abs().max().item()
    if error > 1e-6:
        raise RuntimeError(f"strategy '{strategy}' returned a non-orthogonal basis at {site} (|QᵀQ − I| = {error:.2e})")


def _moment(hidden: list[torch.Tensor], masks: list[torch.Tensor], width: int, device: torch.device) -> SecondMoment:
    moment = SecondMoment(width, device)
    for h, m in zip(hidden, masks):
        moment.add(h, m)
    return moment


def _project(hidden: list[torch.Tensor], basis: torch.Tensor) -> list[torch.Tensor]:
    return [h @ basis.to(h.dtype) for h in hidden]


@torch.no_grad()
def prune(
    model: PreTrainedModel,
    family: ModelFamily,
    batches: list[Batch],
    widths: Sequence[int],
    pipeline: Sequence[PipelineStep],
    device: torch.device | str = "cpu",
    progress: ProgressCallback | None = None,
    sensitivity: SensitivityOptions | None = None,
) -> PruneResult:
    """Rotate and slice `model` in place, then return it as a `sliced_*` model.

    Layers are moved to `device` one at a time and back to where they were, so the model
    need not fit on the accelerator (except to estimate H, which needs the whole model and its
    backward graph on `device`); the result is where the model was. `widths` gives
    the kept width of each site. H is estimated (with `sensitivity` options) only when a
    strategy of the pipeline requires it, on the fused model before anything is sliced.
    """
    device = torch.device(device)
    report = progress or (lambda *_: None)
    model.eval()
    model.requires_grad_(False)
    config = model.config
    d, num_layers = config.hidden_size, config.num_hidden_layers
    per_layer = family.sites_per_layer
    if len(widths) != per_layer * num_layers + 1:
        raise ValueError(f"expected {per_layer * num_layers + 1} site widths, got {len(widths)}")
    if family.head_width_is_embedding_width and widths[0] != widths[-1]:
        raise ValueError(f"{family.name}: the head input must be sliced like the embedding (slice_head)")
    names = site_names(num_layers, per_layer)
    needed = required_statistics(pipeline)
    selector = _SiteSelector(pipeline, device)
    home = model.get_submodule(family.head).weight.device

    report("fusing norms", 0, num_layers)
    fuse_norms(model, family)
    report("capturing layer inputs", 0, num_layers)
    inputs: LayerInputs = capture_layer_inputs(model, family, batches, device)
    hidden, masks = inputs.hidden, inputs.token_masks
    if "H" in needed:
        report("estimating output sensitivity (H)", 0, len(batches))
        selector.fisher = estimate_fisher(model, family, inputs, sensitivity or SensitivityOptions(), device)

    previous = selector.select(names[0], d, widths[0], _moment(hidden, masks, d, device))
    projection, embeddings = stream_writers(model, family)
    if projection is not None:
        rotate_output(projection, previous)  # it writes the stream; the embedding keeps its own width
    for embedding in embeddings:
        rotate_embedding(embedding, previous)
    hidden = _project(hidden, previous)
    identity = torch.eye(d, dtype=torch.float64, device=device)

    site = 1
    layers = model.get_submodule(family.layers)
    for i, layer in enumerate(layers):
        report(f"layer {i + 1}/{num_layers}", i, num_layers)
        assert isinstance(layer, SlicedDecoderLayer)
        layer_home = next(layer.parameters()).device
        layer.to(device)
        like = layer.self_attn.get_submodule(family.attn_output).weight
        for block, readers, writers, shortcut in layer.sites(family):
            for linear in readers:  # the block reads the stream in the previous site's basis
                rotate_inputs(linear, previous)
            setattr(layer, shortcut, transition(previous, identity, like))  # block output in d coordinates
            hidden = [block(h, **kw[i]) for h, kw in zip(hidden, inputs.layer_kwargs)]
            chosen = selector.select(names[site], d, widths[site], _moment(hidden, masks, d, device))
            for linear in writers:
                rotate_output(linear, chosen)
            setattr(layer, shortcut, transition(previous, chosen, like))
            hidden = _project(hidden, chosen)
            previous, site = chosen, site + 1
        layer.to(layer_home)
    report(f"layer {num_layers}/{num_layers}", num_layers, num_layers)

    reader = stream_reader(model, family)
    rotate_inputs(reader, previous)
    model.to(home)  # capture moved the embedding and rotary modules to `device`
    final_norm = model.get_submodule(family.final_norm)
    slicing = {
        "hidden_size": d,
        "embedding": widths[0],
        "attn": list(widths[1:] if per_layer == 1 else widths[1::2]),
        "mlp": list(widths[1:] if per_layer == 1 else widths[2::2]),
        "norm_eps": final_norm.eps,
        "reader_bias": reader.bias is not None,
    }
    sliced = as_sliced_model(model, family, slicing)
    return PruneResult(model=sliced, sites=selector.records, slicing=slicing)


def as_sliced_model(model: PreTrainedModel, family: ModelFamily, slicing: dict[str, Any]) -> PreTrainedModel:
    """Re-home the processed weights in the registered `sliced_*` class (no copy).

    Building the class from its config and loading the weights strictly proves that a
    saved model reloads into exactly this structure.
    """
    config_cls, model_cls = sliced_classes(model.config.model_type)
    values = model.config.to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        values.pop(key, None)
    values["tie_word_embeddings"] = False
    config = config_cls(**values, slicing=slicing)
    config.architectures = [model_cls.__name__]
    config._attn_implementation = model.config._attn_implementation
    with torch.device("meta"):
        sliced = model_cls(config)
    sliced.load_state_dict(model.state_dict(), strict=True, assign=True)
    source_buffers = dict(model.named_buffers())
    for name, buffer in sliced.named_buffers():
        if buffer.is_meta:
            owner, _, attr = name.rpartition(".")
            sliced.get_submodule(owner)._buffers[attr] = source_buffers[name]
    sliced.generation_config = model.generation_config
    sliced.eval()
    sliced.requires_grad_(False)
    return sliced
