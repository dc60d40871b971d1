"""Routed experts and their width as pruning axes (issue 48), measured on a Mixture-of-Experts
model with the residual width untouched: for each expert selector at each kept count (`--kept`),
each neuron selector at each expert width (`--widths`, every expert kept), and each combination
of the two (`--combos`, e.g. 6x128: 6 experts of 128 neurons, chosen by output+H then obs+H), the
pruned model's parameters (total and active per token), KL to the original and perplexity on
held-out windows, and the prune time. A `+H` selector is given the output sensitivity H of each
MoE block's stream (from the H pass on the unpruned model); without it the stream's coordinates
weigh alike. Routed parameters scale with experts × width, so 6/8 experts, width 144 of 192 and
8x144 cost the same. With `--router-refit`, each expert row is measured again with the router
refitted after the experts go (`experts.router_refit`, `engine.router_refit`). With
`--shared-widths` (a model with a shared expert, e.g. `make_ref_moe.py --shared-width`), each
neuron selector narrows every shared expert alone (`mlp.shared_kept`), and `obs+H gate-blind`
is the ablation whose statistics leave out the shared expert's gate (C = E[h hᵀ], not E[σ² h hᵀ]).

    python benchmarks/make_ref_moe.py                       # once: the reference MoE (not in the repository)
    python benchmarks/moe_experts.py                         # benchmarks/results/ref-moe, ../shared data
    python benchmarks/moe_experts.py --kept 6 4 --selectors reap output+H --widths 96 --combos 6x128
    python benchmarks/moe_experts.py --kept 6 4 --selectors reap output+H --router-refit --tag _router
    python benchmarks/moe_experts.py --model benchmarks/results/ref-moe-shared --kept --widths 168 156 \
        --shared-widths 192 96 --neuron-selectors magnitude obs+H "obs+H gate-blind"

Writes benchmarks/results/moe_experts_<model>.json and .md.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from mlp_neurons import stream_sensitivity  # run as a script: benchmarks/ is on sys.path
from rich.console import Console
from rich.table import Table

from compressor.engine.expert_width import SharedMoments
from compressor.engine.experts import ExpertOptions, prune_experts
from compressor.engine.neurons import MlpOptions, prune_mlp
from compressor.engine.transforms import fuse_norms
from compressor.evaluation.metrics import compare, parameter_count
from compressor.models.families import family_for
from compressor.models.layout import set_mlp_widths
from compressor.recipe.schema import validate
from compressor.runtime.loading import Resources
from compressor.strategies.registry import PluginRegistry

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHARED = ROOT.parent / "shared"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=RESULTS / "ref-moe")
    parser.add_argument("--calibration", type=int, default=64, help="calibration windows of 512 tokens")
    parser.add_argument("--heldout", type=int, default=32, help="held-out windows of 512 tokens (valid.jsonl)")
    parser.add_argument("--kept", type=int, nargs="*", default=[6, 4], help="experts kept per MoE layer")
    parser.add_argument("--selectors", nargs="+", default=["frequency", "reap", "output", "output+H"])
    parser.add_argument("--widths", type=int, nargs="*", default=[], help="neurons every routed expert keeps")
    parser.add_argument("--neuron-selectors", nargs="+", default=["magnitude", "obs+H"])
    parser.add_argument("--combos", nargs="*", default=[], help="EXPERTSxWIDTH, e.g. 6x128")
    parser.add_argument("--shared-widths", type=int, nargs="*", default=[], help="neurons every shared expert keeps")
    parser.add_argument("--sample-tokens", type=int, default=2048, help="experts.sample_tokens")
    parser.add_argument("--no-protect", action="store_true", help="experts.protect_super: false")
    parser.add_argument("--router-refit", action="store_true", help="each expert row again with the router refit")
    parser.add_argument("--router-steps", type=int, default=20, help="experts.router_steps")
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


@contextmanager
def gate_blind(on: bool) -> Iterator[None]:
    """The ablation: a shared expert's statistics without its gate (C = E[h hᵀ] over every token)."""
    if not on:
        yield
        return
    add = SharedMoments.add

    def blind(self: SharedMoments, block: Any, x: torch.Tensor) -> None:
        gate, block.shared_expert_gate = block.shared_expert_gate, None
        try:
            add(self, block, x)
        finally:
            block.shared_expert_gate = gate

    SharedMoments.add = blind  # type: ignore[method-assign]
    try:
        yield
    finally:
        SharedMoments.add = add  # type: ignore[method-assign]


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
    width0 = int(getattr(original.config, family.mlp_width))
    refits = (False, True) if args.router_refit else (False,)
    shared0 = getattr(original.config, family.shared_expert_width or "", None)
    cases = [(keep, name, None, None, r, None) for keep in args.kept for name in args.selectors for r in refits]
    cases += [(None, None, width, name, False, None) for width in args.widths for name in args.neuron_selectors]
    cases += [(int(e), "output+H", int(w), "obs+H", False, None) for e, w in (c.split("x") for c in args.combos)]
    cases += [
        (None, None, None, name, False, shared) for shared in args.shared_widths for name in args.neuron_selectors
    ]
    rows: list[dict[str, Any]] = []
    for keep, expert_name, width, neuron_name, refit, shared in cases:
        model = resources.model(recipe.model)
        fuse_norms(model, family)
        tick = time.perf_counter()
        records = []
        if keep is not None and expert_name is not None:
            expert_options = ExpertOptions(
                registry.expert_selector(expert_name.removesuffix("+H")),
                device,
                super_ratio=None if args.no_protect else 10.0,
                sample_tokens=args.sample_tokens,
                router_steps=args.router_steps if refit else 0,
                sensitivity=sensitivity if expert_name.endswith("+H") or refit else None,
            )
            records = prune_experts(model, family, calibration, keep, expert_options)
            setattr(model.config, family.experts, keep)
        widths = []
        if neuron_name is not None:
            selector = neuron_name.removesuffix(" gate-blind")
            with gate_blind(selector != neuron_name):
                neuron_options = MlpOptions(
                    registry.selector(selector.removesuffix("+H")),
                    device,
                    sensitivity=sensitivity if selector.endswith("+H") else None,
                )
                widths = prune_mlp(model, family, calibration, width, neuron_options, shared_keep=shared)
            set_mlp_widths(model.config, family, width, shared)
        seconds = time.perf_counter() - tick
        figures = compare(original, model, heldout, device)["pruned"]
        what = "shared width" if shared is not None else "width"
        label = " then ".join(
            f"{name} ({kind})" for name, kind in ((expert_name, "experts"), (neuron_name, what)) if name is not None
        ) + (" + router refit" if refit else "")
        row = {
            "selector": label,
            "kept": keep or experts,
            "of": experts,
            "width": width or width0,
            "of_width": width0,
            "shared": shared or shared0,
            "of_shared": shared0,
            "params": parameter_count(model) / total0,
            "active_params": active_params(model, model.config) / active0,
            "kl": figures["kl"],
            "ppl": figures["ppl"],
            "prune_s": seconds,
            "protected": sum(len(r.protected) for r in records),
            "fewest_tokens": min(r.fewest_tokens for r in records) if records else None,
            "kept_by_layer": [r.kept for r in records],
            "width_error": [r.error_refit for r in widths],
            "shared_error": [r.shared_expert.error_refit for r in widths if r.shared_expert is not None],
            "router": [r.router for r in records if r.router is not None],
        }
        rows.append(row)
        console.log(f"{label}: {row['kept']}x{row['width']}: KL {row['kl']:.5f} ppl {row['ppl']:.3f} ({seconds:.1f} s)")
    baseline = compare(original, resources.model(recipe.model), heldout, device)["baseline"]["ppl"]
    table = Table(title=f"{args.model.name}: routed experts and their width (original perplexity {baseline:.3f})")
    columns = ("selector", "experts x width", "params", "active params", "KL", "ppl", "protected", "prune s")
    if shared0:
        columns = (*columns[:2], "shared width", *columns[2:])
    for column in columns:
        table.add_column(column, justify="right")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = (
            r["selector"],
            f"{r['kept']}/{r['of']} x {r['width']}/{r['of_width']}",
            *([f"{r['shared']}/{r['of_shared']}"] if shared0 else []),
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
