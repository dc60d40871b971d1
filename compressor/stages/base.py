"""The one state the stages of a run share (`RunState`): what the runner hands them, and every
field a stage hands the next, declared here and nowhere else."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from compressor.data.batches import Batch
from compressor.engine.checkpoint import Checkpoint
from compressor.engine.experts import ExpertRecord
from compressor.engine.heads import HeadRecord
from compressor.engine.mlp_widths import WidthCurve
from compressor.engine.neurons import NeuronRecord
from compressor.engine.parallel import Ranks
from compressor.engine.refine import RefinementRecord
from compressor.engine.survey import SurveyMemo
from compressor.engine.walk_options import PruneResult
from compressor.evaluation.metrics import compare
from compressor.models.depth import remove_blocks
from compressor.models.sites import EMBEDDING
from compressor.models.stock import head_stream
from compressor.recipe.schema import Recipe
from compressor.reports.guard import GuardRecord
from compressor.reports.report_model import (
    DecodeBudget,
    DepthReport,
    Estimate,
    RunReport,
    SplitRecord,
    WidthSearchRecord,
)
from compressor.runtime.loading import Resources
from compressor.runtime.resume import fisher_key

if TYPE_CHECKING:
    from compressor.plan.checks import Plan
    from compressor.training.distill import DistillationRecord
    from compressor.training.teachers import DistillationData

Progress = Callable[[str, int, int], None]


@dataclass(eq=False)
class RunState:
    """Everything the stages of one run share: what the runner hands them, and what each stage
    hands the next (every field declared here, typed; `tests/run/test_stages.py` holds stages to it)."""

    staging: Path
    recipe: Recipe
    checked: Plan
    device: torch.device
    checkpoint: Checkpoint
    progress: Progress
    resources: Resources
    ranks: Ranks
    save_model: bool = True
    warn: Callable[[str], None] = lambda _: None
    started: float = field(default_factory=time.perf_counter)
    writes: bool = False
    """The walk writes model/ as it goes (a streamed run with nothing after the walk that changes
    the model whole); the pruned model's layers are then read back from there."""
    warnings: list[str] = field(default_factory=list)
    """Said during the run (a guarded step handed back), beside the plan's warnings in the report."""
    guards: list[GuardRecord] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    decode: DecodeBudget | None = None
    """`target_decode`: the budgets the decode search found (`plan.decode_budget`), kept in the checkpoint."""
    heldout: list[Batch] = field(default_factory=list)
    """The guard's held-out windows."""
    measuring_windows: dict[str, list[Batch]] = field(default_factory=dict)
    """The held-out windows an unguarded stage measures on (the split choice's, a measuring depth
    selector's), by stage name."""
    # data
    tokenizer: Any = None
    calibration: list[Batch] = field(default_factory=list)
    evaluation: list[Batch] | None = None
    distillation_rows: DistillationData | None = None
    # load
    model: PreTrainedModel | None = None
    baseline_params: int = 0
    baseline_size: dict[str, int] = field(default_factory=dict)
    fingerprint: dict[str, str] = field(default_factory=dict)
    # depth
    removed_blocks: list[int] = field(default_factory=list)
    """The decoder blocks the depth stage removed (original indices): every model the later stages
    prune is the original without them (`model_to_prune`)."""
    depth: DepthReport | None = None
    # split
    split: SplitRecord | None = None
    """`mlp` without `kept`: the splits measured and the one chosen."""
    split_fisher_source: str | None = None
    """Where the splits' H came from: "computed" by the first split (and checkpointed before the
    run's walk read it), or "checkpoint" of a run killed while choosing; the report says this
    rather than what the run's walk (or the adopted trial's) was handed."""
    best_trial: tuple[float, int, RunState] | None = None
    """While choosing without refinement: the lowest-KL split measured so far, as pruned (its KL, index, state)."""
    split_prune_s: dict[int, float] = field(default_factory=dict)
    """Each split's own pruning time while choosing, by index (`SplitCandidate.prune_s`)."""
    survey: SurveyMemo | None = None
    """While choosing a split: the survey of the original model, measured by the first trial's walk
    and recalled by the others' and the run's (`engine.survey.SurveyMemo`)."""
    adopted: bool = False
    """The chosen split's trial walk and MLP stage are the run's (no refinement between them): not pruned twice."""
    # walk, then the stages after it, each handing the model on
    result: PruneResult | None = None
    pruned: PreTrainedModel | None = None
    bases: dict[str, torch.Tensor] = field(default_factory=dict)
    head_scale: torch.Tensor | None = None
    """A stock tied head's final-norm diagonal, from the symmetric fit or refinement (None: the
    diagonal fit at saving, `stock.tied_scale`)."""
    head_fit: str = "diagonal"
    """How that diagonal was found, for the report: diagonal, symmetric (rotated), refined."""
    config: Any = None
    """The pruned model's config as the stages leave it (the MLP stage's width)."""
    refinement: RefinementRecord | None = None
    unrefined: PreTrainedModel | None = None
    """The model before refinement, as it would be saved: evaluated beside the refined one."""
    stock: dict[str, Any] | None = None
    neurons: list[NeuronRecord] = field(default_factory=list)
    """`mlp`: what each layer's MLP kept."""
    mlp_weighed_by_h: bool = False
    mlp_widths: list[int] | None = None
    """`slicing.layout: heterogeneous`: each layer's MLP width (0: its FFN removed)."""
    attention_removed: list[int] | None = None
    """`mlp.remove_attention`: the layers whose attention the allocation removed."""
    attention_units: int = 0
    """`mlp.remove_attention` or `mlp.merge_kv_heads`: the neurons a layer's attention counts as in the allocation."""
    kv_heads: list[int] | None = None
    """`mlp.merge_kv_heads`: each layer's KV heads as the allocation left them (0: its attention removed)."""
    kv_units: dict[int, int] = field(default_factory=dict)
    """`mlp.merge_kv_heads`: the neurons an attention counts as at each fewer KV-head count."""
    width_curves: list[WidthCurve] = field(default_factory=list)
    """`slicing.layout: heterogeneous`: each layer's predicted error by width, that chose them."""
    width_search: WidthSearchRecord | None = None
    """`mlp.search`: what measuring allocations found."""
    heads: list[HeadRecord] = field(default_factory=list)
    """`heads`: what each attention layer kept."""
    heads_weighed_by_h: bool = False
    experts: list[ExpertRecord] = field(default_factory=list)
    """`experts`: what each MoE layer kept."""
    distillation: DistillationRecord | None = None
    undistilled: dict[str, float] | None = None
    original: PreTrainedModel | None = None
    """The original model a stage loaded whole and a later one reuses (the distillation's teacher)."""
    # evaluate
    metrics: dict[str, Any] = field(default_factory=dict)
    speed: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """What a plugin stage records for the report (`report.json`'s `stages`), by stage name."""
    report: RunReport | None = None
    estimate: Estimate | None = None
    """`compress run`'s time plan, made before the run started (`plan.timing`), for the report."""

    def __post_init__(self) -> None:
        if self.config is None:
            self.config = self.checked.layout.config

    @property
    def family(self) -> Any:
        return self.checked.layout.family

    @property
    def one_basis(self) -> bool:
        return self.checked.layout.one_basis

    @property
    def keep_tied(self) -> bool | None:
        return False if self.one_basis else None  # a global layout's head is decided by its stock conversion

    @contextmanager
    def timed(self, key: str | None) -> Iterator[None]:
        tick = time.perf_counter()
        yield
        if key is not None:
            self.timings[key] = time.perf_counter() - tick

    def model_to_prune(self) -> PreTrainedModel:
        """A fresh copy of the model the walk prunes (the caller may change it): the original,
        without the blocks the depth stage removed."""
        model = self.resources.model(self.recipe.model)
        if self.removed_blocks:
            remove_blocks(model, self.family, self.removed_blocks)
        return model

    def fisher_key(self, data: str | None = None) -> str:
        """What H of the model the walk prunes depends on (the original without the removed blocks),
        on the run's data or on `data` (another data fingerprint: a screened trial's)."""
        model = self.fingerprint["model"] + "".join(f"-{block}" for block in self.removed_blocks)
        return fisher_key(self.recipe, model, data or self.fingerprint["data"], self.device)

    def head_stream(self) -> torch.Tensor | None:
        assert self.result is not None
        return head_stream(self.result.head_moment, self.bases[EMBEDDING])

    def as_saved(self, sliced: PreTrainedModel, scale: torch.Tensor | None) -> PreTrainedModel:
        """The model as the run would save it, in the format the plan chose (`stages.exporters`): a
        global layout's stock model (its tied head with the diagonal `scale`, or fitted), a per-site
        layout's sliced model itself."""
        return self.checked.exporter.as_saved(self, sliced, scale)

    def heldout_kl(self, original: PreTrainedModel, sliced: PreTrainedModel, scale: torch.Tensor | None) -> float:
        """KL(original ‖ the model as it would be saved) on the guard's held-out windows."""
        saved = self.as_saved(sliced, scale).to(self.device)
        return compare(original, saved, self.heldout, self.device)["pruned"]["kl"]

    def record_guard(self, guard: GuardRecord) -> None:
        """A guarded step's verdict: in the report, and said in one line when the step was undone."""
        self.guards.append(guard)
        if not guard.kept:
            self.warnings.append(guard.line())
            self.warn(guard.line())


@contextmanager
def on_device(model: PreTrainedModel, device: torch.device) -> Iterator[None]:
    """`model` whole on `device`, without gradients, while the block runs (a stage that measures
    candidates on held-out windows), then back where it was."""
    home = next(model.parameters()).device
    model.to(device)
    try:
        with torch.no_grad():
            yield
    finally:
        model.to(home)
