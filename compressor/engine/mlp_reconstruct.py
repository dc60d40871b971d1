"""A pruned MLP's kept weights trained to reproduce what it should write (`mlp.reconstruct`).

The least-squares refit (`engine.refit`) can only move the down projection: the input rows of the
kept neurons sit before the nonlinearity. Here every weight the MLP kept (its input rows and its
output projection, starting from the refit) is trained with Adam on the same target as the refit,
t = y + α e per calibration token (y what the unpruned MLP wrote, e the error feedback), weighed by
G (H where the MLP writes: the loss is then the second-order estimate of the KL it adds). The loss
stays local to one MLP on its own calibration inputs, so no model output or other layer is
involved; it is the refit's problem, solved over more weights, not distillation.
A share of the tokens is held out: every `check_every` steps the weighed error there is measured,
and the best weights seen are kept, the refit's among them, so held-out error never rises.
Each parameter's step size is `lr` times its root mean square, so one setting suits models whose
weights differ in scale (a parameter of zeros, e.g. a bias, takes `lr` itself). Weights are scored
as they will be written back (rounded to the model's dtype), so the kept ones are what the check
saw. Deterministic on one device (seeded by the layer index); data-parallel ranks average their
gradients and sum their held-out errors, so all keep the same weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from compressor.engine.calibration import counted_rows
from compressor.engine.parallel import Ranks

CHECK_EVERY = 25
"""Steps between two measurements of the held-out error."""
CHUNK_ROWS = 4096
"""Held-out tokens measured at once (the memory plan counts a chunk's pass)."""


@dataclass(frozen=True)
class ReconstructSettings:
    """The recipe's `mlp.reconstruct`, as the engine reads it."""

    steps: int
    lr: float
    batch_tokens: int
    heldout: float
    check_every: int = CHECK_EVERY


@dataclass
class ReconstructionRecord:
    """One MLP's reconstruction, for the report: the weighed relative error on its held-out tokens,
    E[(y' − t)ᵀG(y' − t)] / E[tᵀGt], with the refit's weights (`heldout_before`) and with those kept
    (`heldout_after`; `best_step` 0: the refit's)."""

    steps: int
    best_step: int
    heldout_before: float
    heldout_after: float
    tokens: int
    heldout_tokens: int
    weighed_by_h: bool


class TokenPairs:
    """Per counted calibration token, the MLP's input x and its target t (float32, on the host):
    what the MLP wrote on the pruned stream before pruning, plus α times the layer's error against
    the reference stream (`add_error`, the same e the refit's feedback takes back)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        """The MLP whose calls are recorded (its forward maps x to what it writes)."""
        self.inputs: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []

    def add(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, count: int) -> None:
        self.inputs.append(counted_rows(x.reshape(*mask.shape, x.shape[-1]), mask, count).float().cpu())
        self.targets.append(counted_rows(y.reshape(*mask.shape, y.shape[-1]), mask, count).float().cpu())

    def add_error(self, batch: int, error: torch.Tensor, mask: torch.Tensor, count: int, feedback: float) -> None:
        self.targets[batch] += feedback * counted_rows(error, mask, count).float().cpu()

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's x and t, concatenated; the per-batch rows are let go (the memory plan counts
        both at the peak of the concatenation)."""
        x, t = torch.cat(self.inputs), torch.cat(self.targets)
        self.inputs, self.targets = [], []
        return x, t


def _weighed_error(
    mlp: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor, L: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ‖(y' − t)L‖² and Σ‖tL‖² over the rows (G = L Lᵀ)."""
    y = functional_call(mlp, params, (x.to(next(iter(params.values())).dtype),))
    y = y[0] if isinstance(y, tuple) else y
    return (((y - t) @ L) ** 2).sum(), ((t @ L) ** 2).sum()


def weighing_factor(G: torch.Tensor | None, d: int, device: torch.device) -> torch.Tensor:
    """L (float32, on `device`) with L Lᵀ = G: V·√λ from G's eigendecomposition in float64, negative
    eigenvalues (round-off of an estimated H) set to 0, so a G that is singular or slightly
    indefinite weighs as well as it can instead of failing; the identity for G None."""
    if G is None:
        return torch.eye(d, device=device)
    values, vectors = torch.linalg.eigh(G.detach().to(device, torch.float64))
    return (vectors * values.clamp_min(0).sqrt()).float()


def _as_saved(params: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """The weights as they will be written back (rounded to each parameter's dtype), in float32."""
    return {name: p.detach().to(dtypes[name]).float() for name, p in params.items()}


def _heldout_error(
    mlp: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor, L: torch.Tensor, ranks: Ranks
) -> float:
    """The weighed relative error on the held-out rows, summed over the ranks, in chunks."""
    sums = torch.zeros(2, dtype=torch.float64, device=L.device)
    with torch.no_grad():
        for start in range(0, len(x), CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            error, energy = _weighed_error(mlp, params, x[rows].to(L.device), t[rows].to(L.device), L)
            sums += torch.stack([error, energy]).double()
    ranks.sum_(sums)
    return float(sums[0] / sums[1]) if sums[1] > 0 else 0.0


def reconstruct_mlp(
    pairs: TokenPairs,
    G: torch.Tensor | None,
    settings: ReconstructSettings,
    seed: int,
    device: torch.device,
    ranks: Ranks | None = None,
) -> ReconstructionRecord:
    """Train every parameter of `pairs.module` (already pruned and refitted) on `pairs`, in float32,
    and set it to the weights of lowest held-out error (see the module docstring)."""
    ranks, mlp = ranks or Ranks.current(), pairs.module
    x, t = pairs.tensors()
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=generator)
    held = max(1, int(len(x) * settings.heldout))
    fit, check = order[held:], order[:held]
    L = weighing_factor(G, t.shape[1], device)
    dtypes = {name: p.dtype for name, p in mlp.named_parameters()}
    params = {
        name: p.detach().to(device, torch.float32).clone().requires_grad_(True) for name, p in mlp.named_parameters()
    }
    groups = [
        {"params": [p], "lr": settings.lr * float(p.detach().pow(2).mean().sqrt()) or settings.lr}
        for p in params.values()
    ]
    x_check, t_check = x[check], t[check]
    kept = _as_saved(params, dtypes)
    start = best = _heldout_error(mlp, kept, x_check, t_check, L, ranks)
    best_step = 0
    with torch.enable_grad():
        optimizer = torch.optim.Adam(groups)
        for step in range(1, settings.steps + 1):
            rows = fit[torch.randint(0, len(fit), (min(settings.batch_tokens, len(fit)),), generator=generator)]
            error, energy = _weighed_error(mlp, params, x[rows].to(device), t[rows].to(device), L)
            optimizer.zero_grad()
            (error / energy.clamp_min(1e-30)).backward()
            if ranks.world > 1:
                for p in params.values():
                    ranks.sum_(p.grad).div_(ranks.world)
            optimizer.step()
            if step % settings.check_every == 0 or step == settings.steps:  # scored as they would be saved
                saved = _as_saved(params, dtypes)
                now = _heldout_error(mlp, saved, x_check, t_check, L, ranks)
                if now < best:
                    best, best_step, kept = now, step, saved
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            p.copy_(kept[name].to(p.device, p.dtype))
    return ReconstructionRecord(
        steps=settings.steps,
        best_step=best_step,
        heldout_before=start,
        heldout_after=best,
        tokens=ranks.sum_count(len(fit), device),
        heldout_tokens=ranks.sum_count(held, device),
        weighed_by_h=G is not None,
    )
