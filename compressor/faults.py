"""Named points of a run where a test can kill the process, to prove that resume works anywhere.

`COMPRESS_KILL_AT=<point>` makes the process SIGKILL itself when it reaches that point (no
cleanup, no exception handler runs: as the OOM killer or `kill -9` do). Points:
`capture` (inputs captured), `fisher` (H pass, after its first chunk), `site:<site id>`
(that site's checkpoint written), `writing:<layer>` and `written:<layer>` (a walk that writes as
it goes: that layer's tensors in the output's shards, before and after they are committed), `mlp:<layer>` (that layer's MLP pruned), `split:<index>`
(that split of the budget measured), `stage:<name>` (that stage of the run done) and `publish` (everything saved, before the output is put in
place). Inside `scoped(prefix)` every point is `<prefix><point>` (a split's trial walk reaches
`split1/site:embedding`, not the run's own `site:embedding`). With `COMPRESS_KILL_RANK=<rank>` too, only that rank of a `torchrun` job dies
(as one process of a data-parallel job lost to the OOM killer). Unset, `reached` costs one
dictionary look-up.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

KILL_VARIABLE = "COMPRESS_KILL_AT"
KILL_RANK_VARIABLE = "COMPRESS_KILL_RANK"


_prefix = ""


@contextmanager
def scoped(prefix: str) -> Iterator[None]:
    """Points reached inside are named `<prefix><point>`."""
    global _prefix
    outer, _prefix = _prefix, _prefix + prefix
    try:
        yield
    finally:
        _prefix = outer


def reached(point: str) -> None:
    rank = os.environ.get(KILL_RANK_VARIABLE)
    if os.environ.get(KILL_VARIABLE) == _prefix + point and rank in (None, os.environ.get("RANK", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
