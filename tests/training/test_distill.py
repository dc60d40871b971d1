"""Recovery distillation (`compressor.training.distill`): it lowers the held-out KL, keeps the saved
architecture, merges LoRA exactly, resumes after a kill, runs under torchrun, and refuses bad
settings in one line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from compressor.cli import main
from compressor.data.batches import Batch
from compressor.engine.activations import ActivationStore
from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.errors import UserError
from compressor.faults import KILL_VARIABLE
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout
from compressor.recipe.schema import load_recipe
from compressor.recipe.sections.distillation import DistillationSpec
from compressor.strategies.registry import PluginRegistry
from compressor.training.distill import TrainingRun, distill
from compressor.training.teachers import CachedTeacher, LiveTeacher, _rows, cached_targets, collate, distillation_data
from compressor_plugins.pca import PCA
from tests.conftest import EXAMPLES, copy_model, random_batches, save_tiny_checkpoint, tiny_model, widths_for
from tests.engine.test_parallel import TORCHRUN, _compress
from tests.run.test_cli import write_recipe

DISTILLATION = {
    "tokens": 2048,
    "seq_len": 32,
    "batch_size": 4,
    "heldout_windows": 8,
    "eval_every": 4,
    "lr": 0.01,
    "patience": None,
}


@pytest.fixture(scope="module")
def sharp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with larger weights than the default init, so its predictions are peaked and
    slicing half its width costs a KL worth recovering."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("sharp-llama"), initializer_range=0.2)


def _run(tmp_path: Path, checkpoint: Path, output: str, **changes: Any) -> dict[str, Any]:
    recipe = write_recipe(tmp_path, checkpoint, output=output, **changes)
    assert main(["run", str(recipe)]) == 0
    return json.loads((tmp_path / output / "report.json").read_text())


def _state_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in load_file(str(folder / "model.safetensors")).items()}


@pytest.mark.parametrize(
    ("layout", "method"), [("per_site", "lora"), pytest.param("global", "full", marks=pytest.mark.slow)]
)  # slow: two more CLI runs
def test_distillation_lowers_the_heldout_kl_and_keeps_the_architecture(
    layout: str, method: str, sharp_checkpoint: Path, tmp_path: Path
) -> None:
    """The same recipe with and without a distillation section: the same config, class, tensor
    names and shapes (so the same parameter count); the held-out KL went down, the evaluation
    KL too, and the report says what the stage did."""
    slicing = {"layout": layout}
    plain = _run(tmp_path, sharp_checkpoint, "plain", slicing=slicing, sparsity=0.5)
    distilled = _run(
        tmp_path,
        sharp_checkpoint,
        "distilled",
        slicing=slicing,
        sparsity=0.5,
        distillation={**DISTILLATION, "method": method},
    )
    record = distilled["distillation"]
    assert record["kept"] == "distilled" and record["heldout_kl_best"] < 0.9 * record["heldout_kl_before"]
    assert record["steps"] == record["max_steps"] == 2048 // (4 * 32) and record["tokens"] == 2048
    assert [point["step"] for point in record["curve"]] == [0, 4, 8, 12, 16]
    assert record["world_size"] == 1 and record["method"] == method
    (guard,) = distilled["guards"]  # the stage's own held-out guard, recorded as every guarded step's
    assert guard == {
        "step": "distillation",
        "windows": record["heldout_windows"],
        "kept": True,
        "kl_before": record["heldout_kl_before"],
        "kl_after": record["heldout_kl_best"],
    }
    assert plain["guards"] == []
    metrics = distilled["metrics"]
    assert metrics["pruned"]["kl"] < metrics["undistilled"]["kl"]
    assert metrics["undistilled"] == plain["metrics"]["pruned"]  # measured on the same model and windows
    assert distilled["params"] == plain["params"]
    configs = [json.loads((tmp_path / run / "model" / "config.json").read_text()) for run in ("plain", "distilled")]
    assert configs[0] == configs[1]
    assert _state_shapes(tmp_path / "plain" / "model") == _state_shapes(tmp_path / "distilled" / "model")
    assert (tmp_path / "distilled" / "distillation.png").stat().st_size > 0
    assert ("modeling_sliced.py" in {p.name for p in (tmp_path / "distilled" / "model").iterdir()}) == (
        layout == "per_site"
    )  # a stock folder stays stock
    assert "distillation held-out KL" in (tmp_path / "distilled" / "report.md").read_text()


def _student_and_data(top_k: int = 16) -> tuple[Any, Any, Any, DistillationSpec]:
    original = tiny_model("llama", vocab_size=8192)
    family = family_for("llama")
    widths = widths_for("llama", original.config, 48, slice_head=False)
    student = prune(
        copy_model(original),
        fixed_layout(original.config, family, widths),
        random_batches(8192, length=16),
        [PipelineStep(PCA())],
    ).model
    tokenizer = AutoTokenizer.from_pretrained(EXAMPLES / "ref-llama")
    spec = DistillationSpec(
        tokens=1024,
        dataset={"path": "json", "data_files": str(EXAMPLES / "data" / "calib-demo.jsonl")},
        format="text",
        text_field="text",
        seq_len=32,
        batch_size=4,
        heldout_windows=4,
        eval_every=2,
        lr=0.003,
        top_k=top_k,
        patience=None,
    )
    return original, student, distillation_data(spec, tokenizer), spec


class _AdaptedLogits(TrainerCallback):
    """The adapted (unmerged) student's logits on a probe batch, once training has ended and the
    best checkpoint is loaded."""

    def __init__(self, probe: dict[str, torch.Tensor]) -> None:
        self.probe = probe
        self.logits: torch.Tensor | None = None

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> Any:
        model.eval()
        with torch.no_grad():
            self.logits = model(input_ids=self.probe["input_ids"], attention_mask=self.probe["attention_mask"]).logits
        return control


def test_the_merged_model_computes_what_the_adapted_student_computed(tmp_path: Path) -> None:
    """LoRA merged into the weights: the returned model's logits equal the adapted student's (the
    Trainer's model after loading the best checkpoint), and survive a save and load."""
    original, student, data, spec = _student_and_data()
    probe = collate(data.heldout)
    adapted = _AdaptedLogits(probe)
    shapes = {name: tuple(p.shape) for name, p in student.named_parameters()}
    merged, record = distill(
        student,
        LiveTeacher(original, spec.top_k),
        data,
        spec,
        TrainingRun(tmp_path / "ck", torch.device("cpu"), {"test": "merge"}, callbacks=[adapted]),
    )
    assert record.kept == "distilled" and record.merge_max_abs_diff is not None
    assert {name: tuple(p.shape) for name, p in merged.named_parameters()} == shapes  # no adapter left
    assert type(merged).__name__ == "SlicedLlamaForCausalLM"
    with torch.no_grad():
        logits = merged(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    assert adapted.logits is not None
    assert torch.allclose(logits, adapted.logits, atol=1e-5 * float(adapted.logits.abs().max()))
    merged.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "saved", dtype=torch.float32, attn_implementation=merged.config._attn_implementation
    ).eval()
    with torch.no_grad():
        again = reloaded(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    assert torch.equal(again, logits)


def test_cached_targets_equal_the_live_teachers() -> None:
    """The teacher run layer by layer over all rows (one layer on the device at a time) gives the
    targets the whole model gives batch by batch."""
    original, _, data, spec = _student_and_data(top_k=8)
    rows = data.train[:6] + data.heldout[:2]
    spec = dataclasses.replace(spec, top_k=8, batch_size=3)
    store = ActivationStore(torch.device("cpu"))
    cached = CachedTeacher(cached_targets(original, family_for("llama"), rows, spec, store, lambda *_: None))
    live = LiveTeacher(original, 8)
    inputs = collate(rows)
    counted = inputs["loss_mask"].bool()
    expected, found = live.target(inputs, counted), cached.target(inputs, counted)
    assert torch.equal(found.indices, expected.indices)
    assert torch.allclose(found.values, expected.values, atol=1e-5)
    assert torch.allclose(found.tail, expected.tail, atol=1e-5)


def test_chat_rows_count_only_what_the_sensitivity_mask_counts() -> None:
    ids = torch.arange(12).view(2, 6)
    real = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    assistant = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0]])
    rows = _rows([Batch(ids, real, assistant)], first=5)
    assert [row["loss_mask"].tolist() for row in rows] == [[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0]]
    assert [int(row["row"]) for row in rows] == [5, 6]
    padded = collate(
        [{**rows[0], **{k: rows[0][k][:4] for k in ("input_ids", "attention_mask", "loss_mask")}}, rows[1]]
    )
    assert padded["attention_mask"].tolist()[0] == [1, 1, 1, 1, 0, 0]


def _cli(recipe: Path, output: Path, **env: str) -> subprocess.CompletedProcess:
    return _compress([sys.executable], recipe, output, **env)


@pytest.mark.slow  # three runs of the CLI in subprocesses (~40 s); .ci/run runs it
def test_a_killed_distillation_continues_with_the_same_command(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """SIGKILL once the step-8 checkpoint is written: nothing is published, the same command
    continues from step 8 to the model of an uninterrupted run; changed distillation settings
    are refused before anything loads."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None, distillation=DISTILLATION)
    whole = _cli(recipe, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    killed = _cli(recipe, tmp_path / "run", **{KILL_VARIABLE: "distillation:8"})
    assert killed.returncode != 0 and not (tmp_path / "run").exists()
    assert (tmp_path / ".run.partial" / "checkpoint" / "distillation" / "checkpoint-8").is_dir()
    (tmp_path / "changed").mkdir()
    changed = write_recipe(
        tmp_path / "changed",
        tiny_checkpoint,
        evaluation=None,
        output=str(tmp_path / "run"),
        distillation={**DISTILLATION, "lr": 0.02},
    )
    refused = _cli(changed, tmp_path / "run")
    assert refused.returncode == 2 and "different recipe" in refused.stderr and "--restart" in refused.stderr
    resumed = _cli(recipe, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["distillation"]["resumed_from_step"] == 8 and report["distillation"]["steps"] == 16
    expected = load_file(str(tmp_path / "whole" / "model" / "model.safetensors"))
    found = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
    assert expected.keys() == found.keys()
    for name, tensor in expected.items():
        assert torch.allclose(found[name], tensor, atol=1e-6), name
    assert not (tmp_path / ".run.partial").exists()


@pytest.mark.slow  # a two-process torchrun job (~20 s); .ci/run runs it
def test_distillation_under_torchrun_trains_on_both_processes(sharp_checkpoint: Path, tmp_path: Path) -> None:
    """Two gloo processes: the walk shares the calibration, then the Trainer runs DDP; the report
    says two processes trained, each step covering both processes' windows."""
    recipe = write_recipe(
        tmp_path, sharp_checkpoint, evaluation=None, calibration__num_samples=4, sparsity=0.5, distillation=DISTILLATION
    )
    done = _compress(TORCHRUN, recipe, tmp_path / "two")
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "two" / "report.json").read_text())["distillation"]
    assert record["world_size"] == 2 and record["windows_per_step"] == 2 * 4
    assert record["steps"] == 2048 // (2 * 4 * 32) and record["tokens"] == 2048
    assert record["kept"] == "distilled"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokens": -5}, "distillation.tokens"),
        (
            {"method": "lora", "lora": {"target_modules": ["q_prj"]}},
            "'q_prj' is not a linear layer of this model (did you mean 'q_proj'?)",
        ),
        ({"lora": {"target_modules": ["attn_writer"]}}, "its linear layers: attn_shortcut, down_proj"),  # Gemma2's only
        (
            {"trainer": {"optimm": "adamw_torch"}},
            "distillation.trainer.optimm is not a transformers TrainingArguments field (did you mean 'optim'?)",
        ),
        ({"trainer": {"max_steps": 3}}, "distillation.trainer.max_steps is set by the distillation section itself"),
        ({"trainer": {"fsdp": "full_shard"}}, "distillation.trainer.fsdp: sharded training is not supported yet"),
        ({"trainer": {"optim": "no_such_optimiser"}}, "distillation: transformers refused the training settings"),
        (
            {"dataset": {"path": "json", "data_files": str(EXAMPLES / "data" / "valid-demo.jsonl")}},
            "is the evaluation's dataset",
        ),
        ({"heldout_windows": 100000}, "distillation: the dataset yields"),
    ],
)
def test_bad_distillation_settings_are_one_line(
    change: dict[str, Any], message: str, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, distillation={**DISTILLATION, **change})
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_distillation_data_defaults_to_the_calibration_text(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, tiny_checkpoint, distillation={"tokens": 100}), PluginRegistry())
    spec = recipe.distillation
    assert spec is not None
    assert (spec.dataset, spec.seq_len, spec.format) == (recipe.calibration.dataset, 64, "text")


def test_a_problem_found_in_the_stage_keeps_the_walk(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A user error raised by the stage itself (after the walk): one line, exit 2, and the walk's
    checkpoint kept, so the fixed recipe continues without walking again."""
    import compressor.training.distill

    def refuse(*_: Any, **__: Any) -> None:
        raise UserError("distillation: something only the stage could find")

    monkeypatch.setattr(compressor.training.distill, "distill", refuse)
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None, distillation=DISTILLATION)
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert "something only the stage could find" in err and "progress is kept" in err and len(err.splitlines()) == 1
    assert any((tmp_path / ".out.partial" / "checkpoint" / "sites").iterdir())


def test_distillation_needs_the_models_saved(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from compressor.run.runner import RunOptions, run

    recipe = load_recipe(write_recipe(tmp_path, tiny_checkpoint, distillation=DISTILLATION), PluginRegistry())
    with pytest.raises(UserError, match="save the models"):
        run(recipe, PluginRegistry(), options=RunOptions(save_model=False))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # two trainings of the tiny model (~12 s)
def test_gradient_checkpointing_recomputes_the_sliced_layers_to_the_same_weights(tmp_path: Path) -> None:
    """With `gradient_checkpointing` the sliced layers (GradientCheckpointingLayer) are recomputed in
    the backward pass: the trained weights are those of a run that kept every activation."""

    original, student, data, spec = _student_and_data()
    spec = dataclasses.replace(spec, tokens=512, method="full", warmup=0.0, lr=0.001)
    results, calls = [], []
    for checkpointing in (False, True):
        model = copy_model(student)
        count = [0]
        model.model.layers[0].self_attn.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))  # noqa: B023
        trained, record = distill(
            model,
            LiveTeacher(original, spec.top_k),
            data,
            dataclasses.replace(spec, gradient_checkpointing=checkpointing),
            TrainingRun(tmp_path / str(checkpointing), torch.device("cpu"), {"test": "gc"}),
        )
        assert record.steps == 4 and record.kept == "distilled"
        results.append(trained.state_dict())
        calls.append(count[0])
    assert calls[1] == calls[0] + 4  # the layer (its attention inside) recomputed once per training step
    assert results[0].keys() == results[1].keys()
    moved = [name for name, tensor in results[0].items() if not torch.equal(tensor, student.state_dict()[name])]
    assert moved  # training changed the weights
    for name in results[0]:
        assert torch.allclose(results[0][name], results[1][name], atol=1e-6), name


@pytest.mark.slow  # a CLI run (~15 s)
def test_a_cached_teacher_run_with_activations_on_disk(sharp_checkpoint: Path, tmp_path: Path) -> None:
    """`teacher: cached` with `activations: disk`: the stage runs from the targets computed layer
    by layer (spilled activations in the staging folder, gone after) and still lowers the KL."""
    report = _run(
        tmp_path,
        sharp_checkpoint,
        "cached",
        sparsity=0.5,
        evaluation=None,
        activations="disk",
        distillation={**DISTILLATION, "teacher": "cached"},
    )
    record = report["distillation"]
    assert record["kept"] == "distilled" and record["heldout_kl_best"] < 0.9 * record["heldout_kl_before"]
    assert not (tmp_path / ".cached.partial").exists()


def test_a_distillation_that_makes_the_student_worse_is_undone_and_said(
    sharp_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A learning rate that wrecks the student: every held-out measurement is worse than the
    student as received, so the run saves the undistilled model and says so in one line."""
    plain = _run(tmp_path, sharp_checkpoint, "plain", sparsity=0.5)
    capsys.readouterr()
    wrecked = _run(
        tmp_path,
        sharp_checkpoint,
        "wrecked",
        sparsity=0.5,
        distillation={**DISTILLATION, "tokens": 512, "lr": 5.0, "method": "full"},
    )
    (guard,) = wrecked["guards"]
    assert guard["step"] == "distillation" and not guard["kept"] and guard["kl_after"] > guard["kl_before"]
    assert wrecked["distillation"]["kept"] == "received"
    said = capsys.readouterr()
    lines = [line for line in (said.out + said.err).splitlines() if line.startswith("warning: distillation:")]
    assert len(lines) == 1 and "the model from before distillation is kept" in lines[0]
    assert wrecked["metrics"]["pruned"] == plain["metrics"]["pruned"]  # the walk's model, as if not distilled
