"""One budget over a Mixture-of-Experts model's axes (issue 48, item 5): `experts` (and `mlp`)
without `kept` measure every expert count with each split of the budget and keep the best, saving
what a run with that choice fixed saves; `target_active_params` limits the parameters a token
uses, reported beside the total and counted on the reloaded model; a kill while choosing resumes
to the same model; bad settings are one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.cli import main
from compressor.evaluation.metrics import parameter_count
from tests.conftest import save_tiny_checkpoint
from tests.models.test_active_params import _used
from tests.run.test_cli import _DELETE, write_recipe
from tests.run.test_mlp_split import _model, _report, _same, _untimed
from tests.run.test_resume import compress

CHOOSE: dict[str, Any] = {"heldout_windows": 2}
COMMON: dict[str, Any] = dict(
    sparsity=_DELETE, target_params=0.8, slicing={"layout": "global"}, pipeline=[{"strategy": "sensitivity"}]
)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE with both layers sparse, so the experts are a large share of the budget."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", mlp_only_layers=[])


def _active(model: torch.nn.Module) -> int:
    """Parameters a token uses, counted on the reloaded model (`test_active_params._used`)."""
    return _used(model, model.config.num_experts, model.config.num_experts_per_tok)


def test_the_run_measures_every_expert_count_and_split_and_saves_what_a_fixed_run_saves(
    moe: Path, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    recipe = write_recipe(
        tmp_path / "a",
        moe,
        output=str(tmp_path / "chosen"),
        experts=CHOOSE,
        mlp={**CHOOSE, "candidates": 2},
        **COMMON,
    )
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "chosen")
    split = report["mlp"]["split"]
    candidates = split["candidates"]
    assert {c["experts"] for c in candidates} == {None, 3, 2}  # every expert (4), then min_kept 0.5 of them
    assert candidates[0]["experts"] is None and candidates[0]["mlp_kept"] == report["mlp"]["of"]
    kls = [c["heldout_kl"] for c in candidates]
    assert split["chosen"] == kls.index(min(kls))
    chosen = candidates[split["chosen"]]
    assert report["experts"]["kept"] == (chosen["experts"] or 4) and report["kept_width"] == chosen["width"]
    for candidate in candidates:
        assert candidate["params"] <= report["allocation"]["budget"]
    markdown = (tmp_path / "chosen" / "report.md").read_text()
    experts = f", {chosen['experts']} experts" if chosen["experts"] else ""
    assert f"split: width {chosen['width']}, MLP {chosen['mlp_kept']}{experts} (chosen)" in markdown
    assert (tmp_path / "chosen" / "split.png").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "chosen" / "model")
    assert model.config.num_experts == (chosen["experts"] or 4)
    assert parameter_count(model) == report["params"]["pruned"] == chosen["params"]
    assert _active(model) == report["active_params"]["pruned"] == chosen["active_params"]
    # the run with the chosen count, width and split fixed saves the same model, tensor for tensor
    fixed = write_recipe(
        tmp_path / "b",
        moe,
        output=str(tmp_path / "fixed"),
        experts={"kept": chosen["experts"]} if chosen["experts"] else None,
        mlp={"kept": chosen["mlp_kept"]} if chosen["mlp_kept"] < report["mlp"]["of"] else None,
        **COMMON,
    )
    assert main(["run", str(fixed)]) == 0
    assert _report(tmp_path / "fixed")["kept_width"] == chosen["width"]
    assert _same(_model(tmp_path / "chosen"), _model(tmp_path / "fixed"))


def test_an_active_target_limits_the_parameters_a_token_uses_in_the_saved_model(moe: Path, tmp_path: Path) -> None:
    recipe = write_recipe(
        tmp_path,
        moe,
        experts={"kept": 3},
        mlp={"kept": 0.5},
        **{k: v for k, v in COMMON.items() if k != "target_params"},
        target_active_params=0.6,
    )
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    original = AutoModelForCausalLM.from_pretrained(moe)
    active = report["active_params"]
    assert active["baseline"] == _active(original) and active["pruned"] == _active(model)
    assert active["pruned"] <= 0.6 * active["baseline"]
    assert report["target_active_params"] == 0.6 and report["target_params"] is None
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "target_active_params 0.6" in markdown.splitlines()[0]
    assert f"|   parameters per token (active) | {active['baseline']:,} | {active['pruned']:,} (" in markdown


@pytest.mark.parametrize("kill", ["split:1", "publish"])
def test_a_run_killed_while_choosing_the_expert_count_resumes_to_the_same_model(
    kill: str, moe: Path, tmp_path: Path
) -> None:
    """Killed before the choice is saved (measured again) or after it (the saved choice, checked
    against the plan's candidates, expert count included, and the chosen split walked again)."""
    recipe = write_recipe(tmp_path, moe, experts={**CHOOSE, "candidates": 2}, evaluation=None, **COMMON)
    whole = compress(recipe, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    killed = compress(recipe, tmp_path / "run", kill=kill)
    assert killed.returncode == -9, killed.stderr
    resumed = compress(recipe, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr
    assert ("split 1/2" in resumed.stderr + resumed.stdout) == (kill == "split:1")  # measured again only then
    assert _untimed(_report(tmp_path / "run")["experts"]["split"]) == _untimed(
        _report(tmp_path / "whole")["experts"]["split"]
    )
    assert _same(_model(tmp_path / "whole"), _model(tmp_path / "run"))


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("llama", {"target_active_params": 0.5}, "llama models route no token to some experts only"),
        ("qwen3_moe", {"target_active_params": 0.5, "sparsity": 0.2}, "not both; remove sparsity"),
        (
            "qwen3_moe",
            {"target_active_params": 0.5, "allocation": {"method": "curves"}, "slicing": {"layout": "per_site"}},
            "curves allocates widths under target_params alone",
        ),
        (
            "qwen3_moe",
            {"target_params": 0.8, "experts": {"kept": 3, "candidates": 4}},
            "experts.candidates applies when the run chooses",
        ),
        ("qwen3_moe", {"target_params": 0.8, "experts": {"candidates": 1}}, "experts.candidates"),
        (
            "qwen3_moe",
            {"target_params": 0.8, "experts": {}, "mlp": {"measure_best": 2}},
            "expert counts it cannot predict; set experts.kept, or remove mlp.measure_best",
        ),
        ("qwen3_moe", {"target_params": 0.8, "mlp": {"measure_best": 2}}, "this model's MLPs are routed experts"),
        ("olmoe", {"target_active_params": 0.5, "mlp": {}}, "where only target_params is counted yet"),
        (  # every candidate count would spend the same active budget: the choice measures nothing
            "qwen3_moe",
            {"target_active_params": 0.6, "experts": {}},
            "experts: with target_active_params alone the run has no expert count to choose",
        ),
    ],
)
def test_bad_budget_settings_are_one_line_and_write_nothing(
    family: str, changes: dict, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / family, family)
    settings = {**{k: v for k, v in COMMON.items() if k != "target_params"}, **changes}
    recipe = write_recipe(tmp_path, checkpoint, **settings)
    capsys.readouterr()
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_single_expert_count_to_measure_warns_and_chooses_nothing(moe: Path, tmp_path: Path, capsys) -> None:
    recipe = write_recipe(tmp_path, moe, experts={"min_kept": 1.0}, **COMMON)
    capsys.readouterr()
    assert main(["run", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "experts: the budget leaves one expert count to measure" in out and "split: the run measures" not in out
