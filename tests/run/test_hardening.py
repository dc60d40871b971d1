"""Failure paths a new user hit: each ends in one line, exit code 2 (130 on Ctrl-C), no
traceback, and nothing half-written beside the output."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compressor.cli import main
from tests.conftest import ROOT, save_tiny_checkpoint
from tests.run.test_cli import write_recipe

ENTRY = [sys.executable, "-c", "import sys; from compressor.entry import main; sys.exit(main())"]
"""What the `compress` console script runs (pyproject's [project.scripts])."""


def _one_line_error(capsys: pytest.CaptureFixture, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("where", ["calibration", "evaluation"])
def test_windows_longer_than_the_model_s_positions_are_refused(
    tiny_checkpoint: Path, tmp_path: Path, where: str, dry_run: bool, capsys: pytest.CaptureFixture
) -> None:
    """The tiny model has 128 positions; 256-token windows would be scored past them."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, **{f"{where}__seq_len": 256})
    assert main(["run", str(recipe), *(["--dry-run"] if dry_run else [])]) == 2
    _one_line_error(capsys, f"{where}.seq_len is 256", "128 positions", f"set {where}.seq_len to 128 or less")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"calibration__text_field": "body"}, "calibration: the dataset's records have no field 'body' (fields: text)"),
        ({"evaluation__text_field": "body"}, "evaluation: the dataset's records have no field 'body' (fields: text)"),
        (
            {"calibration__format": "chat"},
            "calibration: the dataset's records have no field 'messages' (fields: text); "
            "set calibration.messages_field",
        ),
    ],
)
def test_dry_run_reads_the_first_record_of_the_data(
    tiny_checkpoint: Path, tmp_path: Path, change: dict, message: str, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, **change)
    assert main(["run", str(recipe), "--dry-run"]) == 2
    _one_line_error(capsys, message)


def test_dry_run_passes_data_with_the_named_field(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["run", str(write_recipe(tmp_path, tiny_checkpoint)), "--dry-run"]) == 0
    assert "recipe OK" in capsys.readouterr().out


def _failing_rename(source: str, destination: Path):
    """Path.rename, failing (as a busy or read-only folder would) for one move: the previous run's
    folder set aside (`source` "out"), or the finished run put in place ("partial")."""
    rename = Path.rename

    def patched(self: Path, target: os.PathLike) -> Path:
        moving = "partial" if self.name.endswith(".partial") else self.name
        if moving == source and (Path(target) == destination or source == "out"):
            raise PermissionError(13, "Permission denied", str(target))
        return rename(self, target)

    return patched


@pytest.mark.parametrize(("failing", "previous_run"), [("partial", False), ("partial", True), ("out", True)])
def test_a_run_that_cannot_be_put_in_place_says_so_and_leaves_nothing_aside(
    tiny_checkpoint: Path,
    tmp_path: Path,
    failing: str,
    previous_run: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    output = tmp_path / "out"
    before = None
    if previous_run:
        assert main(["run", str(recipe)]) == 0
        before = (output / "report.json").read_bytes()
    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.setattr(Path, "rename", _failing_rename(failing, output))
        assert main(["run", str(recipe), "--overwrite"]) == 2
    _one_line_error(
        capsys,
        f"cannot put the finished run in place at {output}: Permission denied",
        "run the same command to continue",
    )
    assert not list(tmp_path.glob(".out.old-*"))  # no empty folder left aside
    if previous_run:
        assert (output / "report.json").read_bytes() == before  # the previous run is where it was
    else:
        assert not output.exists()
    assert main(["run", str(recipe), "--overwrite"]) == 0  # the same command publishes the kept progress
    report = json.loads((output / "report.json").read_text())
    assert report["resume"]["sites_loaded"] == len(report["sites"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "recipe.yaml"]


def _start(recipe: Path, entry: list[str] = ENTRY, **env: str) -> subprocess.Popen:
    """`compress run` as a terminal starts it: SIGINT at its default even where the tests run in the
    background (a non-interactive shell starts background jobs with SIGINT ignored, which children inherit)."""
    return subprocess.Popen(
        [*entry, "run", str(recipe)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **env},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _interrupted(process: subprocess.Popen) -> str:
    _, err = process.communicate(timeout=120)
    assert "Traceback" not in err, err
    assert process.returncode == 130 and err.startswith("interrupted") and err.count("\n") == 1, err
    return err


INTERRUPT_ON_IMPORT = """
import importlib.abc, os, signal, sys

class _Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["INTERRUPT_ON_IMPORT"]:
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, _Interrupt())
"""


@pytest.mark.parametrize(
    ("module", "entry"),
    [
        *(
            (module, "compress")
            for module in ["rich", "torch", "transformers", "compressor.run.runner", "compressor_plugins.sensitivity"]
        ),
        ("rich", "python -m compressor.cli"),
        ("torch", "python -m compressor.cli"),  # torchrun's form
    ],
)
def test_ctrl_c_while_compress_imports_a_library_is_one_line(
    tiny_checkpoint: Path, tmp_path: Path, module: str, entry: str
) -> None:
    """SIGINT exactly as `compress` starts importing `module` (a sitecustomize hook signals the
    process then): one line, exit code 130, nothing created."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(INTERRUPT_ON_IMPORT)
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None, pipeline=[{"strategy": "sensitivity"}])
    command = ENTRY if entry == "compress" else [sys.executable, "-m", "compressor.cli"]
    _interrupted(_start(recipe, command, PYTHONPATH=f"{hook}{os.pathsep}{ROOT}", INTERRUPT_ON_IMPORT=module))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hook", "recipe.yaml"]


@pytest.mark.parametrize("phase", ["tokenising data", "loading model", "fusing norms", "capturing layer inputs"])
def test_ctrl_c_as_a_phase_begins_is_one_line_and_leaves_nothing_unfinished(
    tiny_checkpoint: Path, tmp_path: Path, phase: str
) -> None:
    """SIGINT as a phase of the run begins (its log line is read from the pipe): one line, exit
    code 130, no output folder, and no staging folder unless a site was checkpointed by the time
    the signal landed (the tiny model is fast), which the line then says."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    process = _start(recipe)
    assert process.stdout is not None
    for line in process.stdout:
        if phase in line:
            process.send_signal(signal.SIGINT)
            break
    else:
        pytest.fail(f"the run never logged '{phase}'")
    err = _interrupted(process)
    left = sorted(p.name for p in tmp_path.iterdir())
    if "progress is kept" in err:
        assert phase == "capturing layer inputs" and left == [".out.partial", "recipe.yaml"]
        assert (tmp_path / ".out.partial" / "checkpoint" / "fingerprint.json").is_file()
    else:
        assert left == ["recipe.yaml"]


def _model_with_code(folder: Path, marker: Path) -> Path:
    """The tiny model, its config pointing (auto_map) at Python code in its folder that leaves
    `marker` behind when it runs."""
    save_tiny_checkpoint(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"}
    config["model_type"] = "custom-llama"
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'custom-llama'\n"
        "class CustomModel(LlamaForCausalLM):\n    config_class = CustomConfig\n"
    )
    return folder


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_model_s_own_code_never_runs_unless_the_recipe_asks(
    tmp_path: Path, dry_run: bool, capsys: pytest.CaptureFixture
) -> None:
    marker = tmp_path / "code-ran"
    model = _model_with_code(tmp_path / "model", marker)
    recipe = write_recipe(tmp_path, model, evaluation=None)
    capsys.readouterr()
    assert main(["run", str(recipe), *(["--dry-run"] if dry_run else [])]) == 2
    _one_line_error(capsys, "ships its own Python code (auto_map in its config)", "model.trust_remote_code: true")
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "recipe.yaml"]
    # asked for, the code runs (and the family it declares is then checked like any other)
    recipe = write_recipe(tmp_path, model, evaluation=None, model__trust_remote_code=True)
    assert main(["run", str(recipe), "--dry-run"]) == 2
    _one_line_error(capsys, "custom-llama")
    assert marker.read_text() == "ran"


def test_recipes_are_read_with_a_safe_yaml_loader(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "unsafe"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    assert main(["run", str(recipe), "--dry-run"]) == 2
    _one_line_error(capsys, "is not valid YAML", "could not determine a constructor")
    assert not marker.exists()


def test_the_recipe_schema_is_current_and_accepts_the_shipped_recipes(tmp_path: Path) -> None:
    """recipes/recipe.schema.json is what `compress schema` prints (regenerate it with
    `compress schema --output recipes/recipe.schema.json`), every shipped recipe passes it, and
    it refuses what validation refuses: an unknown key, a wrong type, an out-of-range number, an
    option a strategy does not have."""
    import jsonschema
    import yaml

    assert main(["schema", "--output", str(tmp_path / "schema.json")]) == 0
    schema = json.loads((tmp_path / "schema.json").read_text())
    assert schema == json.loads((ROOT / "recipes" / "recipe.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert len(recipes) >= 5
    for path in recipes:
        errors = list(validator.iter_errors(yaml.safe_load(path.read_text())))
        assert not errors, (path.name, errors[0].message)
    good = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
    for key, value in [
        ("bogus", 1),
        ("sparsity", 1.5),
        ("seed", "one"),
        ("device", "gpu"),
        ("pipeline", [{"strategy": "sensitivity", "tau": [1]}]),
        ("pipeline", [{"strategy": "nope"}]),
        ("slicing", {"round_to": 0}),
    ]:
        assert list(validator.iter_errors({**good, key: value})), key


def _disk_full(path: object, *args: object, **kwargs: object) -> None:
    """Write a few bytes, then fail as a full disk does."""
    Path(str(path)).write_bytes(b"partial")
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


@pytest.mark.parametrize("writer", ["checkpoint", "model"])
def test_a_full_disk_while_saving_is_one_line_and_leaves_nothing(
    tiny_checkpoint: Path, tmp_path: Path, writer: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The disk fills while a site's checkpoint is written (safetensors), or while the pruned
    model is saved: one line, exit code 2, and neither output, staging folder nor temporary file."""
    from transformers import PreTrainedModel

    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    with monkeypatch.context() as patch:
        if writer == "checkpoint":
            patch.setattr("compressor.engine.checkpoint.save_file", lambda tensors, path, **_: _disk_full(path))
        else:
            patch.setattr(PreTrainedModel, "save_pretrained", lambda self, folder, **_: _disk_full(Path(folder)))
        assert main(["run", str(recipe)]) == 2
    _one_line_error(capsys, "no space left on the device while writing", "free some space there")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_a_run_folder_s_model_is_never_unpickled(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A run folder whose model was swapped for a pickle (pytorch_model.bin) is refused by
    `compress eval` in one line: its weights load from safetensors only."""
    from safetensors.torch import load_file

    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    assert main(["run", str(recipe)]) == 0
    weights = tmp_path / "out" / "model" / "model.safetensors"
    torch.save(load_file(str(weights)), weights.with_name("pytorch_model.bin"))
    weights.unlink()
    capsys.readouterr()
    data = str(ROOT / "examples" / "data" / "valid-demo.jsonl")
    assert (
        main(
            ["eval", str(tmp_path / "out"), "--data", data, "--num-samples", "2", "--seq-len", "32", "--no-throughput"]
        )
        == 2
    )
    _one_line_error(capsys, "cannot load model", "model.safetensors")


def test_a_strategy_chain_needing_unknown_statistics_is_refused_before_loading(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """A plugin strategy that requires a statistic the engine cannot compute is refused by
    `plan` (what --dry-run and a run call before loading weights), naming the statistic."""
    from compressor.errors import UserError
    from compressor.plan.checks import plan
    from compressor.recipe.schema import load_recipe
    from compressor.strategies.contract import Strategy
    from compressor.strategies.registry import PluginRegistry, hookimpl

    class NeedsG(Strategy):
        name = "needs-g"
        requires = ("C", "G")

        def select(self, problem, incoming, options):  # pragma: no cover - never reached
            raise AssertionError

    class Plugin:
        @hookimpl
        def compressor_strategies(self) -> list[Strategy]:
            return [NeedsG()]

    registry = PluginRegistry(extra_plugins=[Plugin()])
    recipe = load_recipe(write_recipe(tmp_path, tiny_checkpoint, pipeline=[{"strategy": "needs-g"}]), registry)
    with pytest.raises(UserError, match="the pipeline needs statistics this engine cannot compute: G"):
        plan(recipe, registry)


def test_dry_run_counts_the_windows_of_local_text(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Asking for more windows than the data holds is refused by --dry-run, not later by the run."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, calibration__num_samples=100_000)
    assert main(["run", str(recipe), "--dry-run"]) == 2
    _one_line_error(capsys, "calibration: the dataset yields", "but num_samples is 100000")


def test_dry_run_refuses_an_output_that_cannot_be_written(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "a-file").write_text("")
    recipe = write_recipe(tmp_path, tiny_checkpoint, output="a-file/run")
    assert main(["run", str(recipe), "--dry-run"]) == 2
    _one_line_error(capsys, f"cannot write the output folder {tmp_path / 'a-file' / 'run'}", "choose another --output")
    assert main(["run", str(recipe)]) == 2  # and the run refuses it before any work
    _one_line_error(capsys, "cannot create the output folder")


LAUGHS = "".join(
    f"  - &a{i} [{', '.join([f'*a{i - 1}' if i else 'x'] * 9)}]\n" for i in range(9)
)  # nine levels of nine: 9^9 values once expanded, a few hundred bytes written


@pytest.mark.parametrize(
    ("tail", "needle"),
    [
        pytest.param(b"# caf\xe9\n", "is not UTF-8 text (byte 0xe9", id="latin-1"),
        pytest.param(b"seed: !!float abc\n", "line {line}, column 7: 'abc' is tagged as a number", id="float-tag"),
        pytest.param(b"seed: !!int 1.5\n", "'1.5' is tagged as an integer but is not one", id="int-tag"),
        pytest.param(b"seed: " + b"9" * 5000 + b"\n", "an integer of 5000 digits", id="long-int"),
        pytest.param(b"extra: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply", id="nesting"),
        pytest.param(b"seed: 1\nseed: 2\n", "the key 'seed' is given twice (first at line {line})", id="duplicate"),
        pytest.param(b"seed:\n" + LAUGHS.encode(), "expands to more than 100,000 values", id="aliases"),
        pytest.param(b"seed: 1180591620717411303424\n", "seed must be in [0,", id="seed-beyond-64-bits"),
        pytest.param(b"refinement: {epochs: .inf}\n", "refinement.epochs must be a finite number", id="inf"),
        pytest.param(b"mlp: {damping: .nan}\n", "mlp.damping must be a finite number", id="nan"),
    ],
)
def test_a_recipe_that_is_not_what_it_should_be_is_one_line_at_once(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture, tail: bytes, needle: str
) -> None:
    """Bytes that are not UTF-8, YAML whose tags lie, integers and nesting no setting takes, a key
    given twice, an alias tree that expands to billions of values, and numbers at infinity: one
    line each, at once (printed whole, the alias tree would take the machine's memory), before any work."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    text = recipe.read_bytes()
    recipe.write_bytes(text + tail)
    needle = needle.format(line=text.count(b"\n") + 1)
    assert main(["run", str(recipe), "--dry-run"]) == 2
    _one_line_error(capsys, needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        pytest.param(3, "config.json must be a JSON object of fields, got int", id="number"),
        pytest.param(None, "config.json must be a JSON object of fields, got NoneType", id="null"),
        pytest.param({"hidden_size": -256}, "config.json's hidden_size must be a positive integer, got -256", id="neg"),
        pytest.param({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0", id="zero"),
        pytest.param({"num_hidden_layers": "six"}, "num_hidden_layers must be a positive integer, got 'six'", id="str"),
        pytest.param(
            {"num_hidden_layers": 10**6}, "num_hidden_layers is 1,000,000, more than any model has", id="many"
        ),
        pytest.param({"vocab_size": 10**12}, "vocab_size is 1,000,000,000,000, more than any model has", id="wide"),
    ],
)
def test_a_config_json_no_model_can_be_built_from_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, value: object, needle: str
) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "model")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **value} if isinstance(value, dict) else value))
    capsys.readouterr()
    recipe = write_recipe(tmp_path, checkpoint, evaluation=None)
    for args in (["--dry-run"], []):
        assert main(["run", str(recipe), *args]) == 2
        _one_line_error(capsys, needle)
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial*"))


def test_paths_longer_than_the_file_system_allows_are_one_line(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    long = "a" * 300  # one name past NAME_MAX (255)
    for recipe in (
        write_recipe(tmp_path, tiny_checkpoint, evaluation=None, output=str(tmp_path / long)),
        write_recipe(tmp_path, tmp_path / long, evaluation=None),
        tmp_path / f"{long}.yaml",
    ):
        assert main(["run", str(recipe), "--dry-run"]) == 2
        _one_line_error(capsys, "a path is longer than the file system allows", "give a shorter")


@pytest.mark.parametrize(
    ("trainer", "needle"),
    [
        ({"lr_scheduler_kwargs": "abc"}, "lr_scheduler_kwargs must be a mapping"),
        ({"dataloader_num_workers": -1}, "dataloader_num_workers must not be negative (its default is 0)"),
        ({"adam_beta1": float("inf")}, "adam_beta1 must be a finite number"),
    ],
)
def test_distillation_trainer_values_transformers_would_take_and_fail_on_are_refused(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture, trainer: dict, needle: str
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None, distillation={"tokens": 2048, "trainer": trainer})
    assert main(["run", str(recipe), "--dry-run"]) == 2
    _one_line_error(capsys, f"distillation.trainer.{needle}")


def test_the_dry_run_counts_the_held_out_windows_after_the_calibration_windows(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Refinement's guard (and the split choice of `mlp: {}`) reads held-out windows after the
    calibration windows: a dry run that accepted 128 + 16 windows from text that holds 136 let the
    run stop at tokenising."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None, refinement={"heldout_windows": 16})
    capsys.readouterr()
    fits = main(["run", str(recipe), "--dry-run", "--set", "calibration.num_samples=8"])
    assert fits == 0 and "refinement held-out data: 16 windows after the calibration windows" in capsys.readouterr().out
    assert main(["run", str(recipe), "--dry-run", "--set", "calibration.num_samples=100000"]) == 2
    held = int(re.search(r"the dataset yields (\d+) windows", capsys.readouterr().err).group(1))
    assert main(["run", str(recipe), "--dry-run", "--set", f"calibration.num_samples={held - 8}"]) == 2
    _one_line_error(capsys, f"refinement.heldout_windows: 16 windows after the {held - 8} calibration windows need")


def test_yaml_merge_keys_still_read_and_may_override_what_they_bring(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A key given twice is refused, but a merge key (`<<`) brings keys the mapping may set again."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None, sparsity=0.1)  # 57.6 of 64 kept
    text = recipe.read_text()
    recipe.write_text(text + "slicing:\n  <<: &common {round_to: 8, slice_head: true}\n  round_to: 16\n")
    assert main(["run", str(recipe), "--dry-run"]) == 0
    assert "kept width 48" in capsys.readouterr().out  # round_to 16 (8 would keep 56): the mapping's own key won
    recipe.write_text(text + "slicing:\n  <<: &common {round_to: 8, slice_head: true}\n")
    assert main(["run", str(recipe), "--dry-run"]) == 0
    assert "kept width 56" in capsys.readouterr().out


@pytest.mark.parametrize("dry_run", [False, True])
def test_ctrl_c_that_a_library_turns_into_another_error_is_still_an_interrupt(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, dry_run: bool
) -> None:
    """transformers' lazy import catches what an import raised, the KeyboardInterrupt of a Ctrl-C
    included once in a while, and raises "Could not import module 'Trainer'" in its place: the
    command still ends as interrupted, in one line with exit code 130, nothing left behind."""
    import compressor.recipe.schema as schema

    real = schema.validate

    def interrupted_while_importing(*args: object, **kwargs: object) -> object:
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            raise ModuleNotFoundError("Could not import module 'Trainer'") from None
        return real(*args, **kwargs)

    monkeypatch.setattr(schema, "validate", interrupted_while_importing)
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    # Python's own handler, as in a terminal: a suite launched in the background (make … &) inherits
    # SIGINT ignored, which the command rightly leaves ignored
    launcher = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(["run", str(recipe), *(["--dry-run"] if dry_run else [])]) == 130
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the command's handler is gone again
    finally:
        signal.signal(signal.SIGINT, launcher)
    assert capsys.readouterr().err == "interrupted; then ModuleNotFoundError: Could not import module 'Trainer'\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"model__path": "no/such/place"}, "is not a hub id (name or organisation/name) either"),
        ({"output": "out\x00put"}, "output holds a NUL character"),
        ({"evaluation__dataset": {"path": "json"}}, "evaluation.dataset: path json is the loader of json files"),
        ({"calibration__dataset__data_files": "a\x00b"}, "calibration.dataset.data_files holds a NUL character"),
        ({"calibration__batch_size": 10**15, "calibration__num_samples": 10**15}, "more than one tensor can hold"),
    ],
)
def test_paths_and_sizes_no_run_could_use_are_one_line(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture, changes: dict, needle: str
) -> None:
    """A model path that is neither a folder nor a hub id, a NUL in a path, a batch whose tensors
    no index can address, a file loader without files: each refused by the dry run (found by
    `test_generated_recipes` and by running what it accepted)."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, **changes)
    assert main(["run", str(recipe), "--dry-run"]) == 2
    _one_line_error(capsys, needle)


def test_the_dry_run_refuses_what_the_run_would_refuse_on_this_device(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A float16 distillation on a CPU: the dry run said "recipe OK" and the run then refused it;
    both now check the device's settings in one place (`plan.checks.check_device_settings`)."""
    recipe = write_recipe(
        tmp_path, tiny_checkpoint, device="cpu", distillation={"tokens": 2048, "precision": "float16"}
    )
    for args in (["--dry-run"], []):
        assert main(["run", str(recipe), *args]) == 2
        _one_line_error(capsys, "distillation.precision: float16 has no mixed precision on CPU")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_a_ctrl_c_the_launcher_ignores_stays_ignored(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`compress run a.yaml &` in a script ignores SIGINT: the command leaves it ignored."""
    import compressor.recipe.schema as schema

    seen, real = [], schema.validate

    def watched(*args: object, **kwargs: object) -> object:
        seen.append(signal.getsignal(signal.SIGINT))
        return real(*args, **kwargs)

    monkeypatch.setattr(schema, "validate", watched)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["run", str(write_recipe(tmp_path, tiny_checkpoint, evaluation=None)), "--dry-run"]) == 0
        assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt2"])
def test_streaming_a_family_that_rewrites_its_modules_is_refused_by_the_dry_run(
    family: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Fused experts (and GPT-2's Conv1D) become linears before fusion, which streaming does not do
    layer by layer: the plan says so before any weight loads, and `auto` picks memory."""
    checkpoint = save_tiny_checkpoint(tmp_path / "model", family)
    slicing = {"slicing": {"slice_head": True}} if family == "gpt2" else {}
    recipe = write_recipe(tmp_path, checkpoint, model__load="stream", evaluation=None, **slicing)
    capsys.readouterr()  # the checkpoint's own progress bar
    assert main(["run", str(recipe), "--dry-run"]) == 2
    _one_line_error(capsys, f"model family '{'gpt2' if family == 'gpt2' else 'moe'}' rewrites its modules")
    assert not (tmp_path / "out").exists()
    recipe = write_recipe(tmp_path, checkpoint, model__load="auto", evaluation=None, **slicing)
    assert main(["run", str(recipe), "--dry-run"]) == 0
    assert "model.load: auto chose memory (this model family does not stream)" in capsys.readouterr().out
