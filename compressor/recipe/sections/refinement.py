"""The `refinement` section: the walk's bases refined end to end on the output KL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import StrictInt

from compressor.errors import UserError
from compressor.recipe.sections.contract import Section, SectionContext
from compressor.validation import FORBID, Number, described, options

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe


@options(frozen=True, config=FORBID)
class RefinementSpec:
    """End-to-end refinement of the walk's bases against the output KL (`compressor.engine.refine`)."""

    epochs: Annotated[Number, described("passes over the calibration windows", gt=0)] = 1.0
    """Passes over its windows (one Riemannian Adam step per batch)."""
    windows: Annotated[StrictInt, described("or null for all calibration windows", ge=1)] | None = None
    """How many calibration windows it uses (evenly spaced); None: all."""
    lr: Annotated[Number, described("the Riemannian Adam step size", gt=0)] = 0.02
    batch_size: Annotated[StrictInt, described("calibration windows per step", ge=1)] = 4
    """Calibration windows per step."""
    top_k: Annotated[StrictInt, described("0 keeps the whole distribution", ge=0)] = 64
    """Teacher probabilities kept per token (the rest is one bin); 0 keeps the whole distribution."""
    heldout_windows: Annotated[
        StrictInt, described("calibration-dataset windows after the calibration set, for the held-out guard", ge=1)
    ] = 16
    """The guard's windows: read from the calibration dataset after the `num_samples` windows the
    walk and refinement use. The refined model is kept only when its KL to the original on them,
    saved as it will be, is not above the received model's."""


def check_refinement(spec: RefinementSpec, recipe: Recipe, context: SectionContext) -> RefinementSpec:
    if recipe.slicing.correct_readers:
        raise UserError(
            "refinement cannot follow slicing.correct_readers: it optimises the bases of a model "
            "whose readers are its bases; turn one of them off"
        )
    return spec


SECTION = Section("refinement", RefinementSpec, check_refinement)
