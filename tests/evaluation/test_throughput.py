"""Size and speed figures: what they count, and that the timed decode is the real cached decoding path."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.evaluation.throughput import (
    ThroughputOptions,
    compare_speed,
    decode,
    measure_throughput,
    model_size,
    prefill,
)
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor_plugins.pca import PCA
from tests.conftest import FAMILY_CONFIGS, copy_model, random_batches, tiny_model, widths_for
from tests.engine.test_slicing import _expected_parameters

FAST = dict(prompt_len=8, decode_tokens=4, batch_sizes=(1, 3), warmup=1, repeats=2)


def _pruned(family_name: str) -> tuple[PreTrainedModel, PreTrainedModel, list[int]]:
    """(dense, 25%-pruned, widths per site) for a tiny model of the family."""
    dense = tiny_model(family_name)
    config = dense.config
    slice_head = family_for(family_name).head_width_is_embedding_width
    by_site = widths_for(family_name, config, kept_width(config.hidden_size, 0.25, 8), slice_head)
    pruned = prune(
        copy_model(dense),
        fixed_layout(dense.config, family_for(family_name), by_site),
        random_batches(config.vocab_size),
        [PipelineStep(PCA())],
    ).model
    return dense, pruned, list(by_site.values())


@pytest.fixture(scope="module")
def llama() -> tuple[PreTrainedModel, PreTrainedModel, list[int]]:
    return _pruned("llama")


def _transition_count(widths: list[int], parallel: bool) -> int:
    if parallel:  # one transition per layer, layer input → layer output
        return sum(w_in * w_out for w_in, w_out in zip(widths, widths[1:]))
    return sum(widths[i] * widths[i + 1] + widths[i + 1] * widths[i + 2] for i in range(0, len(widths) - 1, 2))


def _safetensors_data_bytes(folder: Path) -> int:
    """Bytes of tensor data in a saved model.safetensors (file size less the 8-byte length and JSON header)."""
    path = folder / "model.safetensors"
    with path.open("rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        json.loads(handle.read(header_len))  # a well-formed header
    return path.stat().st_size - 8 - header_len


@pytest.mark.parametrize("family_name", ["llama", "phi", "gemma2", "qwen2"])
def test_sliced_parameters_match_a_hand_count_with_the_transitions(family_name: str) -> None:
    dense, pruned, widths = _pruned(family_name)
    size = model_size(pruned)
    transitions = _transition_count(widths, family_for(family_name).parallel)
    assert transitions > 0
    assert size["transition_params"] == transitions
    assert size["params"] == _expected_parameters(dense.config, widths)  # includes the transitions
    assert model_size(dense)["transition_params"] == 0


@pytest.mark.parametrize("family_name", ["llama", "qwen2"])
def test_weight_bytes_are_what_the_checkpoint_stores(family_name: str, tmp_path: Path) -> None:
    """Checked against the safetensors file, which stores tied weights once and no non-persistent buffers."""
    dense, pruned, _ = _pruned(family_name)
    for name, model in (("dense", dense), ("pruned", pruned)):
        model.save_pretrained(tmp_path / name)
        assert model_size(model)["weight_bytes"] == _safetensors_data_bytes(tmp_path / name)


def test_weight_bytes_halve_from_float32_to_bfloat16(llama) -> None:
    _, pruned, _ = llama
    full = model_size(pruned)
    assert full["weight_bytes"] == 4 * full["params"]  # a Llama has no persistent buffers
    half = model_size(copy_model(pruned).to(torch.bfloat16))
    assert half["params"] == full["params"]
    assert 2 * half["weight_bytes"] == full["weight_bytes"]


def test_tied_embeddings_are_counted_once() -> None:
    model = tiny_model("qwen2")  # tie_word_embeddings=True
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert head.weight is embedding.weight
    every = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    size = model_size(model)
    assert size["params"] == every - embedding.weight.numel()
    # Tied as distinct Parameter objects over one storage: still once.
    head.weight = nn.Parameter(embedding.weight.detach(), requires_grad=False)
    assert head.weight is not embedding.weight
    assert model_size(model) == size


@pytest.mark.parametrize("which", ["dense", "pruned"])
def test_throughput_gives_positive_finite_rates_per_batch_size(
    llama, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("compressor.evaluation.throughput.load_average", lambda: 3.5)
    dense, pruned, _ = llama
    model = dense if which == "dense" else pruned
    result = measure_throughput(model, "cpu", ThroughputOptions(**FAST))
    assert {key: result[key] for key in ("device", "dtype", "prompt_len", "decode_tokens", "warmup", "repeats")} == {
        "device": "cpu",
        "dtype": "float32",
        "prompt_len": 8,
        "decode_tokens": 4,
        "warmup": 1,
        "repeats": 2,
    }
    assert set(result["batch"]) == {"1", "3"}
    assert result["cpus"] == os.cpu_count() and result["load_average"] == 3.5  # the load while timing
    for numbers in result["batch"].values():
        assert set(numbers) == {
            f"{phase}_{key}"
            for phase in ("prefill", "decode")
            for key in ("tok_s", "s", "runs_s", "tok_s_min", "tok_s_max", "spread")
        }
        assert len(numbers["prefill_runs_s"]) == len(numbers["decode_runs_s"]) == 2
        rates = [numbers[key] for key in ("prefill_tok_s", "decode_tok_s", "prefill_s", "decode_s")]
        assert all(math.isfinite(value) and value > 0 for value in rates)
        for phase in ("prefill", "decode"):  # the slowest and the fastest repeat
            runs, tokens = numbers[f"{phase}_runs_s"], numbers[f"{phase}_tok_s"] * numbers[f"{phase}_s"]
            assert numbers[f"{phase}_tok_s_min"] == pytest.approx(tokens / max(runs))
            assert numbers[f"{phase}_tok_s_max"] == pytest.approx(tokens / min(runs))
            assert numbers[f"{phase}_tok_s_min"] <= numbers[f"{phase}_tok_s"] <= numbers[f"{phase}_tok_s_max"]
            assert numbers[f"{phase}_spread"] == pytest.approx((max(runs) - min(runs)) / numbers[f"{phase}_s"])


def test_measuring_runs_in_eval_mode_and_restores_the_mode(llama) -> None:
    """Dropout must not be timed; the caller's model is left as it was."""
    _, pruned, _ = llama
    seen = []
    handle = pruned.register_forward_pre_hook(lambda module, _: seen.append(module.training))
    try:
        pruned.train()
        measure_throughput(pruned, "cpu", ThroughputOptions(**{**FAST, "batch_sizes": (1,), "repeats": 1}))
        assert seen and not any(seen)
        assert pruned.training
    finally:
        handle.remove()
        pruned.eval()


@pytest.mark.parametrize("family_name", sorted(FAMILY_CONFIGS))
def test_cached_decode_gives_the_logits_of_a_full_forward(family_name: str) -> None:
    """The timed path (prefill, then one token at a time through the KV cache) is real decoding
    for the sliced model: its logits equal those of one forward over the whole sequence."""
    _, pruned, _ = _pruned(family_name)
    ids = random_batches(pruned.config.vocab_size, count=1, batch=2, length=14)[0].input_ids
    with torch.inference_mode():
        full = pruned(input_ids=ids, use_cache=False).logits
        last, cache = prefill(pruned, ids[:, :9])
        steps = decode(pruned, cache, ids[:, 9:])
    scale = full.abs().max()
    assert steps.shape == (2, 5, pruned.config.vocab_size)
    torch.testing.assert_close(last / scale, full[:, 8] / scale, rtol=0, atol=1e-5)
    torch.testing.assert_close(steps / scale, full[:, 9:] / scale, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 14


def test_comparison_reports_ratios_and_speedups(llama) -> None:
    dense, pruned, _ = llama
    result = compare_speed(dense, pruned, "cpu", **FAST)
    assert result["baseline"]["params"] == model_size(dense)["params"]
    assert result["pruned"]["transition_params"] > 0
    assert 0 < result["ratio"]["params"] < 1
    assert result["ratio"]["weight_bytes"] == pytest.approx(result["ratio"]["params"])
    assert set(result["speedup"]) == set(result["speedup_range"]) == {"1", "3"}
    for batch, phases in result["speedup"].items():
        assert set(phases) == {"prefill", "decode"}
        assert all(math.isfinite(value) and value > 0 for value in phases.values())
        for phase, speedup in phases.items():  # the repeats' span holds the median's ratio
            low, high = result["speedup_range"][batch][phase]
            assert low <= speedup <= high


def test_a_run_longer_than_the_model_allows_is_refused(llama) -> None:
    dense, _, _ = llama  # max_position_embeddings=128
    with pytest.raises(ValueError, match="exceeds the model's 128 positions"):
        measure_throughput(dense, "cpu", ThroughputOptions(prompt_len=120, decode_tokens=16, batch_sizes=(1,)))


def test_a_run_reports_size_and_speed_of_both_models(tiny_checkpoint, tmp_path) -> None:
    import json

    from compressor.cli import main
    from tests.run.test_cli import write_recipe

    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation__throughput=True)
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    size, speed = report["size"], report["speed"]
    assert size["baseline"]["params"] == report["params"]["baseline"]
    assert size["pruned"]["params"] == report["params"]["pruned"]
    assert size["baseline"]["transition_params"] == 0 < size["pruned"]["transition_params"]
    assert set(speed["speedup"]) == {"1", "8"}
    for side in ("baseline", "pruned"):
        assert speed[side]["throughput"]["prompt_len"] + speed[side]["throughput"]["decode_tokens"] <= 128
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "| weights (MB) |" in markdown and "| decode tokens/s, batch 8 |" in markdown


def test_a_time_budget_bounds_the_timed_rounds(llama) -> None:
    """A budget smaller than one round still times one round; without one, every repeat runs."""
    _, pruned, _ = llama
    bounded = measure_throughput(pruned, "cpu", ThroughputOptions(**{**FAST, "repeats": 4, "budget_s": 1e-9}))
    unbounded = measure_throughput(pruned, "cpu", ThroughputOptions(**{**FAST, "repeats": 4}))
    assert bounded["budget_s"] == 1e-9 and unbounded["budget_s"] is None
    assert {len(numbers["decode_runs_s"]) for numbers in bounded["batch"].values()} == {1}
    assert {len(numbers["decode_runs_s"]) for numbers in unbounded["batch"].values()} == {4}
