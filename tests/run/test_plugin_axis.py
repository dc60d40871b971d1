"""A toy axis written as a plugin (issue 80, "one place per axis"; `docs/adding-an-axis.md`'s
example): it removes a fixed share of every MLP's neurons, those whose down-projection column is
shortest, through its own stage, its own unit and selector, and its own `Axis`. Installed as a
third party's package, with no file of `compressor/` naming it, it is listed by `compress
families`, `compress strategies` and the dry run (its axis and its memory phase), timed in the time
plan, refused in one line for a selector not installed or a model its `Axis.allows` refuses, and
run: the report records it and the
exporter saves a model plain transformers loads at the narrower width.

Not covered, because the plan cannot yet do it for a plugin's axis: the budget search (the toy
axis takes a fixed share; the run's parameter budget is the walk's, before it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from compressor.cli import main
from compressor.errors import UserError
from compressor.models.axes import Axis
from compressor.strategies.registry import PluginRegistry, hookimpl
from tests.conftest import install_plugin, save_tiny_checkpoint
from tests.run.test_cli import write_recipe

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "adding-an-axis.md"
PLUGIN = GUIDE.read_text().split("```python\n")[1].split("```")[0]
"""The guide's worked example, as the guide shows it: the test runs the plugin a reader copies."""


@pytest.fixture
def toy_axis(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The plugin as an installed package: a module and its entry point in a folder on sys.path."""
    return install_plugin(monkeypatch, tmp_path_factory.mktemp("site"), "toy_axis", PLUGIN, "toy_axis")


def test_no_file_of_the_package_names_the_toy_axis() -> None:
    package = ROOT / "compressor"
    naming = [str(path) for path in package.rglob("*.py") if re.search(r"toy[-_](mlp|neuron|axis)", path.read_text())]
    assert not naming


def test_the_toy_axis_is_listed_where_every_axis_is(
    toy_axis: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["families"]) == 0
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.count("│") > 4}
    axes, stock = (cell.strip().split(", ") for cell in rows["llama"].split("│")[4:6])
    assert axes[-1] == "toy-mlp" and stock[-1] == "toy-mlp"  # after the built-in axes
    assert "toy-mlp" not in rows["mixtral"].split("│")[4]  # its own rule: no routed experts
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert "toy-neuron selectors" in out and "column-norm" in out


def test_the_dry_run_plans_the_toy_axis_and_refuses_a_selector_not_installed(
    toy_axis: Path, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, slicing={"layout": "global"}, toy_mlp={"share": 0.25})
    assert main(["run", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    axes = next(line for line in out.splitlines() if "axes:" in line)
    assert "MLP neurons by column norm (a plugin's)" in axes and "toy-mlp" in axes.split("allows")[1]
    assert "toy_mlp (the pruned model, narrowed in place)" in out  # its memory phase
    wrong = write_recipe(tmp_path, tiny_checkpoint, slicing={"layout": "global"}, toy_mlp={"selector": "colum-norm"})
    assert main(["run", str(wrong), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown toy-neuron selector 'colum-norm' (did you mean 'column-norm'?)" in err
    moe = save_tiny_checkpoint(tmp_path / "moe", "mixtral")  # routed experts: the axis's `allows` says no
    (tmp_path / "on-moe").mkdir()
    assert main(["run", str(write_recipe(tmp_path / "on-moe", moe, toy_mlp={"share": 0.25})), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: toy_mlp: the mixtral family (mixtral) does not allow the axis 'toy-mlp' (MLP neurons by column "
        "norm (a plugin's)); remove toy_mlp (`compress families` lists each model type's axes)"
    )


def test_a_run_prunes_the_toy_axis_reports_it_and_saves_a_model_transformers_loads(
    toy_axis: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, slicing={"layout": "global"}, toy_mlp={"share": 0.25})
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    width = AutoConfig.from_pretrained(tiny_checkpoint).intermediate_size
    assert report["stages"]["toy_mlp"] == {
        "width": width,
        "kept": width - round(0.25 * width),
        "selector": "column-norm",
    }
    assert "toy_mlp_s" in report["timings"]
    assert {"name": "toy_mlp", "seconds": 2e-3, "key": "toy_mlp_s"} in report["estimate"]["phases"]  # its time
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    assert saved.config.intermediate_size == width - round(0.25 * width)
    assert sum(p.numel() for p in saved.parameters()) == report["params"]["pruned"]
    with torch.no_grad():
        assert torch.isfinite(saved(torch.tensor([[1, 2, 3]])).logits).all()


def test_an_axis_key_declared_twice_is_refused_in_one_line() -> None:
    class Twice:
        @hookimpl
        def compressor_axes(self) -> list[Axis]:
            return [Axis("mlp", "another MLP width", "other", "other", lambda *_: True, lambda *_: True)]

    with pytest.raises(UserError) as refused:
        PluginRegistry(extra_plugins=[Twice()])
    assert re.fullmatch(
        r"axis 'mlp' is declared twice, by 'built-in' and plugin '.+'; rename the plugin's axis or uninstall one of them",
        str(refused.value),
    )
