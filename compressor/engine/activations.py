"""Calibration activations held off the accelerator, one batch at a time on it.

A 12B model's activations over 1,024 × 2,048 tokens are ~21 GB per copy in bf16: they live in
host memory (pinned when the device is a GPU, so host-to-device copies are fast), or in
memory-mapped files when host memory is short, and go to the device one batch at a time.
On a CPU run the store holds the very tensors the device computed: nothing is copied.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

OFFLOAD_MODES = ("host", "disk")


def to_device(value: Any, device: torch.device, memo: dict[int, Any] | None = None) -> Any:
    """`value` (tensors inside tuples, lists and dicts) on `device`; a tensor reached twice is
    moved once (layers share masks and position embeddings), non-blocking from pinned memory."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = value.to(device, non_blocking=True)
        return memo[id(value)]
    if isinstance(value, dict):
        return {k: to_device(v, device, memo) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        moved = [to_device(v, device, memo) for v in value]
        return type(value)(moved) if isinstance(value, list) else tuple(moved)
    return value


@contextmanager
def held_on(parts: list[nn.Module], device: torch.device, *, read_only: bool = False) -> Iterator[None]:
    """Put `parts` on `device` for a while, and each back where it was afterwards (a part with
    neither parameters nor buffers, such as a fused norm, has no home and is left alone).

    With `read_only` (the parts are only run there, as in the H pass or a survey) they go back to
    the very tensors they had: nothing is copied back, which on a GPU saves a device-to-host
    copy of every weight each time a layer is visited."""
    homes = [next((t.device for t in (*part.parameters(), *part.buffers())), None) for part in parts]
    kept = [_tensors_of(part) for part in parts] if read_only else []
    try:
        for part, home in zip(parts, homes):
            if home is not None and home != device:  # already there: nothing to move (fake tensors cannot be)
                part.to(device)
        yield
    finally:
        if read_only:
            for tensors in kept:
                _restore(tensors)
        else:
            for part, home in zip(parts, homes):
                if home is not None and not _released(part):
                    part.to(home)


def _released(part: nn.Module) -> bool:
    """The pass dropped the part to the meta device (written out as it went): it has no home to go to."""
    return any(t.is_meta for t in part.parameters())


def _tensors_of(part: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]]:
    """Each parameter of `part` (the object, tied ones included, and its data) and each buffer,
    by owning module and name."""
    out: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]] = []
    for module in part.modules():
        out.extend((module, name, param, param.data) for name, param in module._parameters.items() if param is not None)
        out.extend((module, name, buffer, None) for name, buffer in module._buffers.items() if buffer is not None)
    return out


def _restore(tensors: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]]) -> None:
    """The same parameter objects (so tied weights stay tied) with their old data, and the old buffers."""
    for module, name, tensor, data in tensors:
        if data is None:
            module._buffers[name] = tensor
        else:
            tensor.data = data  # a move may have swapped its data (GPU) or replaced the object (meta)
            module._parameters[name] = tensor  # type: ignore[assignment]


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`, in pinned memory when it comes from a GPU.

    A copy into fresh pageable memory page-faults its way through it: on an H200 host such copies
    of the H pass's streams and gradients took 46 of its 108 GPU seconds. Pinned blocks are a DMA
    at the bus's speed, are recycled by torch's caching host allocator once freed, and make the
    copy back to the device fast too."""
    tensor = tensor.detach()
    if tensor.device.type != "cuda":
        return tensor.to("cpu")
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)


class ActivationStore:
    """One tensor per calibration batch, replaced in place as the walk moves down the model.

    `put` overwrites a batch's slot, so at most one copy of the activations exists, plus the
    batch in flight. `offload="disk"` keeps the slots in memory-mapped files under `folder`.
    """

    def __init__(self, device: torch.device, offload: str = "host", folder: Path | None = None) -> None:
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {offload!r}")
        self.device = device
        self.pin = device.type == "cuda"
        self._offload, self._parent = offload, folder
        self._folder = None
        if offload == "disk":
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
            self._folder = Path(tempfile.mkdtemp(prefix="activations-", dir=folder))
        self._slots: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._slots)

    def sibling(self) -> ActivationStore:
        """An empty store kept the way this one is (host, pinned or spilled beside it on disk)."""
        return ActivationStore(self.device, self._offload, self._parent)

    def append(self, tensor: torch.Tensor) -> None:
        self._slots.append(self._hold(len(self._slots), tensor))

    def put(self, index: int, tensor: torch.Tensor) -> None:
        """Replace batch `index` (reusing its buffer when the shape is unchanged)."""
        slot = self._slots[index]
        if slot.shape == tensor.shape and slot.dtype == tensor.dtype and (self.pin or self._folder is not None):
            slot.copy_(tensor.detach())
        else:
            self._slots[index] = self._hold(index, tensor)

    def get(self, index: int, device: torch.device | None = None) -> torch.Tensor:
        """Batch `index` on `device` (default: the store's device). On the host it is the stored
        tensor itself: do not keep it past the next `put` of that batch."""
        return self._slots[index].to(device or self.device, non_blocking=True)

    def host(self, index: int) -> torch.Tensor:
        return self._slots[index]

    def close(self) -> None:
        """Drop every slot and remove the spill files."""
        self._slots.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def _hold(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if self._folder is not None:
            path = self._folder / f"batch-{index:06d}.bin"
            path.unlink(missing_ok=True)
            mapped = torch.from_file(str(path), shared=True, size=tensor.numel(), dtype=tensor.dtype)
            return mapped.view(tensor.shape).copy_(tensor)
        if tensor.device.type == "cpu" and not self.pin:
            return tensor
        held = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin)
        return held.copy_(tensor)
