"""`evaluation.device_map`: lm-eval on each model placed by accelerate (here everything goes to disk,
the one placement a CPU machine can check) scores what the whole models score, perplexity and KL run
layer by layer, and nothing of the placement stays in the output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from compressor.cli import main
from tests.evaluation.test_lm_eval import RECORDS, _write_task
from tests.run.test_cli import write_recipe


def _run(tmp_path: Path, checkpoint: Path, name: str, **changes) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    _write_task(folder / "tasks")
    output = folder / "out"
    suite = {"tasks": ["tasks/tiny_choice.yaml"], "batch_size": 4}
    path = write_recipe(folder, checkpoint, output=str(output), evaluation__lm_eval=suite, **changes)
    assert main(["run", str(path)]) == 0
    return output


def _weight_bytes(folder: Path) -> int:
    total = 0
    for shard in folder.glob("*.safetensors"):
        with safe_open(shard, "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open has no __iter__)
                piece = tensors.get_slice(name)
                count = 1
                for extent in piece.get_shape():
                    count *= extent
                total += count * 4  # float32 runs
    return total


@pytest.mark.parametrize("load", ["memory", "stream"])
def test_tasks_on_placed_models_score_as_on_whole_models(tiny_checkpoint: Path, tmp_path: Path, load: str) -> None:
    whole = _run(tmp_path, tiny_checkpoint, "whole")
    placed = _run(
        tmp_path,
        tiny_checkpoint,
        f"placed-{load}",
        model__load=load,
        evaluation__device_map="auto",
        # nothing fits the host: every weight offloaded to disk (a GPU's share is dropped on a CPU run)
        evaluation__max_memory={0: "1GiB", "cpu": "1KiB"},
    )
    reports = [json.loads((run / "report.json").read_text())["metrics"] for run in (whole, placed)]
    for side in ("baseline", "pruned"):
        assert reports[1][side]["tasks"] == reports[0][side]["tasks"]
        assert reports[1][side]["tasks"]["tiny_choice"]["samples"] == len(RECORDS)
        assert {key: value for key, value in reports[1][side].items() if key not in ("tasks", "placement")} == {
            key: value for key, value in reports[0][side].items() if key != "tasks"
        }  # perplexity and KL, layer by layer, equal the whole models' figures
        assert "placement" not in reports[0][side]
    assert reports[1]["baseline"]["placement"] == {"disk": _weight_bytes(tiny_checkpoint)}
    assert reports[1]["pruned"]["placement"] == {"disk": _weight_bytes(placed / "model")}
    loading = json.loads((placed / "report.json").read_text())["loading"]
    assert loading["written_as_it_goes"] is (load == "stream")  # lm-eval reads the written folder
    assert not (placed / "offload").exists()
    assert "| tiny_choice acc (n=6) |" in (placed / "report.md").read_text()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"evaluation__max_memory": {"cpu": "1GiB"}}, "evaluation.max_memory applies to models placed by accelerate"),
        ({"evaluation__device_map": "auto", "evaluation__throughput": True}, "set evaluation.throughput: false"),
        (
            {"evaluation__device_map": "auto", "evaluation__max_memory": {"gpu0": "1GiB"}},
            "'gpu0' is not a device",
        ),
        (
            {"evaluation__device_map": "auto", "evaluation__max_memory": {"0": "lots"}},
            "evaluation.max_memory.0: 'lots' is not a size",
        ),
        ({"evaluation__device_map": "everywhere"}, "evaluation.device_map"),
        (
            {"evaluation__device_map": "auto", "evaluation__max_memory": {"cpu": "70gb"}},
            "'70gb' would be read as bits",
        ),
    ],
)
def test_bad_placement_is_one_line(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture, changes: dict, message: str
) -> None:
    path = write_recipe(tmp_path, tiny_checkpoint, **changes)
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()
