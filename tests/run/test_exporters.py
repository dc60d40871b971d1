"""The exporter registry (issue 80, item 4): the plan chooses what a run saves its model as, `Save`
writes that format, and `compress export`'s side (`stages.formats`, stdlib only) tells the same format
from the saved config; a plugin stage may follow saving when it only reads what was saved."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from compressor.cli import main
from compressor.errors import UserError
from compressor.plan.checks import plan
from compressor.recipe.schema import load_recipe
from compressor.stages.contract import Stage
from compressor.stages.formats import FORMATS, saved_format
from compressor.stages.order import BUILTIN_STAGES, run_order
from compressor.strategies.registry import PluginRegistry
from tests.conftest import install_plugin, save_tiny_checkpoint
from tests.run.test_cli import _DELETE, write_recipe

LAYOUTS = {
    "per-site": {},
    "original": {"slicing": {"layout": "global"}},
    "decilm": {
        "slicing": {"layout": "heterogeneous"},
        "budget": "non_embedding",
        "target_params": 0.8,
        "sparsity": _DELETE,
        "mlp": {},
    },
}


@pytest.mark.parametrize("expected", list(LAYOUTS))
def test_the_saved_folder_is_in_the_format_the_plan_chose(expected: str, tmp_path: Path) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "model", "llama", intermediate_size=512, num_hidden_layers=3)
    recipe = write_recipe(tmp_path, checkpoint, **LAYOUTS[expected])
    registry = PluginRegistry()
    chosen = plan(load_recipe(recipe, registry), registry).exporter
    assert chosen is not None and chosen.format.name == expected
    assert main(["run", str(recipe)]) == 0
    config = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert saved_format(config) is chosen.format


def test_every_format_is_told_apart_by_its_config_alone() -> None:
    configs = {
        "per-site": {"model_type": "sliced_llama"},
        "decilm": {"model_type": "nemotron-nas", "block_configs": []},
        "vision-language": {"model_type": "gemma3", "text_config": {"hidden_size": 64}},
        "original": {"model_type": "llama"},
    }
    assert {saved_format(config).name for config in configs.values()} == {found.name for found in FORMATS}
    assert all(saved_format(config).name == name for name, config in configs.items())
    readable = {found.name for found in FORMATS if found.gguf_refusal is None}
    assert readable == {"decilm", "vision-language", "original"}


class _Reads(Stage):
    name = "reads_saved"
    after = "saving model"


class _Changes(_Reads):
    name = "changes_saved"
    changes_model = True


def test_a_stage_may_follow_saving_only_when_it_reads_what_was_saved() -> None:
    order = [stage.name for stage in run_order([_Reads()])]
    assert order.index("reads_saved") == order.index("saving model") + 1
    with pytest.raises(UserError, match="follows 'saving model' and changes the model"):
        run_order([_Changes()])
    assert len(run_order([])) == len(BUILTIN_STAGES)


PLUGIN = '''
"""A test plugin's stage after saving: what model/ holds, for the report."""
from compressor.plugin import Stage, hookimpl


class ListSaved(Stage):
    name = "list_saved"
    after = "saving model"

    def run(self, state):
        state.extra[self.name] = {"files": sorted(p.name for p in (state.staging / "model").iterdir())}


@hookimpl
def compressor_stages():
    return [ListSaved()]
'''


def test_a_plugin_stage_after_saving_reads_the_saved_folder(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "site").mkdir()
    install_plugin(monkeypatch, tmp_path / "site", "list_saved_stage", textwrap.dedent(PLUGIN), "list_saved")
    recipe = write_recipe(tmp_path, tiny_checkpoint, slicing={"layout": "global"})
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(report["stages"]["list_saved"]["files"])
