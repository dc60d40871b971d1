"""Data-parallel calibration: which calibration batches are this process's, and sums over processes.

Under `torchrun` (or any `torch.distributed` process group) every rank runs the same walk on its
own share of the calibration batches; each site's statistics (C and H, as sums with their token
counts) are summed over the ranks before a basis is chosen, so every rank chooses the same basis.
With no process group there is one rank and nothing is communicated.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from compressor.errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the data-parallel group."""

    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> Ranks:
        """The initialised default process group, or a single rank."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def mine(self, count: int) -> list[int]:
        """The indices of this rank's batches among `count`: every world-th, from its rank (so
        the shares differ by at most one batch)."""
        return list(range(self.rank, count, self.world))

    def share(self, batches: Sequence[T]) -> list[T]:
        """This rank's batches (`mine`); refused when a rank of several would have none."""
        mine = [batches[i] for i in self.mine(len(batches))]
        if self.world > 1 and not mine:
            raise UserError(
                f"{len(batches)} calibration batches cannot be shared by {self.world} processes: "
                f"give at least one batch per process"
            )
        return mine

    def skipped_rows(self, rows: list[int]) -> list[list[int]]:
        """For each of this rank's batches (`mine`), the rows of the other ranks' batches just
        before it, given every batch's rows: the label draws this rank skips."""
        mine = self.mine(len(rows))
        return [rows[before + 1 : index] for before, index in zip([-1, *mine], mine)]

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks, in place (the backend's device: NCCL needs it on the
        GPU, gloo takes host tensors too)."""
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s elementwise maximum over the ranks, in place."""
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def sum_count(self, count: int, device: torch.device) -> int:
        """An integer (a token count) summed over the ranks."""
        if self.world == 1:
            return count
        return int(self.sum_(torch.tensor([count], dtype=torch.int64, device=device)).item())

    def gather_counts(self, count: int, device: torch.device) -> list[int]:
        """Each rank's `count`, in rank order (for the report)."""
        if self.world == 1:
            return [count]
        out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world)]
        dist.all_gather(out, torch.tensor([count], dtype=torch.int64, device=device))
        return [int(t.item()) for t in out]

    def agree(self, values: torch.Tensor) -> bool:
        """Whether every rank holds the same integer `values` (a checksum compared by all-reduce): a
        choice each rank makes alone from summed statistics must be the same choice everywhere."""
        if self.world == 1:
            return True
        weights = torch.arange(1, values.numel() + 1, dtype=torch.float64, device=values.device)
        total = (values.to(torch.float64).flatten() * weights).sum()
        checksum = torch.stack([total, -total])  # the max of both: the largest and minus the smallest
        dist.all_reduce(checksum, op=dist.ReduceOp.MAX)
        return bool(checksum[0] == -checksum[1])

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def start(device: torch.device) -> tuple[Ranks, torch.device]:
    """Join the process group that `torchrun` describes (WORLD_SIZE above 1 in the environment):
    NCCL with one GPU per local rank, gloo on CPU. Outside torchrun: one rank, `device` unchanged."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available():
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Ranks.current(), device


def stop() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
