"""What the command line shows while it works: a live progress bar on a terminal, one timestamped
line per phase elsewhere, and plain-text tables."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compressor.errors import UserError

if TYPE_CHECKING:
    from rich.console import Console


def phase_logger(console: Console, label: str = "", every_s: float = 60.0) -> Callable[[str, int, int], None]:
    """A progress callback that logs each phase once (not every batch), timestamped, so a log
    file stays short; `label` prefixes every line (e.g. which run of a sweep). A phase that lasts
    longer than `every_s` (an optimiser's steps at one site) logs how far it is, with the time left."""
    import time

    state: dict[str, Any] = {"phase": None, "since": 0.0, "logged": 0.0}

    def log(text: str) -> None:
        console.log(f"{label}: {text}" if label else text, markup=False, highlight=False)

    def log_phase(phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if state["phase"] != phase:
            state.update(phase=phase, since=now, logged=now)
            log(phase)
        elif total and 0 < done < total and now - state["logged"] >= every_s:
            state["logged"] = now
            log(f"{phase}: {done}/{total}, about {_duration((now - state['since']) * (total - done) / done)} left")

    return log_phase


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes}:{seconds:02d}"


@contextmanager
def progress_display(console: Console) -> Iterator[Callable[[str, int, int], None]]:
    """A live bar with the time a phase has taken and an estimate of what it has left, on a
    terminal; elsewhere (a log file, CI) one timestamped line per phase (and, in a long phase,
    one a minute), so a log stays short (a live display there would only leave a blank line)."""
    if not console.is_terminal:
        yield phase_logger(console)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)
        shown = {"phase": "starting"}

        def update(phase: str, done: int, total: int) -> None:
            if phase != shown["phase"]:  # a new phase: its rate, so its time left, starts afresh
                shown["phase"] = phase
                bar.reset(task, description=phase, completed=done, total=total)
            else:
                bar.update(task, completed=done, total=total)

        yield update


def print_table(console: Console, title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A listing whose cells are plain text (no rich markup) and fold rather than truncate."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    console.print(table)


def write_output(console: Console, output: Path, text: str) -> None:
    """Write a command's --output file; a path that cannot be written is a one-line user error."""
    try:
        output.write_text(text)
    except OSError as error:
        raise UserError(f"cannot write {output}: {error.strerror or error}") from None
    console.print(f"wrote {output}", markup=False, highlight=False)


def note_skipped(console: Console, registry: Any) -> None:
    from compressor.strategies.registry import ALLOW_VARIABLE

    if registry.allowed is not None:
        skipped = registry.skipped()
        console.print(
            f"{ALLOW_VARIABLE}={','.join(registry.allowed)}: not loaded: {', '.join(skipped) or 'none'}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
