"""A measured search over per-layer MLP widths, from the predicted allocation (`engine.mlp_widths`).

The allocation adds each layer's predicted error, which is not a safe guide when many layers are
pruned at once (EvoPress, Sieberling et al. 2025: errors interact). The search starts from that
allocation and measures instead: a (1 + λ) evolution whose offspring move whole grid steps from
one layer's MLP to another's (the total stays the same), each offspring's model assembled from the
solutions the width curves already chose and refitted at every width on the unpruned model (no
selector runs again), and its KL to the original measured on held-out windows; an offspring
better than its parent replaces it. Deterministic given the seed; nothing here knows a strategy
or a model family beyond `mlp_linears`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from compressor.engine.refit import drop_neurons


@dataclass(frozen=True)
class WidthSolution:
    """One layer's MLP at one width, as the curves chose it: the kept neurons and the down
    projection that reads them (d × m, refitted; m = 0: the FFN removed)."""

    kept: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True)
class SearchResult:
    """The widths the search ended on, its start's and its end's measured KL, and how many
    allocations it measured (the start among them)."""

    widths: list[int]
    start_kl: float
    kl: float
    measured: int
    accepted: int


def mutate(widths: Sequence[int], grids: Sequence[Sequence[int]], rng: random.Random, moves: int) -> list[int]:
    """`widths` with `moves` budget-keeping moves: one layer one step up its grid and another one
    step down (every grid has the same step, so the total stays); a move with nowhere to go is skipped."""
    out = list(widths)
    for _ in range(moves):
        up = [i for i, w in enumerate(out) if w + _step(grids[i]) in grids[i]]
        down = [i for i, w in enumerate(out) if w - _step(grids[i]) in grids[i]]
        pairs = [(i, j) for i in up for j in down if i != j]
        if not pairs:
            break
        i, j = rng.choice(pairs)
        out[i] += _step(grids[i])
        out[j] -= _step(grids[j])
    return out


def _step(grid: Sequence[int]) -> int:
    return grid[1] - grid[0] if len(grid) > 1 else 0


@dataclass(frozen=True)
class SearchSettings:
    """How long and how widely `evolve` searches, in one object beside what it searches over."""

    evaluations: int
    """The measurements of the fitness the search may make (the start is the first)."""
    offspring: int = 4
    """λ: the offspring each generation draws from the parent."""
    max_moves: int = 3
    """Each offspring takes 1 to this many budget-keeping moves (`mutate`) from the parent."""
    seed: int = 0


def evolve(
    start: Sequence[int],
    grids: Sequence[Sequence[int]],
    fitness: Callable[[list[int]], float],
    settings: SearchSettings,
    progress: Callable[[int, int], None] | None = None,
) -> SearchResult:
    """(1 + `settings.offspring`) evolution from `start` under `settings.evaluations` measurements
    of `fitness` (lower is better; the start is the first): each generation's offspring take 1 to
    `settings.max_moves` moves (`mutate`) from the parent, and the best of them replaces it where it
    measured lower. An allocation is measured once; a generation whose offspring were all measured
    before draws again."""
    evaluations, offspring, max_moves = settings.evaluations, settings.offspring, settings.max_moves
    steps = {_step(grid) for grid in grids if len(grid) > 1}
    if len(steps) > 1:
        raise ValueError(f"the layers' grids have different steps {sorted(steps)}; a move would change the total")
    rng = random.Random(settings.seed)
    seen: dict[tuple[int, ...], float] = {}

    def measure(widths: list[int]) -> float:
        key = tuple(widths)
        if key not in seen:
            seen[key] = fitness(widths)
            if progress:
                progress(len(seen), evaluations)
        return seen[key]

    parent = list(start)
    start_kl = best = measure(parent)
    accepted, stale = 0, 0
    while len(seen) < evaluations and stale < 8:
        children = []
        for _ in range(min(offspring, evaluations - len(seen))):
            child = mutate(parent, grids, rng, rng.randint(1, max_moves))
            if tuple(child) not in seen:
                children.append(child)
        stale = 0 if children else stale + 1
        scored = [(measure(child), child) for child in children]
        if scored:
            kl, child = min(scored, key=lambda pair: pair[0])
            if kl < best:
                parent, best, accepted = child, kl, accepted + 1
    return SearchResult(parent, start_kl, best, len(seen), accepted)


@contextmanager
def assembled(
    mlps: Sequence[tuple[list[nn.Linear], nn.Linear]],
    solutions: Sequence[Mapping[int, WidthSolution]],
    widths: Sequence[int],
) -> Iterator[None]:
    """Every layer's MLP (`mlps[i]`: its input linears and output one, as `mlp_linears` gives them)
    at `widths[i]` from its `solutions` while the block runs, then as it was (a layer at its full
    width, or a width without a solution, stays as it is)."""
    saved: list[tuple[nn.Linear, nn.Parameter, nn.Parameter | None, int, int]] = []
    try:
        for (inputs, output), options, width in zip(mlps, solutions, widths, strict=True):
            solution = options.get(width)
            if solution is None or width == output.in_features:
                continue
            for linear in (*inputs, output):
                saved.append((linear, linear.weight, linear.bias, linear.in_features, linear.out_features))
            drop_neurons(inputs, output, solution.kept, solution.down)
        yield
    finally:
        for linear, weight, bias, in_features, out_features in reversed(saved):
            linear.weight, linear.bias = weight, bias
            linear.in_features, linear.out_features = in_features, out_features
