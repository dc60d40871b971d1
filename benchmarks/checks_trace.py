"""Which of compressor's modules a recipe's checks visit (issue 47's before/after table): every
module whose code runs while `load_recipe` validates a recipe, and while the whole check before a
run does (validation, `plan`, the device checks, the memory plan). Run inside a checkout (its
`compressor` first on the path); prints one JSON line. `code_metrics.py` calls it per checkout.

    PYTHONPATH=/tmp/old python benchmarks/checks_trace.py recipes/ref_llama_stock.yaml
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _ours(frame: Any) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == "compressor" or name.startswith("compressor.") else None


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def visited(work: Callable[[], Any]) -> dict[str, Any]:
    """The `compressor` modules whose functions are called while `work` runs, and the calls from
    one room into another (the nearest compressor caller up the stack, libraries skipped)."""
    seen: set[str] = set()
    crossings = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal crossings
        if event != "call" or (module := _ours(frame)) is None:
            return
        seen.add(module)
        caller = frame.f_back
        while caller is not None and _ours(caller) is None:
            caller = caller.f_back
        if caller is not None and _room(_ours(caller)) != _room(module):
            crossings += 1

    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
    return {"modules": sorted(seen), "room_crossings": crossings}


def main() -> None:
    import torch

    from compressor.plan.checks import check_device_settings, plan
    from compressor.plan.memory import run_memory_plan
    from compressor.recipe.schema import load_recipe
    from compressor.strategies.registry import PluginRegistry

    path = Path(sys.argv[1])
    registry = PluginRegistry()
    load_recipe(path, registry)  # imports and caches warmed, so the trace sees calls only
    validation = visited(lambda: load_recipe(path, registry))

    def whole() -> None:
        recipe = load_recipe(path, registry)
        checked = plan(recipe, registry)
        check_device_settings(recipe, torch.device("cpu"))
        run_memory_plan(recipe, checked, torch.device("cpu"))

    checks = visited(whole)
    print(json.dumps({"validation": validation, "checks": checks}))


if __name__ == "__main__":
    main()
