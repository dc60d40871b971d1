"""`mlp.reconstruct` (`engine.mlp_reconstruct`): a pruned MLP's kept weights trained on its refit's
target per token: fewer errors on tokens it never saw, nothing changed where the refit already
meets the target, and the target the pairs hold is the refit's own (with error feedback)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP

import compressor.engine.neurons as neurons
from compressor.engine.mlp_reconstruct import (
    ReconstructionRecord,
    ReconstructSettings,
    TokenPairs,
    reconstruct_mlp,
    weighing_factor,
)
from compressor.engine.neurons import MlpOptions, prune_mlp
from compressor.engine.refit import drop_neurons, refit_down
from compressor.models.families import family_for
from compressor.strategies.registry import PluginRegistry
from tests.conftest import copy_model, random_batches, tiny_model

SETTINGS = ReconstructSettings(steps=200, lr=0.01, batch_tokens=256, heldout=0.25, check_every=20)


def _teacher(d: int = 16, f: int = 48, seed: int = 0) -> LlamaMLP:
    torch.manual_seed(seed)
    config = tiny_model("llama").config
    config.hidden_size, config.intermediate_size = d, f
    return LlamaMLP(config).eval()


def _pairs(module: torch.nn.Module, x: torch.Tensor, t: torch.Tensor) -> TokenPairs:
    pairs = TokenPairs(module)
    pairs.add(x[None], t[None], torch.ones(1, len(x), dtype=torch.bool), len(x))
    return pairs


def _error(module: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, G: torch.Tensor) -> float:
    with torch.no_grad():
        r = module(x) - t
        return float(torch.einsum("ni,ij,nj->", r, G, r) / torch.einsum("ni,ij,nj->", t, G, t))


def _pruned(teacher: LlamaMLP, x: torch.Tensor, keep: int) -> LlamaMLP:
    """The teacher cut to its first `keep` neurons, the down projection refitted by least squares."""
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        h = torch.nn.functional.silu(teacher.gate_proj(x)) * teacher.up_proj(x)
    C = (h.T @ h / len(h)).double()
    kept = torch.arange(keep)
    down = refit_down(teacher.down_proj.weight.double(), C, kept, 1e-6)
    drop_neurons([student.gate_proj, student.up_proj], student.down_proj, kept, down)
    return student


def test_reconstruction_lowers_the_error_on_tokens_it_never_saw() -> None:
    """A third of the neurons kept and refitted: training gate, up and down on the target lowers the
    G-weighed error on fresh tokens, the record's held-out errors fall, and the refit's weights were
    the start (its held-out error is theirs)."""
    teacher = _teacher()
    generator = torch.Generator().manual_seed(1)
    x, fresh = torch.randn(4096, 16, generator=generator), torch.randn(2048, 16, generator=generator)
    student = _pruned(teacher, x, 16)
    A = torch.randn(16, 16, generator=generator)
    G = (A @ A.T / 16 + 0.1 * torch.eye(16)).double()
    with torch.no_grad():
        t = teacher(x)
        t_fresh = teacher(fresh)
    before = _error(student, fresh, t_fresh, G.float())
    record = reconstruct_mlp(_pairs(student, x, t), G, SETTINGS, seed=0, device=torch.device("cpu"))
    after = _error(student, fresh, t_fresh, G.float())
    assert after < 0.9 * before
    assert record.heldout_after < record.heldout_before and record.best_step > 0 and record.weighed_by_h
    assert record.tokens + record.heldout_tokens == 4096 and record.heldout_tokens == 1024
    assert record.heldout_before == pytest.approx(before, rel=0.25)  # the same refit, on other random tokens


def test_a_target_the_weights_already_meet_leaves_them_as_they_were() -> None:
    """Every neuron kept and the target the MLP's own output: the held-out error is 0 at the start,
    no step can lower it, and the weights come back bit for bit."""
    teacher = _teacher()
    x = torch.randn(1024, 16)
    with torch.no_grad():
        t = teacher(x)
    before = {name: p.detach().clone() for name, p in teacher.named_parameters()}
    record = reconstruct_mlp(_pairs(teacher, x, t), None, SETTINGS, seed=0, device=torch.device("cpu"))
    assert record.best_step == 0 and record.heldout_after == record.heldout_before < 1e-10
    assert not record.weighed_by_h
    assert all(torch.equal(p, before[name]) for name, p in teacher.named_parameters())


@pytest.mark.parametrize("feedback", [0.0, 0.5])
def test_the_pairs_hold_the_refits_target(feedback: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """In `prune_mlp`, the pairs a layer's reconstruction is given are the refit's problem per token:
    the least-squares map from the kept neurons' activations (computed from the recorded inputs) to
    the recorded targets is the down projection the refit left, with and without error feedback."""
    seen: list[tuple[TokenPairs, torch.Tensor]] = []

    def record_only(pairs: TokenPairs, *args: object) -> ReconstructionRecord:
        seen.append((pairs, pairs.module.down_proj.weight.detach().clone()))
        return ReconstructionRecord(0, 0, 0.0, 0.0, 0, 0, False)

    monkeypatch.setattr(neurons, "reconstruct_mlp", record_only)
    original = tiny_model("llama")
    model = copy_model(original)
    batches = random_batches(original.config.vocab_size, padded=True)
    keep = original.config.intermediate_size // 2
    selector = PluginRegistry().selector("magnitude")
    records = prune_mlp(
        model,
        family_for("llama"),
        batches,
        keep,
        MlpOptions(selector, damping=1e-12, feedback=feedback, reconstruct=SETTINGS),
    )
    assert len(seen) == len(records) == original.config.num_hidden_layers
    for (pairs, down), record in zip(seen, records):
        x, t = pairs.tensors()
        assert len(x) == record.tokens  # every counted token, once (not the reference stream's)
        mlp = pairs.module
        with torch.no_grad():
            h = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
        fitted = torch.linalg.lstsq(h.double(), t.double()).solution.T
        assert torch.allclose(fitted, down.double(), rtol=1e-3, atol=1e-4)


def test_a_singular_or_slightly_indefinite_g_weighs_without_failing() -> None:
    """H estimated in float32 can be singular or have tiny negative eigenvalues: L Lᵀ is then G with
    those set to 0 (a Cholesky factor would raise), and the identity where there is no G."""
    generator = torch.Generator().manual_seed(3)
    A = torch.randn(8, 5, generator=generator, dtype=torch.float64)
    G = A @ A.T  # rank 5
    G[0, 0] -= 1e-9 * float(G.diagonal().mean())  # a round-off's worth below semidefinite
    L = weighing_factor(G, 8, torch.device("cpu")).double()
    assert torch.allclose(L @ L.T, G, atol=1e-5 * float(G.abs().max()))
    assert torch.equal(weighing_factor(None, 8, torch.device("cpu")), torch.eye(8))


def test_a_bfloat16_mlp_keeps_the_weights_its_record_scored() -> None:
    """In a bfloat16 model the weights are scored as they are written back: the record's held-out
    error is what the module's own bfloat16 weights give on the held-out tokens, recomputed here."""
    teacher = _teacher()
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2048, 16, generator=generator)
    student = _pruned(teacher, x, 16).to(torch.bfloat16)
    with torch.no_grad():
        t = teacher(x)
    record = reconstruct_mlp(_pairs(student, x, t), None, SETTINGS, seed=5, device=torch.device("cpu"))
    assert {p.dtype for p in student.parameters()} == {torch.bfloat16} and record.best_step > 0
    check = torch.randperm(len(x), generator=torch.Generator().manual_seed(5))[: record.heldout_tokens]
    as_float = copy.deepcopy(student).float()
    assert record.heldout_after == pytest.approx(_error(as_float, x[check], t[check], torch.eye(16)), rel=1e-5)
