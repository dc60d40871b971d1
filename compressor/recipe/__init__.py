"""Recipes: the YAML schema and its validation (`schema`), and the options of the H pass that a
recipe sets (`sensitivity_options`).

`compressor.recipe` was one module before the package was split into rooms; its names still
resolve here (`from compressor.recipe import load_recipe`), forwarded to `schema`."""

from __future__ import annotations

from compressor._aliases import forwarding

__getattr__ = forwarding(__name__, "compressor.recipe.schema")
