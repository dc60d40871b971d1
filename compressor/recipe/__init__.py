"""Recipes: the YAML schema and its validation (`schema`), and the options of the H pass that a
recipe sets (`sensitivity_options`)."""
