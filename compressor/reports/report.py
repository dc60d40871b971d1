"""Human-readable views of a run report: the rows of the before/after table, as Markdown
(written next to report.json) or as a rich table (printed at the end of a run)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from compressor.engine.experts import ExpertRecord
from compressor.engine.refine import RefinementRecord
from compressor.evaluation.throughput import rate_range, rounds, speedup_bounds, under_load
from compressor.reports.guard import GuardRecord
from compressor.reports.report_model import DecodeBudget, Metrics, MlpReport, RunReport, Sizes, SplitRecord
from compressor.training.distill import DistillationRecord


def summary_rows(report: RunReport) -> list[tuple[str, str, str]]:
    """(quantity, baseline, pruned) rows shared by the Markdown and terminal tables."""
    params = report.params
    rows = [
        ("parameters", f"{params.baseline:,}", f"{params.pruned:,} ({params.ratio:.1%})"),
        *transition_rows(report),
        *active_rows(report),
        *decode_rows(report),
        ("hidden width", str(report.model.hidden_size), kept_label(report)),
        *depth_rows(report),
        *heads_rows(report),
        *mlp_rows(report),
        *expert_rows(report),
    ]
    rows += speed_rows(report.size, report.speed)
    metrics = report.metrics
    if metrics.baseline is not None and metrics.pruned is not None and metrics.pruned.kl is not None:
        rows.append(("perplexity", f"{metrics.baseline.ppl:.3f}", f"{metrics.pruned.ppl:.3f}"))
        rows.append(("KL to original (nats/token)", "0", f"{metrics.pruned.kl:.5f}"))
        if metrics.unrefined is not None:
            rows.append(("KL before refinement", "", f"{metrics.unrefined.kl:.5f}"))
        if metrics.undistilled is not None:
            rows.append(("perplexity before distillation", "", f"{metrics.undistilled.ppl:.3f}"))
            rows.append(("KL before distillation", "", f"{metrics.undistilled.kl:.5f}"))
    rows += task_rows(metrics)
    rows += refinement_rows(report.refinement)
    rows += guard_rows(report.guards, "refinement")
    rows += distillation_rows(report.distillation)
    rows += timing_rows(report.timings, report.fisher_autocast)
    environment = report.environment
    if environment.device == "cpu" and environment.threads is not None:
        rows.append(("CPU threads (torch)", "", str(environment.threads)))
    return rows


def decode_rows(report: RunReport) -> list[tuple[str, str, str]]:
    """`target_decode`: the target, what the search gave the candidates, and the saved model's own timing."""
    decode = report.decode
    if decode is None:
        return []
    rows = [("  decode time per token (target_decode)", "1", f"at most {decode.target:g}: {decode_summary(decode)}")]
    speedup = (report.speed or {}).get("speedup", {}).get("1", {}).get("decode")
    if speedup:
        rows.append(("  decode time per token, the saved model (evaluation, batch 1)", "1", f"{1 / speedup:.2f}"))
    return rows


def decode_summary(decode: DecodeBudget) -> str:
    """`4 candidates at 52.9–62.5% of the parameters, measured 0.66–0.70`."""
    budgets = [candidate.target_params for candidate in decode.candidates]
    ratios = [candidate.ratio for candidate in decode.candidates]
    count = len(budgets)
    return (
        f"{count} candidate{'s' if count > 1 else ''} at {_span(budgets, '.1%')} of the parameters, "
        f"measured {_span(ratios, '.2f')}"
    )


def _span(values: list[float], spec: str) -> str:
    low, high = format(min(values), spec), format(max(values), spec)
    return low if low == high else f"{low}–{high}"


def active_rows(report: RunReport) -> list[tuple[str, str, str]]:
    """The parameters one token uses, under the total (a model with routed experts)."""
    active = report.active_params
    if active is None:
        return []
    return [("  parameters per token (active)", f"{active.baseline:,}", f"{active.pruned:,} ({active.ratio:.1%})")]


def transition_rows(report: RunReport) -> list[tuple[str, str, str]]:
    """The residual transitions' share of the pruned parameter count, labelled as parameters and
    placed under them (not under the hidden width, which it is no part of)."""
    transitions = report.allocation.transition_params
    if not transitions:
        return []
    tied = report.slicing.tie_head
    label = "  of which residual transitions" + (" and the tied head's map" if tied else "") + " (parameters)"
    return [(label, "", f"{transitions:,}")]


def mlp_rows(report: RunReport) -> list[tuple[str, str, str]]:
    """The MLP's width (`mlp`), with the selector and the mean output error it left per layer."""
    if report.mlp is None:
        return []
    mlp = report.mlp
    narrowed = [r for r in mlp.layers if r.kept < r.width]
    errors = [r.error_refit if r.error_refit is not None else r.error_dropped for r in narrowed]
    how = f"{mlp.selector}{' weighed by H' if mlp.weighed_by_h else ''}, {f'refitted, feedback {mlp.feedback:g}' if mlp.refit else 'not refitted'}"
    experts = any(layer.experts for layer in mlp.layers)
    label = "MLP width (each routed expert)" if experts else "MLP width"
    kept = str(mlp.kept) if mlp.widths is None else "per layer " + ", ".join(str(w) for w in mlp.widths)
    rows = [(label, str(mlp.of), f"{kept} ({how})" if narrowed else f"{kept} (all kept)")]
    rows += _allocation_rows(mlp)
    if errors:
        rows.append(("  MLP output error, mean over layers", "", f"{sum(errors) / len(errors):.4f}"))
    rebuilt = [r.reconstruction for r in mlp.layers if r.reconstruction is not None]
    if rebuilt:
        before = sum(r.heldout_before for r in rebuilt) / len(rebuilt)
        after = sum(r.heldout_after for r in rebuilt) / len(rebuilt)
        weighed = "weighed by H, " if rebuilt[0].weighed_by_h else ""
        rows.append(
            (
                "  mlp.reconstruct (held-out error, mean over layers)",
                "",
                f"{before:.4f} → {after:.4f} ({weighed}{rebuilt[0].steps} steps, {rebuilt[0].heldout_tokens:,} tokens held out)",
            )
        )
    fewest = [layer.fewest_tokens for layer in narrowed if layer.fewest_tokens is not None]
    if experts and fewest:
        rows.append(("  fewest calibration tokens an expert's neurons were chosen on", "", f"{min(fewest):,}"))
    shared = [layer.shared_expert for layer in mlp.layers if layer.shared_expert is not None]
    if mlp.shared_kept is not None and shared:
        rows.append(("Shared expert width", str(mlp.shared_of), f"{mlp.shared_kept} ({how})"))
        errors = [r.error_refit if r.error_refit is not None else r.error_dropped for r in shared]
        rows.append(("  shared expert output error, mean over layers", "", f"{sum(errors) / len(errors):.4f}"))
    return rows + split_rows(mlp.split)


def _allocation_rows(mlp: MlpReport) -> list[tuple[str, str, str]]:
    """The heterogeneous layout's allocation: the neurons given, what `mlp.search` measured, the
    attentions removed and the KV heads merged."""
    rows: list[tuple[str, str, str]] = []
    if mlp.widths is not None:
        total = mlp.kept * len(mlp.widths)
        freed = len(mlp.attention_removed or []) * (mlp.attention_units or 0)
        given = f" and {freed:,} from removed attention" if freed else ""
        merged = [kv for kv in mlp.kv_heads or [] if kv in (mlp.kv_units or {})]  # fewer than the model's
        from_kv = sum((mlp.attention_units or 0) - (mlp.kv_units or {})[kv] for kv in merged)
        given += f" and {from_kv:,} from merged KV heads" if from_kv else ""
        rows.append(("  neurons allocated (heterogeneous)", "", f"{sum(mlp.widths):,} of the uniform {total:,}{given}"))
    if mlp.search is not None:
        found = mlp.search
        moved = (
            "moved from the predicted allocation" if found.predicted != mlp.widths else "kept the predicted allocation"
        )
        rows.append(
            (
                "  mlp.search (allocations measured)",
                "",
                f"{found.measured} on {found.windows} windows, {moved}: KL {found.predicted_kl:.4g} → {found.kl:.4g} "
                "(each MLP as its curve's solution)",
            )
        )
    if mlp.attention_removed is not None:
        gone = ", ".join(map(str, mlp.attention_removed)) or "none"
        each = f"each counted as {mlp.attention_units} neurons"
        rows.append(("  attention removed in layers", "", f"{gone} ({each})"))
    if mlp.kv_heads is not None:
        counted = ", ".join(f"{kv}: {units}" for kv, units in sorted((mlp.kv_units or {}).items()))
        heads = ", ".join(map(str, mlp.kv_heads))
        rows.append(("  KV heads per layer (merged)", "", f"{heads} (neurons an attention counts as at {counted})"))
    return rows


def split_rows(split: SplitRecord | None) -> list[tuple[str, str, str]]:
    """Every candidate split of the budget the run measured, the chosen one marked."""
    if split is None:
        return []
    rows = []
    if split.measure_best is not None:
        predict = "" if split.predict_s is None else f", predicting took {split.predict_s:.1f} s"
        rows.append(
            ("  splits measured", "", f"the {split.measure_best} of {len(split.candidates)} predicted best{predict}")
        )
    for index, candidate in enumerate(split.candidates):
        mark = " (chosen)" if index == split.chosen else ""
        experts = "" if candidate.experts is None else f", {candidate.experts} experts"
        experts += "" if candidate.heads is None else f", {candidate.heads} heads"
        experts += without_blocks(candidate.removed_blocks)
        pruned = "" if candidate.prune_s is None else f", pruned in {candidate.prune_s:.1f} s"
        if split.screen_windows is not None and candidate.prune_s is not None:
            pruned += f" on {split.screen_windows} calibration windows"
        predicted = "" if candidate.predicted_kl is None else f"predicted KL {candidate.predicted_kl:.4g}"
        if candidate.heldout_kl is None:
            measured = f"{predicted}, not measured"
        else:
            measured = f"held-out KL {candidate.heldout_kl:.4g} ({split.windows} windows){pruned}"
            measured += f", {predicted}" if predicted else ""
        rows.append((f"  split: width {candidate.width}, MLP {candidate.mlp_kept}{experts}{mark}", "", measured))
    return rows


def without_blocks(blocks: Sequence[int] | None) -> str:
    """`, without blocks 4, 5` (nothing for none): a candidate's removed decoder blocks."""
    return f", without block{'s' * (len(blocks) > 1)} {', '.join(map(str, blocks))}" if blocks else ""


def depth_rows(report: RunReport) -> list[tuple[str, str, str]]:
    """The decoder blocks the run removed (`depth`), by which selector, and what removing them
    alone cost on the selector's held-out windows where it measured."""
    depth = report.depth
    if depth is None:
        return []
    blocks = ", ".join(str(block) for block in depth.removed)
    removed = f"removed {blocks}" if blocks else "none removed"
    rows = [("decoder blocks", str(depth.of), f"{depth.of - len(depth.removed)} ({removed}; {depth.selector})")]
    for candidate in depth.candidates or []:  # `depth` open: each count's blocks, measured alone where asked
        alone = "" if candidate.heldout_kl is None else f": KL without them alone {candidate.heldout_kl:.4g}"
        rows.append((f"  candidate: without {', '.join(map(str, candidate.removed))}", "", f"{depth.selector}{alone}"))
    if depth.heldout_kl is not None:
        rows.append(
            (
                "  KL without them alone (held-out)",
                "",
                f"{depth.heldout_kl:.4g} ({depth.heldout_windows} windows, {depth.measurements} measured)",
            )
        )
    return rows + split_rows(depth.split)


def expert_rows(report: RunReport) -> list[tuple[str, str, str]]:
    """The routed experts each MoE layer kept (`experts`), by which selector, and the fewest
    calibration tokens any expert was routed (what its statistics rest on)."""
    if report.experts is None:
        return []
    experts = report.experts
    if not experts.layers:  # the chosen split keeps every expert
        return [
            ("routed experts per MoE layer", str(experts.of), f"{experts.kept} (all kept)"),
            *split_rows(experts.split),
        ]
    return [
        ("routed experts per MoE layer", str(experts.of), f"{experts.kept} ({experts.selector})"),
        ("  fewest calibration tokens an expert saw", "", f"{experts.fewest_tokens:,}"),
        *router_rows(experts.layers),
        *split_rows(experts.split),
    ]


def router_rows(layers: list[ExpertRecord]) -> list[tuple[str, str, str]]:
    """The router refit's held-out output change (a share of the block's output), mean over the
    layers, before and after, and how many layers kept it."""
    refits = [layer.router for layer in layers if layer.router is not None]
    if not refits:
        return []
    before = sum(r["before"] for r in refits) / len(refits)
    after = sum(r["after"] if r["applied"] else r["before"] for r in refits) / len(refits)
    kept = sum(bool(r["applied"]) for r in refits)
    return [
        (
            "  router refit: held-out output change",
            "",
            f"{before:.4f} → {after:.4f} ({kept}/{len(refits)} layers kept it)",
        )
    ]


def refinement_rows(refinement: RefinementRecord | None) -> list[tuple[str, str, str]]:
    """The refinement objective before and after, both in the pruned column: the baseline column
    holds only the original model's figures, and the unrefined model is already a pruned one."""
    if refinement is None:
        return []
    objective = f"calibration KL (refinement objective, top_k {refinement.options['top_k']})"
    return [
        (f"{objective} before refinement", "", f"{refinement.calibration_kl_before:.5f}"),
        (f"{objective} after refinement", "", f"{refinement.calibration_kl_after:.5f} ({refinement.kept})"),
    ]


def guard_rows(guards: list[GuardRecord], step: str) -> list[tuple[str, str, str]]:
    """The held-out guard of `step` (`reports.guard`): the saved model's KL on windows the step did not
    train on, before and after it, and whether its result was kept."""
    rows = []
    for guard in guards:
        if guard.step == step:
            verdict = "kept" if guard.kept else f"undone: the model from before {step} is saved"
            rows.append(
                (
                    f"held-out KL before/after {step} ({guard.windows} windows, guard)",
                    "",
                    f"{guard.kl_before:.5f} -> {guard.kl_after:.5f} ({verdict})",
                )
            )
    return rows


def distillation_rows(distillation: DistillationRecord | None) -> list[tuple[str, str, str]]:
    """The held-out KL before and at the kept checkpoint, and what the stage trained on."""
    if distillation is None:
        return []
    top_k = distillation.options["top_k"]
    objective = f"distillation held-out KL ({distillation.heldout_windows} windows, top_k {top_k})"
    stopped = ", stopped early" if distillation.stopped_early else ""
    return [
        (f"{objective} before", "", f"{distillation.heldout_kl_before:.5f}"),
        (
            f"{objective} kept",
            "",
            f"{distillation.heldout_kl_best:.5f} ({distillation.kept}, step {distillation.best_step})",
        ),
        (
            "distillation",
            "",
            f"{distillation.method}, {distillation.tokens / 1e6:.3g}M tokens, "
            f"{distillation.steps} steps{stopped}, {distillation.world_size} process(es)",
        ),
    ]


def heads_rows(report: RunReport) -> list[tuple[str, str, str]]:
    """The query heads every attention layer kept (`heads`), by which selector, and the output
    projection's mean relative error after the refit (or without it)."""
    heads = report.heads
    if heads is None:
        return []
    rows = [("query heads per layer", str(heads.of), f"{heads.kept} (head_dim {heads.head_dim}; {heads.selector})")]
    errors = [layer.error_refit if layer.error_refit is not None else layer.error_dropped for layer in heads.layers]
    if errors:
        what = "refitted" if heads.refit else "unrefitted"
        rows.append((f"  attention output error ({what}, mean)", "", f"{sum(errors) / len(errors):.4g}"))
    return rows + split_rows(heads.split)


def timing_rows(timings: dict[str, Any], autocast: str | None = None) -> list[tuple[str, str, str]]:
    """Seconds per phase. H gets its own row where this run computed it (`fisher_s` > 0): reports
    that have `fisher_s` leave it out of `prune_s`, and a run that shared H spent none."""
    rows = []
    if timings.get("decode_budget_s"):
        rows.append(("timing decode for target_decode (s)", "", f"{timings['decode_budget_s']:.1f}"))
    if timings.get("fisher_s"):
        under = f" (autocast {autocast})" if autocast else ""
        rows.append((f"output sensitivity H (s){under}", "", f"{timings['fisher_s']:.1f}"))
    if "depth_s" in timings:
        rows.append(("choosing blocks to remove (s)", "", f"{timings['depth_s']:.1f}"))
    if "split_s" in timings:  # without refinement the chosen split's prune and MLP times are within it
        rows.append(("choosing the split (s)", "", f"{timings['split_s']:.1f}"))
    rows.append(("prune time (s)", "", f"{timings['prune_s']:.1f}"))
    if "refine_s" in timings:
        rows.append(("refinement time (s)", "", f"{timings['refine_s']:.1f}"))
    if "experts_s" in timings:
        rows.append(("experts time (s)", "", f"{timings['experts_s']:.1f}"))
    if "heads_s" in timings:
        rows.append(("attention heads time (s)", "", f"{timings['heads_s']:.1f}"))
    if "mlp_s" in timings:
        rows.append(("MLP neurons time (s)", "", f"{timings['mlp_s']:.1f}"))
    if "distill_s" in timings:
        rows.append(("distillation time (s)", "", f"{timings['distill_s']:.1f}"))
    for key, seconds in timings.items():  # a plugin stage's, under its own key
        if key not in BUILT_IN_TIMINGS and isinstance(seconds, (int, float)):
            rows.append((f"{key.removesuffix('_s')} time (s)", "", f"{seconds:.1f}"))
    if "eval_s" in timings:
        rows.append(("evaluation time (s)", "", f"{timings['eval_s']:.1f}"))
    return rows


BUILT_IN_TIMINGS = frozenset(
    (
        "data_s",
        "decode_budget_s",
        "load_s",
        "fisher_s",
        "depth_s",
        "split_s",
        "prune_s",
        "refine_s",
        "experts_s",
        "heads_s",
        "mlp_s",
        "distill_s",
        "save_s",
        "eval_s",
        "total_s",
    )
)
"""The timings the report's rows name; any other is a plugin stage's, shown by its key."""


def speed_rows(size: Sizes | None, speed: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """Weight bytes, and prefill and decode tokens/s per batch size, of the baseline and pruned model."""
    rows = []
    if size is not None:
        sides = (size.baseline, size.pruned)
        rows.append(("weights (MB)", *(f"{s.weight_bytes / 1e6:,.2f}" if s is not None else "" for s in sides)))
    if speed:
        any_side = speed.get("pruned") or speed.get("baseline")
        for phase in ("prefill", "decode"):
            for batch in any_side["throughput"]["batch"]:
                cells = []
                for side in ("baseline", "pruned"):
                    numbers = speed.get(side, {}).get("throughput", {}).get("batch", {}).get(batch)
                    cells.append(rate_cell(numbers, phase) if numbers else "")
                if "speedup" in speed:
                    cells[1] += f" ({speedup_label(speed, batch, phase)})"
                rows.append((f"{phase} tokens/s, batch {batch}", *cells))
        loaded = under_load(any_side["throughput"])
        if loaded is not None:
            rows.append(("timed under load", "", loaded))
    return rows


def rate_cell(numbers: dict[str, Any], phase: str) -> str:
    """The median tokens/s with the slowest and fastest repeat's: a median of a few runs on a busy
    machine means little without its spread, and a range (unlike ± a percentage of the median,
    which passed 100% when one repeat ran 4.5x faster) cannot read like a bug."""
    median, span = numbers[f"{phase}_tok_s"], rate_range(numbers, phase)
    if rounds(numbers, phase) == 1:
        return f"{median:,.0f} (one round)"
    if span is None or not median or span[0] == span[1]:
        return f"{median:,.0f}"
    few = " in two rounds" if rounds(numbers, phase) == 2 else ""
    return f"{median:,.0f} ({span[0]:,.0f}–{span[1]:,.0f}{few})"


def speedup_label(speed: dict[str, Any], batch: str, phase: str) -> str:
    """`×speedup`, and whether the difference from the baseline is within the repeats' spread
    (the two models' ranges of tokens/s overlap), so a 0.97× is not read as a slowdown."""
    label = f"×{speed['speedup'][batch][phase]:.2f}"
    sides = [speed.get(side, {}).get("throughput", {}).get("batch", {}).get(batch) for side in ("pruned", "baseline")]
    if any(side is not None and rounds(side, phase) == 1 for side in sides):
        return label + ", one round: no spread to judge it by"
    bounds = speedup_bounds(sides[0], sides[1], phase) if all(sides) else None
    if bounds is not None and bounds[0] <= 1 <= bounds[1]:
        label += ", within noise"
    return label


def _score(values: dict[str, Any], metric: str) -> str:
    value, stderr = values.get(metric), values.get(f"{metric}_stderr")
    if value is None:
        return "n/a"
    return f"{value:.3f} ± {stderr:.3f}" if stderr is not None else f"{value:.3f}"


def task_rows(metrics: Metrics) -> list[tuple[str, str, str]]:
    """One (task metric, baseline, pruned) row per lm-eval score, with its standard error."""
    pruned = (metrics.pruned.tasks if metrics.pruned is not None else None) or {}
    baseline = (metrics.baseline.tasks if metrics.baseline is not None else None) or {}
    rows = []
    for task, values in pruned.items():
        for metric in values:
            if metric.endswith("_stderr") or metric == "samples":
                continue
            before = _score(baseline[task], metric) if task in baseline else ""
            rows.append((f"{task} {metric} (n={values.get('samples', '?')})", before, _score(values, metric)))
    return rows


def kept_label(report: RunReport) -> str:
    """The kept width, or the range of per-site widths when an allocation chose them."""
    if report.kept_width is not None:
        return str(report.kept_width)
    kept = [site.kept for site in report.sites]
    return f"{min(kept)}–{max(kept)} by site" if kept else "by site"


def budget_label(sparsity: float | None, target_params: float | None, target_active_params: float | None = None) -> str:
    """`sparsity 0.25`, `target_params 0.75`, `target_params 0.75, target_active_params 0.5`."""
    if sparsity is not None:
        return f"sparsity {sparsity}"
    targets = {"target_params": target_params, "target_active_params": target_active_params}
    return ", ".join(f"{key} {value}" for key, value in targets.items() if value is not None)


def title(report: RunReport) -> str:
    chain = " + ".join(step.strategy for step in report.pipeline)
    if report.stock is not None and "residual" in report.stock:  # `models.mlp_only`: no walk, no strategy ran
        chain = "the MLP's width alone"
    method = report.allocation.method
    widths = "" if method == "uniform" else f", {method} widths"
    if report.layout == "global":
        widths += ", one basis (stock architecture)"
    return f"{Path(report.model.path).name}: {chain} at {budget_label(report.sparsity, report.target_params, report.target_active_params)}{widths}"


def write_markdown(report: RunReport, path: Path) -> None:
    lines = [f"# {title(report)}", "", "| | baseline | pruned |", "|---|---:|---:|"]
    lines += [f"| {name} | {before} | {after} |" for name, before, after in summary_rows(report)]
    path.write_text("\n".join(lines) + "\n")


def rich_table(report: RunReport) -> Table:
    table = Table(title=title(report))
    table.add_column("")
    table.add_column("baseline", justify="right")
    table.add_column("pruned", justify="right")
    for row in summary_rows(report):
        table.add_row(*row)
    return table
