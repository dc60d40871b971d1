"""The time plan (issue 50, item 4): `--dry-run` and `compress run` say about how long each phase
will take, from unit costs timed on one layer (`plan.timing`), and the run says what it took
against it. What is tested is what the estimate counts, with the unit costs fixed by hand so that
no clock decides: the work each phase scales with, the split choice's candidates as it measures
them, phases inside the choice not counted twice, and a stage that gives no estimate named."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from compressor.cli import main
from compressor.plan.checks import plan
from compressor.plan.timing import time_plan
from compressor.recipe.schema import load_recipe
from compressor.stages.contract import Stage
from compressor.stages.costs import UnitCosts
from compressor.strategies.registry import PluginRegistry
from tests.conftest import save_tiny_checkpoint
from tests.run.test_cli import _DELETE, write_recipe

COSTS = UnitCosts(
    layer_forward=1e-5,
    layer_backward=3e-5,
    layer_call=1e-3,
    head_forward=2e-5,
    head_backward=5e-5,
    basis=0.01,
    neurons=0.1,
    heads=0.0,
)
"""Unit costs given by hand: the estimate's arithmetic, not this machine's speed."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", intermediate_size=1024)


def _plan(folder: Path, checkpoint: Path, **changes: object) -> dict[str, float]:
    registry = PluginRegistry()
    recipe = load_recipe(write_recipe(folder, checkpoint, **changes), registry)
    phases = time_plan(recipe, plan(recipe, registry), torch.device("cpu"), COSTS).phases
    return {phase.name: phase.seconds for phase in phases}


SENSITIVITY = dict(pipeline=[{"strategy": "sensitivity"}], evaluation=None)
SPLIT = dict(
    sparsity=_DELETE,
    target_params=0.8,
    slicing={"layout": "global"},
    calibration__num_samples=8,
    mlp={"heldout_windows": 2, "candidates": 4, "measure_best": None},  # every split measured, unless a test asks
    **SENSITIVITY,
)


def test_the_walk_and_h_scale_with_the_calibration_tokens(checkpoint: Path, tmp_path: Path) -> None:
    """H is a forward and backward through every layer and the head per token; the walk a pass per
    layer per token and a basis per site: twice the windows, twice the passes, the same bases."""
    few = _plan(tmp_path, checkpoint, calibration__num_samples=4, **SENSITIVITY)
    many = _plan(tmp_path, checkpoint, calibration__num_samples=8, **SENSITIVITY)
    tokens, layers, sites = 4 * 64, 2, 5
    assert few["H pass"] == pytest.approx(tokens * (layers * 3e-5 + 5e-5))
    assert many["H pass"] == pytest.approx(2 * few["H pass"])
    bases = sites * COSTS.basis
    assert many["walk"] - bases == pytest.approx(2 * (few["walk"] - bases))
    assert "H pass" not in _plan(tmp_path, checkpoint, calibration__num_samples=4, evaluation=None)  # pca needs none


def test_the_split_counts_the_candidates_it_measures_and_the_run_s_walk_is_inside_it(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Every split measured: the choice holds the chosen trial's walk and MLP (no walk or MLP phase of
    its own, nor an H pass beside the choice's); measuring the 2 predicted best costs half the
    candidates and a prediction; screened trials cost their share of the windows, and then the run
    prunes the chosen split itself."""
    registry = PluginRegistry()
    count = len(plan(load_recipe(write_recipe(tmp_path, checkpoint, **SPLIT), registry), registry).splits)
    assert count >= 3
    every = _plan(tmp_path, checkpoint, **SPLIT)
    choice = f"choosing the split ({count} candidates)"
    assert set(every) == {"choosing the split: H pass", choice}
    best = _plan(tmp_path, checkpoint, **{**SPLIT, "mlp": {**SPLIT["mlp"], "measure_best": 2}})
    assert best[f"choosing the split (2 of {count} candidates)"] == pytest.approx(every[choice] * 2 / count)
    assert best["predicting the splits"] > 0
    screened = _plan(tmp_path, checkpoint, **{**SPLIT, "mlp": {**SPLIT["mlp"], "screen_windows": 2}})
    assert screened[choice] < every[choice]  # a quarter of the windows pruned (every held-out one measured)
    assert {"walk", "H pass", "MLP neurons"} <= set(screened)


class Silent(Stage):
    """A plugin's stage that gives no estimate."""

    name = "plugin polish"


def test_a_stage_without_an_estimate_is_named_as_not_estimated(checkpoint: Path, tmp_path: Path) -> None:
    registry = PluginRegistry()
    recipe = load_recipe(write_recipe(tmp_path, checkpoint, **SENSITIVITY), registry)
    checked = plan(recipe, registry)
    checked = dataclasses.replace(checked, stages=(*checked.stages, Silent()))
    planned = time_plan(recipe, checked, torch.device("cpu"), COSTS)
    assert planned.unestimated == ("plugin polish",)
    assert "not estimated: plugin polish" in planned.line()


def test_the_dry_run_says_the_estimate_and_the_run_says_what_it_took_against_it(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, checkpoint, **SENSITIVITY)
    assert main(["run", str(recipe), "--dry-run"]) == 0
    assert "note: time: about " in capsys.readouterr().out
    assert main(["run", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "time: about " in out and "took " in out and "; estimated " in out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    estimate = report["estimate"]
    assert {phase["key"] for phase in estimate["phases"]} == {"fisher_s", "prune_s"}
    assert estimate["total_s"] == pytest.approx(sum(phase["seconds"] for phase in estimate["phases"]))
    assert estimate["measured_s"] > 0


def test_a_strategy_that_refuses_a_synthetic_site_is_named_as_not_timed(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin's strategy may refuse made-up statistics: the plan goes on and says what it could not time."""
    from compressor_plugins.pca import PCA

    def refuse(*_: object) -> None:
        raise ValueError("needs real statistics")

    from compressor.plan import timing

    monkeypatch.setattr(PCA, "select", refuse)
    monkeypatch.setattr(timing, "_MEASURED", {})  # measured afresh, not remembered from another test
    registry = PluginRegistry()
    recipe = load_recipe(write_recipe(tmp_path, checkpoint, evaluation=None), registry)
    planned = time_plan(recipe, plan(recipe, registry), torch.device("cpu"))
    assert "the pipeline's strategies" in planned.unestimated
    assert "not estimated: the pipeline's strategies" in planned.line()


def test_the_unit_costs_are_measured_once_per_shape_and_settings(checkpoint: Path, tmp_path: Path) -> None:
    """A sweep's runs (or a suite's) of one shape measure once; another pipeline measures again."""
    from compressor.plan import timing

    registry = PluginRegistry()
    recipe = load_recipe(write_recipe(tmp_path, checkpoint, evaluation=None), registry)
    checked = plan(recipe, registry)
    first = timing.measure_costs(recipe, checked, torch.device("cpu"))
    assert timing.measure_costs(recipe, checked, torch.device("cpu")) is first
    other = load_recipe(write_recipe(tmp_path, checkpoint, **SENSITIVITY), registry)
    assert timing.measure_costs(other, plan(other, registry), torch.device("cpu")) is not first


def test_a_strategy_s_long_work_is_extrapolated_from_its_progress_not_waited_for(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sensitivity.refine: 1000000` (a million more eigendecompositions per site) is watched for
    `STRATEGY_SECONDS` and its time extrapolated from the share it reported done."""
    from compressor.plan import timing

    monkeypatch.setattr(timing, "STRATEGY_SECONDS", 0.2)
    registry = PluginRegistry()
    walks = []
    for refine in (0, 10**6):
        pipeline = [{"strategy": "sensitivity", "refine": refine}]
        recipe = load_recipe(write_recipe(tmp_path, checkpoint, pipeline=pipeline, evaluation=None), registry)
        costs, _ = timing.measure_costs(recipe, plan(recipe, registry), torch.device("cpu"))
        walks.append(costs.basis)
    assert walks[1] > 1000 * walks[0]  # a million refinements, extrapolated: far beyond the plain τ grid


def test_a_layer_too_large_to_build_is_costed_by_its_multiply_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer of more than `LAYER_LIMIT` bytes (a million MLP neurons here) is not built: its cost is
    its parameters' multiply-adds at the rate a matmul runs here."""
    from transformers import LlamaConfig

    from compressor.models.families import family_for
    from compressor.plan import timing

    def refuse(*_: object) -> None:
        raise AssertionError("the layer was built")

    monkeypatch.setattr(timing, "_one_layer_model", refuse)
    monkeypatch.setattr(timing, "matmul_rate", lambda dtype, device: 1e9)
    config = LlamaConfig(hidden_size=64, intermediate_size=10**6, num_attention_heads=4, num_hidden_layers=2)
    forward, backward, call = timing.layer_costs(
        config, family_for("llama"), torch.float32, "sdpa", torch.device("cpu"), 32
    )
    params = 3 * 64 * 10**6 + 4 * 64 * 64 + 2 * 64  # the MLP's three matrices, attention, two norms
    assert forward == pytest.approx(2 * params / 1e9, rel=1e-6) and backward == 3 * forward and call == forward


def test_merging_kv_heads_adds_a_merged_attention_per_count_to_the_heterogeneous_mlp_stage(
    checkpoint: Path, tmp_path: Path
) -> None:
    """The tiny Llama's 2 KV heads may merge into 1: one more layer forward per token and layer."""
    heterogeneous = dict(
        sparsity=_DELETE,
        target_params=0.8,
        budget="non_embedding",
        slicing={"layout": "heterogeneous"},
        evaluation=None,
    )
    whole = _plan(tmp_path, checkpoint, mlp={}, **heterogeneous)
    merging = _plan(tmp_path, checkpoint, mlp={"merge_kv_heads": True}, **heterogeneous)
    tokens, layers = 4 * 64, 2  # write_recipe's calibration
    assert merging["MLP neurons"] - whole["MLP neurons"] == pytest.approx(tokens * layers * 1 * COSTS.layer_forward)


def test_mlp_reconstruct_counts_each_step_as_the_pruned_mlp_s_share_of_the_timed_layer(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A step is a forward and backward of the pruned MLP on `batch_tokens` tokens (and every
    `CHECK_EVERY` steps a forward of the held-out tokens), costed at the unit costs' layer, the
    original's, by parameters: the kept MLP (kept stream × kept neurons) over the whole MLP and the
    attention (the timed layer's; not the pruned MLP and the attention, which counted it twice over)."""
    stock = dict(slicing={"layout": "global"}, sparsity=0.5, **SENSITIVITY)
    rebuild = {"steps": 100, "batch_tokens": 512, "lr": 0.01, "heldout": 0.25}
    tokens, layers, d, neurons, attention = 4 * 64, 2, 64, 1024, 2 * 64 * 16 * (4 + 2)  # 4 query, 2 KV heads of 16
    config = json.loads((checkpoint / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]) == (d, neurons, 2)
    for kept in (256, 512):
        registry = PluginRegistry()
        layout = plan(load_recipe(write_recipe(tmp_path, checkpoint, mlp={"kept": kept}, **stock), registry), registry)
        kept_stream = layout.layout.kept  # what the budget leaves the residual stream
        assert kept_stream is not None and kept_stream < d
        plain = _plan(tmp_path, checkpoint, mlp={"kept": kept}, **stock)["MLP neurons"]
        trained = _plan(tmp_path, checkpoint, mlp={"kept": kept, "reconstruct": rebuild}, **stock)["MLP neurons"]
        share = 3 * kept_stream * kept / (3 * d * neurons + attention)
        steps = 100 * 512 * (COSTS.layer_forward + COSTS.layer_backward)
        checks = (100 // 25 + 2) * tokens * 0.25 * COSTS.layer_forward
        assert trained - plain == pytest.approx(layers * share * (steps + checks))
