"""One `compress run`: check everything, then run the stages in order, then publish.

All checks that need no weights (recipe, model config, family, widths, device, each stage's own
preconditions) happen before any work (`plan.checks`). The run writes into a hidden staging folder
beside the output (`.<name>.partial`) and renames it into place only when everything succeeded,
so a failed run leaves no half-written output. The staging folder also holds the run's
checkpoint: a run that was killed or interrupted after H or a site was finished keeps it, and the
same command continues from there (`restart=True` discards it). Folders, lock and publishing live
in `runtime.staging`, fingerprints in `runtime.resume`, the stages in `stages`; here is the loop.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from compressor import faults
from compressor.engine import parallel
from compressor.engine.checkpoint import Checkpoint
from compressor.errors import Interrupts, ProgressKept, UserError
from compressor.plan.checks import Plan, check_device_settings, plan
from compressor.plan.decode_budget import DecodeSettings
from compressor.plan.decode_budget import resolve as resolve_decode
from compressor.plan.memory import check_memory, machine_memory, resolved_load, run_memory_plan, writes_as_it_goes
from compressor.plan.timing import TimePlan, time_plan
from compressor.recipe.schema import Recipe
from compressor.reports.guard import GuardRecord
from compressor.reports.report_model import RunReport
from compressor.run.follower import follow
from compressor.runtime.loading import Resources, resolve_device
from compressor.runtime.resume import check_interrupted
from compressor.runtime.staging import (
    CHECKPOINT_FOLDER,
    SCRATCH_FOLDER,
    check_output,
    full_disk_is_a_user_error,
    locked,
    prepare_staging,
    publish,
)
from compressor.runtime.threads import use_threads
from compressor.stages.base import Progress, RunState
from compressor.stages.contract import Candidate, Stage
from compressor.stages.split_choice import KeptFisher
from compressor.strategies.registry import PluginRegistry


@dataclass(frozen=True)
class RunOptions:
    """What a run is handed beside its recipe that most callers leave as it is: a sweep's shared
    resources, bases-only saving, and the command line's warnings, memory check and time plan."""

    resources: Resources | None = None
    """Model, data and H (a sweep shares them between its runs); None: the run's own."""
    save_model: bool = True
    """False keeps only the bases (`bases.apply_bases` rebuilds the model from them)."""
    warn: Callable[[str], None] | None = None
    """Hears what the run goes on with but a user should know (a very large cut)."""
    memory_check: bool = True
    """False runs a recipe whose memory plan is above this machine's memory."""
    estimate: Callable[[TimePlan], None] | None = None
    """Hears the time plan (`plan.timing`, a layer timed first), which the report keeps."""


def run(
    recipe: Recipe,
    registry: PluginRegistry,
    progress: Progress | None = None,
    overwrite: bool = False,
    restart: bool = False,
    options: RunOptions | None = None,
) -> RunReport | None:
    """Run a validated recipe; return the report (also written to `<output>/report.json`; None on
    a data-parallel run's ranks above 0, which write nothing).

    A run to the same output that was killed or interrupted continues from its checkpoint
    when the recipe, model and data are unchanged; `restart` discards that checkpoint first.
    `options`: see `RunOptions` (None: its defaults).
    """
    started = time.perf_counter()
    options = options or RunOptions()
    report_progress = progress or (lambda *_: None)
    checked = plan(recipe, registry)  # every stage's own preconditions among its checks
    device = resolve_device(recipe.device)
    check_device_settings(recipe, device, options.save_model, checked.stages)
    ranks, device = parallel.start(device)  # first: each rank plans for its own GPU (cuda:LOCAL_RANK)
    if recipe.threads is not None:  # else the caller's count (the command line's: `threads.command_threads`)
        use_threads(recipe.threads)
    decode = None
    if recipe.target_decode is not None:  # the budgets timed with the threads the run has
        settings = DecodeSettings(progress=report_progress)
        checked, decode = resolve_decode(recipe, checked, registry, device, restart, settings)
    recipe = _fitted(recipe, checked, device, options)
    if ranks.world > 1:
        if options.resources is not None:
            raise UserError("a sweep's runs share their data and H in one process: launch it without torchrun")
        if ranks.rank > 0:
            check_output(Path(recipe.output), overwrite)  # as rank 0 does: every rank stops at once
            return follow(recipe, checked, device, ranks, Resources(), report_progress)
    planned = None
    if options.estimate is not None:  # timed before anything is written; the run's own seed is set when it starts
        planned = time_plan(recipe, checked, device)
        options.estimate(planned)
    staging = prepare_staging(Path(recipe.output), overwrite)
    state = RunState(
        staging=staging,
        recipe=recipe,
        checked=checked,
        device=device,
        checkpoint=Checkpoint(staging / CHECKPOINT_FOLDER),
        progress=report_progress,
        resources=options.resources or Resources(),
        ranks=ranks,
        save_model=options.save_model,
        warn=options.warn or (lambda _: None),
        started=started,
        writes=writes_as_it_goes(recipe, checked.layout, options.save_model, checked.stages),
        estimate=None if planned is None else planned.record(),
        decode=decode,
    )
    if decode is not None:
        state.timings["decode_budget_s"] = 0.0 if decode.reused else decode.seconds
    return _run_staged(state, overwrite, restart)


def _fitted(recipe: Recipe, checked: Plan, device: torch.device, options: RunOptions) -> Recipe:
    """The recipe with the model's loading this machine's memory allows (`plan.memory.resolved_load`),
    the plan's warnings and that choice said first; refused (unless `options.memory_check` is off)
    before anything is written, so that a run that cannot fit stops in its first second."""
    for warning in checked.warnings if options.warn is not None else ():
        options.warn(warning)
    machine = machine_memory(device)
    recipe, chosen = resolved_load(recipe, checked, device, machine, options.save_model)
    if chosen is not None and options.warn is not None:
        options.warn(chosen)
    if options.memory_check:
        check_memory(run_memory_plan(recipe, checked, device, options.save_model), machine)
    return recipe


def _run_staged(state: RunState, overwrite: bool, restart: bool) -> RunReport:
    """The stages in the locked staging folder, then the folder published as the output. A
    failure keeps the checkpoint's progress (to continue from) unless the run made none, or
    its input was bad from the start."""
    output, staging = Path(state.recipe.output), state.staging
    check_interrupted(output, state.recipe, restart)  # its progress kept, refused before anything is loaded
    with locked(staging, output):
        check_output(output, overwrite)  # again, under the lock: another run may have published meanwhile
        checkpoint = state.checkpoint
        shutil.rmtree(staging / SCRATCH_FOLDER, ignore_errors=True)  # spill files of a killed run
        if restart:
            checkpoint.discard()
        fresh = not checkpoint.has_progress()  # else this run resumes progress made before it
        try:
            with full_disk_is_a_user_error(output):
                run_stages(state)
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
    assert state.report is not None
    return state.report


def run_stages(state: RunState) -> None:
    """Every stage of the plan in order, each that has work in this run timed under its key; a
    guarded stage's candidate judged by the held-out guard (`guard`)."""
    if state.checked.may_choose_split:  # the splits' trial walks and the run's walk share one H pass
        state.resources = KeptFisher(state.resources)
    torch.manual_seed(state.recipe.seed)
    for stage in state.checked.stages:
        if not stage.runs(state):
            continue
        with state.timed(stage.timing):
            candidate = stage.run(state)
            if candidate is not None:
                guard(stage, state, candidate)
        faults.reached(f"stage:{stage.name}")


def guard(stage: Stage, state: RunState, candidate: Candidate) -> None:
    """The held-out guard, the one place a stage's proposed model is judged: KL(original ‖ model as
    saved) on held-out windows, before and after the stage; its model kept only when not worse."""
    original = state.resources.whole_model(state.recipe.model).to(state.device)
    phase = f"{stage.name}: the guard, on held-out windows"
    state.progress(phase, 0, 2)
    before = state.heldout_kl(original, state.pruned, candidate.received_scale)
    state.progress(phase, 1, 2)
    after = state.heldout_kl(original, candidate.model, candidate.head_scale)
    record = GuardRecord.judge(stage.name, sum(len(batch.input_ids) for batch in state.heldout), before, after)
    state.record_guard(record)
    if record.kept:
        stage.adopt(state, candidate)
