"""Built-in Mixture-of-Experts expert selectors (issue 48): which of a layer's routed experts stay.

- `frequency`: the experts the calibration tokens were routed to most often.
- `reap` (Lasby et al., 2026): the largest mean over an expert's routed tokens of its routing
  weight times the norm of its output, what the expert adds to the stream when it is chosen.
- `output` (output-aware, the paper's idea applied to experts; interventional, as Model-Optimizer's
  Puzzletron hook): removes experts greedily, each time the one whose removal changes the block's
  output least, with every sampled token re-picking its top-k among the experts left (weights as
  the family's router gives them) and the change δ priced as E[δᵀ H δ], H the output sensitivity of
  the stream the block writes to (the identity when the run has none: the squared output change).

Every selector keeps the problem's protected experts (super experts) first.
"""

from __future__ import annotations

import torch

from compressor.plugin import ExpertChoice, ExpertProblem, ExpertSelector, hookimpl, keep_highest, routing_weights

CHUNK_ELEMENTS = 1 << 24
"""`output` prices this many (candidate, token, expert) weights at a time."""


class Frequency(ExpertSelector):
    name = "frequency"
    description = "keep the experts the calibration tokens were routed to most often"

    def select(self, problem: ExpertProblem) -> ExpertChoice:
        return ExpertChoice(keep_highest(problem.tokens.to(torch.float64), problem))


class Reap(ExpertSelector):
    name = "reap"
    description = "REAP: keep the largest mean over routed tokens of routing weight × ‖expert output‖"

    def select(self, problem: ExpertProblem) -> ExpertChoice:
        return ExpertChoice(keep_highest(problem.reap, problem))


class OutputAware(ExpertSelector):
    name = "output"
    description = "output-aware: greedy removal by E[δᵀHδ], δ the block's output change with top-k re-picked"
    requires = ("outputs",)

    def select(self, problem: ExpertProblem) -> ExpertChoice:
        assert problem.probabilities is not None and problem.gram is not None
        P, gram = problem.probabilities, problem.gram
        E = problem.experts
        removed = torch.zeros(E, dtype=torch.bool, device=P.device)
        protected = problem.protected.to(P.device)
        original = routing_weights(P, removed[None], problem.top_k, problem.normalise)[0]  # T × E
        energy = float(torch.einsum("te,tef,tf->", original, gram, original)) / len(P)
        cost = 0.0
        for _ in range(E - problem.keep):
            candidates = torch.nonzero(~removed & ~protected).flatten()
            trial = removed[None].repeat(len(candidates), 1)
            trial[torch.arange(len(candidates)), candidates] = True
            costs = _costs(P, gram, trial, original, problem)
            best = int(torch.argmin(costs))
            removed[candidates[best]] = True
            cost = float(costs[best])
        kept = torch.nonzero(~removed).flatten()
        return ExpertChoice(
            kept,
            {
                "output_change": cost,
                "relative_output_change": cost / energy if energy > 0 else 0.0,
                "sensitivity": "H" if problem.weighed_by_h else "none",
            },
        )


def _costs(
    P: torch.Tensor, gram: torch.Tensor, trial: torch.Tensor, original: torch.Tensor, problem: ExpertProblem
) -> torch.Tensor:
    """E_t[δᵀ G δ] for each trial removal set (rows of `trial`), in chunks of candidates."""
    per_chunk = max(1, CHUNK_ELEMENTS // (P.numel()))
    out = []
    for start in range(0, len(trial), per_chunk):
        delta = routing_weights(P, trial[start : start + per_chunk], problem.top_k, problem.normalise) - original
        out.append(torch.einsum("cte,tef,ctf->c", delta, gram, delta) / len(P))
    return torch.cat(out)


@hookimpl
def compressor_selectors() -> list[ExpertSelector]:
    return [Frequency(), Reap(), OutputAware()]
