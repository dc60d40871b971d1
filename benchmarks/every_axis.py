"""Every axis at one budget, side by side (issue 49's table): the two-axis model the run chose before
heads and depth existed, each new axis beside the residual width, every axis chosen by the run, and
the heterogeneous layout (DeciLM), each as a `compress run` of one base recipe, then (optionally)
converted by llama.cpp's own converter and timed there.

Rows, at each `--targets` budget (`target_params`), all saved as the original class except the last:
- `two axes`: residual width and MLP neurons, the split chosen by measuring every candidate on every
  window (`mlp: {}`; `--choice default`: as the run decides by default, the 2 predicted best screened);
- `depth`: `depth.removed` blocks (`kl` selector) and the residual width taking the rest;
- `heads`: `heads.kept` of each KV group's query heads (`obs`) and the residual width taking the rest;
- `every axis`: `mlp: {}`, `heads: {}` and `depth: {}` together, the `--best` predicted candidates measured;
- `heterogeneous`: per-layer MLP widths, attention removable (the stream whole; refused where the
  MLPs cannot hold the budget).

Times: "run s" is the run less loading, saving and evaluation (H, choosing and pruning); "choosing
s" the split and depth stages; "chosen's pruning s" the saved model's walk (less H), heads and MLP
stages, inside "choosing s" where the run adopted the chosen trial (every calibration window).

    python benchmarks/every_axis.py                                   # ref-llama at 0.75 and 0.6
    python benchmarks/every_axis.py --model benchmarks/results/ref-llama-tied --name ref-llama-tied
    python benchmarks/real_model.py recipe --only global-beyond-tied --set refinement=null \\
        --output benchmarks/results/smollm2-protocol.yaml           # SmolLM2's protocol as a recipe
    python benchmarks/every_axis.py --recipe benchmarks/results/smollm2-protocol.yaml --name smollm2 \\
        --targets 0.75 --removed 2 \\
        --shortlist 4 --open-depth 'max_removed: 4, candidates: 3' --heads 0.67 --choice default
    python benchmarks/every_axis.py --reuse --gguf-python /work/gguf-venv/bin/python \\
        --converter /work/gguf-src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py

Each run's folder stays under benchmarks/results/every_axis_<name>/ (`--reuse` reads a finished
one back instead of running it again). With `--gguf-python` (a venv with llama-cpp-python, see
`gguf_check.py`) the dense model and every saved model are converted, their perplexity compared
with transformers' and their prefill and decode timed in llama.cpp (`--quantize q4_k_m`: each file
quantized by llama.cpp's quantizer first, the tables named `-q4_k_m`). Writes
benchmarks/results/every_axis_<name>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from axis_runs import EVALUATION, ROOT, common, run_report, working_seconds, write_tables
from rich.console import Console

from compressor.commands.gguf import QUANT_TYPES
from compressor.stages.split import TRIAL_TIMINGS

ROWS = ("two axes", "depth", "heads", "every axis", "heterogeneous")


def configurations(
    target: float,
    removed: int,
    heads: float,
    best: int,
    shortlist: int | None = None,
    open_depth: str = "",
    choice: str = "every",
) -> list[tuple[str, list[str]]]:
    """(label, --set changes) of every row at one budget. `shortlist`: both depth rows' `kl` selector
    measures only that many blocks per step (a model of many blocks is not measured once per block
    and step); `open_depth`: what the every-axis row's open `depth` section adds (`max_removed: 4`);
    `choice`: every (the two-axis row measures every split on every window, the every-axis row its
    `best` predicted on every window) or default (`mlp.measure_best` and `mlp.screen_windows` as the
    run decides them, `auto`, the every-axis row measuring its `best`)."""
    every = choice == "every"
    thorough = ["mlp.measure_best=null", "mlp.screen_windows=null"] if every else []
    whole = ["mlp.screen_windows=null"] if every else []
    budget = [f"target_params={target}", "sparsity=null"]
    stock = [*budget, "slicing.layout=global"]
    options = [] if shortlist is None else [f"shortlist: {shortlist}"]
    fixed = ", ".join([f"removed: {removed}", *options])
    open_section = ", ".join([*options, *([open_depth] if open_depth else [])])
    blocks = "block" if removed == 1 else "blocks"
    return [
        (f"{target}: two axes, chosen", [*stock, "mlp={}", *thorough]),
        (f"{target}: depth ({removed} {blocks}) + width", [*stock, f"depth={{{fixed}}}"]),
        (f"{target}: heads ({heads:g}) + width", [*stock, f"heads.kept={heads}"]),
        (
            f"{target}: every axis, chosen",
            [*stock, "mlp={}", f"mlp.measure_best={best}", *whole, "heads={}", f"depth={{{open_section}}}"],
        ),
        (
            f"{target}: heterogeneous",
            [*budget, "slicing.layout=heterogeneous", "mlp={}", "mlp.remove_attention=true"],
        ),
    ]


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """What each row shows beyond `common`: the axes' choices and the time spent choosing."""
    mlp, heads, depth = report.get("mlp") or {}, report.get("heads") or {}, report.get("depth") or {}
    timings = report["timings"]
    return {
        "widths": mlp.get("widths"),
        "mlp_kept": mlp.get("kept"),
        "mlp_of": mlp.get("of"),
        "attention_removed": mlp.get("attention_removed"),
        "heads_kept": heads.get("kept"),
        "heads_of": heads.get("of"),
        "blocks_removed": depth.get("removed") or [],
        "choosing_s": timings.get("split_s", 0.0) + timings.get("depth_s", 0.0),
        "own_s": sum(timings.get(key, 0.0) for key in TRIAL_TIMINGS),
        "work_s": working_seconds(timings),
    }


def run_rows(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    """Each configuration's run (or, with --reuse, its finished report), as a row."""
    base = [*EVALUATION, *([f"model.path={args.model.resolve()}"] if args.model else [])]
    rows = []
    runs = [
        (label, [*changes, *args.set])
        for target in args.targets
        for kind, (label, changes) in zip(
            ROWS,
            configurations(target, args.removed, args.heads, args.best, args.shortlist, args.open_depth, args.choice),
        )
        if kind in args.rows
    ]
    for index, (label, changes) in enumerate(runs):
        folder = args.folder / re.sub(r"[^a-z0-9.]+", "-", label.lower()).strip("-")
        console.print(f"[{index + 1}/{len(runs)}] {label}")
        if args.reuse and (folder / "report.json").is_file():
            report = json.loads((folder / "report.json").read_text())
        else:
            try:
                report = run_report(args.recipe, [*base, *changes], folder)
            except SystemExit as refusal:
                console.print(f"  refused: {refusal}")
                rows.append({"label": label, "changes": changes, "refused": str(refusal)})
                continue
        rows.append({"label": label, "changes": changes, "model_dir": str(folder / "model"), **common(report)})
        rows[-1].update(figures(report))
    return rows


def llama_cpp(args: argparse.Namespace, rows: list[dict[str, Any]], dense: Path) -> dict[str, Any]:
    """gguf_check.py over the dense model and every saved one, in the llama-cpp-python venv."""
    out = args.folder / "gguf"
    command = [str(args.gguf_python), str(ROOT / "benchmarks" / "gguf_check.py"), "--converter", str(args.converter)]
    report = out / f"check{'' if args.quantize is None else '-' + args.quantize}.json"
    command += ["--output", str(out), "--json", str(report), "--trust-remote-code", "--reuse-gguf"]
    command += ["--windows", str(args.windows), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    command += ["--decode-steps", str(args.decode_steps)]
    command += [] if args.quantize is None else ["--quantize", args.quantize]
    for model in [dense, *(Path(row["model_dir"]) for row in rows if "model_dir" in row)]:
        command += ["--model", str(model)]
    report.unlink(missing_ok=True)  # never read an earlier call's figures
    subprocess.run(command, cwd=ROOT, check=False)  # a model that fails is a row with its error
    checked = json.loads(report.read_text())["models"]
    return {str(Path(entry["model"]).resolve()): entry for entry in checked}


def llama_cpp_cells(gguf: dict[str, Any] | None) -> list[str]:
    """The last four cells of a row: the GGUF's size, llama.cpp's perplexity beside transformers'
    (float32: a quantized file's difference is what quantizing cost), prefill and decode."""
    if not gguf:
        return ["–", "–", "–", "–"]
    if gguf.get("error"):
        return ["–", gguf["error"][:40], "–", "–"]
    ppl = f"{gguf['ppl_transformers']:.3f} / {gguf['ppl_llama_cpp']:.3f}"
    size = f"{gguf['gguf_bytes'] / 2**20:.1f}"
    return [size, ppl, f"{gguf['prefill_tokens_per_s']:.0f}", f"{gguf['decode_tokens_per_s']:.1f}"]


def cells(row: dict[str, Any]) -> list[str]:
    """A row of the table: the dense model's (its perplexity and llama.cpp's figures), a pruned
    model's, or a refused configuration's (its label alone)."""
    if row["label"] == "dense":
        dense = ["dense", "100%", "", "all", "all", "none", "0", f"{row['ppl']:.2f}", "", "", ""]
        return [*dense, *llama_cpp_cells(row["gguf"])]
    if "refused" in row:
        return [row["label"], "refused", *["–"] * 13]
    if row["widths"] is not None:
        mlp = " ".join(str(w) for w in row["widths"])
    else:
        mlp = "all" if row["mlp_kept"] in (None, row["mlp_of"]) else f"{row['mlp_kept']} of {row['mlp_of']}"
    heads = "all" if row["heads_kept"] is None else f"{row['heads_kept']} of {row['heads_of']}"
    blocks = ",".join(map(str, row["blocks_removed"])) or "none"
    return [
        row["label"],
        f"{row['share']:.1%}",
        str(row["width"]),
        mlp,
        heads,
        blocks,
        f"{row['kl']:.4f}",
        f"{row['ppl']:.2f}",
        f"{row['work_s']:.0f}",
        f"{row['choosing_s']:.0f}",
        f"{row['own_s']:.0f}",
        *llama_cpp_cells(row.get("gguf")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "ref_llama_sens.yaml")
    parser.add_argument("--model", type=Path, default=None, help="another model folder in place of the recipe's")
    parser.add_argument("--name", default="ref-llama")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.75, 0.6])
    parser.add_argument("--removed", type=int, default=1, help="blocks the depth row removes")
    parser.add_argument("--heads", type=float, default=0.5, help="the share of query heads the heads row keeps")
    parser.add_argument("--best", type=int, default=2, help="candidates the every-axis row measures")
    parser.add_argument(
        "--choice", choices=("every", "default"), default="every", help="how the chosen rows choose (configurations)"
    )
    parser.add_argument("--shortlist", type=int, default=None, help="blocks the depth rows measure per step")
    parser.add_argument("--open-depth", default="", help="the every-axis row's depth options, e.g. 'max_removed: 4'")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="the rows to run")
    parser.add_argument("--set", action="append", default=[], help="a recipe change every row takes (key=value)")
    parser.add_argument("--label", default="", help="appended to --name in the results' names")
    parser.add_argument("--reuse", action="store_true", help="read finished runs back instead of rerunning")
    parser.add_argument("--gguf-python", type=Path, default=None, help="a venv's python with llama-cpp-python")
    parser.add_argument("--converter", type=Path, default=None, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows for the llama.cpp perplexity")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=64, help="tokens timed one at a time in llama.cpp")
    parser.add_argument("--quantize", choices=QUANT_TYPES, default=None, help="llama.cpp's quantizer type timed")
    args = parser.parse_args()
    if args.quantize is not None and args.gguf_python is None:
        parser.error("--quantize quantizes the GGUF files that --gguf-python converts; give --gguf-python too")
    args.name += args.label
    args.folder = ROOT / "benchmarks" / "results" / f"every_axis_{args.name}"
    console = Console()
    rows = run_rows(args, console)
    if args.gguf_python:
        recipe_model = yaml.safe_load(args.recipe.read_text())["model"]["path"]
        dense = (args.model or args.recipe.parent / recipe_model).resolve()
        checked = llama_cpp(args, rows, dense)
        ppl = next((row["baseline_ppl"] for row in rows if "baseline_ppl" in row), float("nan"))
        dense_row = {"label": "dense", "gguf": checked.get(str(dense)), "ppl": ppl}
        rows = [dense_row, *rows]
        for row in rows[1:]:
            row["gguf"] = checked.get(str(Path(row.get("model_dir", "-")).resolve()))
    columns = (
        "configuration",
        "params",
        "width",
        "MLP",
        "heads",
        "blocks removed",
        "KL",
        "ppl",
        "run s",
        "choosing s",
        "chosen's pruning s",
        "GGUF MiB",
        "ppl HF / llama.cpp",
        "prefill tok/s",
        "decode tok/s",
    )
    kind = "float32" if args.quantize is None else args.quantize
    title = f"{args.name}: every axis at one budget (held-out KL; llama.cpp on this CPU, {kind} GGUF)"
    stem = f"every_axis_{args.name}" + ("" if args.quantize is None else f"-{args.quantize}")
    write_tables(rows, columns, cells, title, stem, args.recipe, console)


if __name__ == "__main__":
    main()
