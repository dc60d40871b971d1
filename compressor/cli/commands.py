"""One handler per `compress` command: each reads its arguments, calls the room that does the
work (`run.runner`, `plan.preflight`, `commands.*`, the plugin registry) and shows the result.
rich and everything heavier are imported inside the handlers, so Ctrl-C while they load is one
line too."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compressor.cli.display import note_skipped, print_table, progress_display, write_output
from compressor.cli.interrupts import ended_by_interrupt, interrupt_line
from compressor.errors import UserError

if TYPE_CHECKING:
    from rich.console import Console


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
    from compressor.runtime.staging import CHECKPOINT_FOLDER, staging_folder

    if args.dry_run:
        _dry_run(args, recipe, registry, console)
        return
    from compressor.engine import parallel

    rank = int(os.environ.get("RANK", "0"))
    _before_the_run(args, recipe, console, rank)
    try:
        report = _run_on_this_rank(args, recipe, registry, console, rank)
    except BaseException as error:
        if not ended_by_interrupt(error):
            raise
        kept = (staging_folder(Path(recipe.output)) / CHECKPOINT_FOLDER).is_dir()
        raise interrupt_line(
            error, "progress is kept: run the same command to continue, or add --restart" if kept else None
        ) from None
    finally:
        parallel.stop()
    if report is None:  # a data-parallel run's other ranks: rank 0 shows and writes
        return
    _show_report(report, console)
    console.print(f"wrote {recipe.output}")


def _before_the_run(args: argparse.Namespace, recipe: Any, console: Console, rank: int) -> None:
    """A changed recipe refused before "resuming" is said; the threads; an interrupted run's
    progress said before the work, not after it (rank 0 speaks)."""
    from compressor.runtime.resume import check_interrupted, progress_summary

    if rank == 0:
        check_interrupted(Path(recipe.output), recipe, args.restart)
    _set_threads(console, recipe.threads, say=rank == 0)
    resumable = None if args.restart or rank > 0 else progress_summary(Path(recipe.output))
    if resumable is not None:
        console.print(f"resuming an interrupted run: {resumable}", markup=False, highlight=False, soft_wrap=True)


def _run_on_this_rank(args: argparse.Namespace, recipe: Any, registry: Any, console: Console, rank: int) -> Any:
    """The run, with a live display and warnings on rank 0; its report (None on the other ranks)."""
    from compressor.run.runner import RunOptions, run

    if rank > 0:
        run(
            recipe,
            registry,
            None,
            overwrite=args.overwrite,
            restart=args.restart,
            options=RunOptions(memory_check=not args.skip_memory_check),
        )
        return None

    def warn(text: str) -> None:
        console.print(f"warning: {text}", markup=False, highlight=False, soft_wrap=True)

    def estimated(plan: Any) -> None:
        console.print(plan.line(), markup=False, highlight=False, soft_wrap=True)

    with progress_display(console) as progress:
        return run(
            recipe,
            registry,
            progress,
            overwrite=args.overwrite,
            restart=args.restart,
            options=RunOptions(warn=warn, memory_check=not args.skip_memory_check, estimate=estimated),
        )


def _dry_run(args: argparse.Namespace, recipe: Any, registry: Any, console: Console) -> None:
    """`compress run --dry-run`: every check a run makes before loading weights, said line by line;
    a refusal is the command's one error line after them."""
    from compressor.plan.preflight import dry_run
    from compressor.reports.report import budget_label

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


def _show_report(report: Any, console: Console) -> None:
    """A finished run's table, and its time against the estimate made before it started."""
    from compressor.reports.report import rich_table

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
    with progress_display(console) as progress:
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
    print_table(console, f"{report.target}{windows}", ("", "reference", "target"), rows)
    if output is not None:
        write_output(console, output, to_json(report))


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
        with progress_display(console) as progress:
            summary = run_sweep(sweep, registry, progress, restart=args.restart)
    except BaseException as error:
        if not ended_by_interrupt(error):
            raise
        raise interrupt_line(error, "finished runs and H are kept: run the same command to continue") from None
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
    with progress_display(console) as progress:
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
        print_table(console, "runs", names, [tuple(cell(c, row.get(c)) for c in names) for row in table])
        for line in warnings:
            console.print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)
    else:  # a pipe or a log: the Markdown table, whole lines that nothing folds or cuts
        console.print(render(table, ".md", warnings), end="", markup=False, highlight=False, soft_wrap=True)
    if output is not None:
        write_output(console, output, render(table, output.suffix, warnings))


def _export(args: argparse.Namespace, console: Console) -> None:
    from compressor.commands.gguf import ALIGNED_WIDTH, GgufSettings, export_gguf, wider_line
    from compressor.runtime.threads import available_cpus

    def starting(model: Path) -> None:
        said = f"converting {model} with llama.cpp's converter ({args.outtype})"
        console.print(said, markup=False, highlight=False, soft_wrap=True)

    settings = GgufSettings(
        converter=Path(args.converter) if args.converter else None,
        outtype=args.outtype,
        quantize_to=args.quantize,
        quantizer=Path(args.quantizer) if args.quantizer else None,
        pre_tokenizer=args.pre_tokenizer,
        threads=args.threads or available_cpus(),
    )
    exported = export_gguf(Path(args.source), Path(args.gguf), settings, overwrite=args.overwrite, starting=starting)
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
    write_output(console, output, text)


def _strategies(args: argparse.Namespace, console: Console) -> None:
    from compressor.strategies.registry import PluginRegistry

    registry = PluginRegistry()
    rows = [(name, e.plugin, e.source, e.item.description) for name, e in registry.strategies().items()]
    print_table(console, "registered strategies", ("name", "plugin", "from", "description"), rows)
    for kind in registry.selector_kinds():
        selectors = [(name, e.plugin, e.source, e.item.description) for name, e in registry.entries(kind).items()]
        if selectors:
            print_table(console, kind.title, ("name", "plugin", "from", "description"), selectors)
    note_skipped(console, registry)


def _families(args: argparse.Namespace, console: Console) -> None:
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
            ", ".join(axis.key for axis in family_axes(e.item, model_type, registry.axes())),
            ", ".join(axis.key for axis in stock_axes(e.item, model_type, registry.axes())) or "none",
            e.plugin,
            e.source,
        )
        for model_type, e in registry.families().items()
    ]
    columns = ("model_type", "family", "layouts", "axes", "stock axes", "plugin", "from")
    print_table(console, "supported model families", columns, rows)
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
    print_table(console, "vision-language checkpoints (text tower)", ("model_type", "projector", "saved whole"), towers)
    note_skipped(console, registry)


COMMANDS: dict[str, Any] = {
    "run": _run,
    "families": _families,
    "compare": _compare,
    "eval": _eval,
    "sweep": _sweep,
    "surrogate": _surrogate,
    "schema": _schema,
    "export": _export,
    "strategies": _strategies,
}
"""Each command's handler, `handler(args, console)`."""
