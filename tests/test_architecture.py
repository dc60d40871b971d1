"""The package's folders are its rooms: each room imports only the rooms below it, and the flat
module names of before the split keep importing (the same module objects)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import compressor

PACKAGE = Path(compressor.__file__).parent

BASE = {"errors", "faults", "validation", "hub", "_post_import", "__init__"}
"""Top-level modules every room may use."""

BELOW: dict[str, set[str]] = {
    "models": set(),
    "data": set(),
    "strategies": {"models"},
    "recipe": {"strategies", "models"},
    "evaluation": {"recipe", "data"},
    "engine": {"models", "strategies", "recipe", "data"},
    "training": {"models", "strategies", "recipe", "data", "engine"},
    "reports": {"models", "strategies", "recipe", "data", "engine", "evaluation", "training"},
    "runtime": {"models", "strategies", "recipe", "data", "engine", "evaluation", "training", "reports"},
    "stages": {"models", "strategies", "recipe", "data", "engine", "evaluation", "training", "reports", "runtime"},
    "plan": {
        "models",
        "strategies",
        "recipe",
        "data",
        "engine",
        "evaluation",
        "training",
        "reports",
        "runtime",
        "stages",
    },
    "run": {
        "models",
        "strategies",
        "recipe",
        "data",
        "engine",
        "evaluation",
        "training",
        "reports",
        "runtime",
        "stages",
        "plan",
    },
    "commands": {
        "models",
        "strategies",
        "recipe",
        "data",
        "engine",
        "evaluation",
        "training",
        "reports",
        "runtime",
        "stages",
        "plan",
        "run",
    },
    "cli": {
        "models",
        "strategies",
        "recipe",
        "data",
        "engine",
        "evaluation",
        "training",
        "reports",
        "runtime",
        "stages",
        "plan",
        "run",
        "commands",
    },
}
"""Room -> the rooms it may import (besides itself and the base modules)."""


def _room(module: str) -> str:
    """`compressor.engine.walk` -> `engine`; a base module's name for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and not parts[1].startswith("__") else "__init__"  # __version__: the package's


def _typing_only(tree: ast.AST) -> set[int]:
    """The nodes under `if TYPE_CHECKING:`: imports for annotations, never executed."""
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }


def _imports(path: Path) -> set[str]:
    """Every `compressor.*` module a file imports when it runs, at its top or inside functions (an
    annotation may name a room above: a stage's `check_plan` is handed the `Plan`, under TYPE_CHECKING)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    typing_only = _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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
    loose = {path.stem for path in PACKAGE.glob("*.py")} - BASE - {"entry", "plugin"}
    assert not loose, f"modules outside the rooms: {sorted(loose)}"
    upward = []
    for room, allowed in BELOW.items():
        for path in sorted((PACKAGE / room).rglob("*.py")):  # a room's folders are the room (run/stages)
            for module in _imports(path):
                target = _room(module)
                if target not in BASE and target != room and target not in allowed:
                    upward.append(f"{path.relative_to(PACKAGE)} imports {module}")
    for name in BASE - {"__init__"}:
        for module in _imports(PACKAGE / f"{name}.py"):
            if _room(module) not in BASE:
                upward.append(f"{name}.py imports {module}")
    assert not upward, "\n".join(upward)


def _module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports when it runs: at its top or inside functions, but
    not under `if TYPE_CHECKING:` (annotations only, never executed). `from a.b import c` names
    the module `a.b.c` where that is one, else `a.b`."""
    modules = {".".join((package, *path.relative_to(root).with_suffix("").parts)): path for path in root.rglob("*.py")}
    modules = {name.removesuffix(".__init__"): path for name, path in modules.items()}

    def home(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = _typing_only(tree)
        targets = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {home(f"{node.module}.{alias.name}") for alias in node.names}
            elif isinstance(node, ast.Import):
                targets |= {home(alias.name) for alias in node.names}
        graph[name] = {target for target in targets if target is not None and target != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_what_imports_it() -> None:
    """No import cycle in compressor/, imports written inside functions counted: a cycle held open by
    a late import is a module that cannot be read, tested or moved alone (issue 80)."""
    cycles = _cycles(_module_graph(PACKAGE, "compressor"))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_finds_a_cycle_held_open_by_an_import_inside_a_function(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "plan.py").write_text("from pkg.stage import Stage\n")
    (package / "stage.py").write_text("class Stage:\n    def run(self):\n        from pkg import plan\n")
    (package / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.plan import x\n"
    )
    (package / "cost.py").write_text("from pkg.typed import y\n")
    assert _cycles(_module_graph(package, "pkg")) == [["pkg.plan", "pkg.stage"]]


def test_every_package_folder_is_in_the_wheel() -> None:
    """setuptools lists the packages by hand: a folder left out installs in editable mode (as the
    suite runs) and is missing from a built wheel."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(path.parent.relative_to(PACKAGE.parent).parts) for path in PACKAGE.rglob("__init__.py")} | {
        "compressor_plugins",
        "compressor_demo",  # examples/: the demo model and text, package data (`bundled:`)
    }
    assert found == listed, f"missing from pyproject.toml: {sorted(found - listed)}; stale: {sorted(listed - found)}"


def test_the_architecture_page_draws_every_room() -> None:
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [room for room in BELOW if f"compressor/{room}/" not in page]
    assert not missing, f"docs/architecture.md does not show {missing}"


def test_importing_the_package_stays_cheap() -> None:
    """`import compressor` (the CLI's help, a recipe check) imports neither torch nor transformers."""
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, compressor, compressor.cli; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.strip() == "[]"


def test_there_is_no_compatibility_layer() -> None:
    """Every module has one name, its home: 0.1's flat names and the packages' forwarding are gone."""
    script = (
        "import importlib\n"
        "for name in ('compressor.bases', 'compressor.runner', 'compressor.strategy'):\n"
        "    try:\n        importlib.import_module(name)\n    except ModuleNotFoundError:\n        print('gone')\n"
        "try:\n    from compressor.engine import prune\nexcept ImportError:\n    print('gone')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.stdout.split() == ["gone"] * 4, done.stderr


def _plugin_code() -> dict[str, str]:
    """The built-in plugins, the example plugins and the Python blocks of the plugin guides."""
    root = PACKAGE.parent
    code = {str(path.relative_to(root)): path.read_text() for path in (root / "plugins").glob("*.py")}
    for path in (root / "examples").rglob("*.py"):
        code[str(path.relative_to(root))] = path.read_text()
    for guide in ("writing-a-strategy.md", "adding-a-model-family.md", "writing-a-stage.md", "adding-an-axis.md"):
        text = (root / "docs" / guide).read_text()
        for index, block in enumerate(text.split("```python\n")[1:]):
            code[f"docs/{guide} block {index}"] = block.split("```")[0]
    return code


def test_plugins_and_their_guides_import_only_the_public_face() -> None:
    """`compressor.plugin` is the stable API: a plugin that reaches past it breaks when a module moves."""
    reaching = []
    for where, source in _plugin_code().items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "compressor":
                if node.module != "compressor.plugin":
                    reaching.append(f"{where}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                reaching += [
                    f"{where}: import {alias.name}"
                    for alias in node.names
                    if alias.name.split(".")[0] == "compressor" and alias.name != "compressor.plugin"
                ]
    assert not reaching, "\n".join(reaching)


def test_the_public_face_is_cheap_to_import() -> None:
    """Loading plugins (recipe checks, `compress strategies`) must not import transformers."""
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, compressor.plugin, compressor_plugins.sensitivity; print('transformers' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.strip() == "False"


def test_every_layer_by_layer_pass_goes_through_visit_layers() -> None:
    """A decoder layer reaches the device in one place (`engine/layerwise.py`), where streaming
    weights from disk attaches; a pass that moves layers itself would bypass it."""
    import re

    moving = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "layerwise.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"held_on\(\[\s*layers?\b", line):
                moving.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not moving, "\n".join(moving)


def test_a_folder_named_compressor_beside_a_script_does_not_shadow_the_package(tmp_path: Path) -> None:
    """A script in the folder that holds the clone (which git names `compressor`) imports the
    package, not the clone as an empty namespace package (the Makefile puts the checkout on the path)."""
    (tmp_path / "compressor").mkdir()  # the clone, seen from its parent: no __init__.py at its top
    found = subprocess.run(
        [sys.executable, "-c", "import compressor; print(compressor.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert found.stdout.strip() == str(PACKAGE / "__init__.py")


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_setup_takes_the_cpu_torch_unless_an_nvidia_gpu_answers(tmp_path: Path) -> None:
    """Without a working nvidia-smi the Makefile adds PyTorch's CPU index for torch (PyPI's Linux
    torch is the CUDA build, several GB of NVIDIA wheels); with one, PyPI's; TORCH_INDEX= and TORCH=
    override. Read from `make -n` (what it would run), with fake nvidia-smi commands in its place
    (`NVIDIA_SMI`): nothing is installed, and the machine's own GPU does not count."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    (fake / "nvidia-smi").chmod(0o755)
    failing = tmp_path / "broken"
    failing.mkdir()
    (failing / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (failing / "nvidia-smi").chmod(0o755)

    def torch_line(smi: Path, *args: str) -> str:
        planned = subprocess.run(
            ["make", "-n", "-B", f"VENV={tmp_path / 'venv'}", f"NVIDIA_SMI={smi}", *args, "setup"],
            capture_output=True,
            text=True,
            check=True,
            cwd=PACKAGE.parent,
            env=outside_make,
        ).stdout
        return next(line for line in planned.splitlines() if "pip install --quiet torch" in line).strip()

    # under `make test-all` (.ci/run passes TORCH_INDEX=) the outer make's command-line variables
    # reach this one through MAKEFLAGS and the environment: it must see only its own command line
    outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH", "TORCH_INDEX", "NVIDIA_SMI", "VENV", "PYTHON")
    outside_make = {k: v for k, v in os.environ.items() if k not in outer}

    cpu = "--extra-index-url https://download.pytorch.org/whl/cpu"
    none = tmp_path / "absent" / "nvidia-smi"
    assert torch_line(none).endswith(f"torch==2.13.0 {cpu}")  # no nvidia-smi at all
    assert torch_line(failing / "nvidia-smi").endswith(cpu)  # one that finds no GPU
    assert torch_line(fake / "nvidia-smi").endswith("torch==2.13.0")
    assert torch_line(none, "TORCH_INDEX=").endswith("torch==2.13.0")
    assert "torch==2.12.0" in torch_line(none, "TORCH=torch==2.12.0")


def test_the_tests_are_arranged_like_the_package() -> None:
    """tests/<room>/ holds the tests of compressor/<room>/; only whole-package checks sit at the top."""
    tests = PACKAGE.parent / "tests"
    folders = {path.name for path in tests.iterdir() if path.is_dir() and (path / "__init__.py").is_file()}
    assert folders <= set(BELOW), f"test folders that are not rooms: {sorted(folders - set(BELOW))}"
    loose = {path.name for path in tests.glob("test_*.py")} - {"test_architecture.py", "test_docs.py"}
    assert not loose, f"tests outside the rooms' folders: {sorted(loose)}"


def test_the_engine_s_entry_takes_the_layout_and_one_options_object() -> None:
    """`engine.prune(model, layout, batches, pipeline, options)`: what the walk needs beside the
    layout (checkpoint, H, ranks, allocator, progress) travels in `WalkOptions`, so a new need is a
    field, not another parameter every caller passes (issue 47, item 4)."""
    import inspect

    from compressor.engine.walk import prune
    from compressor.engine.walk_options import WalkOptions

    parameters = inspect.signature(prune).parameters
    assert len(parameters) <= 6, list(parameters)
    assert list(parameters)[:4] == ["model", "layout", "batches", "pipeline"]
    assert parameters["options"].annotation in (WalkOptions, "WalkOptions")
    assert {"checkpoint", "fisher", "ranks", "progress", "allocator"} <= {f.name for f in fields(WalkOptions)}


MODULE_LINES = 600
FUNCTION_LINES = 60
PARAMETERS = 6

LONG_FUNCTIONS: dict[str, int] = {}
"""Issue 80's backlog of functions over `FUNCTION_LINES` lines, each at its length when the limit came:
the list may only shrink (a function shortened under the limit leaves it), and none may grow."""

MANY_PARAMETERS: dict[str, int] = {
    "compressor.engine.fisher.estimate_fisher": 7,
    "compressor.evaluation.memtrack.attention": 8,
    "compressor.models.decilm.configuration_decilm.__init__": 17,
    "compressor.models.decilm.modeling_decilm.forward": 9,
    "compressor.models.stock.save_stock": 7,
    "compressor.models.stock.to_stock": 7,
}
"""The same for functions with more than `PARAMETERS` parameters (an options object instead); exempt and
staying: remote-code classes whose signatures transformers calls (DeciLM's configuration `__init__` and model
`forward`) and `memtrack.attention`, a drop-in for torch's `scaled_dot_product_attention` with its signature."""


def _function_sizes() -> tuple[dict[str, int], dict[str, int]]:
    """Every function of `compressor/` over the limits: its dotted name → lines, and → parameters."""
    long: dict[str, int] = {}
    many: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("compressor", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            name, arguments = f"{module}.{node.name}", node.args
            lines = node.end_lineno - node.lineno + 1
            named = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
            count = len([a for a in named if a not in ("self", "cls")]) + bool(arguments.vararg) + bool(arguments.kwarg)
            if lines > FUNCTION_LINES:
                long[name] = max(lines, long.get(name, 0))
            if count > PARAMETERS:
                many[name] = max(count, many.get(name, 0))
    return long, many


def test_no_module_is_over_600_lines() -> None:
    sizes = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    over = {name: lines for name, lines in sizes.items() if lines > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines: {over}"


@pytest.mark.parametrize(("limits", "backlog"), [(0, LONG_FUNCTIONS), (1, MANY_PARAMETERS)])
def test_no_function_grows_past_the_limits_and_the_backlog_only_shrinks(limits: int, backlog: dict[str, int]) -> None:
    """A function over the limits that is not in the backlog, or longer than it was there, fails; so
    does a backlog entry that is now within the limits (remove it: the backlog records what is left)."""
    found = _function_sizes()[limits]
    grown = {name: size for name, size in found.items() if size > backlog.get(name, 0)}
    assert not grown, f"over the limit, or grown past the backlog: {grown}"
    fixed = sorted(set(backlog) - set(found))
    assert not fixed, f"within the limits now: remove from the backlog {fixed}"


def test_benchmarks_import_no_private_name_of_the_package() -> None:
    """A benchmark that reaches a `_`-prefixed name breaks when the module moves it (issue 80)."""
    private = []
    for path in sorted((PACKAGE.parent / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "compressor":
                private += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    assert not private, private
