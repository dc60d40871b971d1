"""`--dry-run` checks what a run checks before loading weights, and says what it did not check."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from compressor.cli import main
from compressor.engine.checkpoint import FINGERPRINT_FILE, FISHER_FILE
from compressor.runtime.staging import CHECKPOINT_FOLDER, staging_folder
from tests.conftest import save_tiny_checkpoint
from tests.evaluation.test_lm_eval import _write_task
from tests.run.test_cli import write_recipe
from tests.run.test_hub import no_network  # noqa: F401  (a fixture)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_recipe_for_cuda_is_refused_here_after_everything_else_is_checked(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, device="cuda")
    assert main(["run", str(recipe), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert "no CUDA GPU is available" in err and err.count("\n") == 1
    assert out.startswith("recipe checked, but the run would stop here") and "checked: model config" in out
    recipe = write_recipe(tmp_path, tiny_checkpoint, device="cuda", sparsity=0.99)  # a real problem comes first
    assert main(["run", str(recipe), "--dry-run"]) == 2
    assert "leaves no width" in capsys.readouterr().err


def _interrupted_with_another_recipe(output: Path) -> None:
    """What a killed run leaves: a checkpoint with progress (H) and its fingerprint."""
    checkpoint = staging_folder(output) / CHECKPOINT_FOLDER
    checkpoint.mkdir(parents=True)
    (checkpoint / FINGERPRINT_FILE).write_text(json.dumps({"recipe": "another", "model": "m", "data": "d"}))
    (checkpoint / FISHER_FILE).write_bytes(b"progress")


def test_an_interrupted_run_with_another_recipe_is_refused_before_any_weights_load(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    model = save_tiny_checkpoint(tmp_path / "m")
    (model / "model.safetensors").write_bytes(b"not a checkpoint")  # loading it would fail otherwise
    recipe = write_recipe(tmp_path, model)
    _interrupted_with_another_recipe(tmp_path / "out")
    for dry_run in (["--dry-run"], []):
        assert main(["run", str(recipe), *dry_run]) == 2
        err = capsys.readouterr().err
        assert "was started with a different recipe; rerun with --restart" in err and err.count("\n") == 1
        assert (staging_folder(tmp_path / "out") / CHECKPOINT_FOLDER / FISHER_FILE).is_file()  # progress kept
    assert main(["run", str(recipe), "--dry-run", "--restart"]) == 0


def test_the_dry_run_names_the_lm_eval_tasks_and_what_it_did_not_check(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _write_task(tmp_path / "tasks")
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation__lm_eval={"tasks": ["tasks/tiny_choice.yaml"]})
    assert main(["run", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"checked: lm-eval task names: {tmp_path / 'tasks' / 'tiny_choice.yaml'}" in out
    assert "not checked: the lm-eval tasks' own data" in out
    assert "not checked: the weights" in out and "checked: calibration data: 4 windows of 64 tokens" in out


def test_a_hub_dataset_out_of_reach_is_not_checked_rather_than_refused(
    tiny_checkpoint: Path,
    tmp_path: Path,
    no_network: None,  # noqa: F811
    capsys: pytest.CaptureFixture,
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, calibration__dataset={"path": "someone/some-dataset"})
    started = time.perf_counter()
    assert main(["run", str(recipe), "--dry-run"]) == 0
    assert time.perf_counter() - started < 30
    out = capsys.readouterr().out
    assert "not checked: calibration data (hub dataset 'someone/some-dataset'; huggingface.co cannot be reached" in out
    assert "checked: evaluation data: 4 windows" in out


def test_a_very_large_cut_warns_in_the_dry_run_the_run_and_its_report(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, sparsity=0.75, evaluation=None)
    assert main(["run", str(recipe), "--dry-run"]) == 0
    assert "warning: sparsity 0.75 keeps 16 of 64 dimensions" in capsys.readouterr().out
    assert main(["run", str(recipe)]) == 0
    assert "warning: sparsity 0.75 keeps 16 of 64 dimensions" in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert len(report["warnings"]) == 1 and "expect a large loss" in report["warnings"][0]
    recipe = write_recipe(tmp_path, tiny_checkpoint, sparsity=0.25, evaluation=None)
    assert main(["run", str(recipe), "--dry-run", "--overwrite"]) == 0
    assert "warning" not in capsys.readouterr().out


def test_the_dry_run_refuses_what_the_run_refuses_at_the_output(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A previous run without --overwrite, or a user's file in it with --overwrite: the run stops
    at once, so the dry run does not say OK (it lists what it checked first)."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    assert main(["run", str(recipe)]) == 0
    capsys.readouterr()
    assert main(["run", str(recipe), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert "already holds a run; pass --overwrite" in err and "checked: model config" in out
    assert main(["run", str(recipe), "--dry-run", "--overwrite"]) == 0
    (tmp_path / "out" / "model" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["run", str(recipe), "--dry-run", "--overwrite"]) == 2
    assert "holds files the previous run did not write (model/notes.txt)" in capsys.readouterr().err
