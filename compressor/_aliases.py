"""The flat module names of compressor before it was split into rooms, still importable.

Until 0.2 the package was one folder: `compressor.bases`, `compressor.strategy`,
`compressor.plugins`, ... Plugins and scripts written then keep working: importing an old
name gives the module at its new home (the same module object, so a class or function is
the same whichever name imported it), with a `DeprecationWarning` naming that home.
`compressor.engine`, `compressor.recipe` and `compressor.data` are packages now whose
attributes forward to the old module's names (see their `__init__`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

MOVED: dict[str, str] = {
    "activations": "engine.activations",
    "allocation": "engine.allocation",
    "bases": "engine.bases",
    "budget": "models.budget",
    "calibration": "engine.calibration",
    "chat": "data.chat",
    "checkpoint": "engine.checkpoint",
    "compare": "run.compare",
    "distill": "training.distill",
    "eval_command": "run.eval_command",
    "evaluate": "evaluation.metrics",
    "export": "models.export",
    "families": "models.families",
    "harness": "evaluation.harness",
    "memtrack": "evaluation.memtrack",
    "modeling": "models.sliced",
    "parallel": "engine.parallel",
    "plots": "evaluation.plots",
    "plugins": "strategies.registry",
    "preflight": "run.preflight",
    "refine": "engine.refine",
    "report": "run.report",
    "runner": "run.runner",
    "sensitivity": "engine.fisher",
    "sensitivity_options": "recipe.sensitivity_options",
    "sites": "models.sites",
    "stock": "models.stock",
    "strategy": "strategies.contract",
    "surrogate": "run.surrogate",
    "sweep": "run.sweep",
    "throughput": "evaluation.throughput",
    "transforms": "engine.transforms",
}
"""Old module name (under `compressor.`) -> its home now (under `compressor.`)."""


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new home (imported first, if need be)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.target}; import it from there",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system stamped the alias's spec on it: its own back


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.partition(".")
        if package != "compressor" or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(f"compressor.{MOVED[name]}"))


def install() -> None:
    """Put the finder on `sys.meta_path` once (after the path finders: a real module wins)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(_AliasFinder())


def forwarding(package: str, module: str) -> Callable[[str], Any]:
    """The `__getattr__` of a package that replaced a module of the same name: the old module's
    names resolve from `module`, its new home (imported on first use)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # the import system's probes: nothing to forward
            raise AttributeError(name)
        try:  # a submodule not imported yet (`from compressor.engine import parallel`) is itself
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{package}.{name}":
                raise
        try:
            return getattr(importlib.import_module(module), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
