"""lm-evaluation-harness tasks on models already in memory.

A run evaluates the dense and the pruned model in the process that pruned, through lm-eval's
HF wrapper around the loaded model objects: nothing is reloaded from disk and the models are
never looked up on the hub. Tasks are lm-eval registry names (`arc_easy`, `mmlu`), names from a
local `include_path`, or task YAML files. A local task's relative `dataset_kwargs.data_files`
resolve against its YAML's folder (lm-eval alone would read them against the current folder),
so a recipe and its tasks can be run from anywhere, offline.

Results are flattened to `{task: {metric: value, metric_stderr: value, samples: n}}`, one entry
per task named in the recipe (a group such as `mmlu` gives its aggregate); a metric computed
under a filter other than lm-eval's `none` keeps the filter in its name (`exact_match,flexible-extract`,
and its error `exact_match,flexible-extract_stderr`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from transformers import PreTrainedModel

from compressor.errors import UserError, first_line
from compressor.recipe import TASK_FILE_SUFFIXES, LmEvalSpec


@functools.lru_cache(maxsize=4)
def _manager(include_path: str | None, include_defaults: bool) -> Any:
    """Indexing lm-eval's registry takes seconds: once per process for each kind."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def _task_manager(spec: LmEvalSpec) -> Any:
    """lm-eval's task index; its built-in registry only when a task needs it."""
    local_only = all(task.endswith(TASK_FILE_SUFFIXES) for task in spec.tasks)
    if spec.include_path is not None and not local_only:
        local = _manager(spec.include_path, False)
        if all(task.endswith(TASK_FILE_SUFFIXES) or task in local.task_index for task in spec.tasks):
            return local
    return _manager(spec.include_path, not local_only)


def check_tasks(spec: LmEvalSpec) -> None:
    """Every task name is known to lm-eval (or to `include_path`): a typo fails before any work."""
    with _quiet():
        index = _task_manager(spec).task_index
    for task in spec.tasks:
        if not task.endswith(TASK_FILE_SUFFIXES) and task not in index:
            where = f" or in {spec.include_path}" if spec.include_path else ""
            raise UserError(f"unknown lm-eval task '{task}': not in lm-eval's registry{where} "
                            f"(list them with `lm_eval ls tasks`, or give a task YAML file)")


def _local_config(path: Path) -> dict[str, Any]:
    """A task YAML as lm-eval reads it (includes merged, !function resolved), with relative
    data files resolved against the YAML's folder."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        config = load_yaml(path)
    except (OSError, ValueError, ImportError) as error:
        raise UserError(f"cannot read lm-eval task {path}: {first_line(error)}") from None
    kwargs = config.get("dataset_kwargs")
    if isinstance(kwargs, dict) and "data_files" in kwargs:
        config["dataset_kwargs"] = {**kwargs, "data_files": _resolved(kwargs["data_files"], path.parent)}
    return config


def _resolved(files: Any, base: Path) -> Any:
    if isinstance(files, str):
        return files if "://" in files or Path(files).is_absolute() else str((base / files).resolve())
    if isinstance(files, list):
        return [_resolved(f, base) for f in files]
    if isinstance(files, dict):
        return {k: _resolved(v, base) for k, v in files.items()}
    return files


def _task_specs(spec: LmEvalSpec, manager: Any) -> tuple[list[str | dict[str, Any]], list[str]]:
    """What to hand lm-eval for each task, and the name its results come back under."""
    specs: list[str | dict[str, Any]] = []
    names: list[str] = []
    for task in spec.tasks:
        entry = manager.task_index.get(task)
        if task.endswith(TASK_FILE_SUFFIXES):
            config = _local_config(Path(task))
        elif entry is not None and entry.yaml_path is not None and spec.include_path is not None \
                and Path(entry.yaml_path).resolve().is_relative_to(Path(spec.include_path).resolve()) \
                and entry.kind.name == "TASK":
            config = _local_config(Path(entry.yaml_path))
        else:
            specs.append(task)
            names.append(task)
            continue
        if "task" not in config:
            raise UserError(f"lm-eval task file {task} has no 'task' key (only single tasks can be given as files)")
        specs.append(config)
        names.append(str(config["task"]))
    return specs, names


def _flatten(values: dict[str, Any]) -> dict[str, float | int | None]:
    """lm-eval's `{"acc,none": .., "acc_stderr,none": ..}` to `{"acc": .., "acc_stderr": ..}`."""
    out: dict[str, float | int | None] = {}
    for key, value in values.items():
        if key == "sample_len":
            out["samples"] = int(value)
        if "," not in key:
            continue
        metric, _, filtered = key.partition(",")
        stderr = metric.endswith("_stderr")
        stem = metric.removesuffix("_stderr")
        name = (stem if filtered == "none" else f"{stem},{filtered}") + ("_stderr" if stderr else "")
        out[name] = float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
    return out


@contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's logging would interleave with our progress display, and its `git describe` of the
    current folder (irrelevant here: the report records the versions) prints git's complaint
    outside a repository. Its tqdm bars are switched off by the CLI, which sets TQDM_DISABLE
    before tqdm is first imported."""
    from lm_eval import evaluator

    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with mock.patch.object(evaluator, "get_git_commit_hash", lambda: None):
            yield
    finally:
        logger.setLevel(level)


def run_tasks(model: PreTrainedModel, tokenizer: Any, spec: LmEvalSpec, device: torch.device,
              seed: int = 0) -> dict[str, dict[str, float | int | None]]:
    """Evaluate `model` (already on `device`) on the spec's tasks; `{task: {metric: value}}`."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    with _quiet():
        manager = _task_manager(spec)
        specs, names = _task_specs(spec, manager)
        wrapper = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=spec.batch_size, device=str(device))
        limit = spec.limit if spec.limit is None or spec.limit < 1 else int(spec.limit)
        try:
            results = simple_evaluate(model=wrapper, tasks=specs, task_manager=manager, num_fewshot=spec.num_fewshot,
                                      limit=limit, apply_chat_template=spec.apply_chat_template, log_samples=False,
                                      random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                      fewshot_random_seed=seed)
        except (OSError, ConnectionError) as error:
            raise UserError(f"lm-eval could not load a task's data: {first_line(error)}"
                            f"{' (offline mode is on; use local task files)' if os.environ.get('HF_DATASETS_OFFLINE') == '1' else ''}") from None
    if results is None:  # only a non-zero rank in a distributed run gets None
        return {}
    return {name: _flatten(results["results"].get(name, {})) for name in names}
