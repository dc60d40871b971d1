"""Errors a user can fix: the CLI prints them as one line and exits with code 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input (recipe, file, model, option): reported in one line, never as a traceback.

    The message names the problem and, where there is one, the fix.
    """
