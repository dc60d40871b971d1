"""The MLP's width as the pruning axis (issue 34), measured alone: for each neuron selector, with
and without the down projection's refit, at each kept fraction of the MLP's neurons, the pruned
model's parameters, KL to the original and perplexity on held-out windows, and the prune time.
`obs+H` is the output-aware selector given the output sensitivity H of each MLP's stream (from the
H pass on the unpruned model); `obs` without it weighs the stream's coordinates alike.

    python benchmarks/mlp_neurons.py                                  # ref-llama, ../shared data
    python benchmarks/mlp_neurons.py --model benchmarks/results/smollm2-135m --fractions 0.5 0.75

Writes benchmarks/results/mlp_neurons_<model>.json and .md.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from compressor.engine.neurons import MlpOptions, mlp_linears, prune_mlp
from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.evaluation.metrics import compare, parameter_count
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout
from compressor.models.sites import layer_site_ids, site_ids
from compressor.recipe.schema import validate
from compressor.recipe.sections.sensitivity import SensitivityOptions
from compressor.runtime.loading import Resources
from compressor.strategies.registry import PluginRegistry

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHARED = ROOT.parent / "shared"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=SHARED / "models" / "ref-llama")
    parser.add_argument("--calibration", type=int, default=64, help="calibration windows of 512 tokens")
    parser.add_argument("--heldout", type=int, default=32, help="held-out windows of 512 tokens (valid.jsonl)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.75], help="kept share of neurons")
    parser.add_argument("--kept", type=int, nargs="+", help="kept neurons per MLP (replaces --fractions)")
    parser.add_argument("--selectors", nargs="+", default=["magnitude", "leverage", "obs", "obs+H"])
    parser.add_argument("--damping", type=float, nargs="+", default=[1e-2], help="the refit's ridge(s), x mean diag C")
    parser.add_argument(
        "--feedback", type=float, nargs="+", default=[0.0], help="the refit's error feedback share(s) α (mlp.feedback)"
    )
    parser.add_argument("--tag", default="", help="appended to the output files' names")
    parser.add_argument("--no-plain", action="store_true", help="only the refitted variants")
    return parser.parse_args()


def stream_sensitivity(resources: Resources, recipe: Any, calibration: list[Any], registry: PluginRegistry) -> dict:
    """H of the stream each layer's MLP writes to (by layer index), from the H pass of a
    full-width walk, in the original's coordinates (which norm fusion keeps)."""
    model = resources.model(recipe.model)
    family = family_for(model.config.model_type)
    layers, d = model.config.num_hidden_layers, model.config.hidden_size
    layout = fixed_layout(model.config, family, dict.fromkeys(site_ids(family, layers), d))
    step = registry.strategy("sensitivity")
    result = prune(
        model,
        layout,
        calibration,
        [PipelineStep(step, step.parse_options({}))],
        WalkOptions(sensitivity=SensitivityOptions(dtype="float32"), seed=recipe.seed),
    )
    assert result.fisher is not None
    return {i: result.fisher[layer_site_ids(family, i)[-1]] for i in range(layers)}


def main() -> None:
    args = _args()
    console = Console()
    registry = PluginRegistry()
    raw = {
        "model": {"path": str(args.model.resolve()), "dtype": "float32"},
        "calibration": {
            "dataset": {"path": "json", "data_files": str(SHARED / "corpus" / "calib.jsonl")},
            "num_samples": args.calibration,
            "seq_len": 512,
        },
        "pipeline": [{"strategy": "pca"}],  # unused: the recipe only carries the data and model settings here
        "target_params": 0.75,
        "evaluation": {
            "dataset": {"path": "json", "data_files": str(SHARED / "corpus" / "valid.jsonl")},
            "num_samples": args.heldout,
            "seq_len": 512,
            "throughput": False,
        },
        "output": str(RESULTS / "unused"),
    }
    recipe = validate(raw, ROOT, registry)
    resources = Resources()
    tokenizer = resources.tokenizer(recipe.model)
    calibration = resources.batches(recipe.calibration, tokenizer, "calibration")
    assert recipe.evaluation is not None
    heldout = resources.batches(recipe.evaluation, tokenizer, "evaluation")
    original = resources.model(recipe.model)
    family = family_for(original.config.model_type)
    width = mlp_linears(original.get_submodule(family.layers)[0], family)[1].in_features
    device = torch.device("cpu")
    sensitivity = None
    if any(s.endswith("+H") for s in args.selectors):
        console.log("H pass (full-width walk)")
        sensitivity = stream_sensitivity(resources, recipe, calibration, registry)
    rows: list[dict[str, Any]] = []
    keeps = args.kept or [int(round(fraction * width)) for fraction in args.fractions]
    variants = [(True, damping, alpha) for damping in args.damping for alpha in args.feedback]
    variants += [] if args.no_plain else [(False, None, 0.0)]
    for keep in keeps:
        for name in args.selectors:
            for refit, damping, alpha in variants:
                model = resources.model(recipe.model)
                tick = time.perf_counter()
                options = MlpOptions(
                    registry.selector(name.removesuffix("+H")),
                    device,
                    refit=refit,
                    damping=damping or args.damping[0],
                    feedback=alpha,
                    sensitivity=sensitivity if name.endswith("+H") else None,
                )
                records = prune_mlp(model, family, calibration, keep, options)
                seconds = time.perf_counter() - tick
                figures = compare(original, model, heldout, device)["pruned"]
                row = {
                    "selector": name,
                    "refit": refit,
                    "damping": damping,
                    "feedback": alpha,
                    "kept": keep,
                    "of": width,
                    "params": parameter_count(model) / parameter_count(original),
                    "kl": figures["kl"],
                    "ppl": figures["ppl"],
                    "prune_s": seconds,
                    "output_error": sum(r.error_refit if refit else r.error_dropped for r in records) / len(records),
                }
                rows.append(row)
                console.log(
                    f"{name} refit={refit} damping={damping} feedback={alpha} kept {keep}/{width}: KL {row['kl']:.5f} ppl {row['ppl']:.3f} "
                    f"({seconds:.1f} s)"
                )
    baseline = compare(original, resources.model(recipe.model), heldout, device)["baseline"]["ppl"]
    table = Table(title=f"{args.model.name}: MLP neurons only (original perplexity {baseline:.3f})")
    columns = ("selector", "refit", "damping", "feedback", "kept", "params", "KL", "ppl", "output error", "prune s")
    for column in columns:
        table.add_column(column, justify="right")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = (
            r["selector"],
            "yes" if r["refit"] else "no",
            f"{r['damping']:g}" if r["refit"] else "",
            f"{r['feedback']:g}" if r["refit"] else "",
            f"{r['kept']}/{r['of']}",
            f"{r['params']:.1%}",
            f"{r['kl']:.5f}",
            f"{r['ppl']:.3f}",
            f"{r['output_error']:.4f}",
            f"{r['prune_s']:.1f}",
        )
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    stem = RESULTS / f"mlp_neurons_{args.model.name}{args.tag}"
    stem.with_suffix(".json").write_text(
        json.dumps(
            {
                "model": str(args.model),
                "baseline_ppl": baseline,
                "args": vars(args) | {"model": str(args.model)},
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
