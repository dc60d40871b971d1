"""The run is a list of stages over one declared state: every field a stage hands the next is
declared (and typed) in `RunState`, so a reader sees the whole state without reading every stage;
the runner is the loop, small enough to read at once."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import compressor.run.runner
from compressor.stages import order
from compressor.stages.base import RunState
from compressor.stages.contract import Stage
from compressor.stages.order import BUILTIN_STAGES

RUN = Path(compressor.run.runner.__file__).parent


def _assigned_state_attributes(path: Path) -> dict[str, int]:
    """`state.X = ...` (or `trial.X`, a split's own state) in a module, by X, with a line."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(element, ast.Attribute) and getattr(element.value, "id", None) in ("state", "trial"):
                    found.setdefault(element.attr, node.lineno)
    return found


def test_every_field_a_stage_sets_is_declared_in_run_state() -> None:
    declared = {field.name for field in dataclasses.fields(RunState)}
    undeclared = {
        f"{path.name}:{line} {name}"
        for path in [*sorted((RUN / "stages").glob("*.py")), RUN / "runner.py"]
        for name, line in _assigned_state_attributes(path).items()
        if name not in declared
    }
    assert not undeclared, f"set by a stage but not declared in RunState: {sorted(undeclared)}"


def test_the_runner_is_a_loop_and_no_function_in_run_is_long() -> None:
    assert len((RUN / "runner.py").read_text().splitlines()) <= 300
    long = []
    for path in RUN.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 80:
                    long.append(f"{path.relative_to(RUN)}:{node.name} ({length} lines)")
    assert not long, f"functions in run/ over 80 lines: {long}"


def test_every_built_in_stage_is_declared_once_and_named() -> None:
    names = [stage.name for stage in BUILTIN_STAGES]
    assert len(set(names)) == len(names) and all(names)
    assert all(isinstance(stage, Stage) for stage in BUILTIN_STAGES)
    # a stage the guard judges must be one that changes the model
    assert all(stage.changes_model for stage in BUILTIN_STAGES if stage.guarded)
    assert order.PLACEABLE and set(order.PLACEABLE) <= set(names)
