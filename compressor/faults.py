"""Named points of a run where a test can kill the process, to prove that resume works anywhere.

`COMPRESS_KILL_AT=<point>` makes the process SIGKILL itself when it reaches that point (no
cleanup, no exception handler runs: as the OOM killer or `kill -9` do). Points:
`capture` (inputs captured), `fisher` (H pass, after its first chunk), `site:<site id>`
(that site's checkpoint written), `mlp:<layer>` (that layer's MLP pruned) and `publish`
(everything saved, before the output is put in place). With `COMPRESS_KILL_RANK=<rank>` too, only that rank of a `torchrun` job dies
(as one process of a data-parallel job lost to the OOM killer). Unset, `reached` costs one
dictionary look-up.
"""

from __future__ import annotations

import os
import signal

KILL_VARIABLE = "COMPRESS_KILL_AT"
KILL_RANK_VARIABLE = "COMPRESS_KILL_RANK"


def reached(point: str) -> None:
    rank = os.environ.get(KILL_RANK_VARIABLE)
    if os.environ.get(KILL_VARIABLE) == point and rank in (None, os.environ.get("RANK", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
