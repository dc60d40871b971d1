"""`experts:` in a recipe (issue 48, items 2 and 3): a Mixture-of-Experts model's routed experts
pruned with the residual width under one budget, saved so that plain transformers loads it with
fewer experts and the run's logits, reported with each layer's fewest routed tokens; bad settings
refused in one line; a run killed in the stage resumes to the same model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.cli import main
from compressor.commands.compare import render
from compressor.commands.compare import rows as compare_rows
from compressor.data.text import batches_of, load_records, token_windows
from compressor.evaluation.metrics import compare, parameter_count
from tests.conftest import EXAMPLES, save_tiny_checkpoint, tiny_model
from tests.run.test_cli import _DELETE, write_recipe


def _report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


def _kl_of_reload(original: Path, saved: Path, remote: bool) -> float:
    """KL(original ‖ saved model as reloaded) on the recipe's evaluation windows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(original)
    windows = token_windows(
        load_records({"path": "json", "data_files": str(EXAMPLES / "data" / "valid-demo.jsonl")}), tokenizer, 64, 4
    )
    reference = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, trust_remote_code=remote)
    return compare(reference, reloaded, batches_of(windows, 2), torch.device("cpu"))["pruned"]["kl"]


@pytest.mark.parametrize("layout", ["per_site", "global"])
def test_a_run_with_experts_saves_fewer_experts_that_reload_to_the_run_s_model(
    layout: str, moe_checkpoint: Path, tmp_path: Path
) -> None:
    recipe = write_recipe(
        tmp_path,
        moe_checkpoint,
        sparsity=_DELETE,
        target_params=0.8,
        slicing={"layout": layout},
        pipeline=[{"strategy": "sensitivity"}],
        experts={"kept": 3},
    )
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    experts = report["experts"]
    assert experts["kept"] == 3 and experts["of"] == 4 and experts["selector"] == "output"
    assert len(experts["layers"]) == 1  # the tiny Qwen3-MoE's second layer is dense (mlp_only_layers)
    layer = experts["layers"][0]
    assert len(layer["kept"]) == 3 and layer["objectives"]["sensitivity"] == "H"
    assert experts["fewest_tokens"] == min(layer["tokens"]) > 0
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "| routed experts per MoE layer | 4 | 3 (output) |" in markdown
    assert f"|   fewest calibration tokens an expert saw |  | {experts['fewest_tokens']:,} |" in markdown
    saved = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert saved["num_experts"] == saved["num_local_experts"] == 3  # what vLLM and transformers read
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model", trust_remote_code=layout == "per_site")
    assert model.config.num_experts == 3
    if layout == "global":
        assert type(model).__name__ == "Qwen3MoeForCausalLM"
        assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 3
    assert parameter_count(model) == report["params"]["pruned"] == report["allocation"]["predicted_params"]
    assert report["params"]["pruned"] <= report["allocation"]["budget"]
    kl = _kl_of_reload(moe_checkpoint, tmp_path / "out" / "model", layout == "per_site")
    assert kl == pytest.approx(report["metrics"]["pruned"]["kl"], rel=1e-3, abs=1e-6)


STOCK_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}


@pytest.mark.parametrize(("name", "layout"), [("qwen3_moe", "global"), ("mixtral", "per_site"), ("gpt_oss", "global")])
def test_a_run_with_experts_and_mlp_saves_fewer_narrower_experts_that_reload_to_the_run_s_model(
    name: str, layout: str, tmp_path: Path
) -> None:
    """`mlp.kept` is every routed expert's width (Qwen3-MoE's moe_intermediate_size, Mixtral's and
    gpt-oss's intermediate_size), after `experts` chose which experts stay; gpt-oss's stock experts
    are saved transposed, gate and up interleaved, with their biases."""
    checkpoint = save_tiny_checkpoint(tmp_path / name, name)
    recipe = write_recipe(
        tmp_path,
        checkpoint,
        sparsity=_DELETE,
        target_params=0.8,
        slicing={"layout": layout},
        pipeline=[{"strategy": "sensitivity"}],
        experts={"kept": 3},
        mlp={"kept": 0.5},
        model__attn_implementation="eager",  # gpt-oss's class has no sdpa attention (its sinks)
    )
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    key = "moe_intermediate_size" if name == "qwen3_moe" else "intermediate_size"
    width = json.loads((checkpoint / "config.json").read_text())[key]
    assert report["mlp"]["kept"] == width // 2 and report["mlp"]["of"] == width
    layers = report["mlp"]["layers"]
    assert len(layers) == len(report["experts"]["layers"])  # one record per MoE layer; a dense one keeps its width
    assert all(layer["experts"] == 3 and layer["fewest_tokens"] > 0 for layer in layers)  # every kept expert used
    saved = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert saved[key] == width // 2 and saved["num_experts"] == 3
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model", trust_remote_code=layout == "per_site")
    if layout == "global":
        assert type(model).__name__ == STOCK_CLASSES[name]
        d, f = model.config.hidden_size, width // 2
        assert model.model.layers[0].mlp.experts.down_proj.shape == ((3, f, d) if name == "gpt_oss" else (3, d, f))
        if name == "qwen3_moe":
            assert model.model.layers[1].mlp.down_proj.in_features == model.config.intermediate_size  # dense: whole
    assert parameter_count(model) == report["params"]["pruned"] == report["allocation"]["predicted_params"]
    kl = _kl_of_reload(checkpoint, tmp_path / "out" / "model", layout == "per_site")
    assert kl == pytest.approx(report["metrics"]["pruned"]["kl"], rel=1e-3, abs=1e-6)
    # `compress compare` shows the experts kept and the active share, beside a varied `experts` setting
    shutil.copytree(tmp_path / "out", tmp_path / "other")
    saved_recipe = tmp_path / "other" / "recipe.yaml"
    saved_recipe.write_text(saved_recipe.read_text().replace("kept: 3", "kept: 2"))
    row, _ = compare_rows([tmp_path / "out", tmp_path / "other"])
    assert row["experts kept"] == "3/4" and row["active params"] == report["active_params"]["ratio"] < 1
    assert any(key.startswith("experts.") for key in row)  # the varied setting, its own column
    assert "| experts kept | active params |" in render([row], ".md")


def test_too_few_calibration_tokens_per_expert_warn_with_the_windows_that_would_do(
    moe_checkpoint: Path, tmp_path: Path
) -> None:
    recipe = write_recipe(
        tmp_path, moe_checkpoint, evaluation=None, experts={"kept": 3, "selector": "frequency", "min_tokens": 10_000}
    )
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    fewest = report["experts"]["fewest_tokens"]
    line = next(w for w in report["warnings"] if w.startswith("experts:"))
    assert f"fewest: {fewest}" in line and "fewer than 10000" in line
    assert f"about {-(-4 * 10_000 // fewest)} calibration windows" in line  # 4 windows now


@pytest.mark.parametrize(
    ("experts", "family", "message"),
    [
        ({"kept": 5}, "qwen3_moe", "experts.kept 5: each token uses 2 of the 4 experts, so keep between 2 and 4"),
        ({"kept": 1}, "qwen3_moe", "experts.kept 1: each token uses 2 of the 4 experts, so keep between 2 and 4"),
        ({"kept": 3, "selector": "reep"}, "qwen3_moe", "unknown expert selector 'reep' (did you mean 'reap'?)"),
        ({"kept": 2}, "llama", "llama models have no routed experts this family describes"),
        ({"kept": 3, "min_kept": 0.25}, "qwen3_moe", "experts.min_kept applies when the run chooses the expert count"),
        ({}, "llama", "llama models have no routed experts this family describes"),  # the count left to choose
    ],
)
def test_bad_expert_settings_are_one_line_and_write_nothing(
    experts: dict, family: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / family, family)
    recipe = write_recipe(tmp_path, checkpoint, experts=experts)
    capsys.readouterr()  # saving the checkpoint may have shown progress
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("mlp", "family", "message"),
    [
        ({}, "llama", "llama models have no routed experts this family describes"),
        ({"kept": 40}, "qwen3_moe", "mlp.kept 40 keeps 40 of the MLP's 32 neurons; keep between 1 and 32"),
    ],
)
def test_bad_expert_width_settings_are_one_line_and_write_nothing(
    mlp: dict, family: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A model without experts is told so; an expert width above the experts' own is refused before work."""
    checkpoint = save_tiny_checkpoint(tmp_path / family, family)
    recipe = write_recipe(tmp_path, checkpoint, experts={"kept": 3}, mlp=mlp)
    capsys.readouterr()
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_experts_under_torchrun_are_refused_in_one_line(
    moe_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The ranks above 0 do not follow the stage: rank 0 would wait for them in its sums."""
    recipe = write_recipe(tmp_path, moe_checkpoint, experts={"kept": 3, "selector": "reap"})
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "experts runs in one process" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_run_killed_while_pruning_experts_resumes_to_a_bit_identical_model(
    moe_checkpoint: Path, tmp_path: Path
) -> None:
    """SIGKILL after the first MoE layer: the walk's sites come back from the checkpoint and the
    stage runs again, to the model an uninterrupted run saves, tensor for tensor."""
    from tests.run.test_resume import killed_and_resumed_is_whole

    recipe = write_recipe(
        tmp_path, moe_checkpoint, evaluation=None, pipeline=[{"strategy": "sensitivity"}], experts={"kept": 2}
    )
    killed_and_resumed_is_whole(recipe, tmp_path, "experts:0", sites=5)


def test_a_checkpoint_with_mxfp4_experts_is_asked_for_dequantized(tmp_path: Path) -> None:
    """gpt-oss's hub checkpoints hold their experts in MXFP4: the run loads them in its dtype
    (transformers' kernels, where installed, would keep them packed); other checkpoints load as they are."""
    from compressor.recipe.sections.model import ModelSpec
    from compressor.runtime.loading import dequantized

    checkpoint = save_tiny_checkpoint(tmp_path / "gpt-oss", "gpt_oss")
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    assert dequantized(ModelSpec(path=str(checkpoint))) == {}
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    config_path.write_text(json.dumps(config))
    asked = dequantized(ModelSpec(path=str(checkpoint)))["quantization_config"]
    assert type(asked).__name__ == "Mxfp4Config" and asked.dequantize


def test_quantized_experts_are_refused_with_how_to_load_them() -> None:
    """A user's error (the model loaded with its kernels), so one line and exit 2, not a traceback."""
    from compressor.errors import UserError
    from compressor.models.experts import unfuse_experts

    model = tiny_model("gpt_oss")
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(  # MXFP4 blocks: two 4-bit values a byte
        torch.zeros(*experts.gate_up_proj.shape[:2], experts.gate_up_proj.shape[2] // 2, dtype=torch.uint8),
        requires_grad=False,
    )
    with pytest.raises(UserError, match=r"experts are quantized \(torch.uint8.*Mxfp4Config\(dequantize=True\)"):
        unfuse_experts(model)


@pytest.mark.parametrize(
    ("layout", "mlp"), [("global", {"kept": 0.5, "shared_kept": 0.5}), ("per_site", {"kept": 16, "shared_kept": 24})]
)
def test_a_run_with_a_shared_expert_width_saves_a_narrower_shared_expert_that_reloads_to_the_run_s_model(
    layout: str, mlp: dict, tmp_path: Path
) -> None:
    """`mlp.shared_kept` narrows Qwen2-MoE's shared expert beside the routed experts' `mlp.kept`
    under one budget; the saved config says both widths and transformers reloads it (its own
    class, or the sliced one) at the run's KL."""
    checkpoint = save_tiny_checkpoint(tmp_path / "qwen2_moe", "qwen2_moe")
    recipe = write_recipe(
        tmp_path,
        checkpoint,
        sparsity=_DELETE,
        target_params=0.8,
        slicing={"layout": layout, "tie_head": True},  # the tiny Qwen2-MoE's head is tied: kept so per site too
        pipeline=[{"strategy": "sensitivity"}],
        mlp=mlp,
    )
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    config = json.loads((checkpoint / "config.json").read_text())
    shared, routed = config["shared_expert_intermediate_size"], config["moe_intermediate_size"]
    assert report["mlp"]["shared_kept"] == shared // 2 and report["mlp"]["shared_of"] == shared
    assert all(layer["shared_expert"]["kept"] == shared // 2 for layer in report["mlp"]["layers"])
    routed_kept = report["mlp"]["kept"]
    assert routed_kept == routed // 2
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert f"| Shared expert width | {shared} | {shared // 2} (obs weighed by H, refitted" in markdown
    saved = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert saved["shared_expert_intermediate_size"] == shared // 2 and saved["moe_intermediate_size"] == routed_kept
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model", trust_remote_code=layout == "per_site")
    if layout == "global":
        assert type(model).__name__ == "Qwen2MoeForCausalLM"
    assert model.model.layers[0].mlp.shared_expert.down_proj.in_features == shared // 2
    assert parameter_count(model) == report["params"]["pruned"] == report["allocation"]["predicted_params"]
    kl = _kl_of_reload(checkpoint, tmp_path / "out" / "model", layout == "per_site")
    assert kl == pytest.approx(report["metrics"]["pruned"]["kl"], rel=1e-3, abs=1e-6)


@pytest.mark.parametrize(
    ("mlp", "family", "message"),
    [
        ({"kept": 8, "shared_kept": 8}, "qwen3_moe", "mlp.shared_kept: qwen3_moe models have no shared expert"),
        ({"kept": 8, "shared_kept": 2.5}, "qwen2_moe", "mlp.shared_kept 2.5: give a whole number of neurons"),
        ({"shared_kept": 64}, "qwen2_moe", "mlp.shared_kept 64 keeps 64 of the shared expert's 48 neurons"),
    ],
)
def test_bad_shared_expert_widths_are_one_line_and_write_nothing(
    mlp: dict, family: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / family, family)
    recipe = write_recipe(tmp_path, checkpoint, mlp=mlp)
    capsys.readouterr()
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
