"""Errors a user can fix: the CLI prints them as one line and exits with code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from types import FrameType


class UserError(Exception):
    """Bad input (recipe, file, model, option): reported in one line, never as a traceback.

    The message names the problem and, where there is one, the fix.
    """


class ProgressKept(UserError):
    """A user error after which the run's checkpoint is deliberately kept (its message says how to
    continue); any other user error removes what the run created."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none), for one-line reports."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """ " (did you mean 'x'?)" for the allowed name nearest a misspelt one, or nothing when
    none is near: a typo is named with its fix."""
    nearest = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{nearest[0]}'?)" if nearest else ""


class Interrupts:
    """Ctrl-C, remembered for the command (`cli.main` installs `on_signal` as SIGINT's handler): a
    library may catch the KeyboardInterrupt and raise another error in its place (transformers'
    lazy import: "Could not import module 'Trainer'"); once the user has pressed Ctrl-C, whatever
    ends the command ends it as an interrupt, and the run keeps its progress."""

    seen = False

    @classmethod
    def on_signal(cls, signum: int, frame: FrameType | None) -> None:
        cls.seen = True
        raise KeyboardInterrupt
