"""The run's state is declared in one place: `_Stages.__init__` names (and types) every attribute
a stage hands to the next, so a reader sees the whole state without reading every stage."""

from __future__ import annotations

import ast
from pathlib import Path

import compressor.run.runner


def test_every_attribute_of_a_run_s_stages_is_declared_in_init() -> None:
    tree = ast.parse(Path(compressor.run.runner.__file__).read_text())
    stages = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "_Stages")
    declared: set[str] = set()
    assigned: dict[str, str] = {}
    for method in (node for node in stages.body if isinstance(node, ast.FunctionDef)):
        for node in ast.walk(method):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(element, ast.Attribute) and getattr(element.value, "id", None) == "self":
                        if method.name == "__init__":
                            declared.add(element.attr)
                        else:
                            assigned.setdefault(element.attr, method.name)
    undeclared = {name: where for name, where in assigned.items() if name not in declared}
    assert not undeclared, f"set by a stage but not declared in _Stages.__init__: {undeclared}"
