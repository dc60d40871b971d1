"""A stage from a plugin (issue 47, item 5): installed as a third party's package, it runs after the
walk and changes the model, and the recipe's schema, the held-out guard, the memory plan,
`--dry-run`, resume and the report all see it, with no line of core code naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from compressor.cli import main
from tests.conftest import install_plugin
from tests.run.test_cli import write_recipe

PLUGIN = '''
"""A test plugin's stage: after the walk, the pruned model with its head scaled."""
import copy
from typing import Annotated

import torch

from compressor.plugin import FORBID, Candidate, Number, Stage, described, hookimpl, options


@options(frozen=True, config=FORBID)
class ScaleNormOptions:
    scale: Annotated[Number, described("the head's factor", gt=0)] = 1.0
    heldout_windows: Annotated[int, described("held-out windows the guard measures on", ge=1)] = 2


class ScaleNorm(Stage):
    name = "scale_norm"
    timing = "scale_norm_s"
    section = "scale_norm"
    options = ScaleNormOptions
    after = "walk"
    changes_model = True
    guarded = True

    def heldout_windows(self, recipe, plan):
        return recipe.stages[self.section].heldout_windows

    def memory(self, footprint):
        return [footprint.phase("scale_norm (a copy of the pruned model)", footprint.walked + footprint.pruned_weights,
                                0, "remove scale_norm")]

    def run(self, state):
        spec = state.recipe.stages[self.section]
        state.progress("scaling the head", 0, 1)
        model = copy.deepcopy(state.pruned)
        with torch.no_grad():
            model.get_submodule(state.family.head).weight.mul_(spec.scale)
        state.extra[self.name] = {"scale": spec.scale}
        return Candidate(model, state.bases, state.head_scale, state.head_scale)


@hookimpl
def compressor_stages():
    return [ScaleNorm()]
'''


@pytest.fixture
def stage_plugin(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The plugin as an installed package: a module and its entry point in a folder on sys.path."""
    return install_plugin(
        monkeypatch, tmp_path_factory.mktemp("site"), "scale_norm_stage", textwrap.dedent(PLUGIN), "scale_norm"
    )


def _report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


def test_a_plugin_stage_runs_after_the_walk_and_the_guard_judges_it(
    stage_plugin: Path, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # the recipe's schema has its section; a wrong key in it is one line naming the key
    assert main(["schema"]) == 0
    assert "scale_norm" in json.loads(capsys.readouterr().out)["properties"]
    bad = write_recipe(tmp_path, tiny_checkpoint, scale_norm={"scael": 2.0})
    assert main(["run", str(bad), "--dry-run"]) == 2
    assert "scale_norm.scael" in capsys.readouterr().err
    # a recipe without its section neither runs it nor plans its memory
    (tmp_path / "without").mkdir()
    assert main(["run", str(write_recipe(tmp_path / "without", tiny_checkpoint)), "--dry-run"]) == 0
    assert "scale_norm" not in capsys.readouterr().out
    # the dry run's memory plan has its phase
    kept = write_recipe(tmp_path, tiny_checkpoint, output=str(tmp_path / "kept"), scale_norm={"scale": 1.0})
    assert main(["run", str(kept), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "scale_norm (a copy of the pruned model)" in out and "scale_norm held-out data: 2 windows" in out
    # a stage that changes nothing is kept by the guard, and the report records it
    assert main(["run", str(kept)]) == 0
    report = _report(tmp_path / "kept")
    assert [(g["step"], g["kept"]) for g in report["guards"]] == [("scale_norm", True)]
    assert report["stages"] == {"scale_norm": {"scale": 1.0}} and "scale_norm_s" in report["timings"]
    assert "scale_norm time (s)" in (tmp_path / "kept" / "report.md").read_text()
    # one that makes the model worse is handed back: the saved model is the walk's
    (tmp_path / "worse").mkdir()
    worse = write_recipe(
        tmp_path / "worse", tiny_checkpoint, output=str(tmp_path / "worse-out"), scale_norm={"scale": 4.0}
    )
    assert main(["run", str(worse)]) == 0
    guard = _report(tmp_path / "worse-out")["guards"][0]
    assert guard["step"] == "scale_norm" and not guard["kept"] and guard["kl_after"] > guard["kl_before"]
    said = capsys.readouterr()
    assert "the model from before scale_norm is kept" in said.out + said.err
    a, b = (load_file(str(tmp_path / name / "model" / "model.safetensors")) for name in ("kept", "worse-out"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the recipe as run names the section, and runs again as it was saved
    assert "scale_norm" in (tmp_path / "worse-out" / "recipe.yaml").read_text()


def test_a_run_killed_after_a_plugin_stage_resumes_its_walk_and_runs_the_stage_again(
    stage_plugin: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, output=str(tmp_path / "out"), scale_norm={"scale": 4.0})
    command = [sys.executable, "-c", "import sys; from compressor.cli import main; sys.exit(main(sys.argv[1:]))"]
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(stage_plugin), *sys.path]),
        "COMPRESS_KILL_AT": "stage:scale_norm",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    killed = subprocess.run([*command, "run", str(recipe)], env=environment, capture_output=True, text=True)
    assert killed.returncode == -9 and (tmp_path / ".out.partial" / "checkpoint").is_dir()
    del environment["COMPRESS_KILL_AT"]
    resumed = subprocess.run([*command, "run", str(recipe)], env=environment, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    report = _report(tmp_path / "out")
    assert report["resume"]["sites_loaded"] and report["guards"][0]["step"] == "scale_norm"


def test_a_plugin_stage_under_torchrun_is_refused_in_one_line(
    stage_plugin: Path, tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The ranks above 0 follow the built-in stages only: a plugin's would run on rank 0 alone."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, scale_norm={"scale": 1.0})
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["run", str(recipe), "--dry-run"]) == 2
    assert "plugin stage 'scale_norm' runs in one process" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_misspelt_plugin_section_is_told_its_name(
    stage_plugin: Path, tiny_checkpoint: Path, tmp_path: Path, capsys
) -> None:
    """The nearest-key suggestion knows the installed stages' sections as it knows the built-in ones."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, scale_nrom={"scale": 1.0})
    assert main(["run", str(recipe), "--dry-run"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: unknown key 'scale_nrom' (did you mean 'scale_norm'?)"), error
    assert error.endswith(", scale_norm")


def test_a_streamed_run_with_a_plugin_stage_that_changes_the_model_does_not_write_as_it_walks(
    stage_plugin: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """The walk writes model/ as it goes only when no stage after it changes the model: a plugin's
    stage counts (its change would otherwise be lost, `Save` finding the model already written)."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, model__load="stream", scale_norm={"scale": 1.0})
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    assert report["stages"] == {"scale_norm": {"scale": 1.0}}
    assert report["loading"]["load"] == "stream" and report["loading"]["written_as_it_goes"] is False
