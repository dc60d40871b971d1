"""Run a callback right after a module is first imported (a post-import hook).

`import compressor` must make saved sliced models loadable through the transformers Auto
classes, but importing transformers (and torch) costs seconds that `compress --help` and recipe
checks do not need. So the package registers its classes when transformers itself is imported:
whoever loads a model imports transformers first, and pays for the registration then.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: object = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; the other finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module
        callback = self.callback

        def exec_module(module: ModuleType) -> None:
            execute(module)
            callback()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Call `callback` now if module `name` is imported already, else once it has been."""
    if name in sys.modules:
        callback()
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))
