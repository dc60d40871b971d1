"""`compress run --dry-run`: every check a run makes before it loads weights, made without
loading them, and a plain list of what could not be checked (and why).

A dry run fails where the run would fail before its first minute of work: the device, the
model's config and family, the budget, strategy options, lm-eval task names, the data (local
text is tokenised to count its windows; a hub dataset's first record is read), an interrupted
run started with another recipe, an output that cannot be written. What only the run can find
(the weights, memory, numbers) is listed as not checked, as is what the hub could not tell.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compressor.data.text import is_local
from compressor.errors import UserError
from compressor.hub import cached, unreachable
from compressor.models.axes import family_axes, stock_axes
from compressor.models.layout import SlicedLayout, shared_expert_neurons
from compressor.plan.checks import Plan, check_device_settings, plan
from compressor.plan.decode_budget import resolve as resolve_decode
from compressor.plan.memory import machine_memory, resolved_load, run_memory_plan
from compressor.plan.timing import time_plan
from compressor.recipe.schema import Recipe
from compressor.recipe.sections.data import DataSpec
from compressor.reports.report import decode_summary
from compressor.reports.report_model import DecodeBudget
from compressor.runtime.loading import check_fields, heldout_batches, load_tokenizer, resolve_device, token_batches
from compressor.runtime.resume import check_interrupted, progress_summary
from compressor.runtime.staging import check_output, check_writable
from compressor.runtime.threads import planned_threads
from compressor.stages.costs import size
from compressor.stages.data import heldout_counts
from compressor.stages.evaluate import check_evaluation_tasks
from compressor.stages.order import run_order
from compressor.strategies.registry import PluginRegistry

NETWORK_WORDS = ("connect", "timed out", "timeout", "unreachable", "max retries", "name or service", "resolve")
"""A hub dataset error with these words was the network's, not the dataset's: not checked, not refused."""
ALWAYS_UNCHECKED = "the weights (not loaded: a missing or corrupt shard, NaN or Inf show only in the run)"


@dataclass
class DryRun:
    """What a dry run found: checked (one line each), notes, warnings, and what it could not check."""

    checked: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    refusal: str | None = None
    """Why the run would stop at once here although the recipe is sound (a device this machine
    lacks, an output it may not replace): the dry run shows what it checked, then fails with it."""

    def lines(self) -> list[str]:
        return (
            [f"checked: {line}" for line in self.checked]
            + [f"note: {line}" for line in self.notes]
            + [f"warning: {line}" for line in self.warnings]
            + [f"not checked: {line}" for line in self.unchecked]
        )


def dry_run(
    recipe: Recipe, registry: PluginRegistry, overwrite: bool = False, restart: bool = False, memory_check: bool = True
) -> DryRun:
    """Check `recipe` as `compress run` would before loading weights; a problem is a UserError."""
    found = DryRun()
    try:  # a recipe for a GPU is still checked on a laptop; the missing device is the last word
        device = resolve_device(recipe.device)
        missing = None
    except UserError as error:
        device, missing = None, str(error)
    if device is not None:
        try:  # a sound recipe that cannot run on this device: checked through, then refused
            check_device_settings(recipe, device, stages=run_order(registry.stages()))
        except UserError as error:
            missing = str(error)
        found.checked.append(f"device {recipe.device} (here: {device})")
        if device.type == "cpu":
            threads, given = planned_threads(recipe.threads)
            found.checked.append(f"CPU threads: {threads} ({given}; set threads to change)")
    model_lines = DryRun()
    checked = _model(recipe, registry, model_lines)
    if checked is not None and recipe.target_decode is not None and device is not None and missing is None:
        budgeted, decode = resolve_decode(recipe, checked, registry, device, restart=restart)
        found.checked.append(decode_line(decode))
        model_lines = DryRun()
        checked = _model(recipe, registry, model_lines, budgeted)  # its lines at the budgets found
    for lines, more in zip(
        (found.checked, found.notes, found.warnings, found.unchecked),
        (model_lines.checked, model_lines.notes, model_lines.warnings, model_lines.unchecked),
    ):
        lines += more
    if checked is not None:
        found.warnings += checked.warnings
        _memory(recipe, checked, device, found, memory_check)
        if device is not None:
            found.notes.append(time_plan(recipe, checked, device).line())
    _data_checks(recipe, checked, found)
    _tasks(recipe, found)
    output = Path(recipe.output)
    check_writable(output)
    check_interrupted(output, recipe, restart)
    resumable = None if restart else progress_summary(output)
    if resumable is not None:
        found.notes.append(f"the run would resume an interrupted run: {resumable} (--restart discards it)")
    try:
        check_output(output, overwrite)
        found.checked.append(f"output {output} can be written")
    except UserError as error:
        found.refusal = str(error)
    found.unchecked.append(ALWAYS_UNCHECKED)
    if missing is not None:
        found.refusal = missing
    return found


def _data_checks(recipe: Recipe, checked: Plan | None, found: DryRun) -> None:
    """The calibration and evaluation data (local text tokenised to count its windows), the held-out
    windows each measuring stage reads after the calibration windows, and the distillation data."""
    tokenizer = load_tokenizer(recipe.model) if checked is not None else None
    for where, spec in (("calibration", recipe.calibration), ("evaluation", recipe.evaluation)):
        if spec is not None:
            _data(where, spec, tokenizer, found)
    if checked is not None and tokenizer is not None and is_local(recipe.calibration.dataset):
        for stage, count in heldout_counts(recipe, checked):  # read after the calibration windows
            where = stage.heldout_section(recipe)
            heldout_batches(recipe.calibration, tokenizer, count, where)
            found.checked.append(f"{where} held-out data: {count} windows after the calibration windows")
    if recipe.distillation is not None and tokenizer is not None:
        _distillation(recipe, tokenizer, found)


def axes_line(recipe: Recipe, checked: Plan) -> str:
    """The axes the run prunes (the expert counts it measures, where it chooses; a plugin's axis where
    the recipe has its section), beside the family's."""
    layout = checked.layout
    axes = ["residual width"] if layout.residual else []
    chosen_widths = any(split.mlp_width is not None for split in checked.splits)
    axes += ["MLP width"] if layout.mlp_width is not None or chosen_widths else []
    axes += ["shared expert width"] if layout.shared_width is not None else []
    counts = sorted({split.experts for split in checked.splits if split.experts is not None}, reverse=True)
    if checked.expert_selector is not None and (layout.experts is not None or counts):
        kept = _kept_of(layout.experts, counts, getattr(layout.config, layout.family.experts))
        axes += [f"routed experts ({kept} per layer, by {checked.expert_selector.name})"]
    heads = sorted({split.heads for split in checked.splits if split.heads is not None}, reverse=True)
    if checked.head_selector is not None and (layout.heads is not None or heads):
        kept = _kept_of(layout.heads, heads, layout.config.num_attention_heads)
        axes += [f"query heads ({kept} per layer, by {checked.head_selector.name})"]
    if checked.block_selector is not None:
        blocks = layout.config.num_hidden_layers + len(checked.removed_blocks)
        removed = sorted({len(split.removed_blocks) for split in checked.splits})
        count = f"{', '.join(map(str, removed))} measured" if len(removed) > 1 else str(len(checked.removed_blocks))
        axes += [f"depth ({count} of {blocks} blocks removed, by {checked.block_selector.name})"]
    axes += [axis.name for axis in checked.plugin_axes(recipe)]
    family, model_type = layout.family, layout.config.model_type
    allowed = ", ".join(axis.key for axis in family_axes(family, model_type, checked.axes))
    stock = ", ".join(axis.key for axis in stock_axes(family, model_type, checked.axes))
    return f"axes: {', '.join(axes)} (this family allows {allowed}" + (
        f"; saved stock: {stock})" if layout.one_basis else ")"
    )


def _kept_of(fixed: int | None, counts: list[int], of: int) -> str:
    """`6 of 8` (a fixed count), or `8, 6, 4 of 8 measured` (the counts the split choice measures)."""
    return f"{fixed} of {of}" if not counts else f"{of}, {', '.join(map(str, counts))} of {of} measured"


def active_line(layout: SlicedLayout, what: str) -> str:
    """The parameters a token uses: the budget `target_active_params` sets (or the original's), and
    what the plan's widths use."""
    active = layout.counted_active
    assert active is not None
    limit = (
        f"budget {layout.active_budget:,} of {active.original:,} ({layout.active_budget / active.original:.1%})"
        if layout.active_budget is not None
        else f"the original uses {active.original:,}"
    )
    used = f", these widths use {active.count(layout.widths):,}" if layout.widths is not None else ""
    return f"{what} per token (active: top-k of each layer's routed experts): {limit}{used}"


def decode_line(decode: DecodeBudget) -> str:
    """What `target_decode`'s search found: the candidates' parameter budgets and measured decode times."""
    how = "read back from the interrupted run" if decode.reused else f"timed in {decode.seconds:.0f} s"
    return (
        f"target_decode {decode.target:g} of the dense model's decode time on {decode.device} ({how}): "
        f"{decode_summary(decode)}"
    )


def _config_lines(recipe: Recipe, checked: Plan) -> list[str]:
    """The model config's line (its shape, the budget, the kept width and the embedding's share),
    and the active parameters' of a Mixture-of-Experts model."""
    layout = checked.layout
    original, counted = layout.params.original, layout.counted.original
    kept = layout.kept if layout.kept is not None else "chosen per site after a survey"
    what = "non-embedding parameters" if layout.counts == "non_embedding" else "parameters"
    saved = (
        f" ({layout.params.count(layout.widths):,} of {original:,} parameters in all)"
        if layout.counts == "non_embedding" and layout.widths is not None
        else ""
    )
    budget = (
        f"no target on the {counted:,} {what} in all"
        if recipe.sparsity is None and recipe.target_params is None and checked.decode_budgets is None
        else f"budget {layout.budget:,} of {counted:,} {what} ({layout.budget / counted:.1%})"
    )
    line = (
        f"model config ({layout.config.model_type}, {layout.config.num_hidden_layers + len(checked.removed_blocks)} "
        f"layers, "
        f"hidden {layout.config.hidden_size}): {budget}, kept width {kept}{saved}; the embedding is "
        f"{layout.params.embedding / original:.0%} of the parameters"
    )
    return [line] if layout.counted_active is None else [line, active_line(layout, what)]


def _model(recipe: Recipe, registry: PluginRegistry, found: DryRun, planned: Plan | None = None) -> Plan | None:
    """The plan from the model's config (a hub model's config and tokenizer are small files,
    fetched where the hub can be reached or read from the cache); None when it cannot be had."""
    path = recipe.model.path
    if not Path(path).is_dir():
        why = unreachable()
        if why and not cached(path, "config.json", recipe.model.revision):
            check_evaluation_tasks(recipe)
            found.unchecked.append(
                f"the model's config, family, budget and widths, and the data's window counts "
                f"(hub model '{path}' is not in the cache; {why})"
            )
            found.notes.append(f"this machine cannot run it until model '{path}' can be fetched or is in the cache")
            return None
    checked = planned if planned is not None else plan(recipe, registry)
    layout = checked.layout
    found.checked += _config_lines(recipe, checked)
    if checked.tower is not None:
        found.checked.append(
            f"a vision-language checkpoint: its text tower ({layout.config.model_type}) is pruned on text, the "
            f"vision encoder kept, the projector's output ({checked.tower.projector}) "
            + ("mapped with the embedding's basis" if layout.residual else "as it was (the stream is kept whole)")
            + "; saved whole as its own class"
        )
    layout = checked.layout
    found.checked.append(axes_line(recipe, checked))
    if not layout.residual:
        heterogeneous = recipe.slicing.layout == "heterogeneous"
        saved = "DeciLMForCausalLM (remote code)" if heterogeneous else ", ".join(layout.config.architectures or [])
        found.checked.append(
            f"{'per-layer MLP widths' if heterogeneous else 'one basis'}: saved as {saved or 'the original class'} "
            f"with its residual stream whole (hidden_size {layout.config.hidden_size}: {layout.kept_stream}) "
            f"and every MLP narrower ({'at most ' if heterogeneous else ''}"
            f"{layout.params.count(layout.widths or {}):,} parameters)"
        )
    elif checked.layout.one_basis:
        found.checked.append(
            f"one basis: saved as {', '.join(checked.layout.config.architectures or ['the original class'])} "
            f"with hidden_size {checked.layout.kept} ({checked.layout.params.count(checked.layout.widths):,} parameters)"
        )
    found.checked += mlp_lines(checked, recipe)
    if checked.chooses_split:
        found.checked.append(split_line(checked))
    found.checked.append(f"strategies {' + '.join(s.strategy for s in recipe.pipeline)} and their options")
    return checked


def split_line(checked: Plan) -> str:
    """The splits of the budget the run chooses from, and how many it predicts and measures."""
    splits = ", ".join(
        f"width {split.kept} with MLP {split.mlp_width or 'whole'}"
        + ("" if split.experts is None else f" and {split.experts} experts")
        + ("" if split.heads is None else f" and {split.heads} heads")
        + ("" if not split.removed_blocks else f" and {len(split.removed_blocks)} blocks removed")
        + f" ({split.counted.count(split.widths or {}):,})"
        for split in checked.splits
    )
    screen = checked.screen_windows
    pruned_on = "" if screen is None else f", each pruned on {screen} calibration windows (the chosen one on all)"
    best, count = checked.measure_best, len(checked.splits)
    measures = (
        f"measures {count} splits"
        if best is None
        else f"predicts {count} splits and measures the {min(best, count)} best"
    )
    return f"split: the run {measures} of the budget on held-out windows{pruned_on} and keeps the best: {splits}"


def mlp_lines(checked: Plan, recipe: Recipe) -> list[str]:
    """What `mlp` keeps: every MLP's (each routed expert's) neurons, and every shared expert's; in
    `slicing.layout: heterogeneous` the MLPs share the uniform width's neurons, and with
    `mlp.remove_attention` the attentions may go too (`mlp.search`: allocations measured); then
    `mlp.reconstruct`'s training."""
    layout, selector, lines = checked.layout, checked.selector, []
    if selector is None:
        return lines
    rebuild, after = recipe.mlp.reconstruct if recipe.mlp is not None else None, []
    if rebuild is not None:
        after.append(
            f"mlp.reconstruct: after the refit, each MLP's kept weights take {rebuild.steps} Adam steps of "
            f"{rebuild.batch_tokens} tokens on its target (weighed by H where the MLP writes, where the run has "
            f"it), the best on {float(rebuild.heldout):.1%} of the tokens held out kept"
        )
    if layout.shared_width is not None:
        of = shared_expert_neurons(layout.config, layout.family)
        lines.append(f"mlp: every shared expert keeps {layout.shared_width} of its {of} neurons ({selector.name})")
    if layout.mlp_width is not None:
        family = layout.family
        assert family.mlp_width is not None
        what = "routed expert" if family.experts is not None else "MLP"
        if recipe.slicing.layout == "heterogeneous":
            layers = layout.config.num_hidden_layers
            lines.append(
                f"mlp: the {layers} MLPs share {layers * layout.mlp_width:,} neurons ({layout.mlp_width} each, "
                f"uniform), given to the layers in steps of 256 by their width curves ({selector.name})"
            )
            if recipe.mlp is not None and recipe.mlp.remove_attention:
                lines.append(
                    "mlp.remove_attention: a layer's attention may go too (DeciLM no_op), where its predicted "
                    "error is below what its parameters buy as MLP neurons"
                )
            if recipe.mlp is not None and recipe.mlp.merge_kv_heads:
                lines.append(
                    "mlp.merge_kv_heads: a layer may keep fewer key-value heads (DeciLM n_heads_in_group), its "
                    "neighbours merged and its output projection refitted, where that costs less than its neurons buy"
                )
            if recipe.mlp is not None and recipe.mlp.search is not None:
                lines.append(
                    f"mlp.search: up to {recipe.mlp.search} allocations measured from the predicted one on "
                    f"{recipe.mlp.heldout_windows} held-out windows, the lowest KL kept"
                )
            return lines + after
        lines.append(
            f"mlp: every {what} keeps {layout.mlp_width} of its "
            f"{getattr(layout.config, family.mlp_width)} neurons ({selector.name})"
        )
    return lines + after


def _memory(recipe: Recipe, checked: Plan, device: Any, found: DryRun, check: bool) -> None:
    """The memory plan, phase by phase, against this machine's memory (the device the recipe names
    where this machine has it, else its host alone); a peak above it is the dry run's refusal."""
    on = device if device is not None else torch.device("cpu")
    machine = machine_memory(on)
    recipe, chosen = resolved_load(recipe, checked, on, machine)
    if chosen is not None:
        found.notes.append(chosen)
    memory = run_memory_plan(recipe, checked, on)
    found.notes.append(
        f"memory plan for {memory.shape}, {machine.describe()}; host figures include this process's "
        f"{size(memory.base)} before loading weights, not the allocator's overhead:"
    )
    found.notes += [f"  {line}" for line in memory.lines()]
    refusal = memory.refusal(machine)
    if refusal is not None and check:
        found.refusal = found.refusal or refusal
    elif refusal is not None:
        found.warnings.append(refusal)
    else:
        peak = memory.peak_host()
        found.checked.append(f"memory: the peak ({peak.name}, host {size(peak.host)}) fits this machine")


def _distillation(recipe: Recipe, tokenizer: Any, found: DryRun) -> None:
    """Its LoRA targets and trainer keys (checked by `plan`), and its windows when the data is local."""
    from compressor.training.distill import steps_for
    from compressor.training.teachers import distillation_data

    spec = recipe.distillation
    assert spec is not None and spec.dataset is not None
    found.checked.append(
        f"distillation: {spec.method}"
        + (f" on {spec.lora.target_modules}" if spec.method == "lora" else "")
        + (f", trainer settings {', '.join(spec.trainer)}" if spec.trainer else "")
    )
    if not is_local(spec.dataset):
        found.unchecked.append("distillation data's window count (a hub dataset, read only by the run)")
        return
    data = distillation_data(spec, tokenizer)
    steps, per_step = steps_for(spec, 1)
    found.checked.append(
        f"distillation data: {len(data.train)} training windows of {spec.seq_len} tokens "
        f"({steps * per_step / len(data.train):.2g} passes for {spec.tokens:,} tokens in {steps} "
        f"steps on one process), {len(data.heldout)} held-out windows"
    )


def _data(where: str, spec: DataSpec, tokenizer: Any, found: DryRun) -> None:
    """Local text: its first record's field, and enough windows (tokenised when the tokenizer
    is at hand). A hub dataset: its first record, unless the hub cannot be reached."""
    local = is_local(spec.dataset)
    if not local:
        why = unreachable()
        if why:
            found.unchecked.append(f"{where} data (hub dataset {spec.dataset.get('path')!r}; {why})")
            return
    try:
        check_fields(spec, where)
    except UserError as error:
        if local or not any(word in str(error).lower() for word in NETWORK_WORDS):
            raise
        found.unchecked.append(f"{where} data (hub dataset {spec.dataset.get('path')!r} could not be reached: {error})")
        return
    if tokenizer is not None and local:
        batches = token_batches(spec, tokenizer, where)
        found.checked.append(f"{where} data: {sum(len(b.input_ids) for b in batches)} windows of {spec.seq_len} tokens")
    else:
        found.checked.append(f"{where} data: its first record has the field the recipe names")
        found.unchecked.append(f"{where} data's window count (read only by the run)")


def _tasks(recipe: Recipe, found: DryRun) -> None:
    suites = recipe.evaluation.lm_eval if recipe.evaluation is not None else None
    if not suites:
        return
    # their names were checked with the model (by `plan`, or on their own where the config was out of reach)
    names = [task for suite in suites for task in suite.tasks]
    found.checked.append(f"lm-eval task names: {', '.join(names)}")
    found.unchecked.append("the lm-eval tasks' own data (the harness fetches it during the run)")
