"""The paper's method: τ-search propositions, the Fisher estimator, Stiefel refinement."""

from __future__ import annotations

import math

import pytest
import torch

from compressor.data.batches import Batch
from compressor.engine.calibration import capture_layer_inputs
from compressor.engine.fisher import estimate_fisher, site_activations
from compressor.engine.transforms import fuse_norms
from compressor.models.families import family_for
from compressor.recipe.sections.sensitivity import SensitivityOptions
from compressor.strategies.contract import (
    SiteProblem,
    SiteStatistics,
    StrategyOptionError,
    complete_basis,
    coupled_loss,
    coupled_losses,
    eigh_descending,
    tau_candidates,
)
from compressor_plugins.pca import PCA
from compressor_plugins.sensitivity import Sensitivity, TauGrid
from compressor_plugins.stiefel import Schedule, Stiefel, loss_and_gradient
from tests.conftest import tiny_model


def random_psd(d: int, seed: int, decay: float = 0.3) -> torch.Tensor:
    """A positive-definite matrix with a spread spectrum, like activation statistics."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    spectrum = torch.exp(-decay * torch.arange(d, dtype=torch.float64)) + 1e-3
    return q @ torch.diag(spectrum) @ q.T


def problem(C: torch.Tensor, H: torch.Tensor, keep: int) -> SiteProblem:
    return SiteProblem("site", 0, C.shape[0], keep, SiteStatistics(C=C, tokens=1, extra={"H": H}))


def projector(basis: torch.Tensor) -> torch.Tensor:
    return basis @ basis.T


def test_with_identity_h_the_sensitivity_subspace_is_pca() -> None:
    C = random_psd(12, seed=1)
    site = problem(C, torch.eye(12, dtype=torch.float64), keep=8)
    sens = Sensitivity().select(site, None, TauGrid())
    pca = PCA().select(site, None, None)
    assert torch.allclose(projector(sens.removed(8)), projector(pca.removed(8)), atol=1e-10)
    assert sens.objectives["loss"] == pytest.approx(sens.objectives["loss_pca"], rel=1e-12)


def test_batched_tau_candidates_are_the_one_at_a_time_eigendecompositions() -> None:
    """One batched eigendecomposition (the grid's matrices, then C) gives each τ's subspaces and
    its loss, as one eigendecomposition per τ does."""
    C, H, keep, taus = random_psd(24, seed=4), random_psd(24, seed=5, decay=0.1), 16, (0.5, 1.0, 7.0, 70.0)
    stacked = tau_candidates(C, H, taus)
    singles = [eigh_descending(tau * C + H / tau)[1] for tau in taus] + [eigh_descending(C)[1]]
    assert stacked.shape == (len(taus) + 1, 24, 24)
    losses = coupled_losses(C, H, stacked[:, :, keep:])
    for Q, single, loss in zip(stacked, singles, losses.tolist()):
        assert torch.allclose(projector(Q[:, keep:]), projector(single[:, keep:]), atol=1e-10)
        assert loss == pytest.approx(coupled_loss(C, H, single[:, keep:]), rel=1e-10)
        assert loss == pytest.approx(
            float(torch.trace(single[:, keep:].T @ C @ single[:, keep:] @ single[:, keep:].T @ H @ single[:, keep:])),
            rel=1e-10,
        )


@pytest.mark.parametrize("d", [2, 3])
def test_rank_one_tau_search_reaches_the_brute_force_minimum(d: int) -> None:
    """Proposition 1: min_u (uᵀCu)(uᵀHu) is attained by a bottom eigenvector of τC + H/τ."""
    C, H = random_psd(d, seed=2, decay=1.0), random_psd(d, seed=3, decay=2.0)
    taus = torch.logspace(-3, 3, 4001, dtype=torch.float64).tolist()
    chosen = Sensitivity().select(problem(C, H, keep=d - 1), None, TauGrid(tuple(taus))).objectives["loss"]
    Cn, Hn = C / torch.linalg.matrix_norm(C), H / torch.linalg.matrix_norm(H)
    if d == 2:
        angles = torch.linspace(0, math.pi, 200_001, dtype=torch.float64)
        u = torch.stack([angles.cos(), angles.sin()], dim=1)
    else:
        n = 400_000  # Fibonacci sphere
        i = torch.arange(n, dtype=torch.float64) + 0.5
        phi, theta = torch.acos(1 - 2 * i / n), math.pi * (1 + 5**0.5) * i
        u = torch.stack([theta.cos() * phi.sin(), theta.sin() * phi.sin(), phi.cos()], dim=1)
    brute = (((u @ Cn) * u).sum(1) * ((u @ Hn) * u).sum(1)).min().item()
    assert chosen <= brute * (1 + 1e-9)  # the spectral pick is at least as good as any sampled direction
    assert chosen >= brute * (1 - 1e-3)  # and the sampling is fine enough to come within 0.1%


def test_upper_bound_holds_for_random_subspaces() -> None:
    """Proposition 2: Tr(UᵀCU·UᵀHU) ≤ ¼ Tr(UᵀM_τ²U) for every orthonormal U and τ > 0."""
    g = torch.Generator().manual_seed(4)
    for trial in range(200):
        d = int(torch.randint(2, 12, (1,), generator=g))
        k = int(torch.randint(1, d + 1, (1,), generator=g))
        C, H = random_psd(d, seed=10 + trial), random_psd(d, seed=1000 + trial, decay=0.7)
        U, _ = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
        tau = float(torch.exp(torch.randn(1, generator=g, dtype=torch.float64) * 2))
        M = tau * C + H / tau
        assert coupled_loss(C, H, U) <= 0.25 * torch.trace(U.T @ M @ M @ U).item() * (1 + 1e-12)


def test_sensitivity_beats_or_ties_pca_on_its_objective_and_reports_candidates() -> None:
    C, H = random_psd(16, seed=5), random_psd(16, seed=6, decay=0.1)
    basis = Sensitivity().select(problem(C, H, keep=12), None, TauGrid())
    assert basis.objectives["loss"] <= basis.objectives["loss_pca"]
    assert [c["tau"] for c in basis.objectives["candidates"]] == [1.0, 7.0, 10.0, 30.0, 70.0]
    assert basis.objectives["tau"] in (1.0, 7.0, 10.0, 30.0, 70.0)
    assert min(c["loss"] for c in basis.objectives["candidates"]) == basis.objectives["loss"]


def test_with_pca_among_the_candidates_the_choice_is_never_worse_than_pca() -> None:
    C, H = random_psd(16, seed=5), random_psd(16, seed=6, decay=0.1)
    grid_only = Sensitivity().select(problem(C, H, keep=12), None, TauGrid(taus=(0.01,)))
    assert grid_only.objectives["loss"] > grid_only.objectives["loss_pca"]  # an H-dominated grid loses here
    chosen = Sensitivity().select(problem(C, H, keep=12), None, TauGrid(taus=(0.01,), include_pca=True))
    assert chosen.objectives["loss"] == chosen.objectives["loss_pca"]
    assert chosen.objectives["chose_pca"] and chosen.objectives["tau"] is None
    pca = torch.linalg.eigh(C)[1][:, :4]  # C's bottom 4 eigenvectors: the removed directions
    assert torch.allclose(projector(chosen.Q[:, 12:]), projector(pca), atol=1e-8)


def test_refining_tau_only_ever_lowers_the_objective() -> None:
    C, H = random_psd(16, seed=5), random_psd(16, seed=6, decay=0.1)
    grid = Sensitivity().select(problem(C, H, keep=12), None, TauGrid())
    refined = Sensitivity().select(problem(C, H, keep=12), None, TauGrid(refine=8))
    assert len(refined.objectives["refined"]) == 8
    assert refined.objectives["loss"] < grid.objectives["loss"]  # the grid's best τ = 7 is not the optimum here
    assert 1.0 < refined.objectives["tau"] < 10.0  # searched between the best grid point's neighbours
    for seed in range(10):
        C, H = random_psd(12, seed=seed), random_psd(12, seed=seed + 50, decay=0.05)
        for refine in (1, 2, 5):
            base = Sensitivity().select(problem(C, H, keep=8), None, TauGrid())
            more = Sensitivity().select(problem(C, H, keep=8), None, TauGrid(refine=refine))
            assert more.objectives["loss"] <= base.objectives["loss"]


def test_stiefel_gradient_is_the_gradient_of_the_loss() -> None:
    C, H = random_psd(7, seed=7), random_psd(7, seed=8)
    U = torch.linalg.qr(torch.randn(7, 3, dtype=torch.float64))[0].requires_grad_(True)
    torch.trace((U.T @ C @ U) @ (U.T @ H @ U)).backward()
    assert torch.allclose(U.grad, loss_and_gradient(C, H, U.detach())[1], atol=1e-12)


def sensitive_where_pca_cuts(C: torch.Tensor, removed: int, seed: int) -> torch.Tensor:
    """An H large on C's `removed` lowest-energy directions (plus noise): PCA's blind spot."""
    _, vectors = torch.linalg.eigh(C)
    bottom = vectors[:, :removed]
    return 10 * bottom @ bottom.T + 0.1 * random_psd(C.shape[0], seed)


@pytest.mark.parametrize("start", ["sensitivity", "pca"])
def test_stiefel_refinement_never_increases_the_loss(start: str) -> None:
    C = random_psd(16, seed=9)
    H = sensitive_where_pca_cuts(C, removed=6, seed=10)
    site = problem(C, H, keep=10)
    incoming = Sensitivity().select(site, None, TauGrid()) if start == "sensitivity" else PCA().select(site, None, None)
    refined = Stiefel().select(site, incoming, Schedule(steps=2000, lr=1e-2, patience=200))
    before, after = refined.objectives["loss_before"], refined.objectives["loss_after"]
    Cn, Hn = C / torch.linalg.matrix_norm(C), H / torch.linalg.matrix_norm(H)
    assert before == pytest.approx(coupled_loss(Cn, Hn, incoming.removed(10)))
    assert after == pytest.approx(coupled_loss(Cn, Hn, refined.removed(10)))
    assert after <= before
    if start == "pca":  # PCA ignores H, so there is room to improve (locally: refinement is a local search)
        assert after < 0.8 * before
    q = refined.Q
    assert torch.allclose(q.T @ q, torch.eye(16, dtype=torch.float64), atol=1e-10)


def test_complete_basis_spans_the_removed_subspace_last() -> None:
    U = torch.linalg.qr(torch.randn(9, 4, dtype=torch.float64))[0]
    Q = complete_basis(U)
    assert torch.allclose(Q.T @ Q, torch.eye(9, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(projector(Q[:, 5:]), projector(U), atol=1e-12)


@pytest.mark.parametrize(
    ("strategy", "options", "message"),
    [
        (Sensitivity(), {"taus": [1, -2]}, "taus.1 must be above 0 \\(a positive number\\), got -2"),
        (Sensitivity(), {"taus": []}, "non-empty"),
        (
            Sensitivity(),
            {"tau": [1]},
            "unknown key 'tau' \\(did you mean 'taus'\\?\\); allowed keys: taus, include_pca, refine",
        ),
        (Sensitivity(), {"include_pca": "yes"}, "include_pca must be true or false"),
        (Sensitivity(), {"refine": -1}, "refine must be at least 0 \\(a whole number of extra τ values\\), got -1"),
        (Sensitivity(), {"refine": 2.5}, "refine must be an integer"),
        (Stiefel(), {"steps": 0}, "steps must be at least 1"),
        (Stiefel(), {"lr": 0}, "lr must be above 0"),
        (Stiefel(), {"steps": 2.5}, "steps must be an integer"),
        (Stiefel(), {"iterations": 5}, "unknown key 'iterations'; allowed keys: steps, lr, patience, tolerance"),
    ],
)
def test_bad_strategy_options_are_refused(strategy, options, message) -> None:
    with pytest.raises(StrategyOptionError, match=message):
        strategy.parse_options(options)


def _exact_fisher(model, family, inputs, batch: int) -> list[torch.Tensor]:
    """Σ_j Σ_v p_j(v) ∇log p_j(v) ∇log p_j(v)ᵀ per token, by enumerating the vocabulary, averaged over tokens."""
    with torch.enable_grad():
        sites, logits = site_activations(model, family, inputs, batch)
        log_probs = torch.log_softmax(logits.double(), -1)[0]
        positions, vocab = log_probs.shape
        totals = [torch.zeros(s.shape[-1], s.shape[-1], dtype=torch.float64) for s in sites]
        for j in range(positions):
            for v in range(vocab):
                grads = torch.autograd.grad(log_probs[j, v], sites, retain_graph=True)
                weight = log_probs[j, v].exp().item()
                for total, g in zip(totals, grads):
                    total += weight * g[0].double().T @ g[0].double()  # summed over the tokens i
    return [t / positions for t in totals]


def test_fisher_estimate_converges_to_the_exact_fisher() -> None:
    model = tiny_model(
        "llama", vocab_size=12, hidden_size=16, head_dim=4, num_hidden_layers=1, intermediate_size=24
    ).double()
    family = family_for("llama")
    fuse_norms(model, family)
    ids = torch.tensor([[0, 5, 3, 9, 7]])
    exact = _exact_fisher(
        model, family, capture_layer_inputs(model, family, [Batch(ids, torch.ones_like(ids))], torch.device("cpu")), 0
    )

    def estimate(samples: int) -> dict[str, torch.Tensor]:
        repeated = ids.repeat(samples, 1)
        inputs = capture_layer_inputs(model, family, [Batch(repeated, torch.ones_like(repeated))], torch.device("cpu"))
        return estimate_fisher(model, family, inputs, SensitivityOptions(dtype="float64"), torch.device("cpu"), seed=3)

    def error(estimates: dict[str, torch.Tensor]) -> float:
        return max(
            (torch.linalg.matrix_norm(e - x) / torch.linalg.matrix_norm(x)).item()
            for e, x in zip(estimates.values(), exact)
        )

    coarse, fine = error(estimate(20)), error(estimate(4000))
    assert fine < 0.1
    assert fine < coarse / 3


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_sampled_score_is_the_gradient_of_the_sampled_log_likelihood(reduction: str) -> None:
    from compressor.engine.fisher import sampled_score

    logits = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, :2] = False
    score = sampled_score(logits, mask, torch.Generator().manual_seed(0), reduction)
    labels = score.argmax(-1)  # the sampled label is the only entry with a positive score
    picked = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)[mask]
    (picked.sum() if reduction == "sum" else picked.mean()).backward()
    assert torch.allclose(score, logits.grad, atol=1e-12)


def test_sampled_labels_follow_the_model_distribution() -> None:
    from compressor.engine.fisher import sampled_score

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = probs.log().expand(20_000, 4).unsqueeze(0)
    score = sampled_score(logits, torch.ones(1, 20_000, dtype=torch.bool), torch.Generator().manual_seed(1), "sum")
    frequencies = torch.bincount(score[0].argmax(-1), minlength=4).double() / 20_000
    assert torch.allclose(frequencies, probs, atol=0.015)


def test_two_level_sampling_draws_what_a_full_cdf_search_draws() -> None:
    """Block sums then a search inside the block: the same label as inverse-CDF sampling over
    the whole row (up to rounding), across whole blocks and a shorter last one."""
    from compressor.engine.fisher import sample_labels

    logits = 3 * torch.randn(4000, 300, generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(logits, -1)
    labels = sample_labels(probs, torch.Generator().manual_seed(4), block=128)
    cdf = probs.cumsum(-1)
    draws = torch.rand(4000, 1, generator=torch.Generator().manual_seed(4)) * cdf[:, -1:]
    reference = torch.searchsorted(cdf, draws).clamp_max(299).view(-1)
    assert (labels == reference).float().mean().item() > 0.999
    assert labels.max().item() >= 256  # the short last block is reached


def test_two_level_sampling_follows_the_distribution() -> None:
    from compressor.engine.fisher import sample_labels

    probs = torch.softmax(torch.linspace(0, 4, 300), -1)
    labels = sample_labels(probs.expand(200_000, 300).contiguous(), torch.Generator().manual_seed(3), block=64)
    frequencies = torch.bincount(labels, minlength=300).double() / 200_000
    per_block = lambda x: torch.stack([part.sum() for part in x.split(64)])  # noqa: E731
    assert torch.allclose(per_block(frequencies), per_block(probs.double()), atol=0.005)
    assert torch.allclose(frequencies, probs.double(), atol=0.002)


def test_autocast_estimate_stays_close_to_full_precision() -> None:
    model = tiny_model("llama")
    family = family_for("llama")
    fuse_norms(model, family)
    ids = torch.randint(3, 128, (16, 32), generator=torch.Generator().manual_seed(0))
    inputs = capture_layer_inputs(model, family, [Batch(ids, torch.ones_like(ids))], torch.device("cpu"))
    full = estimate_fisher(model, family, inputs, SensitivityOptions(), torch.device("cpu"), seed=5)
    low = estimate_fisher(model, family, inputs, SensitivityOptions(autocast="bfloat16"), torch.device("cpu"), seed=5)
    assert list(low) == list(full)
    for exact, approx in zip(full.values(), low.values()):
        assert approx.dtype == torch.float32  # the accumulation dtype
        assert (torch.linalg.matrix_norm(approx - exact) / torch.linalg.matrix_norm(exact)).item() < 0.1


H_PASS_CASES = [(name, {}) for name in sorted(__import__("tests.conftest", fromlist=["FAMILY_CONFIGS"]).FAMILY_CONFIGS)]
H_PASS_CASES.append(("opt", {"word_embed_proj_dim": 32}))  # project_out between the final norm and the head


@pytest.mark.parametrize(
    ("family_name", "overrides"),
    H_PASS_CASES,
    ids=[name + ("-projections" if extra else "") for name, extra in H_PASS_CASES],
)
def test_the_h_pass_forward_reproduces_the_model_logits(family_name: str, overrides: dict) -> None:
    """H is the Fisher of *this* model's output: the H pass must compute the same logits
    (soft-capping included, through OPT's project_out) as the fused model's own forward."""
    model = tiny_model(family_name, **overrides)
    family = family_for(family_name)
    fuse_norms(model, family)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs = capture_layer_inputs(model, family, [Batch(ids, torch.ones_like(ids))], torch.device("cpu"))
    with torch.no_grad():
        _, logits = site_activations(model, family, inputs, 0)
        expected = model(input_ids=ids).logits
    assert torch.allclose(logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_autocast_auto_is_bfloat16_only_where_the_cpu_computes_it(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`auto` follows the CPU's bf16 instructions (emulated bf16 is several times slower than
    float32), and an explicit setting is taken as given."""
    from compressor.engine.fisher import autocast_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) == (torch.bfloat16 if native else None)
    assert autocast_dtype("bfloat16", cpu) == torch.bfloat16 and autocast_dtype(None, cpu) is None
    assert autocast_dtype("auto", torch.device("meta")) is None
