"""A complete run report as `report.json` holds it, for tests of what reads reports (tables,
compare, sweeps) without running a model: every field `RunReport` requires, with small values."""

from __future__ import annotations

import copy
from typing import Any

from compressor.reports.report_model import RunReport

_TEMPLATE: dict[str, Any] = {
    "compressor": "0.3.0",
    "model": {
        "path": "/models/ref-llama",
        "model_type": "llama",
        "family": "llama",
        "hidden_size": 256,
        "num_layers": 6,
        "dtype": "float32",
    },
    "sparsity": 0.25,
    "target_params": None,
    "kept_width": 192,
    "layout": "per_site",
    "stock": None,
    "rounding": None,
    "allocation": {
        "method": "uniform",
        "budget": 800,
        "predicted_params": 800,
        "transition_params": 0,
        "shared_sites": [],
    },
    "seed": 0,
    "parallel": {"world_size": 1, "tokens_by_rank": [65536]},
    "pipeline": [{"strategy": "pca", "options": {}}],
    "slicing": {},
    "fingerprint": {"recipe": "r", "model": "m", "data": "d"},
    "resumed_from": None,
    "resume": {"sites_loaded": 0, "fisher_loaded": False},
    "fisher_source": None,
    "fisher_autocast": None,
    "refinement": None,
    "guards": [],
    "distillation": None,
    "metrics": {"baseline": {"ppl": 30.167}, "pruned": {"ppl": 31.0, "kl": 0.02}},
    "params": {"baseline": 1000, "pruned": 800, "ratio": 0.8},
    "size": {
        "baseline": {"params": 1000, "weight_bytes": 4000, "transition_params": 0},
        "pruned": {"params": 800, "weight_bytes": 3200, "transition_params": 0},
    },
    "speed": None,
    "warnings": [],
    "sites": [],
    "timings": {"data_s": 1.5, "load_s": 2.0, "fisher_s": 20.0, "prune_s": 7.0, "eval_s": 3.0},
    "environment": {"device": "cpu", "torch": "2", "transformers": "5", "python": "3"},
}


def report_dict(**changes: Any) -> dict[str, Any]:
    """The template with `changes` (a mapping given for a mapping section replaces only its keys);
    checked against `RunReport`, so a test cannot pass on a report the runner could not write."""
    report = copy.deepcopy(_TEMPLATE)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(report.get(key), dict) and key not in ("metrics", "timings"):
            report[key] = {**report[key], **value}
        else:
            report[key] = value
    RunReport.model_validate(report)
    return report


def run_report(**changes: Any) -> RunReport:
    return RunReport.model_validate(report_dict(**changes))
