"""CPU threads (`runtime.threads`, issue 50): the count is the affinity mask capped by a cgroup CPU
quota (v2 and v1 files, read from a fake mount), less the CPUs other work keeps busy (sampled by a
fresh command-line process only), shared among the machine's ranks; a recipe's `threads`,
`--threads` or `OMP_NUM_THREADS` replaces it, torch runs with it, and the report and the dry run
say it; a count below one is refused in one line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from compressor.cli import main
from compressor.runtime.threads import (
    available_cpus,
    busy_jiffies,
    cgroup_cpus,
    command_threads,
    others_busy,
    planned_threads,
    process_age,
    use_threads,
)
from tests.run.test_cli import write_recipe


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu,cpuacct/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 2.0),
        ({"cpu.max": "garbled"}, None),
        ({}, None),
    ],
)
def test_the_cgroup_quota_is_read_from_either_version(
    files: dict[str, str], cpus: float | None, tmp_path: Path
) -> None:
    assert cgroup_cpus(_cgroup(tmp_path, files)) == cpus


def test_the_available_cpus_are_the_affinity_capped_by_the_quota(tmp_path: Path) -> None:
    mask = len(os.sched_getaffinity(0))
    assert available_cpus(_cgroup(tmp_path / "none", {"cpu.max": "max 100000"})) == mask
    assert available_cpus(_cgroup(tmp_path / "half", {"cpu.max": "50000 100000"})) == 1  # at least one
    assert available_cpus(_cgroup(tmp_path / "wide", {"cpu.max": f"{100000 * (mask + 4)} 100000"})) == mask


def test_use_threads_sets_torch_and_leaves_the_cpus_other_work_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("compressor.runtime.threads.available_cpus", lambda: 4)
    assert use_threads(3) == (3, None) and torch.get_num_threads() == 3
    assert use_threads(None) == (4, None) and torch.get_num_threads() == 4
    assert use_threads(None, processes=64) == (1, None)
    assert use_threads(4, busy=3.0) == (4, None)  # the recipe's count stands
    assert use_threads(None, busy=0.6) == (4, None)  # an idle machine's noise: a CPU counts from 0.75
    threads, note = use_threads(None, busy=2.2)
    assert threads == 2 == torch.get_num_threads()
    assert note is not None and "other work keeps 2.2 of the 4 CPUs busy" in note and "uses 2 threads" in note
    threads, note = use_threads(None, processes=2, busy=2.0)  # the free CPUs shared, not each rank's share less all
    assert threads == 1 and note is not None and "per process" in note
    assert use_threads(None, busy=9.0)[0] == 1


def test_the_command_line_honours_omp_num_threads_and_torchrun_s_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("compressor.runtime.threads.available_cpus", lambda: 8)
    monkeypatch.setattr("compressor.runtime.threads.others_busy", lambda: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert command_threads(None) == (8, None) and command_threads(3) == (3, None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert command_threads(None) == (2, None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's default per rank
    assert command_threads(None) == (1, None) and command_threads(5) == (5, None)


def test_the_dry_run_plans_the_count_a_run_would_set_without_setting_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`planned_threads`: the recipe's, OMP_NUM_THREADS, or the CPUs less those other work keeps
    busy, shared among torchrun's local ranks, each named; torch's own count is left alone."""
    monkeypatch.setattr("compressor.runtime.threads.available_cpus", lambda: 8)
    monkeypatch.setattr("compressor.runtime.threads.others_busy", lambda: 3.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    torch.set_num_threads(2)
    assert planned_threads(3) == (3, "the recipe's")
    assert planned_threads(None) == (5, "the CPUs this process is given, less 3 other work keeps busy")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    threads, where = planned_threads(None)
    assert threads == 2 and where.endswith("shared by 2 processes")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert planned_threads(None) == (1, "OMP_NUM_THREADS")
    assert torch.get_num_threads() == 2


STAT = """cpu  300 0 100 500 0 0 0 0 0 0
cpu0 {busy0} 0 0 {idle0} 0 0 0 0 0 0
cpu1 {busy1} 0 0 {idle1} 5 0 0 0 0 0
intr 12345
"""


def test_busy_time_is_counted_on_the_cpus_of_the_mask() -> None:
    stat = STAT.format(busy0=100, idle0=50, busy1=7, idle1=30)
    assert busy_jiffies(stat, {0, 1}) == (107, 192) and busy_jiffies(stat, {1}) == (7, 42)


def test_only_a_fresh_process_without_a_quota_measures_other_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    age = process_age()
    assert age is not None and age > 0
    monkeypatch.setattr("compressor.runtime.threads.process_age", lambda: 5.0)
    samples = iter([STAT.format(busy0=0, idle0=0, busy1=0, idle1=0), STAT.format(busy0=20, idle0=0, busy1=1, idle1=19)])
    monkeypatch.setattr("compressor.runtime.threads.time.sleep", lambda _: None)
    monkeypatch.setattr("compressor.runtime.threads.os.sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr(Path, "read_text", lambda self: next(samples) if str(self) == "/proc/stat" else "")
    assert others_busy(tmp_path) == pytest.approx(2 * 21 / 40)  # one CPU held, the other idle
    monkeypatch.undo()
    monkeypatch.setattr("compressor.runtime.threads.process_age", lambda: 600.0)  # a test session: its own load
    assert others_busy(tmp_path) is None
    monkeypatch.setattr("compressor.runtime.threads.process_age", lambda: 5.0)
    assert others_busy(_cgroup(tmp_path / "quota", {"cpu.max": "200000 100000"})) is None


def test_a_run_uses_the_threads_it_is_told_and_says_so(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    torch.set_num_threads(2)
    assert main(["run", str(recipe), "--dry-run", "--threads", "1"]) == 0
    assert "CPU threads: 1 (the recipe's; set threads to change)" in capsys.readouterr().out
    assert main(["run", str(recipe), "--threads", "1"]) == 0
    assert torch.get_num_threads() == 1
    assert json.loads((tmp_path / "out" / "report.json").read_text())["environment"]["threads"] == 1
    assert "| CPU threads (torch) |  | 1 |" in (tmp_path / "out" / "report.md").read_text()
    capsys.readouterr()
    assert main(["run", str(recipe), "--set", "threads=0", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert "threads" in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_fresh_cli_run_on_a_busy_machine_runs_on_fewer_threads_and_says_why(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("compressor.runtime.threads.available_cpus", lambda: 2)
    monkeypatch.setattr("compressor.runtime.threads.others_busy", lambda: 1.1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None)
    assert main(["run", str(recipe)]) == 0
    assert "warning: other work keeps 1.1 of the 2 CPUs busy" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "report.json").read_text())["environment"]["threads"] == 1
