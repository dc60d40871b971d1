"""How many CPU threads a run's torch uses: the CPUs this process is given, or the recipe's `threads`.

torch's own default is every core its OpenMP runtime sees, which is the machine's, not what a
container's CPU quota or a `taskset` mask gives the process. Past that, spinning threads wait on
each other, and a run on two cores with one of them busy took 4× longer than on one thread
(issue 50). The count is the affinity mask capped by the cgroup's CPU quota (v2 `cpu.max`, v1
`cpu.cfs_quota_us`), less the CPUs other work keeps busy where a fresh process can tell (their
busy time sampled for a fifth of a second at its start; said in a warning), shared among the
data-parallel ranks on the machine. A recipe's `threads` (or `OMP_NUM_THREADS`) replaces it. The
command line decides (`command_threads`); the report records the count.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

CGROUP = Path("/sys/fs/cgroup")
"""Where this process's cgroup is mounted (its own, inside a container's cgroup namespace)."""


def cgroup_cpus(root: Path = CGROUP) -> float | None:
    """The CPUs a cgroup quota allows (quota / period; 1.5 means one and a half), or None where
    no quota is set or no cgroup file can be read."""
    v2 = root / "cpu.max"
    try:
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        for folder in (root / "cpu", root / "cpu,cpuacct"):
            quota_file = folder / "cpu.cfs_quota_us"
            if quota_file.is_file():
                quota = int(quota_file.read_text())
                period = int((folder / "cpu.cfs_period_us").read_text())
                return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None
    return None


def available_cpus(root: Path = CGROUP) -> int:
    """The CPUs this process may use: its affinity mask, capped by a cgroup quota (rounded down,
    at least one)."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpus(root)
    if quota is not None:
        count = min(count, math.floor(quota))
    return max(1, count)


FRESH_S = 30.0
"""Only a process younger than this measures other work: a long-lived one (a test session, a
sweep) keeps the count it has, and its own threads may still be spinning down."""

WINDOW_S = 0.2
"""How long the CPUs' busy time is sampled while this process sleeps."""


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where that cannot be read."""
    try:
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def busy_jiffies(stat: str, cpus: set[int]) -> tuple[int, int]:
    """(busy, total) jiffies of the CPUs `cpus` in a /proc/stat text (busy: not idle or waiting on I/O)."""
    busy = total = 0
    for line in stat.splitlines():
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def others_busy(root: Path = CGROUP) -> float | None:
    """The CPUs of this process's affinity mask that other work keeps busy, sampled for
    `WINDOW_S` while this process sleeps; None where it cannot be told: an older process (see
    `FRESH_S`), a cgroup quota (the CPUs are shared by share, not by core), or no /proc/stat."""
    age = process_age()
    if age is None or age > FRESH_S or cgroup_cpus(root) is not None:
        return None
    try:
        cpus = os.sched_getaffinity(0)
        before = busy_jiffies(Path("/proc/stat").read_text(), cpus)
        time.sleep(WINDOW_S)
        after = busy_jiffies(Path("/proc/stat").read_text(), cpus)
    except (OSError, ValueError, AttributeError):
        return None
    total = after[1] - before[1]
    return None if total <= 0 else len(cpus) * (after[0] - before[0]) / total


def use_threads(requested: int | None, processes: int = 1, busy: float | None = None) -> tuple[int, str | None]:
    """Set torch's CPU threads to `choose_threads`'s count; returns it and its note."""
    threads, note = choose_threads(requested, processes, busy)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads, note


def choose_threads(requested: int | None, processes: int = 1, busy: float | None = None) -> tuple[int, str | None]:
    """`requested`, or the available CPUs less those other work keeps `busy` (`others_busy`; a CPU
    counts from three quarters busy), shared among this machine's `processes` (data-parallel
    ranks); and, where other work lowered the count, a note saying so."""
    if requested is not None:
        return requested, None
    cpus, share = available_cpus(), max(1, processes)
    held = 0 if busy is None else min(cpus - 1, math.floor(busy + 0.25))
    threads = max(1, (cpus - held) // share)
    if not held or threads >= max(1, cpus // share):
        return threads, None
    return threads, (
        f"other work keeps {busy:.1f} of the {cpus} CPUs busy, and threads that wait on each other "
        f"make a run several times slower, so this run uses {threads} thread{'s' if threads > 1 else ''}"
        f"{' per process' if share > 1 else ''} (set threads to choose)"
    )


def command_threads(requested: int | None) -> tuple[int, str | None]:
    """What a command-line process (`compress run`, `eval`, `sweep`) sets before its work:
    `requested`, else `OMP_NUM_THREADS` where it is set (torchrun sets 1 per rank), else the CPUs
    this process is given less those other work keeps busy, shared among the ranks torchrun
    started on this machine (`LOCAL_WORLD_SIZE`). Library calls (`run.runner.run`) leave torch's
    count alone unless a recipe sets `threads`."""
    return use_threads(*_command_inputs(requested))


def planned_threads(requested: int | None) -> tuple[int, str]:
    """The count `command_threads` would set, without setting it, and where it comes from (the dry run)."""
    chosen, processes, busy = _command_inputs(requested)
    threads, note = choose_threads(chosen, processes, busy)
    if requested is not None:
        return threads, "the recipe's"
    if chosen is not None:
        return threads, "OMP_NUM_THREADS"
    where = "the CPUs this process is given"
    if note is not None:
        where += f", less {available_cpus() // max(1, processes) - threads} other work keeps busy"
    return threads, where + (f", shared by {processes} processes" if processes > 1 else "")


def _command_inputs(requested: int | None) -> tuple[int | None, int, float | None]:
    """`requested` or `OMP_NUM_THREADS`, the processes on this machine, and (none requested) how
    many CPUs other work keeps busy."""
    if requested is None:
        told = os.environ.get("OMP_NUM_THREADS", "")
        requested = int(told) if told.isdigit() and int(told) > 0 else None
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    processes = int(local) if local.isdigit() and int(local) > 0 else 1
    return requested, processes, others_busy() if requested is None else None
