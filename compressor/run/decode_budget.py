"""`target_decode`: a budget in decode time, met by measurement (issue 49, item 5).

A parameter budget stands in for speed; whoever serves the model cares about the speed. With
`target_decode: f` the pruned model's decode step (batch 1, after a prompt, on this run's device, in
its dtype and attention kernel) takes at most f of the dense model's. A model's speed follows from
its shape, not its weights, so the search times models of the candidates' shapes built with random
weights, each beside a dense model in alternating rounds (`evaluation.throughput`: a load that
comes and goes falls on both), and finds for every candidate group (`checks.group_key`: the blocks
removed, the experts and heads kept) the largest parameter budget at which every candidate of the
group decodes within f, by bisection. A group without two blocks is faster per parameter than one
with every block, so it keeps more parameters at the same decode time: the split choice then
compares its candidates at equal speed, not at equal size.

The budgets are kept in the run's checkpoint: a resumed run plans at the same widths (timings
differ from one measurement to the next), and `--restart` measures again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from compressor.errors import UserError
from compressor.evaluation.throughput import fitting_lengths, measure_side_by_side
from compressor.models.layout import SlicedLayout
from compressor.models.towers import text_config
from compressor.recipe.schema import Recipe
from compressor.run.checks import Plan, candidate_groups, group_layouts, launched_processes, plan
from compressor.run.loading import load_config
from compressor.run.report_model import DecodeBudget, DecodeGroup, DecodeTrial
from compressor.run.resume import stored_decode_budget
from compressor.strategies.registry import PluginRegistry


@dataclass(frozen=True)
class DecodeSettings:
    """How the decode step is timed and how far the search goes."""

    prompt_len: int = 128
    decode_tokens: int = 32
    """The report's own decode timing's lengths (`evaluation.throughput.fitting_lengths`), so that
    the run's evaluation checks the saved model under the conditions the search timed."""
    repeats: int = 5
    """Timed rounds per pair (dense, candidate); their median is compared."""
    steps: int = 5
    """Bisection steps per group after the target has been bracketed (the last halves a gap of
    1/32 of the first bracket)."""
    floor: float = 0.02
    """The smallest parameter budget probed before the target is refused as out of reach."""


Timer = Callable[[PretrainedConfig, Sequence[PretrainedConfig]], list[float]]
"""(the dense model's config, candidates' configs) → each candidate's decode time per token over
the dense model's."""


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

    def timer(dense: PretrainedConfig, configs: Sequence[PretrainedConfig]) -> list[float]:
        key = dense.to_json_string()
        if key not in dense_models:
            dense_models.clear()
            dense_models[key] = build(dense)
        reference = dense_models[key]
        ratios = []
        for config in configs:
            candidate = build(config)
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
            ratios.append(seconds["candidate"] / seconds["dense"])
            del candidate
        return ratios

    return timer


def candidate_label(layout: SlicedLayout) -> str:
    """`width 504, MLP 1160`: a candidate within its group (the group names blocks, experts and heads)."""
    mlp = "all" if layout.mlp_width is None else str(layout.mlp_width)
    return f"width {layout.kept}, MLP {mlp}"


def search_group(
    probe: Callable[[float], dict[str, float] | str], target: float, ceiling: float, settings: DecodeSettings
) -> tuple[float, list[DecodeTrial]]:
    """The largest parameter budget in (0, `ceiling`] at which `probe` (a budget → each candidate's
    decode ratio, or why the budget leaves no width) measures every candidate within `target`:
    the ceiling if it does; else a guess at `target` of it, halved until it does, then bisection.
    Refused in one line where nothing from `settings.floor` up does."""
    trials: list[DecodeTrial] = []

    def meets(budget: float) -> bool:
        measured = probe(budget)
        if isinstance(measured, str):
            trials.append(DecodeTrial(target_params=budget, ratios=None, refused=measured))
            return False
        trials.append(DecodeTrial(target_params=budget, ratios=measured))
        return max(measured.values()) <= target

    if meets(ceiling):
        return ceiling, trials
    high, low = ceiling, ceiling * min(target, 0.95)  # decode time is close to proportional to the parameters
    while not meets(low):
        high, low = low, low / 2
        if low < settings.floor:
            fastest = min((min(t.ratios.values()) for t in trials if t.ratios), default=None)
            reached = "" if fastest is None else f" (the fastest candidate measured took {fastest:.2f} of it)"
            raise UserError(
                f"target_decode {target}: no budget from {settings.floor} of the parameters up decodes within "
                f"{target} of the dense model's time on this device{reached}; raise target_decode, or give "
                f"target_params"
            )
    for _ in range(settings.steps):
        middle = (low + high) / 2
        if meets(middle):
            low = middle
        else:
            high = middle
    return low, trials


def resolve(
    recipe: Recipe,
    registry: PluginRegistry,
    device: torch.device,
    progress: Callable[[str, int, int], None] | None = None,
    restart: bool = False,
    timer: Timer | None = None,
    settings: DecodeSettings = DecodeSettings(),
) -> tuple[Plan, DecodeBudget]:
    """The plan of a `target_decode` recipe, each candidate group at its decode budget, and the
    search's record; an interrupted run's budgets are read back unless `restart`."""
    assert recipe.target_decode is not None
    ceiling_plan = plan(recipe, registry)  # every check, at the ceiling the search starts from
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
    if stored is not None:
        return plan(recipe, registry, stored.budgets()), stored
    started = time.perf_counter()
    timer = timer or shape_timer(recipe, device, settings)
    dense = load_config(recipe.model)
    if ceiling_plan.tower is not None:
        dense = text_config(dense)
    ceiling = recipe.target_params or 1.0
    groups = candidate_groups(recipe, ceiling_plan)
    found: list[DecodeGroup] = []
    measured: dict[str, float] = {}  # by the shape's config: a probe that plans the same shapes is not timed again
    for index, key in enumerate(groups):
        phase = f"target_decode: timing decode of {key}"

        def probe(budget: float, key: str = key, phase: str = phase, index: int = index) -> dict[str, float] | str:
            try:
                layouts = group_layouts(recipe, ceiling_plan, key, budget)
            except UserError as error:
                return str(error)
            configs = [layout.saved_config() for layout in layouts]
            shapes = [config.to_json_string() for config in configs]
            fresh = [i for i, shape in enumerate(shapes) if shape not in measured]
            if progress is not None:
                progress(phase, index, len(groups))
            for i, ratio in zip(fresh, timer(dense, [configs[i] for i in fresh])):
                measured[shapes[i]] = ratio
            return {candidate_label(layout): measured[shape] for layout, shape in zip(layouts, shapes)}

        budget, trials = search_group(probe, recipe.target_decode, ceiling, settings)
        ratios = next(t.ratios for t in reversed(trials) if t.target_params == budget and t.ratios is not None)
        found.append(DecodeGroup(group=key, target_params=budget, ratios=ratios, trials=trials))
    if progress is not None:
        progress("target_decode: timing decode", len(groups), len(groups))
    record = DecodeBudget(
        target=recipe.target_decode,
        ceiling=ceiling,
        device=str(device),
        dtype=recipe.model.dtype,
        prompt_len=settings.prompt_len,
        decode_tokens=settings.decode_tokens,
        repeats=settings.repeats,
        groups=found,
        seconds=time.perf_counter() - started,
    )
    return plan(recipe, registry, record.budgets()), record
