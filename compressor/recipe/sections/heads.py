"""The `heads` section: attention query heads as a pruning axis (issue 49)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import StrictBool, StrictInt, StrictStr

from compressor.errors import UserError
from compressor.recipe.sections.contract import Section, SectionContext, refuse_choice_keys
from compressor.validation import FORBID, Number, described, options

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe


@options(frozen=True, config=FORBID)
class HeadsSpec:
    """Query heads as an axis (`compressor.engine.heads`): every attention layer keeps `kept` of its
    query heads, the same number in every KV group, chosen by `selector`, the output projection
    refitted to what the dropped ones wrote; the residual width (and the MLP's) takes what the
    budget leaves. The saved model is the original class with fewer `num_attention_heads` and an
    explicit `head_dim`."""

    kept: (
        Annotated[Number, described("query heads kept per layer (a whole number), or a fraction of them below 1", gt=0)]
        | None
    ) = None
    """Query heads every attention layer keeps, a multiple of the KV heads in grouped-query attention
    (every KV group keeps as many), or that fraction of them rounded down to such a multiple. In
    multi-head attention a KV head goes with its query head. None: the run chooses the count with
    the split of the budget (`stages.split_choice`), every head kept among the candidates."""
    min_kept: Annotated[Number, described("the candidate counts keep at least this share of the heads", gt=0, lt=1)] = (
        0.5
    )
    """Without `kept`: the fewest heads (a share of them) a candidate count keeps."""
    candidates: Annotated[StrictInt, described("head counts the run measures, every head among them", ge=2)] = 2
    """Without `kept`: how many head counts are tried (each with the MLP's splits when `mlp` leaves its
    width open): every head, then the counts below it evenly spaced down to `min_kept`."""
    heldout_windows: Annotated[
        StrictInt, described("calibration-dataset windows after the calibration set, to measure the candidates", ge=1)
    ] = 16
    """Without `kept`: the windows each candidate's KL to the original is measured on (with `mlp` or
    `experts` also open, the largest of their counts)."""
    selector: StrictStr = "obs"
    """The head selector (`compress strategies` lists them): obs (output-aware: optimal brain
    surgeon over whole heads, weighed by H where the walk estimated it), norm (Minitron: the heads
    with the largest output)."""
    refit: StrictBool = True
    """Refit the output projection to what the dropped heads wrote (least squares on the calibration
    tokens); off: the kept heads' columns as they were."""
    damping: Annotated[Number, described("the refit's ridge, times the mean of diag C", gt=0)] = 0.01


def check_heads(spec: HeadsSpec, recipe: Recipe, context: SectionContext) -> HeadsSpec:
    """`heads.kept` is a whole number or a fraction below 1 (or absent: the run chooses, and only then
    do the choice's keys apply), and the selector is registered (the count is checked against the
    model's heads by the plan)."""
    if spec.kept is not None and spec.kept >= 1 and spec.kept != int(spec.kept):
        raise UserError(f"heads.kept {spec.kept:g}: give a whole number of heads, or a fraction below 1")
    if spec.kept is not None:
        refuse_choice_keys(
            "heads", spec, ("min_kept", "candidates", "heldout_windows"), "the run chooses the head count"
        )
    context.registry.head_selector(spec.selector)
    return spec


SECTION = Section("heads", HeadsSpec, check_heads)
