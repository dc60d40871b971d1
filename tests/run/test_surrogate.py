"""The surrogate check (Figure 2a): its prediction is the true second-order KL where the local
model's approximations are exact; its rows are what they claim; the command writes its files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from compressor.commands.surrogate import (
    JSON_FILE,
    PLOT_FILE,
    Measuring,
    SurrogateOptions,
    SurrogateResult,
    check_recipe,
    probe_directions,
    rank_correlation,
    surrogate_check,
)
from compressor.data.batches import Batch
from compressor.engine.calibration import SecondMoment, capture_layer_inputs
from compressor.engine.fisher import estimate_fisher, site_activations
from compressor.errors import UserError
from compressor.models.families import family_for
from compressor.models.sites import site_ids
from compressor.recipe.schema import load_recipe
from compressor.recipe.sections.sensitivity import SensitivityOptions
from compressor.strategies.registry import PluginRegistry
from tests.conftest import random_batches, tiny_model
from tests.run.test_cli import write_recipe

LLAMA = family_for("llama")
FLOAT64 = SensitivityOptions(dtype="float64")


@pytest.mark.parametrize("site", ["embedding", "layers.0.mlp", "layers.1.mlp"])
def test_prediction_is_the_second_order_kl_where_the_local_model_is_exact(site: str) -> None:
    """One-token sequences of one token: no cross-token terms and one x and one Fisher for every
    token, so ½α²(uᵀHu)(uᵀCu) is the exact second-order KL, up to H's sampling error (8192
    sampled labels: a few %) and third-order terms (≈ 10⁻⁴ at this energy). A missing ½, α
    instead of α² (α is 10⁻³ to 10⁻¹ here), a wrongly scaled H or a perturbation at another site would be
    off by a factor, not by percent. The last site perturbs the head's input directly."""
    model = tiny_model("llama").double()
    calibration = [Batch(torch.full((8192, 1), 17), torch.ones(8192, 1, dtype=torch.long))]
    evaluation = [Batch(torch.full((1, 1), 17), torch.ones(1, 1, dtype=torch.long))]
    result = surrogate_check(
        model,
        LLAMA,
        calibration,
        evaluation,
        site,
        SurrogateOptions(directions=8, eigenvectors=0, energy=1e-8, measuring=Measuring(seed=3, sensitivity=FLOAT64)),
    )
    assert [r["kind"] for r in result.rows] == ["random"] * 8
    assert all(r["alpha"] < 0.1 for r in result.rows)
    ratios = [r["measured"] / r["predicted"] for r in result.rows]
    assert all(0.9 < ratio < 1.1 for ratio in ratios), ratios


@pytest.fixture(scope="module")
def checked() -> tuple[SurrogateResult, torch.nn.Module, list[Batch], list[Batch]]:
    model = tiny_model("llama").double()
    calibration = random_batches(128, count=3, length=16, seed=1)
    evaluation = random_batches(128, count=2, length=16, seed=2)  # float64 eager attention turns padding into NaN
    result = surrogate_check(
        model,
        LLAMA,
        calibration,
        evaluation,
        "layers.0.mlp",
        SurrogateOptions(directions=6, eigenvectors=3, remove=16, measuring=Measuring(seed=5, sensitivity=FLOAT64)),
    )
    return result, model, calibration, evaluation


def test_every_direction_removes_the_same_energy_and_the_rows_recompute(checked) -> None:
    """Rows checked against C, H and KL computed independently (a whole-model forward with an
    edit at the site, as the diagnostics do, instead of the check's rerun from the site)."""
    result, model, calibration, evaluation = checked  # the model's norms are fused by now
    index = site_ids(LLAMA, 2).index("layers.0.mlp")
    inputs = capture_layer_inputs(model, LLAMA, calibration, torch.device("cpu"))
    moment = SecondMoment(64, torch.device("cpu"))
    with torch.no_grad():
        for b in range(len(inputs)):
            moment.add(site_activations(model, LLAMA, inputs, b)[0][index], inputs.token_masks[b])
    C = moment.value()
    H = estimate_fisher(model, LLAMA, inputs, FLOAT64, torch.device("cpu"), seed=5)["layers.0.mlp"]
    energy = torch.linalg.eigvalsh(C)[:16].sum().item()  # PCA's, removing 16 of 64
    assert result.settings["energy"] == pytest.approx(energy, rel=1e-9)
    assert [r["kind"] for r in result.rows] == ["random"] * 6 + ["C-eigenvector"] * 3 + ["H-eigenvector"] * 3 + [
        "tau-minimiser"
    ] * 3
    held_out = capture_layer_inputs(model, LLAMA, evaluation, torch.device("cpu"))
    with torch.no_grad():
        reference = [torch.log_softmax(site_activations(model, LLAMA, held_out, b)[1], -1) for b in range(2)]
    for row in result.rows:
        assert row["alpha"] ** 2 * row["uCu"] == pytest.approx(energy, rel=1e-9)  # equal removed energy
    vectors = probe_directions(C, H, 6, 3, seed=5)
    assert len(vectors) == len(result.rows)
    for row, (_, _, u) in list(zip(result.rows, vectors))[::3]:
        uCu, uHu = (u @ C @ u).item(), (u @ H @ u).item()
        assert row["uCu"] == pytest.approx(uCu, rel=1e-9) and row["uHu"] == pytest.approx(uHu, rel=1e-6)
        assert row["predicted"] == pytest.approx(0.5 * energy * uHu, rel=1e-6)
        alpha = math.sqrt(energy / uCu)

        def edit(s: int, x: torch.Tensor) -> torch.Tensor:
            return x - alpha * (x @ u).unsqueeze(-1) * u if s == index else x  # noqa: B023

        total, count = 0.0, 0
        with torch.no_grad():
            for b in range(2):
                new = torch.log_softmax(site_activations(model, LLAMA, held_out, b, edit)[1], -1)
                mask = held_out.token_masks[b]
                total += (reference[b].exp() * (reference[b] - new)).sum(-1)[mask].sum().item()
                count += int(mask.sum())
        assert row["measured"] == pytest.approx(total / count, rel=1e-9)
        assert row["measured"] > 0
    assert result.settings["evaluation_tokens"] == count


def test_result_json_and_correlations(checked) -> None:
    result = checked[0]
    values = result.to_json()
    assert json.loads(json.dumps(values)) == values  # plain JSON
    assert values["directions"] == len(values["rows"]) == 15
    assert values["kinds"] == {"random": 6, "C-eigenvector": 3, "H-eigenvector": 3, "tau-minimiser": 3}
    predicted = [r["predicted"] for r in values["rows"]]
    measured = [r["measured"] for r in values["rows"]]
    assert values["spearman"] == pytest.approx(rank_correlation(predicted, measured))
    assert values["spearman_random"] == pytest.approx(rank_correlation(predicted[:6], measured[:6]))
    variance = [r["uCu"] for r in values["rows"]]
    assert values["spearman_variance"] == pytest.approx(rank_correlation(variance, measured))
    assert values["spearman_variance_random"] == pytest.approx(rank_correlation(variance[:6], measured[:6]))
    assert -1 <= values["spearman"] <= 1


def test_rank_correlation() -> None:
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 1000]) == pytest.approx(1.0)  # ranks, not values
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties take their average rank: ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4)
    expected = float(torch.corrcoef(torch.tensor([[1, 2.5, 2.5, 4], [1, 2, 3, 4]], dtype=torch.float64))[0, 1])
    assert rank_correlation([1, 5, 5, 9], [1, 2, 3, 4]) == pytest.approx(expected)
    assert rank_correlation([1, 2], [1, 2]) is None and rank_correlation([1, 1, 1], [1, 2, 3]) is None


def test_padding_is_not_counted() -> None:
    model = tiny_model("llama")
    evaluation = random_batches(128, count=2, length=16, seed=2, padded=True)
    result = surrogate_check(
        model,
        LLAMA,
        random_batches(128, count=1),
        evaluation,
        "layers.1.attn",
        SurrogateOptions(directions=3, eigenvectors=0, remove=8),
    )
    assert result.settings["evaluation_tokens"] == sum(int(b.attention_mask.sum()) for b in evaluation) < 2 * 4 * 16
    assert all(math.isfinite(r["measured"]) and r["measured"] > 0 for r in result.rows)


def test_unknown_site_is_a_user_error_naming_valid_ones() -> None:
    model = tiny_model("llama")
    batches = random_batches(128, count=1)
    with pytest.raises(UserError, match=r"unknown site 'layers\.7\.attn'; sites are embedding, layers\.0\.attn"):
        surrogate_check(model, LLAMA, batches, batches, "layers.7.attn", SurrogateOptions(directions=4, remove=8))


# --- the command ---------------------------------------------------------------------------


@pytest.fixture
def recipe_path(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return write_recipe(tmp_path, tiny_checkpoint, calibration__num_samples=4, evaluation__num_samples=2)


def test_check_recipe_writes_json_and_png(recipe_path: Path, tmp_path: Path) -> None:
    registry = PluginRegistry()
    recipe = load_recipe(recipe_path, registry)
    output = tmp_path / "new" / "surrogate"
    phases: list[str] = []
    values = check_recipe(recipe, registry, "layers.1.attn", 5, output, lambda phase, *_: phases.append(phase))
    assert sorted(p.name for p in output.iterdir()) == [JSON_FILE, PLOT_FILE]  # no temporary files left
    assert json.loads((output / JSON_FILE).read_text()) == values
    assert (output / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert values["site"] == "layers.1.attn" and values["kinds"]["random"] == 5
    settings = values["settings"]
    assert settings["remove"] == 16 and settings["sparsity"] == 0.25  # 64 wide, 48 kept at 25%
    assert settings["evaluation_tokens"] == 2 * 64 and settings["calibration_tokens"] == 4 * 64
    assert all(r["measured"] > 0 and r["predicted"] > 0 for r in values["rows"])
    assert "measuring KL" in phases and "estimating output sensitivity (H)" in phases


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_plot_leaves_no_files(
    recipe_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    """Nothing half-written stays: not the JSON written before the plot failed, not the half PNG,
    and not the folder the call made (a folder that was there keeps what it held)."""
    registry = PluginRegistry()
    recipe = load_recipe(recipe_path, registry)

    def broken(self: SurrogateResult, path: Path) -> None:
        Path(path).write_bytes(b"half a PNG")
        raise RuntimeError("disk full")

    monkeypatch.setattr(SurrogateResult, "plot", broken)
    output = tmp_path / "surrogate"
    if existing:
        output.mkdir()
        (output / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="disk full"):
        check_recipe(recipe, registry, "layers.0.attn", 2, output, None)
    if existing:
        assert [p.name for p in output.iterdir()] == ["notes.txt"]
    else:
        assert not output.exists()


@pytest.mark.parametrize(
    ("change", "site", "message"),
    [
        ({"evaluation": None}, "layers.0.attn", "add an evaluation section"),
        (
            {},
            "layers.2.attn",
            "unknown site 'layers.2.attn'; sites are embedding, layers.0.attn, layers.0.mlp, "
            "layers.1.attn, layers.1.mlp (5 in all)",
        ),
        ({"sparsity": 0.0}, "layers.0.attn", "removes no direction"),
        (
            {
                "sparsity": None,
                "target_params": 0.9,
                "allocation": {"method": "curves"},
                "pipeline": [{"strategy": "sensitivity"}],
            },
            "layers.0.attn",
            "give the recipe a sparsity",
        ),
    ],
)
def test_check_recipe_refuses_before_loading_anything(
    tiny_checkpoint: Path, tmp_path: Path, change: dict, site: str, message: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for file in tiny_checkpoint.iterdir():
        (model / file.name).write_bytes(file.read_bytes())
    (model / "model.safetensors").write_bytes(b"not a checkpoint")  # any weight load would fail
    registry = PluginRegistry()
    recipe = load_recipe(write_recipe(tmp_path, model, **change), registry)
    with pytest.raises(UserError) as error:
        check_recipe(recipe, registry, site, 4, tmp_path / "out", None)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_the_surrogate_command(recipe_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from compressor.cli import main

    output = tmp_path / "check"
    assert (
        main(
            [
                "surrogate",
                str(recipe_path),
                "--site",
                "layers.0.mlp",
                "--directions",
                "4",
                "--output",
                str(output),
                "--set",
                "evaluation.num_samples=1",
            ]
        )
        == 0
    )
    values = json.loads((output / JSON_FILE).read_text())
    assert values["settings"]["evaluation_tokens"] == 64 and values["kinds"]["random"] == 4
    assert f"Spearman ρ(predicted, measured KL) = {values['spearman']:.3f}" in capsys.readouterr().out
    assert main(["surrogate", str(recipe_path), "--site", "layers.9.mlp", "--output", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "layers.9.mlp" in err and err.count("\n") == 1 and not (tmp_path / "x").exists()
