"""The built-in head selectors on constructed problems."""

from __future__ import annotations

import torch

from compressor.strategies.head_contract import HeadProblem
from compressor.strategies.registry import PluginRegistry

REGISTRY = PluginRegistry()


def _problem(Z: torch.Tensor, W: torch.Tensor, heads: int, groups: int, keep: int, G=None) -> HeadProblem:
    C = Z.T @ Z / Z.shape[0]
    width = Z.shape[1] // heads
    norms = Z.unflatten(-1, (heads, width)).norm(dim=-1).mean(0)
    return HeadProblem(
        layer=0, keep=keep, heads=heads, groups=groups, head_dim=width, C=C, activation=norms, down=W,
        damping=1e-6, G=G,
    )  # fmt: skip


def test_norm_keeps_the_loudest_heads_of_every_group():
    generator = torch.Generator().manual_seed(0)
    scales = torch.tensor([1.0, 5.0, 2.0, 0.5, 3.0, 4.0]).repeat_interleave(4)
    Z = torch.randn(400, 24, generator=generator, dtype=torch.float64) * scales
    problem = _problem(Z, torch.randn(8, 24, generator=generator, dtype=torch.float64), 6, 2, 4)
    kept = REGISTRY.head_selector("norm").select(problem).kept
    assert kept.tolist() == [1, 2, 4, 5]  # group 0: heads 1, 2 of 0-2; group 1: heads 4, 5 of 3-5


def test_obs_drops_the_head_whose_output_the_others_can_write():
    """Heads 0 and 1 write the same thing (head 1's output is 3× head 0's): the refit writes either
    from the other at no cost, so obs drops one of them; norm keeps both and drops head 2."""
    generator = torch.Generator().manual_seed(1)
    Z = torch.randn(500, 12, generator=generator, dtype=torch.float64)
    Z[:, 4:8] = 3 * Z[:, 0:4]
    Z[:, 8:12] *= 0.8
    W = torch.randn(6, 12, generator=generator, dtype=torch.float64)
    problem = _problem(Z, W, heads=3, groups=1, keep=2)
    chosen = REGISTRY.head_selector("obs").select(problem)
    assert chosen.kept.tolist() in ([0, 2], [1, 2])
    assert chosen.objectives["predicted_loss"] < 1e-3
    assert REGISTRY.head_selector("norm").select(problem).kept.tolist() == [0, 1]


def test_obs_weighs_the_heads_by_the_output_sensitivity():
    """Two independent heads writing to different coordinates: without H the quieter goes; with H
    that cares only for the quieter one's coordinate, the louder goes."""
    generator = torch.Generator().manual_seed(2)
    Z = torch.randn(500, 4, generator=generator, dtype=torch.float64) * torch.tensor([2.0, 2.0, 1.0, 1.0])
    W = torch.zeros(2, 4, dtype=torch.float64)
    W[0, :2], W[1, 2:] = 1.0, 1.0
    plain = _problem(Z, W, heads=2, groups=1, keep=1)
    assert REGISTRY.head_selector("obs").select(plain).kept.tolist() == [0]
    weighed = _problem(Z, W, heads=2, groups=1, keep=1, G=torch.diag(torch.tensor([0.01, 1.0], dtype=torch.float64)))
    assert REGISTRY.head_selector("obs").select(weighed).kept.tolist() == [1]


def test_obs_keeps_as_many_heads_in_every_group():
    generator = torch.Generator().manual_seed(3)
    scales = torch.tensor([0.1, 0.2, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).repeat_interleave(2)  # group 0 is quiet
    Z = torch.randn(300, 16, generator=generator, dtype=torch.float64) * scales
    problem = _problem(Z, torch.randn(5, 16, generator=generator, dtype=torch.float64), 8, 2, 4)
    kept = REGISTRY.head_selector("obs").select(problem).kept
    assert torch.bincount(kept // 4, minlength=2).tolist() == [2, 2]
