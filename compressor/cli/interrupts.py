"""Ctrl-C during a command: remembered (`errors.Interrupts`), so an interrupt a library turned into
another error still ends in one line and exit code 130, with what progress was kept named."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from compressor.errors import Interrupts, first_line


def in_place_of_the_interrupt(error: BaseException) -> str:
    """What ended the command after Ctrl-C, in place of the KeyboardInterrupt (a library's stand-in
    for it, or a failure while stopping), named in the interrupt's line."""
    return f"then {type(error).__name__}: {first_line(error)}"


def ended_by_interrupt(error: BaseException) -> bool:
    """Whether `error` ends the command as an interrupt: Ctrl-C itself, or anything after it."""
    return isinstance(error, KeyboardInterrupt) or Interrupts.seen


def interrupt_line(error: BaseException, kept: str | None) -> KeyboardInterrupt:
    """The interrupt `main` reports in one line: what came in Ctrl-C's place, and what was `kept`."""
    said = [] if isinstance(error, KeyboardInterrupt) else [in_place_of_the_interrupt(error)]
    return KeyboardInterrupt("; ".join([*said, *([kept] if kept else [])]))


@contextmanager
def interrupts_remembered() -> Iterator[None]:
    """`Interrupts.on_signal` handles SIGINT for the command, where Python's own handler is in place
    (in the main thread, where signals arrive; a SIGINT the launcher ignores stays ignored)."""
    Interrupts.seen = False
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    signal.signal(signal.SIGINT, Interrupts.on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
