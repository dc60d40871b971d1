"""End-to-end refinement: what it optimises is the sliced model's KL, it never hands back a worse
calibration KL than it received, and a refined run reloads and reproduces its logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from compressor.cli import main
from compressor.engine.bases import apply_bases, load_bases
from compressor.engine.calibration import capture_layer_inputs
from compressor.engine.pooling import PipelineStep
from compressor.engine.refine import (
    RefinementRun,
    TiedHead,
    _student_logits,
    kl_to_target,
    rebatch,
    refine_bases,
    teacher_target,
)
from compressor.engine.transforms import fuse_norms
from compressor.engine.walk import prune
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor.models.sites import site_ids
from compressor.recipe.sections.refinement import RefinementSpec
from compressor_plugins.pca import PCA
from tests.conftest import copy_model, random_batches, tiny_model, widths_for
from tests.run.test_cli import _DELETE, write_recipe


def _pca_bases(name: str, batches, sparsity: float = 0.25):
    original = tiny_model(name)
    family = family_for(name)
    widths = widths_for(
        name,
        original.config,
        kept_width(original.config.hidden_size, sparsity, 8),
        slice_head=family.head_width_is_embedding_width,
    )
    result = prune(copy_model(original), fixed_layout(original.config, family, widths), batches, [PipelineStep(PCA())])
    return original, family, result


def _calibration_kl(original, pruned, batches) -> float:
    """Mean KL(original ‖ pruned) over every real position, from the two whole models."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            keep = batch.attention_mask.bool()
            p, q = (
                torch.log_softmax(
                    model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[keep].double(), -1
                )
                for model in (original, pruned)
            )
            total += float((p.exp() * (p - q)).sum())
            count += int(keep.sum())
    return total / count


@pytest.mark.parametrize("name", ["llama", "gemma2", "opt", "phi"])
@pytest.mark.parametrize("kind", ["pca", "random"])
def test_the_projected_forward_is_the_sliced_model(name: str, kind: str) -> None:
    """What refinement differentiates (the fused original, stream projected on V Vᵀ after every
    site) computes the sliced model's logits, so its objective is the pruned model's true KL; for
    PCA's bases and for arbitrary orthonormal ones."""
    batches = random_batches(tiny_model(name).config.vocab_size, padded=True)
    original, family, result = _pca_bases(name, batches)
    chosen = result.bases
    if kind == "random":
        generator = torch.Generator().manual_seed(3)
        chosen = {
            site: torch.linalg.qr(torch.randn(v.shape, generator=generator, dtype=torch.float64))[0]
            for site, v in result.bases.items()
        }
    sliced_model = apply_bases(copy_model(original), family, chosen)
    fused = copy_model(original)
    fuse_norms(fused, family)
    inputs = capture_layer_inputs(fused, family, batches, torch.device("cpu"))
    bases = [chosen[site] for site in site_ids(family, original.config.num_hidden_layers)]
    with torch.no_grad():
        for b, batch in enumerate(batches):
            keep = batch.attention_mask.bool()
            projected = _student_logits(fused, family, inputs, b, bases)[keep]
            sliced = sliced_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[keep]
            assert ((projected - sliced).abs().max() / sliced.abs().max()).item() < 1e-5


@pytest.mark.parametrize("name", ["qwen2", "gemma2"])
def test_refinement_of_a_tied_head_is_the_tied_model_and_keeps_it_tied(name: str) -> None:
    """With `tie_head` the pruned model's logits are the projected forward's, projected on the
    columns of the sliced embedding (`TiedHead`), for the walk's bases and arbitrary ones; a
    refinement keeps the last site on the embedding's basis and lowers the true KL."""
    family = family_for(name)
    original = tiny_model(name)
    batches = random_batches(original.config.vocab_size, padded=True)
    ids = site_ids(family, original.config.num_hidden_layers)
    widths = widths_for(name, original.config, 40, slice_head=True)
    result = prune(
        tiny_model(name), fixed_layout(original.config, family, widths, tie_head=True), batches, [PipelineStep(PCA())]
    )
    generator = torch.Generator().manual_seed(5)
    scrambled = {
        site: torch.linalg.qr(torch.randn(v.shape, generator=generator, dtype=torch.float64))[0]
        for site, v in result.bases.items()
    }
    scrambled[ids[-1]] = scrambled["embedding"]
    fused = tiny_model(name)
    fuse_norms(fused, family)
    inputs = capture_layer_inputs(fused, family, batches, torch.device("cpu"))
    head = TiedHead(fused.get_submodule(family.embedding).weight)
    for chosen in (result.bases, scrambled):
        sliced_model = apply_bases(tiny_model(name), family, chosen)
        assert sliced_model.get_submodule(family.head).weight is sliced_model.get_submodule(family.embedding).weight
        bases = [chosen[site] for site in ids]
        with torch.no_grad():
            for b, batch in enumerate(batches):
                keep = batch.attention_mask.bool()
                projected = _student_logits(fused, family, inputs, b, bases, head)[keep]
                sliced = sliced_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[keep]
                assert ((projected - sliced).abs().max() / sliced.abs().max()).item() < 1e-5
    options = RefinementSpec(epochs=3, lr=0.05, batch_size=2, top_k=0)
    refined, record, _ = refine_bases(tiny_model(name), family, batches, result.bases, options)
    assert record.kept == "refined" and torch.equal(refined[ids[-1]], refined["embedding"])
    before = _calibration_kl(original, apply_bases(tiny_model(name), family, result.bases), batches)
    after = _calibration_kl(original, apply_bases(tiny_model(name), family, refined), batches)
    assert record.calibration_kl_before == pytest.approx(before, rel=1e-4)
    assert record.calibration_kl_after == pytest.approx(after, rel=1e-4) and after < before


def test_top_k_objective_is_a_lower_bound_and_exact_with_the_whole_vocabulary() -> None:
    generator = torch.Generator().manual_seed(0)
    teacher = 3 * torch.randn(2, 10, 50, generator=generator)
    student = teacher + 0.5 * torch.randn(teacher.shape, generator=generator)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :3] = False
    p, q = torch.log_softmax(teacher[mask].double(), -1), torch.log_softmax(student[mask].double(), -1)
    exact = float((p.exp() * (p - q)).sum())
    assert float(kl_to_target(teacher_target(teacher, mask, 0), student, mask)) == pytest.approx(exact, rel=1e-5)
    assert float(kl_to_target(teacher_target(teacher, mask, 50), student, mask)) == pytest.approx(exact, rel=1e-5)
    truncated = [float(kl_to_target(teacher_target(teacher, mask, k), student, mask)) for k in (1, 5, 20, 49)]
    assert all(0 < value <= exact * (1 + 1e-4) for value in truncated)  # float32 rounding
    assert truncated[-1] > truncated[0]
    assert float(kl_to_target(teacher_target(teacher, mask, 5), teacher, mask)) == pytest.approx(0, abs=1e-6)


def test_rebatch_pads_batches_of_different_widths_on_the_right() -> None:
    """Chat batches are padded per batch; joined, the narrower ones get pads after their tokens."""
    wide, narrow = random_batches(100, count=1, length=10)[0], random_batches(100, count=1, length=6, seed=2)[0]
    narrow.sensitivity_mask = torch.ones_like(narrow.attention_mask)
    wide.sensitivity_mask = torch.ones_like(wide.attention_mask)
    (joined,) = rebatch([wide, narrow], 8)
    assert joined.input_ids.shape == (8, 10)
    assert torch.equal(joined.input_ids[4:, :6], narrow.input_ids)
    assert joined.attention_mask[4:, 6:].sum() == 0 and joined.sensitivity_mask[4:, 6:].sum() == 0
    assert joined.attention_mask[:4].all()


def test_rebatch_keeps_windows_and_spreads_a_subset() -> None:
    batches = random_batches(100, count=3, batch=4)
    again = rebatch(batches, 5)
    assert [b.input_ids.shape[0] for b in again] == [5, 5, 2]
    assert torch.equal(torch.cat([b.input_ids for b in again]), torch.cat([b.input_ids for b in batches]))
    subset = torch.cat([b.input_ids for b in rebatch(batches, 2, windows=3)])
    everything = torch.cat([b.input_ids for b in batches])
    assert torch.equal(subset, everything[[0, 6, 11]])


@pytest.mark.parametrize("lr, kept", [(0.05, "refined"), (100.0, "received")])
def test_refinement_never_returns_a_higher_calibration_kl(lr: float, kept: str) -> None:
    batches = random_batches(tiny_model("llama").config.vocab_size, padded=True)
    original, family, result = _pca_bases("llama", batches, sparsity=0.5)
    options = RefinementSpec(epochs=3, lr=lr, batch_size=2, top_k=0)
    refined, record, _ = refine_bases(copy_model(original), family, batches, result.bases, options)
    assert record.kept == kept
    assert record.steps == 12
    for site, basis in refined.items():
        assert basis.shape == result.bases[site].shape and basis.dtype == torch.float64
        assert torch.allclose(basis.T @ basis, torch.eye(basis.shape[1], dtype=torch.float64), atol=1e-10)
    # The record's objective is the real KL of the models those bases build (top_k 0: exact).
    before = _calibration_kl(original, apply_bases(copy_model(original), family, result.bases), batches)
    after = _calibration_kl(original, apply_bases(copy_model(original), family, refined), batches)
    assert record.calibration_kl_before == pytest.approx(before, rel=1e-4)
    assert record.calibration_kl_after == pytest.approx(after, rel=1e-4)
    assert after <= before
    if kept == "refined":
        assert after < 0.95 * before  # it does move
    else:
        assert record.calibration_kl_refined > before  # diverged, so the received bases came back
        assert all(torch.equal(refined[site], result.bases[site]) for site in refined)


def test_a_refined_run_reloads_and_reproduces_its_logits(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = write_recipe(
        tmp_path,
        tiny_checkpoint,
        pipeline=[{"strategy": "pca"}],
        calibration__num_samples=8,
        refinement={"epochs": 2, "lr": 0.05, "batch_size": 1, "top_k": 0},
    )
    assert main(["run", str(recipe)]) == 0
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    refinement = report["refinement"]
    assert refinement["kept"] == "refined" and refinement["steps"] == 16
    assert refinement["calibration_kl_after"] < refinement["calibration_kl_before"]
    (guard,) = report["guards"]  # and on the 16 held-out windows too, so the refined model is saved
    assert guard["kept"] and guard["kl_after"] <= guard["kl_before"] and guard["windows"] == 16
    assert report["metrics"]["unrefined"]["kl"] > report["metrics"]["pruned"]["kl"]
    assert "kl" in report["metrics"]["unrefined"] and "refine_s" in report["timings"]
    assert "KL before refinement" in (out / "report.md").read_text()
    assert main(["compare", str(out), "--output", str(tmp_path / "table.json")]) == 0
    (row,) = json.loads((tmp_path / "table.json").read_text())
    assert row["pipeline"] == "pca → refined on KL" and row["refine s"] == report["timings"]["refine_s"]
    assert refinement["options"] == {
        "epochs": 2.0,
        "windows": None,
        "lr": 0.05,
        "batch_size": 1,
        "top_k": 0,
        "heldout_windows": 16,
    }

    original = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    family = family_for(original.config.model_type)
    rebuilt = apply_bases(copy_model(original), family, load_bases(out / "bases.safetensors"))
    reloaded = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    assert sum(p.numel() for p in reloaded.parameters()) == report["params"]["pruned"]
    batch = random_batches(original.config.vocab_size, count=1, padded=True)[0]
    with torch.no_grad():
        expected = rebuilt(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        actual = reloaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.equal(expected, actual)


@pytest.mark.parametrize("name", ["qwen2", "granite"])  # Granite: its logits divided after the tied head too
def test_refinement_optimises_the_stock_tied_head_that_is_saved(name: str) -> None:
    """A one-basis model saved with its head tied computes E·V·diag(D)·Vᵀn, not the untied head:
    refinement's objective before and after is the KL of that saved model (D fitted, then D as
    refinement learned it), so what it lowers is what users load."""
    from compressor.models.stock import fitted_tied_scale, head_stream, to_stock

    original = tiny_model(name)
    assert original.config.tie_word_embeddings
    family = family_for(name)
    batches = random_batches(original.config.vocab_size, padded=True)
    k = kept_width(original.config.hidden_size, 0.25, 8)
    widths = {site: k for site in site_ids(family, original.config.num_hidden_layers)}
    result = prune(
        copy_model(original),
        fixed_layout(original.config, family, widths, layout="global"),
        batches,
        [PipelineStep(PCA())],
    )
    scale = fitted_tied_scale(result.model, family, head_stream(result.head_moment, result.bases["embedding"]))
    options = RefinementSpec(epochs=3, lr=0.05, batch_size=2, top_k=0)
    refined = refine_bases(
        copy_model(original),
        family,
        batches,
        result.bases,
        options,
        RefinementRun(keep_tied=False, stock_tied_scale=scale),
    )
    assert refined.record.kept == "refined" and refined.head_scale is not None
    assert not torch.equal(refined.head_scale, scale)  # D moved with the basis
    saved_before = to_stock(result.model, family, original.config, tie=True, scale=scale)[0]
    moved = apply_bases(copy_model(original), family, refined.bases, keep_tied=False)
    saved_after = to_stock(moved, family, original.config, tie=True, scale=refined.head_scale)[0]
    assert saved_after.config.tie_word_embeddings
    assert refined.record.calibration_kl_before == pytest.approx(
        _calibration_kl(original, saved_before, batches), rel=1e-4
    )
    assert refined.record.calibration_kl_after == pytest.approx(
        _calibration_kl(original, saved_after, batches), rel=1e-4
    )
    untied = _calibration_kl(original, to_stock(result.model, family, original.config, tie=False)[0], batches)
    assert abs(untied - refined.record.calibration_kl_before) > 1e-3 * untied  # another model than the untied one


def test_a_refinement_that_hurts_held_out_text_is_undone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A tied model kept tied, refined for many steps on one window with an objective that keeps
    only the teacher's top token (a crude proxy of the KL): its own objective falls, the saved
    model's KL on the held-out windows rises, so the run saves the unrefined model, says so in one
    line, and its report records the guard's measurement."""
    from tests.conftest import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    common = dict(
        slicing={"layout": "global", "tie_head": True},
        pipeline=[{"strategy": "pca"}],
        sparsity=_DELETE,
        target_params=0.75,
    )
    recipe = write_recipe(
        tmp_path,
        checkpoint,
        **common,
        refinement={"windows": 1, "epochs": 40, "lr": 0.1, "batch_size": 1, "top_k": 1, "heldout_windows": 8},
    )
    assert main(["run", str(recipe)]) == 0
    said = capsys.readouterr()
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    refinement, (guard,) = report["refinement"], report["guards"]
    assert refinement["kept"] == "refined"  # its own objective fell...
    assert refinement["calibration_kl_after"] < refinement["calibration_kl_before"]
    assert guard["step"] == "refinement" and guard["windows"] == 8
    assert guard["kl_after"] > guard["kl_before"] and guard["kept"] is False  # ...the saved model got worse
    line = [text for text in (said.out + said.err).splitlines() if text.startswith("warning: refinement:")]
    assert len(line) == 1 and "so the model from before refinement is kept" in line[0]
    assert any("held-out KL of the saved model" in text for text in report["warnings"])
    assert "unrefined" not in report["metrics"]
    plain = write_recipe(tmp_path, checkpoint, **common, output="plain")  # the same walk, no refinement
    assert main(["run", str(plain)]) == 0
    for name in ("model/model.safetensors", "bases.safetensors"):
        saved, unrefined = (load_file(str(tmp_path / run / name)) for run in ("out", "plain"))
        assert [key for key in saved if not torch.equal(saved[key], unrefined[key])] == []


def test_guard_windows_the_data_cannot_give_are_one_line(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, refinement={"heldout_windows": 100_000})
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: refinement.heldout_windows: 100000 windows after the 4")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial*"))


def test_the_unrefined_figure_is_the_model_that_would_have_been_saved(tmp_path: Path) -> None:
    """A global layout's `metrics.unrefined` is the stock model the run saves without refinement
    (its tied head included), not the sliced model with its untied head: the figure a user
    compares the refined model with."""
    from tests.conftest import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    common = dict(
        slicing={"layout": "global", "tie_head": True},
        pipeline=[{"strategy": "pca"}],
        sparsity=_DELETE,
        target_params=0.75,
    )
    refined = write_recipe(
        tmp_path,
        checkpoint,
        **common,
        refinement={"epochs": 3, "lr": 0.05, "batch_size": 2, "top_k": 0, "heldout_windows": 8},
    )
    assert main(["run", str(refined)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["guards"][0]["kept"] and report["stock"]["tied_fit"] == "symmetric, then refined"
    plain = write_recipe(tmp_path, checkpoint, **common, output="plain")
    assert main(["run", str(plain)]) == 0
    unrefined = json.loads((tmp_path / "plain" / "report.json").read_text())["metrics"]["pruned"]
    assert report["metrics"]["unrefined"] == unrefined
