"""The command line's grammar: every command, its arguments and their help, parsed by argparse
made to raise instead of exiting, so a usage error is one line like every other user error."""

from __future__ import annotations

import argparse
from typing import Any


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so usage errors look like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _version() -> str:
    """This package's version and those of the libraries that decide its results (read from the
    installed metadata: importing torch for it would take seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    from compressor import __version__

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"compress {__version__} (torch {installed('torch')}, transformers {installed('transformers')})"


class _VersionAction(argparse.Action):
    """`--version`, its text read only when asked for (the metadata reads take tens of milliseconds)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(_version())
        parser.exit()


def _positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got '{text}'")
    return int(text)


def build_parser() -> argparse.ArgumentParser:

    parser = _Parser(prog="compress", description="Residual-stream pruning of HF language models.")
    parser.add_argument("--version", action=_VersionAction, nargs=0, help="show the versions and exit")
    commands = parser.add_subparsers(dest="command", required=True)
    _run_command(commands)
    _eval_command(commands)
    _sweep_command(commands)
    _surrogate_command(commands)
    _compare_command(commands)
    _export_command(commands)
    _listings_command(commands)
    return parser


def _run_command(commands: Any) -> None:
    """`compress run`: a recipe, its overrides, and how the run treats an earlier one."""
    run = commands.add_parser("run", help="run a YAML recipe")
    run.add_argument("recipe", help="path to the recipe (YAML)")
    run.add_argument("--output", help="output folder (overrides the recipe's output)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, dotted (e.g. --set sparsity=0.3 --set pipeline.0.strategy=pca)",
    )
    run.add_argument(
        "--threads",
        type=_positive_int,
        help="torch's CPU threads (the recipe's `threads`; default: the CPUs this process is given)",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the recipe, a local model's config.json, the data (local text is tokenised to "
        "count its windows; otherwise its first record) and the output, and stop; loads no weights",
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the output folder of a previous run (a folder holding files no run wrote is "
        "refused even then: a run never deletes what it did not write)",
    )
    run.add_argument(
        "--skip-memory-check",
        action="store_true",
        help="run even where the memory plan (printed by --dry-run) is above this machine's memory",
    )
    run.add_argument(
        "--restart",
        action="store_true",
        help="discard the checkpoint of an interrupted run to the same output and start afresh",
    )


def _eval_command(commands: Any) -> None:
    """`compress eval`: a run folder or any model against a reference, on text, tasks and speed."""
    evaluate = commands.add_parser(
        "eval", help="perplexity, KL to a reference, lm-eval tasks and throughput of a run folder or any model"
    )
    evaluate.add_argument(
        "target",
        help="a run folder (its model/, reference model and evaluation data by default), a model folder or a hub id",
    )
    evaluate.add_argument(
        "--reference", help="reference model for KL(reference ‖ target) (default for a run: its original)"
    )
    evaluate.add_argument(
        "--data", help="evaluation text, JSON lines (default for a run: its recipe's evaluation data)"
    )
    evaluate.add_argument("--text-field", help="field of each JSON line holding the text (default: text)")
    evaluate.add_argument("--num-samples", type=int, help="evaluation windows (default: the run's, else 64)")
    evaluate.add_argument("--seq-len", type=int, help="tokens per window (default: the run's, else 512)")
    evaluate.add_argument("--batch-size", type=int, help="windows per batch (default: the run's, else 8)")
    evaluate.add_argument("--dtype", help="dtype to load the models in (default: the run's, else float32)")
    evaluate.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    evaluate.add_argument(
        "--threads", type=_positive_int, help="torch's CPU threads (default: the CPUs this process is given)"
    )
    evaluate.add_argument(
        "--tasks",
        help="lm-eval tasks, comma-separated: registry names or task YAML files "
        "(default for a run: its recipe's evaluation.lm_eval)",
    )
    evaluate.add_argument("--include-path", help="a folder of local lm-eval task YAMLs")
    evaluate.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own)")
    evaluate.add_argument("--limit", type=float, help="at most this many documents per task (below 1: a fraction)")
    evaluate.add_argument("--task-batch-size", type=int, default=8, help="lm-eval batch size (default 8)")
    evaluate.add_argument(
        "--apply-chat-template", action="store_true", help="format lm-eval prompts with the chat template"
    )
    evaluate.add_argument(
        "--throughput",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure prefill and decode tokens/s, batch 1 and 8 (default: a run's own evaluation.throughput, else on)",
    )
    evaluate.add_argument("--output", help="also write the report to this JSON file")


def _sweep_command(commands: Any) -> None:
    """`compress sweep`: a grid of runs sharing their work."""
    sweep = commands.add_parser(
        "sweep", help="run a grid of recipes sharing H, data and the dense model's scores; tables and plots"
    )
    sweep.add_argument("sweep", help="path to the sweep file (YAML: base, output, grid, set, save_models)")
    sweep.add_argument(
        "--dry-run", action="store_true", help="check the sweep and every run's recipe, list the runs, stop"
    )
    sweep.add_argument(
        "--restart",
        action="store_true",
        help="discard what an earlier run of this sweep finished or kept, and start afresh",
    )


def _surrogate_command(commands: Any) -> None:
    """`compress surrogate`: the paper's Figure 2a at one site."""
    surrogate = commands.add_parser(
        "surrogate", help="does H predict the output KL of removing a direction? (the paper's Figure 2a, at one site)"
    )
    surrogate.add_argument("recipe", help="path to the recipe (YAML): its model, calibration and evaluation data")
    surrogate.add_argument(
        "--site", required=True, help="site id, e.g. layers.2.attn (embedding, layers.N.attn, layers.N.mlp)"
    )
    surrogate.add_argument(
        "--directions",
        type=int,
        default=32,
        help="random directions (default 32; 24 eigen-directions of C, H and τC+H/τ are added)",
    )
    surrogate.add_argument("--output", required=True, help="folder for surrogate.json and surrogate.png")
    surrogate.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key (e.g. --set evaluation.num_samples=16: fewer windows, faster)",
    )


def _compare_command(commands: Any) -> None:
    """`compress compare`: finished runs side by side."""
    compare = commands.add_parser("compare", help="tabulate finished run folders side by side")
    compare.add_argument("runs", nargs="+", help="run folders (each holds report.json)")
    compare.add_argument("--output", help="also write the table to this file (.md, .csv or .json)")


def _export_command(commands: Any) -> None:
    """`compress export`: a saved model as GGUF through llama.cpp's own tools."""
    from compressor.commands.gguf import OUTTYPES, QUANT_TYPES  # stdlib only: `compress --help` stays cheap

    export = commands.add_parser(
        "export", help="a run's stock model as one GGUF file for llama.cpp (its converter; quantized if asked)"
    )
    export.add_argument(
        "source", help="a run folder (its model/) or a model folder, of a global or heterogeneous layout"
    )
    export.add_argument("--gguf", required=True, help="the .gguf file to write")
    export.add_argument(
        "--converter", help="llama.cpp's convert_hf_to_gguf.py (default: $GGUF_CONVERTER; docs/serving.md)"
    )
    export.add_argument("--outtype", default="f16", choices=OUTTYPES, help="the converter's type")
    export.add_argument("--quantize", choices=QUANT_TYPES, help="then quantize with llama.cpp's quantizer")
    export.add_argument(
        "--quantizer", help="llama.cpp's llama-quantize binary (default: the llama-cpp-python library's quantizer)"
    )
    export.add_argument(
        "--pre-tokenizer",
        default="auto",
        help="llama.cpp's pre-tokenizer name, written only where the converter does not know the tokenizer "
        "(auto: inferred from tokenizer.json; none: never)",
    )
    export.add_argument("--overwrite", action="store_true", help="replace an existing --gguf file")
    export.add_argument("--threads", type=_positive_int, help="the quantizer's threads (default: the CPUs given)")


def _listings_command(commands: Any) -> None:
    """`compress schema`, `strategies` and `families`: what is registered."""
    schema = commands.add_parser(
        "schema", help="print the JSON schema of a recipe (for editors), with the options of every loaded strategy"
    )
    schema.add_argument("--output", help="write it to this .json file instead")
    commands.add_parser("strategies", help="list the registered selection strategies")
    commands.add_parser("families", help="list the supported model families (by model_type)")
