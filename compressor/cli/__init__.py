"""`compress`: run recipes, compare runs, list strategies and families. User errors print one line
and exit 2. The grammar is `parser`, each command's handler `commands`, what is shown while
it works `display`, Ctrl-C `interrupts`; rich and everything heavier load inside the handlers."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Sequence

from compressor.cli.interrupts import in_place_of_the_interrupt, interrupts_remembered
from compressor.cli.parser import UsageError, build_parser
from compressor.errors import Interrupts, UserError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
"""128 + SIGINT, as a shell reports a command Ctrl-C stopped."""


def main(argv: Sequence[str] | None = None) -> int:
    with interrupts_remembered():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    # Our display reports progress; tqdm reads this once, when it is first imported.
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        from rich.console import Console

        console = Console(stderr=False, log_path=False)
        parser = build_parser()
        if not (sys.argv[1:] if argv is None else list(argv)):  # bare `compress`: what it can do, not an error
            parser.print_help()
            return 2
        args = parser.parse_args(argv)
        from compressor.cli.commands import COMMANDS

        COMMANDS[args.command](args, console)
    except KeyboardInterrupt as interrupt:
        sys.stderr.write(f"interrupted{'; ' + str(interrupt) if str(interrupt) else ''}\n")
        return EXIT_INTERRUPTED
    except Exception as error:
        if Interrupts.seen:  # what a library made of the interrupt, named
            sys.stderr.write(f"interrupted; {in_place_of_the_interrupt(error)}\n")
            return EXIT_INTERRUPTED
        if isinstance(error, (UserError, UsageError)):
            sys.stderr.write(f"error: {error}\n")
            return EXIT_USER_ERROR
        if not isinstance(error, OSError) or error.errno != errno.ENAMETOOLONG:
            raise
        name = str(error.filename or "")
        sys.stderr.write(
            f"error: a path is longer than the file system allows ({len(name):,} characters: {name[:60]}…); "
            f"give a shorter model, output or recipe path\n"
        )
        return EXIT_USER_ERROR
    return 0
