"""`compress eval TARGET`: perplexity, and KL to a reference model, of a finished run or any model.

For a run folder the defaults come from the run itself: the pruned model in `model/`, the
original model of its recipe as the reference, and its recipe's evaluation windows. Any model
(a local folder or a hub id) can be evaluated too, alone or against `--reference`. The figures
use the keys of a run's report: `metrics.baseline` (the reference) and `metrics.pruned` (the
evaluated model; `kl` when there is a reference).
"""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

import compressor
from compressor.errors import UserError
from compressor.evaluate import compare
from compressor.plugins import PluginRegistry
from compressor.recipe import DTYPES, DataSpec, ModelSpec, check_data, load_recipe, resolve_model_path
from compressor.runner import RUN_MARKER, load_model, load_tokenizer, resolve_device, token_batches

DEFAULT_WINDOWS = DataSpec(dataset={}, num_samples=64, seq_len=512, batch_size=8)


@dataclass(frozen=True)
class EvalRequest:
    """What the command line asked for; None means the run's (or the default) value."""

    target: str
    reference: str | None = None
    data: str | None = None
    text_field: str | None = None
    num_samples: int | None = None
    seq_len: int | None = None
    batch_size: int | None = None
    dtype: str | None = None
    device: str = "auto"


def _model_spec(path: str, dtype: str) -> ModelSpec:
    return ModelSpec(path=resolve_model_path(path, Path.cwd(), "relative to the current folder"), dtype=dtype)


def _plan(request: EvalRequest, registry: PluginRegistry) -> tuple[ModelSpec, ModelSpec | None, DataSpec]:
    """The model to evaluate, the reference (if any) and the evaluation windows."""
    if request.dtype is not None and request.dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got '{request.dtype}'")
    folder = Path(request.target)
    data: DataSpec | None = None
    if (folder / RUN_MARKER).is_file():
        if not (folder / "recipe.yaml").is_file() or not (folder / "model").is_dir():
            raise UserError(f"{folder} holds a report but no recipe.yaml and model/: not a complete run folder")
        recipe = load_recipe(folder / "recipe.yaml", registry)
        dtype = request.dtype or recipe.model.dtype
        target = dataclasses.replace(recipe.model, path=str((folder / "model").resolve()), revision=None, dtype=dtype)
        reference = dataclasses.replace(recipe.model, dtype=dtype) if request.reference is None else None
        data = recipe.evaluation
    else:
        dtype = request.dtype or "float32"
        target = _model_spec(request.target, dtype)
        reference = None
    if request.reference is not None:
        reference = _model_spec(request.reference, dtype)
    if request.data is not None:
        data = dataclasses.replace(data or DEFAULT_WINDOWS, dataset={"path": "json", "data_files": request.data},
                                  format="text")
    if data is None:
        raise UserError(f"no evaluation data for {request.target}: pass --data FILE.jsonl (one JSON object per line, "
                        f"with a text field)")
    overrides = {key: getattr(request, key) for key in ("text_field", "num_samples", "seq_len", "batch_size")
                 if getattr(request, key) is not None}
    data = check_data(dataclasses.replace(data, **overrides), "evaluation", Path.cwd())
    return target, reference, data


def evaluate_target(request: EvalRequest, progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Evaluate as `request` says; return the report (the CLI prints it and may write it)."""
    report_progress = progress or (lambda *_: None)
    started = time.perf_counter()
    target_spec, reference_spec, data = _plan(request, PluginRegistry())
    device = resolve_device(request.device)
    report_progress("tokenising data", 0, 1)
    batches = token_batches(data, load_tokenizer(target_spec), "evaluation")
    report_progress("loading models", 0, 1)
    target = load_model(target_spec).to(device)
    reference = load_model(reference_spec).to(device) if reference_spec is not None else None
    metrics = compare(reference, target, batches, device,
                      lambda done, total: report_progress("evaluating", done, total))
    return {
        "compressor": compressor.__version__,
        "target": target_spec.path,
        "reference": reference_spec.path if reference_spec is not None else None,
        "evaluation": dataclasses.asdict(data),
        "metrics": metrics,
        "timings": {"eval_s": time.perf_counter() - started},
        "environment": {"device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version()},
    }
