"""A recipe is assembled from its sections (issue 47, item 3): each section's options class and
checks live in its own module under `recipe/sections/`, the recipe checks them in one declared
order, and the stage that reads a section names the same options class."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

import compressor.recipe.schema
from compressor.errors import UserError
from compressor.recipe.schema import Recipe, validate
from compressor.recipe.sections.order import BUILTIN_SECTIONS
from compressor.strategies.registry import PluginRegistry
from tests.conftest import EXAMPLES

RECIPE = Path(compressor.recipe.schema.__file__).parent


def _raw(**changes: Any) -> dict[str, Any]:
    data = {"path": "json", "data_files": str(EXAMPLES / "data" / "calib-demo.jsonl")}
    raw: dict[str, Any] = {
        "model": {"path": str(EXAMPLES / "ref-llama")},
        "calibration": {"dataset": data, "num_samples": 4, "seq_len": 32},
        "sparsity": 0.25,
        "pipeline": [{"strategy": "pca"}],
        "output": "out",
    }
    raw.update(changes)
    return raw


def test_every_section_is_a_field_of_the_recipe_typed_by_its_options() -> None:
    fields = {field.name: field for field in dataclasses.fields(Recipe)}
    for section in BUILTIN_SECTIONS:
        assert section.key in fields, f"section {section.key} is not a key of the recipe"
        assert section.options.__name__ in str(fields[section.key].type), section.key
    keys = [section.key for section in BUILTIN_SECTIONS]
    assert len(keys) == len(set(keys))
    typed = {name for name, field in fields.items() if "Spec" in str(field.type) or "Options" in str(field.type)}
    assert typed - {"pipeline"} == set(keys), "an options section of the recipe that no Section declares"


def test_the_schema_module_defines_no_section_of_its_own() -> None:
    """Options classes live beside their sections: schema.py declares only the recipe and its steps."""
    tree = ast.parse((RECIPE / "schema.py").read_text())
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert classes == {"Recipe", "StepSpec"}
    for section in BUILTIN_SECTIONS:
        assert section.options.__module__.startswith("compressor.recipe.sections."), section.key


def test_every_built_in_stage_reads_its_section_s_options() -> None:
    from compressor.stages.order import BUILTIN_STAGES

    options = {section.key: section.options for section in BUILTIN_SECTIONS}
    for stage in BUILTIN_STAGES:
        if stage.section is not None:
            assert stage.options is options[stage.section], stage.name


def test_sections_are_checked_in_their_declared_order(tmp_path: Path) -> None:
    """Two problems: the section checked first (mlp before calibration) is the one reported."""
    raw = _raw(mlp={"selector": "no-such-selector"})
    raw["calibration"] = dict(raw["calibration"], dataset={"path": "json", "data_files": "missing.jsonl"})
    with pytest.raises(UserError, match="unknown neuron selector 'no-such-selector'"):
        validate(raw, tmp_path, PluginRegistry())
    del raw["mlp"]
    with pytest.raises(UserError, match="data file not found"):
        validate(raw, tmp_path, PluginRegistry())


def test_a_section_s_check_sees_the_sections_checked_before_it(tmp_path: Path) -> None:
    """Distillation takes its data from the calibration's, paths already resolved."""
    recipe = validate(_raw(distillation={"tokens": 1000}), tmp_path, PluginRegistry())
    assert recipe.distillation.dataset == recipe.calibration.dataset
    assert Path(recipe.calibration.dataset["data_files"]).is_absolute()
    assert recipe.distillation.seq_len == 32


def test_a_shorthand_is_read_by_its_section(tmp_path: Path) -> None:
    evaluation = dict(_raw()["calibration"], lm_eval={"tasks": ["arc_easy"]})
    recipe = validate(_raw(evaluation=evaluation), tmp_path, PluginRegistry())
    assert [suite.tasks for suite in recipe.evaluation.lm_eval] == [["arc_easy"]]


def test_an_unknown_top_level_key_names_the_nearest_section(tmp_path: Path) -> None:
    with pytest.raises(UserError) as error:
        validate(_raw(refinment={}), tmp_path, PluginRegistry())
    message = str(error.value)
    assert message.startswith("unknown key 'refinment' (did you mean 'refinement'?); allowed keys: model, ")
    assert "stages" not in message.split("allowed keys: ")[1].split(", ")
