"""One residual basis, saved as the original architecture (`slicing.layout: global`).

When every site keeps the same directions V (d × k), every residual transition VᵀV is the
identity: the sliced model is the original architecture with `hidden_size` k, which vLLM,
llama.cpp, TGI and plain transformers load without this package. What changes besides the
widths:

- the norms and the stream's scale. The sliced model's weightless RMSNorm divides by the original
  width d, x / √(‖x‖²/d + ε). The stock model carries the stream scaled by c = √(k/d) (every
  writer, the embedding included, times c), so a stock RMSNorm over k with weight s = √(d/k) and
  the original ε computes s·c·x / √(c²‖x‖²/k + ε) = x / √(‖x‖²/d + ε): the same, with the config's
  ε unchanged, so norms inside the blocks that read the same ε (QK-norm, Qwen3.5's gated norm)
  stay exact too (for a (1 + w) norm, w = s − 1);
- a factor on every block's output (Granite's `residual_multiplier`) is folded into the
  blocks' writers, so the config says 1;
- `head_dim` is written explicitly (the heads keep their width; k is rarely heads × head_dim);
- a family that scales its embeddings by √hidden_size (Gemma) scales by √k, which is √d·c
  already: its embedding keeps its weights;
- a head tied to the embedding (`tie_head`): the final norm's scale g does not commute with the
  rotation, so the saved model either unties the head (vocabulary × k more parameters, exact) or
  keeps it tied and replaces diag(g) by the diagonal D that best maps the sliced embedding E·V
  onto the untied head's W·diag(g)·V over the final stream's statistics (`tied_scale`).

The conversion writes a stock folder (config, safetensors) and loads it back with
`AutoModelForCausalLM.from_pretrained`, so what a run evaluates is what its users load.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from compressor.errors import UserError
from compressor.models.budget import ParamModel, embedding_tables, routed_params
from compressor.models.families import ModelFamily, stream_writers
from compressor.models.sites import EMBEDDING, site_ids

STOCK_KEYS = ("hidden_size", "head_dim", "tie_word_embeddings")
"""Config fields a stock model changes (and a folded `residual_multiplier`, set to 1)."""


def check_stock(family: ModelFamily, families: Iterable[ModelFamily]) -> None:
    """A UserError naming the families that can be saved as their own class, when `family` cannot."""
    if family.stock_refusal is None:
        return
    able = sorted({t for f in families if f.stock_refusal is None for t in f.model_types})
    raise UserError(
        f"slicing.layout: global saves the original architecture, which {family.name} models cannot "
        f"hold: {family.stock_refusal}; model types that can: {', '.join(able)} "
        f"(or use slicing.layout: per_site)"
    )


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def stock_config(config: PretrainedConfig, family: ModelFamily, width: int, tied: bool) -> PretrainedConfig:
    """The original's config at hidden size `width`: explicit head_dim, the head tied or not."""
    values = config.to_dict()
    values.update(hidden_size=width, head_dim=head_dim(config), tie_word_embeddings=tied)
    if family.residual_multiplier is not None:  # folded into the writers by fusion
        values[family.residual_multiplier] = 1.0
    for key in ("transformers_version", "_name_or_path"):
        values.pop(key, None)
    return type(config).from_dict(values)


def width_multiple(config: PretrainedConfig, family: ModelFamily) -> int:
    """What the stock class's config demands of hidden_size: the number of attention heads where it
    insists on a multiple (transformers' LlamaConfig does, though the model reads head_dim), else 1."""
    heads = int(config.num_attention_heads)
    if heads <= 1:
        return 1
    try:
        stock_config(config, family, heads * max(1, config.hidden_size // heads - 1) + 1, False)
    except (ValueError, StrictDataclassError):  # the config's own validation refused a width off the heads
        return heads
    return 1


def meta_params(config: PretrainedConfig, family: ModelFamily | None = None) -> tuple[int, int]:
    """Parameters of `config`'s model (tied weights once) and of its embedding tables (`family`'s)."""
    counts = _meta_counts(config, family)
    return counts[0], counts[1]


def _meta_counts(config: PretrainedConfig, family: ModelFamily | None) -> tuple[int, int, int]:
    """Parameters of `config`'s model, of its embedding tables and of its routed experts."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if family is None:
        return sum(p.numel() for p in model.parameters()), 0, 0
    tables = sum(table.numel() for table in embedding_tables(model, family))
    return sum(p.numel() for p in model.parameters()), tables, routed_params(model, family)


def stock_param_model(config: PretrainedConfig, family: ModelFamily, tied: bool) -> ParamModel:
    """P(k) = a + b·k for the stock models of `config` at width k (every linear, embedding and norm
    is linear in k; nothing is k × k), read off two models built on the meta device. As a
    `ParamModel` over the sites, b sits on the embedding: with one width everywhere, P(widths) is
    exact and there are no transitions."""
    d = config.hidden_size
    low = max(1, d // 2)
    high, at_low = (
        _meta_counts(stock_config(config, family, d, tied), family),
        _meta_counts(stock_config(config, family, low, tied), family),
    )
    slopes = []
    for high_part, low_part in zip(high, at_low, strict=True):  # all, the embedding tables, the routed experts
        slope, rest = divmod(high_part - low_part, d - low) if d != low else (high_part, 0)
        if rest:
            raise RuntimeError(f"{config.model_type}: the stock model's parameters are not linear in its width")
        slopes.append(slope)
    ids = site_ids(family, config.num_hidden_layers)

    def on_embedding(slope: int) -> dict[str, int]:
        return {site: slope if site == EMBEDDING else 0 for site in ids}

    original, tables, routed = _meta_counts(config, family)
    return ParamModel(
        sites=tuple(ids),
        constant=high[0] - slopes[0] * d,
        linear=on_embedding(slopes[0]),
        transitions=(),
        original=original,
        hidden_size=d,
        embedding=tables,
        embedding_constant=high[1] - slopes[1] * d,
        embedding_linear={EMBEDDING: slopes[1]},
        routed_constant=high[2] - slopes[2] * d,
        routed_linear=on_embedding(slopes[2]),
        routed=routed,
    )


@torch.no_grad()
def tied_scale(
    embedding: torch.Tensor, head: torch.Tensor, stream: torch.Tensor | None, rows: int = 16384
) -> torch.Tensor:
    """The diagonal D (k) that makes A·diag(D) closest to B on the final stream: A = E·V, the sliced
    embedding, B = W·diag(g)·V, the untied head; it minimises E_n‖(A·diag(D) − B)·n‖² =
    Tr((AD − B)·N·(AD − B)ᵀ) with N = E[n nᵀ] of the stream the head reads (`stream`, k × k; the
    identity when None). Setting the gradient to zero: (AᵀA ∘ N)·D = diag(AᵀB·N)."""
    gram, cross, N = _head_products(embedding, head, stream, rows)
    return torch.linalg.solve(gram * N, torch.diagonal(cross @ N))


def _head_products(
    embedding: torch.Tensor, head: torch.Tensor, stream: torch.Tensor | None, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AᵀA and AᵀB (A the sliced embedding, B the untied head; float64, k × k) and N (the
    stream's second moment, or the identity), with the vocabulary read in chunks of `rows`: no
    vocabulary × k float64 copies."""
    k = embedding.shape[1]
    gram = torch.zeros(k, k, dtype=torch.float64)
    cross = torch.zeros(k, k, dtype=torch.float64)
    for start in range(0, embedding.shape[0], rows):
        a = embedding[start : start + rows].to("cpu", torch.float64)
        gram += a.T @ a
        cross += a.T @ head[start : start + rows].to("cpu", torch.float64)
    N = torch.eye(k, dtype=torch.float64) if stream is None else stream.to("cpu", torch.float64)
    return gram, cross, N


@torch.no_grad()
def tied_rotation(
    embedding: torch.Tensor, head: torch.Tensor, stream: torch.Tensor | None, rows: int = 16384
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotation R (k × k) of the kept basis and the diagonal D for it that make the tied head
    E·V·R·diag(D)·Rᵀ the least-squares fit of the untied head W·diag(g)·V on the final stream.

    A stock model's norms are uniform but for the final one, so it computes the same with V·R for
    any rotation R: its tied head can realise any symmetric S = R·diag(D)·Rᵀ, not only a diagonal.
    The best S minimises Tr((A·S − B)·N·(A·S − B)ᵀ), A = E·V, B = W·diag(g)·V, N the stream's
    second moment (`stream`; the identity when None): G·S·N + N·S·G = AᵀB·N + N·BᵀA, G = AᵀA.
    With the pencil's eigenvectors P (Pᵀ·G·P = I, Pᵀ·N·P = Λ) and S = P·X·Pᵀ that is
    X_ij = (Pᵀ(AᵀB·N + N·BᵀA)P)_ij / (λ_i + λ_j); then S = R·diag(D)·Rᵀ by its eigenvectors. The
    diagonal fit (`tied_scale`) is the case R = I, so this is never worse in the fit's own terms."""
    gram, cross, N = _head_products(embedding, head, stream, rows)
    k = gram.shape[0]
    lower = torch.linalg.cholesky(gram)
    inverse = torch.linalg.solve_triangular(lower, torch.eye(k, dtype=torch.float64), upper=False)  # L⁻¹
    pencil, vectors = torch.linalg.eigh(inverse @ N @ inverse.T)
    P = inverse.T @ vectors
    right = cross @ N
    X = (P.T @ (right + right.T) @ P) / (pencil[:, None] + pencil[None, :])
    S = P @ X @ P.T
    D, R = torch.linalg.eigh((S + S.T) / 2)
    return R, D


def fitted_tied_scale(sliced: PreTrainedModel, family: ModelFamily, stream: torch.Tensor | None) -> torch.Tensor:
    """`tied_scale` for a sliced model with one basis: its embedding E·V onto its untied head."""
    return tied_scale(sliced.get_submodule(family.embedding).weight, sliced.get_submodule(family.head).weight, stream)


def stock_state(
    sliced: PreTrainedModel,
    family: ModelFamily,
    tie: bool,
    stream: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The stock model's state dict from a sliced model with one basis (no transitions), and what
    the conversion chose (norm scale, embedding factor, tied-head fit). A tied head's diagonal is
    `scale` where given (refinement learned it with the basis), else fitted (`tied_scale`)."""
    slicing = sliced.config.slicing
    d, k = slicing["hidden_size"], slicing["embedding"]
    if any(name.endswith("_shortcut.weight") for name, _ in sliced.named_parameters()) or set(
        slicing["attn"] + slicing["mlp"]
    ) != {k}:
        raise ValueError("a stock model needs one basis at every site (no transition matrices)")
    state = dict(sliced.state_dict())
    dtype = sliced.get_submodule(family.embedding).weight.dtype
    norm_scale = math.sqrt(d / k)
    factor = 1.0 if family.scaled_embedding else stream_scale(d, k)  # Gemma's √k is √d·c already
    head_key = f"{family.head}.weight"
    names = {id(module): name for name, module in sliced.named_modules()}
    projection, embeddings = stream_writers(sliced, family)
    for writer in [m for m in (projection, *embeddings) if m is not None]:  # what writes the stream first
        times = factor if names[id(writer)] == family.embedding else stream_scale(d, k)
        if times != 1.0:
            state.update(_scaled(names[id(writer)], writer, times))
    final = torch.full((k,), norm_scale, dtype=torch.float64)
    record: dict[str, Any] = {
        "norm_scale": norm_scale,
        "stream_scale": stream_scale(d, k),
        "embedding_factor": factor,
        "head": "untied",
    }
    if tie:
        D = fitted_tied_scale(sliced, family, stream) if scale is None else scale.to("cpu", torch.float64)
        final = norm_scale * D / factor
        record.update(
            head="tied",
            tied_scale={
                "min": float(D.min()),
                "max": float(D.max()),
                "weighted_by_stream": stream is not None,
                "fit": "diagonal" if scale is None else "given",
            },
        )
        del state[head_key]
    for index, layer in enumerate(sliced.get_submodule(family.layers)):
        state.update(stock_layer(family, index, layer, d, k))
    state[f"{family.final_norm}.weight"] = (final - family.norm_offset).to(dtype)
    if family.own_state is not None:  # e.g. routed experts back into the family's fused tensors
        state = family.own_state(state)
    return state, record


def stream_scale(d: int, k: int) -> float:
    """c = √(k/d): the factor on the stock model's stream that makes its norms over k, with the
    original ε, compute the sliced model's norms over d."""
    return math.sqrt(k / d)


def stock_layer(family: ModelFamily, index: int, layer: nn.Module, d: int, k: int) -> dict[str, torch.Tensor]:
    """Sliced layer `index`'s tensors that differ in the stock model: its norm weights, √(d/k) (the
    sliced model's norms divide by d, the stock class's by k), and its writers to the stream,
    times c = √(k/d) (`stream_scale`); its other tensors are the stock layer's as they are."""
    prefix = f"{family.layers}.{index}."
    dtype = layer.writers("attn", family)[0].weight.dtype
    value = math.sqrt(d / k) - family.norm_offset
    state = {
        f"{prefix}{name}.weight": torch.full((k,), value, dtype=torch.float64).to(dtype)
        for name in (family.attn_norm, family.mlp_norm)
        if name is not None
    }
    c = stream_scale(d, k)
    names = {id(module): name for name, module in layer.named_modules()}
    for block in ("attn", "mlp"):
        for writer in layer.writers(block, family):
            state.update(_scaled(prefix + names[id(writer)], writer, c))
    return state


def _scaled(name: str, module: nn.Module, times: float) -> dict[str, torch.Tensor]:
    """`module`'s weight (and bias) times `times`, in float64 and cast back once, keyed under `name`."""
    return {
        f"{name}.{kind}": (tensor.detach().to(torch.float64) * times).to(tensor.dtype)
        for kind in ("weight", "bias")
        if (tensor := getattr(module, kind, None)) is not None
    }


def save_stock(
    sliced: PreTrainedModel,
    family: ModelFamily,
    original: PretrainedConfig,
    folder: Path,
    tie: bool = False,
    stream: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Write the stock checkpoint of a sliced model with one basis into `folder` (config.json,
    generation config, safetensors), after proving that the original's class takes its state dict
    whole; return the conversion's record. `original` is the unpruned model's config."""
    config = stock_model_config(sliced, family, original, tie)
    state, record = stock_state(sliced, family, tie, stream, scale)
    stock = stock_shell(config)
    missing, unexpected = stock.load_state_dict(state, strict=False, assign=True)
    tied_away = {f"{family.head}.weight"} if tie else set()
    if set(missing) - tied_away or unexpected:
        raise RuntimeError(
            f"the stock {config.model_type} class does not take the sliced state dict: "
            f"missing {sorted(set(missing) - tied_away)}, unexpected {sorted(unexpected)}"
        )
    if tie:
        stock.tie_weights()
    stock.generation_config = sliced.generation_config
    stock.save_pretrained(folder)
    return stock_record(record, config, family)


def save_own_class(model: PreTrainedModel, family: ModelFamily, folder: Path) -> None:
    """Save a model of the family's own class whose modules `prepare` rewrote (routed experts) in
    the form that class loads (`own_state`), checked whole; other models as they are."""
    if family.own_state is None:
        model.save_pretrained(folder)
        return
    stock = stock_shell(model.config)
    missing, unexpected = stock.load_state_dict(family.own_state(model.state_dict()), strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(
            f"the {model.config.model_type} class does not take the pruned state dict: "
            f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    stock.generation_config = model.generation_config
    stock.save_pretrained(folder)


def stock_model_config(
    sliced: PreTrainedModel, family: ModelFamily, original: PretrainedConfig, tie: bool
) -> PretrainedConfig:
    """The config the stock model of a one-basis sliced model is saved with."""
    config = stock_config(original, family, sliced.config.slicing["embedding"], tie)
    config.architectures = list(original.architectures or [type(sliced).__name__.removeprefix("Sliced")])
    return config


def stock_shell(config: PretrainedConfig) -> PreTrainedModel:
    """The stock class for `config` on the meta device: what its checkpoint holds, without memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def stock_record(record: dict[str, Any], config: PretrainedConfig, family: ModelFamily) -> dict[str, Any]:
    """The report's record of a stock conversion: `stock_state`'s, the width and the changed config keys."""
    return {
        **record,
        "hidden_size": config.hidden_size,
        "config": {key: getattr(config, key) for key in STOCK_KEYS},
    }


def load_stock(folder: Path, like: PreTrainedModel, remote_code: bool = False) -> PreTrainedModel:
    """A saved stock model, in the dtype and attention implementation of `like` (`remote_code`: its
    class is the folder's own code, DeciLM's)."""
    dtype = next(like.parameters()).dtype
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=like.config._attn_implementation, trust_remote_code=remote_code
    )
    return model.eval().requires_grad_(False)


def to_stock(
    sliced: PreTrainedModel,
    family: ModelFamily,
    original: PretrainedConfig,
    folder: Path | None = None,
    tie: bool = False,
    stream: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """`save_stock` into `folder` (a temporary one, removed after, when None), then `load_stock`
    back: the stock model as its users will load it, and the conversion's record."""
    if folder is not None:
        record = save_stock(sliced, family, original, folder, tie, stream, scale)
        return load_stock(folder, sliced), record
    with tempfile.TemporaryDirectory(prefix="compress-stock-") as scratch:
        record = save_stock(sliced, family, original, Path(scratch), tie, stream, scale)
        return load_stock(Path(scratch), sliced), record


def head_stream(moment: torch.Tensor | None, basis: torch.Tensor) -> torch.Tensor | None:
    """N = VᵀCV: the second moment of the stream the head reads, in kept coordinates."""
    if moment is None:
        return None
    V = basis.to(moment.device, torch.float64).clone(memory_format=torch.contiguous_format)  # one layout and
    # alignment, so one rounding: a resumed walk's basis is read from a file
    return V.T @ moment.to(torch.float64) @ V
