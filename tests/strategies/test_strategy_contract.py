"""A strategy that returns a bad basis stops the run in one line naming it, before any weight
changes: a wrong shape or dtype, NaN (which no tolerance test catches: NaN > tol is false), or
a basis that is not orthogonal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.errors import UserError
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor.strategies.contract import Basis, SiteProblem, Strategy
from tests.conftest import copy_model, random_batches, tiny_model, widths_for


def _strategy(make: Callable[[int], torch.Tensor]) -> Strategy:
    class Broken(Strategy):
        name = "broken"

        def select(self, problem: SiteProblem, incoming: Basis | None, options: Any) -> Basis:
            return Basis(make(problem.width))

    return Broken()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: torch.full((d, d), float("nan"), dtype=torch.float64), "a basis holding NaN or Inf"),
        (lambda d: torch.eye(d, dtype=torch.float32), "a \\(64, 64\\) torch.float32 basis; expected"),
        (lambda d: 2 * torch.eye(d, dtype=torch.float64), "a non-orthogonal basis"),
    ],
)
def test_a_bad_basis_stops_the_walk_naming_the_strategy(make: Callable[[int], torch.Tensor], message: str) -> None:
    model, family = tiny_model("llama"), family_for("llama")
    widths = widths_for("llama", model.config, kept_width(model.config.hidden_size, 0.25, 8), False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError, match=f"strategy 'broken' returned {message}.*at site embedding: a bug"):
        prune(
            copy_model(model),
            fixed_layout(model.config, family, widths),
            random_batches(128),
            [PipelineStep(_strategy(make))],
        )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
