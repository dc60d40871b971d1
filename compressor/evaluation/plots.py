"""PNG plots of a sweep (matplotlib, no display needed).

Runs that differ only in `seed` are one point (their mean, with the range as an error bar);
every other grid key but `sparsity` (or `target_params`) makes its own line, labelled by the
pipeline (with the options in which pipelines differ) and the other keys' values, compactly
(`series_labels`). The x axis is the sparsity, or, where some run has none (`target_params`), the
fraction of parameters kept; a grid with a single such value gets bars (one per series), since
lines of one point read as a column of dots. Series whose points are identical are drawn once,
labelled `A = B`, and each series has its own line style and marker, so lines that nearly coincide
both stay visible. The legend sits below the axes, in as many columns as fit the figure's width.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SKIPPED_OBJECTIVES = ("tau", "steps")
"""Per-site figures that are settings or counts, not objectives."""
NOT_SERIES = ("sparsity", "target_params", "seed", "pipeline")
"""Grid keys that do not make a series of their own (x axis, averaged, or the pipeline label)."""
LABEL_LIMIT = 60
"""The length a legend label is cut to, its longest parts first, with an ellipsis (it must fit the figure)."""
PART_LIMIT = 20
"""The fewest characters a part of a label (the pipeline, one grid value) is cut to."""

Points = list[tuple[float, float, float, float]]


def _series(row: dict[str, Any], grid_keys: list[str]) -> str:
    """The series a row belongs to (its identity; `series_labels` gives its legend text)."""
    parts = [row["pipeline"]] if "pipeline" in grid_keys else []
    parts += [f"{key}={row[key]}" for key in grid_keys if key not in NOT_SERIES]
    return ", ".join(parts) or row["pipeline"]


def _parsed(value: Any) -> Any:
    """A grid value as the sweep's table holds it (lists and mappings as JSON text) back as data."""
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _scalar(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _step(step: dict[str, Any], options: dict[str, Any]) -> str:
    """`strategy(key=value, ...)` for a pipeline step."""
    inner = ", ".join(f"{key}={_scalar(value)}" for key, value in options.items())
    return step["strategy"] + (f"({inner})" if inner else "")


def _is_pipeline(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(s, dict) and "strategy" in s for s in value)


def short_value(name: str, value: Any, others: list[Any]) -> str:
    """One grid value as a short label: a pipeline as `sensitivity+stiefel(steps=20)`, a step as
    `stiefel(steps=20)`, a mapping as `name(key=value, ...)` with only the keys in which it differs
    from the grid's other values, anything else as `name=value`."""
    value = _parsed(value)
    if _is_pipeline(value):
        return "+".join(_step(s, {k: v for k, v in s.items() if k != "strategy"}) for s in value)
    if isinstance(value, dict) and "strategy" in value:
        return _step(value, {k: v for k, v in value.items() if k != "strategy"})
    if isinstance(value, dict):
        mappings = [o for o in map(_parsed, others) if isinstance(o, dict)]
        differing = {k: v for k, v in value.items() if any(o.get(k) != v for o in mappings)} or value
        return f"{name}({', '.join(f'{k}={_scalar(v)}' for k, v in differing.items())})"
    return f"{name}={_scalar(value)}"


def _names(grid_keys: list[str]) -> dict[str, str]:
    """Each grid key's last dotted part (`evaluation.num_samples` → `num_samples`), or the whole
    key where two keys share their last part."""
    last = [key.rsplit(".", 1)[-1] for key in grid_keys]
    return {key: (short if last.count(short) == 1 else key) for key, short in zip(grid_keys, last)}


def _truncated(text: str, limit: int = LABEL_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def series_labels(table: list[dict[str, Any]], grid_keys: list[str]) -> dict[str, str]:
    """series → a short, readable legend label, distinct for distinct series (a collision left by
    shortening gets `#1`, `#2`, ...)."""
    names = _names(grid_keys)
    varied = [key for key in grid_keys if key not in NOT_SERIES]
    values = {key: [row.get(key) for row in table] for key in varied}
    labels: dict[str, str] = {}
    for row in table:
        series = _series(row, grid_keys)
        if series in labels:
            continue
        refined_apart = any(key.split(".")[0] == "refinement" for key in varied)
        parts = [_pipeline_label(row["pipeline"], refined_apart)] if "pipeline" in grid_keys or not varied else []
        parts += [short_value(names[key], row.get(key), values[key]) for key in varied]
        labels[series] = _fitted(parts)
    return _distinguished(labels)


def _fitted(parts: list[str]) -> str:
    """The parts joined, the longest cut first until the label fits `LABEL_LIMIT` (none below
    `PART_LIMIT`), so every part keeps its beginning, where the values that differ are."""
    parts = list(parts)
    while (excess := len(", ".join(parts)) - LABEL_LIMIT) > 0:
        longest = max(range(len(parts)), key=lambda i: len(parts[i]))
        if len(parts[longest]) <= PART_LIMIT:
            break
        parts[longest] = _truncated(parts[longest], max(PART_LIMIT, len(parts[longest]) - excess))
    return _truncated(", ".join(parts), LABEL_LIMIT + PART_LIMIT)


def _pipeline_label(label: str, refined_apart: bool) -> str:
    """`compress compare`'s pipeline label, tightened for a legend; without what it says of the
    refinement where a grid key on the refinement labels that already."""
    if refined_apart:
        label = label.split(" → ")[0]
    return label.replace(" + ", "+").replace(" → refined on KL", " → refined")


def _distinguished(labels: dict[str, str]) -> dict[str, str]:
    """Number the labels that several series share, so no two series read alike."""
    counts: dict[str, int] = defaultdict(int)
    for label in labels.values():
        counts[label] += 1
    seen: dict[str, int] = defaultdict(int)
    out = {}
    for series, label in labels.items():
        if counts[label] > 1:
            seen[label] += 1
            label = f"{_truncated(label, LABEL_LIMIT - 3)} #{seen[label]}"
        out[series] = label
    return out


def _by_sparsity(table: list[dict[str, Any]]) -> bool:
    """Whether the x axis is the sparsity (every run has one); else the fraction of the original's
    parameters kept (runs with `target_params`)."""
    return all(row.get("sparsity") is not None for row in table)


def _x(row: dict[str, Any], by_sparsity: bool) -> float:
    return float(row["sparsity"] if by_sparsity else row["params"])


def _lines(table: list[dict[str, Any]], grid_keys: list[str], column: str) -> dict[str, Points]:
    """series → [(x, mean, min, max)] of `column`, x ascending (`_by_sparsity`)."""
    values: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    by_sparsity = _by_sparsity(table)
    for row in table:
        value = row.get(column)
        if isinstance(value, (int, float)) and math.isfinite(value):
            values[_series(row, grid_keys)][_x(row, by_sparsity)].append(float(value))
    return {
        series: [(s, statistics.fmean(v), min(v), max(v)) for s, v in sorted(points.items())]
        for series, points in values.items()
    }


def merge_identical(lines: dict[str, Any], labels: dict[str, str]) -> list[tuple[str, str, Any]]:
    """(first series, label, points) per group of series with equal points: drawn once and labelled
    `A = B`, where one line would otherwise cover the other without a word."""
    groups: dict[str, list[str]] = {}
    for series, points in lines.items():
        groups.setdefault(json.dumps(_rounded(points)), []).append(series)
    return [(members[0], _equal(labels[m] for m in members), lines[members[0]]) for members in groups.values()]


def _rounded(value: Any) -> Any:
    """Numbers to 9 significant digits (equal results that took different float paths compare equal)."""
    if isinstance(value, float):
        return float(f"{value:.9g}")
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def _equal(labels: Iterable[str]) -> str:
    """`A = B`, one label a line where they would not fit one line of the legend."""
    labels = list(labels)
    joined = " = ".join(labels)
    return joined if len(joined) <= LABEL_LIMIT else "\n= ".join(labels)


def _colours(table: list[dict[str, Any]], grid_keys: list[str]) -> dict[str, Any]:
    """One colour per series, the same in every panel and figure."""
    import matplotlib

    palette = matplotlib.colormaps["tab10"]
    names = list(dict.fromkeys(_series(row, grid_keys) for row in table))
    return {name: palette(index % 10) for index, name in enumerate(names)}


LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v")


def _styles(table: list[dict[str, Any]], grid_keys: list[str]) -> dict[str, dict[str, Any]]:
    """Per series, a colour, line style, marker and width of its own (later series thinner and
    dashed), so lines that nearly coincide still show each other's colour and marks."""
    colours = _colours(table, grid_keys)
    return {
        name: {
            "color": colour,
            "linestyle": LINE_STYLES[index % len(LINE_STYLES)],
            "marker": MARKERS[index % len(MARKERS)],
            "linewidth": 2.5 - 0.5 * (index % 3),
            "markersize": 7 - 1.5 * (index % 3),
        }
        for index, (name, colour) in enumerate(colours.items())
    }


def _single_x(table: list[dict[str, Any]]) -> bool:
    """Whether every run sits at one x (a grid with one sparsity): bars, not one-point lines."""
    by_sparsity = _by_sparsity(table)
    return len({_x(row, by_sparsity) for row in table}) == 1


def _plot_against_sparsity(
    axes: Any, table: list[dict[str, Any]], grid_keys: list[str], column: str, dense: float | None = None
) -> None:
    styles, labels = _styles(table, grid_keys), series_labels(table, grid_keys)
    lines = _lines(table, grid_keys, column)
    if _single_x(table):
        _bars(axes, table, lines, {series: style["color"] for series, style in styles.items()}, labels)
    else:
        for series, label, points in merge_identical(lines, labels):
            xs, means, lows, highs = zip(*points)
            axes.errorbar(
                xs,
                means,
                yerr=[[m - lo for m, lo in zip(means, lows)], [hi - m for m, hi in zip(means, highs)]],
                capsize=3,
                label=label,
                **styles[series],
            )
        axes.set_xlabel(
            "sparsity (fraction of the hidden width removed)"
            if _by_sparsity(table)
            else "parameters kept (fraction of the original's)"
        )
    if dense is not None:
        axes.axhline(dense, color="grey", linestyle="--", label="dense")
    axes.grid(alpha=0.3)


def _bars(
    axes: Any, table: list[dict[str, Any]], lines: dict[str, Points], colours: dict[str, Any], labels: dict[str, str]
) -> None:
    """One bar per series (its mean, the seeds' range as an error bar) at the grid's only x."""
    for position, (series, points) in enumerate(lines.items()):
        _, mean, low, high = points[0]
        spread = [[mean - low], [high - mean]] if high > low else None
        bar = axes.bar(position, mean, yerr=spread, capsize=3, color=colours[series], label=labels[series])
        axes.bar_label(bar, fmt="%.4g", fontsize=8)  # bars start at 0: close values differ in their labels
    axes.set_xticks([])  # the legend names the bars
    x = _x(table[0], _by_sparsity(table))
    axes.set_xlabel(f"sparsity {x}" if _by_sparsity(table) else f"{x:.3f} of the parameters kept")


def _dense(table: list[dict[str, Any]], column: str) -> float | None:
    values = [row[column] for row in table if isinstance(row.get(column), (int, float))]
    return values[0] if values else None


def _figure(rows: int, columns: int, size: tuple[float, float]) -> tuple[Any, Any]:
    """A figure (not pyplot: no global backend, no windows, any thread) whose layout leaves room
    for a legend placed outside the axes."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    return figure, figure.subplots(rows, columns, squeeze=False)


def add_legend(figure: Any) -> Any:
    """One legend for all panels, below them, in as many columns (up to 3) as fit the figure's
    width; None where nothing is labelled."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    handles: dict[str, Any] = {}
    for axes in figure.axes:
        for handle, label in zip(*axes.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if not handles:
        return None
    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    for columns in range(min(3, len(handles)), 0, -1):
        legend = figure.legend(
            list(handles.values()), list(handles), loc="outside lower center", ncol=columns, fontsize=8, frameon=False
        )
        canvas.draw()
        if legend.get_window_extent().width <= figure.bbox.width or columns == 1:
            return legend
        legend.remove()
    return None


def kl_ppl_figure(table: list[dict[str, Any]], grid_keys: list[str]) -> Any:
    """KL and perplexity against the sparsity (or bars at a single sparsity), legend placed."""
    model = table[0]["model"] if table else ""
    figure, grid = _figure(1, 2, (12, 4.5))
    axes = grid[0]
    _plot_against_sparsity(axes[0], table, grid_keys, "KL")
    if not _single_x(table):  # a log axis cuts bars off at an arbitrary floor: bars stay linear, from 0
        axes[0].set_yscale("log")
    axes[0].set_ylabel("KL(original ‖ pruned), nats per token")
    axes[0].set_title(f"{model}: KL to the original model")
    _plot_against_sparsity(axes[1], table, grid_keys, "pruned ppl", _dense(table, "baseline ppl"))
    axes[1].set_ylabel("perplexity")
    axes[1].set_title(f"{model}: perplexity")
    add_legend(figure)
    return figure


def _save(figure: Any, path: Path) -> Path:
    """`bbox_inches="tight"`: whatever sticks out of the figure (a legend of long labels that fits
    in no column count) is still in the picture, not cut at its edges."""
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def sweep_plots(
    table: list[dict[str, Any]],
    sites: list[list[dict[str, Any]]],
    curves: list[list[dict[str, int | float]]],
    grid_keys: list[str],
    folder: Path,
) -> list[Path]:
    """Write the sweep's plots into `folder`; return their paths. Per row of `table`: its run's site
    records (as the report writes them) and distillation curve (empty without distillation)."""
    written: list[Path] = []
    model = table[0]["model"] if table else ""
    if any(isinstance(row.get("KL"), float) for row in table):
        written.append(_save(kl_ppl_figure(table, grid_keys), folder / "kl_ppl_vs_sparsity.png"))

    tasks = [c for c in (table[0] if table else {}) if c.startswith("dense ")]
    if tasks:
        figure, grid = _figure(1, len(tasks), (6 * len(tasks), 4.5))
        for axes, dense_column in zip(grid[0], tasks):
            column = dense_column.removeprefix("dense ")
            _plot_against_sparsity(axes, table, grid_keys, column, _dense(table, dense_column))
            axes.set_ylabel(column)
            axes.set_title(f"{model}: {column}")
        add_legend(figure)
        written.append(_save(figure, folder / "tasks_vs_sparsity.png"))

    objectives = _objectives(table, sites, grid_keys)
    if objectives:
        written.append(_save(_objectives_figure(table, grid_keys, objectives), folder / "objectives_by_site.png"))

    labels = series_labels(table, grid_keys)
    by_sparsity = _by_sparsity(table)
    labelled = {
        f"{labels[_series(row, grid_keys)]} @ {_x(row, by_sparsity):g}": curve
        for row, curve in zip(table, curves)
        if curve
    }
    if labelled:
        written.append(_save(distillation_figure(labelled, model), folder / "distillation_heldout_kl.png"))
    return written


def distillation_figure(curves: dict[str, list[dict[str, int | float]]], model: str = "") -> Any:
    """Held-out KL against distillation tokens, one line per run (a run folder's
    `distillation.png`, a sweep's `distillation_heldout_kl.png`); the best point of each marked."""
    figure, grid = _figure(1, 1, (7, 4.5))
    axes = grid[0][0]
    for label, curve in curves.items():
        tokens = [point["tokens"] / 1e6 for point in curve]
        kls = [point["kl"] for point in curve]
        line = axes.plot(tokens, kls, marker="o", markersize=3, label=label)[0]
        best = min(range(len(kls)), key=kls.__getitem__)
        axes.plot([tokens[best]], [kls[best]], marker="*", markersize=11, color=line.get_color(), linestyle="none")
    axes.set_xlabel("distillation tokens (millions)")
    axes.set_ylabel("held-out KL(original ‖ student), nats per token")
    axes.set_yscale("log")
    axes.set_title(f"{model + ': ' if model else ''}held-out KL during distillation (★ best, kept)")
    add_legend(figure)
    return figure


@dataclass(frozen=True)
class SplitCounts:
    """Each split candidate's counts beside its widths, one list per axis the split opened (None:
    not an axis of this split): `split_figure` draws a line per combination."""

    experts: list[int | None] | None = None
    """Experts kept (None: every expert)."""
    heads: list[int | None] | None = None
    """Attention heads kept (None: every head)."""
    blocks: list[int] | None = None
    """Blocks removed."""


def split_figure(
    candidates: list[tuple[int, int, int, float]],
    chosen: int,
    of: int,
    model: str = "",
    counts: SplitCounts = SplitCounts(),
) -> Any:
    """A run's `split.png` (`mlp`, `experts`, `heads` without `kept`, `depth` without `removed`):
    held-out KL of each split of one budget against the MLP neurons it keeps, a line per count of
    experts, heads and removed blocks (`SplitCounts`), each point labelled with its residual width;
    the chosen one starred. `candidates`: (residual width, MLP neurons, parameters, KL)."""
    experts, heads, blocks = counts.experts, counts.heads, counts.blocks
    figure, grid = _figure(1, 1, (7, 4.5))
    axes = grid[0][0]
    none: list[Any] = [None] * len(candidates)
    combinations = list(zip(experts or none, heads or none, blocks or none, strict=True))
    kept = [mlp / of for _, mlp, _, _ in candidates]
    kls = [kl for *_, kl in candidates]
    for count in dict.fromkeys(combinations):  # in the order measured
        rows = [i for i, c in enumerate(combinations) if c == count]
        parts = [] if experts is None else ["every expert" if count[0] is None else f"{count[0]} experts"]
        parts += [] if heads is None else ["every head" if count[1] is None else f"{count[1]} heads"]
        parts += [] if blocks is None else ["every block" if not count[2] else f"{count[2]} blocks removed"]
        axes.plot([kept[i] for i in rows], [kls[i] for i in rows], marker="o", label=", ".join(parts) or None)
    axes.plot([kept[chosen]], [kls[chosen]], marker="*", markersize=14, color="tab:orange", linestyle="none")
    for (width, mlp, params, kl), x in zip(candidates, kept, strict=True):
        axes.annotate(
            f"width {width}\nMLP {mlp}\n{params / 1e6:.2f}M",
            (x, kl),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=7,
        )
    if experts is not None or heads is not None or blocks is not None:
        axes.legend(fontsize=8)
    axes.margins(x=0.12, y=0.2)  # room for the labels inside the axes
    axes.set_xlabel("share of the MLP's neurons kept (1: the residual width alone)")
    axes.set_ylabel("held-out KL(original ‖ model), nats per token")
    axes.set_title(f"{model + ': ' if model else ''}splits of one budget (★ chosen)")
    return figure


def _objectives_figure(
    table: list[dict[str, Any]], grid_keys: list[str], objectives: dict[str, dict[str, tuple[list[str], list[float]]]]
) -> Any:
    """One panel per strategy objective, a line per series over the sites (equal lines once, `A = B`)."""
    keys = sorted(objectives)
    columns = min(3, len(keys))
    rows = math.ceil(len(keys) / columns)
    figure, grid = _figure(rows, columns, (6 * columns, 4 * rows))
    styles, labels = _styles(table, grid_keys), series_labels(table, grid_keys)
    for axes, key in zip(grid.flat, keys):
        for series, label, (sites, values) in merge_identical(objectives[key], labels):
            axes.plot(sites, values, label=label, **styles[series])
        axes.set_title(key)
        axes.set_xlabel("site")
        axes.tick_params(axis="x", labelrotation=90, labelsize=6)
        if all(v > 0 for _, values in objectives[key].values() for v in values):
            axes.set_yscale("log")
        axes.grid(alpha=0.3)
    for axes in list(grid.flat)[len(keys) :]:
        axes.axis("off")
    x = _objective_x(table)
    where = f"sparsity {x}" if _by_sparsity(table) else f"{x:.3f} of the parameters kept"
    figure.suptitle(f"{table[0]['model']}: each strategy's objective per site, {where}")
    add_legend(figure)
    return figure


def _objective_x(table: list[dict[str, Any]]) -> float:
    """The sparsity (or parameter fraction) the per-site plot shows: the middle one of the sweep."""
    by_sparsity = _by_sparsity(table)
    values = sorted({_x(row, by_sparsity) for row in table})
    return values[len(values) // 2]


def _objectives(
    table: list[dict[str, Any]], sites: list[list[dict[str, Any]]], grid_keys: list[str]
) -> dict[str, dict[str, tuple[list[str], list[float]]]]:
    """objective → series → (site ids, values) at one sparsity, for the first seed of each series;
    sites where nothing is removed are left out."""
    if not table:
        return {}
    by_sparsity, x = _by_sparsity(table), _objective_x(table)
    out: dict[str, dict[str, tuple[list[str], list[float]]]] = defaultdict(dict)
    seen: set[str] = set()
    for row, records in zip(table, sites):
        series = _series(row, grid_keys)
        if _x(row, by_sparsity) != x or series in seen:
            continue
        seen.add(series)
        collected: dict[str, tuple[list[str], list[float]]] = {}
        for site in records:
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
