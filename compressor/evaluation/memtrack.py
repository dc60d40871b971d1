"""Live tensor bytes per device, and their peaks: a measuring instrument for the walk's memory bounds.

`LiveBytes` is a `TorchDispatchMode`: every tensor an operator returns while it is active is
counted on its device until its storage is freed. It works on real tensors and on fake ones
(`FakeTensorMode`), so the device memory of a 70B model's walk can be measured on a machine
without a GPU. Tensors that existed before (weights, say) are counted only once `adopt` is
called on them.

`emulated_accelerator` lets the whole engine run with the meta device standing in for a GPU:
tensors there have shapes and no data, so a prune of a real config costs seconds, and
`LiveBytes` then tells the accelerator's bytes ("meta") from the host's ("cpu"). Attention there
runs a fused kernel's shape functions, as a GPU's SDPA would, not the math path's L × L weights.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of live storages per device type ("cpu", "cuda", "meta", …) and their peaks.

    A storage's Python object lives exactly as long as the storage (torch preserves it), so a
    finalizer on it says when its bytes are freed: the totals are exact after every operator,
    at a constant cost per storage."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self._storages: dict[int, tuple[int, str]] = {}

    def adopt(self, *tensors: torch.Tensor) -> None:
        """Count tensors made outside the mode (a module's weights moved before it started)."""
        for tensor in tensors:
            self._track(tensor)

    def reset_peak(self) -> None:
        self.peak = defaultdict(int, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
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
        if key in self._storages:  # counted and alive: a freed storage has left the map
            return
        size, device = storage.nbytes(), tensor.device.type
        self._storages[key] = (size, device)
        weakref.finalize(storage, self._freed, key).atexit = False
        self.live[device] += size
        self.peak[device] = max(self.peak[device], self.live[device])

    def _freed(self, key: int) -> None:
        size, device = self._storages.pop(key)
        self.live[device] -= size


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None


_aten = torch.ops.aten


class _MetaAccelerator(TorchDispatchMode):
    """What a data-less device cannot do itself: a copy to the host becomes an uninitialised host
    tensor of the same size (zeros below 1 MiB, so small values read back stay finite), a copy
    from the device into a host tensor leaves it as it is, and a scalar read off the device is
    neutral (True, 0 or 0.0: checks pass, every candidate ties)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            func is _aten._to_copy.default
            and args[0].device.type == "meta"
            and torch.device(kwargs.get("device") or "meta").type == "cpu"
        ):
            source = args[0]
            dtype = kwargs.get("dtype") or source.dtype
            small = source.numel() * dtype.itemsize < 2**20
            return (torch.zeros if small else torch.empty)(
                source.shape, dtype=dtype, device="cpu", pin_memory=bool(kwargs.get("pin_memory"))
            )
        if func is _aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type == "meta":
            return args[0]
        if func is _aten._local_scalar_dense.default and args[0].device.type == "meta":
            value = args[0]
            return True if value.dtype == torch.bool else 0.0 if value.is_floating_point() else 0
        return func(*args, **kwargs)


class _HostGenerator(torch.Generator):
    """A generator asked for on any device is made on the host (still a `torch.Generator`)."""

    def __new__(cls, device: Any = "cpu") -> _HostGenerator:
        return super().__new__(cls, "cpu")

    def __init__(self, device: Any = "cpu") -> None:
        pass


def _fused_attention(original: Any) -> Any:
    """`scaled_dot_product_attention` that, on the meta device, runs the memory-efficient kernel's
    meta function: the output and a log-sum-exp per row, never the L × L weights, as the flash or
    memory-efficient kernel a GPU picks for bf16 windows keeps; the meta device alone would take
    the math path. Grouped key/value heads are broadcast as views (no bytes); a boolean mask
    becomes the additive bias that kernel takes, as torch makes it on a GPU."""

    def attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if query.device.type != "meta":
            return original(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        if key.shape[-3] != query.shape[-3]:
            groups = query.shape[-3] // key.shape[-3]
            key, value = (
                t.unsqueeze(-3).expand(*t.shape[:-2], groups, *t.shape[-2:]).flatten(-4, -3) for t in (key, value)
            )
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
        bias = None if attn_mask is None else attn_mask.expand(*query.shape[:-2], query.shape[-2], key.shape[-2])
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return _aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale
        )[0]

    return attention


@contextmanager
def emulated_accelerator() -> Iterator[torch.device]:
    """The meta device as an accelerator without data: give the engine the device this yields and
    it runs its own code, every move and every lifetime as on a GPU, in shape only. Bases chosen
    this way are meaningless; sizes and lifetimes are the engine's. A random generator asked for
    on the device is the host's (the meta device has none)."""
    generator, attention = torch.Generator, torch.nn.functional.scaled_dot_product_attention
    torch.Generator = _HostGenerator  # type: ignore[misc]
    torch.nn.functional.scaled_dot_product_attention = _fused_attention(attention)
    try:
        with _MetaAccelerator():
            yield torch.device("meta")
    finally:
        torch.Generator = generator  # type: ignore[misc]
        torch.nn.functional.scaled_dot_product_attention = attention
