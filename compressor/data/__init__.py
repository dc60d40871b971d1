"""Text in, token windows out: local files or hub datasets cut into windows (`text`), chat
conversations with their assistant-token masks (`chat`), and the `Batch` every consumer reads
(`batches`).

`compressor.data` was one module before the package was split into rooms; its names still
resolve here (`from compressor.data import token_windows`), forwarded to `text`."""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # the import system's probes: nothing to forward
        raise AttributeError(name)
    try:
        return getattr(importlib.import_module("compressor.data.text"), name)
    except AttributeError:
        raise AttributeError(f"module 'compressor.data' has no attribute {name!r}") from None
