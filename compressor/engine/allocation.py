"""Width allocation: how many directions each site keeps, under one exact parameter budget.

`uniform` keeps the same width everywhere (SliceGPT's choice). `curves` measures, at every site
of the original (fused, unsliced) model, a loss curve: for each width it could keep, the
paper's predicted KL ½·Tr(UᵀCU·UᵀHU) of the best removed subspace among PCA's and the
τ-candidates (bottom eigenvectors of τC + H/τ). It then picks one width per site minimising
the summed predicted KL subject to the sliced model's exact parameter count (`budget`),
transitions k_s·k_t included. `solve` runs a dynamic program over the chain of sites that
keeps, for each width of the current site, the (parameters, loss) pairs no other pair beats
(one per 1/131072 of the budget); where those frontiers would grow too large (deep models, fine
width grids) it takes the exact optimum of loss + λ·parameters at the λ that fits and spends
what is left greedily. Parameters are counted exactly, so the budget is never exceeded; sites
that must keep one width (a shared basis) are one unknown, and a head tied to the embedding
ties the chain's two ends.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from compressor.models.budget import ParamModel
from compressor.strategies.contract import DEFAULT_TAUS, frobenius_normalised, tau_candidates

RESOLUTION = 1 << 17
"""Frontiers keep one point per 1/RESOLUTION of the budget: the best loss is found to within
about that many parameters (bounded time on deep models); the budget itself is never exceeded."""


def loss_curve(
    C: torch.Tensor,
    H: torch.Tensor,
    widths: Sequence[int],
    taus: Sequence[float] = DEFAULT_TAUS,
    pooled: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> list[float]:
    """Predicted KL ½·Tr(UᵀCU·UᵀHU) (per token, so comparable across sites) of keeping each of
    `widths`, U being the removed directions of the best candidate basis for that width. Made
    non-increasing in the width (keeping more never predicts more loss than keeping less).
    `pooled`: the (C, H) of later sites that keep the same basis; candidates then come from the
    sums (as the walk chooses a shared basis) and each member's loss is added."""
    members = [(C, H), *pooled]  # each in float64 only while it is read (a global layout pools every site)
    C_all = sum(c.to(torch.float64) for c, _ in members)
    H_all = sum(h.to(torch.float64) for _, h in members)
    d = C_all.shape[0]
    Cn, Hn = frobenius_normalised(C_all), frobenius_normalised(H_all)
    bases = tau_candidates(Cn, Hn, taus)  # the grid's, then PCA's
    best = torch.full((d + 1,), math.inf, dtype=torch.float64)
    for Q in bases:
        losses = torch.zeros(d + 1, dtype=torch.float64)  # index = kept width
        for c, h in ((c.to(torch.float64), h.to(torch.float64)) for c, h in members):
            product = (Q.T @ c @ Q) * (Q.T @ h @ Q)  # Tr(A_UB_U) = Σ A∘B over the removed block (B symmetric)
            tail = product.flip(0, 1).cumsum(0).cumsum(1).flip(0, 1)  # tail[k, k]: block of columns k..d-1
            losses[:d] += tail.diagonal()
        best = torch.minimum(best, 0.5 * losses)
    envelope = torch.cummin(best, 0).values  # non-increasing in the kept width
    return [float(envelope[k]) for k in widths]


@dataclass
class Choice:
    """One unknown of the allocation: consecutive sites that keep one width."""

    sites: list[str]
    widths: list[int]
    losses: list[float] = field(default_factory=list)


def groups_of(params: ParamModel, shared: Collection[str]) -> list[list[str]]:
    """Consecutive sites joined where a site reuses the previous site's basis."""
    groups: list[list[str]] = []
    for site in params.sites:
        if site in shared and groups:
            groups[-1].append(site)
        else:
            groups.append([site])
    return groups


def solve(
    params: ParamModel, choices: Sequence[Choice], budget: int, tie_ends: bool = False
) -> tuple[dict[str, int], str]:
    """The widths (one per choice, for all its sites) of least summed loss whose parameter count
    is at most `budget` (`tie_ends`: the first and last choices keep the same width), and the
    solver that found them: "exact" (the Pareto dynamic program, exact up to its cost buckets) or,
    where its frontiers would outgrow `WORK_LIMIT`, "lagrangian" (the exact optimum of loss + λ·parameters at the λ that
    fits, then the leftover budget spent greedily)."""
    solver = "exact"
    try:
        found = _over_ends(params, choices, budget, tie_ends, _solve_chain)
    except _TooLarge:
        found = None
    if found is None:  # too large, or (never seen) the buckets dropped every path that fits
        solver = "lagrangian"
        found = _over_ends(params, choices, budget, tie_ends, _lagrangian_chain)
    if found is None:
        raise ValueError(f"no allocation of the allowed widths fits {budget:,} parameters")
    return {site: width for choice, width in zip(choices, found[1]) for site in choice.sites}, solver


class _TooLarge(Exception):
    pass


WORK_LIMIT = 2_000_000
"""Frontier points the exact program may combine at one site before the Lagrangian solver takes over."""


def _over_ends(
    params: ParamModel, choices: Sequence[Choice], budget: int, tie_ends: bool, chain: Any
) -> tuple[float, list[int]] | None:
    if not tie_ends:
        return chain(params, choices, budget)
    found = None
    for width in choices[0].widths:
        ends = [_restrict(choices[0], width), *choices[1:-1], _restrict(choices[-1], width)]
        if not ends[-1].widths:
            continue
        candidate = chain(params, ends, budget)
        if candidate is not None and (found is None or candidate[0] < found[0]):
            found = candidate
    return found


def _costs(params: ParamModel, choices: Sequence[Choice]) -> tuple[list[int], list[int]]:
    """Each choice's parameters per unit of width, and how many k_s·k_t matrices join it to the
    next (a one-layer model's residual transition and tied-head map join the same two sites)."""
    transitions = set(params.transitions)
    for c in choices:
        if any(pair in transitions for pair in zip(c.sites, c.sites[1:])):
            raise ValueError(f"sites {', '.join(c.sites)} keep one width but have transitions between them")
    linear = [sum(params.linear[s] for s in c.sites) for c in choices]
    joined = [params.transitions.count((a.sites[-1], b.sites[0])) for a, b in zip(choices, choices[1:])]
    return linear, joined


def _fixed_pairs(params: ParamModel, choices: Sequence[Choice]) -> int:
    """Parameters of the transitions that do not join consecutive choices (a tied head's map from
    the last site to the embedding): the program fixes both ends' widths (`tie_ends`)."""
    owner = {site: g for g, c in enumerate(choices) for site in c.sites}
    total = 0
    for s, t in params.transitions:
        if abs(owner[s] - owner[t]) > 1:
            ends = (choices[owner[s]].widths, choices[owner[t]].widths)
            if len(ends[0]) != 1 or len(ends[1]) != 1:
                raise ValueError(f"the transition {s} → {t} joins sites that are not neighbours; fix both widths")
            total += ends[0][0] * ends[1][0]
    return total


def _lagrangian_chain(params: ParamModel, choices: Sequence[Choice], budget: int) -> tuple[float, list[int]] | None:
    linear, joined = _costs(params, choices)
    widths = [np.array(c.widths, dtype=np.float64) for c in choices]
    losses = [np.array(c.losses, dtype=np.float64) for c in choices]

    def best(lam: float) -> list[int]:
        """Indices minimising Σ loss + lam·parameters (Viterbi over the chain)."""
        value = losses[0] + lam * linear[0] * widths[0]
        back = []
        for g in range(1, len(choices)):
            total = value[:, None] + lam * joined[g - 1] * np.outer(widths[g - 1], widths[g])
            index = total.argmin(0)
            value = total[index, np.arange(len(widths[g]))] + losses[g] + lam * linear[g] * widths[g]
            back.append(index)
        path = [int(value.argmin())]
        for index in reversed(back):
            path.append(int(index[path[-1]]))
        return path[::-1]

    def count(path: list[int]) -> int:
        return params.count({s: c.widths[i] for c, i in zip(choices, path) for s in c.sites})

    low, high = 0.0, 1e-12
    while count(best(high)) > budget:
        high *= 4
        if high > 1e30:
            return None
    if count(best(low)) > budget:
        for _ in range(100):
            middle = (low + high) / 2
            low, high = (low, middle) if count(best(middle)) <= budget else (middle, high)
    path = best(high) if count(best(low)) > budget else best(low)
    spent = count(path)
    while True:  # spend what is left: widen the choice that buys the most loss per parameter
        options = []
        for g, c in enumerate(choices):
            if path[g] + 1 < len(c.widths):
                wider = path[:g] + [path[g] + 1] + path[g + 1 :]
                cost = count(wider)
                if cost <= budget:
                    options.append(((c.losses[path[g]] - c.losses[path[g] + 1]) / max(cost - spent, 1), wider, cost))
        if not options:
            break
        _, path, spent = max(options, key=lambda o: o[0])
    return sum(c.losses[i] for c, i in zip(choices, path)), [c.widths[i] for c, i in zip(choices, path)]


def _restrict(choice: Choice, width: int) -> Choice:
    keep = [i for i, w in enumerate(choice.widths) if w == width]
    return Choice(choice.sites, [choice.widths[i] for i in keep], [choice.losses[i] for i in keep])


def _solve_chain(params: ParamModel, choices: Sequence[Choice], budget: int) -> tuple[float, list[int]] | None:
    resolution = budget // RESOLUTION
    linear, joined = _costs(params, choices)
    # the least any later choices can cost, to drop points that cannot fit
    floor = [0] * (len(choices) + 1)
    for g in range(len(choices) - 1, -1, -1):
        low = min(c for c in choices[g].widths)
        nxt = min(choices[g + 1].widths) if g + 1 < len(choices) else 0
        floor[g] = floor[g + 1] + linear[g] * low + (joined[g] * low * nxt if g + 1 < len(choices) else 0)
    # frontier[k] = (costs, losses, parent widths, parent indices), costs ascending, losses descending
    frontiers: list[dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = []
    first = choices[0]
    front = {}
    fixed = _fixed_pairs(params, choices)
    for w, loss in zip(first.widths, first.losses):
        cost = params.constant + fixed + linear[0] * w
        if cost + floor[1] <= budget:
            front[w] = (np.array([cost], np.int64), np.array([loss]), np.array([-1]), np.array([-1]))
    frontiers.append(front)
    for g in range(1, len(choices)):
        previous, front = frontiers[-1], {}
        if sum(len(v[0]) for v in previous.values()) * len(choices[g].widths) > WORK_LIMIT:
            raise _TooLarge
        for w, loss in zip(choices[g].widths, choices[g].losses):
            parts = []
            for pw, (costs, losses, _, _) in previous.items():
                add = linear[g] * w + joined[g - 1] * pw * w
                parts.append((costs + add, losses + loss, np.full(len(costs), pw), np.arange(len(costs))))
            if not parts:
                continue
            costs, losses, pws, pis = (np.concatenate(x) for x in zip(*parts))
            fits = costs + floor[g + 1] <= budget
            costs, losses, pws, pis = costs[fits], losses[fits], pws[fits], pis[fits]
            if not len(costs):
                continue
            order = np.lexsort((losses, costs))
            costs, losses, pws, pis = costs[order], losses[order], pws[order], pis[order]
            running = np.minimum.accumulate(losses)
            keep = np.ones(len(costs), bool)
            keep[1:] = losses[1:] < running[:-1]  # strictly better than every cheaper point
            costs, losses, pws, pis = costs[keep], losses[keep], pws[keep], pis[keep]
            if resolution > 1:  # each cost bucket keeps its cheapest point and its lowest loss (its last)
                buckets = costs // resolution
                edge = buckets[1:] != buckets[:-1]
                ends = np.append(True, edge) | np.append(edge, True)
                costs, losses, pws, pis = costs[ends], losses[ends], pws[ends], pis[ends]
            front[w] = (costs, losses, pws, pis)
        frontiers.append(front)
    last = frontiers[-1]
    if not last:
        return None
    best_w, best_i = min(((w, int(np.argmin(v[1]))) for w, v in last.items()), key=lambda x: last[x[0]][1][x[1]])
    total = float(last[best_w][1][best_i])
    widths = [best_w]
    w, i = best_w, best_i
    for g in range(len(choices) - 1, 0, -1):
        _, _, pws, pis = frontiers[g][w]
        w, i = int(pws[i]), int(pis[i])
        widths.append(w)
    return total, widths[::-1]


class CurveAllocator:
    """Collects each site's loss curve as the engine surveys the original model, then solves.
    Sites that keep one basis (`shared`) have one curve: the summed loss of the basis chosen
    from their pooled statistics."""

    requires = ("C", "H")

    def __init__(
        self,
        params: ParamModel,
        budget: int,
        choices: Mapping[str, Sequence[int]],
        shared: Collection[str] = (),
        tie_ends: bool = False,
        taus: Sequence[float] = DEFAULT_TAUS,
    ) -> None:
        self.params, self.budget, self.tie_ends, self.taus = params, budget, tie_ends, tuple(taus)
        self.groups = groups_of(params, shared)
        self.choices = {tuple(g): sorted(set.intersection(*(set(choices[s]) for s in g))) for g in self.groups}
        self.curves: dict[tuple[str, ...], list[float]] = {}
        self.solver = ""
        self._group = {site: tuple(g) for g in self.groups for site in g}
        self._waiting: dict[tuple[str, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def observe(self, site: str, C: torch.Tensor, H: torch.Tensor | None) -> None:
        if H is None:
            raise ValueError("allocation by loss curves needs H")
        group = self._group[site]
        members = self._waiting.setdefault(group, [])
        members.append((C, H))
        if site == group[-1]:
            (C0, H0), *rest = self._waiting.pop(group)
            self.curves[group] = loss_curve(C0, H0, self.choices[group], self.taus, rest)

    def widths(self) -> dict[str, int]:
        widths, self.solver = solve(self.params, self.choices_by_group(), self.budget, self.tie_ends)
        return widths

    def choices_by_group(self) -> list[Choice]:
        return [Choice(list(g), self.choices[g], self.curves[g]) for g in self.choices]

    def predicted(self, widths: Mapping[str, int]) -> float:
        """The summed predicted KL of `widths`."""
        return sum(curve[self.choices[g].index(widths[g[0]])] for g, curve in self.curves.items())

    def to_json(self, widths: Mapping[str, int]) -> dict[str, Any]:
        return {
            "method": "curves",
            "solver": self.solver,
            "budget": self.budget,
            "params": self.params.count(widths),
            "predicted_kl": self.predicted(widths),
            "curves": {"+".join(g): dict(zip(map(str, self.choices[g]), curve)) for g, curve in self.curves.items()},
        }
