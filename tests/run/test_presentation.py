"""What tables and plots show a reader: prune time apart from shared work, warnings when runs were
evaluated on different data, every differing setting, honest report rows, readable plots."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from compressor.commands import compare
from compressor.commands.compare import render, rows
from compressor.reports.report import summary_rows
from tests.reports import report_dict, run_report

RECIPE: dict[str, Any] = {
    "model": {"path": "/models/ref-llama", "dtype": "float32"},
    "calibration": {"dataset": {"path": "json", "data_files": "/data/calib.jsonl"}, "num_samples": 128, "seq_len": 512},
    "pipeline": [{"strategy": "pca"}],
    "sparsity": 0.25,
    "evaluation": {
        "dataset": {"path": "json", "data_files": "/data/valid.jsonl"},
        "num_samples": 64,
        "seq_len": 512,
        "lm_eval": None,
    },
    "refinement": None,
    "seed": 0,
}


def _run(folder: Path, report: dict[str, Any], recipe: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps(report))
    if recipe is not None:
        (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return folder


def _recipe(**dotted: Any) -> dict[str, Any]:
    recipe = copy.deepcopy(RECIPE)
    for key, value in dotted.items():
        *parents, last = key.split("__")
        node = recipe
        for part in parents:
            node = node[part]
        node[last] = value
    return recipe


# --- 1. prune time apart from the shared work -------------------------------------------------


def test_the_table_reports_shared_work_apart_from_the_prune_time(tmp_path: Path) -> None:
    first = _run(tmp_path / "000", report_dict(), _recipe())
    shared = {"data_s": 0.0, "load_s": 0.1, "fisher_s": 0.0, "prune_s": 7.1}
    second = _run(tmp_path / "001", report_dict(timings=shared), _recipe())
    table = rows([first, second])
    assert [row["prune s"] for row in table] == [7.0, 7.1]
    assert table[0]["shared s"] == pytest.approx(1.5 + 2.0 + 20.0)  # the first run paid for the rest
    assert table[1]["shared s"] == pytest.approx(0.1)
    assert [row["H s"] for row in table] == [20.0, 0.0]
    header = render(table, ".md").splitlines()[0]
    assert "| prune s | shared s |" in header


def test_an_old_report_without_fisher_s_has_no_h_cell(tmp_path: Path) -> None:
    old = report_dict(timings={"data_s": 1.0, "load_s": 2.0, "prune_s": 29.6})
    table = rows([_run(tmp_path / "old", old)])
    assert table[0]["shared s"] == pytest.approx(3.0)
    assert "H s" not in table[0]  # unknown, not zero: its prune_s still holds H


def test_the_run_report_gives_h_its_own_row_when_the_run_computed_it() -> None:
    rows_by_name = {name: (before, after) for name, before, after in summary_rows(run_report())}
    assert rows_by_name["output sensitivity H (s)"] == ("", "20.0")
    assert rows_by_name["prune time (s)"] == ("", "7.0")
    names = [name for name, _, _ in summary_rows(run_report(timings={"fisher_s": 0.0, "prune_s": 7.0}))]
    assert "output sensitivity H (s)" not in names  # H shared from an earlier run: nothing spent on it


# --- 3. runs evaluated on different data -------------------------------------------------------


def test_compare_warns_when_runs_were_evaluated_on_different_windows(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", report_dict(), _recipe())
    b = _run(
        tmp_path / "b",
        report_dict(metrics={"baseline": {"ppl": 20.314}, "pruned": {"ppl": 21.0, "kl": 0.01}}),
        _recipe(evaluation__num_samples=256),
    )
    warnings = compare.compare_runs([a, b])[1]
    assert len(warnings) == 1
    assert "evaluated on different data" in warnings[0]
    assert "evaluation.num_samples 64 vs 256" in warnings[0]
    assert "baseline perplexity 30.167 vs 20.314" in warnings[0]
    assert "not comparable" in warnings[0]
    assert "> **warning**: these runs were evaluated on different data" in compare.render(rows([a, b]), ".md", warnings)


def test_a_differing_baseline_perplexity_alone_is_warned_about(tmp_path: Path) -> None:
    """An old run without its recipe, or a data file edited between runs: the baseline shows it."""
    a = _run(tmp_path / "a", report_dict())
    b = _run(tmp_path / "b", report_dict(metrics={"baseline": {"ppl": 15.687}, "pruned": {"ppl": 16.0, "kl": 0.01}}))
    assert "baseline perplexity 30.167 vs 15.687" in " ".join(compare.compare_runs([a, b])[1])


def test_runs_evaluated_alike_get_no_warning(tmp_path: Path) -> None:
    noise = {"baseline": {"ppl": 30.167 * (1 + 1e-7)}, "pruned": {"ppl": 40.0, "kl": 0.1}}
    a = _run(tmp_path / "a", report_dict(), _recipe())
    b = _run(
        tmp_path / "b", report_dict(metrics=noise, seed=1), _recipe(sparsity=0.5, seed=1, calibration__num_samples=64)
    )
    assert compare.compare_runs([a, b])[1] == []  # the seed changes no perplexity window


def test_a_seed_that_differs_is_warned_about_for_task_scores(tmp_path: Path) -> None:
    tasks = {
        "baseline": {"ppl": 30.167, "tasks": {"arc_easy": {"acc": 0.7}}},
        "pruned": {"ppl": 31.0, "kl": 0.02, "tasks": {"arc_easy": {"acc": 0.6}}},
    }
    a = _run(tmp_path / "a", report_dict(metrics=tasks), _recipe())
    b = _run(tmp_path / "b", report_dict(metrics=tasks, seed=1), _recipe(seed=1))
    (warning,) = compare.compare_runs([a, b])[1]
    assert "task scores" in warning and "seed 0 vs 1" in warning


def test_the_table_shows_every_setting_that_differs(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", report_dict(), _recipe())
    b = _run(
        tmp_path / "b", report_dict(), _recipe(calibration__num_samples=64, refinement={"windows": 8, "top_k": 64})
    )
    c = _run(tmp_path / "c", report_dict(), _recipe(refinement={"windows": 16, "top_k": 64}))
    table = rows([a, b, c])
    assert [row["calibration.num_samples"] for row in table] == [128, 64, 128]
    assert [row["refinement"] for row in table] == ["null", "set", "set"]  # one column for a section set or not
    assert [row["refinement.windows"] for row in table] == ["null", 8, 16]
    assert "refinement.top_k" not in table[0]  # equal wherever it is set
    assert "evaluation.num_samples" not in table[0] and "model.path" not in table[0]  # equal: no column
    assert "output" not in table[0]
    assert not any(key.startswith("refinement") for key in rows([a, b], shown=["refinement"])[0])  # a sweep's grid key


# --- 4, 5. report rows -------------------------------------------------------------------------


def test_the_baseline_column_holds_no_pruned_figure() -> None:
    refinement = {
        "steps": 10,
        "options": {"top_k": 64},
        "calibration_kl_before": 0.0123,
        "calibration_kl_refined": 0.0045,
        "calibration_kl_after": 0.0045,
        "kept": "refined",
        "seconds": 1.0,
    }
    table = summary_rows(run_report(refinement=refinement))
    refined = [(name, before, after) for name, before, after in table if "calibration KL" in name]
    assert [before for _, before, _ in refined] == ["", ""]
    assert ["0.01230" in after for _, _, after in refined] == [True, False]
    assert ["0.00450" in after for _, _, after in refined] == [False, True]
    assert "before" in refined[0][0] and "after" in refined[1][0]


def test_the_transitions_row_is_part_of_the_parameters() -> None:
    report = run_report(allocation={"transition_params": 4096}, slicing={"tie_head": None})
    names = [name for name, _, _ in summary_rows(report)]
    at = names.index("parameters")
    assert "residual transitions" in names[at + 1] and "(parameters)" in names[at + 1]
    assert names[at + 1].startswith("  of which")
    assert names[at + 2] == "hidden width"


# --- 6. throughput spread ----------------------------------------------------------------------


def _speed(baseline: tuple[float, float, float], pruned: tuple[float, float, float]) -> dict[str, Any]:
    """Speed figures of both models at batch 1: (median, slowest, fastest) prefill tokens/s; decode alike."""

    def side(rates: tuple[float, float, float]) -> dict[str, Any]:
        median, low, high = rates
        numbers = {}
        for phase in ("prefill", "decode"):
            numbers.update({f"{phase}_tok_s": median, f"{phase}_tok_s_min": low, f"{phase}_tok_s_max": high})
        return {"throughput": {"batch": {"1": numbers}}}

    ratio = pruned[0] / baseline[0]
    return {"baseline": side(baseline), "pruned": side(pruned), "speedup": {"1": {"prefill": ratio, "decode": ratio}}}


def _speed_cells(speed: dict[str, Any]) -> tuple[str, str]:
    from compressor.reports.report import speed_rows

    (_, before, after), _ = speed_rows(None, speed)
    return before, after


def test_a_speedup_within_the_spread_of_the_repeats_is_called_noise() -> None:
    before, after = _speed_cells(_speed((1000, 900, 1100), (930, 880, 1050)))
    assert before == "1,000 (900–1,100)"  # the median, then the slowest and fastest repeat
    assert "×0.93" in after and "within noise" in after


def test_a_speedup_beyond_the_spread_is_not_called_noise() -> None:
    _, after = _speed_cells(_speed((1000, 990, 1010), (1500, 1480, 1520)))
    assert "×1.50" in after and "noise" not in after


def test_a_cell_of_one_round_says_so_and_judges_no_speedup() -> None:
    speed = _speed((1000, 1000, 1000), (1500, 1500, 1500))
    for side in ("baseline", "pruned"):
        for phase in ("prefill", "decode"):
            speed[side]["throughput"]["batch"]["1"][f"{phase}_runs_s"] = [0.1]
    before, after = _speed_cells(speed)
    assert before == "1,000 (one round)" and after.startswith("1,500 (one round)")
    assert "×1.50, one round: no spread to judge it by" in after and "within noise" not in after
    speed["baseline"]["throughput"]["batch"]["1"]["prefill_runs_s"] = [0.1, 0.11]
    speed["baseline"]["throughput"]["batch"]["1"]["prefill_tok_s_min"] = 900
    assert _speed_cells(speed)[0] == "1,000 (900–1,000 in two rounds)"


@pytest.mark.parametrize(("load", "named"), [(2.5, True), (1.9, False), (None, False)])
def test_a_load_above_the_cpus_while_timing_is_named(load: float | None, named: bool) -> None:
    from compressor.reports.report import speed_rows

    speed = _speed((1000, 900, 1100), (930, 880, 1050))
    for side in ("baseline", "pruned"):
        speed[side]["throughput"].update({"load_average": load, "cpus": 2})
    rows = speed_rows(None, speed)
    loaded = [row for row in rows if row[0] == "timed under load"]
    assert bool(loaded) == named
    if named:
        assert loaded[0][2].startswith("load average 2.5 on 2 CPUs while timed")


def test_old_speed_figures_get_their_spread_from_the_timed_runs() -> None:
    """Reports measured before the range was recorded keep every run's time: the spread follows."""
    from compressor.evaluation.throughput import rate_range

    numbers = {"prefill_tok_s": 100.0, "prefill_s": 1.0, "prefill_runs_s": [0.8, 1.0, 1.25]}
    assert rate_range(numbers, "prefill") == pytest.approx((80.0, 125.0))
    assert rate_range({"prefill_tok_s": 100.0, "prefill_s": 1.0}, "prefill") is None


# --- 2. plots ----------------------------------------------------------------------------------


REFINEMENTS = [{"windows": 8, "top_k": 64, "steps": 100}, {"windows": 16, "top_k": 64, "steps": 100}]
PIPELINES = ["sensitivity", "sensitivity + stiefel(steps=20)"]


def _table(sparsities: list[float], kl: Any = None) -> list[dict[str, Any]]:
    """A sweep's table over sparsity × pipeline × refinement; `kl(row index)` gives the KL."""
    table = []
    for sparsity in sparsities:
        for pipeline in PIPELINES:
            for refinement in REFINEMENTS:
                index = len(table)
                table.append(
                    {
                        "model": "ref-llama",
                        "pipeline": pipeline,
                        "sparsity": sparsity,
                        "params": 0.8,
                        "KL": kl(index) if kl else 0.01 * (index + 1),
                        "pruned ppl": 20.0 + index,
                        "baseline ppl": 19.0,
                        "refinement": json.dumps(refinement),
                    }
                )
    return table


GRID = ["sparsity", "pipeline", "refinement"]


def _data_lines(axes: Any) -> list[Any]:
    """The plotted series' lines (not error bar caps, not the dense reference)."""
    from matplotlib.container import ErrorbarContainer

    return [c.lines[0] for c in axes.containers if isinstance(c, ErrorbarContainer)]


def _legend_texts(figure: Any) -> list[str]:
    return [text.get_text() for legend in figure.legends for text in legend.get_texts()]


def test_labels_are_short_and_name_what_differs() -> None:
    from compressor.evaluation.plots import series_labels

    labels = list(series_labels(_table([0.2]), GRID).values())
    assert labels == [
        "sensitivity, refinement(windows=8)",
        "sensitivity, refinement(windows=16)",
        "sensitivity+stiefel(steps=20), refinement(windows=8)",
        "sensitivity+stiefel(steps=20), refinement(windows=16)",
    ]


def test_long_labels_are_cut_and_colliding_ones_told_apart() -> None:
    from compressor.evaluation.plots import LABEL_LIMIT, series_labels

    long = "x" * 100
    table = [{"model": "m", "pipeline": f"{long}{end}", "sparsity": 0.2, "params": 0.8} for end in "ab"]
    labels = list(series_labels(table, ["pipeline"]).values())
    assert all(len(label) <= LABEL_LIMIT and "…" in label for label in labels)
    assert len(set(labels)) == 2


def test_the_legend_fits_inside_the_figure_below_the_axes() -> None:
    from compressor.evaluation.plots import kl_ppl_figure

    figure = kl_ppl_figure(_table([0.2, 0.3]), GRID)
    (legend,) = figure.legends
    box, width = legend.get_window_extent(), figure.bbox.width
    assert 0 <= box.x0 and box.x1 <= width and 0 <= box.y0
    assert all(box.y1 <= axes.get_tightbbox().y0 + 1 for axes in figure.axes)  # under the axes and their labels


def test_a_single_sparsity_gets_bars() -> None:
    from compressor.evaluation.plots import kl_ppl_figure

    figure = kl_ppl_figure(_table([0.25]), GRID)
    kl_axes, ppl_axes = figure.axes
    assert len(kl_axes.patches) == len(ppl_axes.patches) == 4
    assert sorted(p.get_height() for p in kl_axes.patches) == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert _data_lines(kl_axes) == []  # no column of dots
    assert kl_axes.get_yscale() == "linear" and kl_axes.get_ylim()[0] == 0  # a log axis would cut the bars short
    assert sorted(float(t.get_text()) for t in kl_axes.texts) == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert figure.axes[0].get_yscale() == "linear"
    assert kl_ppl_figure(_table([0.2, 0.3]), GRID).axes[0].get_yscale() == "log"  # lines over a range stay on log


def test_identical_series_say_so_in_the_legend() -> None:
    from compressor.evaluation.plots import kl_ppl_figure

    table = _table([0.2, 0.3], kl=lambda index: 0.01 * (1 + index // 2))  # the refinement changes nothing
    figure = kl_ppl_figure(table, GRID)
    assert len(_data_lines(figure.axes[0])) == 2
    texts = [text.replace("\n", " ") for text in _legend_texts(figure)]  # long ones are one label a line
    assert "sensitivity, refinement(windows=8) = sensitivity, refinement(windows=16)" in texts


def test_nearly_equal_series_stay_distinguishable() -> None:
    """Lines a hair apart (a later step changed little): each keeps a style of its own, so the one
    drawn last does not hide the other."""
    from compressor.evaluation.plots import kl_ppl_figure

    table = _table([0.2, 0.3], kl=lambda index: 0.01 * (1 + index // 2) * (1 + 1e-5 * (index % 2)))
    figure = kl_ppl_figure(table, GRID)
    drawn = _data_lines(figure.axes[0])
    assert len(drawn) == 4  # not merged: the values differ
    assert len({(line.get_linestyle(), line.get_marker()) for line in drawn}) == 4
