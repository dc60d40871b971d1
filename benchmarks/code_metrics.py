"""How easy the code is to carry on, in numbers (issue 33's before/after table): lines of code,
the largest module and function, `engine.prune`'s parameter count, the modules a recipe's checks visit, the loops that move decoder
layers to the device themselves, README lines, tracked files over 1 MB, and string look-ups in
the report readers. Reads a checkout (default: this one); compare two with a worktree:

    git worktree add /tmp/old c355f7b
    python benchmarks/code_metrics.py /tmp/old . --output benchmarks/results/code_metrics.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

LAYER_LOOP = re.compile(r"held_on\(\[\s*layers?\b|held_on\(\[layers\[")
"""A pass that holds one decoder layer on the device itself (`visit_layers` is the one that may)."""
READERS = ("commands/compare.py", "reports/report.py", "cli.py", "commands/sweep.py", "commands/eval_command.py")
LOOKUP = re.compile(r"""report\[|report\.get|\["(metrics|params|speed|timings|size)"\]|\.get\(\"""")


TRACED_RECIPE = "recipes/ref_llama_stock.yaml"
"""The recipe whose checks `checks_trace.py` follows (it reads ../shared's reference model config)."""


def traced(root: Path) -> dict[str, Any]:
    """Modules and room crossings of a recipe's checks in checkout `root` (`checks_trace.py`)."""
    recipe = root / TRACED_RECIPE
    if not recipe.is_file():
        return {}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("checks_trace.py")), str(recipe)],
        env={**os.environ, "PYTHONPATH": str(root.resolve())},
        capture_output=True,
        text=True,
    )
    if done.returncode:
        return {"validation_modules": f"failed: {done.stderr.strip().splitlines()[-1:]}"}
    found = json.loads(done.stdout.splitlines()[-1])
    return {
        "validation_modules": len(found["validation"]["modules"]),
        "validation_room_crossings": found["validation"]["room_crossings"],
        "checks_modules": len(found["checks"]["modules"]),
    }


def measure(root: Path) -> dict[str, Any]:
    files = sorted((root / "compressor").rglob("*.py"))
    lines = {f: len(f.read_text().splitlines()) for f in files}
    largest = max(files, key=lambda f: lines[f])
    function, length = "", 0
    prune_params = None
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if size > length:
                    function, length = f"{f.relative_to(root / 'compressor')}:{node.name}", size
                if node.name == "prune" and f.name == "walk.py":
                    prune_params = len(node.args.args) + len(node.args.kwonlyargs)
    run_files = [f for f in files if (root / "compressor" / "run") in f.parents]
    run_largest = max(run_files, key=lambda f: lines[f])
    run_functions = sorted(
        (node.end_lineno - node.lineno + 1, f"{f.relative_to(root / 'compressor')}:{node.name}")  # type: ignore[operator]
        for f in run_files
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    )
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    big = [name for name in tracked if (root / name).is_file() and (root / name).stat().st_size > 1_000_000]
    return {
        "lines": sum(lines.values()),
        "largest_module": f"{largest.relative_to(root / 'compressor')} ({lines[largest]})",
        "largest_function": f"{function} ({length})",
        "prune_parameters": prune_params,
        "run_largest_module": f"{run_largest.relative_to(root / 'compressor')} ({lines[run_largest]})",
        "run_largest_function": f"{run_functions[-1][1]} ({run_functions[-1][0]})",
        "run_functions_over_80_lines": sum(1 for size, _ in run_functions if size > 80),
        "runner_lines": lines.get(root / "compressor" / "run" / "runner.py"),
        "schema_lines": lines.get(root / "compressor" / "recipe" / "schema.py"),
        **traced(root),
        "layer_loops": sum(len(LAYER_LOOP.findall(f.read_text())) for f in files),
        "readme_lines": len((root / "README.md").read_text().splitlines()),
        "files_over_1MB": big,
        "reader_string_lookups": sum(
            len(LOOKUP.findall(line))
            for name in READERS
            if (root / "compressor" / name).is_file()
            for line in (root / "compressor" / name).read_text().splitlines()
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", type=Path, help="checkouts to measure")
    parser.add_argument("--output", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    results = {str(root): measure(root) for root in args.roots}
    table = Table(title="code metrics")
    table.add_column("")
    for root in results:
        table.add_column(root, justify="right")
    for key in next(iter(results.values())):
        table.add_row(key, *(str(r[key]) for r in results.values()))
    Console().print(table)
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
