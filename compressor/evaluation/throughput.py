"""What the pruning buys: size and speed of a dense and a pruned model on one device.

Size counts what a pruned model really carries, the residual transition matrices included
(ordinary `nn.Linear` parameters: the `attn_shortcut` / `mlp_shortcut` of every
`compressor.models.sliced.SlicedDecoderLayer`). Speed follows the usual split of generation into prefill (one forward
over the whole prompt) and decode (one token at a time against the KV cache), in tokens per
second per batch size, after untimed warm-up runs, as the median of repeats, with the slowest
and fastest repeat beside it (a speedup near 1 may be noise: `speedup_bounds`). The timed
decode is the model's real cached decoding path (`prefill` then `decode`, also used by the
tests to check it against a full forward), fed fixed random tokens so both models do the same
work whatever they predict.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel


def _storage_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Tensors viewing the same memory (tied weights, even as distinct Parameters) share a key."""
    if tensor.device.type == "meta":
        return ("meta", id(tensor))
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))


def transition_params(model: nn.Module) -> int:
    """Parameters of the residual transitions (a dense model has none). Found by attribute name,
    not class, so the copy of the layer in a run folder's own code (`modeling_sliced.py`,
    loaded with `trust_remote_code` where compressor is not imported) counts too."""
    total = 0
    for module in model.modules():
        for name in ("attn_shortcut", "mlp_shortcut"):
            shortcut = getattr(module, name, None)
            if isinstance(shortcut, nn.Module):
                total += sum(p.numel() for p in shortcut.parameters())
    return total


def model_size(model: nn.Module) -> dict[str, int]:
    """`params` (tied weights once, transitions included), `weight_bytes` (those parameters and
    the persistent buffers, i.e. what the state dict holds, at their dtypes' sizes) and
    `transition_params` (the share of `params` the residual transitions cost)."""
    seen: set[tuple[Any, ...]] = set()
    params = weight_bytes = 0
    for tensor in model.state_dict(keep_vars=True).values():  # persistent buffers only
        key = _storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        weight_bytes += tensor.numel() * tensor.element_size()
        if isinstance(tensor, nn.Parameter):
            params += tensor.numel()
    return {"params": params, "weight_bytes": weight_bytes, "transition_params": transition_params(model)}


def prefill(model: PreTrainedModel, input_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """One forward over the prompt that fills a fresh KV cache; returns the last position's
    logits (batch, vocab) and the cache.

    The head runs on every position. Generation keeps only the last (`logits_to_keep=1`), but
    that slice is a strided view and, on CPU, torch's matmul then copies the head weight for
    every row when the weights do not require grad, as in a model fresh from the engine, and
    not in one loaded from disk: a cost of a flag, not of the model, which would skew the
    comparison (bfloat16, batch 8: +60% prefill time on the reference model).
    """
    out = model(input_ids=input_ids, use_cache=True)
    return out.logits[:, -1], out.cache


def decode(model: PreTrainedModel, cache: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Feed `tokens` (batch, steps) one position at a time through the KV cache, as generation
    does; returns each step's logits (batch, steps, vocab). The cache grows in place."""
    logits = []
    for step in range(tokens.shape[1]):
        out = model(input_ids=tokens[:, step : step + 1], cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


def _max_positions(model: PreTrainedModel) -> int | None:
    """The longest sequence the config allows (learned position tables fail past it)."""
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(model.config, name, None)
        if isinstance(value, int):
            return value
    return None


def fitting_lengths(models: list[PreTrainedModel], prompt_len: int = 128, decode_tokens: int = 32) -> dict[str, int]:
    """`prompt_len` and `decode_tokens`, shortened to fit the models' position limits (the
    prompt gives way first), for a report that must not fail on a model with short contexts."""
    limits = [limit for limit in map(_max_positions, models) if limit is not None]
    if limits and prompt_len + decode_tokens > min(limits):
        decode_tokens = min(decode_tokens, max(1, min(limits) // 4))
        prompt_len = max(1, min(limits) - decode_tokens)
    return {"prompt_len": prompt_len, "decode_tokens": decode_tokens}


REPORT_BATCH_SIZES, REPORT_REPEATS, REPORT_BUDGET_S = (1, 8), 5, 20.0
"""A run's report times batch 1 and 8, up to 5 rounds each within about 20 s of timed rounds (a
135M model on two busy CPU cores spent 11 of a run's 26 minutes here with 3 unbounded repeats)."""


def report_settings(models: list[PreTrainedModel]) -> dict[str, Any]:
    """`ThroughputOptions`' fields, as `measure`'s and `compare_speed`'s keywords, for a run's or
    `compress eval`'s report: lengths that fit the models, the batch sizes and the bounded repeats."""
    return {
        **fitting_lengths(models),
        "batch_sizes": REPORT_BATCH_SIZES,
        "repeats": REPORT_REPEATS,
        "budget_s": REPORT_BUDGET_S,
    }


def cost_note(settings: Mapping[str, Any]) -> str:
    """What the measurement `settings` (`report_settings`) will cost, for its progress line."""
    return (
        f"one warm-up and up to {settings['repeats']} timed rounds per batch size, "
        f"about {settings['budget_s'] * len(settings['batch_sizes']):.0f} s at most after warm-up"
    )


@dataclass(frozen=True)
class ThroughputOptions:
    """How `measure_throughput` times a model: the lengths, the batch sizes, the runs and their
    budget, and the random ids it feeds (`report_settings` gives a run's report's)."""

    prompt_len: int = 128
    """Prefill: batch × prompt_len tokens over the time of one forward on random ids."""
    decode_tokens: int = 32
    """Decode: batch × decode_tokens tokens over the time of decode_tokens single-token forwards
    after that prefill (its cache untimed)."""
    batch_sizes: Iterable[int] = (1, 8)
    warmup: int = 1
    """Runs not timed."""
    repeats: int = 3
    """Timed runs: rates come from their median."""
    budget_s: float | None = None
    """Bounds the timed rounds' seconds per batch size (at least one round; `_timings`)."""
    vocab_size: int | None = None
    """The random ids are drawn from [0, vocab_size) (the config's by default)."""
    seed: int = 0
    """Seeds the random ids."""


def _timings(
    models: list[PreTrainedModel],
    device: torch.device,
    ids: torch.Tensor,
    new: torch.Tensor,
    options: ThroughputOptions,
) -> list[tuple[list[float], list[float]]]:
    """(prefill seconds, decode seconds) of each run of each model. The models take turns run by
    run, so a load that comes and goes on a shared machine falls on all of them alike. With
    `budget_s`, a round (every model once) is not started once the rounds so far plus one more,
    at the last round's (or warm-up's) cost, would pass it: at least one timed round, at most
    `repeats` (a model whose one call takes seconds gets fewer repeats, not minutes)."""
    warmup, repeats, budget_s = options.warmup, options.repeats, options.budget_s

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def once(model: PreTrainedModel) -> tuple[float, float]:
        sync()
        tick = time.perf_counter()
        _, cache = prefill(model, ids)
        sync()
        middle = time.perf_counter()
        decode(model, cache, new)
        sync()
        return middle - tick, time.perf_counter() - middle

    round_s = 0.0
    for _ in range(warmup):
        round_s = sum(sum(once(model)) for model in models)
    runs: list[tuple[list[float], list[float]]] = [([], []) for _ in models]
    spent = 0.0
    for done in range(repeats):
        if done and budget_s is not None and spent + round_s > budget_s:
            break
        round_s = 0.0
        for model, (prefill_s, decode_s) in zip(models, runs):
            first, second = once(model)
            prefill_s.append(first)
            decode_s.append(second)
            round_s += first + second
        spent += round_s
    return runs


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the system does not give one)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def under_load(throughput: Mapping[str, Any]) -> str | None:
    """Where the load average while timing was above the machine's CPUs (runnable threads beyond
    its cores: the timings include waiting), a line saying so; None otherwise."""
    load, cpus = throughput.get("load_average"), throughput.get("cpus")
    if load is None or not cpus or load <= cpus:
        return None
    return f"load average {load:.1f} on {cpus} CPUs while timed: the tokens/s include waiting for a core"


def rounds(numbers: Mapping[str, Any], phase: str) -> int | None:
    """How many timed rounds a phase's figures come from (None: not recorded)."""
    runs = numbers.get(f"{phase}_runs_s")
    return len(runs) if runs else None


def _rates(phase: str, tokens: int, seconds: list[float]) -> dict[str, Any]:
    """A phase's median rate and time, every run's time, and the slowest and fastest run's rate:
    the spread that tells a real speedup from the noise of a busy machine."""
    median = statistics.median(seconds)
    return {
        f"{phase}_tok_s": tokens / median,
        f"{phase}_s": median,
        f"{phase}_runs_s": seconds,
        f"{phase}_tok_s_min": tokens / max(seconds),
        f"{phase}_tok_s_max": tokens / min(seconds),
        f"{phase}_spread": (max(seconds) - min(seconds)) / median,
    }


def rate_range(numbers: Mapping[str, Any], phase: str) -> tuple[float, float] | None:
    """(slowest, fastest) tokens/s of a phase's timed runs; derived from `*_runs_s` for
    measurements taken before the range was recorded; None where neither is there."""
    if f"{phase}_tok_s_min" in numbers and f"{phase}_tok_s_max" in numbers:
        return numbers[f"{phase}_tok_s_min"], numbers[f"{phase}_tok_s_max"]
    runs = numbers.get(f"{phase}_runs_s")
    if not runs or not numbers.get(f"{phase}_s"):
        return None
    tokens = numbers[f"{phase}_tok_s"] * numbers[f"{phase}_s"]
    return tokens / max(runs), tokens / min(runs)


def speedup_bounds(side: Mapping[str, Any], base: Mapping[str, Any], phase: str) -> tuple[float, float] | None:
    """The lowest and highest speedup the two models' ranges of tokens/s allow (slowest `side`
    run over fastest `base` run, and the reverse); a span that holds 1 means the difference is
    within the noise of the repeats. None where a range is unknown."""
    ours, theirs = rate_range(side, phase), rate_range(base, phase)
    if ours is None or theirs is None:
        return None
    return ours[0] / theirs[1], ours[1] / theirs[0]


def _check_lengths(
    models: list[PreTrainedModel], prompt_len: int, decode_tokens: int, warmup: int, repeats: int
) -> None:
    """Counts that time something, and a prompt and decode that fit every model's positions."""
    if repeats < 1 or warmup < 0 or prompt_len < 1 or decode_tokens < 1:
        raise ValueError("need repeats, prompt_len and decode_tokens >= 1 and warmup >= 0")
    for model in models:
        limit = _max_positions(model)
        if limit is not None and prompt_len + decode_tokens > limit:
            raise ValueError(
                f"prompt_len + decode_tokens = {prompt_len + decode_tokens} exceeds the model's {limit} positions"
            )


def _throughput(
    models: list[PreTrainedModel], device: torch.device | str, options: ThroughputOptions
) -> list[dict[str, Any]]:
    """`measure_throughput` of several models on the same inputs, their runs interleaved."""
    device = torch.device(device)
    prompt_len, decode_tokens, warmup, repeats = (
        options.prompt_len,
        options.decode_tokens,
        options.warmup,
        options.repeats,
    )
    _check_lengths(models, prompt_len, decode_tokens, warmup, repeats)
    vocab = options.vocab_size or min(model.config.vocab_size for model in models)
    generator = torch.Generator().manual_seed(options.seed)
    per_batch: list[dict[str, dict[str, Any]]] = [{} for _ in models]
    loads = [load_average()]
    modes = [model.training for model in models]
    try:
        for model in models:
            model.eval()
        with torch.inference_mode():
            for batch in options.batch_sizes:
                ids = torch.randint(vocab, (batch, prompt_len), generator=generator).to(device)
                new = torch.randint(vocab, (batch, decode_tokens), generator=generator).to(device)
                timed = _timings(models, device, ids, new, options)
                for into, (prefill_s, decode_s) in zip(per_batch, timed):
                    into[str(batch)] = {
                        **_rates("prefill", batch * prompt_len, prefill_s),
                        **_rates("decode", batch * decode_tokens, decode_s),
                    }
    finally:
        for model, training in zip(models, modes):
            model.train(training)
    loads.append(load_average())
    known = [load for load in loads if load is not None]
    settings = {
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "load_average": max(known) if known else None,
        "cpus": os.cpu_count(),
        "prompt_len": prompt_len,
        "decode_tokens": decode_tokens,
        "warmup": warmup,
        "repeats": repeats,
        "budget_s": options.budget_s,
    }
    return [
        {**settings, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "batch": batch}
        for model, batch in zip(models, per_batch)
    ]


def measure_throughput(
    model: PreTrainedModel, device: torch.device | str, options: ThroughputOptions = ThroughputOptions()
) -> dict[str, Any]:
    """Prefill and decode tokens per second of `model` (already on `device`) at each batch size,
    timed as `options` say (`ThroughputOptions`).

    Rates come from the median of the timed runs (all kept, in `*_runs_s`; the slowest and fastest
    run's rates in `*_tok_s_min` and `*_tok_s_max`, and the range of the times over their median in
    `*_spread`). On CUDA the device is synchronised around each timing. The model runs in eval mode
    and is given back in the mode it came in.
    """
    return _throughput([model], device, options)[0]


def measure(model: PreTrainedModel, device: torch.device | str, **options: Any) -> dict[str, Any]:
    """`model_size` and, under `throughput`, `measure_throughput` (`options`: `ThroughputOptions`' fields)."""
    return {**model_size(model), "throughput": measure_throughput(model, device, ThroughputOptions(**options))}


def measure_side_by_side(
    models: Mapping[str, PreTrainedModel], device: torch.device | str, **options: Any
) -> dict[str, dict[str, Any]]:
    """Every model measured as `measure` does, on the same inputs, their runs taken in turn (so a
    load that comes and goes falls on all of them alike)."""
    speeds = _throughput(list(models.values()), device, ThroughputOptions(**options))
    return {name: {**model_size(model), "throughput": speed} for (name, model), speed in zip(models.items(), speeds)}


def relative(side: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """`side` against `base`: size ratios, tokens/s ratios per batch size (above 1: faster), and
    under `speedup_range` the span of those ratios the repeats allow (`speedup_bounds`)."""
    speedup, spans = {}, {}
    for batch, numbers in base["throughput"]["batch"].items():
        ours = side["throughput"]["batch"][batch]
        speedup[batch] = {phase: ours[f"{phase}_tok_s"] / numbers[f"{phase}_tok_s"] for phase in ("prefill", "decode")}
        spans[batch] = {phase: speedup_bounds(ours, numbers, phase) for phase in ("prefill", "decode")}
    return {
        "ratio": {key: side[key] / base[key] for key in ("params", "weight_bytes")},
        "speedup": speedup,
        "speedup_range": spans,
    }


def compare_speed(
    baseline: PreTrainedModel,
    pruned: PreTrainedModel,
    device: torch.device | str,
    **options: Any,
) -> dict[str, Any]:
    """Both models measured as `measure` does (`options`: `ThroughputOptions`' fields), on
    the same inputs, their runs taken in turn; `ratio` is pruned / baseline for the sizes,
    `speedup` pruned / baseline tokens per second per batch size (above 1: pruned is faster)."""
    sides = measure_side_by_side({"baseline": baseline, "pruned": pruned}, device, **options)
    return {**sides, **relative(sides["pruned"], sides["baseline"])}
