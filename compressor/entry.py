"""The `compress` console script. Until `compressor.cli` is imported, Ctrl-C ends the process at
once with one line and exit code 130 (nothing exists yet to clean up); from then on
`compressor.cli.main` handles it like any interrupt (it imports rich and everything heavier
inside its handlers), cleaning up what a run created."""

from __future__ import annotations

import os
import signal
from types import FrameType


def _interrupted_early(signum: int, frame: FrameType | None) -> None:
    os.write(2, b"interrupted\n")
    os._exit(130)


def main() -> int:
    previous = signal.signal(signal.SIGINT, _interrupted_early)
    from compressor.cli import main as cli_main  # argparse and the standard library modules it needs

    signal.signal(signal.SIGINT, previous)
    return cli_main()
