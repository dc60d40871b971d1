"""Safetensors shards written tensor by tensor, as a pass finishes them, never holding them all.

`save_pretrained` and `save_file` need every tensor in memory at once. A walk over a model bigger
than the host's memory finishes one layer at a time, so its output is laid out before it starts:
the tensors' names, shapes and dtypes (meta tensors are enough) are split into shards as
`save_pretrained` splits them (huggingface_hub's `split_torch_state_dict_into_shards`), each shard
file is created at its final size with its safetensors header, and each tensor's bytes are written
at their offset when the tensor is done (`write`). `commit` makes what was written durable and
records it; a killed process's successor (same layout) trusts exactly the committed tensors and
writes the rest. `finish` checks that every tensor was written and writes the index last.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from compressor.engine.checkpoint import write_atomic

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
INDEX_SUFFIX = ".index.json"


def _header(tensors: Mapping[str, torch.Tensor], names: list[str], metadata: Mapping[str, str]) -> tuple[bytes, dict]:
    """The safetensors header of a file holding `names`, and each name's byte range after it. As
    safetensors lays them out: the widest dtypes first (each tensor aligned to its element size),
    the header padded with spaces to a multiple of 8."""
    entries: dict[str, dict] = {}
    offset = 0
    for name in sorted(names, key=lambda n: (-tensors[n].element_size(), n)):
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    body = json.dumps({"__metadata__": dict(metadata), **entries}, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body, entries


class ShardWriter:
    """The shards of `tensors` (name → a tensor or meta tensor of the final shape and dtype) in
    `folder`, written as the caller finishes each tensor. `progress`: where committed names are
    recorded (a checkpoint's file; without one nothing is resumed)."""

    def __init__(
        self,
        folder: Path,
        tensors: Mapping[str, torch.Tensor],
        *,
        progress: Path | None = None,
        max_shard_size: int | str = "50GB",
        filename_pattern: str = "model{suffix}.safetensors",
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.folder, self.progress = folder, progress
        self.planned = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
        meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in self.planned.items()}
        split = split_torch_state_dict_into_shards(
            meta, filename_pattern=filename_pattern, max_shard_size=max_shard_size
        )
        self.index_name = filename_pattern.format(suffix="") + INDEX_SUFFIX if split.is_sharded else None
        self.total_size = int(split.metadata["total_size"])
        self.location: dict[str, tuple[str, int]] = {}
        """name → (shard file, absolute offset of its bytes)."""
        self._headers: dict[str, bytes] = {}
        self._sizes: dict[str, int] = {}
        for file, names in split.filename_to_tensors.items():
            header, entries = _header(meta, list(names), metadata or {"format": "pt"})
            self._headers[file] = header
            self._sizes[file] = len(header) + sum(e["data_offsets"][1] - e["data_offsets"][0] for e in entries.values())
            for name, entry in entries.items():
                self.location[name] = (file, len(header) + entry["data_offsets"][0])
        self.written: set[str] = set()
        """Names written and committed (by this process or, per `progress`, one before it)."""
        self._pending: set[str] = set()
        self._handles: dict[str, int] = {}
        folder.mkdir(parents=True, exist_ok=True)
        self._remove_strays(filename_pattern)
        self._open(self._committed())

    def _remove_strays(self, pattern: str) -> None:
        """Shards and an index of this pattern that this layout does not plan (an earlier run's,
        with another layout) go, and so does any index: it is written last, by `finish`, so that a
        reader of the folder never takes an old index for this model's."""
        stem, _, suffix = pattern.partition("{suffix}")
        for path in self.folder.glob(f"{stem}*{suffix}*"):
            if path.name not in self._headers and path.is_file():
                path.unlink()

    def _committed(self) -> set[str]:
        if self.progress is None or not self.progress.is_file():
            return set()
        return set(json.loads(self.progress.read_text())["written"]) & set(self.planned)

    def _open(self, committed: set[str]) -> None:
        """Each shard opened for writing: kept (with its committed names) when it is there with this
        layout's header and size, else created afresh."""
        for file, header in self._headers.items():
            path = self.folder / file
            names = {name for name, (f, _) in self.location.items() if f == file}
            kept = path.is_file() and path.stat().st_size == self._sizes[file]
            if kept:
                with open(path, "rb") as handle:
                    kept = handle.read(len(header)) == header
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | (0 if kept else os.O_TRUNC), 0o644)
            if not kept:
                os.pwrite(descriptor, header, 0)
                os.ftruncate(descriptor, self._sizes[file])  # sparse until written
            self._handles[file] = descriptor
            if kept:
                self.written |= names & committed

    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write these finished tensors at their places (durable only after `commit`)."""
        for name, tensor in tensors.items():
            if name not in self.planned:
                raise ValueError(f"'{name}' is not a tensor of the planned shards")
            if (tuple(tensor.shape), tensor.dtype) != self.planned[name]:
                raise ValueError(
                    f"'{name}' was planned as {self.planned[name]}, written as {(tuple(tensor.shape), tensor.dtype)}"
                )
            file, offset = self.location[name]
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            view = memoryview(data)
            while view.nbytes:
                done = os.pwrite(self._handles[file], view, offset)
                view, offset = view[done:], offset + done
            self._pending.add(name)

    def commit(self) -> None:
        """Flush what was written to disk, then record it (atomically) as written."""
        if not self._pending:
            return
        for descriptor in self._handles.values():
            os.fsync(descriptor)
        self.written |= self._pending
        self._pending.clear()
        if self.progress is not None:
            record = json.dumps({"written": sorted(self.written)})
            write_atomic(self.progress, lambda p: p.write_text(record + "\n"))

    def missing(self, names: Iterable[str] | None = None) -> list[str]:
        """Planned names (of `names`, by default all) not yet committed."""
        return [name for name in (self.planned if names is None else names) if name not in self.written]

    def close(self) -> None:
        for descriptor in self._handles.values():
            os.close(descriptor)
        self._handles.clear()

    def finish(self) -> None:
        """Every planned tensor written: the index (when sharded) is written last, and the shards closed."""
        try:
            self.commit()
            missing = self.missing()
            if missing:
                raise ValueError(f"{len(missing)} planned tensor(s) were never written, e.g. '{missing[0]}'")
        finally:
            self.close()
        if self.index_name is not None:
            index = {
                "metadata": {"total_size": self.total_size},
                "weight_map": {name: file for name, (file, _) in sorted(self.location.items())},
            }
            write_atomic(self.folder / self.index_name, lambda p: p.write_text(json.dumps(index, indent=2) + "\n"))
