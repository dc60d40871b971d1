"""Per-site checkpoints: a `compress run` killed anywhere continues to a bit-identical model;
bases saved as data rebuild the model exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from compressor.cli import main
from compressor.engine.bases import apply_bases, load_bases
from compressor.engine.checkpoint import Checkpoint
from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.faults import KILL_VARIABLE
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor_plugins.pca import PCA
from compressor_plugins.sensitivity import Sensitivity, TauGrid
from tests.conftest import EXAMPLES, FAMILY_CONFIGS, ROOT, copy_model, random_batches, tiny_model, widths_for
from tests.run.test_cli import write_recipe

SITES = ["embedding", "layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp"]


def compress(recipe: Path, output: Path, *extra: str, kill: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(torch.get_num_threads())}  # alike every run
    env.pop(KILL_VARIABLE, None)
    if kill is not None:
        env[KILL_VARIABLE] = kill
    return subprocess.run(
        [sys.executable, "-m", "compressor.cli", "run", str(recipe), "--output", str(output), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def killed_and_resumed_is_whole(recipe: Path, folder: Path, kill: str, sites: int) -> None:
    """A run of `recipe` killed (SIGKILL) at fault point `kill` and run again loads its `sites` walked
    sites from the checkpoint and saves the model an uninterrupted run saves, tensor for tensor."""
    done = compress(recipe, folder / "whole")
    assert done.returncode == 0, done.stderr
    killed = compress(recipe, folder / "run", kill=kill)
    assert killed.returncode == -9, killed.stderr
    resumed = compress(recipe, folder / "run")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((folder / "run" / "report.json").read_text())["resume"]["sites_loaded"] == sites
    whole, again = (load_file(str(folder / r / "model" / "model.safetensors")) for r in ("whole", "run"))
    assert whole.keys() == again.keys() and all(torch.equal(whole[k], again[k]) for k in whole)


def tensors(run: Path) -> dict[str, torch.Tensor]:
    found = {f"model.{k}": v for k, v in load_file(str(run / "model" / "model.safetensors")).items()}
    found.update({f"bases.{k}": v for k, v in load_bases(run / "bases.safetensors").items()})
    return found


@pytest.fixture(scope="module")
def recipe(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """H and a τ-search (so H is checkpointed too), several H chunks, no evaluation (not resumed)."""
    folder = tmp_path_factory.mktemp("resume")
    return write_recipe(
        folder,
        tiny_checkpoint,
        evaluation=None,
        pipeline=[{"strategy": "sensitivity"}],
        calibration__num_samples=8,
        sensitivity={"chunk": 2},
    )


@pytest.fixture(scope="module")
def uninterrupted(recipe: Path) -> dict[str, torch.Tensor]:
    output = recipe.parent / "uninterrupted"
    done = compress(recipe, output)
    assert done.returncode == 0, done.stderr
    return tensors(output)


# (kill point, finished sites loaded on resume, H loaded, first site chosen after resuming)
KILLS = [
    ("capture", 0, False, None),
    ("fisher", 0, False, None),  # mid-way through the H pass: H is not saved, so it is recomputed
    ("site:embedding", 1, True, "layers.0.attn"),
    ("site:layers.0.attn", 2, True, "layers.0.mlp"),  # in the middle of a layer
    ("site:layers.1.mlp", 5, False, None),  # after the last site: nothing left to choose, H not needed
    ("publish", 5, False, None),  # everything written, not yet in place
]


@pytest.mark.parametrize(("point", "loaded", "fisher_loaded", "resumed_from"), KILLS, ids=[k[0] for k in KILLS])
def test_a_killed_run_resumes_to_a_bit_identical_model(
    point: str,
    loaded: int,
    fisher_loaded: bool,
    resumed_from: str | None,
    recipe: Path,
    uninterrupted: dict[str, torch.Tensor],
    tmp_path: Path,
) -> None:
    output = tmp_path / "run"
    killed = compress(recipe, output, kill=point)
    assert killed.returncode == -9, killed.stderr  # SIGKILL: no handler ran
    assert not output.exists()
    resumed = compress(recipe, output)
    assert resumed.returncode == 0, resumed.stderr
    assert not (tmp_path / ".run.partial").exists()
    said = f"resuming an interrupted run: {tmp_path / '.run.partial' / 'checkpoint'} holds {loaded} finished site(s)"
    assert (said in resumed.stdout) == (loaded > 0)  # said first, before the work
    assert said not in resumed.stdout or resumed.stdout.index(said) < resumed.stdout.index("wrote")
    report = json.loads((output / "report.json").read_text())
    assert report["resume"] == {"sites_loaded": loaded, "fisher_loaded": fisher_loaded}
    assert report["resumed_from"] == resumed_from
    assert [s["name"] for s in report["sites"]] == SITES
    produced = tensors(output)
    assert produced.keys() == uninterrupted.keys()
    different = [name for name, value in uninterrupted.items() if not torch.equal(produced[name], value)]
    assert not different


def test_a_changed_recipe_is_refused_and_restart_discards_the_checkpoint(recipe: Path, tmp_path: Path) -> None:
    output = tmp_path / "run"
    assert compress(recipe, output, kill="site:layers.0.attn").returncode == -9
    same = compress(recipe, output, "--dry-run")
    assert same.returncode == 0 and "the run would resume an interrupted run" in same.stdout
    assert "holds 2 finished site(s), H" in same.stdout
    changed = compress(recipe, output, "--set", "sparsity=0.5")
    assert changed.returncode == 2
    assert changed.stderr.strip().count("\n") == 0 and "Traceback" not in changed.stderr
    assert "different recipe (sparsity changed)" in changed.stderr and "--restart" in changed.stderr
    assert "resuming" not in changed.stdout  # refused before it says it resumes
    assert (
        "different recipe (sparsity changed)" in compress(recipe, output, "--set", "sparsity=0.5", "--dry-run").stderr
    )
    restarted = compress(recipe, output, "--set", "sparsity=0.5", "--restart")
    assert restarted.returncode == 0, restarted.stderr
    report = json.loads((output / "report.json").read_text())
    assert report["resume"]["sites_loaded"] == 0 and report["resumed_from"] is None
    assert report["kept_width"] == 32


def test_a_run_killed_with_spilled_activations_resumes_with_other_memory_settings(
    recipe: Path, uninterrupted: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """Memory settings are not part of the fingerprint (a run killed for lack of memory resumes
    with new ones), and the killed run's spill files do not reach the output."""
    output = tmp_path / "run"
    killed = compress(recipe, output, "--set", "activations=disk", kill="site:layers.0.attn")
    assert killed.returncode == -9
    assert list((tmp_path / ".run.partial" / "scratch").glob("activations-*/*.bin"))
    resumed = compress(recipe, output, "--set", "activations=host", "--set", "sensitivity.chunk=1")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(p.name for p in output.iterdir()) == [
        ".run-files",
        "bases.safetensors",
        "model",
        "recipe.yaml",
        "report.json",
        "report.md",
    ]  # no scratch left
    assert json.loads((output / "report.json").read_text())["resume"]["sites_loaded"] == 2
    produced = tensors(output)
    assert all(torch.equal(produced[name], value) for name, value in uninterrupted.items())


def test_ctrl_c_keeps_the_checkpoint_and_says_how_to_continue(
    recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def interrupt_at(point: str) -> None:
        if point == "site:layers.0.attn":
            raise KeyboardInterrupt

    output = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr("compressor.engine.walk.faults.reached", interrupt_at)
        assert main(["run", str(recipe), "--output", str(output)]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted; progress is kept: run the same command to continue" in err
    assert not output.exists() and (tmp_path / ".run.partial" / "checkpoint" / "fingerprint.json").is_file()
    assert main(["run", str(recipe), "--output", str(output)]) == 0
    assert json.loads((output / "report.json").read_text())["resumed_from"] == "layers.0.mlp"


def test_sites_without_a_fingerprint_are_not_trusted(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "checkpoint")
    checkpoint.start({"recipe": "a"})
    checkpoint.save_site(0, "embedding", torch.eye(4, dtype=torch.float64), {"name": "embedding"})
    assert list(Checkpoint(tmp_path / "checkpoint").finished_sites()) == ["embedding"]
    (tmp_path / "checkpoint" / "fingerprint.json").unlink()  # e.g. killed while being discarded
    checkpoint.start({"recipe": "b"})
    assert checkpoint.finished_sites() == {} and not checkpoint.has_progress()


def test_changed_data_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    data = tmp_path / "calib.jsonl"
    data.write_text((EXAMPLES / "data" / "calib-demo.jsonl").read_text())
    recipe = write_recipe(
        tmp_path, tiny_checkpoint, evaluation=None, calibration__dataset={"path": "json", "data_files": str(data)}
    )
    output = tmp_path / "run"
    assert compress(recipe, output, kill="site:layers.0.attn").returncode == -9
    data.write_text("\n".join(reversed(data.read_text().splitlines())) + "\n")  # same recipe, other windows
    changed = compress(recipe, output)
    assert changed.returncode == 2 and "different data" in changed.stderr and "--restart" in changed.stderr
    assert (tmp_path / ".run.partial" / "checkpoint").is_dir()  # refused, not discarded


@pytest.mark.parametrize("family_name", sorted(FAMILY_CONFIGS))
def test_saved_bases_applied_to_the_original_model_reproduce_the_pruned_model(family_name: str) -> None:
    original = tiny_model(family_name)
    family = family_for(family_name)
    d = original.config.hidden_size
    widths = widths_for(family_name, original.config, kept_width(d, 0.25, 8), family.head_width_is_embedding_width)
    result = prune(
        copy_model(original),
        fixed_layout(original.config, family, widths),
        random_batches(original.config.vocab_size),
        [PipelineStep(PCA())],
    )
    assert {site: v.shape[1] for site, v in result.bases.items()} == widths
    rebuilt = apply_bases(copy_model(original), family, result.bases)
    expected, actual = result.model.state_dict(), rebuilt.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)
    assert rebuilt.config.slicing == result.model.config.slicing


def test_activations_spilled_to_disk_give_the_same_model(tmp_path: Path) -> None:
    original = tiny_model("llama")
    d = original.config.hidden_size
    widths = widths_for("llama", original.config, kept_width(d, 0.25, 8), False)
    batches = random_batches(original.config.vocab_size, count=3)
    pipeline = [PipelineStep(Sensitivity(), TauGrid())]
    in_memory = prune(
        copy_model(original), fixed_layout(original.config, family_for("llama"), widths), batches, pipeline
    )
    spilled = prune(
        copy_model(original),
        fixed_layout(original.config, family_for("llama"), widths),
        batches,
        pipeline,
        WalkOptions(offload="disk", scratch=tmp_path),
    )
    assert not list(tmp_path.iterdir())  # the spill files are gone
    for name, value in in_memory.model.state_dict().items():
        assert torch.equal(spilled.model.state_dict()[name], value), name


def test_the_default_budget_leaves_the_fingerprint_as_it_was_before_the_key(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """A checkpoint written before `budget` existed still resumes: the default is left out of the
    digest, and a budget that changes the model changes it."""
    from compressor.recipe.schema import load_recipe
    from compressor.runtime.resume import fingerprinted, recipe_fingerprint
    from compressor.strategies.registry import PluginRegistry

    registry = PluginRegistry()
    plain = write_recipe(tmp_path, tiny_checkpoint, sparsity=None, target_params=0.8)
    default = load_recipe(plain, registry)
    counted = load_recipe(plain, registry, ["budget=non_embedding"])
    assert "budget" not in fingerprinted(default) and fingerprinted(counted)["budget"] == "non_embedding"
    assert recipe_fingerprint(default) != recipe_fingerprint(counted)
