"""The demo model (`ref-llama/`) and text (`data/`) the package ships as `compressor_demo`: a recipe
names them `bundled:ref-llama` and `bundled:data/calib-demo.jsonl` wherever it lies
(`compressor.recipe.paths`). The plugin folders beside them are not part of the package."""
