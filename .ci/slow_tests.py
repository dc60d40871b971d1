"""Choose the tests `make test` leaves out: from a CI run's `.ci/durations.xml` (junit, written by
`make test-all`), the slowest tests not already marked slow until the rest take at most `--budget`
minutes; written to `tests/slow_tests.txt`, one node id per line, which `tests/conftest.py` marks
slow. `.ci/run` (`make test-all`) still runs every test.

    python .ci/slow_tests.py ../ci-check/.ci/durations.xml --budget 8
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("durations", type=Path)
    parser.add_argument("--budget", type=float, default=8.0, help="minutes the default suite may take")
    args = parser.parse_args()
    marked = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "SLOW_TESTS_LIST": "off"},  # the tests marked in their own files only
    ).stdout.split()
    slow = {line for line in marked if "::" in line}
    times = []
    for case in ET.parse(args.durations).getroot().iter("testcase"):
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        if node not in slow:
            times.append((float(case.get("time", 0.0)), node))
    times.sort(reverse=True)
    left, chosen = sum(t for t, _ in times), []
    for seconds, node in times:
        if left <= args.budget * 60:
            break
        left -= seconds
        chosen.append(node)
    out = ROOT / "tests" / "slow_tests.txt"
    out.write_text(
        "# tests `make test` leaves out (marked slow by tests/conftest.py), chosen by .ci/slow_tests.py from a\n"
        "# CI run's times; `.ci/run` runs them all\n" + "".join(f"{node}\n" for node in sorted(chosen))
    )
    print(f"{len(chosen)} tests marked slow; the rest took {left / 60:.1f} min in that run -> {out}")


if __name__ == "__main__":
    main()
