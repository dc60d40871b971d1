"""`model.load: stream`: a run whose layer-by-layer passes read the layers from the safetensors
shards gives the model, bases and report metrics of the same run in memory, resumes a run killed
in memory, and refuses a folder it cannot stream in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.cli import main
from tests.conftest import save_tiny_checkpoint
from tests.run.test_cli import write_recipe
from tests.run.test_resume import compress, recipe, tensors, uninterrupted  # noqa: F401  (fixtures)


def _run(tmp_path: Path, checkpoint: Path, name: str, load: str, **changes) -> Path:
    folder = tmp_path / f"{name}-{load}"
    folder.mkdir()
    output = folder / "out"
    path = write_recipe(folder, checkpoint, output=str(output), model__load=load, **changes)
    assert main(["run", str(path)]) == 0
    return output


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        ("pca", {}),
        ("global-sensitivity", {"pipeline": [{"strategy": "sensitivity"}], "slicing": {"layout": "global"}}),
    ],
)
def test_a_streamed_run_is_bit_identical_to_the_run_in_memory(
    tiny_checkpoint: Path, tmp_path: Path, name: str, changes: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_memory = _run(tmp_path, tiny_checkpoint, name, "memory", **changes)
    loaded: list[str] = []
    whole = AutoModelForCausalLM.from_pretrained.__func__

    def recorded(cls, path, *args, **kwargs):
        loaded.append(str(path))
        return whole(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recorded))
    streamed = _run(tmp_path, tiny_checkpoint, name, "stream", **changes)
    assert str(tiny_checkpoint) not in loaded  # the original never whole in memory, evaluation included
    expected, actual = tensors(in_memory), tensors(streamed)
    assert actual.keys() == expected.keys()
    assert not [key for key, value in expected.items() if not torch.equal(actual[key], value)]
    reports = [json.loads((run / "report.json").read_text()) for run in (in_memory, streamed)]
    assert reports[0]["fingerprint"] == reports[1]["fingerprint"]
    assert reports[0]["sites"] == reports[1]["sites"]
    assert reports[0]["metrics"] == reports[1]["metrics"]  # evaluated layer by layer: the same operations
    # nothing after the walk changes the model: written as the walk goes (a global layout as the stock class)
    assert reports[1]["loading"] == {"load": "stream", "written_as_it_goes": True, "layers_written_before": 0}
    assert reports[0]["stock"] == reports[1]["stock"]
    assert reports[0]["loading"]["written_as_it_goes"] is False
    assert main(["eval", str(streamed)]) == 0  # `compress eval` of a streamed run loads whole models


def test_a_run_killed_in_memory_resumes_streamed_to_the_same_model(
    recipe: Path,  # noqa: F811
    uninterrupted: dict[str, torch.Tensor],  # noqa: F811
    tmp_path: Path,
) -> None:
    output = tmp_path / "run"
    assert compress(recipe, output, kill="site:layers.0.attn").returncode == -9
    resumed = compress(recipe, output, "--set", "model.load=stream")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((output / "report.json").read_text())["resume"]["sites_loaded"] == 2
    produced = tensors(output)
    assert not [name for name, value in uninterrupted.items() if not torch.equal(produced[name], value)]


def test_a_streamed_run_that_measures_throughput_keeps_its_layers_to_run_the_models_whole(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    output = _run(tmp_path, tiny_checkpoint, "throughput", "stream", evaluation__throughput=True)
    report = json.loads((output / "report.json").read_text())
    assert report["loading"]["written_as_it_goes"] is False and report["speed"] is not None


@pytest.mark.parametrize(
    ("kill", "committed"),
    [("writing:1", 1), pytest.param("written:0", 1, marks=pytest.mark.slow)],  # the default suite's time
)
def test_a_streamed_run_killed_while_writing_resumes_to_the_same_model(
    recipe: Path,  # noqa: F811
    uninterrupted: dict[str, torch.Tensor],  # noqa: F811
    tmp_path: Path,
    kill: str,
    committed: int,
) -> None:
    output = tmp_path / "run"
    killed = compress(recipe, output, "--set", "model.load=stream", kill=kill)
    assert killed.returncode == -9, killed.stderr
    resumed = compress(recipe, output, "--set", "model.load=stream")
    assert resumed.returncode == 0, resumed.stderr
    loading = json.loads((output / "report.json").read_text())["loading"]
    assert loading == {"load": "stream", "written_as_it_goes": True, "layers_written_before": committed}
    produced = tensors(output)  # the run in memory, uninterrupted: the same tensors
    assert not [name for name, value in uninterrupted.items() if not torch.equal(produced[name], value)]


def test_a_global_streamed_run_killed_while_writing_resumes_to_the_stock_model_of_the_run_in_memory(
    recipe: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A global layout's walk writes the original class as it goes (each layer with its stock norm
    weights, the embedding, final norm and head at the end): killed mid-write, it resumes to the
    files the run in memory saves through `stock.to_stock`."""
    in_memory, output = tmp_path / "memory", tmp_path / "run"
    done = compress(recipe, in_memory, "--set", "slicing.layout=global")
    assert done.returncode == 0, done.stderr
    streamed = ("--set", "model.load=stream", "--set", "slicing.layout=global")
    killed = compress(recipe, output, *streamed, kill="writing:1")
    assert killed.returncode == -9, killed.stderr
    resumed = compress(recipe, output, *streamed)
    assert resumed.returncode == 0, resumed.stderr
    reports = [json.loads((run / "report.json").read_text()) for run in (in_memory, output)]
    assert reports[1]["loading"] == {"load": "stream", "written_as_it_goes": True, "layers_written_before": 1}
    assert reports[0]["stock"] == reports[1]["stock"] and reports[1]["stock"]["head"] == "untied"
    expected, produced = tensors(in_memory), tensors(output)
    assert produced.keys() == expected.keys()
    assert not [name for name, value in expected.items() if not torch.equal(produced[name], value)]
    assert (output / "model" / "config.json").read_text() == (in_memory / "model" / "config.json").read_text()


def test_a_folder_without_safetensors_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = save_tiny_checkpoint(tmp_path / "model")
    weights = folder / "model.safetensors"
    from safetensors.torch import load_file

    torch.save(load_file(str(weights)), folder / "pytorch_model.bin")
    weights.unlink()
    path = write_recipe(tmp_path, folder, output=str(tmp_path / "out"), model__load="stream")
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "has no safetensors weights" in err and "model.load: memory" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
