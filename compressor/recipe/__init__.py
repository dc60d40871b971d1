"""Recipes: reading the YAML (`reading`), its paths (`paths`), one module per section with its
options and checks (`sections`), and the recipe assembled and validated from them (`schema`)."""
