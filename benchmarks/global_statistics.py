"""Does a global basis chosen from the partly sliced model's statistics beat the unsliced model's?

SliceGPT's walk measures each site's C on the model whose earlier sites are already sliced. A
global basis is chosen before the walk from the unsliced model's statistics (the survey); the
walk then measures every site again on the sliced model (`PruneResult.walked`, pooled alike).
This chooses a second basis from those (the same pipeline, H unchanged: it is the unsliced
model's in both), applies it, and compares the held-out KL and perplexity of the two stock
models. Prints a table, writes JSON. Run by hand:

    .venv/bin/python benchmarks/global_statistics.py [--recipe recipes/ref_llama_stock.yaml] \\
        [--set pipeline.0.strategy=pca ...] [--out benchmarks/results/global_statistics.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedModel

from compressor.engine.bases import apply_bases
from compressor.engine.pooling import SiteChooser
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.evaluation.metrics import compare
from compressor.models.sites import EMBEDDING
from compressor.models.stock import head_stream, to_stock
from compressor.plan.checks import plan
from compressor.recipe.schema import load_recipe
from compressor.runtime.loading import load_model, load_tokenizer, resolve_device, token_batches
from compressor.strategies.registry import PluginRegistry

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "ref_llama_stock.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "global_statistics.json"))
    args = parser.parse_args()
    console = Console()
    registry = PluginRegistry()
    recipe = load_recipe(args.recipe, registry, ["refinement=null", "evaluation.lm_eval=null", *args.overrides])
    if recipe.slicing.layout != "global":
        raise SystemExit("the recipe must have slicing.layout: global")
    checked = plan(recipe, registry)
    device = resolve_device(recipe.device)
    tokenizer = load_tokenizer(recipe.model)
    calibration = token_batches(recipe.calibration, tokenizer, "calibration")
    evaluation = token_batches(recipe.evaluation, tokenizer, "evaluation")
    torch.manual_seed(recipe.seed)
    tick = time.perf_counter()
    result = prune(
        load_model(recipe.model),
        checked.layout,
        calibration,
        checked.pipeline,
        WalkOptions(
            device=device,
            sensitivity=recipe.sensitivity,
            seed=recipe.seed,
            pooling=recipe.slicing.pooling,
            pool_walked=True,
        ),
    )
    walk_s = time.perf_counter() - tick
    assert result.walked is not None
    ids = list(checked.layout.widths)
    kept, _ = SiteChooser(checked.pipeline, ids).choose(checked.layout.kept, result.walked)
    second = {site: kept.to("cpu") for site in ids}

    def stock(bases: dict[str, torch.Tensor], sliced: PreTrainedModel | None = None) -> PreTrainedModel:
        sliced = sliced or apply_bases(load_model(recipe.model), checked.layout.family, bases, device, keep_tied=False)
        return to_stock(
            sliced,
            checked.layout.family,
            checked.layout.config,
            tie=checked.layout.tie_head,
            stream=head_stream(result.head_moment, bases[EMBEDDING]),
        )[0]

    original = load_model(recipe.model).to(device)
    rows = {}
    for label, model in (
        ("unsliced model's statistics (survey)", stock(result.bases, result.model)),
        ("sliced model's statistics (walk)", stock(second)),
    ):
        rows[label] = compare(original, model.to(device), evaluation, device)["pruned"]
    V1, V2 = result.bases[EMBEDDING], second[EMBEDDING]
    overlap = float(torch.linalg.matrix_norm(V1.T @ V2) ** 2 / V1.shape[1])
    table = Table(
        title=f"{Path(recipe.model.path).name}: one basis at width {checked.layout.kept}, "
        f"{'+'.join(s.strategy.name for s in checked.pipeline)}"
    )
    for column in ("statistics", "KL (nats)", "perplexity"):
        table.add_column(column, justify="left" if column == "statistics" else "right")
    for label, metrics in rows.items():
        table.add_row(label, f"{metrics['kl']:.5f}", f"{metrics['ppl']:.3f}")
    console.print(table)
    console.print(f"subspace overlap ‖V1ᵀV2‖²/k = {overlap:.4f}; walk {walk_s:.1f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "recipe": args.recipe,
                "overrides": args.overrides,
                "width": checked.layout.kept,
                "results": rows,
                "subspace_overlap": overlap,
                "walk_s": walk_s,
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
