"""The time plan: about how long each phase of a run will take on this machine, before any weight
is loaded. As the memory plan measures memory on one fake layer, this measures time on one real
decoder layer of the model's shape (random weights, the recipe's dtype, the run's device): its
forward, and its forward with the backward the H pass makes, per calibration token and for one
decoding step; the head's matmul and log-softmax; and the run's own strategies and selectors on
one synthetic problem of the model's widths (at most `PROBLEM_WIDTH` wide, scaled as the cube of
the width beyond it). Each stage turns those unit costs into its phases (`Stage.seconds`), from
the counts of the recipe and the plan: tokens, layers, sites, the candidates a split choice
measures. An estimate: Python's overhead, the allocator and other work on the machine are not in
it, and a plugin stage that says nothing is not counted.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from compressor.stages.costs import TimedPhase, UnitCosts, Work, duration
from compressor.stages.data import heldout_counts
from compressor.stages.split import adopts

if TYPE_CHECKING:
    from compressor.plan.checks import Plan
    from compressor.recipe.schema import Recipe
    from compressor.reports.report_model import Estimate

PROBLEM_WIDTH = 512
"""The widest synthetic problem a strategy or selector is timed on; wider ones are scaled as width³
(an eigendecomposition's cost, and a greedy selector's over a square matrix)."""

MEASURED_TOKENS = 512
"""Tokens of one calibration window the layer is timed on (fewer when the window is shorter)."""

LAYER_LIMIT = 256 * 2**20
"""A layer of more bytes than this is not built to be timed: its cost is its multiply-adds at the
rate a matmul of its dtype runs here (where a layer is that large, its matmuls are its time)."""

STRATEGY_SECONDS = 2.0
"""How long a strategy or selector is watched on its synthetic problem: past it, its time is its
progress so far (`SiteProblem.progress`) extrapolated to its whole work."""


@dataclass(frozen=True)
class TimePlan:
    """The estimate of every phase, in the run's order, and what the measurement rests on."""

    phases: tuple[TimedPhase, ...]
    measured_s: float
    """Seconds the measurement itself took."""
    unestimated: tuple[str, ...] = ()
    """Stages the run has that give no estimate (a plugin's), and what the unit costs could not time."""

    @property
    def total(self) -> float:
        return sum(phase.seconds or 0.0 for phase in self.phases)

    def by_key(self) -> dict[str, float]:
        """Each report `timings` key's estimated seconds (what a run compares its own with)."""
        keys: dict[str, float] = {}
        for phase in self.phases:
            if phase.key is not None and phase.seconds is not None:
                keys[phase.key] = keys.get(phase.key, 0.0) + phase.seconds
        return keys

    def record(self) -> Estimate:
        """The plan as the report keeps it."""
        from compressor.reports.report_model import Estimate, EstimatedPhase

        phases = [EstimatedPhase(name=p.name, seconds=p.seconds, key=p.key) for p in self.phases]
        return Estimate(
            total_s=self.total, phases=phases, measured_s=self.measured_s, unestimated=list(self.unestimated)
        )

    def line(self) -> str:
        """One line: the total and each phase's share."""
        shown = [phase for phase in self.phases if phase.seconds is not None and phase.seconds >= 0.05]
        parts = ", ".join(f"{phase.name} {duration(phase.seconds or 0.0)}" for phase in shown)
        left = [*self.unestimated, *(phase.name for phase in self.phases if phase.seconds is None)]
        said = [part for part in (parts, f"not estimated: {', '.join(left)}" if left else "") if part]
        return (
            f"time: about {duration(self.total)} on this machine ({'; '.join([*said, ''])}from one layer of this "
            f"model's shape timed here in {self.measured_s:.1f} s: an estimate, other work on the machine not counted)"
        )


def _median_seconds(call: Callable[[], Any], device: torch.device, repeats: int = 3) -> float:
    """The median of `repeats` timed calls after one untimed one."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    call()
    times = []
    for _ in range(repeats):
        sync()
        tick = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - tick)
    return statistics.median(times)


def _one_layer_model(config: Any, dtype: torch.dtype, attention: str) -> Any:
    """The config's model with one decoder layer and a small vocabulary (the head is timed apart):
    what the memory plan builds on fake tensors, here with real ones."""
    from transformers import AutoModelForCausalLM

    single = copy.deepcopy(config)
    single.num_hidden_layers = 1
    if isinstance(getattr(single, "layer_types", None), list):
        single.layer_types = single.layer_types[:1]
    single.vocab_size = min(int(single.vocab_size), 256)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(single, key, None)
        if isinstance(value, int) and value >= single.vocab_size:
            setattr(single, key, None)
    model = AutoModelForCausalLM.from_config(single, dtype=dtype, attn_implementation=attention).eval()
    model.requires_grad_(False)
    return model


def layer_costs(
    config: Any, family: Any, dtype: torch.dtype, attention: str, device: torch.device, seq_len: int
) -> tuple[float, float, float]:
    """(forward per token, forward and backward per token, one single-token call) of one decoder
    layer of `config`'s shape on `device`, on one window of up to `MEASURED_TOKENS` tokens; a layer
    of more than `LAYER_LIMIT` bytes from its multiply-adds instead (`matmul_rate`)."""
    from compressor.plan.fake_layer import layer_bytes, layer_inputs

    layer_bytes = layer_bytes(config, family, dtype, attention)
    if layer_bytes > LAYER_LIMIT:
        forward = 2 * (layer_bytes / dtype.itemsize) / matmul_rate(dtype, device)
        return forward, 3 * forward, forward  # the backward to the input: about twice the forward again

    tokens = max(1, min(seq_len, MEASURED_TOKENS))
    model = _one_layer_model(config, dtype, attention)  # its inputs made on the host, then the layer moved
    inputs = layer_inputs(model, family, 1, tokens, dtype)
    single_inputs = layer_inputs(model, family, 1, 1, dtype)
    layer = model.get_submodule(family.layers)[0].to(device)
    hidden = inputs.hidden.get(0).to(device)
    kwargs = {k: _to(v, device) for k, v in inputs.layer_kwargs[0][0].items()}
    single = single_inputs.hidden.get(0).to(device)
    single_kwargs = {k: _to(v, device) for k, v in single_inputs.layer_kwargs[0][0].items()}

    def forward() -> None:
        with torch.no_grad():
            layer(hidden, **kwargs)

    def backward() -> None:
        x = hidden.detach().requires_grad_(True)
        out = layer(x, **kwargs)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    def call() -> None:
        with torch.no_grad():
            layer(single, **single_kwargs)

    forward_s = _median_seconds(forward, device)
    backward_s = _median_seconds(backward, device)
    return forward_s / tokens, backward_s / tokens, _median_seconds(call, device)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


def matmul_rate(dtype: torch.dtype, device: torch.device) -> float:
    """Multiply-adds a second (× 2: flops) of a [512 × 1024] @ [1024 × 4096] matmul of `dtype` here."""
    a = torch.randn(512, 1024, dtype=dtype, device=device)
    b = torch.randn(1024, 4096, dtype=dtype, device=device)
    return 2 * 512 * 1024 * 4096 / _median_seconds(lambda: a @ b, device)


def head_costs(d: int, vocab: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """(forward, forward and backward) per token of the head's matmul and log-softmax at width `d`
    over `vocab` entries, timed on 256 tokens, up to 16,384 entries and 4,096 wide (scaled to the
    vocabulary and the width)."""
    rows, width = min(vocab, 16384), min(d, 4096)
    weight = torch.randn(rows, width, dtype=dtype, device=device) * 0.02
    x = torch.randn(256, width, dtype=dtype, device=device)

    def forward() -> None:
        with torch.no_grad():
            torch.log_softmax((x @ weight.T).float(), -1)

    def backward() -> None:
        y = x.detach().requires_grad_(True)
        torch.log_softmax((y @ weight.T).float(), -1)[:, 0].sum().backward()

    scale = vocab / rows / 256 * d / width
    return _median_seconds(forward, device) * scale, _median_seconds(backward, device) * scale


def moment_cost(width: int, device: torch.device) -> float:
    """Seconds per token of accumulating a float64 E[x xᵀ] of `width` (`calibration.SecondMoment`),
    timed on 512 tokens at most 2,048 wide and scaled as width²."""
    if width <= 0:
        return 0.0
    measured = min(width, 2048)
    total = torch.zeros(measured, measured, dtype=torch.float64, device=device)
    x = torch.randn(512, measured, dtype=torch.float64, device=device)
    return _median_seconds(lambda: total.addmm_(x.T, x), device) / 512 * (width / measured) ** 2


def _spd(width: int, generator: torch.Generator) -> torch.Tensor:
    """A random symmetric positive-definite matrix (float64), as an E[x xᵀ] looks."""
    x = torch.randn(4 * width, width, dtype=torch.float64, generator=generator)
    return x.T @ x / (4 * width)


class _Watched(Exception):
    """Raised from a watched strategy's progress once `STRATEGY_SECONDS` have passed: what it did so far."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"{seconds:.1f} s")
        self.seconds = seconds


def _watch(call: Callable[[Callable[[int, int], None]], Any]) -> tuple[float, Any]:
    """`call(progress)` timed; where it reports progress past `STRATEGY_SECONDS`, stopped there and its
    time extrapolated from the share done (seconds, and its result or None)."""
    tick = time.perf_counter()

    def progress(done: int, total: int) -> None:
        elapsed = time.perf_counter() - tick
        if done > 0 and total > done and elapsed > STRATEGY_SECONDS:
            raise _Watched(elapsed * total / done)

    try:
        result = call(progress)
    except _Watched as watched:
        return watched.seconds, None
    return time.perf_counter() - tick, result


def basis_cost(checked: Plan, d: int, kept: int) -> float | None:
    """Seconds per site of the pipeline's strategies on a synthetic site of width `d` keeping `kept`
    (timed at most `PROBLEM_WIDTH` wide, scaled as width³; a long one watched, `_watch`); None where a
    strategy refuses made-up statistics (a plugin's may)."""
    from compressor.strategies.contract import SiteProblem, SiteStatistics

    width = min(d, PROBLEM_WIDTH)
    keep = max(1, min(width - 1, round(kept * width / d)))
    generator = torch.Generator().manual_seed(0)
    stats = SiteStatistics(C=_spd(width, generator), tokens=4 * width, extra={"H": _spd(width, generator)})
    seconds, incoming = 0.0, None
    for step in checked.pipeline:

        def choose(progress: Callable[[int, int], None], step: Any = step, incoming: Any = incoming) -> Any:
            problem = SiteProblem(name="embedding", index=0, width=width, keep=keep, stats=stats, progress=progress)
            return step.strategy.select(problem, incoming, step.options)

        try:
            spent, incoming = _watch(choose)
        except Exception:  # noqa: BLE001 - not timed, said so
            return None
        seconds += spent
        if incoming is None:  # stopped early: the steps after it are not timed
            break
    return seconds * (d / width) ** 3


def neuron_cost(checked: Plan, d: int, f: int, kept: int) -> float | None:
    """Seconds per layer of the `mlp` selector on a synthetic MLP of `f` neurons keeping `kept` (timed
    at most `PROBLEM_WIDTH` neurons wide, scaled as width³)."""
    from compressor.strategies.neuron_contract import NeuronProblem

    if checked.selector is None or f <= 0:
        return 0.0
    width, stream = min(f, PROBLEM_WIDTH), min(d, PROBLEM_WIDTH)
    generator = torch.Generator().manual_seed(0)
    problem = NeuronProblem(
        layer=0,
        keep=max(1, min(width - 1, round(kept * width / f))),
        C=_spd(width, generator),
        activation=torch.rand(width, dtype=torch.float64, generator=generator),
        down=torch.randn(stream, width, dtype=torch.float64, generator=generator),
        damping=1e-2,
        G=_spd(stream, generator) if "H" in checked.selector.requires else None,
        tokens=4 * width,
    )
    tick = time.perf_counter()
    try:
        checked.selector.select(problem)
    except Exception:  # noqa: BLE001 - as for a strategy: not timed, said so
        return None
    return (time.perf_counter() - tick) * (f / width) ** 3


def measure_costs(recipe: Recipe, checked: Plan, device: torch.device) -> tuple[UnitCosts, float]:
    """The unit costs of this recipe's model on `device`, and the seconds measuring them took.
    Remembered per model shape, settings, strategies and threads: a sweep's runs, or a test suite's,
    measure once (the seconds are the first measurement's)."""
    from compressor.models.layout import mlp_neurons

    layout = checked.layout
    config, family = layout.config, layout.family
    threads = torch.get_num_threads()
    key = (
        config.to_json_string(),
        family.name,
        recipe.model.dtype,
        recipe.model.attn_implementation,
        str(device),
        recipe.calibration.seq_len,
        repr([(step.strategy.name, step.options) for step in checked.pipeline]),
        None if checked.selector is None else checked.selector.name,
        recipe.mlp is not None,
        layout.kept,
        layout.mlp_width,
        layout.residual,
        threads,
    )
    if key not in _MEASURED:
        _MEASURED[key] = _measure(recipe, checked, device, mlp_neurons)
    return _MEASURED[key]


_MEASURED: dict[tuple[Any, ...], tuple[UnitCosts, float]] = {}


def _measure(recipe: Recipe, checked: Plan, device: torch.device, mlp_neurons: Any) -> tuple[UnitCosts, float]:
    """`measure_costs` itself."""
    tick = time.perf_counter()
    layout = checked.layout
    config, family = layout.config, layout.family
    dtype = getattr(torch, recipe.model.dtype)
    threads = torch.get_num_threads()
    forward, backward, call = layer_costs(
        config, family, dtype, recipe.model.attn_implementation, device, recipe.calibration.seq_len
    )
    head_forward, head_backward = head_costs(config.hidden_size, int(config.vocab_size), dtype, device)
    d = config.hidden_size
    kept = layout.kept or d
    basis = basis_cost(checked, d, kept) if layout.residual else 0.0
    f = mlp_neurons(config, family) if recipe.mlp is not None and family.mlp_width is not None else 0
    neurons = neuron_cost(checked, d, f, layout.mlp_width or max(1, f // 2)) if f else 0.0
    untimed = tuple(
        what for what, cost in (("the pipeline's strategies", basis), ("the mlp selector", neurons)) if cost is None
    )
    moment_stream = moment_cost(d, device) if layout.residual else 0.0
    moment_mlp = moment_cost(f, device) if f else 0.0
    torch.set_num_threads(threads)
    costs = UnitCosts(
        forward,
        backward,
        call,
        head_forward,
        head_backward,
        basis or 0.0,
        neurons or 0.0,
        0.0,
        moment_stream,
        moment_mlp,
        untimed,
    )
    return costs, time.perf_counter() - tick


def time_plan(recipe: Recipe, checked: Plan, device: torch.device, costs: UnitCosts | None = None) -> TimePlan:
    """Every stage's phases (`Stage.seconds`) from the unit costs (measured here unless given)."""
    measured_s = 0.0
    if costs is None:
        costs, measured_s = measure_costs(recipe, checked, device)
    config = checked.layout.config
    stages = [stage for stage in checked.stages if stage.wanted(recipe)]
    evaluation = recipe.evaluation
    work = Work(
        costs=costs,
        recipe=recipe,
        checked=checked,
        layers=config.num_hidden_layers,
        original_layers=config.num_hidden_layers + len(checked.removed_blocks),
        tokens=recipe.calibration.num_samples * recipe.calibration.seq_len,
        evaluation_tokens=0 if evaluation is None else evaluation.num_samples * evaluation.seq_len,
        heldout={stage.name: count * recipe.calibration.seq_len for stage, count in heldout_counts(recipe, checked)},
        adopts_trial=adopts(recipe, checked),
    )
    phases: list[TimedPhase] = []
    unestimated: list[str] = []
    for stage in stages:
        estimated = stage.seconds(work)
        if estimated is None:
            unestimated.append(stage.name)
        else:
            phases += estimated
    return TimePlan(tuple(phases), measured_s, (*unestimated, *costs.untimed))
