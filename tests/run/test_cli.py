"""The CLI end to end on a tiny model, and one clear line with exit code 2 for every bad input."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import compressor
from compressor.cli import main
from compressor.engine.bases import load_bases
from compressor.models.families import BUILTIN_FAMILIES
from compressor.runtime.staging import RUN_FILES
from tests.conftest import EXAMPLES, save_tiny_checkpoint


def write_recipe(folder: Path, checkpoint: Path, **changes: Any) -> Path:
    recipe: dict[str, Any] = {
        "model": {"path": str(checkpoint), "dtype": "float32"},
        "calibration": {
            "dataset": {"path": "json", "data_files": str(EXAMPLES / "data" / "calib-demo.jsonl")},
            "num_samples": 4,
            "seq_len": 64,
            "batch_size": 2,
        },
        "sparsity": 0.25,
        "pipeline": [{"strategy": "pca"}],
        "evaluation": {
            "dataset": {"path": "json", "data_files": str(EXAMPLES / "data" / "valid-demo.jsonl")},
            "num_samples": 4,
            "seq_len": 64,
            "throughput": False,
        },  # timed in test_throughput.py
        "output": "out",
    }
    for dotted, value in changes.items():
        node = recipe
        *parents, last = dotted.split("__")
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


_DELETE = object()


def test_run_writes_model_recipe_and_report(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # threads fixed: where other work holds the cores, a note on the count would come before the plan
    recipe = write_recipe(tmp_path, tiny_checkpoint, threads=2)
    assert main(["run", str(recipe)]) == 0
    out = tmp_path / "out"  # relative output resolves against the recipe's folder
    assert sorted(p.name for p in out.iterdir()) == [
        ".run-files",
        "bases.safetensors",
        "model",
        "recipe.yaml",
        "report.json",
        "report.md",
    ]
    assert not list(tmp_path.glob(".out.partial*"))
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # not the staging folder's 0700
    assert stat.S_IMODE((out / "model" / "model.safetensors").stat().st_mode) == 0o666 & ~umask
    report = json.loads((out / "report.json").read_text())
    metrics = report["metrics"]
    assert metrics["baseline"]["ppl"] > 1 and metrics["pruned"]["ppl"] > 1 and metrics["pruned"]["kl"] > 0
    assert report["params"]["pruned"] < report["params"]["baseline"]
    assert {"prune_s", "eval_s", "total_s"} <= set(report["timings"])
    assert [s["name"] for s in report["sites"]] == [
        "embedding",
        "layers.0.attn",
        "layers.0.mlp",
        "layers.1.attn",
        "layers.1.mlp",
    ]
    assert [s["kept"] for s in report["sites"]] == [48, 48, 48, 48, 64]
    bases = load_bases(out / "bases.safetensors")
    assert {site: tuple(v.shape) for site, v in bases.items()} == {s["name"]: (64, s["kept"]) for s in report["sites"]}
    assert all(v.dtype == torch.float64 for v in bases.values())
    assert report["resumed_from"] is None and report["seed"] == 0
    assert report["pipeline"] == [{"strategy": "pca", "options": {}}]
    assert set(report["fingerprint"]) == {"recipe", "model", "data"}
    assert all(s["strategy"] == "pca" and "removed_energy" in s["steps"][0]["objectives"] for s in report["sites"])
    resolved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert resolved["calibration"]["dataset"]["data_files"] == str(EXAMPLES / "data" / "calib-demo.jsonl")
    assert resolved["slicing"] == {
        "layout": "per_site",
        "pooling": "trace",
        "round_to": 8,
        "kept": None,
        "slice_head": False,
        "correct_readers": False,
        "shared_bases": False,
        "tie_head": None,
        "tied_fit": "symmetric",
    }
    reloaded = AutoModelForCausalLM.from_pretrained(out / "model")
    assert reloaded.config.model_type == "sliced_llama"
    assert torch.isfinite(reloaded(torch.tensor([[0, 5, 6, 7]])).logits).all()
    out = capsys.readouterr().out
    assert "perplexity" in out
    lines = out.splitlines()
    assert lines[0].startswith("time: about ")  # the time plan first, then a line per phase (not a terminal)
    phases = [line.split("] ", 1)[-1].strip() for line in lines[1:4]]
    assert phases == ["tokenising data", "loading model", "fusing norms"]


def test_set_overrides_and_output_option(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint)
    target = tmp_path / "elsewhere"
    assert (
        main(
            [
                "run",
                str(recipe),
                "--output",
                str(target),
                "--set",
                "sparsity=0.5",
                "--set",
                "slicing.slice_head=true",
                "--set",
                "evaluation=null",
            ]
        )
        == 0
    )
    report = json.loads((target / "report.json").read_text())
    assert report["kept_width"] == 32 and [s["kept"] for s in report["sites"]][-1] == 32
    assert report["metrics"] == {} and "eval_s" not in report["timings"]
    assert not (tmp_path / "out").exists()


def test_existing_run_needs_overwrite(tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    assert main(["run", str(recipe)]) == 0
    first = (tmp_path / "out" / "report.json").read_text()
    assert main(["run", str(recipe)]) == 2
    assert "already holds a run; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "out" / "report.json").read_text() == first
    assert main(["run", str(recipe), "--overwrite"]) == 0
    assert (tmp_path / "out" / "report.json").read_text() != first  # timings differ: it was rewritten


@pytest.mark.parametrize("foreign", ["my_analysis.md", "notes/today.txt", "model/notes.txt", "plots/"])
def test_overwrite_refuses_a_run_folder_holding_files_the_run_did_not_write(
    tiny_checkpoint: Path, tmp_path: Path, foreign: str, capsys: pytest.CaptureFixture
) -> None:
    """A user's file (or folder) added to a previous run, at the top level or inside model/,
    is named and kept; the previous run stays as it was, and no staging folder is left."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    assert main(["run", str(recipe)]) == 0
    output = tmp_path / "out"
    added = output / foreign
    if foreign.endswith("/"):
        added.mkdir()
    else:
        added.parent.mkdir(exist_ok=True)
        added.write_text("the user's own words")
    before = {p.relative_to(output): p.read_bytes() for p in output.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["run", str(recipe), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and foreign in err and "did not write" in err
    assert {p.relative_to(output): p.read_bytes() for p in output.rglob("*") if p.is_file()} == before
    assert added.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out", "recipe.yaml"]
    added.unlink() if added.is_file() else added.rmdir()
    if foreign == "notes/today.txt":
        added.parent.rmdir()
    assert main(["run", str(recipe), "--overwrite"]) == 0  # once moved out, the run is replaced


def test_overwrite_replaces_a_run_whose_own_files_were_edited(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    assert main(["run", str(recipe)]) == 0
    (tmp_path / "out" / "report.md").write_text("edited")
    (tmp_path / "out" / "model" / "config.json").unlink()
    assert main(["run", str(recipe), "--overwrite"]) == 0
    assert (tmp_path / "out" / "report.md").read_text() != "edited"
    assert (tmp_path / "out" / "model" / "config.json").is_file()


def test_a_run_from_before_runs_listed_their_files_is_judged_by_the_names_a_run_writes(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No .run-files (an earlier compressor's run): its own files are replaced, a user's are not."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    assert main(["run", str(recipe)]) == 0
    (tmp_path / "out" / RUN_FILES).unlink()
    (tmp_path / "out" / "model" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["run", str(recipe), "--overwrite"]) == 2
    assert "did not write (model/notes.txt)" in capsys.readouterr().err
    (tmp_path / "out" / "model" / "notes.txt").unlink()
    assert main(["run", str(recipe), "--overwrite"]) == 0
    assert (tmp_path / "out" / RUN_FILES).is_file()


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_that_is_not_a_run_is_never_replaced(
    tiny_checkpoint: Path, tmp_path: Path, overwrite: bool, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "thesis.tex").write_text("user data")
    assert main(["run", str(recipe), *(["--overwrite"] if overwrite else [])]) == 2
    assert "holds no previous run" in capsys.readouterr().err
    assert (tmp_path / "out" / "thesis.tex").read_text() == "user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "recipe.yaml"]


def test_a_symlinked_output_resolves_to_its_target(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    (tmp_path / "real").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "real")
    assert main(["run", str(recipe)]) == 0
    assert (tmp_path / "real" / "report.json").is_file()
    assert (tmp_path / "out").is_symlink() and (tmp_path / "out" / "report.json").is_file()


@pytest.mark.parametrize("target", ["file", "under-a-file"])
def test_unusable_output_paths_are_user_errors(
    tiny_checkpoint: Path, tmp_path: Path, target: str, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    (tmp_path / "a-file").write_text("x")
    output = tmp_path / "a-file" if target == "file" else tmp_path / "a-file" / "sub"
    assert main(["run", str(recipe), "--output", str(output), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert ("is not a folder" if target == "file" else "cannot create the output folder") in err
    assert (tmp_path / "a-file").read_text() == "x"


def test_saved_recipe_records_strategy_defaults(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None, pipeline=[{"strategy": "sensitivity"}])
    assert main(["run", str(recipe)]) == 0
    saved = yaml.safe_load((tmp_path / "out" / "recipe.yaml").read_text())
    assert saved["pipeline"] == [
        {"strategy": "sensitivity", "taus": [1.0, 7.0, 10.0, 30.0, 70.0], "include_pca": False, "refine": 0}
    ]
    assert saved["sensitivity"] == {
        "dtype": "float32",
        "reduction": "sum",
        "autocast": None,
        "chunk": 32,
        "recompute": None,
    }
    assert saved["seed"] == 0 and saved["activations"] == "host"


def test_dry_run_reads_the_config_but_no_weights(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = save_tiny_checkpoint(tmp_path / "model")
    (folder / "model.safetensors").write_bytes(b"not a checkpoint")  # any weight load would fail
    recipe = write_recipe(tmp_path, folder)
    assert main(["run", str(recipe), "--dry-run"]) == 0
    assert "recipe OK" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def _bloom_checkpoint(folder: Path) -> Path:
    from transformers import BloomConfig

    folder.mkdir()
    BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=100).save_pretrained(folder)
    return folder


def _gpt2_checkpoint(folder: Path) -> Path:
    from transformers import GPT2Config

    folder.mkdir()
    GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100).save_pretrained(folder)
    return folder


BAD_INPUTS = {
    "unknown top-level key": (dict(spars=0.3), None, "unknown key 'spars'"),
    "unknown nested key": (dict(calibration__num_sample=3), None, "unknown key 'calibration.num_sample'"),
    "no budget": (dict(sparsity=_DELETE), None, "give one of sparsity"),
    "unknown strategy": (dict(pipeline=[{"strategy": "pcaa"}]), None, "unknown strategy 'pcaa'"),
    "misspelt nested key in the file": (
        dict(calibration__num_samples=_DELETE, calibration__num_sample=4),
        None,
        "unknown key 'calibration.num_sample' (did you mean 'num_samples'?); allowed",
    ),
    "misspelt section in the file": (
        dict(calibraton={"num_samples": 4}, calibration=_DELETE),
        None,
        "unknown key 'calibraton' (did you mean 'calibration'?); allowed",
    ),
    "misspelt strategy": (
        dict(pipeline=[{"strategy": "sensitivty"}]),
        None,
        "unknown strategy 'sensitivty' (did you mean 'sensitivity'?)",
    ),
    "misspelt strategy option": (
        dict(pipeline=[{"strategy": "stiefel", "step": 5}]),
        None,
        "unknown key 'step' (did you mean 'steps'?)",
    ),
    "option for an option-less strategy": (dict(pipeline=[{"strategy": "pca", "tau": 3}]), None, "takes no options"),
    "empty pipeline": (dict(pipeline=[]), None, "pipeline must be a non-empty list"),
    "wrong type": (dict(calibration__num_samples="many"), None, "calibration.num_samples must be an integer"),
    "sparsity out of range": (dict(sparsity=1.5), None, "sparsity must be in [0, 1)"),
    "impossible sparsity": (dict(sparsity=0.95), None, "leaves no width"),
    "bad dtype": (dict(model__dtype="fp7"), None, "model.dtype must be one of"),
    "bad device": (dict(device="tpu"), None, "device must be auto, cpu, cuda"),
    "missing data file": (
        dict(calibration__dataset={"path": "json", "data_files": "nope.jsonl"}),
        None,
        "data file not found",
    ),
    "missing model folder": (dict(model__path="./no-such-model"), None, "model folder not found"),
    "reference data not beside the checkout": (
        dict(calibration__dataset={"path": "json", "data_files": "../shared/corpus/calib.jsonl"}),
        None,
        "expect the reference data (models/ref-llama, corpus/) in a shared/",
    ),
    "hub model while offline": (dict(model__path="someone/some-model"), None, "offline mode is on"),
    "unsupported family": ("bloom", None, "model_type 'bloom' is not supported"),
    "too little data": (dict(evaluation__num_samples=100000), None, "evaluation: the dataset yields"),
    "no text field": (dict(calibration__text_field="body"), None, "calibration: dataset record 0 has no field 'body'"),
    "bad --set": ({}, ["--set", "sparsity"], "--set expects KEY=VALUE"),
    "--set target_params beside the recipe's sparsity": (
        {},
        ["--set", "target_params=0.75"],
        "not both; remove sparsity (on the command line: --set sparsity=null)",
    ),
    "bad --set value": ({}, ["--set", "sparsity=lots"], "sparsity must be a number"),
    "--set value that is not YAML": ({}, ["--set", "sparsity=[0.3"], "--set sparsity: the value is not valid YAML"),
    "unknown option": ({}, ["--frobnicate"], "unrecognized arguments"),
    "--set yes is a string, not true": (
        {},
        ["--set", "evaluation.throughput=yes"],
        "evaluation.throughput must be true or false",
    ),
    "negative refinement top_k": (dict(refinement={"top_k": -1}), None, "refinement.top_k must be at least 0"),
    "a word for a count that takes auto": (
        dict(mlp={"measure_best": "foo"}),
        None,
        "mlp.measure_best must be an integer (splits measured: those of lowest predicted KL), or auto or null, got 'foo'",
    ),
    "a count out of range that takes auto": (
        dict(mlp={"screen_windows": 0}),
        None,
        "mlp.screen_windows must be at least 1 (calibration windows each split is pruned on while choosing), "
        "or auto or null, got 0",
    ),
    "unknown refinement key": (dict(refinement={"steps": 5}), None, "unknown key 'refinement.steps'"),
    "refinement after corrected readers": (
        dict(refinement={}, slicing={"correct_readers": True}),
        None,
        "refinement cannot follow slicing.correct_readers",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(
    case: str, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    changes, extra_args, message = BAD_INPUTS[case]
    if changes == "bloom":
        recipe = write_recipe(tmp_path, _bloom_checkpoint(tmp_path / "bloom"))
    else:
        recipe = write_recipe(tmp_path, tiny_checkpoint, **changes)
    code = main(["run", str(recipe), *(extra_args or [])])
    out, err = capsys.readouterr()
    assert code == 2
    assert message in err
    assert all(line.strip() for line in out.splitlines())  # phase lines at most, no blank line
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial*"))


def test_a_mistyped_model_folder_is_not_taken_for_a_hub_id(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "tiny-llama").symlink_to(tiny_checkpoint, target_is_directory=True)
    recipe = write_recipe(tmp_path, tiny_checkpoint, model__path="tiny-lama")
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'tiny-llama'?" in err and err.count("\n") == 1
    far = write_recipe(tmp_path, tiny_checkpoint, model__path="gpt2")  # a hub id without an organisation
    assert main(["run", str(far), "--dry-run"]) == 0


def test_missing_recipe_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["run", str(tmp_path / "absent.yaml")]) == 2
    assert "recipe file not found" in capsys.readouterr().err


def test_recipe_that_is_not_yaml(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed\nsparsity: 1\n")
    assert main(["run", str(path)]) == 2
    assert "not valid YAML at line 2" in capsys.readouterr().err


def test_recipe_folder_instead_of_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["run", str(tmp_path)]) == 2
    assert "is a folder; give the recipe file" in capsys.readouterr().err


def test_strategies_lists_builtin_pca_with_its_source(capsys: pytest.CaptureFixture) -> None:
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert "pca" in out and f"compressor {compressor.__version__}" in out and "SliceGPT" in out


def test_shipped_recipes_validate(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Every shipped recipe passes its dry run here; one for a GPU, on a machine without one,
    is checked in full and then refused naming the device (it would stop there at once)."""
    for recipe in sorted((EXAMPLES.parent / "recipes").glob("*.yaml")):
        if "shared" in recipe.read_text() and not (EXAMPLES.parent.parent / "shared").is_dir():
            continue
        model = str(yaml.safe_load(recipe.read_text())["model"]["path"])
        if model.startswith(".") and not (recipe.parent / model).is_dir():
            continue  # a folder a benchmark script makes (smollm2_stock.yaml: benchmarks/real_model.py prepare)
        command = ["run", str(recipe), "--dry-run", "--output", str(tmp_path / recipe.stem)]
        if "device: cuda" in recipe.read_text() and not torch.cuda.is_available():
            capsys.readouterr()
            assert main(command) == 2, recipe
            assert "no CUDA GPU" in capsys.readouterr().err
            command += ["--set", "device=auto"]
        assert main(command) == 0, recipe


def test_unsupported_family_fails_before_loading_weights(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = save_tiny_checkpoint(tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"not a checkpoint")  # would fail if anything loaded it
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "bloom"
    (folder / "config.json").write_text(json.dumps(config))
    recipe = write_recipe(tmp_path, folder)
    assert main(["run", str(recipe)]) == 2
    supported = sorted(t for family in BUILTIN_FAMILIES for t in family.model_types)
    assert f"supported model types: {', '.join(supported)} (a plugin can add" in capsys.readouterr().err
    assert "qwen3_5_text" in supported and "bloom" not in supported


def test_dry_run_refuses_an_existing_output_as_the_run_would(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.json").write_text("{}")
    assert main(["run", str(recipe), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("recipe checked, but the run would stop here") and "already holds a run" in err


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(sparsity=0.95), "leaves no width"),
        (dict(model__path="BLOOM"), "model_type 'bloom' is not supported"),
    ],
)
def test_dry_run_checks_a_local_model_config(
    changes: dict, message: str, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    if changes.get("model__path") == "BLOOM":
        changes = dict(model__path=str(_bloom_checkpoint(tmp_path / "bloom")))
    assert main(["run", str(write_recipe(tmp_path, tiny_checkpoint, **changes)), "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_two_packages_claiming_one_plugin_name_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """pluggy would load only the first of two same-named entry points, silently."""
    for name in ("alpha", "beta"):
        info = tmp_path / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text("[compressor]\nshared-name = compressor_plugins.pca\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["strategies"]) == 2
    err = capsys.readouterr().err
    assert "'shared-name' is registered by two installed packages, 'alpha' and 'beta'" in err


def test_a_plugin_package_installed_while_the_process_runs_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The registry's scan of installed packages is remembered for a sys.path as its folders
    stand: a package installed into one of them since (a `%pip install` in a notebook) is seen."""

    def install(name: str) -> None:
        info = tmp_path / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text("[compressor]\nextra = json\n")  # a module with no hooks

    install("alpha")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["strategies"]) == 0
    time.sleep(0.05)  # past the file system's clock tick
    install("beta")
    capsys.readouterr()
    assert main(["strategies"]) == 2
    assert "'extra' is registered by two installed packages, 'alpha' and 'beta'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(do_layer_norm_before=False), "do_layer_norm_before: false"),
    ],
)
def test_unsupported_opt_variants_are_refused(
    overrides: dict, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from transformers import OPTConfig

    folder = tmp_path / "opt"
    OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=8192, **overrides
    ).save_pretrained(folder)
    recipe = write_recipe(tmp_path, folder)
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_gpt2_needs_the_head_sliced_like_the_embedding(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = _gpt2_checkpoint(tmp_path / "gpt2")
    recipe = write_recipe(tmp_path, folder, evaluation=None, calibration__num_samples=1)  # its tokenizer: few windows
    assert main(["run", str(recipe), "--dry-run"]) == 2
    assert "set slicing.slice_head: true" in capsys.readouterr().err
    assert main(["run", str(recipe), "--dry-run", "--set", "slicing.slice_head=true"]) == 0


def test_compare_tabulates_runs_and_shows_the_options_that_differ(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, pipeline=[{"strategy": "sensitivity", "taus": [1, 10]}])
    assert main(["run", str(recipe), "--output", str(tmp_path / "a")]) == 0
    assert (
        main(
            [
                "run",
                str(recipe),
                "--output",
                str(tmp_path / "b"),
                "--set",
                "pipeline.0.taus=[3]",
                "--set",
                "sparsity=0.5",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(tmp_path / "t.csv")]) == 0
    import csv

    table = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert [row["pipeline"] for row in table] == ["sensitivity(taus=[1.0, 10.0])", "sensitivity(taus=[3.0])"]
    assert [row["kept"] for row in table] == ["48", "32"]
    reports = [json.loads((tmp_path / run / "report.json").read_text()) for run in ("a", "b")]
    assert [float(row["KL"]) for row in table] == [r["metrics"]["pruned"]["kl"] for r in reports]
    printed = capsys.readouterr().out.splitlines()  # not a terminal: the Markdown table
    assert printed[0].startswith("| run | model | pipeline |")
    assert printed[3].startswith("| b | tiny-llama") and "| sensitivity(taus=[3.0]) | 0.5 | 32 |" in printed[3]
    assert main(["compare", str(tmp_path / "a"), "--output", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text().splitlines()[2].startswith("| a | tiny-llama")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compare", "{tmp}/nothing"], "is not a finished run"),
        (
            ["compare", "{run}"],
            f"report.json is not a run report of compressor {compressor.__version__} (no compressor, model",
        ),
        (["compare", "{run}", "--output", "{tmp}/table.txt"], "--output must end in .md, .csv, .json"),
    ],
)
def test_compare_refuses_bad_input_in_one_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text("{}")
    assert main([a.format(tmp=tmp_path, run=run) for a in args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_eval_of_a_run_reproduces_the_runs_own_figures(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint)
    assert main(["run", str(recipe)]) == 0
    assert main(["eval", str(tmp_path / "out"), "--output", str(tmp_path / "eval.json")]) == 0
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    ran = json.loads((tmp_path / "out" / "report.json").read_text())
    assert evaluated["reference"] == str(tiny_checkpoint)
    for side, key in (("baseline", "ppl"), ("pruned", "ppl"), ("pruned", "kl")):
        assert evaluated["metrics"][side][key] == pytest.approx(ran["metrics"][side][key], rel=1e-6)
    assert "KL to reference" in capsys.readouterr().out
    assert evaluated["speed"] is None  # the run's own evaluation.throughput: false


def test_eval_times_a_run_whose_own_evaluation_did_not(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """`--throughput` overrides a run's `evaluation.throughput: false` (a run benchmarked without
    speed can be timed afterwards); `--no-throughput` the other way."""
    recipe = write_recipe(tmp_path, tiny_checkpoint)
    assert main(["run", str(recipe)]) == 0
    assert main(["eval", str(tmp_path / "out"), "--throughput", "--output", str(tmp_path / "timed.json")]) == 0
    speed = json.loads((tmp_path / "timed.json").read_text())["speed"]
    assert speed is not None and set(speed["speedup"]) == {"1", "8"}
    data = str(EXAMPLES / "data" / "valid-demo.jsonl")
    bare = ["eval", str(tiny_checkpoint), "--data", data, "--num-samples", "2", "--seq-len", "32"]
    # a model alone is timed unless told
    assert main([*bare, "--no-throughput", "--output", str(tmp_path / "untimed.json")]) == 0
    assert json.loads((tmp_path / "untimed.json").read_text())["speed"] is None


def test_eval_of_a_model_alone_and_with_fewer_windows(tiny_checkpoint: Path, tmp_path: Path) -> None:
    data = str(EXAMPLES / "data" / "valid-demo.jsonl")
    args = ["eval", str(tiny_checkpoint), "--data", data, "--num-samples", "2", "--seq-len", "32"]
    assert main([*args, "--output", str(tmp_path / "alone.json")]) == 0
    alone = json.loads((tmp_path / "alone.json").read_text())
    assert set(alone["metrics"]) == {"pruned", "tokens"} and alone["reference"] is None
    assert alone["metrics"]["tokens"]["count"] == 2 * 31
    assert main([*args, "--reference", str(tiny_checkpoint), "--output", str(tmp_path / "self.json")]) == 0
    itself = json.loads((tmp_path / "self.json").read_text())["metrics"]
    assert itself["pruned"]["kl"] == pytest.approx(0.0, abs=1e-9)  # a model against itself
    assert itself["pruned"]["ppl"] == pytest.approx(alone["metrics"]["pruned"]["ppl"], rel=1e-9)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "nothing to evaluate for"),
        (["--data", "{tmp}/missing.jsonl"], "data file not found"),
        (["--num-samples", "0", "--data", "{data}"], "evaluation.num_samples must be at least 1"),
        (["--output", "{tmp}/report.txt"], "--output must be a .json file"),
    ],
)
def test_eval_refuses_bad_input_in_one_line(
    extra: list[str], message: str, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = str(EXAMPLES / "data" / "valid-demo.jsonl")
    args = ["eval", str(tiny_checkpoint), *[a.format(tmp=tmp_path, data=data) for a in extra]]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_eval_of_a_folder_of_runs_says_what_it_is_and_what_would_do(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "report.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "runs"), "--data", str(EXAMPLES / "data" / "valid-demo.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "is not a run folder (no report.json) but holds 1 run(s)" in err and "compress compare" in err
    assert main(["eval", str(tmp_path / "empty")]) == 2
    assert "neither a run folder (no report.json) nor a model folder (no config.json)" in capsys.readouterr().err


def test_help_and_recipe_checks_leave_the_model_stack_unimported(tmp_path: Path) -> None:
    """`compress --help` imports neither torch nor transformers; checking a recipe and listing the
    strategies import torch (the strategies are torch code) but not transformers or lm-eval, and
    `compress run` reports a recipe's typo before it imports them (seconds sooner)."""
    import subprocess
    import sys

    script = (
        "import contextlib, io, sys\nfrom compressor.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n    {call}\n"
        "print(sorted(m for m in ('torch', 'transformers', 'lm_eval', 'datasets') if m in sys.modules))"
    )
    demo = EXAMPLES.parent / "recipes" / "demo.yaml"
    typo = tmp_path / "typo.yaml"
    typo.write_text(demo.read_text().replace("num_samples", "num_sample"))
    for call, expected in [
        (f"main(['run', {str(typo)!r}])", "['torch']"),
        ("main(['--help'])", "[]"),
        (
            f"from compressor.recipe.schema import load_recipe; from compressor.strategies.registry import PluginRegistry; "
            f"load_recipe({str(demo)!r}, PluginRegistry())",
            "['torch']",
        ),
        ("main(['strategies'])", "['torch']"),
    ]:
        out = subprocess.run(
            [sys.executable, "-c", script.format(call=call)], capture_output=True, text=True, check=True
        ).stdout
        assert out.strip().splitlines()[-1] == expected, (call, out)


def test_sliced_classes_register_even_after_a_probe_for_transformers() -> None:
    """Libraries probe with importlib.util.find_spec before importing; the hook must survive that."""
    import subprocess
    import sys

    script = (
        "import importlib.util, compressor\n"
        "importlib.util.find_spec('transformers')\n"
        "import transformers.models.llama\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        "print('sliced_llama' in CONFIG_MAPPING)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("yes", "yes"),
        ("on", "on"),
        ("n", "n"),
        ("true", True),
        ("False", False),
        ("1e-3", 1e-3),
        ("-2.5E+1", -25.0),
        ("010", 10),
        ("1:30", "1:30"),
        ("0x1f", 31),
        ("null", None),
        ("[1, no]", [1, "no"]),
    ],
)
def test_recipe_values_are_read_as_yaml_1_2(text: str, value: Any) -> None:
    """Only true/false are booleans (YAML 1.1 made `yes`, `on`, `n` booleans and `1:30` the number
    90), and `1e-3` is a number (YAML 1.1 left it a string)."""
    from compressor.recipe.reading import parse_yaml

    assert parse_yaml(text) == value and type(parse_yaml(text)) is type(value)


def test_yes_in_a_recipe_file_is_refused_not_read_as_true(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint)
    text = recipe.read_text()
    assert "throughput: false" in text
    recipe.write_text(text.replace("throughput: false", "throughput: yes"))
    assert main(["run", str(recipe), "--dry-run"]) == 2
    assert "evaluation.throughput must be true or false, got 'yes'" in capsys.readouterr().err


def test_bare_compress_prints_its_usage(capsys: pytest.CaptureFixture) -> None:
    assert main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: compress") and "run" in out and "eval" in out


def test_version_names_the_package_and_the_libraries_that_decide_results(capsys: pytest.CaptureFixture) -> None:
    from importlib.metadata import version

    import compressor

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"compress {compressor.__version__} (torch {version('torch')}")
    assert version("compressor") == compressor.__version__  # pyproject.toml and the package agree


def test_a_log_names_each_phase_once_and_a_long_one_with_its_time_left() -> None:
    import io

    from rich.console import Console

    from compressor.cli.display import phase_logger

    console = Console(file=io.StringIO(), width=200)
    log = phase_logger(console, every_s=0.0)
    for done in range(4):
        log("site 1/3 (embedding): stiefel", done, 4)
    log("site 2/3 (layer.0.attn): stiefel", 0, 4)
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 5 and all("site 1/3 (embedding): stiefel" in line for line in lines[:4])
    assert "left" not in lines[0] and "1/4, about" in lines[1] and "3/4, about" in lines[3]
    assert "site 2/3" in lines[4] and "left" not in lines[4]
    quiet_file = io.StringIO()
    quiet = phase_logger(Console(file=quiet_file, width=200), every_s=3600.0)
    for done in range(4):
        quiet("phase", done, 4)
    assert len(quiet_file.getvalue().splitlines()) == 1  # a short phase is one line, as before
