"""Checks of the rerank strategy on a made-up site: no model, no data, a fraction of a second."""

import pytest
import torch
from compressor_rerank import Rerank

from compressor.plugin import SiteProblem, SiteStatistics, StrategyOptionError


def problem(width: int = 16, keep: int = 12) -> SiteProblem:
    torch.manual_seed(0)
    x, g = torch.randn(1000, width, dtype=torch.float64), torch.randn(1000, width, dtype=torch.float64)
    C = x.T @ x / 1000  # E[x xᵀ], as the engine gives it
    H = (g * torch.linspace(0.1, 3, width, dtype=torch.float64)).T @ g / 1000  # some E[g gᵀ]
    return SiteProblem(
        name="layers.0.attn", index=1, width=width, keep=keep, stats=SiteStatistics(C=C, tokens=1000, extra={"H": H})
    )


def test_basis_is_what_the_engine_accepts_and_no_worse_than_pca() -> None:
    strategy, site = Rerank(), problem()
    basis = strategy.select(site, None, strategy.parse_options({}))
    assert basis.Q.dtype == torch.float64 and basis.Q.shape == (16, 16)
    assert torch.allclose(basis.Q.T @ basis.Q, torch.eye(16, dtype=torch.float64), atol=1e-10)
    assert basis.objectives["loss"] <= basis.objectives["loss_pca"] * (1 + 1e-12)


def test_power_zero_is_pca() -> None:
    strategy, site = Rerank(), problem()
    basis = strategy.select(site, None, strategy.parse_options({"power": 0}))
    assert basis.objectives["swapped"] == 0
    assert basis.objectives["loss"] == pytest.approx(basis.objectives["loss_pca"])


@pytest.mark.parametrize("bad", [{"power": -1}, {"power": "1"}, {"pwer": 1}])
def test_bad_options_are_refused(bad: dict) -> None:
    with pytest.raises(StrategyOptionError):
        Rerank().parse_options(bad)
