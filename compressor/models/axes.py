"""Every axis a run can prune, in one list (`AXES`): its name, the recipe setting that opens or fixes
it, and which model types allow it, read from what their `ModelFamily` describes (an MLP width, routed
experts, a separate query projection) and from the saved formats that can hold it. `compress families`
and the dry run list a family's axes from here; a new built-in axis is an entry here, a plugin's is
returned by its `compressor_axes` hook (`docs/adding-an-axis.md`) and joins these in the registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from compressor.models.families import QUERY, ModelFamily


@dataclass(frozen=True)
class Axis:
    """One prunable axis of a model."""

    key: str
    """What `compress families` and the dry run's list of allowed axes show."""
    name: str
    setting: str
    """The recipe setting that opens or fixes it (`--set` speaks these)."""
    section: str
    """The recipe section its stage reads (`tests/models/test_family_features.py`: every pruning stage's is an axis's)."""
    allows: Callable[[ModelFamily, str], bool]
    """Whether a model of this family and model_type can be pruned on this axis (its config may still
    refuse: a class that reads no `head_dim`, a per-layer list it does not know)."""
    stock: Callable[[ModelFamily, str], bool]
    """Whether a global layout, saved as the original class, can hold it."""
    unit: str | None = None
    """What its selectors choose among (`strategies.units`: "neuron", "head", ...; None: no selector)."""


def _always(family: ModelFamily, model_type: str) -> bool:
    return True


def _never(family: ModelFamily, model_type: str) -> bool:
    return False


def _rotated(family: ModelFamily, model_type: str) -> bool:
    """The original class can hold one rotated basis (`ModelFamily.stock_refusal`); where it cannot, a
    global layout keeps the stream whole and prunes the MLP alone (`plan.checks` refuses the rest)."""
    return family.stock_refusal is None


def _mlp(family: ModelFamily, model_type: str) -> bool:
    return family.mlp_width is not None


def _experts(family: ModelFamily, model_type: str) -> bool:
    return bool(family.experts)


def _shared_expert(family: ModelFamily, model_type: str) -> bool:
    return family.shared_expert_width is not None


def _query_heads(family: ModelFamily, model_type: str) -> bool:
    """Queries from a linear of their own: the one that loses heads' rows."""
    return QUERY in family.attn_inputs


def _decilm(family: ModelFamily, model_type: str) -> bool:
    """Blocks that are DeciLM's, the format per-layer shapes are saved in (`models.decilm`, imported
    here only when asked: it imports transformers, which listing a plugin's axes need not)."""
    from compressor.models.decilm import FAMILIES as DECILM_TYPES

    return model_type in DECILM_TYPES


AXES: tuple[Axis, ...] = (
    Axis("residual", "residual width", "sparsity or target_params", "slicing", _always, _rotated),
    Axis("mlp", "MLP width (each routed expert's on a MoE)", "mlp", "mlp", _mlp, _mlp, "neuron"),
    Axis(
        "experts",
        "routed experts",
        "experts",
        "experts",
        _experts,
        lambda family, model_type: _experts(family, model_type) and _rotated(family, model_type),
        "expert",
    ),
    Axis(
        "shared-expert",
        "a shared expert's width, where the model has one",
        "mlp.shared_kept",
        "mlp",
        _shared_expert,
        lambda family, model_type: _shared_expert(family, model_type) and _rotated(family, model_type),
        "neuron",
    ),
    Axis(
        "heads",
        "query heads",
        "heads",
        "heads",
        _query_heads,
        lambda family, model_type: _query_heads(family, model_type) and _rotated(family, model_type),
        "head",
    ),
    Axis("depth", "whole decoder blocks", "depth", "depth", _always, _rotated, "block"),
    Axis(
        "per-layer", "per-layer MLP widths, attentions removed", "slicing.layout: heterogeneous", "mlp", _decilm, _never
    ),
    Axis("kv-heads", "per-layer KV heads", "mlp.merge_kv_heads", "mlp", _decilm, _never),
)
"""Every axis, in the order a run prunes them where it matters."""


def family_axes(family: ModelFamily, model_type: str, axes: tuple[Axis, ...] = AXES) -> tuple[Axis, ...]:
    """The axes (of `axes`: the built-in ones, or the registry's with a plugin's) a model of this
    family and model_type allows."""
    return tuple(axis for axis in axes if axis.allows(family, model_type))


def stock_axes(family: ModelFamily, model_type: str, axes: tuple[Axis, ...] = AXES) -> tuple[Axis, ...]:
    """The axes a global layout (saved as the original class) of such a model can prune."""
    return tuple(axis for axis in family_axes(family, model_type, axes) if axis.stock(family, model_type))
