"""Run a callback right after a module is first imported (a post-import hook).

`import compressor` must make saved sliced models loadable through the transformers Auto
classes, but importing transformers (and torch) costs seconds that `compress --help` and recipe
checks do not need. So the package registers its classes when transformers itself is imported:
whoever loads a model imports transformers first, and pays for the registration then.

The finder stays in `sys.meta_path` (removing it while the import system iterates that list, or
when a library merely probes `importlib.util.find_spec`, would lose the hook); it wraps the
loader of every spec it is asked for until the module has actually been executed once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback
        self.done = False
        self._looking = threading.local()

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or self.done or getattr(self._looking, "active", False):
            return None
        self._looking.active = True  # the other finders locate the module; we only wrap its loader
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._looking.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            self.fire()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def fire(self) -> None:
        """Run the callback once; a failure is a warning, never a failed import of the module."""
        if self.done:
            return
        self.done = True
        try:
            self.callback()
        except Exception as error:  # noqa: BLE001 - the user's `import transformers` must still work
            warnings.warn(f"compressor could not register its sliced model classes: {error}", stacklevel=2)


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Call `callback` now if module `name` is imported already, else once it has been."""
    if name in sys.modules:
        callback()
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))
