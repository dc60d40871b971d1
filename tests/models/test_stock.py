"""One residual basis saved as the original architecture (`slicing.layout: global`): the saved
folder loads with plain transformers (compressor blocked, no remote code) and computes what the
pruned model computes; with nothing sliced it computes what the original computes; budgets are
met exactly; a killed run resumes bit for bit; families the stock class cannot express are
refused before any work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from compressor.cli import main
from compressor.engine.bases import apply_bases, load_bases
from compressor.engine.pooling import GlobalPool, PipelineStep
from compressor.engine.walk import WalkOptions, prune
from compressor.models.families import BUILTIN_FAMILIES, family_for
from compressor.models.layout import fixed_layout
from compressor.models.sites import site_ids
from compressor.models.stock import load_stock, save_stock, stock_param_model, tied_scale
from compressor_plugins.pca import PCA
from tests.conftest import (
    FAMILY_CONFIGS,
    copy_model,
    max_relative_logit_error,
    random_batches,
    save_tiny_checkpoint,
    tiny_model,
)
from tests.run.test_cli import write_recipe
from tests.run.test_resume import compress, tensors

STOCK_FAMILIES = sorted(t for f in BUILTIN_FAMILIES if f.stock_refusal is None for t in f.model_types)
OTHERS = sorted(set(FAMILY_CONFIGS) - set(STOCK_FAMILIES))

LOAD_WITHOUT_COMPRESSOR = """
import json, sys
sys.modules["compressor"] = None  # importing compressor (or anything under it) now fails
import torch
from transformers import AutoModelForCausalLM
ids = torch.tensor(json.loads(sys.argv[2]))
for folder in sys.argv[3:]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.save({"class": type(model).__name__, "logits": logits}, folder + "/../stock-logits.pt")
"""


def test_the_built_in_families_say_whether_their_class_can_hold_one_basis() -> None:
    assert STOCK_FAMILIES == ["gemma", "llama", "mistral", "phi3", "qwen2", "qwen3"]
    assert OTHERS == ["gemma2", "gpt2", "opt", "phi"]


@pytest.mark.parametrize("name", STOCK_FAMILIES)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_with_nothing_sliced_the_stock_model_computes_the_original(name: str, tie: bool, tmp_path: Path) -> None:
    original = tiny_model(name)
    if tie and not original.config.tie_word_embeddings:
        pytest.skip("the original's head is untied")
    config = tiny_model(name).config
    family = family_for(name)
    d = config.hidden_size
    bases = {site: torch.eye(d, dtype=torch.float64) for site in site_ids(family, config.num_hidden_layers)}
    sliced = apply_bases(copy_model(original), family, bases, keep_tied=False)
    save_stock(sliced, family, config, tmp_path, tie=tie)
    stock = load_stock(tmp_path, sliced)
    assert type(stock) is type(original)
    assert stock.config.tie_word_embeddings == tie
    assert max_relative_logit_error(original, stock, random_batches(config.vocab_size, padded=True)) < 2e-6


@pytest.fixture(scope="module")
def global_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A global-layout PCA run at sparsity 0.25 on a tiny model of every stock family (heads
    untied, so the saved model computes exactly what the sliced one does), and the
    logits of each saved folder as plain transformers computes them in a fresh interpreter where
    compressor cannot be imported."""
    root = tmp_path_factory.mktemp("global")
    runs = {}
    for name in STOCK_FAMILIES:
        folder = root / name
        folder.mkdir()
        checkpoint = save_tiny_checkpoint(folder / "original", name)
        recipe = write_recipe(
            folder, checkpoint, slicing={"layout": "global", "tie_head": False}, output=str(folder / "run")
        )
        assert main(["run", str(recipe)]) == 0
        runs[name] = folder / "run"
    ids = random_batches(8192, count=1, batch=2, length=16)[0].input_ids
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_WITHOUT_COMPRESSOR,
            "-",
            json.dumps(ids.tolist()),
            *(str(run / "model") for run in runs.values()),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert loaded.returncode == 0, loaded.stderr
    return runs


@pytest.mark.parametrize("name", STOCK_FAMILIES)
def test_a_global_run_saves_a_stock_model_that_computes_the_pruned_model(
    name: str, global_runs: dict[str, Path]
) -> None:
    run = global_runs[name]
    config = json.loads((run / "model" / "config.json").read_text())
    original = json.loads((run.parent / "original" / "config.json").read_text())
    assert config["model_type"] == original["model_type"] and "auto_map" not in config
    assert config["architectures"] == original["architectures"]
    assert not list((run / "model").glob("*.py"))
    assert config["hidden_size"] < original["hidden_size"] and config["head_dim"] == 16
    saved = torch.load(run / "stock-logits.pt")
    assert saved["class"] == original["architectures"][0]
    # The pruned model as compressor's sliced class computes it, rebuilt from the run's bases.
    family = family_for(name)
    bases = load_bases(run / "bases.safetensors")
    assert len({tuple(v.shape) for v in bases.values()}) == 1
    assert all(torch.equal(v, bases["embedding"]) for v in bases.values())
    from transformers import AutoModelForCausalLM

    sliced = apply_bases(
        AutoModelForCausalLM.from_pretrained(run.parent / "original", dtype=torch.float32),
        family,
        bases,
        keep_tied=False,
    )
    ids = random_batches(8192, count=1, batch=2, length=16)[0].input_ids
    with torch.no_grad():
        expected = sliced(input_ids=ids).logits
    error = ((saved["logits"] - expected).abs().max() / expected.abs().max()).item()
    assert error < 1e-5  # float32 round-off (per-head q/k norms amplify it most)


@pytest.mark.parametrize("name", STOCK_FAMILIES)
def test_a_global_run_meets_its_budget_exactly(name: str, global_runs: dict[str, Path]) -> None:
    report = json.loads((global_runs[name] / "report.json").read_text())
    rounding, budget = report["rounding"], report["allocation"]["budget"]
    params = stock_param_model(
        AutoConfig.from_pretrained(global_runs[name].parent / "original"), family_for(name), tied=False
    )
    assert report["layout"] == "global" and report["stock"]["hidden_size"] == rounding["width"]
    assert report["params"]["pruned"] == rounding["params"] == report["allocation"]["predicted_params"]
    assert rounding["params"] <= budget < params.count({s: rounding["width"] + 8 for s in params.sites})
    assert (
        rounding["unrounded_params"]
        <= budget
        < params.count({s: rounding["unrounded_width"] + 1 for s in params.sites})
    )
    assert rounding["width"] % 8 == 0 and rounding["unrounded_width"] >= rounding["width"]
    assert report["allocation"]["transition_params"] == 0
    # The same budget as SliceGPT's model at 25% (48 of 64 at every site, transitions counted) keeps more width.
    assert rounding["width"] > 48


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


@pytest.mark.parametrize("name", OTHERS)
def test_families_the_stock_class_cannot_hold_are_refused_before_work(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    checkpoint = tmp_path / "model"
    AutoConfig.for_model(
        **{
            **dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                vocab_size=128,
                max_position_embeddings=128,
            ),
            **FAMILY_CONFIGS[name],
        }
    ).save_pretrained(checkpoint)
    recipe = write_recipe(tmp_path, checkpoint, slicing={"layout": "global", "slice_head": True})
    for args in (["--dry-run"], []):
        assert main(["run", str(recipe), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: slicing.layout: global saves the original")
        assert "model types that can: gemma, llama, mistral, phi3, qwen2, qwen3" in err
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial*"))


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


def test_eval_rebuilds_a_global_run_without_its_model_as_the_stock_class(
    global_runs: dict[str, Path], tmp_path: Path
) -> None:
    """A sweep keeps only bases: `compress eval` rebuilds the stock model (a tied original's head
    untied, as the run saved it) and reproduces the run's own figures."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(global_runs["qwen2"], run)
    shutil.rmtree(run / "model")
    assert main(["eval", str(run), "--no-throughput", "--output", str(tmp_path / "eval.json")]) == 0
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    ran = json.loads((run / "report.json").read_text())
    assert "rebuilt" in evaluated["target"]
    for key in ("ppl", "kl"):
        assert evaluated["metrics"]["pruned"][key] == pytest.approx(ran["metrics"]["pruned"][key], rel=1e-5)


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
