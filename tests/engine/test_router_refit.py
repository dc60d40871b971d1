"""The router refit after expert pruning (issue 48, item 3): its cost is the block's real output
change under G, it lowers that cost on tokens it did not fit, it leaves the router as it was
where it cannot, and a run reports what it did."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from compressor.cli import main
from compressor.engine.experts import ExpertOptions, prune_experts
from compressor.engine.router_refit import HELD_OUT, refit_router
from compressor.engine.transforms import fuse_norms
from compressor.models.experts import RoutedExperts
from compressor.models.families import family_for
from compressor_plugins.experts import Reap
from tests.conftest import COMMON, copy_model, random_batches, save_tiny_checkpoint, tiny_model
from tests.run.test_cli import write_recipe

BATCHES = random_batches(COMMON["vocab_size"], count=2, batch=2, length=16)


def _block(name: str, seed: int = 0) -> RoutedExperts:
    model = copy_model(tiny_model(name, seed=seed)).double()
    fuse_norms(model, family_for(name))
    return next(module for module in model.modules() if isinstance(module, RoutedExperts))


def _sample(block: RoutedExperts, tokens: int, G: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Tokens through the block with every expert: inputs, router probabilities, output Grams under G."""
    torch.manual_seed(3)
    x = torch.randn(tokens, block.router.in_features, dtype=torch.float64)
    with torch.no_grad():
        P = torch.softmax(block.router(x), dim=-1)
        outputs = torch.stack([expert(x) for expert in block.experts], dim=1)  # T × E × d
    return x, P, torch.einsum("ted,df,tgf->teg", outputs, G, outputs)


def _output_change(full: RoutedExperts, pruned: RoutedExperts, x: torch.Tensor, G: torch.Tensor) -> float:
    """Σ_t (y'−y)ᵀ G (y'−y) / Σ_t yᵀ G y over the held-out tokens, by running both blocks."""
    rows = torch.arange(x.shape[0]) % HELD_OUT == HELD_OUT - 1
    with torch.no_grad():
        y, y_new = (block(x[rows]) for block in (full, pruned))
    if full.paired:  # gpt-oss's block returns (output, scores)
        y, y_new = y[0], y_new[0]
    change = y_new - y
    return float(torch.einsum("td,df,tf->", change, G, change) / torch.einsum("td,df,tf->", y, G, y))


@pytest.mark.parametrize("name", ["qwen3_moe", "olmoe", "gpt_oss"])  # renormalised; not; router bias
def test_the_refit_cost_is_the_block_s_output_change_and_the_refit_lowers_it_on_held_out_tokens(name: str) -> None:
    full = _block(name)
    d = full.router.in_features
    A = torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    G = A @ A.T / d + torch.eye(d, dtype=torch.float64)  # an H-like positive definite weighing
    x, P, gram = _sample(full, 512, G)
    kept = torch.tensor([0, 2, 3])
    pruned = copy.deepcopy(full)
    pruned.keep_experts(kept)
    rows_before = pruned.router.weight.clone()
    record = refit_router(pruned, kept, x, P, gram, steps=0)
    assert not record.applied and torch.equal(pruned.router.weight, rows_before)
    # (the block routes in float32, as the families do: agreement to ~1e-8)
    assert record.before == pytest.approx(_output_change(full, pruned, x, G), rel=1e-6)
    refit = refit_router(pruned, kept, x, P, gram, steps=20)
    assert refit.applied and refit.after < refit.before
    assert refit.after == pytest.approx(_output_change(full, pruned, x, G), rel=1e-6)  # the rows it kept
    assert not torch.equal(pruned.router.weight, rows_before)


def test_with_every_expert_kept_nothing_can_improve_and_the_router_stays() -> None:
    full = _block("qwen3_moe")
    G = torch.eye(full.router.in_features, dtype=torch.float64)
    x, P, gram = _sample(full, 256, G)
    pruned = copy.deepcopy(full)
    record = refit_router(pruned, torch.arange(len(full.experts)), x, P, gram, steps=20)
    assert record.before == pytest.approx(0.0, abs=1e-12) and not record.applied
    assert torch.equal(pruned.router.weight, full.router.weight)


def test_prune_experts_refits_each_layer_s_router_on_its_own_sample() -> None:
    """The same experts go with and without the refit; where a layer kept it, its router rows moved
    (a scale per row), and running the refitted block on the layer's real inputs changes its output
    less than the plain pruned block does; elsewhere the router is the plain run's."""
    original = tiny_model("olmoe")  # no renormalisation: the kept weights grow when experts go
    family = family_for("olmoe")
    full, plain, refitted = copy_model(original), copy_model(original), copy_model(original)
    for model in (full, plain, refitted):
        fuse_norms(model, family)
    inputs = _block_inputs(full)
    before = prune_experts(plain, family, BATCHES, 3, ExpertOptions(Reap(), super_ratio=None))
    after = prune_experts(
        refitted, family, BATCHES, 3, ExpertOptions(Reap(), super_ratio=None, router_steps=10, sample_tokens=96)
    )
    assert [r.kept for r in before] == [r.kept for r in after] and all(r.router is None for r in before)
    assert any(r.router["applied"] for r in after)
    blocks = [[m for m in model.modules() if isinstance(m, RoutedExperts)] for model in (full, plain, refitted)]
    for record, x, whole, cut, refit in zip(after, inputs, *blocks, strict=True):
        assert record.router["steps"] == 10
        if not record.router["applied"]:
            assert torch.equal(cut.router.weight, refit.router.weight)
            continue
        ratio = refit.router.weight.norm(dim=1) / cut.router.weight.norm(dim=1)
        assert torch.allclose(refit.router.weight, cut.router.weight * ratio[:, None], rtol=1e-5, atol=1e-7)
        with torch.no_grad():
            y = whole(x)
            assert (refit(x) - y).norm() < (cut(x) - y).norm()


def _block_inputs(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each MoE block's input on the test batches' tokens (the whole model, unpruned)."""
    seen: list[torch.Tensor] = []
    handles = [
        m.register_forward_pre_hook(lambda _, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
        for m in model.modules()
        if isinstance(m, RoutedExperts)
    ]
    with torch.no_grad():
        model(input_ids=torch.cat([b.input_ids for b in BATCHES]))
    for handle in handles:
        handle.remove()
    return seen


def test_router_steps_without_the_refit_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "moe", "qwen3_moe")
    recipe = write_recipe(tmp_path, checkpoint, experts={"kept": 3, "router_steps": 10})
    capsys.readouterr()
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "experts.router_steps" in err and "router_refit: true" in err
    assert not (tmp_path / "out").exists()


def test_a_run_with_the_router_refit_reports_it_and_reloads_to_its_model(tmp_path: Path) -> None:
    """The refitted rows are saved: the stock reload computes the run's KL; the report says what the refit did."""
    import json

    from tests.run.test_expert_runs import _kl_of_reload

    checkpoint = save_tiny_checkpoint(tmp_path / "moe", "qwen3_moe")
    recipe = write_recipe(
        tmp_path,
        checkpoint,
        slicing={"layout": "global"},
        experts={"kept": 3, "router_refit": True, "router_steps": 5, "sample_tokens": 64},
    )
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    refits = [layer["router"] for layer in report["experts"]["layers"]]
    assert refits and all(r["steps"] == 5 and r["applied"] == (r["after"] < r["before"]) for r in refits)
    assert any(r["applied"] for r in refits)  # so the reload below checks refitted rows were saved
    assert "router refit: held-out output change" in (tmp_path / "out" / "report.md").read_text()
    kl = _kl_of_reload(checkpoint, tmp_path / "out" / "model", False)
    assert kl == pytest.approx(report["metrics"]["pruned"]["kl"], rel=1e-3, abs=1e-6)
