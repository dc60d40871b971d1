"""Sensitivity strategies through recipes: reports, chat calibration, and no cost for PCA runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import compressor.engine.sensitivity
from compressor.cli import main
from tests.data.test_chat import CONVERSATION
from tests.run.test_cli import write_recipe


def test_sensitivity_then_stiefel_reports_every_site(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = write_recipe(
        tmp_path,
        tiny_checkpoint,
        evaluation=None,
        sensitivity={"autocast": "bfloat16"},
        pipeline=[{"strategy": "sensitivity", "taus": [1, 10]}, {"strategy": "stiefel", "steps": 20, "lr": 0.01}],
    )
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["fisher_source"] == "computed" and report["fisher_autocast"] == "bfloat16"
    for site in report["sites"]:
        assert site["strategy"] == "sensitivity+stiefel"
        sens, stiefel = site["steps"][0]["objectives"], site["steps"][1]["objectives"]
        assert [c["tau"] for c in sens["candidates"]] == [1.0, 10.0]
        assert sens["tau"] in (1.0, 10.0) and sens["loss"] <= sens["loss_pca"] * (1 + 1e-9)
        assert stiefel["loss_before"] == pytest.approx(sens["loss"])
        assert stiefel["loss_after"] <= stiefel["loss_before"]


def test_chat_calibration_runs(tiny_checkpoint: Path, tmp_path: Path) -> None:
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(6)) + "\n")
    recipe = write_recipe(
        tmp_path,
        tiny_checkpoint,
        evaluation=None,
        calibration={
            "dataset": {"path": "json", "data_files": str(data)},
            "format": "chat",
            "num_samples": 6,
            "seq_len": 32,
            "batch_size": 4,
        },
        pipeline=[{"strategy": "sensitivity"}],
    )
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert all(site["steps"][0]["objectives"]["loss"] >= 0 for site in report["sites"])


def test_pca_runs_never_estimate_h(tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("H was estimated for a pipeline that does not need it")

    monkeypatch.setattr(compressor.engine.sensitivity, "estimate_fisher", forbidden)
    assert main(["run", str(write_recipe(tmp_path, tiny_checkpoint, evaluation=None))]) == 0
    assert json.loads((tmp_path / "out" / "report.json").read_text())["fisher_autocast"] is None


def test_bad_sensitivity_settings_exit_2(tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for changes, message in [
        (dict(sensitivity={"dtype": "float16"}), "sensitivity.dtype must be one of float32, float64"),
        (dict(sensitivity={"reduction": "max"}), "sensitivity.reduction must be one of sum, mean"),
        (dict(sensitivity={"autocast": "int8"}), "sensitivity.autocast must be null or one of auto, bfloat16, float16"),
        (dict(calibration__format="dialogue"), "calibration.format must be one of text, chat"),
        (dict(pipeline=[{"strategy": "stiefel", "lr": -1}]), "pipeline.0: strategy 'stiefel': lr must be above 0"),
    ]:
        assert main(["run", str(write_recipe(tmp_path, tiny_checkpoint, **changes))]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
