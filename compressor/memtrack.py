"""Live tensor bytes per device, and their peaks: a measuring instrument for the walk's memory bounds.

`LiveBytes` is a `TorchDispatchMode`: every tensor an operator returns while it is active is
counted on its device until its storage is freed. It works on real tensors and on fake ones
(`FakeTensorMode`), so the device memory of a 70B model's walk can be measured on a machine
without a GPU. Tensors that existed before (weights, say) are counted only once `adopt` is
called on them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of live storages per device type ("cpu", "cuda", …), their peaks, and named marks."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self._storages: dict[int, tuple[StorageWeakRef, int, str]] = {}

    def adopt(self, *tensors: torch.Tensor) -> None:
        """Count tensors made outside the mode (a module's weights moved before it started)."""
        for tensor in tensors:
            self._track(tensor)

    def reset_peak(self) -> None:
        self._sweep()
        self.peak = defaultdict(int, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._sweep()
        # A view or an in-place result shares an input's storage: nothing new was allocated.
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and _storage_key(value) not in inputs:
                self._track(value)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse or storage-less tensors
            return
        key = storage._cdata
        if key in self._storages and not self._storages[key][0].expired():
            return
        size, device = storage.nbytes(), tensor.device.type
        self._storages[key] = (StorageWeakRef(storage), size, device)
        self.live[device] += size
        self.peak[device] = max(self.peak[device], self.live[device])

    def _sweep(self) -> None:
        for key in [k for k, (ref, _, _) in self._storages.items() if ref.expired()]:
            _, size, device = self._storages.pop(key)
            self.live[device] -= size


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None
