"""The `experts` section: the routed experts of a Mixture-of-Experts model as a pruning axis."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import StrictBool, StrictInt, StrictStr

from compressor.recipe.sections.contract import Section, SectionContext
from compressor.validation import FORBID, Number, described, options

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe


@options(frozen=True, config=FORBID)
class ExpertsSpec:
    """Every MoE layer keeps `kept` of its routed experts (the same count in every layer, as every
    stock loader needs), chosen by `selector` from what the calibration tokens did with each
    (`compressor.engine.experts`); the router loses the others' rows and each token re-picks its
    top-k among the rest. The residual width then takes what the budget leaves."""

    kept: Annotated[StrictInt, described("routed experts every MoE layer keeps", ge=1)]
    """Experts kept per layer: at least the experts each token uses (num_experts_per_tok)."""
    selector: StrictStr = "output"
    """The expert selector (`compress strategies` lists them): output (output-aware: the change of
    the block's output when an expert goes and each token re-picks its top-k, weighed by H where
    the walk estimated it), reap (REAP: routing weight × output norm over routed tokens),
    frequency (tokens routed)."""
    protect_super: StrictBool = True
    """Keep the super experts whatever the selector says: those whose largest output coordinate is
    `super_ratio` times the layer's median expert's (they carry the model's massive activations)."""
    super_ratio: Annotated[Number, described("a super expert's peak output over the layer's median expert's", gt=1)] = (
        10.0
    )
    sample_tokens: Annotated[
        StrictInt, described("calibration tokens an output-aware selector routes through every expert", ge=1)
    ] = 2048
    """The tokens `output` prices removals on, every n-th counted calibration token (the sample
    spans the calibration set): each runs through every expert of the layer (E/k times the
    block's own work on them)."""
    min_tokens: Annotated[StrictInt, described("fewest routed tokens per expert before the run warns", ge=1)] = 32
    """An expert the calibration routed fewer tokens to has noisy statistics: the run warns and
    says how many calibration windows would give it this many."""


def check_experts(spec: ExpertsSpec, recipe: Recipe, context: SectionContext) -> ExpertsSpec:
    """The selector is registered (the counts are checked against the model's config by the plan)."""
    context.registry.expert_selector(spec.selector)
    return spec


SECTION = Section("experts", ExpertsSpec, check_experts)
