"""The built-in sections in the order their checks run: a recipe with several problems is told the
first of them, and a section's check sees the sections before it as checked (distillation takes its
data defaults from the calibration's, and refuses the evaluation's dataset)."""

from __future__ import annotations

from compressor.recipe.sections import (
    data,
    depth,
    distillation,
    evaluation,
    experts,
    heads,
    mlp,
    model,
    refinement,
    sensitivity,
    slicing,
)
from compressor.recipe.sections.contract import Section

BUILTIN_SECTIONS: tuple[Section, ...] = (
    slicing.ALLOCATION,
    refinement.SECTION,
    slicing.SLICING,
    mlp.SECTION,
    heads.SECTION,
    experts.SECTION,
    depth.SECTION,
    data.SECTION,
    evaluation.SECTION,
    distillation.SECTION,
    model.SECTION,
    sensitivity.SECTION,
)
