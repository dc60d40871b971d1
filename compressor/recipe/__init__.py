"""Recipes: the YAML schema and its validation (`schema`), and the options of the H pass that a
recipe sets (`sensitivity_options`).

`compressor.recipe` was one module before the package was split into rooms; its names still
resolve here (`from compressor.recipe import load_recipe`), forwarded to `schema`."""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # the import system's probes: nothing to forward
        raise AttributeError(name)
    try:
        return getattr(importlib.import_module("compressor.recipe.schema"), name)
    except AttributeError:
        raise AttributeError(f"module 'compressor.recipe' has no attribute {name!r}") from None
