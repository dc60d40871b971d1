"""The package's folders are its rooms: each room imports only the rooms below it, and the flat
module names of before the split keep importing (the same module objects)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import compressor
from compressor._aliases import MOVED

PACKAGE = Path(compressor.__file__).parent

BASE = {"errors", "faults", "validation", "hub", "_post_import", "_aliases", "__init__"}
"""Top-level modules every room may use."""

BELOW: dict[str, set[str]] = {
    "models": set(),
    "data": set(),
    "strategies": {"models"},
    "recipe": {"strategies", "models"},
    "evaluation": {"recipe", "data"},
    "engine": {"models", "strategies", "recipe", "data"},
    "training": {"models", "strategies", "recipe", "data", "engine"},
    "run": {"models", "strategies", "recipe", "data", "engine", "evaluation", "training"},
}
"""Room -> the rooms it may import (besides itself and the base modules)."""


def _room(module: str) -> str:
    """`compressor.engine.walk` -> `engine`; a base module's name for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    """Every `compressor.*` module a file imports, at its top or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "compressor":
            if node.module == "compressor":
                found.update(f"compressor.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "compressor")
    return found


def test_every_room_imports_only_the_rooms_below_it() -> None:
    rooms = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert rooms == set(BELOW), "a new room needs its place in BELOW (and in docs/architecture.md)"
    loose = {path.stem for path in PACKAGE.glob("*.py")} - BASE - {"cli", "entry"}
    assert not loose, f"modules outside the rooms: {sorted(loose)}"
    upward = []
    for room, allowed in BELOW.items():
        for path in sorted((PACKAGE / room).glob("*.py")):
            for module in _imports(path):
                target = _room(module)
                if target not in BASE and target != room and target not in allowed:
                    upward.append(f"{room}/{path.name} imports {module}")
    for name in BASE - {"__init__"}:
        for module in _imports(PACKAGE / f"{name}.py"):
            if _room(module) not in BASE:
                upward.append(f"{name}.py imports {module}")
    assert not upward, "\n".join(upward)


def test_the_architecture_page_draws_every_room() -> None:
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [room for room in BELOW if f"compressor/{room}/" not in page]
    assert not missing, f"docs/architecture.md does not show {missing}"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_name_imports_its_new_home_with_a_warning(old: str) -> None:
    new = importlib.import_module(f"compressor.{MOVED[old]}")
    sys.modules.pop(f"compressor.{old}", None)
    with pytest.warns(DeprecationWarning, match=f"compressor.{MOVED[old]}"):
        aliased = importlib.import_module(f"compressor.{old}")
    assert aliased is new
    assert aliased.__spec__ is not None and aliased.__spec__.name == f"compressor.{MOVED[old]}"
    assert getattr(compressor, old) is new


def test_the_old_modules_that_became_packages_forward_their_names() -> None:
    """In a fresh interpreter (nothing imported yet), without a warning."""
    script = ("import warnings; warnings.simplefilter('error')\n"
              "from compressor.engine import prune, parallel\n"
              "from compressor.recipe import load_recipe\n"
              "from compressor.data import token_windows\n"
              "from compressor.engine.walk import prune as p; from compressor.recipe.schema import load_recipe as r\n"
              "from compressor.data.text import token_windows as t\n"
              "assert (prune, load_recipe, token_windows) == (p, r, t)\n"
              "import compressor.engine\n"
              "try:\n    compressor.engine.nothing_here\nexcept AttributeError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "module 'compressor.engine' has no attribute 'nothing_here'"


def test_importing_the_package_stays_cheap() -> None:
    """`import compressor` (the CLI's help, a recipe check) imports neither torch nor transformers."""
    loaded = subprocess.run([sys.executable, "-c", "import sys, compressor, compressor.cli; "
                             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"],
                            capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_a_submodule_imported_through_its_package_does_not_load_the_forwarded_module() -> None:
    """`from compressor.engine import parallel` gives the submodule without importing the walk."""
    script = ("import sys\nfrom compressor.engine import parallel\n"
              "print(parallel.__name__, 'compressor.engine.walk' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["compressor.engine.parallel", "False"]


RUNNER_NAMES_01 = ["Progress", "T", "load_config", "load_model", "load_tokenizer", "resolve_device", "token_batches",
                   "check_fields", "Resources", "RUN_MARKER", "RUN_FILES", "list_run_files", "LEGACY_RUN_FILES",
                   "foreign_files", "check_output", "interrupted_with_another_recipe", "check_interrupted",
                   "check_writable", "CHECKPOINT_FOLDER", "SCRATCH_FOLDER", "LOCK_FILE", "staging_folder", "Plan", "plan",
                   "WIDE_LOSS", "budget_warnings", "check_positions", "curve_allocator", "check_tie_head",
                   "check_distillation", "check_evaluation_tasks", "recipe_fingerprint", "DISTILLATION_MEMORY_KEYS",
                   "distillation_fingerprint", "data_fingerprint", "run", "FULL_DISK", "fisher_key", "baseline_tasks_key"]
"""The public names of 0.1's `compressor/runner.py`, before it was split."""


def test_every_name_of_the_old_runner_still_resolves_through_it() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        runner = importlib.import_module("compressor.runner")
    missing = [name for name in RUNNER_NAMES_01 if not hasattr(runner, name)]
    assert not missing, missing
    from compressor.run.loading import load_model
    from compressor.run.staging import RUN_MARKER

    assert (runner.load_model, runner.RUN_MARKER) == (load_model, RUN_MARKER)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        runner.nothing_here  # noqa: B018
