"""Does H predict the output KL of removing a whole subspace? (Figure 2a with k-dimensional U)

The rank-one check is `compress surrogate` (compressor/commands/surrogate.py, `check_recipe`). This
script keeps its subspace variant, built from the same pieces: at one site of the reference
model (recipes/ref_llama_sens.yaml: its model, data and H options), for k-dimensional
subspaces U (k = the width the recipe's sparsity removes: random ones, and the bottom
eigenspaces of τĈ + Ĥ/τ for τ from 0.01 to 100, which run from H-aware to PCA), the stream is
perturbed by x ← x − α·UUᵀx with α chosen so the activation energy removed equals PCA's. The
local model predicts ½α²·Tr(UᵀCU·UᵀHU); the measured KL is the mean per-token
KL(original ‖ perturbed) on held-out windows.

    .venv/bin/python benchmarks/fisher_check.py [--site layers.2.attn] [--out benchmarks/results/fisher_check.json]
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from compressor.commands.surrogate import (
    Measuring,
    check_site,
    ensure_fused,
    measure_kl,
    pca_energy,
    predicted_kl,
    rank_correlation,
    site_statistics,
)
from compressor.engine.calibration import capture_layer_inputs
from compressor.plan.checks import plan
from compressor.recipe.schema import load_recipe
from compressor.runtime.loading import load_model, load_tokenizer, resolve_device, token_batches
from compressor.strategies.contract import eigh_descending, frobenius_normalised
from compressor.strategies.registry import PluginRegistry

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", default="layers.2.attn")
    parser.add_argument("--random", type=int, default=12, help="number of random subspaces")
    parser.add_argument("--calibration", type=int, default=64, help="calibration windows (C and H)")
    parser.add_argument("--windows", type=int, default=16, help="held-out windows (measured KL)")
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "ref_llama_sens.yaml"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fisher_check.json"))
    args = parser.parse_args()
    console = Console(width=140)
    registry = PluginRegistry()
    recipe = load_recipe(
        args.recipe, registry, [f"calibration.num_samples={args.calibration}", f"evaluation.num_samples={args.windows}"]
    )
    checked = plan(recipe, registry)
    family, device = checked.layout.family, resolve_device(recipe.device)
    check_site(family, checked.layout.config.num_hidden_layers, args.site)
    tokenizer = load_tokenizer(recipe.model)
    model = load_model(recipe.model).requires_grad_(False)
    ensure_fused(model, family)
    batches = token_batches(recipe.calibration, tokenizer, "calibration")
    calibration = capture_layer_inputs(model, family, batches, device)
    C, H = site_statistics(model, family, calibration, args.site, Measuring(device, recipe.sensitivity, recipe.seed))
    d = C.shape[0]
    k = d - checked.layout.kept
    target = pca_energy(C, k)

    subspaces: list[tuple[str, torch.Tensor]] = []
    Cn, Hn = frobenius_normalised(C), frobenius_normalised(H)
    for tau in (0.01, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0):
        subspaces.append((f"bottom of τC+H/τ, τ={tau:g}", eigh_descending(tau * Cn + Hn / tau)[1][:, d - k :]))
    generator = torch.Generator().manual_seed(0)
    for i in range(args.random):
        U, _ = torch.linalg.qr(torch.randn(d, k, generator=generator, dtype=torch.float64))
        subspaces.append((f"random {i}", U))
    alphas = [(target / torch.trace(U.T @ C @ U).item()) ** 0.5 for _, U in subspaces]

    held_out = capture_layer_inputs(model, family, token_batches(recipe.evaluation, tokenizer, "evaluation"), device)
    perturbations = [(U, alpha) for (_, U), alpha in zip(subspaces, alphas)]
    measured, _ = measure_kl(model, family, held_out, args.site, perturbations, Measuring(device))
    rows = [
        {"subspace": name, "alpha": alpha, "predicted_kl": predicted_kl(C, H, U, alpha), "measured_kl": kl}
        for (name, U), alpha, kl in zip(subspaces, alphas, measured)
    ]

    correlation = rank_correlation([r["predicted_kl"] for r in rows], [r["measured_kl"] for r in rows])
    table = Table(title=f"H vs finite-difference KL at {args.site} (removed energy fixed at PCA's for k={k} of {d})")
    for column in ("subspace", "α", "predicted KL", "measured KL"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["subspace"], f"{r['alpha']:.3f}", f"{r['predicted_kl']:.5f}", f"{r['measured_kl']:.5f}")
    console.print(table)
    console.print(f"Spearman rank correlation (predicted vs measured): {correlation:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"site": args.site, "k": k, "rows": rows, "spearman": correlation}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
