"""The reports as typed models: `report.json` of a run (`RunReport`) and of `compress eval`
(`EvalReport`). The runner and the eval command build them field by field, and every reader (the
run's tables, `compress compare`, a sweep's plots and results) loads them back through them, so a
renamed or misspelt field fails where it is written or read instead of as a `KeyError` later.

Sections a step owns stay that step's type: the refinement, guard and distillation records are
their dataclasses, `slicing` is the recipe's `SlicingSpec`. Free-form on purpose: `speed` (the
nested measurement of `evaluation.throughput`, read only by `reports.report.speed_rows`), `stock`
(`models.stock.to_stock`'s record), a strategy's options and objectives, and lm-eval's scores.

A field that a report leaves out (a metric not measured, a site without reader correction) is
left out of the JSON too (`exclude_unset`), so the files read as they did when they were dicts.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch
import transformers
from pydantic import BaseModel, ConfigDict, ValidationError

from compressor.engine.experts import ExpertRecord
from compressor.engine.heads import HeadRecord
from compressor.engine.neurons import NeuronRecord
from compressor.engine.refine import RefinementRecord
from compressor.errors import UserError
from compressor.recipe.sections.slicing import SlicingSpec
from compressor.reports.guard import GuardRecord
from compressor.training.distill import DistillationRecord


class _Section(BaseModel):
    """Every section refuses a field it does not declare; NaN and infinities stay as JSON writes them."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class ModelInfo(_Section):
    path: str
    model_type: str
    family: str
    hidden_size: int
    num_layers: int
    dtype: str


class Allocation(_Section):
    """How the widths were chosen; with an allocator, its record (`CurveAllocator.to_json`) too."""

    method: str
    budget: int
    predicted_params: int
    transition_params: int
    shared_sites: list[str]
    solver: str | None = None
    predicted_kl: float | None = None
    curves: dict[str, dict[str, float]] | None = None
    """Per site group: predicted KL at each candidate width."""


class Parallel(_Section):
    world_size: int
    tokens_by_rank: list[int]


class Step(_Section):
    strategy: str
    options: dict[str, Any]


class Resume(_Section):
    sites_loaded: int
    fisher_loaded: bool


class Loading(_Section):
    """How the run held the model (`model.load` as run), and whether its walk wrote the sliced model
    as it went (`engine.written`): each layer written to model/ when finished, then dropped."""

    load: str
    written_as_it_goes: bool
    layers_written_before: int = 0
    """Layers a killed run had written and committed, which this run did not write again."""


class Figures(_Section):
    """One model's figures on the evaluation windows (`evaluation.metrics.compare`) and lm-eval suites."""

    ppl: float | None = None
    nll: float | None = None
    kl: float | None = None
    """KL(reference ‖ this model), nats per token (the pruned side only)."""
    tasks: dict[str, dict[str, Any]] | None = None
    """lm-eval scores, `{task: {metric: value}}`."""
    placement: dict[str, int] | None = None
    """Where accelerate placed the model lm-eval ran (`evaluation.device_map`): weight bytes per device."""


class Tokens(_Section):
    count: int


class Metrics(_Section):
    """The original (`baseline`) and the saved model (`pruned`), and the pruned model before a guarded step."""

    baseline: Figures | None = None
    pruned: Figures | None = None
    unrefined: Figures | None = None
    undistilled: Figures | None = None
    tokens: Tokens | None = None

    def measured(self) -> bool:
        return self.pruned is not None


class ModelSize(_Section):
    """`evaluation.throughput.model_size`."""

    params: int
    weight_bytes: int
    transition_params: int


class Sizes(_Section):
    baseline: ModelSize | None = None
    pruned: ModelSize


class Params(_Section):
    baseline: int
    pruned: int
    ratio: float


class Site(_Section):
    """`engine.pooling.SiteRecord.to_json`: one site's width, what it kept, and each step's objectives."""

    name: str
    width: int
    kept: int
    tokens: int
    strategy: str
    steps: list[dict[str, Any]]
    pooled_with: list[str] | None = None
    correction: dict[str, float] | None = None


class SplitCandidate(_Section):
    """One split of the budget the run measured: the residual width, the MLP's, and the model's
    KL to the original on the split's held-out windows (the model as it would be saved, before
    refinement and distillation)."""

    width: int
    mlp_kept: int
    params: int
    heldout_kl: float | None
    """None: not measured (`mlp.measure_best` left it out by its prediction)."""
    experts: int | None = None
    """Routed experts every MoE layer kept (`experts` without `kept`); None: every expert."""
    heads: int | None = None
    """Query heads every attention layer kept (`heads`); None: every head."""
    removed_blocks: list[int] | None = None
    """`depth` without `removed`: the original's decoder blocks it was without; None: every block."""
    active_params: int | None = None
    """Parameters one token uses (a model with routed experts)."""
    prune_s: float | None = None
    """Seconds its pruning took: the walk (less the shared H pass), experts, heads and MLP stages;
    not its held-out measurement. The chosen one's is what choosing is weighed against."""
    predicted_kl: float | None = None
    """`mlp.measure_best`: its KL predicted before any split was pruned (`stages.split_prediction`)."""


class SplitRecord(_Section):
    """`mlp.split` (or `experts.split` without `mlp`): how the run chose the split (`mlp` or
    `experts` without `kept`, `models.split`)."""

    windows: int
    """Held-out windows of the calibration dataset each candidate was measured on."""
    candidates: list[SplitCandidate]
    chosen: int
    """The index of the candidate the run kept: the lowest held-out KL."""
    screen_windows: int | None = None
    """`mlp.screen_windows`: the calibration windows each candidate was pruned on while choosing
    (the chosen one was then pruned on all of them); None: every window, the chosen trial kept."""
    survey_passes: int | None = None
    """Surveys of the original model the candidates' walks ran (global layout, tied head): one,
    recalled by the rest (`engine.survey.SurveyMemo`); 0 where no walk needed one."""
    measure_best: int | None = None
    """`mlp.measure_best`: how many of the splits, those of lowest predicted KL, were measured."""
    predict_s: float | None = None
    """Seconds spent predicting the splits (the survey and the MLPs' curves, less H), part of choosing."""


class WidthSearchRecord(_Section):
    """`mlp.search` (`engine.width_search`): allocations measured on held-out windows from the
    predicted one (`predicted`, KL `predicted_kl`); `widths` in `mlp` are where it ended (KL `kl`,
    each MLP as the curves' solution on the unpruned model: the saved model is then pruned in order)."""

    measured: int
    accepted: int
    windows: int
    tokens: int
    predicted: list[int]
    predicted_kl: float
    kl: float


class MlpReport(_Section):
    """`mlp`: the MLP's width, the second axis (`engine.neurons`); no layers when the choice kept
    every neuron (the residual width alone was the best split)."""

    kept: int
    of: int
    selector: str
    refit: bool
    damping: float
    shared_kept: int | None = None
    shared_of: int | None = None
    """The neurons every shared expert kept, of its width (`mlp.shared_kept`); None: it kept them all."""
    feedback: float = 0.0
    """The refit's error feedback (`engine.neurons`; 0 in reports from before it existed)."""
    weighed_by_h: bool
    """Whether the selector was given H of each MLP's stream (the walk estimated it)."""
    layers: list[NeuronRecord]
    split: SplitRecord | None = None
    widths: list[int] | None = None
    """`slicing.layout: heterogeneous`: each layer's MLP width (0: the FFN removed), allocated by
    `width_errors` under the uniform width's total (`engine.mlp_widths`)."""
    width_errors: list[dict[int, float]] | None = None
    """Per layer, the predicted error of its MLP's output at each width of the grid."""
    attention_removed: list[int] | None = None
    """`mlp.remove_attention`: the layers whose attention the allocation removed (DeciLM `no_op`)."""
    attention_errors: list[float | None] | None = None
    """`mlp.remove_attention`: per layer, the predicted error of removing its attention."""
    attention_units: int | None = None
    """`mlp.remove_attention` or `mlp.merge_kv_heads`: the neurons one layer's attention counted as in the allocation."""
    kv_heads: list[int] | None = None
    """`mlp.merge_kv_heads`: each layer's KV heads as saved (DeciLM's `n_heads_in_group` = heads / this; 0: removed)."""
    kv_errors: list[dict[int, float]] | None = None
    """`mlp.merge_kv_heads`: per layer, the predicted error at each fewer KV-head count (its output projection refitted)."""
    kv_units: dict[int, int] | None = None
    """`mlp.merge_kv_heads`: the neurons one layer's attention counted as at each fewer KV-head count."""
    search: WidthSearchRecord | None = None
    """`mlp.search`: the allocations measured from the predicted one, and what they found."""


class ExpertsReport(_Section):
    """`experts`: the routed experts every MoE layer kept (`engine.experts`), and per layer which,
    the routed tokens each expert saw and the selector's own figures."""

    kept: int
    of: int
    selector: str
    protect_super: bool
    fewest_tokens: int
    """The fewest calibration tokens any expert of any layer was routed."""
    layers: list[ExpertRecord]
    split: SplitRecord | None = None
    """How the run chose the expert count, where no `mlp` section holds the record (`mlp.split`)."""


class DepthCandidate(_Section):
    """`depth` without `removed`: one count's blocks, the selector's choice for that count, and the
    KL of the original without them alone (nothing else pruned) where it was measured."""

    removed: list[int]
    """Their indices in the original model, ascending."""
    heldout_kl: float | None = None
    objectives: dict[str, Any] = {}


class DepthReport(_Section):
    """`depth`: the decoder blocks the run removed before the walk (`stages.depth`), by which
    selector, every block's influence, and what a measuring selector measured; without `removed`,
    each candidate count's blocks and the split choice's record."""

    removed: list[int]
    """The removed blocks' indices in the original model, ascending (without `removed`: the chosen
    candidate's, none where it keeps every block)."""
    of: int
    selector: str
    influence: list[float]
    """Every original block's 1 − cos(x_in, x_out) over the counted calibration tokens."""
    heldout_windows: int = 0
    """The windows a measuring selector priced removals on (0: it measured nothing)."""
    measurements: int = 0
    """Forward passes over those windows (each a set of blocks removed)."""
    heldout_kl: float | None = None
    """KL(original ‖ the model without the removed blocks, nothing else pruned) on those windows."""
    objectives: dict[str, Any] = {}
    """The selector's own figures."""
    candidates: list[DepthCandidate] | None = None
    """Without `removed`: the blocks of every candidate count above none, as the split choice measured them."""
    split: SplitRecord | None = None
    """Without `removed`, where no `mlp`, `experts` or `heads` holds it: the split choice's record."""


class HeadsReport(_Section):
    """`heads`: the query heads every attention layer kept (`engine.heads`), of how many, and per
    layer which, with the output projection's relative errors before and after its refit."""

    kept: int
    of: int
    head_dim: int
    selector: str
    refit: bool
    damping: float
    weighed_by_h: bool
    """Whether the selector was given H of each attention's stream (the walk estimated it)."""
    layers: list[HeadRecord]
    split: SplitRecord | None = None
    """`heads` without `kept` and no `mlp` or `experts` to hold it: how the run chose the count
    (with every head kept, `kept` is `of` and there are no layers)."""


class Environment(_Section):
    device: str
    torch: str
    transformers: str
    python: str
    threads: int | None = None
    """torch's CPU threads (`runtime.threads`)."""

    @classmethod
    def here(cls, device: object) -> Environment:
        """This process's: the device, the versions and torch's CPU threads."""
        return cls(
            device=str(device),
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=platform.python_version(),
            threads=torch.get_num_threads(),
        )


class EstimatedPhase(_Section):
    name: str
    seconds: float | None
    """None: not estimated."""
    key: str | None = None
    """The `timings` key it is measured under."""


class Estimate(_Section):
    """`compress run`'s time plan, made before any weight loaded (`plan.timing`): what the run's
    `timings` can be held against."""

    total_s: float
    phases: list[EstimatedPhase]
    measured_s: float
    """Seconds the measurement of one layer took."""
    unestimated: list[str] = []
    """Stages that gave no estimate (a plugin's)."""


class DecodeTrial(_Section):
    """One probe of the decode search: a candidate planned at `target_params` and timed."""

    target_params: float
    label: str | None = None
    """The candidate's shape at that budget (`width 504, MLP 1160`)."""
    ratio: float | None = None
    """Its decode time per token over the dense model's; None: the budget left it no width (`refused`)."""
    refused: str | None = None


class DecodeCandidate(_Section):
    """One candidate's decode budget: its group (`plan.checks.group_key`: blocks, experts, heads) and
    its place among the group's splits."""

    group: str
    place: int
    label: str
    target_params: float
    """The largest parameter budget probed at which it decoded within the target."""
    ratio: float
    """Its measured decode time over the dense model's, at that budget."""
    trials: list[DecodeTrial]


class DecodeBudget(_Section):
    """`target_decode`: the parameter budget of each candidate, found by timing models of its shape
    against the dense model (`plan.decode_budget`)."""

    target: float
    """The most of the dense model's decode time per token the pruned model may take."""
    ceiling: float
    """The highest parameter budget searched (`target_params`, or 1)."""
    device: str
    dtype: str
    prompt_len: int
    decode_tokens: int
    repeats: int
    candidates: list[DecodeCandidate]
    seconds: float
    """What the search took (building and timing the models)."""
    reused: bool = False
    """Read back from an interrupted run's checkpoint instead of measured again."""

    def budgets(self) -> dict[str, dict[int | None, float]]:
        """Each candidate's parameter budget by group and place, what `plan.checks.plan` plans it at."""
        budgets: dict[str, dict[int | None, float]] = {}
        for candidate in self.candidates:
            budgets.setdefault(candidate.group, {})[candidate.place] = candidate.target_params
        return budgets


class RunReport(_Section):
    """`report.json` of `compress run`."""

    compressor: str
    model: ModelInfo
    sparsity: float | None
    target_params: float | None
    target_active_params: float | None = None
    decode: DecodeBudget | None = None
    """`target_decode`: the decode search's budgets and measurements (None without it)."""
    kept_width: int | None
    layout: str
    stock: dict[str, Any] | None
    """The stock export of a global layout (`models.stock.to_stock`): its head, tied scale and fit."""
    rounding: dict[str, int] | None
    allocation: Allocation
    seed: int
    parallel: Parallel
    pipeline: list[Step]
    slicing: SlicingSpec
    fingerprint: dict[str, str]
    resumed_from: str | None
    resume: Resume
    loading: Loading | None = None
    fisher_source: str | None
    fisher_autocast: str | None
    refinement: RefinementRecord | None
    guards: list[GuardRecord]
    distillation: DistillationRecord | None
    mlp: MlpReport | None = None
    experts: ExpertsReport | None = None
    depth: DepthReport | None = None
    heads: HeadsReport | None = None
    stages: dict[str, Any] = {}
    """What each plugin stage recorded (`RunState.extra`), by stage name."""
    metrics: Metrics
    params: Params
    active_params: Params | None = None
    """The parameters one token uses (a model with routed experts: top-k of each layer's), from the
    layout's exact polynomial; None for a model without routed experts."""
    size: Sizes
    speed: dict[str, Any] | None
    warnings: list[str]
    sites: list[Site]
    timings: dict[str, float]
    estimate: Estimate | None = None
    """The time plan `compress run` made before it started (None: run from Python, or an older report)."""
    environment: Environment

    def write(self, path: Path) -> None:
        path.write_text(to_json(self))

    @classmethod
    def read(cls, path: Path | str) -> RunReport:
        """The report in `path`, or one line saying why it is not a run report of this version."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as error:
            raise UserError(f"cannot read {path}: {error}") from None
        try:
            return cls.model_validate(json.loads(text))
        except ValueError as error:  # JSONDecodeError and ValidationError
            detail = _first_error(error) if isinstance(error, ValidationError) else str(error)
            raise UserError(f"{path} is not a run report of compressor {_version()} ({detail})") from None


class EvalReport(_Section):
    """`compress eval --output`."""

    compressor: str
    target: str
    size: Sizes
    speed: dict[str, Any] | None
    reference: str | None
    evaluation: dict[str, Any] | None
    """The evaluation windows' settings (`recipe.sections.data.DataSpec`), None with tasks only."""
    metrics: Metrics
    timings: dict[str, float]
    environment: Environment


def to_json(report: BaseModel) -> str:
    """The report as `json.dumps(indent=2)` wrote its dict: the fields set, in order, NaN as NaN."""
    return json.dumps(report.model_dump(exclude_unset=True), indent=2) + "\n"


def _first_error(error: ValidationError) -> str:
    """The fields a report lacks (the first few), else its first wrong field."""
    missing = [".".join(map(str, e["loc"])) for e in error.errors() if e["type"] == "missing"]
    if missing:
        return "no " + ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    first = error.errors()[0]
    return f"{'.'.join(map(str, first['loc']))}: {first['msg']}"


def _version() -> str:
    import compressor

    return compressor.__version__
