"""Over a thousand generated bad and borderline recipes (`tests.run.recipe_fuzz`) through
`compress run --dry-run`: each ends in exit code 0, or in one line and exit code 2, within a
bounded time and memory, with nothing left beside the recipe; every recipe that must be refused
is. A handful of the mutations the dry run accepts then run for real (slow)."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from compressor.cli import main
from compressor.strategies.registry import PluginRegistry
from tests.conftest import EXAMPLES, ROOT
from tests.run.recipe_fuzz import Case, Generator, shipped_recipes

PLAN_SHOWN = "recipe checked, but the run would stop here"
"""A dry run refused by a check that explains itself with the plan (memory, output) prints it first."""

SECONDS_PER_CASE = 60
"""A dry run that takes longer has stopped answering (the slowest valid one takes about a second)."""

GROWTH_LIMIT_MIB = 1024
"""The process's resident memory may not grow by this much during one case (an unbounded
expansion), sampled every 20 ms. The 60 s alarm interrupts Python code only: a hang inside a C
call would stall the test rather than fail it."""


def small_data(folder: Path) -> Path:
    """The demo's first three documents (about 3,000 tokens): enough windows for the base recipe
    and the stages that read more, tokenised in milliseconds."""
    lines = (EXAMPLES / "data" / "calib-demo.jsonl").read_text().splitlines()[:3]
    path = folder / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def base_recipe(data: Path) -> tuple[dict[str, Any], dict[tuple[str, ...], Any]]:
    """A valid recipe that checks in a fraction of a second, and what a generated list item needs
    to be read at all (an lm-eval suite needs its tasks)."""
    local = {"path": "json", "data_files": str(data)}
    recipe = {
        "model": {"path": "model", "dtype": "float32"},
        "calibration": {"dataset": local, "num_samples": 4, "seq_len": 32, "batch_size": 2},
        "sparsity": 0.25,
        "pipeline": [{"strategy": "pca"}],
        "evaluation": {"dataset": local, "num_samples": 2, "seq_len": 32, "throughput": False},
        "device": "cpu",
        "output": "out",
    }
    fill = {
        ("evaluation", "lm_eval", "0"): {"tasks": [str(ROOT / "recipes/tasks/next_line/next_line.yaml")]},
        ("distillation",): {"tokens": 1024, "seq_len": 32, "heldout_windows": 2, "eval_every": 4},
        ("refinement",): {"windows": 4},
        ("experts",): {"kept": 2},
        ("depth",): {"removed": 1},
        ("heads",): {"kept": 2},
    }
    return recipe, fill


def generated(checkpoint: Path, data: Path) -> list[Case]:
    recipe, fill = base_recipe(data)
    shipped = shipped_recipes(ROOT / "recipes", Path("model"), data)
    config = json.loads((checkpoint / "config.json").read_text())
    return Generator(PluginRegistry(), recipe, fill, shipped, config, seed=0).cases()


class _Unbounded(BaseException):
    """Raised by the alarm: the case ran past its time."""


@dataclass
class Outcome:
    code: int | None
    out: str
    err: str
    left: list[str]
    growth_mib: float


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _PeakWatch(threading.Thread):
    """This process's resident memory sampled every 20 ms while a case runs: its peak growth, which
    the process's high-water mark (`ru_maxrss`) would hide below any earlier peak."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.start_mib = self.peak_mib = _rss_mib()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.peak_mib = max(self.peak_mib, _rss_mib())

    def growth(self) -> float:
        self.done.set()
        self.join()
        return max(self.peak_mib, _rss_mib()) - self.start_mib


def dry_run(case: Case, folder: Path, checkpoint: Path, capfd: pytest.CaptureFixture, real: bool = False) -> Outcome:
    """`compress run recipe.yaml --dry-run` on `case` in its own `folder` (the model as `model/`)."""
    folder.mkdir()
    model = folder / "model"
    if case.config is None:
        model.symlink_to(checkpoint)
    else:
        model.mkdir()
        for file in checkpoint.iterdir():
            if file.name != "config.json":
                (model / file.name).symlink_to(file)
        config = case.config if isinstance(case.config, bytes) else json.dumps(case.config).encode()
        (model / "config.json").write_bytes(config)
    (folder / "recipe.yaml").write_bytes(case.text)
    arguments = ["run", str(folder / "recipe.yaml"), *(f"--set={o}" for o in case.overrides)]
    capfd.readouterr()
    watch = _PeakWatch()
    watch.start()

    def expire(signum: int, frame: Any) -> None:
        raise _Unbounded

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(SECONDS_PER_CASE * (20 if real else 1))
    try:
        code: int | None = main(arguments if real else [*arguments, "--dry-run"])
    except _Unbounded:
        code = None
    except Exception as error:  # what `compress` would print as a traceback
        code = 1
        print(f"Traceback: {type(error).__name__}: {str(error)[:200]}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    captured = capfd.readouterr()
    left = sorted(p.name for p in folder.iterdir() if p.name not in ("recipe.yaml", "model"))
    return Outcome(code, captured.out, captured.err, left, watch.growth())


def problems(case: Case, outcome: Outcome) -> list[str]:
    """What `outcome` breaks of the promise: one line and exit 2, or exit 0; refused when it must be."""
    found = []
    if outcome.code is None:
        return [f"no answer within {SECONDS_PER_CASE} s"]
    if "Traceback" in outcome.out + outcome.err:
        found.append("printed a traceback")
    if outcome.code not in (0, 2):
        found.append(f"exit code {outcome.code}")
    if outcome.code == 2 and not (outcome.err.startswith("error: ") and outcome.err.count("\n") == 1):
        found.append(f"not one error line: {outcome.err[-300:]!r}")
    if outcome.code == 2 and outcome.out and not outcome.out.startswith(PLAN_SHOWN):
        found.append(f"printed before the error: {outcome.out[:200]!r}")
    if case.must_refuse and outcome.code == 0:
        found.append("accepted")
    if case.must_refuse and outcome.code == 2 and case.names is not None and case.names not in outcome.err:
        found.append(f"refused without naming {case.names}: {outcome.err.strip()[:200]!r}")
    if outcome.left:
        found.append(f"left {outcome.left}")
    if outcome.growth_mib > GROWTH_LIMIT_MIB:
        found.append(f"peak memory grew by {outcome.growth_mib:,.0f} MiB")
    return found


def test_over_a_thousand_generated_recipes_end_in_one_line_or_pass(
    tiny_checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    cases = generated(tiny_checkpoint, small_data(tmp_path))
    assert len(cases) >= 1000, len(cases)
    failures, codes = [], Counter()
    for index, case in enumerate(cases):
        outcome = dry_run(case, tmp_path / str(index), tiny_checkpoint, capfd)
        codes[(case.category, outcome.code)] += 1
        failures += [f"{case.name}: {problem}" for problem in problems(case, outcome)]
    refused = sum(n for (_, code), n in codes.items() if code == 2)
    assert not failures, f"{len(failures)} of {len(cases)} generated recipes:\n" + "\n".join(failures[:40])
    assert 0.5 * len(cases) < refused < len(cases), codes  # most are bad, and some pass: the oracle sees both


REAL_RUNS = 10


@pytest.mark.slow
def test_mutations_the_dry_run_accepts_run_or_end_in_one_line(
    tiny_checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """A seeded handful of one-setting mutations the dry run accepts (other choices, values at
    their bounds; not the huge counts, which run as long as they ask), run for real: each ends
    with its report, or in one line and exit code 2 with nothing left behind but kept progress
    that the line names."""
    candidates = [
        c
        for c in generated(tiny_checkpoint, small_data(tmp_path))
        if not c.must_refuse and c.category in ("value", "strategy") and "huge" not in c.name
    ]
    random.Random(1).shuffle(candidates)
    accepted: list[Case] = []
    for index, case in enumerate(candidates):
        if dry_run(case, tmp_path / f"dry{index}", tiny_checkpoint, capfd).code == 0:
            accepted.append(case)
        if len(accepted) == REAL_RUNS:
            break
    failures = []
    for index, case in enumerate(accepted):
        outcome = dry_run(case, tmp_path / f"real{index}", tiny_checkpoint, capfd, real=True)
        found = [p for p in problems(case, outcome) if not p.startswith("left")]
        if outcome.code == 0 and outcome.left != ["out"]:
            found.append(f"left {outcome.left} after a finished run")
        if outcome.code == 2 and outcome.left and not (outcome.left == [".out.partial"] and "kept" in outcome.err):
            found.append(f"left {outcome.left} after {outcome.err!r}")
        failures += [f"{case.name}: {problem}" for problem in found]
    assert len(accepted) == REAL_RUNS
    assert not failures, "\n".join(failures)
