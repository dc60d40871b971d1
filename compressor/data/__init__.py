"""Text in, token windows out: local files or hub datasets cut into windows (`text`), chat
conversations with their assistant-token masks (`chat`), and the `Batch` every consumer reads
(`batches`).

`compressor.data` was one module before the package was split into rooms; its names still
resolve here (`from compressor.data import token_windows`), forwarded to `text`."""

from __future__ import annotations

from compressor._aliases import forwarding

__getattr__ = forwarding(__name__, "compressor.data.text")
