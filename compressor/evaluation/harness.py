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

import copy
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from transformers import PreTrainedModel

from compressor.errors import UserError, did_you_mean, first_line
from compressor.recipe.paths import resolve_path
from compressor.recipe.sections.evaluation import TASK_FILE_SUFFIXES, LmEvalSpec


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
    """Every task name is known to lm-eval (or to `include_path`) and every task file reads: a
    typo or a broken YAML fails before any work. Tags are refused (lm-eval reports no score for
    a tag, only for its tasks: name those)."""
    with _quiet():
        manager = _task_manager(spec)
        index = manager.task_index
        for task in spec.tasks:
            if task.endswith(TASK_FILE_SUFFIXES):
                continue
            if task not in index:
                where = f" or in {spec.include_path}" if spec.include_path else ""
                raise UserError(
                    f"unknown lm-eval task '{task}'{did_you_mean(task, index)}: not in lm-eval's "
                    f"registry{where} "
                    f"(list them with `lm_eval ls tasks`, or give a task YAML file)"
                )
            if index[task].kind.name == "TAG":
                raise UserError(
                    f"lm-eval name '{task}' is a tag, which has no score of its own: name its tasks "
                    f"(`lm_eval ls tasks` lists them)"
                )
        _task_specs(spec, manager)


def check_suites(suites: list[LmEvalSpec]) -> None:
    """`check_tasks` for each suite of a recipe or a command line."""
    for suite in suites:
        check_tasks(suite)


def suite_digest(spec: LmEvalSpec) -> str:
    """What decides a suite's scores besides the model: its settings, lm-eval's version, and the
    bytes of its local task files and of the data files they name (so an edited local task is
    never mistaken for the old one)."""
    import lm_eval

    with _quiet():
        specs, _ = _task_specs(spec, _task_manager(spec))
    parts = [json.dumps(dataclasses.asdict(spec), sort_keys=True), lm_eval.__version__]
    for item in specs:
        if isinstance(item, dict):
            parts.append(json.dumps(item, sort_keys=True, default=str))
            files = (item.get("dataset_kwargs") or {}).get("data_files")
            for path in _paths(files):
                parts.append(hashlib.sha256(Path(path).read_bytes()).hexdigest() if Path(path).is_file() else path)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _paths(files: Any) -> list[str]:
    if isinstance(files, str):
        return [files]
    if isinstance(files, list):
        return [p for f in files for p in _paths(f)]
    if isinstance(files, dict):
        return [p for f in files.values() for p in _paths(f)]
    return []


LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")
"""`dataset_path`s whose `data_files` are local files (a hub dataset's are paths inside its repository)."""


def _local_config(path: Path) -> dict[str, Any]:
    """A task YAML as lm-eval reads it (includes merged, !function resolved), with the relative
    data files of a local builder resolved against the YAML's folder."""
    import yaml
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        config = load_yaml(path)
    except (OSError, ValueError, ImportError, AttributeError, yaml.YAMLError) as error:
        raise UserError(f"cannot read lm-eval task {path}: {first_line(error)}") from None
    kwargs = config.get("dataset_kwargs")
    local = config.get("dataset_path") in LOCAL_BUILDERS or (path.parent / str(config.get("dataset_path"))).is_dir()
    if local and isinstance(kwargs, dict) and "data_files" in kwargs:
        config["dataset_kwargs"] = {**kwargs, "data_files": _resolved(kwargs["data_files"], path.parent)}
    return config


def _resolved(files: Any, base: Path) -> Any:
    if isinstance(files, str):
        return resolve_path(files, base)
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
        elif (
            entry is not None
            and entry.yaml_path is not None
            and spec.include_path is not None
            and Path(entry.yaml_path).resolve().is_relative_to(Path(spec.include_path).resolve())
            and entry.kind.name == "TASK"
        ):
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
    """lm-eval's logging would interleave with our progress display; its `git describe` of the
    current folder prints git's complaint outside a repository, and its environment survey runs
    subprocesses at every call (both irrelevant here: the report records the versions). Its tqdm bars are switched off by the CLI, which sets TQDM_DISABLE
    before tqdm is first imported."""
    from lm_eval import evaluator

    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with (
            mock.patch.object(evaluator, "get_git_commit_hash", lambda: None),
            mock.patch.object(evaluator, "add_env_info", lambda results: None),
        ):
            yield
    finally:
        logger.setLevel(level)


Progress = Callable[[str, int, int], None]

REQUEST_KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")
"""lm-eval's request types: the LM methods its evaluator calls with all of a kind's requests."""


def _watch_requests(wrapper: Any, report: Progress, what: str, seconds: float = 0.25) -> None:
    """Make `wrapper` (an lm-eval LM) report `what: <kind> requests` with answered/total as it
    works. lm-eval's evaluator hands each request type's requests of all the tasks at once (in
    an order of its own), and the HF model calls its cache hook once per answered request as
    each batch finishes (a `loglikelihood_rolling` request, once all its windows are done): a
    counting hook gives per-batch progress at no cost, reported at most every `seconds`."""
    from lm_eval.api.model import CacheHook

    class Counter(CacheHook):
        def __init__(self) -> None:
            super().__init__(None)
            self.phase, self.done, self.total, self.last = "", 0, 0, 0.0

        def add_partial(self, attr: str, req: Any, res: Any) -> None:
            self.done += 1
            now = time.perf_counter()
            if now - self.last >= seconds:
                self.last = now
                report(self.phase, min(self.done, self.total), self.total)

    counter = Counter()
    wrapper.set_cache_hook(counter)

    def counted(kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(requests: list[Any], *args: Any, **kwargs: Any) -> Any:
            counter.phase, counter.done, counter.total = f"{what}: {kind} requests", 0, len(requests)
            counter.last = time.perf_counter()
            report(counter.phase, 0, counter.total)
            kwargs.setdefault("disable_tqdm", True)  # HF's bars pass disable= themselves, past TQDM_DISABLE
            answers = method(requests, *args, **kwargs)
            report(counter.phase, counter.total, counter.total)
            return answers

        return run

    for kind in REQUEST_KINDS:  # the evaluator looks them up on the instance: getattr(lm, kind)
        setattr(wrapper, kind, counted(kind, getattr(wrapper, kind)))


def _task_list(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def run_tasks(
    model: PreTrainedModel,
    tokenizer: Any,
    spec: LmEvalSpec,
    device: torch.device,
    seed: int = 0,
    progress: Progress | None = None,
) -> dict[str, dict[str, float | int | None]]:
    """Evaluate `model` (already on `device`, or placed by accelerate with `device` its first) on the
    spec's tasks; `{task: {metric: value}}`.
    `progress(phase, done, total)` hears the suite's tasks being prepared, then its requests
    being answered (per request type, as batches finish)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    report = progress or (lambda *_: None)
    with _quiet():
        manager = _task_manager(spec)
        specs, names = _task_specs(spec, manager)
        what = _task_list(names)
        report(f"{what}: preparing the tasks", 0, 1)
        # lm-eval may give the tokenizer a pad token: a copy keeps the caller's (saved with the model) as it was
        wrapper = HFLM(
            pretrained=model, tokenizer=copy.deepcopy(tokenizer), batch_size=spec.batch_size, device=str(device)
        )
        if getattr(model, "hf_device_map", None):  # placed by accelerate: its first device, not a weight's
            wrapper._device = device
        _watch_requests(wrapper, report, what)
        limit = spec.limit if spec.limit is None or spec.limit < 1 else int(spec.limit)
        try:
            results = simple_evaluate(
                model=wrapper,
                tasks=specs,
                task_manager=manager,
                num_fewshot=spec.num_fewshot,
                limit=limit,
                apply_chat_template=spec.apply_chat_template,
                log_samples=False,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
        except (OSError, ConnectionError) as error:
            raise UserError(
                f"lm-eval could not load a task's data: {first_line(error)}"
                f"{' (offline mode is on; use local task files)' if os.environ.get('HF_DATASETS_OFFLINE') == '1' else ''}"
            ) from None
    if results is None:  # only a non-zero rank in a distributed run gets None
        return {}
    scores: dict[str, dict[str, float | int | None]] = {}
    for name in names:
        flat = _flatten(results["results"].get(name, {}))
        if any(key != "samples" for key in flat):
            scores[name] = flat
        else:  # a group that aggregates nothing: its tasks' scores
            for task in results.get("group_subtasks", {}).get(name, []):
                scores[task] = _flatten(results["results"].get(task, {}))
    return scores
