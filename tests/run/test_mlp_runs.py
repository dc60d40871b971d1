"""`mlp:` in a recipe (issue 34): the MLP's width pruned with the residual width under one budget,
saved so that plain transformers loads it, reported; bad settings refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.cli import main
from compressor.evaluation.metrics import parameter_count
from tests.conftest import save_tiny_checkpoint
from tests.run.test_cli import _DELETE, write_recipe


def _report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


def test_a_global_run_with_mlp_saves_the_original_class_at_both_widths(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """target_params 0.75 with half the MLP's neurons: the residual width takes what the budget
    leaves (no narrower than without mlp; the tiny model's embeddings and the stock width's step of
    16 leave it at 48 here), the parameter count is the plan's to the parameter, and the folder is a
    plain Llama with hidden_size k and intermediate_size 64."""
    common = dict(sparsity=_DELETE, target_params=0.75, slicing={"layout": "global"})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = write_recipe(tmp_path / "a", tiny_checkpoint, output=str(tmp_path / "plain"), **common)
    assert main(["run", str(plain)]) == 0
    recipe = write_recipe(tmp_path / "b", tiny_checkpoint, output=str(tmp_path / "mlp"), mlp={"kept": 0.5}, **common)
    assert main(["run", str(recipe)]) == 0
    report, without = _report(tmp_path / "mlp"), _report(tmp_path / "plain")
    assert report["kept_width"] >= without["kept_width"]
    assert report["params"]["pruned"] < without["params"]["pruned"]
    assert report["params"]["pruned"] == report["allocation"]["predicted_params"] <= report["allocation"]["budget"]
    assert report["mlp"]["kept"] == 64 and report["mlp"]["of"] == 128 and len(report["mlp"]["layers"]) == 2
    assert not report["mlp"]["weighed_by_h"]  # a pca walk estimates no H
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mlp" / "model")
    assert model.config.model_type == "llama" and model.config.intermediate_size == 64
    assert model.config.hidden_size == report["kept_width"]
    assert parameter_count(model) == report["params"]["pruned"]
    assert "| MLP width | 128 | 64 (obs, refitted, feedback 0.5) |" in (tmp_path / "mlp" / "report.md").read_text()


def test_a_per_site_run_with_mlp_weighs_by_h_and_reloads(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, pipeline=[{"strategy": "sensitivity"}], mlp={"kept": 96})
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    assert report["mlp"]["weighed_by_h"] and report["mlp"]["kept"] == 96
    assert all(layer["error_refit"] <= layer["error_dropped"] for layer in report["mlp"]["layers"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    assert model.config.intermediate_size == 96
    assert {m.out_features for name, m in model.named_modules() if name.endswith("up_proj")} == {96}
    assert parameter_count(model) == report["params"]["pruned"] == report["allocation"]["predicted_params"]
    ids = torch.randint(3, 100, (1, 12))
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_a_run_with_mlp_reconstruct_trains_the_kept_weights_and_reports_it(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """`mlp.reconstruct`: the same run as without it up to the refit, then each MLP's kept weights
    trained: the saved model reloads as the original class at the same widths, its MLP weights
    differ from the refit's, every layer's held-out error is no higher than the refit's, and
    report.md says so."""
    common = dict(pipeline=[{"strategy": "sensitivity"}], evaluation=None, calibration__num_samples=16)
    runs = {}
    for name, extra in (("refit", {}), ("rebuilt", {"reconstruct": {"steps": 100, "batch_tokens": 256, "lr": 0.05}})):
        (tmp_path / name).mkdir()
        recipe = write_recipe(
            tmp_path / name, tiny_checkpoint, output=str(tmp_path / name / "out"), mlp={"kept": 64, **extra}, **common
        )
        assert main(["run", str(recipe)]) == 0
        runs[name] = (
            _report(tmp_path / name / "out"),
            AutoModelForCausalLM.from_pretrained(tmp_path / name / "out" / "model"),
        )
    (plain, refit), (report, rebuilt) = runs["refit"], runs["rebuilt"]
    assert rebuilt.config.intermediate_size == refit.config.intermediate_size == 64
    assert report["params"]["pruned"] == plain["params"]["pruned"] == parameter_count(rebuilt)
    layers = report["mlp"]["layers"]
    rebuilt_on = [layer["reconstruction"]["tokens"] + layer["reconstruction"]["heldout_tokens"] for layer in layers]
    assert rebuilt_on == [layer["tokens"] for layer in layers]  # every counted token, trained on or held out
    assert all(layer["reconstruction"]["weighed_by_h"] for layer in layers)
    assert all(layer.get("reconstruction") is None for layer in plain["mlp"]["layers"])
    moved = [
        not torch.equal(a.mlp.gate_proj.weight, b.mlp.gate_proj.weight)
        for a, b in zip(rebuilt.model.layers, refit.model.layers)
    ]
    trained = [layer["reconstruction"]["best_step"] > 0 for layer in layers]
    assert moved == trained and any(trained)
    assert (
        "mlp.reconstruct (held-out error, mean over layers)" in (tmp_path / "rebuilt" / "out" / "report.md").read_text()
    )


def test_the_dry_run_names_the_reconstruction(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`--dry-run` says what `mlp.reconstruct` will do, only where it is set, and writes nothing.
    (Its memory phase is not compared here: the printed phases carry this process's own memory,
    measured at each plan, which moved by more than the tiny model's pairs in the full suite.)"""
    for name, mlp in (
        ("rebuilt", {"kept": 64, "reconstruct": {"steps": 7, "batch_tokens": 96}}),
        ("plain", {"kept": 64}),
    ):
        (tmp_path / name).mkdir()
        recipe = write_recipe(tmp_path / name, tiny_checkpoint, output=str(tmp_path / name / "out"), mlp=mlp)
        assert main(["run", str(recipe), "--dry-run"]) == 0
        captured = capsys.readouterr()
        out = captured.out + captured.err
        assert ("mlp.reconstruct: after the refit, each MLP's kept weights take 7 Adam steps of 96 tokens" in out) == (
            name == "rebuilt"
        )
        assert not (tmp_path / name / "out").exists()


@pytest.mark.parametrize(
    ("mlp", "family", "message"),
    [
        ({"kept": 1.5}, "llama", "mlp.kept 1.5: give a whole number of neurons, or a fraction below 1"),
        ({"kept": 0.5, "reconstruct": {"steps": 0}}, "llama", "mlp.reconstruct.steps"),
        ({"kept": 0.5, "reconstruct": {}}, "qwen3_moe", "mlp.reconstruct trains each dense MLP module"),
        ({"kept": 200}, "llama", "mlp.kept 200 keeps 200 of the MLP's 128 neurons; keep between 1 and 128"),
        ({"kept": 0.5, "selector": "obss"}, "llama", "unknown neuron selector 'obss' (did you mean 'obs'?)"),
        ({}, "gpt2", "does not describe its MLP's width (ModelFamily.mlp_width)"),
        ({"kept": 0.5}, "gpt2", "does not describe its MLP's width (ModelFamily.mlp_width)"),
    ],
)
def test_bad_mlp_settings_are_one_line_and_write_nothing(
    mlp: dict, family: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / family, family)
    extra = {"slicing": {"slice_head": True}} if family == "gpt2" else {}
    recipe = write_recipe(tmp_path, checkpoint, mlp=mlp, **extra)
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_sweep_of_mlp_runs_without_saved_models_is_refused_before_work(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A run without model/ is rebuilt from its bases, which do not hold the pruned MLPs."""
    import yaml

    write_recipe(tmp_path, tiny_checkpoint, mlp={"kept": 0.5})
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": "recipe.yaml", "output": "sweep-out", "grid": {"sparsity": [0.25]}}))
    assert main(["sweep", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert "prunes the MLP (mlp)" in err and "set save_models: true" in err and err.count("\n") == 1
    assert not (tmp_path / "sweep-out").exists()


def test_a_run_killed_while_pruning_the_mlp_resumes_to_a_bit_identical_model(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """SIGKILL after the first layer's MLP: the walk's sites come back from the checkpoint and the
    stage runs again, to the model an uninterrupted run saves, tensor for tensor."""
    from tests.run.test_resume import killed_and_resumed_is_whole

    recipe = write_recipe(
        tmp_path, tiny_checkpoint, evaluation=None, pipeline=[{"strategy": "sensitivity"}], mlp={"kept": 0.5}
    )
    killed_and_resumed_is_whole(recipe, tmp_path, "mlp:0", sites=5)


@pytest.mark.parametrize(("family", "width_key"), [("opt", "ffn_dim"), ("phi3", "intermediate_size")])
def test_other_families_save_their_mlp_width_and_reload(family: str, width_key: str, tmp_path: Path) -> None:
    """OPT (fc1/fc2, its width in `ffn_dim`) and Phi-3 (a fused gate_up projection): the saved
    per-site folder reloads (its remote code) with the MLP's width in the config, every MLP at
    that width, the run's parameter count and finite logits."""
    checkpoint = save_tiny_checkpoint(tmp_path / family, family)
    recipe = write_recipe(tmp_path, checkpoint, mlp={"kept": 40})
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model", trust_remote_code=True)
    assert getattr(model.config, width_key) == 40 == report["mlp"]["kept"]
    down = "fc2" if family == "opt" else "down_proj"
    assert {m.in_features for name, m in model.named_modules() if name.endswith(down)} == {40}
    assert parameter_count(model) == report["params"]["pruned"] == report["allocation"]["predicted_params"]
    assert torch.isfinite(model(input_ids=torch.randint(3, 100, (1, 12))).logits).all()


def test_mlp_composes_with_shared_bases_and_distillation(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The MLP's width beside shared bases (the budget's polynomial without some transitions) and
    before a distillation (the student trained is the pruned one): the saved model has the MLP's
    width and exactly the plan's parameters."""
    recipe = write_recipe(
        tmp_path,
        tiny_checkpoint,
        slicing={"shared_bases": True},
        mlp={"kept": 0.5},
        distillation={"tokens": 512, "seq_len": 32, "batch_size": 4, "heldout_windows": 4, "eval_every": 2},
    )
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    assert report["distillation"] is not None and report["mlp"]["kept"] == 64
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model", trust_remote_code=True)
    assert model.config.intermediate_size == 64
    assert parameter_count(model) == report["params"]["pruned"] == report["allocation"]["predicted_params"]
