"""The `experts` section: the routed experts of a Mixture-of-Experts model as a pruning axis."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import StrictBool, StrictInt, StrictStr

from compressor.errors import UserError
from compressor.recipe.sections.contract import Section, SectionContext, refuse_choice_keys
from compressor.validation import FORBID, Number, described, options

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe


@options(frozen=True, config=FORBID)
class ExpertsSpec:
    """Every MoE layer keeps `kept` of its routed experts (the same count in every layer, as every
    stock loader needs), chosen by `selector` from what the calibration tokens did with each
    (`compressor.engine.experts`); the router loses the others' rows and each token re-picks its
    top-k among the rest. The residual width then takes what the budget leaves. Without `kept` the
    run measures `candidates` expert counts, each with the residual width (and, with `mlp` but no
    `mlp.kept`, the experts' width) the budget leaves it, and keeps the best (`stages.split_choice`)."""

    kept: Annotated[StrictInt, described("routed experts every MoE layer keeps", ge=1)] | None = None
    """Experts kept per layer: at least the experts each token uses (num_experts_per_tok); None:
    the run chooses the count with the split of the budget."""
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
    router_refit: StrictBool = False
    """After each layer loses its experts, rescale the kept router rows (and shift its bias, where
    it has one) so the block writes what it wrote with all of them, priced on the `sample_tokens`
    sample under H where the pipeline estimates it (else with the stream's coordinates alike) (`engine.router_refit`); kept only where it lowers that cost on a
    held-out quarter of the sample."""
    router_steps: Annotated[StrictInt, described("rounds of the router refit's coordinate search", ge=1)] = 20
    min_tokens: Annotated[StrictInt, described("fewest routed tokens per expert before the run warns", ge=1)] = 32
    """An expert the calibration routed fewer tokens to has noisy statistics: the run warns and
    says how many calibration windows would give it this many."""
    min_kept: Annotated[
        Number, described("the fewest experts a candidate count keeps, a share of them", gt=0, le=1)
    ] = 0.5
    """Without `kept`: the candidate counts run from every expert down to this share of them (never
    below the experts a token uses)."""
    candidates: Annotated[StrictInt, described("expert counts the run measures, every expert among them", ge=2)] = 3
    """Without `kept`: how many expert counts are tried, evenly spaced from every expert down to
    `min_kept` of them; each with its residual (and experts') width is pruned and measured."""
    heldout_windows: Annotated[
        StrictInt, described("calibration-dataset windows after the calibration set, to measure the counts", ge=1)
    ] = 16
    """Without `kept`: the windows each candidate's KL to the original is measured on (with `mlp`
    choosing too, the larger of the two sections' counts)."""


def check_experts(spec: ExpertsSpec, recipe: Recipe, context: SectionContext) -> ExpertsSpec:
    """The selector is registered and the choice's keys come without `kept` (the counts are checked
    against the model's config by the plan)."""
    if spec.kept is not None:
        refuse_choice_keys(
            "experts", spec, ("min_kept", "candidates", "heldout_windows"), "the run chooses the expert count"
        )
    if not spec.router_refit and spec.router_steps != ExpertsSpec().router_steps:
        raise UserError(
            "experts.router_steps applies to the router refit; set experts.router_refit: true, or remove it"
        )
    context.registry.expert_selector(spec.selector)
    return spec


SECTION = Section("experts", ExpertsSpec, check_experts)
