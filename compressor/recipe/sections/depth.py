"""The `depth` section: whole decoder blocks as a pruning axis (issue 49)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import StrictInt, StrictStr

from compressor.errors import UserError
from compressor.recipe.sections.contract import Section, SectionContext
from compressor.validation import FORBID, described, options

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe


@options(frozen=True, config=FORBID)
class DepthSpec:
    """`removed` whole decoder blocks go before the walk, chosen by `selector` on the original
    model (`compressor.engine.depth`); the model without them is what the rest of the run prunes,
    and it saves as the original class with fewer layers. The residual width (and the MLP's, with
    `mlp`) then takes what the budget leaves."""

    removed: Annotated[StrictInt, described("decoder blocks removed", ge=1)]
    """How many blocks go (at least one block stays; the plan refuses more)."""
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
    """The windows a measuring selector prices each removal on (its KL to the original)."""


def check_depth(spec: DepthSpec, recipe: Recipe, context: SectionContext) -> DepthSpec:
    """The selector is registered, and the options that only a measuring one reads come with one
    (the count is checked against the model's blocks by the plan)."""
    selector = context.registry.block_selector(spec.selector)
    if "measure" not in selector.requires:
        for key in ("shortlist", "heldout_windows"):
            if getattr(spec, key) != getattr(DepthSpec(removed=spec.removed), key):
                raise UserError(
                    f"depth.{key} applies to a selector that measures (kl), but depth.selector is "
                    f"'{spec.selector}'; remove depth.{key}"
                )
    return spec


SECTION = Section("depth", DepthSpec, check_depth)
