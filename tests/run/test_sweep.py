"""`compress sweep`: a grid of runs sharing H, data and the dense model, resumable, with tables and plots."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import compressor.engine.sensitivity
from compressor.cli import main
from tests.reports import report_dict
from tests.run.test_cli import write_recipe

PNG = b"\x89PNG\r\n\x1a\n"


def _write_sweep(folder: Path, base: Path, **extra: object) -> Path:
    sweep = {
        "base": base.name,
        "output": "sweep-out",
        "grid": {
            "sparsity": [0.125, 0.25],
            "pipeline": [
                [{"strategy": "sensitivity"}],
                [{"strategy": "sensitivity"}, {"strategy": "stiefel", "steps": 2}],
            ],
        },
        **extra,
    }
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))  # grid order decides the run order
    return path


@pytest.fixture
def fisher_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the H passes the engine really runs."""
    calls: list[int] = []
    real = compressor.engine.sensitivity.estimate_fisher

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(compressor.engine.sensitivity, "estimate_fisher", counted)
    return calls


def test_a_sweep_writes_its_table_and_plots_and_computes_h_once(
    tiny_checkpoint: Path, tmp_path: Path, fisher_calls: list[int]
) -> None:
    base = write_recipe(tmp_path, tiny_checkpoint)
    assert main(["sweep", str(_write_sweep(tmp_path, base))]) == 0
    out = tmp_path / "sweep-out"
    assert len(fisher_calls) == 1  # 4 runs need H; it depends on none of the varied keys
    with open(out / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 4
    shared = [float(r["shared s"]) for r in table]  # the first run loads, tokenises and computes H for all
    assert float(table[0]["H s"]) > 0 and [float(r["H s"]) for r in table[1:]] == [0.0, 0.0, 0.0]
    assert shared[0] > float(table[0]["H s"]) and all(s < shared[0] for s in shared[1:])
    assert {(r["sparsity"], r["pipeline"]) for r in table} == {
        (s, p) for s in ("0.125", "0.25") for p in ("sensitivity", "sensitivity + stiefel")
    }
    assert len(json.loads((out / "results.json").read_text())) == 4
    assert (out / "results.md").read_text().count("\n| 0") == 4
    for plot in ("kl_ppl_vs_sparsity.png", "objectives_by_site.png"):
        assert (out / plot).read_bytes().startswith(PNG)
    reports = [json.loads((out / "runs" / name / "report.json").read_text()) for name in ("000", "001", "002", "003")]
    assert [r["sparsity"] for r in reports] == [0.125, 0.125, 0.25, 0.25]
    assert all(r["metrics"]["pruned"]["kl"] > 0 for r in reports)
    assert not (out / "runs" / "000" / "model").exists()  # save_models is off: the bases are kept
    assert (out / "runs" / "000" / "bases.safetensors").is_file()
    # compress eval rebuilds such a run's model from the original and its bases
    assert main(["eval", str(out / "runs" / "003"), "--no-throughput", "--output", str(tmp_path / "e.json")]) == 0
    evaluated_report = json.loads((tmp_path / "e.json").read_text())
    assert evaluated_report["target"].endswith("003 (rebuilt from bases.safetensors)")
    evaluated = evaluated_report["metrics"]
    assert evaluated["pruned"]["kl"] == pytest.approx(reports[3]["metrics"]["pruned"]["kl"], rel=1e-6)
    assert evaluated["pruned"]["ppl"] == pytest.approx(reports[3]["metrics"]["pruned"]["ppl"], rel=1e-6)


def test_an_interrupted_sweep_continues_without_recomputing(
    tiny_checkpoint: Path, tmp_path: Path, fisher_calls: list[int], capsys: pytest.CaptureFixture
) -> None:
    base = write_recipe(tmp_path, tiny_checkpoint)
    sweep = _write_sweep(tmp_path, base)
    assert main(["sweep", str(sweep)]) == 0
    out = tmp_path / "sweep-out"
    first = json.loads((out / "results.json").read_text())
    kept = (out / "runs" / "000" / "report.json").stat().st_mtime_ns
    shutil.rmtree(out / "runs" / "003")  # as if the sweep had stopped before its last run was published
    capsys.readouterr()
    assert main(["sweep", str(sweep)]) == 0
    assert "ran 1 of 4 runs" in capsys.readouterr().out
    assert len(fisher_calls) == 1  # the second invocation loaded H from the sweep's shared folder
    assert (out / "runs" / "000" / "report.json").stat().st_mtime_ns == kept
    again = json.loads((out / "results.json").read_text())
    assert [r["KL"] for r in again] == pytest.approx([r["KL"] for r in first], rel=1e-9)


def test_a_changed_grid_point_is_run_again(
    tiny_checkpoint: Path, tmp_path: Path, fisher_calls: list[int], capsys: pytest.CaptureFixture
) -> None:
    base = write_recipe(tmp_path, tiny_checkpoint)
    assert main(["sweep", str(_write_sweep(tmp_path, base))]) == 0
    capsys.readouterr()
    assert main(["sweep", str(_write_sweep(tmp_path, base, set={"evaluation.num_samples": 3}))]) == 0
    assert "ran 4 of 4 runs" in capsys.readouterr().out  # every recipe changed (evaluation is no fingerprint key)


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        ({"base": "recipe.yaml", "output": "o"}, "missing key 'grid' in sweep"),
        ({"base": "recipe.yaml", "output": "o", "grid": {"sparsity": 0.2}}, "grid.sparsity must be a non-empty list"),
        ({"base": "recipe.yaml", "output": "o", "grid": {"sparsity": [0.2]}, "plots": True}, "unknown key 'plots'"),
        ({"base": "nothing.yaml", "output": "o", "grid": {"sparsity": [0.2]}}, "base recipe file not found"),
        (
            {"base": "recipe.yaml", "output": "o", "grid": {"sparsity": [0.2, 1.5]}},
            "sweep run 001 (sparsity=1.5): sparsity must be in [0, 1)",
        ),
        ({"base": "recipe.yaml", "output": "o", "grid": {"pipeline": [[{"strategy": "nosuch"}]]}}, "unknown strategy"),
    ],
)
def test_bad_sweeps_are_one_line_and_write_nothing(
    sweep: dict, message: str, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    write_recipe(tmp_path, tiny_checkpoint)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_a_sweep_refuses_a_folder_it_did_not_write(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = write_recipe(tmp_path, tiny_checkpoint)
    (tmp_path / "sweep-out").mkdir()
    (tmp_path / "sweep-out" / "notes.txt").write_text("mine")
    assert main(["sweep", str(_write_sweep(tmp_path, base))]) == 2
    assert "is not an earlier sweep's folder" in capsys.readouterr().err


def test_a_sweep_killed_mid_run_resumes_that_run_and_reuses_h(tiny_checkpoint: Path, tmp_path: Path) -> None:
    base = write_recipe(tmp_path, tiny_checkpoint)
    sweep = _write_sweep(tmp_path, base)

    def compress(kill: str | None) -> subprocess.CompletedProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
        if kill:
            env["COMPRESS_KILL_AT"] = kill
        return subprocess.run(
            [sys.executable, "-m", "compressor.cli", "sweep", str(sweep)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    killed = compress("site:layers.1.attn")  # SIGKILL inside the first run, after H and some sites
    assert killed.returncode == -9
    out = tmp_path / "sweep-out"
    assert (out / "runs" / ".000.partial" / "checkpoint").is_dir()
    finished = compress(None)
    assert finished.returncode == 0, finished.stderr
    assert "ran 4 of 4 runs" in finished.stdout and "H computed 0 time(s)" in finished.stdout
    first = json.loads((out / "runs" / "000" / "report.json").read_text())
    assert first["resume"]["sites_loaded"] > 0


def test_a_point_interrupted_under_an_edited_grid_starts_afresh(tiny_checkpoint: Path, tmp_path: Path) -> None:
    base = write_recipe(tmp_path, tiny_checkpoint)
    sweep = _write_sweep(tmp_path, base)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "COMPRESS_KILL_AT": "site:layers.1.attn"}
    killed = subprocess.run(
        [sys.executable, "-m", "compressor.cli", "sweep", str(sweep)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -9
    edited = _write_sweep(tmp_path, base, set={"calibration.num_samples": 3})  # run 000's recipe is another now
    assert main(["sweep", str(edited)]) == 0
    report = json.loads((tmp_path / "sweep-out" / "runs" / "000" / "report.json").read_text())
    assert report["resume"]["sites_loaded"] == 0 and report["sites"][0]["tokens"] == 3 * 64


def test_extending_the_grid_keeps_every_finished_run(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = write_recipe(tmp_path, tiny_checkpoint)
    pipelines = [[{"strategy": "pca"}], [{"strategy": "sensitivity"}]]
    assert (
        main(["sweep", str(_write_sweep(tmp_path, base, grid={"sparsity": [0.125, 0.375], "pipeline": pipelines}))])
        == 0
    )
    out = tmp_path / "sweep-out"
    kl = {json.loads((out / "runs" / n / "report.json").read_text())["sparsity"]: None for n in ("002", "003")}
    before = {n: (out / "runs" / n / "report.json").read_text() for n in ("000", "001", "002", "003")}
    capsys.readouterr()
    extended = _write_sweep(tmp_path, base, grid={"sparsity": [0.125, 0.25, 0.375], "pipeline": pipelines})
    assert main(["sweep", str(extended)]) == 0
    assert "ran 2 of 6 runs" in capsys.readouterr().out  # only the inserted 0.25 runs
    assert (out / "runs" / "004" / "report.json").read_text() == before["002"]  # 0.375 moved from 002 to 004
    assert (out / "runs" / "005" / "report.json").read_text() == before["003"]
    assert json.loads((out / "runs" / "002" / "report.json").read_text())["sparsity"] == 0.25
    assert list(kl) == [0.375]
    shrunk = _write_sweep(tmp_path, base, grid={"sparsity": [0.125], "pipeline": pipelines})
    assert main(["sweep", str(shrunk)]) == 0
    assert sorted(p.name for p in (out / "previous").iterdir()) == ["002", "003", "004", "005"]
    assert len(json.loads((out / "results.json").read_text())) == 2


def test_plots_of_runs_with_a_parameter_target_use_the_parameter_fraction(tmp_path: Path) -> None:
    """Runs with `target_params` have no sparsity: their points sit at the parameters they kept."""
    from compressor.evaluation.plots import _lines, sweep_plots

    table = [
        {
            "model": "m",
            "pipeline": "pca",
            "sparsity": None,
            "target_params": t,
            "params": kept,
            "KL": kl,
            "pruned ppl": 30.0 + kl,
            "baseline ppl": 30.0,
        }
        for t, kept, kl in ((0.75, 0.748, 0.02), (0.9, 0.897, 0.005))
    ]
    assert _lines(table, ["target_params"], "KL") == {"pca": [(0.748, 0.02, 0.02, 0.02), (0.897, 0.005, 0.005, 0.005)]}
    written = sweep_plots(table, [[], []], [[], []], ["target_params"], tmp_path)
    assert [p.name for p in written] == ["kl_ppl_vs_sparsity.png"]
    assert written[0].read_bytes().startswith(PNG)


def _fake_run(folder: Path, num_samples: int, ppl: float, refinement: dict | None) -> None:
    """A finished run folder as compare reads it: its report and its saved recipe."""
    folder.mkdir(parents=True)
    report = report_dict(
        model={"path": "/m/ref-llama", "hidden_size": 64},
        kept_width=48,
        metrics={"baseline": {"ppl": ppl}, "pruned": {"ppl": ppl + 1, "kl": 0.01}},
        timings={"data_s": 1.0, "load_s": 1.0, "fisher_s": 0.0, "prune_s": 2.0},
    )
    (folder / "report.json").write_text(json.dumps(report))
    recipe = {
        "model": {"path": "/m/ref-llama"},
        "sparsity": 0.25,
        "seed": 0,
        "refinement": refinement,
        "evaluation": {
            "dataset": {"path": "json", "data_files": "/d/v.jsonl"},
            "num_samples": num_samples,
            "seq_len": 64,
        },
    }
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))


def test_results_of_a_grid_over_the_evaluation_carry_its_warning(tmp_path: Path) -> None:
    """A grid over the evaluation windows: results.md says the KL and perplexity are not comparable,
    and settings under a grid key are not repeated as dotted columns of their own."""
    from types import SimpleNamespace

    from compressor.commands.sweep import Point, Sweep, results, warnings, write_results

    points = []
    for name, samples, ppl, windows in (("000", 64, 30.167, 8), ("001", 256, 20.314, 16)):
        _fake_run(tmp_path / "runs" / name, samples, ppl, {"windows": windows})
        values = {"evaluation.num_samples": samples, "refinement": {"windows": windows}}
        points.append(Point(name, values, SimpleNamespace(output=str(tmp_path / "runs" / name))))
    table, notes = results(points), warnings(points)
    assert [row["evaluation.num_samples"] for row in table] == [64, 256]
    assert not any(key.startswith("refinement.") for row in table for key in row)
    assert [row["refinement"] for row in table] == ['{"windows": 8}', '{"windows": 16}']
    assert len(notes) == 1 and "evaluation.num_samples 64 vs 256" in notes[0]
    write_results(Sweep(tmp_path / "s.yaml", tmp_path, {}, points, False), table, notes)
    assert f"> **warning**: {notes[0]}" in (tmp_path / "results.md").read_text()
    assert "warning" not in (tmp_path / "results.csv").read_text()


def test_a_grid_with_one_sparsity_plots_bars(tmp_path: Path) -> None:
    from compressor.evaluation.plots import sweep_plots

    table = [
        {
            "model": "m",
            "pipeline": p,
            "sparsity": 0.25,
            "params": 0.8,
            "KL": kl,
            "pruned ppl": 30.0 + kl,
            "baseline ppl": 30.0,
        }
        for p, kl in (("pca", 0.02), ("sensitivity", 0.01))
    ]
    written = sweep_plots(table, [[], []], [[], []], ["sparsity", "pipeline"], tmp_path)
    assert [p.name for p in written] == ["kl_ppl_vs_sparsity.png"]
    assert written[0].read_bytes().startswith(PNG)


def test_a_grid_of_distilled_runs_plots_their_heldout_curves(tmp_path: Path) -> None:
    """Points whose reports carry a distillation curve get one line each in
    distillation_heldout_kl.png, labelled by what the grid varies; points without one add nothing."""
    from compressor.evaluation.plots import distillation_figure, sweep_plots

    table = [
        {
            "model": "m",
            "pipeline": "pca",
            "sparsity": 0.25,
            "params": 0.8,
            "KL": kl,
            "pruned ppl": 30.0,
            "baseline ppl": 29.0,
            "distillation.method": method,
        }
        for method, kl in (("lora", 0.02), ("full", 0.01), (None, 0.03))
    ]
    curve = [{"step": 0, "tokens": 0, "kl": 0.03}, {"step": 10, "tokens": 40960, "kl": 0.02}]
    written = sweep_plots(table, [[], [], []], [curve, curve[:1], []], ["distillation.method"], tmp_path)
    assert [p.name for p in written] == ["kl_ppl_vs_sparsity.png", "distillation_heldout_kl.png"]
    assert written[1].read_bytes().startswith(PNG)
    figure = distillation_figure({"a": curve, "b": curve[:1]})
    lines = [line for line in figure.axes[0].get_lines() if not line.get_label().startswith("_")]
    assert [line.get_label() for line in lines] == ["a", "b"]
    assert list(lines[0].get_xdata()) == [0, 0.04096]


@pytest.mark.slow
def test_a_streamed_sweep_gives_the_sweep_in_memory(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """`model.load: stream` in a sweep's base: every run streams its own shell (none cached) and the
    table is the one the same sweep gives in memory."""
    results = {}
    for load in ("memory", "stream"):
        folder = tmp_path / load
        folder.mkdir()
        base = write_recipe(folder, tiny_checkpoint, model__load=load)
        assert main(["sweep", str(_write_sweep(folder, base))]) == 0
        rows = json.loads((folder / "sweep-out" / "results.json").read_text())
        results[load] = [{k: v for k, v in row.items() if "s" != k.split()[-1] and "time" not in k} for row in rows]
    assert results["stream"] == results["memory"]


def test_a_sweep_s_dry_run_refuses_what_its_runs_would_refuse_on_this_device(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A grid of distilled runs that keeps only the bases would be refused by each run as it
    starts, perhaps hours in: `compress sweep --dry-run` refuses it first."""
    base = write_recipe(tmp_path, tiny_checkpoint, distillation={"tokens": 2048})
    sweep = _write_sweep(tmp_path, base, save_models=False)
    assert main(["sweep", str(sweep), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "distillation changes the weights, which bases alone cannot rebuild" in err


def test_a_sweep_over_heads_and_depth_saves_each_point_s_model(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Issue 49's `compress sweep` over the new axes: a grid of removed blocks and kept query heads,
    the residual width taking the rest of one budget; each run saves the original class with the
    blocks and heads its point names, and the table has a column for each axis."""
    from transformers import AutoConfig

    base = write_recipe(tmp_path, tiny_checkpoint, sparsity=None, target_params=0.85, slicing={"layout": "global"})
    grid = {"depth": [None, {"removed": 1}], "heads": [None, {"kept": 0.5}]}
    assert main(["sweep", str(_write_sweep(tmp_path, base, grid=grid, save_models=True))]) == 0
    out = tmp_path / "sweep-out"
    with open(out / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 4 and {"depth", "heads"} <= set(table[0])
    found = []
    for name in ("000", "001", "002", "003"):
        config = AutoConfig.from_pretrained(out / "runs" / name / "model")
        report = json.loads((out / "runs" / name / "report.json").read_text())
        assert report["params"]["pruned"] <= report["allocation"]["budget"]
        found.append((config.num_hidden_layers, config.num_attention_heads, config.head_dim))
    assert found == [(2, 4, 16), (2, 2, 16), (1, 4, 16), (1, 2, 16)]  # grid order: depth, then heads
