"""One `compress run`: check everything, load, prune, save, evaluate, report.

All checks that need no weights (recipe, model config, family, widths, device) happen
before any work (`run.checks`). The run writes into a hidden staging folder beside the output
(`.<name>.partial`) and renames it into place only when everything succeeded, so a failed
run leaves no half-written output. The staging folder also holds the run's checkpoint: a run
that was killed or interrupted after H or a site was finished keeps it, and the same command
continues from there (`restart=True` discards it). Folders, lock and publishing live in
`run.staging`, loading in `run.loading`, fingerprints in `run.resume`; here is the order of a run
(`run`) and its stages (`_Stages`: read data, load, walk, refine, distil, save, evaluate, report).
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
import yaml
from transformers import PreTrainedModel

import compressor
from compressor import faults
from compressor.data.batches import Batch
from compressor.engine import parallel
from compressor.engine.activations import ActivationStore
from compressor.engine.bases import BASES_FILE, READERS_FILE, apply_bases, save_bases
from compressor.engine.checkpoint import DISTILLATION_FOLDER, Checkpoint, model_digest, tensor_digest
from compressor.engine.fisher import autocast_dtype
from compressor.engine.neurons import NeuronRecord, prune_mlp
from compressor.engine.parallel import Ranks
from compressor.engine.refine import RefinementRecord, refine_bases
from compressor.engine.walk import PruneResult, WalkOptions, prune
from compressor.errors import Interrupts, ProgressKept, UserError
from compressor.evaluation.metrics import compare, evaluate_models, parameter_count
from compressor.evaluation.plots import distillation_figure, split_figure
from compressor.evaluation.throughput import compare_speed, cost_note, model_size, report_settings
from compressor.models.export import write_remote_code
from compressor.models.families import ModelFamily
from compressor.models.layout import SlicedLayout, mlp_neurons, with_mlp_width
from compressor.models.sites import EMBEDDING, layer_site_ids
from compressor.models.stock import fitted_tied_scale, head_stream, load_stock, tied_rotation, to_stock
from compressor.models.towers import copy_processor_files, save_tower
from compressor.recipe.schema import LmEvalSpec, MlpSpec, ModelSpec, Recipe
from compressor.run.checks import Plan, check_device_settings, heldout_windows, plan
from compressor.run.guard import GuardRecord
from compressor.run.layerwise_eval import evaluates_layer_by_layer, layerwise_compare, placed_task_scores
from compressor.run.loading import Resources, heldout_batches, load_model, load_whole, resolve_device
from compressor.run.memory import check_memory, machine_memory, resolved_load, run_memory_plan, writes_as_it_goes
from compressor.run.report import write_markdown
from compressor.run.report_model import (
    Allocation,
    Environment,
    Loading,
    Metrics,
    MlpReport,
    ModelInfo,
    ModelSize,
    Parallel,
    Params,
    Resume,
    RunReport,
    Site,
    Sizes,
    SplitRecord,
    Step,
)
from compressor.run.resume import (
    baseline_tasks_key,
    check_interrupted,
    data_fingerprint,
    distillation_fingerprint,
    fisher_key,
    recipe_fingerprint,
    save_recipe_values,
)
from compressor.run.split_choice import KeptFisher, choose, split_label
from compressor.run.staging import (
    CHECKPOINT_FOLDER,
    SCRATCH_FOLDER,
    check_output,
    full_disk_is_a_user_error,
    locked,
    prepare_staging,
    publish,
    staging_folder,
)
from compressor.strategies.registry import PluginRegistry
from compressor.validation import replaced

if TYPE_CHECKING:  # the distillation stack is imported only by a run that distils
    from compressor.training.distill import DistillationData, DistillationRecord

Progress = Callable[[str, int, int], None]


def run(
    recipe: Recipe,
    registry: PluginRegistry,
    progress: Progress | None = None,
    overwrite: bool = False,
    restart: bool = False,
    resources: Resources | None = None,
    save_model: bool = True,
    warn: Callable[[str], None] | None = None,
    memory_check: bool = True,
) -> RunReport | None:
    """Run a validated recipe; return the report (also written to `<output>/report.json`; None on
    a data-parallel run's ranks above 0, which write nothing).

    A run to the same output that was killed or interrupted continues from its checkpoint
    when the recipe, model and data are unchanged; `restart` discards that checkpoint first.
    `resources` supplies model, data and H (a sweep shares them between its runs);
    `save_model=False` keeps only the bases (`bases.apply_bases` rebuilds the model from them).
    `warn` hears what the run goes on with but a user should know (a very large cut).
    `memory_check=False` runs a recipe whose memory plan is above this machine's memory.
    """
    started = time.perf_counter()
    report_progress = progress or (lambda *_: None)
    checked = plan(recipe, registry)
    for warning in checked.warnings if warn is not None else ():
        warn(warning)
    device = resolve_device(recipe.device)
    check_device_settings(recipe, device, save_model)
    ranks, device = parallel.start(device)  # first: each rank plans for its own GPU (cuda:LOCAL_RANK)
    machine = machine_memory(device)
    recipe, chosen = resolved_load(recipe, checked, device, machine, save_model)
    if chosen is not None and warn is not None:
        warn(chosen)
    if memory_check:  # before anything is written: a run that cannot fit stops in its first second
        check_memory(run_memory_plan(recipe, checked, device, save_model), machine)
    if ranks.world > 1:
        if not checked.layout.residual:
            raise UserError(
                "a global layout that prunes the MLP alone runs in one process (it has no walk to share); "
                "launch one process"
            )
        if recipe.refinement is not None:
            raise UserError("refinement runs in one process: remove refinement from the recipe, or launch one process")
        if checked.chooses_split:
            raise UserError(
                "mlp: choosing the split of the budget runs in one process: fix the MLP's width (mlp.kept), "
                "or launch one process"
            )
        if resources is not None:
            raise UserError("a sweep's runs share their data and H in one process: launch it without torchrun")
        if ranks.rank > 0:
            check_output(Path(recipe.output), overwrite)  # as rank 0 does: every rank stops at once
            return _follow(recipe, checked, device, ranks, Resources(), report_progress)
    output = Path(recipe.output)
    staging = prepare_staging(output, overwrite)
    check_interrupted(output, recipe, restart)  # its progress kept, refused before anything is loaded
    with locked(staging, output):
        check_output(output, overwrite)  # again, under the lock: another run may have published meanwhile
        checkpoint = Checkpoint(staging / CHECKPOINT_FOLDER)
        shutil.rmtree(staging / SCRATCH_FOLDER, ignore_errors=True)  # spill files of a killed run
        if restart:
            checkpoint.discard()
        fresh = not checkpoint.has_progress()  # else this run resumes progress made before it
        try:
            with full_disk_is_a_user_error(output):
                report = _run_in(
                    staging,
                    recipe,
                    checked,
                    device,
                    checkpoint,
                    started,
                    report_progress,
                    resources or Resources(),
                    save_model,
                    ranks,
                    warn,
                )
            faults.reached("publish")
            publish(staging, output)
        except UserError as error:  # bad input found on the way: what this run created goes
            if Interrupts.seen and checkpoint.has_progress():  # a library's stand-in for Ctrl-C: kept
                raise
            if (fresh and not isinstance(error, ProgressKept)) or not checkpoint.has_progress():
                shutil.rmtree(staging, ignore_errors=True)
            raise
        except BaseException:  # an interrupt or a crash: progress is kept, to continue from
            if not checkpoint.has_progress():
                shutil.rmtree(staging, ignore_errors=True)
            raise
    return report


def _prune(
    model: PreTrainedModel,
    recipe: Recipe,
    checked: Plan,
    calibration: list[Batch],
    device: torch.device,
    report_progress: Progress,
    checkpoint: Checkpoint,
    scratch: Path,
    fisher: dict[str, torch.Tensor] | None,
    ranks: Ranks,
    write_to: Path | None = None,
) -> PruneResult:
    """The walk as the recipe asks for it: the same call on every rank of a data-parallel run
    (`write_to`: the sliced model written there as the walk goes, by rank 0)."""
    options = WalkOptions(
        device=device,
        sensitivity=recipe.sensitivity,
        seed=recipe.seed,
        offload=recipe.activations,
        scratch=scratch,
        correct_readers=recipe.slicing.correct_readers,
        pooling=recipe.slicing.pooling,
        write_to=write_to,
        allocator=checked.allocator,
        checkpoint=checkpoint,
        fisher=fisher,
        ranks=ranks,
        progress=report_progress,
    )
    return prune(model, checked.layout, calibration, checked.pipeline, options)


def _follow(
    recipe: Recipe, checked: Plan, device: torch.device, ranks: Ranks, resources: Resources, report_progress: Progress
) -> None:
    """A data-parallel run's rank above 0: the walk on its share of the calibration batches, its
    statistics summed with the others'; rank 0 writes the run folder and the checkpoint, which
    this rank only reads (to resume where rank 0 does)."""
    torch.manual_seed(recipe.seed)
    tokenizer = resources.tokenizer(recipe.model)
    calibration = resources.batches(recipe.calibration, tokenizer, "calibration")
    rows = _distillation_data(recipe, tokenizer)
    model = resources.model(recipe.model)
    ranks.barrier()  # rank 0 has prepared the staging folder and checked the checkpoint's fingerprint
    checkpoint = Checkpoint(staging_folder(Path(recipe.output)) / CHECKPOINT_FOLDER, writable=False)
    layout, config = checked.layout, checked.layout.config
    with tempfile.TemporaryDirectory(prefix=f"compress-rank{ranks.rank}-") as scratch:
        written = staging_folder(Path(recipe.output)) / "model" if writes_as_it_goes(recipe, layout) else None
        result = _prune(
            model,
            recipe,
            checked,
            calibration,
            device,
            report_progress,
            checkpoint,
            Path(scratch),
            None,
            ranks,
            written,
        )
        if recipe.distillation is None and layout.mlp_width is None:
            return None
        pruned, bases, scale = result.model, result.bases, None
        if _rotates_for_a_tied_head(recipe, checked):  # as rank 0's walk does, so every rank prunes one model
            pruned, bases, scale = _rotated_for_a_tied_head(
                result, resources.model(recipe.model), layout.family, device
            )
        if layout.mlp_width is not None:  # every rank measures its share, C summed: the same neurons everywhere
            _prune_mlp(
                recipe,
                checked,
                pruned,
                calibration,
                result,
                bases,
                checkpoint,
                device,
                report_progress,
                Path(scratch),
                ranks,
            )
            config = with_mlp_width(config, layout.family, layout.mlp_width)
    if recipe.distillation is not None:  # every rank trains its share; rank 0 saves
        if layout.one_basis:
            pruned, _ = to_stock(
                pruned,
                layout.family,
                config,
                tie=layout.tie_head,
                stream=head_stream(result.head_moment, bases[EMBEDDING]),
                scale=scale,
            )
        _distil(
            recipe,
            checked.layout.family,
            pruned,
            rows,
            staging_folder(Path(recipe.output)),
            device,
            None,
            Resources(),
            report_progress,
            ranks,
        )
    return None


def _prune_mlp(
    recipe: Recipe,
    checked: Plan,
    pruned: PreTrainedModel,
    calibration: list[Batch],
    result: PruneResult,
    bases: Mapping[str, torch.Tensor],
    checkpoint: Checkpoint,
    device: torch.device,
    progress: Progress,
    scratch: Path,
    ranks: Ranks,
) -> tuple[list[NeuronRecord], bool]:
    """The MLP stage, the same call on every rank: each MLP of `pruned` keeps the layout's neurons,
    chosen on the model as the walk (and refinement) left it, weighed by H in each MLP's stream
    coordinates where the walk estimated it; its config says the new width. Returns the layers'
    records and whether H weighed the choice."""
    spec, layout, selector, family = recipe.mlp, checked.layout, checked.selector, checked.layout.family
    assert spec is not None and layout.mlp_width is not None and selector is not None
    assert family.mlp_width is not None
    sensitivity = _stream_sensitivity(family, layout.config, result, checkpoint, bases, device)
    records = prune_mlp(
        pruned,
        family,
        calibration,
        layout.mlp_width,
        selector,
        device,
        refit=spec.refit,
        damping=spec.damping,
        feedback=spec.feedback,
        sensitivity=sensitivity,
        progress=progress,
        store=ActivationStore(device, recipe.activations, scratch),
        ranks=ranks,
    )
    setattr(pruned.config, family.mlp_width, layout.mlp_width)
    return records, sensitivity is not None


def _stream_sensitivity(
    family: ModelFamily,
    config: Any,
    result: PruneResult,
    checkpoint: Checkpoint,
    bases: Mapping[str, torch.Tensor],
    device: torch.device,
) -> _StreamSensitivity | None:
    """H of the stream each layer's MLP writes to, in the coordinates the MLP writes it (RᵀHR with
    R what reads the site's kept coordinates: its basis, or its reader map with corrected
    readers); None when the walk did not estimate H, or where the MLP's output does not land
    in the stream directly (a norm after the block)."""
    fisher = result.fisher
    if fisher is None:  # a resumed walk with every site saved needs no H, but this stage does
        fisher = checkpoint.load_fisher()
    if fisher is None or family.mlp_post_norm is not None:
        return None
    readers = result.readers or {}
    sites = [layer_site_ids(family, i)[-1] for i in range(config.num_hidden_layers)]
    return _StreamSensitivity(
        fisher, {i: readers.get(site, bases[site]) for i, site in enumerate(sites)}, sites, device
    )


class _StreamSensitivity(Mapping[int, torch.Tensor]):
    """RᵀHR of each layer's MLP stream (d × d H, R d × k), computed on the device when the MLP
    stage reaches that layer, so no layer's k × k matrix waits in host memory for its turn."""

    def __init__(
        self,
        fisher: Mapping[str, torch.Tensor],
        readers: dict[int, torch.Tensor],
        sites: list[str],
        device: torch.device,
    ) -> None:
        self.fisher, self.readers, self.sites, self.device = fisher, readers, sites, device

    def __getitem__(self, layer: int) -> torch.Tensor:
        R = self.readers[layer].to(self.device, torch.float64)
        return R.T @ self.fisher[self.sites[layer]].to(self.device, torch.float64) @ R

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.sites)))

    def __len__(self) -> int:
        return len(self.sites)


def _stock_tied(checked: Plan) -> bool:
    """Saved as the original class with its head tied (its final norm's diagonal fitted or learned)."""
    return checked.layout.one_basis and checked.layout.tie_head


def _rotates_for_a_tied_head(recipe: Recipe, checked: Plan) -> bool:
    return _stock_tied(checked) and recipe.slicing.tied_fit == "symmetric"


def _rotated_for_a_tied_head(
    result: PruneResult, original: PreTrainedModel, family: ModelFamily, device: torch.device
) -> tuple[PreTrainedModel, dict[str, torch.Tensor], torch.Tensor]:
    """A stock tied head (`slicing.tied_fit: symmetric`): the walk's basis V becomes V·R, R the
    rotation whose final-norm diagonal D fits the untied head best (`stock.tied_rotation`); the
    sliced model rebuilt from `original` with it, the rotated bases, and D."""
    sliced = result.model
    R, scale = tied_rotation(
        sliced.get_submodule(family.embedding).weight,
        sliced.get_submodule(family.head).weight,
        head_stream(result.head_moment, result.bases[EMBEDDING]),
    )
    # One basis: every site the same tensor, so sites stay shared bit for bit. A fresh copy: a resumed
    # walk's basis is read from a file, and BLAS may round a product of differently aligned memory differently.
    rotated = result.bases[EMBEDDING].clone(memory_format=torch.contiguous_format) @ R
    bases = {site: rotated for site in result.bases}
    return apply_bases(original, family, bases, device, keep_tied=False), bases, scale


def _run_in(
    staging: Path,
    recipe: Recipe,
    checked: Plan,
    device: torch.device,
    checkpoint: Checkpoint,
    started: float,
    report_progress: Progress,
    resources: Resources,
    save_model: bool,
    ranks: Ranks,
    warn: Callable[[str], None] | None = None,
) -> RunReport:
    """Everything a run writes, into `staging`, stage by stage; returns the report."""
    if checked.chooses_split:  # the splits' trial walks and the run's walk share one H pass
        resources = KeptFisher(resources)
    stages = _Stages(staging, recipe, checked, device, checkpoint, report_progress, resources, ranks, warn, save_model)
    torch.manual_seed(recipe.seed)
    with stages.timed("data_s"):
        stages.read_data()
    with stages.timed("load_s"):
        stages.load_model()
    stages.start_checkpoint()
    if checked.chooses_split:  # else nothing to choose (a warning said so)
        with stages.timed("split_s"):
            stages.choose_split()
    if not stages.adopted:
        stages.walk()
    if isinstance(resources, KeptFisher):
        resources.kept.clear()  # the walk's result holds H from here on
    if recipe.refinement is not None:
        with stages.timed("refine_s"):
            stages.refine()
    if stages.checked.layout.mlp_width is not None and not stages.adopted:
        with stages.timed("mlp_s"):
            stages.prune_mlp()
    if recipe.distillation is not None:
        stages.to_student()
        with stages.timed("distill_s"):
            stages.distil()
    with stages.timed("save_s"):
        stages.save(save_model)
    if stages.evaluation is not None:
        with stages.timed("eval_s"):
            stages.evaluate()
    stages.timings["total_s"] = time.perf_counter() - started
    return stages.write_report()


class _Stages:
    """One run's stages in its staging folder, and what each hands to the next (the pruned model,
    its bases, the records the report is made of)."""

    def __init__(
        self,
        staging: Path,
        recipe: Recipe,
        checked: Plan,
        device: torch.device,
        checkpoint: Checkpoint,
        progress: Progress,
        resources: Resources,
        ranks: Ranks,
        warn: Callable[[str], None] | None = None,
        save_model: bool = True,
    ) -> None:
        self.staging, self.recipe, self.checked, self.device = staging, recipe, checked, device
        self.checkpoint, self.progress, self.resources, self.ranks = checkpoint, progress, resources, ranks
        self.warn = warn or (lambda _: None)
        self.warnings: list[str] = []
        """Said during the run (a guarded step handed back), beside the plan's warnings in the report."""
        self.guards: list[GuardRecord] = []
        self.heldout: list[Batch] = []
        self.split_windows: list[Batch] = []
        """`mlp` without `kept`: the windows each split is measured on."""
        self.head_scale: torch.Tensor | None = None
        """A stock tied head's final-norm diagonal, from the symmetric fit or refinement (None: the
        diagonal fit at saving, `stock.tied_scale`)."""
        self.head_fit = "diagonal"
        """How that diagonal was found, for the report: diagonal, symmetric (rotated), refined."""
        self.family, self.config = checked.layout.family, checked.layout.config
        self.one_basis = checked.layout.one_basis
        self.save_model = save_model
        self.writes = writes_as_it_goes(recipe, checked.layout, save_model)
        """The walk writes model/ as it goes (a streamed run with nothing after the walk that
        changes the model whole); the pruned model's layers are then read back from there."""
        self.timings: dict[str, float] = {}
        # read_data
        self.tokenizer: Any = None
        self.calibration: list[Batch] = []
        self.evaluation: list[Batch] | None = None
        self.distillation_rows: DistillationData | None = None
        # load_model
        self.model: PreTrainedModel | None = None
        self.baseline_params = 0
        self.baseline_size: dict[str, int] = {}
        # walk, then refine, to_student, distil and save, each handing the model on
        self.fingerprint: dict[str, str] = {}
        self.result: PruneResult | None = None
        self.pruned: PreTrainedModel | None = None
        self.bases: dict[str, torch.Tensor] = {}
        self.refinement: RefinementRecord | None = None
        self.unrefined: PreTrainedModel | None = None
        self.stock: dict[str, Any] | None = None
        self.neurons: list[NeuronRecord] = []
        """`mlp`: what each layer's MLP kept."""
        self.split: SplitRecord | None = None
        """`mlp` without `kept`: the splits measured and the one chosen."""
        self.split_fisher_source: str | None = None
        """Where the splits' H came from: "computed" by the first split (and checkpointed before the
        run's walk read it), or "checkpoint" of a run killed while choosing; the report says this
        rather than what the run's walk (or the adopted trial's) was handed."""
        self.best_trial: tuple[float, int, _Stages] | None = None
        """While choosing without refinement: the lowest-KL split measured so far, as pruned (its KL, index, stages)."""
        self.adopted = False
        """The chosen split's trial walk and MLP stage are the run's (no refinement between them): not pruned twice."""
        self.mlp_weighed_by_h = False
        self.distillation: DistillationRecord | None = None
        self.undistilled: dict[str, float] | None = None
        self.original: PreTrainedModel | None = None
        # evaluate
        self.metrics: dict[str, Any] = {}
        self.speed: dict[str, Any] | None = None

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        tick = time.perf_counter()
        yield
        self.timings[key] = time.perf_counter() - tick

    def read_data(self) -> None:
        """ "tokenising data": every window the run reads, the distillation's too (a data problem found
        before the walk costs nothing)."""
        recipe = self.recipe
        self.progress("tokenising data", 0, 1)
        self.tokenizer = self.resources.tokenizer(recipe.model)
        self.calibration = self.resources.batches(recipe.calibration, self.tokenizer, "calibration")
        self.evaluation = (
            self.resources.batches(recipe.evaluation, self.tokenizer, "evaluation") if recipe.evaluation else None
        )
        self.distillation_rows = _distillation_data(recipe, self.tokenizer)
        for where, count in heldout_windows(recipe, self.checked).items():
            windows = heldout_batches(recipe.calibration, self.tokenizer, count, where)
            if where == "refinement":
                self.heldout = windows
            else:
                self.split_windows = windows

    def load_model(self) -> None:
        """ "loading model", and its size before pruning."""
        self.progress("loading model", 0, 1)
        self.model = self.resources.model(self.recipe.model)
        self.baseline_params = parameter_count(self.model)
        self.baseline_size = model_size(self.model)

    def start_checkpoint(self) -> None:
        """The checkpoint's fingerprint checked (or written): progress of another recipe, model or data is refused."""
        self.fingerprint = {
            "recipe": recipe_fingerprint(self.recipe),
            "model": model_digest(self.model),
            "data": data_fingerprint(self.calibration),
        }
        self.checkpoint.start(self.fingerprint)
        save_recipe_values(self.checkpoint, self.recipe)

    def choose_split(self) -> None:
        """ "choosing the split of the budget" (`mlp` without `kept`): every split of the plan pruned
        and measured on held-out windows (`run.split_choice`), or the choice a killed run made; the
        run goes on with the chosen layout."""
        splits, saved = self.checked.splits, self.checkpoint.load_split()
        if saved is not None:
            self.split = SplitRecord.model_validate(saved)
            chosen = self.split.candidates[self.split.chosen]
            layout = splits[self.split.chosen] if self.split.chosen < len(splits) else None
            if layout is None or (layout.kept, layout.mlp_width or chosen.mlp_kept) != (chosen.width, chosen.mlp_kept):
                raise ProgressKept(
                    f"the interrupted run in {self.staging} chose a split (width {chosen.width}, MLP "
                    f"{chosen.mlp_kept}) that this version's plan does not list; rerun with --restart"
                )
        else:
            if self.checkpoint.has_fisher():  # a run killed while choosing: its H pass is not repeated
                loaded = self.checkpoint.load_fisher()
                assert loaded is not None
                self.resources.keep_fisher(self._fisher_key(), loaded)
                self.split_fisher_source = "checkpoint"
            original = self.resources.whole_model(self.recipe.model)  # on the device only while it measures
            self.model = None  # reloaded for the run's walk unless the chosen split's trial is kept
            rng = torch.get_rng_state()  # every split starts its walk where the run's own walk will
            self.split = choose(
                splits,
                lambda index, layout: self._measured_split(index, layout, original, rng),
                sum(len(batch.input_ids) for batch in self.split_windows),
                self.progress,
            )
            torch.set_rng_state(rng)
            del original
            self.checkpoint.save_split(self.split.model_dump())
        self.checked = dataclasses.replace(self.checked, layout=splits[self.split.chosen])
        if self.best_trial is not None and self.best_trial[1] == self.split.chosen:
            self._adopt(self.best_trial[2])
        self.best_trial = None
        if not self.adopted and self.model is None:
            self.model = self.resources.model(self.recipe.model)

    def _adopt(self, trial: _Stages) -> None:
        """The chosen split's trial becomes the run's walk and MLP stage: the same calls on the same
        model, data, H and random state as the run's own would make, so the same tensors."""
        assert trial.result is not None
        self.result, self.pruned, self.bases = trial.result, trial.pruned, trial.bases
        self.head_scale, self.head_fit = trial.head_scale, trial.head_fit
        self.neurons, self.mlp_weighed_by_h, self.config = trial.neurons, trial.mlp_weighed_by_h, trial.config
        for key in ("prune_s", "mlp_s"):
            if key in trial.timings:
                self.timings[key] = trial.timings[key]
        self.adopted = True

    def _measured_split(self, index: int, layout: SlicedLayout, original: PreTrainedModel, rng: torch.Tensor) -> float:
        """One split pruned as this run would prune it (walk, tied head, MLP; no refinement or
        distillation) in a scratch folder, and its KL to `original` on `windows`, saved as it would be."""
        label = f"split {index + 1}/{len(self.checked.splits)} ({split_label(layout)})"
        folder = self.staging / SCRATCH_FOLDER / f"split-{index}"
        trial = _Stages(
            folder,
            self.recipe,
            dataclasses.replace(self.checked, layout=layout),
            self.device,
            Checkpoint(folder / CHECKPOINT_FOLDER, writable=False),  # H goes to the run's checkpoint
            lambda phase, done, total: self.progress(f"{label}: {phase}", done, total),
            self.resources,
            self.ranks,
        )
        trial.tokenizer, trial.calibration, trial.heldout = self.tokenizer, self.calibration, self.split_windows
        trial.model = self.resources.model(self.recipe.model)
        trial.fingerprint = self.fingerprint  # the same recipe, model and data: not hashed again
        torch.set_rng_state(rng)
        with faults.scoped(f"split{index}/"):
            trial.walk()
            if layout.mlp_width is not None:
                with trial.timed("mlp_s"):
                    trial.prune_mlp()
        assert trial.result is not None
        if trial.result.fisher is not None and not self.checkpoint.has_fisher():
            self.checkpoint.save_fisher(trial.result.fisher)
            if trial.result.fisher_source == "computed":
                self.split_fisher_source = "computed"
        self.timings["fisher_s"] = max(self.timings.get("fisher_s", 0.0), trial.timings.get("fisher_s", 0.0))
        trial.progress("measuring held-out KL", 0, 1)
        kl = trial._heldout_kl(original.to(self.device), trial.pruned, trial.head_scale)
        original.to("cpu")
        shutil.rmtree(folder, ignore_errors=True)
        if (
            self.recipe.refinement is None
            and math.isfinite(kl)
            and (self.best_trial is None or kl < self.best_trial[0])
        ):
            trial.pruned.to("cpu")  # the best so far waits on the host; the one it replaces is dropped
            # H is the checkpoint's and the resources'; the walk's own model (unrotated, before a tied
            # head's fit) is read by nothing after the walk: one model waits, not two
            trial.result = dataclasses.replace(trial.result, fisher=None, model=trial.pruned)
            self.best_trial = (kl, index, trial)
        return kl

    def _fisher_key(self) -> str:
        return fisher_key(self.recipe, self.fingerprint["model"], self.fingerprint["data"], self.device)

    def walk(self) -> None:
        """`engine.prune` on the plan's layout; H kept for a sweep (and for the run's other walks)."""
        recipe, device = self.recipe, self.device
        if not self.checked.layout.residual:
            self._keep_stream()
            return
        h_key = self._fisher_key()
        self.ranks.barrier()  # the other ranks read the checkpoint once its fingerprint is checked
        tick = time.perf_counter()
        self.result = _prune(
            self.model,
            recipe,
            self.checked,
            self.calibration,
            device,
            self.progress,
            self.checkpoint,
            self.staging / SCRATCH_FOLDER,
            self.resources.fisher(h_key),
            self.ranks,
            self.staging / "model" if self.writes else None,
        )
        if self.result.fisher is not None:
            self.resources.keep_fisher(h_key, self.result.fisher)
        self.pruned, self.bases = self.result.model, self.result.bases
        if _rotates_for_a_tied_head(recipe, self.checked):
            self.progress("fitting the tied head", 0, 1)
            self.pruned, self.bases, self.head_scale = _rotated_for_a_tied_head(
                self.result, self.resources.model(recipe.model), self.family, device
            )
            self.head_fit = "symmetric"
        self.timings["fisher_s"] = max(self.timings.get("fisher_s", 0.0), self.result.fisher_seconds)  # shared work
        self.timings["prune_s"] = time.perf_counter() - tick - self.result.fisher_seconds

    def _keep_stream(self) -> None:
        """A layout that prunes the MLP alone (`models.mlp_only`): no walk; the original model, whole
        in memory, is what the MLP stage prunes, every site at its full width."""
        if self.recipe.model.load == "stream":  # a streamed shell's layers are read by a walk only
            self.model = self.resources.whole_model(self.recipe.model)
        assert self.model is not None and self.checked.layout.widths is not None
        self.result = PruneResult(
            model=self.model,
            sites=[],
            slicing={},
            bases={},
            widths=dict(self.checked.layout.widths),
            tokens_by_rank=[sum(int(batch.attention_mask.sum()) for batch in self.calibration)],
        )
        self.pruned, self.bases = self.model, {}
        self.timings["prune_s"] = 0.0

    @property
    def keep_tied(self) -> bool | None:
        return False if self.one_basis else None  # a global layout's head is decided by its stock conversion

    def refine(self) -> None:
        """`refinement`: the bases moved together on the output KL (a stock tied head's diagonal with
        them), applied to a fresh original when they lowered the objective, and kept only when the
        model as saved is not worse on the held-out windows (`run.guard`)."""
        recipe = self.recipe
        assert recipe.refinement is not None
        received_scale = self.head_scale
        if _stock_tied(self.checked) and received_scale is None:
            received_scale = fitted_tied_scale(self.pruned, self.family, self._head_stream())
        refined = refine_bases(
            self.resources.whole_model(recipe.model),
            self.family,
            self.calibration,
            self.bases,
            recipe.refinement,
            self.device,
            recipe.seed,
            self.progress,
            self.keep_tied,
            received_scale,
        )
        self.refinement = refined.record
        if refined.record.kept != "refined":
            return
        self.progress("applying refined bases", 0, 1)
        candidate = apply_bases(
            self.resources.model(recipe.model), self.family, refined.bases, self.device, keep_tied=self.keep_tied
        )
        original = self.resources.whole_model(recipe.model).to(self.device)
        self.progress("refinement: the guard, on held-out windows", 0, 2)
        before = self._heldout_kl(original, self.pruned, received_scale)
        self.progress("refinement: the guard, on held-out windows", 1, 2)
        after = self._heldout_kl(original, candidate, refined.head_scale)
        guard = GuardRecord.judge("refinement", sum(len(b.input_ids) for b in self.heldout), before, after)
        self._guarded(guard)
        if guard.kept:
            self.unrefined = self._as_saved(self.pruned, received_scale)  # evaluated beside the refined model
            self.pruned, self.bases, self.head_scale = candidate, refined.bases, refined.head_scale
            self.head_fit += ", then refined"

    def _as_saved(self, sliced: PreTrainedModel, scale: torch.Tensor | None) -> PreTrainedModel:
        """The model as the run would save it: a global layout's stock model (its tied head with
        the diagonal `scale`, or fitted), a per-site layout's sliced model itself."""
        if not self.one_basis:
            return sliced
        return to_stock(
            sliced, self.family, self.config, tie=self.checked.layout.tie_head, stream=self._head_stream(), scale=scale
        )[0]

    def _heldout_kl(self, original: PreTrainedModel, sliced: PreTrainedModel, scale: torch.Tensor | None) -> float:
        """KL(original ‖ the model as it would be saved) on the guard's held-out windows."""
        saved = self._as_saved(sliced, scale).to(self.device)
        return compare(original, saved, self.heldout, self.device)["pruned"]["kl"]

    def _guarded(self, guard: GuardRecord) -> None:
        """A guarded step's verdict: in the report, and said in one line when the step was undone."""
        self.guards.append(guard)
        if not guard.kept:
            self.warnings.append(guard.line())
            self.warn(guard.line())

    def _head_stream(self) -> torch.Tensor | None:
        return head_stream(self.result.head_moment, self.bases[EMBEDDING])

    def prune_mlp(self) -> None:
        """ "MLP neurons": every MLP keeps the layout's neurons (`engine.neurons.prune_mlp`), chosen on
        the model as the walk and refinement left it, weighed by H in each MLP's stream coordinates
        where the walk estimated it; the model's config, and every later conversion, says the new width."""
        layout = self.checked.layout
        assert self.pruned is not None and self.result is not None and layout.mlp_width is not None
        self.neurons, self.mlp_weighed_by_h = _prune_mlp(
            self.recipe,
            self.checked,
            self.pruned,
            self.calibration,
            self.result,
            self.bases,
            self.checkpoint,
            self.device,
            self.progress,
            self.staging / SCRATCH_FOLDER,
            self.ranks,
        )
        self.unrefined = None  # it kept every neuron: beside the pruned model its KL would mix the two steps
        self.config = with_mlp_width(self.config, self.family, layout.mlp_width)

    def _mlp_report(self, spec: MlpSpec) -> MlpReport:
        assert self.checked.selector is not None
        width = mlp_neurons(self.checked.layout.config, self.family)
        return MlpReport(
            kept=self.checked.layout.mlp_width or width,
            of=width,
            selector=self.checked.selector.name,
            refit=spec.refit,
            damping=spec.damping,
            feedback=self.neurons[0].feedback if self.neurons else spec.feedback,
            weighed_by_h=self.mlp_weighed_by_h,
            layers=self.neurons,
            **({} if self.split is None else {"split": self.split}),
        )

    def to_student(self) -> None:
        """A global layout's student is what users load: the original class at the kept width."""
        if self.one_basis and self.checked.layout.residual:
            self.progress("converting to the original architecture", 0, 1)
            self.pruned, self.stock = to_stock(
                self.pruned,
                self.family,
                self.config,
                tie=self.checked.layout.tie_head,
                stream=self._head_stream(),
                scale=self.head_scale,
            )

    def distil(self) -> None:
        """`distillation`: the student trained on the original's distribution."""
        self.pruned, self.distillation, self.undistilled, self.original = _distil(
            self.recipe,
            self.family,
            self.pruned,
            self.distillation_rows,
            self.staging,
            self.device,
            self.evaluation,
            self.resources,
            self.progress,
            self.ranks,
        )
        record = self.distillation  # guarded by the stage: its best held-out checkpoint, or the student as received
        trained = [point["kl"] for point in record.curve if point["step"] > 0]
        self._guarded(
            GuardRecord(
                "distillation",
                record.heldout_windows,
                record.heldout_kl_before,
                min(trained, default=record.heldout_kl_before),
                record.kept == "distilled",
            )
        )

    def save(self, save_model: bool) -> None:
        """ "saving model": the folder users load (a global layout's saved as the original class and
        loaded back, so what is evaluated is what users load), the tokenizer and the bases."""
        staging, pruned = self.staging, self.pruned
        self.progress("saving model" if save_model else "saving bases", 0, 1)
        if not self.checked.layout.residual:  # the original class with narrower MLPs
            pruned = self._save_mlp_alone(pruned, save_model)
        elif self.writes and self.one_basis:  # the walk wrote the stock model as it went
            self.stock = self.result.stock
        elif self.one_basis and self.distillation is None and self.checked.tower is not None:
            pruned, self.stock = to_stock(
                pruned,
                self.family,
                self.config,
                tie=self.checked.layout.tie_head,
                stream=self._head_stream(),
                scale=self.head_scale,
            )
            if save_model:  # the whole vision-language checkpoint, loaded back as users load it
                pruned = self._save_tower(pruned, staging / "model", self.bases[EMBEDDING])
        elif self.one_basis and self.distillation is None:
            pruned, self.stock = to_stock(
                pruned,
                self.family,
                self.config,
                staging / "model" if save_model else None,
                tie=self.checked.layout.tie_head,
                stream=self._head_stream(),
                scale=self.head_scale,
            )
        elif self.one_basis and save_model:  # already the original class (distilled): saved and loaded back
            pruned.save_pretrained(staging / "model")
            pruned = load_stock(staging / "model", pruned)
        elif save_model:
            if not self.writes:  # else the walk wrote it, layer by layer
                pruned.save_pretrained(staging / "model")
            write_remote_code(staging / "model", self.family, self.config.model_type)
        self.pruned = pruned
        if save_model:
            self.tokenizer.save_pretrained(staging / "model")
        if not self.checked.layout.residual:
            return  # no bases: the stream kept its own
        objectives = {site.name: site.steps for site in self.result.sites}
        metadata = {"objectives": json.dumps(objectives)}
        if self.refinement is not None:
            metadata["refinement"] = json.dumps(self.refinement.to_json())
        save_bases(self.bases, staging / BASES_FILE, metadata)
        if self.result.readers is not None:
            save_bases(self.result.readers, staging / READERS_FILE)

    def _save_mlp_alone(self, pruned: PreTrainedModel, save_model: bool) -> PreTrainedModel:
        """A layout that prunes the MLP alone saves the original class, its config's MLP width the
        kept one, and loads it back (a vision-language checkpoint whole, its projector as it was)."""
        family, d = self.family, self.config.hidden_size
        assert family.mlp_width is not None and self.checked.layout.kept_stream is not None
        self.stock = {
            "norm_scale": 1.0,
            "stream_scale": 1.0,
            "embedding_factor": 1.0,
            "head": "unchanged",
            "hidden_size": d,
            "config": {family.mlp_width: getattr(self.config, family.mlp_width)},
            "residual": f"kept whole: {self.checked.layout.kept_stream}",
        }
        if not save_model:
            return pruned
        folder = self.staging / "model"
        if self.checked.tower is not None:  # the projector writes the stream as it was
            return self._save_tower(pruned, folder, None)
        pruned.save_pretrained(folder)
        return load_stock(folder, pruned)

    def _save_tower(self, pruned: PreTrainedModel, folder: Path, basis: torch.Tensor | None) -> PreTrainedModel:
        """A vision-language checkpoint saved whole (`models.towers.save_tower`): the original
        loaded again, its text tower replaced by `pruned`, its projector mapped into the pruned
        stream; returned as the run's text model, read back from the folder."""
        tower, spec = self.checked.tower, self.recipe.model
        assert tower is not None and self.stock is not None
        save_tower(
            load_whole(replaced(spec, load="memory")),
            tower,
            pruned,
            basis,
            self.stock["stream_scale"],
            folder,
        )
        self.stock["vision_language"] = {
            "class": type(pruned).__name__,
            "projector": tower.projector,
            "copied": copy_processor_files(spec.path, folder),
        }
        return load_model(replaced(spec, path=str(folder), revision=None, load="memory"))

    def evaluate(self) -> None:
        """ "evaluating": perplexity, KL and lm-eval suites of both models; the unrefined model's KL;
        throughput. lm-eval on models placed by accelerate (`evaluation.device_map`) comes after the
        rest, each model loaded from its folder alone."""
        recipe, device, evaluation, resources = self.recipe, self.device, self.evaluation, self.resources
        assert evaluation is not None and recipe.evaluation is not None
        self.progress("evaluating", 0, len(evaluation))
        placed = recipe.evaluation.device_map is not None
        suites = None if placed else recipe.evaluation.lm_eval
        if evaluates_layer_by_layer(recipe) and self.original is None and self.unrefined is None:
            self.metrics = layerwise_compare(
                resources.model(recipe.model),
                self.pruned if self.writes else self.pruned.to(device),  # written: its layers read when visited
                self.family,
                evaluation,
                device,
                lambda done, total: self.progress("evaluating, layer by layer", done, total),
            )
            if self.undistilled is not None:
                self.metrics["undistilled"] = self.undistilled
        else:
            self._evaluate_whole(suites)
        if placed and recipe.evaluation.lm_eval:
            if not self.writes:  # the device's memory is accelerate's to place the models in
                self.pruned.to("cpu")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            self._placed_tasks()

    def _evaluate_whole(self, suites: list[LmEvalSpec] | None) -> None:
        """Both models whole on the run's device: perplexity, KL, lm-eval `suites`, throughput."""
        recipe, device, evaluation, resources = self.recipe, self.device, self.evaluation, self.resources
        assert evaluation is not None and recipe.evaluation is not None
        original = (self.original if self.original is not None else resources.whole_model(recipe.model)).to(device)
        self.original = None
        tasks_key = baseline_tasks_key(suites or [], self.fingerprint["model"], recipe, self.tokenizer, device)
        metrics = evaluate_models(
            original,
            self.pruned.to(device),
            evaluation,
            device,
            self.progress,
            tasks=suites,
            tokenizer=self.tokenizer,
            seed=recipe.seed,
            baseline_tasks=resources.baseline_tasks(tasks_key),
        )
        if suites:
            resources.keep_baseline_tasks(tasks_key, metrics["baseline"]["tasks"])
        if self.undistilled is not None:  # measured before the distillation stage, on the same windows
            metrics["undistilled"] = self.undistilled
        if self.unrefined is not None:  # held-out KL before refinement (the model as it was saved), beside the refined
            self.progress("evaluating the unrefined model", 0, len(evaluation))
            metrics["unrefined"] = compare(original, self.unrefined.to(device), evaluation, device)["pruned"]
            self.unrefined = None
        if recipe.evaluation.throughput:
            settings = report_settings([original, self.pruned])
            self.progress(f"measuring throughput ({cost_note(settings)})", 0, 1)
            self.speed = compare_speed(original, self.pruned, device, **settings)
        self.metrics = metrics
        del original

    def _placed_tasks(self) -> None:
        """lm-eval on each model in turn, placed by accelerate over the GPUs, host memory and disk
        (offloaded weights in the staging folder, removed after each model): the original from its
        folder, the pruned model from the saved `model/` (or a copy saved for it when the run
        saves no model)."""
        recipe, staging = self.recipe, self.staging
        spec = recipe.evaluation
        assert spec is not None and spec.lm_eval
        key = baseline_tasks_key(spec.lm_eval, self.fingerprint["model"], recipe, self.tokenizer, self.device)
        offload = staging / SCRATCH_FOLDER / "offload"  # cleared at a run's start and at publishing

        def scores(model: ModelSpec, which: str) -> tuple[dict[str, Any], dict[str, int]]:
            return placed_task_scores(
                model,
                spec,
                self.tokenizer,
                recipe.seed,
                offload,
                self.device,
                lambda phase, done, total: self.progress(f"lm-eval, {which} model (placed): {phase}", done, total),
            )

        baseline, placement = self.resources.baseline_tasks(key), None
        if baseline is None:
            baseline, placement = scores(recipe.model, "original")
            self.resources.keep_baseline_tasks(key, baseline)
        self.metrics.setdefault("baseline", {}).update(tasks=baseline, placement=placement)
        folder = staging / "model" if self.save_model else staging / SCRATCH_FOLDER / "lm-eval-model"
        if not self.save_model:
            self.pruned.save_pretrained(folder)
        try:
            pruned, placement = scores(replaced(recipe.model, path=str(folder), revision=None), "pruned")
        finally:
            if not self.save_model:
                shutil.rmtree(folder, ignore_errors=True)
        self.metrics["pruned"].update(tasks=pruned, placement=placement)

    def write_report(self) -> RunReport:
        """report.json, report.md, the recipe as run, and the distillation curve's plot."""
        recipe, checked, result, config, staging = self.recipe, self.checked, self.result, self.config, self.staging
        layout = checked.layout
        pruned_params = parameter_count(self.pruned)
        fisher_source = self.split_fisher_source or result.fisher_source
        report = RunReport(
            compressor=compressor.__version__,
            model=ModelInfo(
                path=recipe.model.path,
                model_type=config.model_type,
                family=self.family.name,
                hidden_size=config.hidden_size,
                num_layers=config.num_hidden_layers,
                dtype=recipe.model.dtype,
            ),
            sparsity=recipe.sparsity,
            target_params=recipe.target_params,
            kept_width=layout.kept,
            layout=recipe.slicing.layout,
            stock=self.stock
            if self.stock is None or self.stock["head"] != "tied"
            else {**self.stock, "tied_fit": self.head_fit},
            rounding=layout.rounding,
            allocation=Allocation.model_validate(
                {
                    "method": recipe.allocation.method,
                    "budget": layout.budget,
                    "predicted_params": layout.counted.count(result.widths),
                    "transition_params": layout.params.transition_params(result.widths),
                    "shared_sites": list(layout.shared),
                    # the allocator's record: its method ("curves"), solver, predicted KL and curves
                    **{k: v for k, v in (result.allocation or {}).items() if k not in ("widths", "budget", "params")},
                }
            ),
            seed=recipe.seed,
            parallel=Parallel(world_size=self.ranks.world, tokens_by_rank=result.tokens_by_rank),
            pipeline=[Step(strategy=s.strategy, options=s.options) for s in recipe.pipeline],
            slicing=recipe.slicing,
            fingerprint=self.fingerprint,
            resumed_from=result.resumed_from,
            resume=Resume(sites_loaded=result.loaded_sites, fisher_loaded=fisher_source == "checkpoint"),
            loading=Loading(
                load=recipe.model.load,
                written_as_it_goes=self.writes,
                layers_written_before=result.written_before,
            ),
            fisher_source=fisher_source,
            fisher_autocast=_autocast_name(recipe, self.device) if result.fisher_source is not None else None,
            refinement=self.refinement,
            guards=list(self.guards),
            distillation=self.distillation,
            **({} if recipe.mlp is None else {"mlp": self._mlp_report(recipe.mlp)}),
            metrics=Metrics.model_validate(self.metrics),
            params=Params(
                baseline=self.baseline_params, pruned=pruned_params, ratio=pruned_params / self.baseline_params
            ),
            size=Sizes(baseline=ModelSize(**self.baseline_size), pruned=ModelSize(**model_size(self.pruned))),
            speed=self.speed,
            warnings=list(checked.warnings) + self.warnings,
            sites=[Site.model_validate(site.to_json()) for site in result.sites],
            timings=self.timings,
            environment=Environment(
                device=str(self.device),
                torch=torch.__version__,
                transformers=transformers.__version__,
                python=platform.python_version(),
            ),
        )
        report.write(staging / "report.json")
        (staging / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        write_markdown(report, staging / "report.md")
        if self.distillation is not None:
            distillation_figure({"held-out KL": self.distillation.curve}).savefig(
                staging / "distillation.png", dpi=120, bbox_inches="tight"
            )
        if self.split is not None and report.mlp is not None:
            points = [(c.width, c.mlp_kept, c.params, c.heldout_kl) for c in self.split.candidates]
            split_figure(points, self.split.chosen, report.mlp.of, Path(report.model.path).name).savefig(
                staging / "split.png", dpi=120, bbox_inches="tight"
            )
        return report


def _autocast_name(recipe: Recipe, device: torch.device) -> str:
    """The autocast H's passes ran under on this device (`sensitivity.autocast`, `auto` resolved; off:
    the model's own dtype)."""
    lowered = autocast_dtype(recipe.sensitivity.autocast, device)
    return "off" if lowered is None else str(lowered).removeprefix("torch.")


def _distillation_data(recipe: Recipe, tokenizer: Any) -> Any:
    """The distillation stage's windows (None without one)."""
    if recipe.distillation is None:
        return None
    from compressor.training.distill import distillation_data

    return distillation_data(recipe.distillation, tokenizer)


def _distil(
    recipe: Recipe,
    family: ModelFamily,
    student: PreTrainedModel,
    data: Any,
    staging: Path,
    device: torch.device,
    evaluation: list[Batch] | None,
    resources: Resources,
    report_progress: Progress,
    ranks: Ranks,
) -> tuple[PreTrainedModel, Any, dict[str, float] | None, PreTrainedModel]:
    """The distillation stage on every rank: the original as teacher (beside the student, or its
    targets cached layer by layer), the student's evaluation-window KL before (rank 0, when the
    recipe evaluates), then `distill.distill` on `data` (read before the walk). Returns the
    student, the stage's record, the before-metrics and the original (reused for evaluation). A
    bad setting found here keeps the walk's checkpoint, to continue from once it is fixed."""
    from compressor.training.distill import CachedTeacher, LiveTeacher, cached_targets, distill

    spec = recipe.distillation
    assert spec is not None
    original = resources.whole_model(recipe.model)
    undistilled = None
    if evaluation is not None and ranks.rank == 0:
        report_progress("evaluating the undistilled model", 0, len(evaluation))
        undistilled = compare(original.to(device), student.to(device), evaluation, device)["pruned"]
    if spec.teacher == "cached":
        original.to("cpu")
        student.to("cpu")
        store = ActivationStore(device, recipe.activations, staging / SCRATCH_FOLDER)  # `activations: disk` spills
        teacher: Any = CachedTeacher(
            cached_targets(
                original, family, data.train + data.heldout, spec.top_k, device, spec.batch_size, report_progress, store
            )
        )
    else:
        teacher = LiveTeacher(original, spec.top_k)
    fingerprint = {
        "settings": distillation_fingerprint(recipe),
        "data": tensor_digest([row["input_ids"] for row in data.train + data.heldout]),
        "world": str(ranks.world),
    }
    folder = staging / CHECKPOINT_FOLDER / DISTILLATION_FOLDER
    try:
        student, record = distill(
            student, teacher, data, spec, folder, device, fingerprint, recipe.seed, report_progress, ranks.world
        )
    except UserError as error:
        if isinstance(error, ProgressKept):
            raise
        raise ProgressKept(
            f"{error} (the walk's progress is kept in {staging}: fix that and run the same command to continue)"
        ) from None
    return student, record, undistilled, original
