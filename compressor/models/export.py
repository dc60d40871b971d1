"""Self-contained pruned folders: the modelling code travels with the weights.

A saved sliced model loads with `import compressor` (which registers the `sliced_*` classes),
and also where compressor is not installed: the folder holds `modeling_sliced.py`, built from
this package's own `experts`, `families` and `modeling` sources, and its `config.json` names it in an
`auto_map`, so `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` and tools
that only take a path (lm-eval's `hf` model with `trust_remote_code=True`) can load it.
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import compressor
from compressor.models import experts, families
from compressor.models import sliced as modeling
from compressor.models.families import BUILTIN_FAMILIES, ModelFamily

REMOTE_MODULE = "modeling_sliced"
CONFIG_CLASS = "SlicedConfig"
MODEL_CLASS = "SlicedForCausalLM"

_HEADER = '''"""Sliced model classes written by compressor {version} (residual-stream pruning), so this
folder loads with `trust_remote_code=True` where compressor is not installed. Generated from
compressor's `families` and `modeling` modules; edits are lost when the model is saved again."""

from __future__ import annotations


class UserError(Exception):
    """compressor.errors.UserError (a model family refusing a config)."""

'''


def _body(module: object) -> str:
    """A module's source without its docstring, `__future__` import and imports of this package."""
    source = inspect.getsource(module)
    tree = ast.parse(source)
    first = tree.body[0]
    skip = first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else 0
    kept = [
        line
        for line in source.splitlines()[skip:]
        if not line.startswith(("from __future__", "from compressor", "import compressor"))
    ]
    return "\n".join(kept).strip("\n") + "\n"


def remote_code(model_type: str) -> str:
    """The source of `modeling_sliced.py` for a sliced model of the original `model_type`."""
    footer = f"\n\n{CONFIG_CLASS}, {MODEL_CLASS} = _make_sliced_classes(family_for({model_type!r}), {model_type!r})\n"
    bodies = "\n\n".join(_body(module) for module in (experts, families, modeling))
    return _HEADER.format(version=compressor.__version__) + bodies + footer


def write_remote_code(folder: Path, family: ModelFamily, model_type: str) -> bool:
    """Add the modelling code and the `auto_map` to a saved sliced model; False (nothing written)
    for a family from a plugin, whose description lives in that plugin's code."""
    if family not in BUILTIN_FAMILIES:
        return False
    (folder / f"{REMOTE_MODULE}.py").write_text(remote_code(model_type))
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {
        "AutoConfig": f"{REMOTE_MODULE}.{CONFIG_CLASS}",
        "AutoModelForCausalLM": f"{REMOTE_MODULE}.{MODEL_CLASS}",
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return True
