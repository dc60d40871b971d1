"""The error of giving one attention layer fewer KV heads, and its output projection's refit:
the per-layer KV-head option of the heterogeneous layout's allocation (`engine.mlp_widths`).

While the width curves' pass runs a layer (`engine.neurons.mlp_width_curves`), each KV-head count
`k` the layer may keep runs too: a copy of the attention with its KV heads merged
(`models.kv_heads`) reads the same input, and the output projection's inputs z (every head's
output as it was) and z' (with the merged heads) are measured together. The refit is the damped
least-squares map from z' to what the attention wrote, W' = (W·E[z z'ᵀ] + δW)(E[z' z'ᵀ] + δI)⁻¹
(δ the damping times the mean of diag E[z' z'ᵀ]; keeping every KV head gives W' = W), and the
error is where the attention writes, Tr[G·E[(Wz − W'z')(Wz − W'z')ᵀ]] with G = H there: the unit
of every other option of the allocation, half the predicted KL.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from compressor.engine.calibration import counted_rows
from compressor.engine.parallel import Ranks
from compressor.models.families import ModelFamily
from compressor.models.kv_heads import merge_kv_heads


@dataclass(frozen=True)
class KvMerge:
    """One layer at `kv` KV heads: the predicted error, and the refitted output projection."""

    kv: int
    error: float
    output: torch.Tensor
    """W' (d × heads·head_dim, in the output projection's dtype, on the host until the allocation)."""


class KvMeasure:
    """Hooks on one attention layer that, while the layer runs on the calibration batches, run a
    merged copy per KV-head count on the same input and gather the refit's moments."""

    def __init__(
        self, attention: nn.Module, family: ModelFamily, config: PretrainedConfig, counts: Sequence[int]
    ) -> None:
        self.output = attention.get_submodule(family.attn_output)
        width = self.output.in_features
        device = self.output.weight.device
        self.copies: dict[int, nn.Module] = {}
        for kv in counts:
            merged = copy.deepcopy(attention)
            merge_kv_heads(merged, config, kv)
            self.copies[kv] = merged
        self.own = torch.zeros(width, width, dtype=torch.float64, device=device)
        self.cross = {kv: torch.zeros_like(self.own) for kv in counts}
        self.merged = {kv: torch.zeros_like(self.own) for kv in counts}
        self.tokens = 0
        self._rows: dict[str, Any] = {}
        self._handles = [
            self.output.register_forward_pre_hook(self._record("own")),
            attention.register_forward_hook(self._run_copies, with_kwargs=True),
        ]
        for kv, merged in self.copies.items():
            self._handles.append(merged.get_submodule(family.attn_output).register_forward_pre_hook(self._record(kv)))

    def batch(self, mask: torch.Tensor, count: int) -> None:
        """The counted tokens of the batch the layer runs on next."""
        self._rows["mask"], self._rows["count"] = mask, count

    def _record(self, key: Any) -> Any:
        def hook(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self._rows[key] = counted_rows(args[0], self._rows["mask"], self._rows["count"]).to(torch.float64)

        return hook

    def _run_copies(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        z = self._rows.pop("own")
        self.own.addmm_(z.T, z)
        self.tokens += z.shape[0]
        for kv, merged in self.copies.items():
            merged(*args, **kwargs)
            z_merged = self._rows.pop(kv)
            self.cross[kv].addmm_(z.T, z_merged)
            self.merged[kv].addmm_(z_merged.T, z_merged)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.copies.clear()

    def results(self, G: torch.Tensor | None, damping: float, ranks: Ranks) -> list[KvMerge]:
        """Each count's refit and predicted error (G None: the identity), from the moments summed
        over ranks (once the layer's pass is over and the hooks `close`d)."""
        tokens = ranks.sum_count(self.tokens, self.own.device)
        W = self.output.weight.detach().to(torch.float64)
        own = ranks.sum_(self.own) / tokens
        G = None if G is None else G.to(W.device, torch.float64)
        found = []
        for kv in self.cross:
            cross, merged = ranks.sum_(self.cross[kv]) / tokens, ranks.sum_(self.merged[kv]) / tokens
            refitted = refit_output(W, cross, merged, damping)
            error = W @ own @ W.T - W @ cross @ refitted.T
            error = error - refitted @ cross.T @ W.T + refitted @ merged @ refitted.T
            value = float(torch.trace(error) if G is None else (G * error).sum())
            found.append(KvMerge(kv, value, refitted.to(self.output.weight.dtype).cpu()))
        return found


def refit_output(W: torch.Tensor, cross: torch.Tensor, merged: torch.Tensor, damping: float) -> torch.Tensor:
    """W' = (W·X + δW)(M + δI)⁻¹ with X = E[z z'ᵀ] and M = E[z' z'ᵀ], δ = `damping` times the
    mean of diag M: the damped least-squares map from z' to W z, ridged towards W itself."""
    delta = damping * float(merged.diagonal().mean())
    damped = merged.clone()
    damped.diagonal().add_(delta)
    return torch.linalg.solve(damped, (W @ cross + delta * W).T).T
