"""Routed experts as the pruning axis (issue 48), measured alone on a Mixture-of-Experts model: for
each expert selector at each kept count, the pruned model's parameters (total and active per
token), KL to the original and perplexity on held-out windows, and the prune time. `output+H` is
the output-aware selector given the output sensitivity H of each MoE block's stream (from the H
pass on the unpruned model); `output` without it weighs the stream's coordinates alike. The
residual width and the experts' width are untouched.

    python benchmarks/make_ref_moe.py                       # once: the reference MoE (not in the repository)
    python benchmarks/moe_experts.py                         # benchmarks/results/ref-moe, ../shared data
    python benchmarks/moe_experts.py --kept 6 4 --selectors reap output+H

Writes benchmarks/results/moe_experts_<model>.json and .md.
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
from mlp_neurons import stream_sensitivity  # run as a script: benchmarks/ is on sys.path
from rich.console import Console
from rich.table import Table

from compressor.engine.experts import prune_experts
from compressor.engine.transforms import fuse_norms
from compressor.evaluation.metrics import compare, parameter_count
from compressor.models.families import family_for
from compressor.recipe.schema import validate
from compressor.run.loading import Resources
from compressor.strategies.registry import PluginRegistry

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHARED = ROOT.parent / "shared"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=RESULTS / "ref-moe")
    parser.add_argument("--calibration", type=int, default=64, help="calibration windows of 512 tokens")
    parser.add_argument("--heldout", type=int, default=32, help="held-out windows of 512 tokens (valid.jsonl)")
    parser.add_argument("--kept", type=int, nargs="+", default=[6, 4], help="experts kept per MoE layer")
    parser.add_argument("--selectors", nargs="+", default=["frequency", "reap", "output", "output+H"])
    parser.add_argument("--sample-tokens", type=int, default=2048, help="experts.sample_tokens")
    parser.add_argument("--no-protect", action="store_true", help="experts.protect_super: false")
    parser.add_argument("--tag", default="", help="appended to the output files' names")
    return parser.parse_args()


def active_params(model: torch.nn.Module, config: Any) -> int:
    """Parameters a token uses: all but the routed experts', plus top-k experts' worth."""
    experts = [m for name, m in model.named_modules() if name.endswith(".experts.0")]
    per_expert = sum(p.numel() for p in experts[0].parameters()) if experts else 0
    routed = sum(
        p.numel() for name, p in model.named_parameters() if ".experts." in name and ".shared_expert" not in name
    )
    return parameter_count(model) - routed + len(experts) * config.num_experts_per_tok * per_expert


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
    experts = int(getattr(original.config, family.experts))
    device = torch.device("cpu")
    sensitivity = None
    if any(s.endswith("+H") for s in args.selectors):
        console.log("H pass (full-width walk)")
        tick = time.perf_counter()
        sensitivity = stream_sensitivity(resources, recipe, calibration, registry)
        console.log(f"H pass: {time.perf_counter() - tick:.1f} s (shared by the +H rows, not in their prune time)")
    reference = resources.model(recipe.model)
    fuse_norms(reference, family)
    total0, active0 = parameter_count(reference), active_params(reference, reference.config)
    rows: list[dict[str, Any]] = []
    for keep in args.kept:
        for name in args.selectors:
            model = resources.model(recipe.model)
            fuse_norms(model, family)
            tick = time.perf_counter()
            records = prune_experts(
                model,
                family,
                calibration,
                keep,
                registry.expert_selector(name.removesuffix("+H")),
                device,
                super_ratio=None if args.no_protect else 10.0,
                sample_tokens=args.sample_tokens,
                sensitivity=sensitivity if name.endswith("+H") else None,
            )
            seconds = time.perf_counter() - tick
            setattr(model.config, family.experts, keep)
            figures = compare(original, model, heldout, device)["pruned"]
            row = {
                "selector": name,
                "kept": keep,
                "of": experts,
                "params": parameter_count(model) / total0,
                "active_params": active_params(model, model.config) / active0,
                "kl": figures["kl"],
                "ppl": figures["ppl"],
                "prune_s": seconds,
                "protected": sum(len(r.protected) for r in records),
                "fewest_tokens": min(r.fewest_tokens for r in records),
                "kept_by_layer": [r.kept for r in records],
            }
            rows.append(row)
            console.log(
                f"{name} kept {keep}/{experts}: KL {row['kl']:.5f} ppl {row['ppl']:.3f} ({seconds:.1f} s); "
                f"kept {row['kept_by_layer']}"
            )
    baseline = compare(original, resources.model(recipe.model), heldout, device)["baseline"]["ppl"]
    table = Table(title=f"{args.model.name}: routed experts only (original perplexity {baseline:.3f})")
    columns = ("selector", "kept", "params", "active params", "KL", "ppl", "protected", "prune s")
    for column in columns:
        table.add_column(column, justify="right")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = (
            r["selector"],
            f"{r['kept']}/{r['of']}",
            f"{r['params']:.1%}",
            f"{r['active_params']:.1%}",
            f"{r['kl']:.5f}",
            f"{r['ppl']:.3f}",
            str(r["protected"]),
            f"{r['prune_s']:.1f}",
        )
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    stem = RESULTS / f"moe_experts_{args.model.name}{args.tag}"
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
