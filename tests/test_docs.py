"""The documentation that a test can hold to the code: the recipe reference against the schema,
and the README's length."""

from __future__ import annotations

import re
from typing import Any

import yaml

from compressor.recipe.schema import recipe_schema
from compressor.strategies.registry import PluginRegistry
from tests.conftest import ROOT


def _schema_keys(schema: dict[str, Any], node: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted keys of the recipe's sections (the pipeline's items are each strategy's own)."""
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    for option in node.get("anyOf", []):
        if "$ref" in option or "properties" in option:
            return _schema_keys(schema, option, prefix)
    keys = set()
    for name, child in node.get("properties", {}).items():
        keys.add(prefix + name)
        if name != "pipeline" and name != "lm_eval":
            keys |= _schema_keys(schema, child, f"{prefix}{name}.")
    return keys


def _documented_keys(block: str) -> set[str]:
    """Dotted keys of the reference block: its YAML, and keys given as an alternative in a
    comment at the top level (`# target_params: 0.75`)."""

    def walk(value: Any, prefix: str = "") -> set[str]:
        if not isinstance(value, dict):
            return set()
        found = set()
        for name, child in value.items():
            found.add(prefix + name)
            if name not in ("pipeline", "lm_eval", "dataset", "trainer"):
                found |= walk(child, f"{prefix}{name}.")
        return found

    return walk(yaml.safe_load(block)) | set(re.findall(r"^# (\w+):", block, re.MULTILINE))


def test_the_recipe_reference_documents_every_key_of_the_schema() -> None:
    text = (ROOT / "docs" / "recipes.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, re.DOTALL).group(1)
    schema = recipe_schema(PluginRegistry())
    expected = _schema_keys(schema, schema)
    documented = _documented_keys(block)
    assert not expected - documented, f"keys missing from docs/recipes.md: {sorted(expected - documented)}"
    assert not documented - expected, (
        f"docs/recipes.md documents keys the schema lacks: {sorted(documented - expected)}"
    )


def test_the_readme_and_the_map_are_short_enough_to_read_to_the_end() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    assert len((ROOT / "docs" / "architecture.md").read_text().splitlines()) <= 150
