"""The `depth` section: whole decoder blocks as a pruning axis (issue 49)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import StrictInt, StrictStr

from compressor.errors import UserError
from compressor.recipe.sections.contract import Section, SectionContext, refuse_choice_keys
from compressor.validation import FORBID, described, options

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe


@options(frozen=True, config=FORBID)
class DepthSpec:
    """`removed` whole decoder blocks go before the walk, chosen by `selector` on the original
    model (`compressor.engine.depth`); the model without them is what the rest of the run prunes,
    and it saves as the original class with fewer layers. The residual width (and the MLP's, with
    `mlp`) then takes what the budget leaves. Without `removed` the count is a candidate axis of
    the split choice (`stages.split_choice`): every block kept, then up to `max_removed` blocks."""

    removed: Annotated[StrictInt, described("decoder blocks removed", ge=1)] | None = None
    """How many blocks go (at least one block stays; the plan refuses more). None: the run chooses
    the count with the split of the budget, every block kept among the candidates."""
    max_removed: Annotated[StrictInt, described("the most blocks a candidate count removes", ge=1)] | None = None
    """Without `removed`: the most blocks a candidate removes (None: a quarter of the model's
    blocks, at least one)."""
    candidates: Annotated[StrictInt, described("block counts the run measures, every block kept among them", ge=2)] = 2
    """Without `removed`: how many block counts are tried (each with the MLP's splits when `mlp` leaves
    its width open): none removed, then counts evenly spaced up to `max_removed`; each count's blocks
    are the selector's choice for that count."""
    selector: StrictStr = "kl"
    """The depth selector (`compress strategies` lists them): kl (greedy: each step removes the
    block whose removal gives the lowest KL to the original on `heldout_windows`, measured), or
    influence (ShortGPT: the blocks whose output stream is most like their input, 1 − cos)."""
    shortlist: Annotated[StrictInt, described("blocks a measuring selector measures per step", ge=1)] | None = None
    """For a measuring selector (kl): at each step measure only this many blocks left, those of
    lowest influence (None: every block left, L + (L−1) + … forward passes over the windows)."""
    heldout_windows: Annotated[
        StrictInt, described("calibration-dataset windows after the calibration set, to measure removals on", ge=1)
    ] = 8
    """The windows a measuring selector prices each removal on (its KL to the original). Without
    `removed` also the windows each candidate's KL is measured on (with `mlp`, `experts` or `heads`
    also open, the largest of their counts), and the windows each count's removal alone is measured
    on for `mlp.measure_best`'s prediction."""


def check_depth(spec: DepthSpec, recipe: Recipe, context: SectionContext) -> DepthSpec:
    """The selector is registered, the options that only a measuring one reads come with one, and the
    choice's keys come without `removed` (the counts are checked against the model's blocks by the plan)."""
    selector = context.registry.block_selector(spec.selector)
    if spec.removed is not None:
        refuse_choice_keys("depth", spec, ("max_removed", "candidates"), "the run chooses the block count", "removed")
    if "measure" not in selector.requires:
        keys = ("shortlist", "heldout_windows") if spec.removed is not None else ("shortlist",)
        for key in keys:
            if getattr(spec, key) != getattr(DepthSpec(removed=spec.removed), key):
                raise UserError(
                    f"depth.{key} applies to a selector that measures (kl), but depth.selector is "
                    f"'{spec.selector}'; remove depth.{key}"
                )
    return spec


SECTION = Section("depth", DepthSpec, check_depth)
