"""`compress`: run recipes, compare runs, list strategies and families. User errors print one line
and exit 2."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compressor.errors import Interrupts, UserError, first_line

if TYPE_CHECKING:  # rich is imported inside main's handlers, so Ctrl-C while it loads is one line too
    from rich.console import Console

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
"""128 + SIGINT, as a shell reports a command Ctrl-C stopped."""


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so usage errors look like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


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


def _parser() -> argparse.ArgumentParser:
    from compressor.commands.gguf import OUTTYPES, QUANT_TYPES  # stdlib only: `compress --help` stays cheap

    parser = _Parser(prog="compress", description="Residual-stream pruning of HF language models.")
    parser.add_argument("--version", action=_VersionAction, nargs=0, help="show the versions and exit")
    commands = parser.add_subparsers(dest="command", required=True)
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
    compare = commands.add_parser("compare", help="tabulate finished run folders side by side")
    compare.add_argument("runs", nargs="+", help="run folders (each holds report.json)")
    compare.add_argument("--output", help="also write the table to this file (.md, .csv or .json)")
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
    schema = commands.add_parser(
        "schema", help="print the JSON schema of a recipe (for editors), with the options of every loaded strategy"
    )
    schema.add_argument("--output", help="write it to this .json file instead")
    commands.add_parser("strategies", help="list the registered selection strategies")
    commands.add_parser("families", help="list the supported model families (by model_type)")
    return parser


def _set_threads(console: Console, requested: int | None, say: bool = True) -> None:
    """torch's CPU threads for this command (`runtime.threads.command_threads`), and where other work
    lowered them, the warning that says so (`say`: this process speaks; a data-parallel rank 0)."""
    from compressor.runtime.threads import command_threads

    _, lowered = command_threads(requested)
    if lowered is not None and say:
        console.print(f"warning: {lowered}", markup=False, highlight=False, soft_wrap=True)


def _quiet_libraries() -> None:
    """Our rich display reports progress; the libraries' own bars would interleave with it."""
    import datasets
    import huggingface_hub
    import transformers

    huggingface_hub.utils.logging.set_verbosity_error()  # no retry chatter before our one-line error
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _run(args: argparse.Namespace, console: Console) -> None:
    from compressor.recipe.schema import load_recipe
    from compressor.strategies.registry import PluginRegistry

    registry = PluginRegistry()
    overrides = args.overrides + ([f"threads={args.threads}"] if args.threads is not None else [])
    recipe = load_recipe(Path(args.recipe), registry, overrides, args.output)  # before the heavy imports
    _quiet_libraries()
    from compressor.reports.report import budget_label, rich_table
    from compressor.run.runner import run
    from compressor.runtime.staging import CHECKPOINT_FOLDER, staging_folder

    if args.dry_run:
        from compressor.plan.preflight import dry_run

        found = dry_run(recipe, registry, args.overwrite, args.restart, not args.skip_memory_check)
        headline = (
            "recipe checked, but the run would stop here"
            if found.refusal
            else ("recipe OK as far as it could be checked" if len(found.unchecked) > 1 else "recipe OK")
        )
        console.print(
            f"{headline}: {args.recipe} -> {recipe.output} "
            f"({' + '.join(s.strategy for s in recipe.pipeline)}"
            f"{', refined on KL' if recipe.refinement else ''}"
            f"{', distilled (' + recipe.distillation.method + ')' if recipe.distillation else ''}, "
            f"{budget_label(recipe.sparsity, recipe.target_params, recipe.target_active_params)}"
            f"{'' if recipe.allocation.method == 'uniform' else ', ' + recipe.allocation.method + ' widths'})"
            + "".join(f"\n  {line}" for line in found.lines()),
            soft_wrap=True,
            markup=False,
            highlight=False,
        )
        if found.refusal:
            raise UserError(found.refusal)
        return
    from compressor.engine import parallel
    from compressor.runtime.resume import check_interrupted, progress_summary

    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:  # a changed recipe is refused before "resuming" is said
        check_interrupted(Path(recipe.output), recipe, args.restart)
    _set_threads(console, recipe.threads, say=rank == 0)
    resumable = None if args.restart or rank > 0 else progress_summary(Path(recipe.output))
    if resumable is not None:  # said before the work, not after it
        console.print(f"resuming an interrupted run: {resumable}", markup=False, highlight=False, soft_wrap=True)
    try:
        if rank > 0:  # a data-parallel run's other ranks: rank 0 shows and writes
            run(
                recipe,
                registry,
                None,
                overwrite=args.overwrite,
                restart=args.restart,
                memory_check=not args.skip_memory_check,
            )
            return

        def warn(text: str) -> None:
            console.print(f"warning: {text}", markup=False, highlight=False, soft_wrap=True)

        def estimated(plan: Any) -> None:
            console.print(plan.line(), markup=False, highlight=False, soft_wrap=True)

        with _progress_display(console) as progress:
            report = run(
                recipe,
                registry,
                progress,
                overwrite=args.overwrite,
                restart=args.restart,
                warn=warn,
                memory_check=not args.skip_memory_check,
                estimate=estimated,
            )
    except BaseException as error:
        if not _ended_by_interrupt(error):
            raise
        kept = (staging_folder(Path(recipe.output)) / CHECKPOINT_FOLDER).is_dir()
        raise _interrupt(
            error, "progress is kept: run the same command to continue, or add --restart" if kept else None
        ) from None
    finally:
        parallel.stop()
    assert report is not None  # rank 0 writes the report
    if report.resumed_from or report.resume.sites_loaded:
        console.print(f"resumed: {report.resume.sites_loaded} finished site(s) loaded from the checkpoint")
    console.print(rich_table(report))
    if report.estimate is not None:
        from compressor.stages.costs import duration

        took = report.timings.get("total_s", 0.0)
        console.print(
            f"took {duration(took)}; estimated {duration(report.estimate.total_s)} before it started "
            f"(report.json: timings, estimate)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    console.print(f"wrote {recipe.output}")


def phase_logger(console: Console, label: str = "", every_s: float = 60.0) -> Callable[[str, int, int], None]:
    """A progress callback that logs each phase once (not every batch), timestamped, so a log
    file stays short; `label` prefixes every line (e.g. which run of a sweep). A phase that lasts
    longer than `every_s` (an optimiser's steps at one site) logs how far it is, with the time left."""
    import time

    state: dict[str, Any] = {"phase": None, "since": 0.0, "logged": 0.0}

    def log(text: str) -> None:
        console.log(f"{label}: {text}" if label else text, markup=False, highlight=False)

    def log_phase(phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if state["phase"] != phase:
            state.update(phase=phase, since=now, logged=now)
            log(phase)
        elif total and 0 < done < total and now - state["logged"] >= every_s:
            state["logged"] = now
            log(f"{phase}: {done}/{total}, about {_duration((now - state['since']) * (total - done) / done)} left")

    return log_phase


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes}:{seconds:02d}"


@contextmanager
def _progress_display(console: Console) -> Iterator[Callable[[str, int, int], None]]:
    """A live bar with the time a phase has taken and an estimate of what it has left, on a
    terminal; elsewhere (a log file, CI) one timestamped line per phase (and, in a long phase,
    one a minute), so a log stays short (a live display there would only leave a blank line)."""
    if not console.is_terminal:
        yield phase_logger(console)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)
        shown = {"phase": "starting"}

        def update(phase: str, done: int, total: int) -> None:
            if phase != shown["phase"]:  # a new phase: its rate, so its time left, starts afresh
                shown["phase"] = phase
                bar.reset(task, description=phase, completed=done, total=total)
            else:
                bar.update(task, completed=done, total=total)

        yield update


def _print_table(console: Console, title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A listing whose cells are plain text (no rich markup) and fold rather than truncate."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    console.print(table)


def _eval(args: argparse.Namespace, console: Console) -> None:

    from compressor.commands.eval_command import EvalRequest, evaluate_target
    from compressor.reports.report import speed_rows, task_rows
    from compressor.reports.report_model import to_json

    _quiet_libraries()
    _set_threads(console, args.threads)
    output = Path(args.output) if args.output else None
    if output is not None and output.suffix != ".json":
        raise UserError(f"--output must be a .json file, got '{output.name}'")
    request = EvalRequest(
        target=args.target,
        reference=args.reference,
        data=args.data,
        text_field=args.text_field,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        dtype=args.dtype,
        device=args.device,
        tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()) if args.tasks else (),
        include_path=args.include_path,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        task_batch_size=args.task_batch_size,
        apply_chat_template=args.apply_chat_template,
        throughput=args.throughput,
        threads=args.threads,
    )
    with _progress_display(console) as progress:
        report = evaluate_target(request, progress)
    metrics, pruned = report.metrics, report.metrics.pruned
    rows = speed_rows(report.size, report.speed)
    if pruned is not None and pruned.ppl is not None:
        baseline = metrics.baseline
        rows.append(
            (
                "perplexity",
                f"{baseline.ppl:.3f}" if baseline is not None and baseline.ppl is not None else "",
                f"{pruned.ppl:.3f}",
            )
        )
    if pruned is not None and pruned.kl is not None:
        rows.append(("KL to reference (nats/token)", "0", f"{pruned.kl:.5f}"))
    rows += task_rows(metrics)
    if metrics.tokens is not None:
        rows.append(("tokens", "", f"{metrics.tokens.count:,}"))
    windows = f" on {report.evaluation['num_samples']} windows" if report.evaluation else ""
    _print_table(console, f"{report.target}{windows}", ("", "reference", "target"), rows)
    if output is not None:
        _write_output(console, output, to_json(report))


def _sweep(args: argparse.Namespace, console: Console) -> None:
    from compressor.commands.compare import render
    from compressor.commands.sweep import check, dump, load_sweep, run_sweep
    from compressor.strategies.registry import PluginRegistry

    _quiet_libraries()
    registry = PluginRegistry()
    sweep = load_sweep(Path(args.sweep), registry)
    if args.dry_run:
        check(sweep, registry)
        console.print(
            f"sweep OK: {args.sweep} -> {sweep.output} ({len(sweep.points)} runs)\n{dump(sweep)}",
            end="",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return
    _set_threads(console, None)  # once: the sweep's runs are timed alike (a base recipe's threads apply)
    try:
        with _progress_display(console) as progress:
            summary = run_sweep(sweep, registry, progress, restart=args.restart)
    except BaseException as error:
        if not _ended_by_interrupt(error):
            raise
        raise _interrupt(error, "finished runs and H are kept: run the same command to continue") from None
    console.print(
        render(summary["table"], ".md", summary["warnings"]), end="", markup=False, highlight=False, soft_wrap=True
    )
    kept = summary["runs"] - len(summary["ran"])
    console.print(
        f"ran {len(summary['ran'])} of {summary['runs']} runs"
        + (f" ({kept} had finished earlier)" if kept else "")
        + f"; H computed {summary['fisher_computed']} time(s)",
        markup=False,
        highlight=False,
    )
    console.print(
        f"wrote {sweep.output}: results.csv, results.json, results.md, "
        f"{', '.join(Path(p).name for p in summary['plots'])}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def _surrogate(args: argparse.Namespace, console: Console) -> None:
    from compressor.commands.surrogate import check_recipe
    from compressor.recipe.schema import load_recipe
    from compressor.strategies.registry import PluginRegistry

    _quiet_libraries()
    registry = PluginRegistry()
    recipe = load_recipe(Path(args.recipe), registry, args.overrides)
    with _progress_display(console) as progress:
        result = check_recipe(recipe, registry, args.site, args.directions, Path(args.output), progress)

    def rho(key: str) -> str:
        return "n/a" if result[key] is None else f"{result[key]:.3f}"

    console.print(
        f"{args.site}: Spearman ρ(predicted, measured KL) = {rho('spearman')} over {len(result['rows'])} "
        f"directions at equal removed energy (random directions only: {rho('spearman_random')}; "
        f"activation variance alone, random directions: {rho('spearman_variance_random')})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    console.print(f"wrote {Path(args.output) / 'surrogate.json'} and surrogate.png", markup=False, highlight=False)


def _compare(args: argparse.Namespace, console: Console) -> None:
    from compressor.commands.compare import FORMATS, cell, columns, compare_runs, render

    output = Path(args.output) if args.output else None
    if output is not None and output.suffix not in FORMATS:
        raise UserError(f"--output must end in {', '.join(FORMATS)}, got '{output.name}'")
    table, warnings = compare_runs([Path(run) for run in args.runs])
    if console.is_terminal:
        names = tuple(columns(table))
        _print_table(console, "runs", names, [tuple(cell(c, row.get(c)) for c in names) for row in table])
        for line in warnings:
            console.print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)
    else:  # a pipe or a log: the Markdown table, whole lines that nothing folds or cuts
        console.print(render(table, ".md", warnings), end="", markup=False, highlight=False, soft_wrap=True)
    if output is not None:
        _write_output(console, output, render(table, output.suffix, warnings))


def _write_output(console: Console, output: Path, text: str) -> None:
    """Write a command's --output file; a path that cannot be written is a one-line user error."""
    try:
        output.write_text(text)
    except OSError as error:
        raise UserError(f"cannot write {output}: {error.strerror or error}") from None
    console.print(f"wrote {output}", markup=False, highlight=False)


def _export(args: argparse.Namespace, console: Console) -> None:
    from compressor.commands.gguf import ALIGNED_WIDTH, export_gguf, wider_line
    from compressor.runtime.threads import available_cpus

    def starting(model: Path) -> None:
        said = f"converting {model} with llama.cpp's converter ({args.outtype})"
        console.print(said, markup=False, highlight=False, soft_wrap=True)

    exported = export_gguf(
        Path(args.source),
        Path(args.gguf),
        converter=Path(args.converter) if args.converter else None,
        outtype=args.outtype,
        quantize_to=args.quantize,
        quantizer=Path(args.quantizer) if args.quantizer else None,
        pre_tokenizer=args.pre_tokenizer,
        overwrite=args.overwrite,
        threads=args.threads or available_cpus(),
        starting=starting,
    )
    what = exported.outtype + (f", quantized to {exported.quantized}" if exported.quantized else "")
    named = f"; pre-tokenizer {exported.pre_tokenizer} named from tokenizer.json" if exported.pre_tokenizer else ""
    if exported.fallbacks is not None and exported.quantized is not None:
        named += "; " + wider_line(exported.fallbacks, exported.off_block, exported.quantized)
    rounded = any(o.fix == "slicing.round_to" for o in exported.off_block)  # to 32 or 256: multiples of 16
    if exported.misaligned_width is not None and not rounded:
        named += (
            f"; hidden size {exported.misaligned_width} is not a multiple of {ALIGNED_WIDTH}, where llama.cpp's "
            f"float32 prefill ran up to 2.8x slower on an AVX-512 CPU (docs/benchmarks.md): prune with a "
            f"slicing.round_to that is a multiple of {ALIGNED_WIDTH}"
        )
    console.print(
        f"wrote {exported.path} ({exported.bytes / 2**20:.1f} MiB, {what}{named})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def _schema(args: argparse.Namespace, console: Console) -> None:
    import json

    from compressor.recipe.schema import recipe_schema
    from compressor.strategies.registry import PluginRegistry

    text = json.dumps(recipe_schema(PluginRegistry()), indent=2, ensure_ascii=False) + "\n"
    if args.output is None:
        console.print(text, end="", markup=False, highlight=False, soft_wrap=True)
        return
    output = Path(args.output)
    if output.suffix != ".json":
        raise UserError(f"--output must be a .json file, got '{output.name}'")
    _write_output(console, output, text)


def _strategies(console: Console) -> None:
    from compressor.strategies.registry import PluginRegistry

    registry = PluginRegistry()
    rows = [(name, e.plugin, e.source, e.item.description) for name, e in registry.strategies().items()]
    _print_table(console, "registered strategies", ("name", "plugin", "from", "description"), rows)
    selectors = [(name, e.plugin, e.source, e.item.description) for name, e in registry.selectors().items()]
    if selectors:
        _print_table(console, "MLP neuron selectors", ("name", "plugin", "from", "description"), selectors)
    experts = [(name, e.plugin, e.source, e.item.description) for name, e in registry.expert_selectors().items()]
    if experts:
        _print_table(console, "MoE expert selectors", ("name", "plugin", "from", "description"), experts)
    blocks = [(name, e.plugin, e.source, e.item.description) for name, e in registry.block_selectors().items()]
    if blocks:
        _print_table(console, "depth selectors", ("name", "plugin", "from", "description"), blocks)
    heads = [(name, e.plugin, e.source, e.item.description) for name, e in registry.head_selectors().items()]
    if heads:
        _print_table(console, "attention-head selectors", ("name", "plugin", "from", "description"), heads)
    _note_skipped(console, registry)


def _families(console: Console) -> None:
    from compressor.models.axes import family_axes, stock_axes
    from compressor.models.decilm import FAMILIES as DECILM_TYPES
    from compressor.models.towers import BUILTIN_TOWERS
    from compressor.strategies.registry import PluginRegistry

    registry = PluginRegistry()
    rows = [
        (
            model_type,
            e.item.name,
            ", ".join(e.item.layouts() + (("heterogeneous",) if model_type in DECILM_TYPES else ())),
            ", ".join(axis.key for axis in family_axes(e.item, model_type)),
            ", ".join(axis.key for axis in stock_axes(e.item, model_type)) or "none",
            e.plugin,
            e.source,
        )
        for model_type, e in registry.families().items()
    ]
    columns = ("model_type", "family", "layouts", "axes", "stock axes", "plugin", "from")
    _print_table(console, "supported model families", columns, rows)
    towers = [
        (
            ", ".join(t.model_types),
            t.projector,
            "layout: global, the text MLPs alone (" + t.keeps_stream.split(",")[0] + ")"
            if t.keeps_stream
            else "layout: global, with the axes the text family saves stock",
        )
        for t in BUILTIN_TOWERS
    ]
    _print_table(
        console, "vision-language checkpoints (text tower)", ("model_type", "projector", "saved whole"), towers
    )
    _note_skipped(console, registry)


def _note_skipped(console: Console, registry: Any) -> None:
    from compressor.strategies.registry import ALLOW_VARIABLE

    if registry.allowed is not None:
        skipped = registry.skipped()
        console.print(
            f"{ALLOW_VARIABLE}={','.join(registry.allowed)}: not loaded: {', '.join(skipped) or 'none'}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def _in_place_of_the_interrupt(error: BaseException) -> str:
    """What ended the command after Ctrl-C, in place of the KeyboardInterrupt (a library's stand-in
    for it, or a failure while stopping), named in the interrupt's line."""
    return f"then {type(error).__name__}: {first_line(error)}"


def _ended_by_interrupt(error: BaseException) -> bool:
    """Whether `error` ends the command as an interrupt: Ctrl-C itself, or anything after it."""
    return isinstance(error, KeyboardInterrupt) or Interrupts.seen


def _interrupt(error: BaseException, kept: str | None) -> KeyboardInterrupt:
    """The interrupt `main` reports in one line: what came in Ctrl-C's place, and what was `kept`."""
    said = [] if isinstance(error, KeyboardInterrupt) else [_in_place_of_the_interrupt(error)]
    return KeyboardInterrupt("; ".join([*said, *([kept] if kept else [])]))


@contextmanager
def _interrupts_remembered() -> Iterator[None]:
    """`Interrupts.on_signal` handles SIGINT for the command, where Python's own handler is in place
    (in the main thread, where signals arrive; a SIGINT the launcher ignores stays ignored)."""
    Interrupts.seen = False
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    signal.signal(signal.SIGINT, Interrupts.on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: Sequence[str] | None = None) -> int:
    with _interrupts_remembered():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    # Our display reports progress; tqdm reads this once, when it is first imported.
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        from rich.console import Console

        console = Console(stderr=False, log_path=False)
        parser = _parser()
        if not (sys.argv[1:] if argv is None else list(argv)):  # bare `compress`: what it can do, not an error
            parser.print_help()
            return 2
        args = parser.parse_args(argv)
        if args.command == "run":
            _run(args, console)
        elif args.command == "families":
            _families(console)
        elif args.command == "compare":
            _compare(args, console)
        elif args.command == "eval":
            _eval(args, console)
        elif args.command == "sweep":
            _sweep(args, console)
        elif args.command == "surrogate":
            _surrogate(args, console)
        elif args.command == "schema":
            _schema(args, console)
        elif args.command == "export":
            _export(args, console)
        else:
            _strategies(console)
    except KeyboardInterrupt as interrupt:
        sys.stderr.write(f"interrupted{'; ' + str(interrupt) if str(interrupt) else ''}\n")
        return EXIT_INTERRUPTED
    except Exception as error:
        if Interrupts.seen:  # what a library made of the interrupt, named
            sys.stderr.write(f"interrupted; {_in_place_of_the_interrupt(error)}\n")
            return EXIT_INTERRUPTED
        if isinstance(error, (UserError, _UsageError)):
            sys.stderr.write(f"error: {error}\n")
            return EXIT_USER_ERROR
        if not isinstance(error, OSError) or error.errno != errno.ENAMETOOLONG:
            raise
        name = str(error.filename or "")
        sys.stderr.write(
            f"error: a path is longer than the file system allows ({len(name):,} characters: {name[:60]}…); "
            f"give a shorter model, output or recipe path\n"
        )
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
