"""The `mlp` section: the MLP's intermediate width as a second axis under the same budget."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import StrictBool, StrictInt, StrictStr

from compressor.errors import UserError
from compressor.recipe.sections.contract import Section, SectionContext, refuse_choice_keys
from compressor.validation import FORBID, Number, described, options

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe


@options(frozen=True, config=FORBID)
class ReconstructSpec:
    """`mlp.reconstruct`: after each dense MLP is chosen and refitted, its kept weights (the input
    rows the refit cannot reach, and the down projection) are trained with Adam on the refit's own
    target per calibration token, weighed by H where the MLP writes (`engine.mlp_reconstruct`).
    Local to each MLP: no model output is involved. A share of the tokens is held out, and the
    weights of lowest error there are kept (the refit's among them)."""

    steps: Annotated[StrictInt, described("Adam steps per MLP", ge=1)] = 300
    lr: Annotated[Number, described("step size, times each weight's root mean square", gt=0)] = 0.005
    """Adam's step size for each parameter, relative to its root mean square, so that one value
    suits models whose weights differ in scale."""
    batch_tokens: Annotated[StrictInt, described("calibration tokens per step", ge=1)] = 2048
    heldout: Annotated[Number, described("share of the tokens held out to keep the best weights", gt=0, lt=1)] = 0.125


@options(frozen=True, config=FORBID)
class MlpSpec:
    """The MLP's width as a second axis (`compressor.engine.neurons`): every layer keeps `kept` of
    its intermediate neurons, chosen by `selector`, the down projection refitted to what the
    dropped ones wrote; the residual width then takes what the budget leaves. Without `kept` the
    run measures `candidates` splits of the budget (the residual width alone among them) and keeps
    the best (`compressor.stages.split_choice`)."""

    kept: (
        Annotated[Number, described("neurons kept per layer (a whole number), or a fraction of them below 1", gt=0)]
        | None
    ) = None
    """Neurons every layer's MLP keeps (an integer), or that fraction of its width, rounded down
    to a multiple of `round_to`; None: the run chooses the split of the budget. In a
    Mixture-of-Experts model, every routed expert's (`moe_intermediate_size`)."""
    shared_kept: (
        Annotated[
            Number, described("neurons every shared expert keeps (a whole number), or a fraction of them below 1", gt=0)
        ]
        | None
    ) = None
    """In a Mixture-of-Experts model with a shared expert (Qwen2-MoE, Qwen3.5-MoE), the neurons it
    keeps in every layer (`shared_expert_intermediate_size`), as `kept` reads them, chosen and
    refitted from every counted token weighed by its shared-expert gate; None: it keeps its width.
    A fixed setting: the split chooser, where it runs, chooses the routed experts' width beside it."""
    selector: StrictStr = "obs"
    """The neuron selector (`compress strategies` lists them): obs (output-aware: optimal brain
    surgeon weighed by H where the walk estimated it, except for families with a norm after the
    MLP, e.g. Gemma2), magnitude (Minitron-style), leverage (MoDeGPT)."""
    refit: StrictBool = True
    """Refit the down projection to what the dropped neurons wrote (least squares on the
    calibration tokens); off: the kept neurons' weights as they were."""
    feedback: Annotated[Number, described("share of the stream's error the refit takes back, 0 to 1", ge=0, le=1)] = 0.5
    """Error feedback: the refit reproduces what the layer's own neurons wrote plus this share of
    the difference between the stream the layer wrote before the MLP stage and the one it writes
    on the pruned stream (0: its own output only; 1: the whole stream as it was). Families with a
    norm after the MLP (Gemma2) and Mixture-of-Experts families run without it."""
    damping: Annotated[Number, described("the refit's ridge, times the mean of diag C", gt=0)] = 0.01
    """Above 0: a neuron that never fires (common after a ReLU) leaves C singular without it."""
    round_to: Annotated[StrictInt, described("a fraction's neuron count is a multiple of this", ge=1)] = 8
    min_kept: Annotated[Number, described("the plan's splits keep at least this share of the neurons", gt=0, lt=1)] = (
        0.25
    )
    """Without `kept`: the fewest neurons (a share of the MLP's width) a candidate split keeps."""
    candidates: Annotated[StrictInt, described("splits the plan measures, residual width alone among them", ge=2)] = 4
    """Without `kept`: how many splits of the budget are tried: the residual width alone, then
    residual widths evenly spaced up to the widest whose MLPs keep `min_kept` of their neurons;
    each is pruned and measured."""
    allocate_by: Literal["fisher", "energy"] = "fisher"
    """slicing.layout: heterogeneous: what weighs the error of each layer's MLP output when the
    layers' widths are allocated (`engine.mlp_widths`): fisher, H where the MLP writes (estimated
    on the model as loaded; the errors are then half the predicted KL, alike in every layer); energy,
    the plain squared error (no backward pass)."""
    remove_attention: StrictBool = False
    """slicing.layout: heterogeneous: the allocation may also remove a layer's attention (DeciLM's
    `no_op`), weighing its predicted error (what it writes, weighed as `allocate_by` says) against
    the neurons its parameters buy for the MLPs; off: every attention stays."""
    merge_kv_heads: StrictBool = False
    """slicing.layout: heterogeneous: the allocation may also give a layer fewer key-value heads
    (DeciLM's per-layer `n_heads_in_group`; any divisor of the model's count): consecutive KV heads
    merge into their mean and the output projection is refitted to what the attention wrote
    (`engine.kv_merge`), weighing the predicted error against the neurons the saved parameters buy;
    off: every attention keeps its KV heads."""
    search: (
        Annotated[StrictInt, described("allocations of the per-layer widths measured, the predicted one first", ge=2)]
        | None
    ) = None
    """slicing.layout: heterogeneous: after predicting the allocation, measure up to this many
    allocations from it (the predicted one first) on `heldout_windows` windows and keep the one of
    lowest KL (`engine.width_search`: an evolution that moves grid steps of neurons between layers'
    MLPs, each model assembled from the width curves' own solutions, so nothing is selected again).
    Each measurement is one pass of the model over the windows. None: the predicted allocation."""
    reconstruct: ReconstructSpec | None = None
    """Train each pruned dense MLP's kept weights on its refit's target after the refit (see
    `ReconstructSpec`; `{}` takes its defaults); None: the refit's weights are saved."""
    heldout_windows: Annotated[
        StrictInt, described("calibration-dataset windows after the calibration set, to measure the splits", ge=1)
    ] = 16
    """Without `kept`: the windows each split's KL to the original is measured on, read from the
    calibration dataset after its `num_samples` windows (text the walk never saw); with `search`,
    those each allocation is measured on."""
    screen_windows: (
        Annotated[StrictInt, described("calibration windows each split is pruned on while choosing", ge=1)]
        | Literal["auto"]
        | None
    ) = "auto"
    """Without `kept`: prune each split on this many calibration windows (evenly spread) while
    choosing, then prune the chosen one on every window with the run's own walk and MLP stage;
    choosing then costs about this share of the calibration per split instead of a whole pruning
    each. None: every split is pruned on every window and the chosen one's trial is kept. auto:
    a quarter of `calibration.num_samples` in a global layout of a dense model, where that quarter
    holds at least 8,192 tokens and 4 per MLP neuron, else None (`stages.split.resolved_choice`)."""
    measure_best: (
        Annotated[StrictInt, described("splits measured: those of lowest predicted KL", ge=1)] | Literal["auto"] | None
    ) = "auto"
    """Without `kept`, in a global layout: before any split is pruned, predict each one's KL from
    second-order estimates (the residual width's from the survey the walk runs anyway, the MLP's
    from each layer's refit error at the split's width, both weighed by H: `stages.split_prediction`),
    then prune and measure only this many, those predicted best (as many as `candidates`: every
    split predicted and measured, to check the prediction). None: every split is measured. auto: 2
    where the prediction applies and saves a measurement (a global layout of a dense model, no
    expert counts open, more than 2 splits, and a pipeline that estimates H anyway), else None."""


def check_mlp(spec: MlpSpec, recipe: Recipe, context: SectionContext) -> MlpSpec:
    """`mlp.kept` is a whole number or a fraction below 1 (or absent: the plan chooses the split, and
    only then do the split's keys apply), and the selector is registered."""
    for key in ("kept", "shared_kept"):
        value = getattr(spec, key)
        if value is not None and value >= 1 and value != int(value):
            raise UserError(f"mlp.{key} {value:g}: give a whole number of neurons, or a fraction below 1")
    if spec.kept is not None:
        measured = ("heldout_windows",) if spec.search is None else ()  # the search's windows
        keys = ("min_kept", "candidates", *measured, "screen_windows", "measure_best")
        idle = {"screen_windows": ("auto", None), "measure_best": ("auto", None)}  # what means nothing here
        refuse_choice_keys("mlp", spec, keys, "the plan chooses the split", idle=idle)
    if spec.allocate_by != "fisher" and recipe.slicing.layout != "heterogeneous":
        raise UserError(
            "mlp.allocate_by weighs the per-layer widths of slicing.layout: heterogeneous, and this recipe's "
            f"layout is {recipe.slicing.layout}; remove mlp.allocate_by, or set slicing.layout: heterogeneous"
        )
    if spec.remove_attention and recipe.slicing.layout != "heterogeneous":
        raise UserError(
            "mlp.remove_attention removes attentions in slicing.layout: heterogeneous (saved as DeciLM), and this "
            f"recipe's layout is {recipe.slicing.layout}; remove mlp.remove_attention, or set slicing.layout: "
            "heterogeneous"
        )
    if spec.merge_kv_heads and recipe.slicing.layout != "heterogeneous":
        raise UserError(
            "mlp.merge_kv_heads gives layers their own key-value heads in slicing.layout: heterogeneous (saved as "
            f"DeciLM), and this recipe's layout is {recipe.slicing.layout}; remove mlp.merge_kv_heads, or set "
            "slicing.layout: heterogeneous"
        )
    if spec.search is not None and recipe.slicing.layout != "heterogeneous":
        raise UserError(
            "mlp.search measures allocations of the per-layer widths of slicing.layout: heterogeneous, and this "
            f"recipe's layout is {recipe.slicing.layout}; remove mlp.search, or set slicing.layout: heterogeneous"
        )
    windows = recipe.calibration.num_samples
    if isinstance(spec.screen_windows, int) and spec.screen_windows >= windows:
        raise UserError(
            f"mlp.screen_windows {spec.screen_windows} is not fewer than the {windows} calibration windows "
            "(calibration.num_samples); lower it, or remove it to prune every split on every window"
        )
    if isinstance(spec.measure_best, int) and spec.measure_best > spec.candidates:
        raise UserError(
            f"mlp.measure_best {spec.measure_best} is more than the {spec.candidates} candidate splits "
            "(mlp.candidates); lower it (equal: every split predicted and measured)"
        )
    if isinstance(spec.measure_best, int) and recipe.slicing.layout != "global":
        raise UserError(
            "mlp.measure_best predicts the splits of one basis kept everywhere, and this recipe's layout is "
            f"{recipe.slicing.layout}; set slicing.layout: global, or remove mlp.measure_best"
        )
    context.registry.selector(spec.selector)
    return spec


SECTION = Section("mlp", MlpSpec, check_mlp)
