"""`target_decode`: a budget in decode time, met by measurement (issue 49, item 5).

A parameter budget stands in for speed; whoever serves the model cares about the speed. With
`target_decode: f` the pruned model's decode step (batch 1, after a prompt, on this run's device, in
its dtype and attention kernel) takes at most f of the dense model's. A model's speed follows from
its shape, not its weights, so the search times models of the candidates' shapes built with random
weights, each beside a dense model in alternating rounds (`evaluation.throughput`: a load that
comes and goes falls on both), and finds for every candidate (each split of each group,
`checks.group_key`: the blocks removed, the experts and heads kept) the largest parameter budget
at which it decodes within f (`search_budget`). A model without two blocks is faster per parameter
than one with every block, and shapes of the same size differ in speed (a kernel's efficiency
depends on its widths), so each candidate keeps what its own speed allows: the split choice then
compares candidates at equal decode time, not at equal size.

The budgets are kept in the run's checkpoint: a resumed run plans at the same widths (timings
differ from one measurement to the next), and `--restart` measures again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from compressor.errors import UserError
from compressor.evaluation.throughput import fitting_lengths, measure_side_by_side
from compressor.models.layout import SlicedLayout
from compressor.plan.checks import (
    Plan,
    candidate_groups,
    candidate_places,
    group_layouts,
    launched_processes,
    plan,
    plan_config,
)
from compressor.recipe.schema import Recipe
from compressor.reports.report_model import DecodeBudget, DecodeCandidate, DecodeTrial
from compressor.runtime.resume import stored_decode_budget
from compressor.strategies.registry import PluginRegistry

Timer = Callable[[PretrainedConfig, PretrainedConfig], float]
"""(the dense model's config, a candidate's config) → the candidate's decode time per token over
the dense model's."""


@dataclass(frozen=True)
class DecodeSettings:
    """How the decode step is timed and how far the search goes."""

    prompt_len: int = 128
    decode_tokens: int = 32
    """The report's own decode timing's lengths (`evaluation.throughput.fitting_lengths`), so that
    the run's evaluation checks the saved model under the conditions the search timed."""
    repeats: int = 3
    """Timed rounds per pair (dense, candidate); their median is compared."""
    steps: int = 4
    """Probes of new shapes per candidate between the budgets that bracket the target (`search_budget`)."""
    close: float = 0.01
    """A budget timed within this share below the target ends the search (the timings' own noise is larger)."""
    floor: float = 0.02
    """The smallest parameter budget probed before the target is refused as out of reach."""
    timer: Timer | None = None
    """What times a candidate's shape against the dense one (None: `shape_timer`, on the run's device)."""
    progress: Callable[[str, int, int], None] | None = None
    """Hears which group's candidates are being timed (the run's progress display)."""


def shape_timer(recipe: Recipe, device: torch.device, settings: DecodeSettings) -> Timer:
    """The timer of a run: models built from the configs on `device`, in the recipe's dtype and
    attention kernel, random weights, each candidate timed beside the dense model (built once and
    kept, so at most two models are held at a time)."""
    dtype = getattr(torch, recipe.model.dtype)
    dense_models: dict[str, torch.nn.Module] = {}

    def build(config: PretrainedConfig) -> torch.nn.Module:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=recipe.model.attn_implementation
            )
        return model.eval().requires_grad_(False)

    def timer(dense: PretrainedConfig, config: PretrainedConfig) -> float:
        key = dense.to_json_string()
        if key not in dense_models:
            dense_models.clear()
            dense_models[key] = build(dense)
        reference, candidate = dense_models[key], build(config)
        lengths = fitting_lengths([reference, candidate], settings.prompt_len, settings.decode_tokens)
        speeds = measure_side_by_side(
            {"dense": reference, "candidate": candidate},
            device,
            batch_sizes=(1,),
            repeats=settings.repeats,
            warmup=1,
            **lengths,
        )
        seconds = {name: side["throughput"]["batch"]["1"]["decode_s"] for name, side in speeds.items()}
        return seconds["candidate"] / seconds["dense"]

    return timer


def candidate_label(layout: SlicedLayout) -> str:
    """`width 504, MLP 1160`: a candidate within its group (the group names blocks, experts and heads)."""
    mlp = "all" if layout.mlp_width is None else str(layout.mlp_width)
    return f"width {layout.kept}, MLP {mlp}"


Probe = Callable[[float], "tuple[str, float] | str"]
"""A budget → one candidate's label and decode ratio there, or why the budget leaves it no width."""


def search_budget(
    probe: Probe, target: float, ceiling: float, settings: DecodeSettings
) -> tuple[float, list[DecodeTrial]]:
    """The largest parameter budget in (0, `ceiling`] found at which a candidate decodes within
    `target`: the ceiling if it does; else a guess at `target` of it, halved until it does; then up
    to `settings.steps` probes of shapes not timed before (one that plans a shape already probed
    costs nothing and does not count: a candidate whose width steps coarsely still reaches its
    next shape) between the highest budget that met the target and the lowest that
    did not (until one is within `settings.close` below it), each where a straight line through their
    ratios meets the target (decode time is close to affine in the parameters), kept off either end.
    Refused in one line where nothing from `settings.floor` up meets the target."""
    trials: list[DecodeTrial] = []

    def timed(budget: float) -> float | None:
        measured = probe(budget)
        if isinstance(measured, str):
            trials.append(DecodeTrial(target_params=budget, refused=measured))
            return None
        label, ratio = measured
        trials.append(DecodeTrial(target_params=budget, label=label, ratio=ratio))
        return ratio

    high, high_ratio = ceiling, timed(ceiling)
    if high_ratio is not None and high_ratio <= target:
        return ceiling, trials
    low = ceiling * min(target, 0.95)  # decode time is close to proportional to the parameters
    while (low_ratio := timed(low)) is None or low_ratio > target:
        high, high_ratio = low, low_ratio
        low /= 2
        if low < settings.floor:
            fastest = min((t.ratio for t in trials if t.ratio is not None), default=None)
            reached = "" if fastest is None else f" (the fastest shape measured took {fastest:.2f} of it)"
            raise UserError(
                f"target_decode {target}: no budget from {settings.floor} of the parameters up decodes within "
                f"{target} of the dense model's time on this device{reached}; raise target_decode, or give "
                f"target_params"
            )
    steps = 0
    while steps < settings.steps:
        gap = high - low
        if gap < 1e-3 or target - low_ratio <= settings.close * target:
            break
        middle = low + gap / 2
        if high_ratio is not None and high_ratio > low_ratio:
            middle = low + (target - low_ratio) * gap / (high_ratio - low_ratio)
        middle = min(max(middle, low + gap / 8), high - gap / 8)
        ratio = timed(middle)
        steps += trials[-1].label not in {trial.label for trial in trials[:-1]}  # a shape probed before is free
        if ratio is not None and ratio <= target:
            low, low_ratio = middle, ratio
        else:
            high, high_ratio = middle, ratio
    return low, trials


def _candidate_probe(
    recipe: Recipe,
    ceiling_plan: Plan,
    key: str,
    place: int,
    time_shape: Callable[[PretrainedConfig], float],
    measured: dict[str, float],
) -> Probe:
    """The probe of group `key`'s candidate at `place`: planned at a budget, its shape timed unless
    `measured` (by the shape's config) has it already."""

    def probe(budget: float) -> tuple[str, float] | str:
        try:
            layouts = group_layouts(recipe, ceiling_plan, key, budget)
        except UserError as error:
            return str(error)
        if place >= len(layouts):
            return f"the budget leaves {len(layouts)} split(s) of the MLP, not {place + 1}"
        config = layouts[place].saved_config()
        shape = config.to_json_string()
        if shape not in measured:
            measured[shape] = time_shape(config)
        return candidate_label(layouts[place]), measured[shape]

    return probe


def resolve(
    recipe: Recipe,
    ceiling_plan: Plan,
    registry: PluginRegistry,
    device: torch.device,
    restart: bool = False,
    settings: DecodeSettings = DecodeSettings(),
) -> tuple[Plan, DecodeBudget]:
    """The plan of a `target_decode` recipe, each candidate at its decode budget, and the search's
    record; `ceiling_plan` is the recipe's plan at its parameter ceiling, where the search starts
    (the run's own, not made again). An interrupted run's budgets are read back unless `restart`."""
    assert recipe.target_decode is not None
    if launched_processes() > 1:
        raise UserError(
            "target_decode times models in one process, and each rank would time its own; launch one process, "
            "or give target_params"
        )
    if recipe.model.load == "stream":
        raise UserError(
            "target_decode times whole models of each candidate's shape on the device, which model.load: stream "
            "says do not fit; give target_params instead"
        )
    stored = None if restart else stored_decode_budget(Path(recipe.output), recipe)
    record = stored or _search(recipe, ceiling_plan, device, settings)
    return plan(recipe, registry, record.budgets()), record


def _search(
    recipe: Recipe,
    ceiling_plan: Plan,
    device: torch.device,
    settings: DecodeSettings,
) -> DecodeBudget:
    """Every candidate's largest budget whose decode time meets the target, timed on `device`."""
    assert recipe.target_decode is not None
    progress = settings.progress
    started = time.perf_counter()
    timer = settings.timer or shape_timer(recipe, device, settings)
    dense = plan_config(recipe, ceiling_plan)
    ceiling = recipe.target_params or 1.0
    groups = candidate_groups(recipe, ceiling_plan)
    found: list[DecodeCandidate] = []
    measured: dict[str, float] = {}  # by the shape's config: a probe that plans a shape already timed does not time it
    places = candidate_places(recipe)
    refusal: UserError | None = None
    for index, key in enumerate(groups):
        for place in range(places):
            if progress is not None:
                progress(f"target_decode: timing decode of {key}", index * places + place, len(groups) * places)

            probe = _candidate_probe(recipe, ceiling_plan, key, place, lambda config: timer(dense, config), measured)
            try:
                budget, trials = search_budget(probe, recipe.target_decode, ceiling, settings)
            except UserError as error:  # this candidate cannot meet the target: the others may
                refusal = error
                continue
            last = next(t for t in reversed(trials) if t.target_params == budget and t.ratio is not None)
            assert last.label is not None and last.ratio is not None
            found.append(
                DecodeCandidate(
                    group=key, place=place, label=last.label, target_params=budget, ratio=last.ratio, trials=trials
                )
            )
    if not found:
        assert refusal is not None
        raise refusal
    if progress is not None:
        progress("target_decode: timing decode", 1, 1)
    return DecodeBudget(
        target=recipe.target_decode,
        ceiling=ceiling,
        device=str(device),
        dtype=recipe.model.dtype,
        prompt_len=settings.prompt_len,
        decode_tokens=settings.decode_tokens,
        repeats=settings.repeats,
        candidates=found,
        seconds=time.perf_counter() - started,
    )
