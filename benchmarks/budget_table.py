"""Where a sliced model's parameters go, and what each way to a parameter target keeps.

For each model shape: the original's parameters; SliceGPT's uniform model at a sparsity (head
input kept whole, and sliced), with the share its residual transitions and its untied head
take; then, for a `target_params` fraction, the widest uniform width each way reaches and its
exact count: plain (transitions and an untied, sliced head paid with width), shared bases (each
layer's MLP keeps its attention's basis), a tied head kept tied (tied models), and both. Counts
come from `compressor.models.budget` (a sliced model built on the meta device), so nothing is loaded.
Why: a model with tied embeddings and a large vocabulary can *grow* when sliced, and the way to
a budget decides how much width is left.

Run by hand (no weights, seconds):

    .venv/bin/python benchmarks/budget_table.py [--target 0.75] [--sparsity 0.25] \
        [--out benchmarks/results/budget_table.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, LlamaConfig, PretrainedConfig

from compressor.errors import UserError
from compressor.models.budget import param_model, widest_uniform
from compressor.models.families import family_for
from compressor.models.layout import kept_width
from compressor.models.sites import shared_site_ids, site_widths

ROOT = Path(__file__).resolve().parent.parent


def shapes() -> dict[str, PretrainedConfig]:
    found = {
        "135M-shaped, tied (30 layers, width 576, vocab 49,152)": LlamaConfig(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            tie_word_embeddings=True,
        )
    }
    reference = ROOT.parent / "shared" / "models" / "ref-llama"
    if reference.is_dir():
        found["ref-llama (6 layers, width 256, vocab 8,192, untied)"] = AutoConfig.from_pretrained(reference)
    return found


def rows_for(name: str, config: PretrainedConfig, target: float, sparsity: float) -> list[dict[str, Any]]:
    family = family_for(config.model_type)
    layers, d = config.num_hidden_layers, config.hidden_size
    tied_model = bool(config.tie_word_embeddings)
    plain = param_model(config, family)
    rows = []

    def row(way: str, params: Any, widths: dict[str, int]) -> dict[str, Any]:
        count = params.count(widths)
        return {
            "model": name,
            "way": way,
            "kept": widths["embedding"],
            "head_input": widths[params.sites[-1]],
            "params": count,
            "ratio": count / params.original,
            "transitions": params.transition_params(widths) / count,
        }

    kept = kept_width(d, sparsity, 8)
    for slice_head in (False, True):
        rows.append(
            row(
                f"SliceGPT at sparsity {sparsity}" + (", head input sliced" if slice_head else ""),
                plain,
                site_widths(family, layers, d, kept, slice_head),
            )
        )
    budget = int(target * plain.original)
    ways = [("plain", (), False), ("shared bases", shared_site_ids(family, layers, True, False), False)]
    if tied_model:
        ways += [
            ("tied head", (), True),
            ("shared bases + tied head", shared_site_ids(family, layers, True, True), True),
        ]
    for way, sites, tied in ways:
        params = param_model(config, family, sites, tied)
        try:
            widths = widest_uniform(params, budget, 8, lambda k: site_widths(family, layers, d, k, True))
        except UserError:
            continue
        rows.append(row(f"target_params {target}: {way}", params, widths))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.75)
    parser.add_argument("--sparsity", type=float, default=0.25)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "budget_table.json"))
    args = parser.parse_args(argv)
    rows = [r for name, config in shapes().items() for r in rows_for(name, config, args.target, args.sparsity)]
    table = Table(title="parameters of sliced models")
    columns = ("model", "way", "kept", "head input", "params", "of original", "transitions")
    for column in columns:
        table.add_column(column, justify="right")
    lines = ["| " + " | ".join(columns) + " |", "|---|---|" + "---:|" * (len(columns) - 2)]
    for r in rows:
        cells = [
            r["model"],
            r["way"],
            str(r["kept"]),
            str(r["head_input"]),
            f"{r['params']:,}",
            f"{r['ratio']:.1%}",
            f"{r['transitions']:.1%}",
        ]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"benchmark": "budget_table", "target": args.target, "sparsity": args.sparsity, "rows": rows}, indent=2
        )
        + "\n"
    )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
