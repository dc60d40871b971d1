"""PNG plots of a sweep (matplotlib, no display needed).

Runs that differ only in `seed` are one point (their mean, with the range as an error bar);
every other grid key but `sparsity` (or `target_params`) makes its own line, labelled by the
pipeline (with the options in which pipelines differ) and the other keys' values. The x axis is the
sparsity, or, where some run has none (`target_params`), the fraction of parameters kept.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

SKIPPED_OBJECTIVES = ("tau", "steps")
"""Per-site figures that are settings or counts, not objectives."""


def _series(row: dict[str, Any], grid_keys: list[str]) -> str:
    parts = [row["pipeline"]] if "pipeline" in grid_keys else []
    parts += [f"{key}={row[key]}" for key in grid_keys if key not in ("sparsity", "target_params", "seed", "pipeline")]
    return ", ".join(parts) or row["pipeline"]


def _by_sparsity(table: list[dict[str, Any]]) -> bool:
    """Whether the x axis is the sparsity (every run has one); else the fraction of the original's
    parameters kept (runs with `target_params`)."""
    return all(row.get("sparsity") is not None for row in table)


def _x(row: dict[str, Any], by_sparsity: bool) -> float:
    return float(row["sparsity"] if by_sparsity else row["params"])


def _lines(table: list[dict[str, Any]], grid_keys: list[str], column: str
           ) -> dict[str, list[tuple[float, float, float, float]]]:
    """series → [(x, mean, min, max)] of `column`, x ascending (`_by_sparsity`)."""
    values: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    by_sparsity = _by_sparsity(table)
    for row in table:
        value = row.get(column)
        if isinstance(value, (int, float)) and math.isfinite(value):
            values[_series(row, grid_keys)][_x(row, by_sparsity)].append(float(value))
    return {series: [(s, statistics.fmean(v), min(v), max(v)) for s, v in sorted(points.items())]
            for series, points in values.items()}


def _colours(table: list[dict[str, Any]], grid_keys: list[str]) -> dict[str, Any]:
    """One colour per series, the same in every panel and figure."""
    import matplotlib

    palette = matplotlib.colormaps["tab10"]
    names = list(dict.fromkeys(_series(row, grid_keys) for row in table))
    return {name: palette(index % 10) for index, name in enumerate(names)}


def _plot_against_sparsity(axes: Any, table: list[dict[str, Any]], grid_keys: list[str], column: str,
                           dense: float | None = None) -> None:
    colours = _colours(table, grid_keys)
    for series, points in _lines(table, grid_keys, column).items():
        xs, means, lows, highs = zip(*points)
        axes.errorbar(xs, means, yerr=[[m - lo for m, lo in zip(means, lows)], [hi - m for m, hi in zip(means, highs)]],
                      marker="o", capsize=3, label=series, color=colours[series])
    if dense is not None:
        axes.axhline(dense, color="grey", linestyle="--", label="dense")
    axes.set_xlabel("sparsity (fraction of the hidden width removed)" if _by_sparsity(table)
                    else "parameters kept (fraction of the original's)")
    axes.grid(alpha=0.3)


def _dense(table: list[dict[str, Any]], column: str) -> float | None:
    values = [row[column] for row in table if isinstance(row.get(column), (int, float))]
    return values[0] if values else None


def sweep_plots(table: list[dict[str, Any]], reports: list[dict[str, Any]], grid_keys: list[str],
                folder: Path) -> list[Path]:
    """Write the sweep's plots into `folder`; return their paths."""
    from matplotlib.figure import Figure  # not pyplot: no global backend, no windows, any thread

    def subplots(rows: int, columns: int, size: tuple[float, float]) -> tuple[Any, Any]:
        figure = Figure(figsize=size)
        return figure, figure.subplots(rows, columns, squeeze=False)

    written: list[Path] = []

    def save(figure: Any, name: str) -> None:
        handles: dict[str, Any] = {}
        for axes in figure.axes:
            for handle, label in zip(*axes.get_legend_handles_labels()):
                handles.setdefault(label, handle)
        if handles:
            figure.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(3, len(handles)),
                          fontsize=8, frameon=False)
        figure.tight_layout(rect=(0, 0.04 + 0.035 * math.ceil(len(handles) / 3), 1, 1))
        path = folder / name
        figure.savefig(path, dpi=120)
        written.append(path)

    model = table[0]["model"] if table else ""
    if any(isinstance(row.get("KL"), float) for row in table):
        figure, grid = subplots(1, 2, (12, 4.5))
        axes = grid[0]
        _plot_against_sparsity(axes[0], table, grid_keys, "KL")
        axes[0].set_yscale("log")
        axes[0].set_ylabel("KL(original ‖ pruned), nats per token")
        axes[0].set_title(f"{model}: KL to the original model")
        _plot_against_sparsity(axes[1], table, grid_keys, "pruned ppl", _dense(table, "baseline ppl"))
        axes[1].set_ylabel("perplexity")
        axes[1].set_title(f"{model}: perplexity")
        save(figure, "kl_ppl_vs_sparsity.png")

    tasks = [c for c in (table[0] if table else {}) if c.startswith("dense ")]
    if tasks:
        figure, grid = subplots(1, len(tasks), (6 * len(tasks), 4.5))
        for axes, dense_column in zip(grid[0], tasks):
            column = dense_column.removeprefix("dense ")
            _plot_against_sparsity(axes, table, grid_keys, column, _dense(table, dense_column))
            axes.set_ylabel(column)
            axes.set_title(f"{model}: {column}")
        save(figure, "tasks_vs_sparsity.png")

    objectives = _objectives(table, reports, grid_keys)
    if objectives:
        keys = sorted(objectives)
        columns = min(3, len(keys))
        rows = math.ceil(len(keys) / columns)
        figure, grid = subplots(rows, columns, (6 * columns, 4 * rows))
        colours = _colours(table, grid_keys)
        for axes, key in zip(grid.flat, keys):
            for series, (sites, values) in objectives[key].items():
                axes.plot(sites, values, marker=".", label=series, color=colours[series])
            axes.set_title(key)
            axes.set_xlabel("site")
            axes.tick_params(axis="x", labelrotation=90, labelsize=6)
            if all(v > 0 for _, values in objectives[key].values() for v in values):
                axes.set_yscale("log")
            axes.grid(alpha=0.3)
        for axes in list(grid.flat)[len(keys):]:
            axes.axis("off")
        x = _objective_x(table)
        where = f"sparsity {x}" if _by_sparsity(table) else f"{x:.3f} of the parameters kept"
        figure.suptitle(f"{model}: each strategy's objective per site, {where}")
        save(figure, "objectives_by_site.png")
    return written


def _objective_x(table: list[dict[str, Any]]) -> float:
    """The sparsity (or parameter fraction) the per-site plot shows: the middle one of the sweep."""
    by_sparsity = _by_sparsity(table)
    values = sorted({_x(row, by_sparsity) for row in table})
    return values[len(values) // 2]


def _objectives(table: list[dict[str, Any]], reports: list[dict[str, Any]], grid_keys: list[str]
                ) -> dict[str, dict[str, tuple[list[str], list[float]]]]:
    """objective → series → (site ids, values) at one sparsity, for the first seed of each series;
    sites where nothing is removed are left out."""
    if not table:
        return {}
    by_sparsity, x = _by_sparsity(table), _objective_x(table)
    out: dict[str, dict[str, tuple[list[str], list[float]]]] = defaultdict(dict)
    seen: set[str] = set()
    for row, report in zip(table, reports):
        series = _series(row, grid_keys)
        if _x(row, by_sparsity) != x or series in seen:
            continue
        seen.add(series)
        collected: dict[str, tuple[list[str], list[float]]] = {}
        for site in report["sites"]:
            if site["kept"] == site["width"]:
                continue  # nothing removed here (the head's input unless slice_head): no objective to show
            for step in site["steps"]:
                for key, value in step["objectives"].items():
                    if key in SKIPPED_OBJECTIVES or isinstance(value, bool) or not isinstance(value, (int, float)):
                        continue
                    name = f"{step['strategy']}.{key}"
                    sites, values = collected.setdefault(name, ([], []))
                    sites.append(site["name"])
                    values.append(float(value))
        for name, pair in collected.items():
            out[name][series] = pair
    return dict(out)
