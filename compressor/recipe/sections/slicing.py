"""The `slicing` and `allocation` sections: the walk's layout and how wide each site stays."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import StrictBool, StrictInt

from compressor.errors import UserError
from compressor.recipe.sections.contract import Section, SectionContext
from compressor.validation import FORBID, Number, described, options

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe


AllocationMethod = Literal["uniform", "curves"]
Layout = Literal["per_site", "global", "heterogeneous"]
Pooling = Literal["trace", "sum"]
TiedFit = Literal["symmetric", "diagonal"]


@options(frozen=True, config=FORBID)
class SlicingSpec:
    layout: Layout = "per_site"
    """per_site: a basis per site, joined by transition matrices (a `sliced_*` class, SliceGPT's
    layout); global: one basis for the whole stream, saved as the original architecture at a
    smaller hidden size (`compressor.models.stock`: vLLM, llama.cpp, TGI load it); heterogeneous:
    the stream kept whole and each layer's MLP its own width (0: the FFN removed), allocated under
    the budget by predicted error, saved as DeciLM (`compressor.models.decilm`: vLLM and llama.cpp
    serve it, transformers with trust_remote_code). Llama models, with an `mlp` section."""
    pooling: Pooling = "trace"
    """global: how the sites' statistics are summed into one problem: each divided by its trace
    (every site counts alike), or raw sums."""
    round_to: Annotated[StrictInt, described("kept widths are multiples of it", ge=1)] = 8
    """Kept widths are multiples of it: 64 or 128 suit tensor cores, 256 llama.cpp's k-quants."""
    kept: Annotated[StrictInt, described("the residual width every site keeps", ge=1)] | None = None
    """The residual width fixed (the hidden size: the stream kept whole), the MLP's neurons taking
    what `target_params` leaves (`models.split.stream_layout`); with `mlp` open and a uniform width.
    None: the budget (or the split the run chooses) decides it."""
    slice_head: StrictBool = False
    correct_readers: StrictBool = False
    """Read each site's stream through the least-squares map C·V(VᵀCV)⁻¹ instead of V (no parameter cost)."""
    shared_bases: StrictBool = False
    """Each layer's MLP site keeps its attention site's basis, so no transition matrix sits between them."""
    tie_head: StrictBool | None = None
    """For a model with tied embeddings: the last site keeps the embedding's basis and the head
    stays tied to the (sliced) embedding, with a small map after the final norm. With the global
    layout: the head stays tied and the final norm's scale becomes the best diagonal fit
    (`stock.tied_scale`); false saves it untied (exact, vocabulary × width more). Unset: off for
    per_site, on for global when the model ties its embeddings (measured better at equal
    parameters, docs/benchmarks.md)."""
    tied_fit: TiedFit = "symmetric"
    """global with a tied head: how the head is fitted to the untied one. symmetric: the basis is
    rotated within its span so that the final norm's diagonal realises the best symmetric map
    (`stock.tied_rotation`, free: the stock model's other norms are uniform); diagonal: the
    final norm's scale alone (`stock.tied_scale`)."""


@options(frozen=True, config=FORBID)
class AllocationSpec:
    """How many directions each site keeps (`compressor.engine.allocation`), under the budget that
    `sparsity` (the uniform model's parameter count) or `target_params` sets."""

    method: AllocationMethod = "uniform"
    """uniform: one width everywhere; curves: per-site widths from predicted-KL curves."""
    min_kept: Annotated[Number, described("a fraction of the hidden width", gt=0, le=1)] = 0.5
    """curves: the narrowest a site may become, as a fraction of the hidden width."""
    step: Annotated[StrictInt, described("a positive multiple of slicing.round_to", ge=1)] | None = None
    """curves: the width grid (a multiple of slicing.round_to; default round_to)."""


def check_allocation(spec: AllocationSpec, recipe: Recipe, context: SectionContext) -> AllocationSpec:
    """The curves' width grid is on the slicing's rounding."""
    round_to = recipe.slicing.round_to
    if spec.step is not None and spec.step % round_to:
        raise UserError(
            f"allocation.step must be a positive multiple of slicing.round_to ({round_to}), got {spec.step}"
        )
    return spec


def check_slicing(slicing: SlicingSpec, recipe: Recipe, context: SectionContext) -> SlicingSpec:
    """What a fixed residual width needs, and what a global layout (one basis, one width) cannot be
    combined with."""
    if slicing.kept is not None:
        check_fixed_stream(slicing, recipe)
    if slicing.layout != "global":
        return slicing
    if slicing.shared_bases:
        raise UserError(
            "slicing.shared_bases shares a basis within each layer, and slicing.layout: global already "
            "keeps one basis everywhere; remove slicing.shared_bases"
        )
    if recipe.allocation.method != "uniform":
        raise UserError(
            "slicing.layout: global keeps one width everywhere, so allocation.method must be uniform "
            f"(got {recipe.allocation.method}); use slicing.layout: per_site for per-site widths"
        )
    return slicing


def check_fixed_stream(slicing: SlicingSpec, recipe: Recipe) -> None:
    """`slicing.kept` fixes the residual axis, so another must take the budget: the MLP's width,
    chosen by the budget (`mlp` without `kept`), under `target_params`, at one uniform width."""
    fix = f"slicing.kept {slicing.kept} fixes the residual width"
    if slicing.layout == "heterogeneous":
        raise UserError(f"{fix}, but slicing.layout: heterogeneous keeps the stream whole; remove slicing.kept")
    if recipe.sparsity is not None:
        raise UserError(f"{fix}, and sparsity sets it too; remove one, or give target_params for the MLPs to spend")
    if recipe.target_decode is not None:
        raise UserError(f"{fix}, and target_decode chooses the widths by measured decode time; remove one")
    if recipe.target_params is None:
        raise UserError(f"{fix}: give target_params (a parameter budget) for the MLP's width to spend")
    if recipe.mlp is None or recipe.mlp.kept is not None:
        raise UserError(f"{fix}, so the MLP's width takes the budget: add mlp: {{}} without mlp.kept")
    if recipe.allocation.method != "uniform":
        raise UserError(f"{fix} at every site; remove allocation.method {recipe.allocation.method}")


SLICING = Section("slicing", SlicingSpec, check_slicing)
ALLOCATION = Section("allocation", AllocationSpec, check_allocation)
