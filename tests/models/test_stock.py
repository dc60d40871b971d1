"""One residual basis saved as the original architecture (`slicing.layout: global`): the saved
folder loads with plain transformers (compressor blocked, no remote code) and computes what the
pruned model computes; with nothing sliced it computes what the original computes; budgets are
met exactly; a killed run resumes bit for bit; families the stock class cannot express are
refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from compressor.cli import main
from compressor.engine.bases import load_bases
from compressor.engine.pooling import GlobalPool, PipelineStep
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.models.families import BUILTIN_FAMILIES, family_for
from compressor.models.layout import fixed_layout
from compressor.models.sites import site_ids
from compressor.models.stock import stock_param_model, tied_scale
from compressor_plugins.pca import PCA
from tests.conftest import (
    FAMILY_CONFIGS,
    random_batches,
    save_tiny_checkpoint,
    tiny_model,
)
from tests.run.test_cli import write_recipe
from tests.run.test_resume import compress, tensors

STOCK_FAMILIES = sorted(t for f in BUILTIN_FAMILIES if f.stock_refusal is None for t in f.model_types)
OTHERS = sorted(set(FAMILY_CONFIGS) - set(STOCK_FAMILIES))


def test_the_built_in_families_say_whether_their_class_can_hold_one_basis() -> None:
    assert STOCK_FAMILIES == [
        "gemma",
        "gpt_oss",
        "granite",
        "llama",
        "mistral",
        "mixtral",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_5_moe_text",
        "qwen3_5_text",
        "qwen3_moe",
        "smollm3",
    ]
    assert OTHERS == ["gemma2", "gemma3_text", "gpt2", "olmo2", "olmo3", "olmoe", "opt", "phi"]


def test_target_params_and_rounding_for_kernels(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = write_recipe(
        tmp_path,
        tiny_checkpoint,
        sparsity=None,
        target_params=0.8,
        evaluation=None,
        slicing={"layout": "global", "round_to": 16},
    )
    text = recipe.read_text().replace("sparsity: null\n", "")
    recipe.write_text(text)
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    config = AutoConfig.from_pretrained(tiny_checkpoint)
    params = stock_param_model(config, family_for("llama"), tied=False)
    rounding = report["rounding"]
    assert rounding["width"] % 16 == 0
    assert report["params"]["pruned"] == params.count({s: rounding["width"] for s in params.sites})
    assert (
        report["params"]["pruned"]
        <= int(0.8 * params.original)
        < params.count({s: rounding["width"] + 16 for s in params.sites})
    )
    assert rounding["unrounded_params"] <= int(0.8 * params.original)


def test_a_killed_global_run_resumes_to_a_bit_identical_model(tmp_path: Path) -> None:
    """A tied model kept tied: after the last site the resumed walk still measures the stream
    the head reads (the tied scale's weights)."""
    checkpoint = save_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    recipe = write_recipe(
        tmp_path,
        checkpoint,
        evaluation=None,
        pipeline=[{"strategy": "sensitivity"}],
        slicing={"layout": "global", "tie_head": True},
    )
    uninterrupted = compress(recipe, tmp_path / "whole")
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    expected = tensors(tmp_path / "whole")
    assert "lm_head.weight" not in load_file(str(tmp_path / "whole" / "model" / "model.safetensors"))
    for point, loaded in (("site:layers.0.mlp", 3), ("site:layers.1.mlp", 5)):
        output = tmp_path / point.replace(":", "-")
        assert compress(recipe, output, kill=point).returncode == -9
        resumed = compress(recipe, output)
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads((output / "report.json").read_text())["resume"]["sites_loaded"] == loaded
        produced = tensors(output)
        assert produced.keys() == expected.keys()
        assert [k for k, v in expected.items() if not torch.equal(produced[k], v)] == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(slicing={"layout": "global", "shared_bases": True}), "remove slicing.shared_bases"),
        (dict(slicing={"layout": "global"}, allocation={"method": "curves"}), "allocation.method must be uniform"),
        (dict(slicing={"layout": "everywhere"}), "slicing.layout must be one of"),
        (dict(slicing={"layout": "global", "pooling": "max"}), "slicing.pooling must be one of"),
    ],
)
def test_what_a_global_layout_cannot_take_is_one_line(
    changes: dict, message: str, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, **changes)
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_trace_pooling_weighs_every_site_alike() -> None:
    torch.manual_seed(0)
    a, b = (torch.randn(6, 6, dtype=torch.float64) for _ in range(2))
    C1, C2 = a @ a.T, b @ b.T
    trace, raw = GlobalPool("trace"), GlobalPool("sum")
    for pool, scale in ((trace, 1.0), (raw, 1.0)):
        pool.add("embedding", C1, 10, None)
        pool.add("layers.0.attn", scale * C2, 10, None)
    louder = GlobalPool("trace")
    louder.add("embedding", C1, 10, None)
    louder.add("layers.0.attn", 1000 * C2, 10, None)
    assert torch.allclose(louder.pooled().C, trace.pooled().C)
    assert torch.allclose(raw.pooled().C, C1 + C2)
    assert trace.pooled().names == ["embedding", "layers.0.attn"]


def test_the_global_basis_is_chosen_from_every_site(tmp_path: Path) -> None:
    """PCA on the trace-pooled C of every site of the unsliced model (the survey), applied everywhere."""
    model = tiny_model("llama")
    family = family_for("llama")
    ids = site_ids(family, 2)
    batches = random_batches(128)
    result = prune(
        model, fixed_layout(model.config, family, {s: 40 for s in ids}, layout="global"), batches, [PipelineStep(PCA())]
    )
    assert result.sites[0].pooled_with == ids[1:]
    assert [r.steps[0]["strategy"] for r in result.sites[1:]] == ["shared"] * 4
    # The same basis from the survey's statistics, computed here by hand.
    from compressor.engine.calibration import capture_layer_inputs
    from compressor.engine.fisher import site_activations
    from compressor.engine.transforms import fuse_norms

    reference = tiny_model("llama")
    fuse_norms(reference, family)
    inputs = capture_layer_inputs(reference, family, batches, torch.device("cpu"))
    pooled = torch.zeros(64, 64, dtype=torch.float64)
    sums = [torch.zeros(64, 64, dtype=torch.float64) for _ in ids]
    for b in range(len(inputs)):
        streams = site_activations(reference, family, inputs, b, lambda _, stream: stream)[0]
        mask = inputs.token_masks[b].reshape(-1).bool()
        for i, stream in enumerate(streams):
            x = stream.reshape(-1, 64)[mask].to(torch.float64)
            sums[i] += x.T @ x
    for total in sums:
        pooled += total / torch.trace(total)
    expected = torch.linalg.eigh(pooled).eigenvectors[:, -40:]
    kept = result.bases["embedding"]
    assert torch.allclose(kept @ kept.T, expected @ expected.T, atol=1e-8)
    # the sites' statistics as the sliced model makes them are pooled only when asked
    assert result.walked is None
    asked = prune(
        tiny_model("llama"),
        fixed_layout(model.config, family, {s: 40 for s in ids}, layout="global"),
        batches,
        [PipelineStep(PCA())],
        WalkOptions(pool_walked=True),
    )
    assert asked.walked is not None and asked.walked.names == ids
    assert torch.equal(asked.bases["embedding"], kept)


def test_the_tied_scale_is_the_least_squares_diagonal() -> None:
    torch.manual_seed(0)
    A, B = torch.randn(50, 6, dtype=torch.float64), torch.randn(50, 6, dtype=torch.float64)
    m = torch.randn(6, 6, dtype=torch.float64)
    N = m @ m.T
    D = tied_scale(A, B, N, rows=7)  # chunked over the vocabulary rows

    def loss(d: torch.Tensor) -> float:
        error = A * d - B
        return float(torch.trace(error @ N @ error.T))

    for j in range(6):
        for step in (1e-3, -1e-3):
            moved = D.clone()
            moved[j] += step
            assert loss(moved) > loss(D)
    g = torch.rand(6, dtype=torch.float64) + 0.5
    assert torch.allclose(tied_scale(A, A * g, N), g)  # exact where a diagonal maps one onto the other


def test_refinement_keeps_one_basis(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = write_recipe(
        tmp_path, tiny_checkpoint, slicing={"layout": "global"}, refinement={"epochs": 1, "batch_size": 2, "lr": 0.05}
    )
    assert main(["run", str(recipe)]) == 0
    bases = load_bases(tmp_path / "out" / "bases.safetensors")
    assert all(torch.equal(v, bases["embedding"]) for v in bases.values())
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["refinement"]["kept"] in ("refined", "received")
    weights = load_file(str(tmp_path / "out" / "model" / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape[1] == report["stock"]["hidden_size"]


def test_a_tied_model_stays_tied_by_default_in_a_global_layout(tmp_path: Path) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    recipe = write_recipe(tmp_path, checkpoint, slicing={"layout": "global"})
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["stock"]["head"] == "tied" and report["stock"]["tied_scale"]["weighted_by_stream"]
    assert report["stock"]["tied_fit"] == "symmetric"  # the basis rotated for the tied head (slicing.tied_fit)
    config = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(str(tmp_path / "out" / "model" / "model.safetensors"))
    params = stock_param_model(AutoConfig.from_pretrained(checkpoint), family_for("qwen2"), tied=True)
    assert report["params"]["pruned"] == params.count({s: report["stock"]["hidden_size"] for s in params.sites})
    untied = write_recipe(tmp_path, checkpoint, slicing={"layout": "global", "tie_head": False}, output="untied")
    assert main(["run", str(untied)]) == 0
    wider = json.loads((tmp_path / "untied" / "report.json").read_text())
    assert wider["stock"]["head"] == "untied" and wider["stock"]["hidden_size"] < report["stock"]["hidden_size"]


def test_the_width_is_one_the_stock_config_accepts(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """transformers' LlamaConfig refuses a hidden_size off the number of heads (its model reads
    head_dim): the plan rounds to both, and the report says so."""
    recipe = write_recipe(
        tmp_path, tiny_checkpoint, evaluation=None, sparsity=0.3, slicing={"layout": "global", "round_to": 1}
    )
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["rounding"]["class_multiple"] == 4 and report["rounding"]["step"] == 4
    assert report["stock"]["hidden_size"] % 4 == 0
    assert report["rounding"]["unrounded_width"] == report["rounding"]["width"]


@pytest.mark.parametrize("k", [12, 20])
def test_the_symmetric_tied_fit_beats_the_diagonal_and_is_exact_at_full_width(k: int) -> None:
    """`tied_rotation`'s R·diag(D)·Rᵀ is the weighted least-squares symmetric map from the sliced
    embedding to the untied head: never worse than `tied_scale`'s diagonal, no symmetric
    perturbation improves it, and at k = d (nothing sliced) it is Vᵀ·diag(g)·V, exact."""
    from compressor.models.stock import tied_rotation, tied_scale

    generator = torch.Generator().manual_seed(0)
    d = 20
    E = torch.randn(500, d, generator=generator, dtype=torch.float64)
    g = torch.rand(d, generator=generator, dtype=torch.float64) * 2 + 0.2
    V = torch.linalg.qr(torch.randn(d, k, generator=generator, dtype=torch.float64))[0]
    X = torch.randn(1000, d, generator=generator, dtype=torch.float64) @ torch.randn(
        d, d, generator=generator, dtype=torch.float64
    )
    N = V.T @ (X.T @ X / 1000) @ V
    A, B = E @ V, E @ torch.diag(g) @ V

    def loss(S: torch.Tensor) -> float:
        residual = A @ S - B
        return float(torch.trace(residual @ N @ residual.T))

    R, D = tied_rotation(A, B, N)
    assert torch.allclose(R.T @ R, torch.eye(k, dtype=torch.float64), atol=1e-10)
    S = R @ torch.diag(D) @ R.T
    diagonal = loss(torch.diag(tied_scale(A, B, N)))
    assert loss(S) <= diagonal
    for _ in range(5):
        P = torch.randn(k, k, generator=generator, dtype=torch.float64) * 1e-4
        assert loss(S + P + P.T) >= loss(S)
    if k == d:
        assert torch.allclose(S, V.T @ torch.diag(g) @ V, atol=1e-8) and loss(S) < 1e-12 * diagonal
    else:
        assert loss(S) < 0.9 * diagonal


def test_target_params_can_count_the_non_embedding_parameters(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    """`budget: non_embedding`: the saved stock model's parameters outside its embedding tables are
    the budget's, at the widest width they allow; the plan says what it counts."""
    recipe = write_recipe(
        tmp_path,
        tiny_checkpoint,
        sparsity=None,
        target_params=0.8,
        evaluation=None,
        slicing={"layout": "global", "round_to": 16},
        budget="non_embedding",
    )
    recipe.write_text(recipe.read_text().replace("sparsity: null\n", ""))
    params = stock_param_model(AutoConfig.from_pretrained(tiny_checkpoint), family_for("llama"), tied=False)
    counted = params.without_embedding()
    budget = int(0.8 * counted.original)
    assert main(["run", str(recipe), "--dry-run"]) == 0
    assert f"budget {budget:,} of {counted.original:,} non-embedding parameters" in capsys.readouterr().out
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    width = report["rounding"]["width"]
    saved = load_file(tmp_path / "out" / "model" / "model.safetensors")
    outside = sum(t.numel() for name, t in saved.items() if "embed_tokens" not in name)
    assert report["allocation"]["budget"] == budget
    assert outside == report["allocation"]["predicted_params"] == counted.count({s: width for s in params.sites})
    assert outside <= budget < counted.count({s: width + 16 for s in params.sites})


def test_a_non_embedding_budget_needs_target_params(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None, budget="non_embedding")
    assert main(["run", str(recipe), "--dry-run"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "budget: non_embedding" in error and "set target_params" in error
