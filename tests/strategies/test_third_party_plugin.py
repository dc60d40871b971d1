"""A third-party strategy, installed for real, is found and used by the `compress` CLI.

The example plugin in examples/keep-coordinates-plugin is pip-installed (offline, from its
source folder) into a private target folder, then the CLI runs in subprocesses with that
folder on PYTHONPATH, exactly as it would for a user who pip-installed the plugin.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import compressor
from tests.conftest import BUILTIN_PLUGINS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "keep-coordinates-plugin"
REF_LLAMA = ROOT / "examples" / "ref-llama"
DATA = ROOT / "examples" / "data"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
HIDDEN, LAYERS = 64, 2


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example plugin, pip-installed into its own folder (no network, no build isolation).

    The source is copied first so setuptools' in-tree build/ and egg-info never land in (or
    stale files leak from) the repository's examples folder.
    """
    tmp = tmp_path_factory.mktemp("plugin")
    source = tmp / "keep-coordinates-plugin"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "--quiet",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    assert (target / "compressor_keep_coordinates" / "__init__.py").is_file()
    return target


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with the reference tokenizer (vocabulary 8192)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=8192,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(REF_LLAMA / name, folder / name)
    return folder


def _env(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(site),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        COMPRESS_PLUGINS=f"{BUILTIN_PLUGINS},keep-coordinates",  # the suite pins its plugins (conftest)
        COLUMNS="250",
    )  # rich wraps table cells at 80 columns when not on a terminal
    return env


def _cli(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "compressor.cli", *args],
        env=_env(site),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _recipe(folder: Path, model: Path, **step: object) -> Path:
    data = {"seq_len": 64, "num_samples": 4, "batch_size": 4}
    recipe = {
        "model": {"path": str(model), "dtype": "float32"},
        "calibration": {"dataset": {"path": "json", "data_files": str(DATA / "calib-demo.jsonl")}, **data},
        "evaluation": {"dataset": {"path": "json", "data_files": str(DATA / "valid-demo.jsonl")}, **data},
        "sparsity": 0.25,
        "pipeline": [{"strategy": "keep-coordinates", **step}],
        "device": "cpu",
        "output": str(folder / "unused"),
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_strategies_lists_the_installed_plugin(site: Path) -> None:
    result = _cli(site, "strategies")
    assert result.returncode == 0, result.stderr
    rows = {
        cells[0]: cells[1:]
        for cells in (
            [cell.strip() for cell in line.strip("│").split("│")]
            for line in result.stdout.splitlines()
            if line.startswith("│")
        )
    }
    assert rows["keep-coordinates"][:2] == ["keep-coordinates", "compressor-keep-coordinates 0.1.0"], result.stdout
    assert rows["pca"][:2] == ["pca", f"compressor {compressor.__version__}"], (
        result.stdout
    )  # the built-in is still there


def test_compress_plugins_keeps_an_installed_plugin_from_loading(site: Path, tiny_llama: Path, tmp_path: Path) -> None:
    """COMPRESS_PLUGINS lists what may load: the third party's module is never imported, listings
    say what was left out, and a recipe naming its strategy is refused in one line."""

    def cli(*args: str, plugins: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from compressor.cli import main; code = main(); "
                "assert 'compressor_keep_coordinates' not in sys.modules; sys.exit(code)",
                *args,
            ],
            env={**_env(site), "COMPRESS_PLUGINS": plugins},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    listed = cli("strategies", plugins="pca,sensitivity")
    assert listed.returncode == 0, listed.stderr
    assert "keep-coordinates" not in listed.stdout.split("COMPRESS_PLUGINS")[0]
    assert (
        "COMPRESS_PLUGINS=pca,sensitivity: not loaded: depth, experts, heads, keep-coordinates, neurons, stiefel"
        in listed.stdout
    )
    refused = cli("run", str(_recipe(tmp_path, tiny_llama)), "--dry-run", plugins="pca")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert (
        "unknown strategy 'keep-coordinates'; registered strategies: pca (COMPRESS_PLUGINS=pca limits the plugins)"
        in refused.stderr
    )
    unknown = cli("strategies", plugins="pca,keep-cordinates")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1
    assert "COMPRESS_PLUGINS names 'keep-cordinates', which is not an installed plugin; installed: " in unknown.stderr
    installed = unknown.stderr.split("installed: ")[1].strip().split(", ")
    assert {"keep-coordinates", "pca", "sensitivity", "stiefel"} <= set(installed)  # and whatever else a user has


def test_basis_is_a_permutation_of_the_highest_energy_coordinates(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "compressor_keep_coordinates", raising=False)
    from compressor_keep_coordinates import KeepCoordinates

    from compressor.strategies.contract import Basis, SiteProblem, SiteStatistics, StrategyOptionError

    strategy = KeepCoordinates()
    energy = torch.tensor([0.5, 3.0, 0.1, 2.0, 1.0], dtype=torch.float64)
    x = torch.randn(5, 5, dtype=torch.float64)
    C = torch.diag(energy) + 0.01 * (x @ x.T)  # off-diagonal terms must not matter
    problem = SiteProblem(name="s", index=0, width=5, keep=3, stats=SiteStatistics(C=C, tokens=10))

    basis = strategy.select(problem, None, strategy.parse_options({}))
    assert basis.Q.dtype == torch.float64 and basis.Q.shape == (5, 5)
    assert torch.equal(basis.Q.abs().sum(0), torch.ones(5)) and torch.equal(basis.Q.sum(1), torch.ones(5))
    assert basis.Q[:, :3].argmax(0).tolist() == torch.diagonal(C).argsort(descending=True)[:3].tolist()
    removed = float(torch.diagonal(C)[basis.Q[:, 3:].argmax(0)].sum())
    assert basis.objectives["removed_energy"] == pytest.approx(removed)
    assert basis.objectives["removed_energy_fraction"] == pytest.approx(removed / float(torch.trace(C)))

    naive = strategy.select(problem, None, strategy.parse_options({"order": "index"}))
    assert torch.equal(naive.Q, torch.eye(5, dtype=torch.float64))

    # Chained after another step, it reorders that step's directions instead of the coordinates.
    rotation, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))
    chained = strategy.select(problem, Basis(Q=rotation), strategy.parse_options({}))
    assert torch.allclose(chained.Q.T @ chained.Q, torch.eye(5, dtype=torch.float64))
    kept_energy = torch.diagonal(chained.Q.T @ C @ chained.Q)
    assert torch.all(kept_energy[:-1] >= kept_energy[1:])

    for bad in ({"order": "sideways"}, {"order": 1}, {"descending": True}):
        with pytest.raises(StrategyOptionError):
            strategy.parse_options(bad)


def test_run_recipe_with_the_plugin(site: Path, tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _cli(site, "run", str(_recipe(tmp_path, tiny_llama, order="energy")), "--output", str(out))
    assert result.returncode == 0, result.stderr

    report = json.loads((out / "report.json").read_text())
    assert [step["strategy"] for step in report["pipeline"]] == ["keep-coordinates"]
    assert report["kept_width"] == 48
    sites = report["sites"]
    assert len(sites) == 2 * LAYERS + 1
    for site_record in sites:
        assert site_record["strategy"] == "keep-coordinates"
        assert set(site_record["steps"][0]["objectives"]) == {"removed_energy", "removed_energy_fraction"}
    assert [s["kept"] for s in sites] == [48] * (2 * LAYERS) + [HIDDEN]  # the head is not sliced by default
    assert sites[-1]["steps"][0]["objectives"]["removed_energy"] == 0.0
    assert 0.0 < sites[0]["steps"][0]["objectives"]["removed_energy_fraction"] < 1.0
    assert (out / "model" / "config.json").is_file()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            {"order": "sideways"},
            "pipeline.0: strategy 'keep-coordinates': order must be energy or index, got 'sideways'",
        ),
        ({"descending": True}, "pipeline.0: strategy 'keep-coordinates' has no option 'descending'"),
    ],
)
def test_bad_option_is_one_line_user_error(
    site: Path, tiny_llama: Path, tmp_path: Path, option: dict[str, object], message: str
) -> None:
    out = tmp_path / "out"
    result = _cli(site, "run", str(_recipe(tmp_path, tiny_llama, **option)), "--output", str(out))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr
    assert not out.exists()


RERANK = ROOT / "examples" / "rerank-plugin"
"""The guide's worked plugin (an option class, the helpers, H), written step by step in the guide."""


def test_guide_shows_the_example_as_it_is() -> None:
    """docs/writing-a-strategy.md quotes the plugins' files in full; keep them in step."""
    guide = (ROOT / "docs" / "writing-a-strategy.md").read_text()
    for path in ("pyproject.toml", "compressor_keep_coordinates/__init__.py"):
        assert (EXAMPLE / path).read_text() in guide, f"the guide's copy of {path} is out of date"
    for path in ("pyproject.toml", "compressor_rerank/__init__.py", "ref_llama_rerank.yaml", "test_rerank.py"):
        assert (RERANK / path).read_text() in guide, f"the guide's copy of rerank-plugin/{path} is out of date"


def test_the_guide_s_worked_plugin_passes_its_own_tests(tmp_path: Path) -> None:
    """What the guide tells its reader to run (`pytest examples/rerank-plugin`), run here from
    the source folder: the plugin's module imports and its basis checks hold."""
    env = {**os.environ, "PYTHONPATH": str(RERANK)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(RERANK)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_the_guide_s_example_copied_into_any_folder_runs_on_the_bundled_model_and_writes_beside_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worked plugin's folder copied elsewhere (as the guide invites): its recipe reads the demo
    model and text the package ships (`bundled:`), whatever folder it lies in, and its run is
    written into that folder's `runs/`, nothing outside it."""
    import importlib

    from compressor.recipe.reading import apply_override
    from compressor.recipe.schema import load_recipe, validate
    from compressor.run.runner import run
    from compressor.strategies.registry import PluginRegistry

    copy = tmp_path / "my plugins" / "rerank-plugin"
    shutil.copytree(RERANK, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "runs"))
    monkeypatch.syspath_prepend(str(copy))
    registry = PluginRegistry(extra_plugins=[importlib.import_module("compressor_rerank")])
    recipe = load_recipe(copy / "ref_llama_rerank.yaml", registry)
    assert Path(recipe.model.path) == (ROOT / "examples" / "ref-llama").resolve()  # the editable install's bundle
    assert recipe.calibration.dataset["data_files"] == str((DATA / "calib-demo.jsonl").resolve())
    assert Path(recipe.output) == copy / "runs" / "ref-llama-rerank-25"
    raw = yaml.safe_load((copy / "ref_llama_rerank.yaml").read_text())
    for change in ("calibration.num_samples=4", "calibration.seq_len=64", "evaluation=null"):
        apply_override(raw, change)
    before = sorted(p.name for p in tmp_path.iterdir())
    report = run(validate(raw, copy, registry), registry)
    assert report is not None and report.pipeline[0].strategy == "rerank"
    assert (copy / "runs" / "ref-llama-rerank-25" / "model" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing beside the folder


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("model.path=bundled:ref-lama", "bundled:ref-lama: the package ships no such file; it ships ref-llama, "),
        ("calibration.dataset.data_files=bundled:data/../../pyproject.toml", "the package ships no such file"),
        (
            "output=bundled:ref-llama",
            "output: bundled:ref-llama names a file the package ships; give a folder of yours",
        ),
    ],
)
def test_a_bundled_path_the_package_does_not_ship_is_one_line(
    change: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from compressor.cli import main

    shutil.copy(RERANK / "ref_llama_rerank.yaml", tmp_path / "recipe.yaml")
    capsys.readouterr()
    assert main(["run", str(tmp_path / "recipe.yaml"), "--set", change, "--set", "pipeline=[{strategy: pca}]"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_the_wheel_ships_the_bundled_demo_model_and_text_and_no_example_plugin(tmp_path: Path) -> None:
    """`bundled:` paths must resolve in an installed wheel too: it carries `compressor_demo` with the
    demo model and its text, and none of the example plugins' code beside them."""
    import zipfile

    source = tmp_path / "source"  # setuptools builds in the tree: a copy keeps build/ out of the checkout
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "runs")
    for part in ("compressor", "plugins", "examples"):
        shutil.copytree(ROOT / part, source / part, ignore=skip)
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--quiet",
        "-w",
        str(tmp_path),
    ]
    done = subprocess.run([*command, "."], cwd=source, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("compressor-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert f"compressor_demo/ref-llama/{name}" in names
    assert {"compressor_demo/data/calib-demo.jsonl", "compressor_demo/data/valid-demo.jsonl"} <= names
    assert not any("rerank" in name or "keep_coordinates" in name or "arcee" in name for name in names)


def test_the_suite_passes_in_a_venv_where_a_users_plugin_is_installed(site: Path) -> None:
    """A user who writes a plugin (docs/writing-a-strategy.md) and then runs the suite: the tests
    that list strategies see only the plugins they mean (conftest pins COMPRESS_PLUGINS)."""
    env = {key: value for key, value in _env(site).items() if key != "COMPRESS_PLUGINS"}  # as in a user's shell
    chosen = [
        "tests/run/test_hardening.py::test_the_recipe_schema_is_current_and_accepts_the_shipped_recipes",
        "tests/run/test_cli.py::test_strategies_lists_builtin_pca_with_its_source",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *chosen],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 passed" in result.stdout


@pytest.mark.parametrize("example", sorted(p.parent.name for p in (ROOT / "examples").glob("*/pyproject.toml")))
def test_example_plugins_resolve_against_this_compressor(example: str, tmp_path: Path) -> None:
    """pip's resolver, offline, against the installed compressor: the example's `compressor` pin
    admits this version (its other dependencies are installed here already), so the plugin guide's
    first `pip install` works. A pin left behind by a version bump fails here."""
    source = tmp_path / example
    shutil.copytree(ROOT / "examples" / example, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "--quiet",
            "--report",
            str(tmp_path / "report.json"),
            str(source),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    wanted = [item["metadata"]["name"] for item in json.loads((tmp_path / "report.json").read_text())["install"]]
    assert wanted == [f"compressor-{example.removesuffix('-plugin')}"], wanted  # nothing but the plugin itself
