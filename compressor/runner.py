"""One `compress run`: check everything, load, prune, save, evaluate, report.

All checks that need no weights (recipe, model config, family, widths, device) happen
before any work. The run writes into a hidden staging folder beside the output
(`.<name>.partial`) and renames it into place only when everything succeeded, so a failed
run leaves no half-written output. The staging folder also holds the run's checkpoint: a run
that was killed or interrupted after H or a site was finished keeps it, and the same command
continues from there (`restart=True` discards it).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import fnmatch
import json
import math
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

import compressor
from compressor import faults, parallel
from compressor.activations import ActivationStore
from compressor.allocation import CurveAllocator
from compressor.bases import BASES_FILE, READERS_FILE, apply_bases, save_bases
from compressor.calibration import Batch
from compressor.chat import chat_batches
from compressor.budget import ParamModel, param_model, widest_uniform
from compressor.checkpoint import DISTILLATION_FOLDER, FINGERPRINT_FILE, Checkpoint, json_digest, model_digest, tensor_digest
from compressor.data import batches_of, first_record, load_records, token_windows
from compressor.engine import PipelineStep, PruneResult, kept_width, prune, required_statistics
from compressor.errors import ProgressKept, UserError, first_line
from compressor.evaluate import compare, evaluate_models, parameter_count
from compressor.export import write_remote_code
from compressor.stock import check_stock, head_stream, load_stock, stock_param_model, to_stock, width_multiple
from compressor.families import ModelFamily, family_for, stream_reader, stream_writers
from compressor.hub import cached, model_advice, unreachable
from compressor.parallel import Ranks
from compressor.plugins import PluginRegistry
from compressor.recipe import DataSpec, DistillationSpec, ModelSpec, Recipe
from compressor.refine import refine_bases
from compressor.report import write_markdown
from compressor.plots import distillation_figure
from compressor.sites import EMBEDDING, shared_site_ids, site_widths
from compressor.throughput import compare_speed, fitting_lengths, model_size

Progress = Callable[[str, int, int], None]
T = TypeVar("T")


def _load(what: str, spec: ModelSpec, loader: Callable[[], T]) -> T:
    """Call a transformers loader; a missing or unreadable model is a one-line UserError. A hub
    model that is not cached, where the hub cannot be reached, is refused at once (huggingface_hub
    would retry for half a minute) with the same advice as in offline mode."""
    on_hub = not Path(spec.path).is_dir()
    if on_hub and unreachable() and not cached(spec.path, "config.json", spec.revision):
        raise UserError(f"cannot load {what}: not in the cache{model_advice()}")
    try:
        return loader()
    except (OSError, ValueError) as error:
        if "contains custom code" in str(error) and not spec.trust_remote_code:
            raise UserError(f"model '{spec.path}' ships its own Python code (auto_map in its config), which is not run "
                            f"unless the recipe sets model.trust_remote_code: true (read that code first)") from None
        hint = model_advice(error) if on_hub else ""
        raise UserError(f"cannot load {what}: {first_line(error)}{hint}") from None


def load_config(spec: ModelSpec) -> PretrainedConfig:
    return _load(f"the config of model '{spec.path}'", spec,
                 lambda: AutoConfig.from_pretrained(spec.path, revision=spec.revision,
                                                    trust_remote_code=spec.trust_remote_code))


def load_model(spec: ModelSpec) -> PreTrainedModel:
    """The model `spec` names; a run folder's model only from safetensors (nothing in a run
    folder is ever unpickled)."""
    from_run = (Path(spec.path).parent / RUN_MARKER).is_file()
    return _load(f"model '{spec.path}'", spec, lambda: AutoModelForCausalLM.from_pretrained(
        spec.path, revision=spec.revision, dtype=getattr(torch, spec.dtype),
        attn_implementation=spec.attn_implementation, trust_remote_code=spec.trust_remote_code,
        **({"use_safetensors": True} if from_run else {}),
    )).eval()


def load_tokenizer(spec: ModelSpec) -> Any:
    return _load(f"the tokenizer of '{spec.path}'", spec,
                 lambda: AutoTokenizer.from_pretrained(spec.path, revision=spec.revision,
                                                       trust_remote_code=spec.trust_remote_code))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device '{name}' requested but no CUDA GPU is available; set device: cpu (or auto)")
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"device '{name}' requested but only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    return device


def token_batches(spec: DataSpec, tokenizer: Any, where: str) -> list[Batch]:
    try:
        records = load_records(spec.dataset)
        if spec.format == "chat":
            return chat_batches(records, tokenizer, spec.seq_len, spec.num_samples, spec.batch_size,
                                spec.messages_field)
        windows = token_windows(records, tokenizer, spec.seq_len, spec.num_samples, spec.text_field)
    except UserError as error:
        raise UserError(f"{where}: {error}") from None
    return batches_of(windows, spec.batch_size)


def check_fields(spec: DataSpec, where: str) -> None:
    """The dataset's first record has the field the recipe names (text, or chat messages)."""
    key = "messages_field" if spec.format == "chat" else "text_field"
    name = getattr(spec, key)
    try:
        record = first_record(spec.dataset)
    except UserError as error:
        raise UserError(f"{where}: {error}") from None
    if record is None:
        raise UserError(f"{where}: the dataset has no records")
    if name not in record:
        raise UserError(f"{where}: the dataset's records have no field '{name}' (fields: {', '.join(record)}); "
                        f"set {where}.{key} in the recipe")


class Resources:
    """Where a run gets its tokenizer, data windows, model and H. This one loads everything
    afresh and keeps nothing; a sweep's (`compressor.sweep.SharedResources`) keeps what its
    runs share, so each is loaded or computed once."""

    def tokenizer(self, spec: ModelSpec) -> Any:
        return load_tokenizer(spec)

    def batches(self, spec: DataSpec, tokenizer: Any, where: str) -> list[Batch]:
        return token_batches(spec, tokenizer, where)

    def model(self, spec: ModelSpec) -> PreTrainedModel:
        """A model the caller may change (pruning works in place)."""
        return load_model(spec)

    def fisher(self, key: str) -> dict[str, torch.Tensor] | None:
        """H computed earlier for `key` (model, data, H options, seed), if kept."""
        return None

    def keep_fisher(self, key: str, fisher: dict[str, torch.Tensor]) -> None:
        pass

    def baseline_tasks(self, key: str) -> dict[str, Any] | None:
        """The original model's lm-eval scores for `key` (model, suites, seed), if kept."""
        return None

    def keep_baseline_tasks(self, key: str, scores: dict[str, Any]) -> None:
        pass


RUN_MARKER = "report.json"
"""A folder holding this file was written by a run, and only such a folder is ever replaced."""


RUN_FILES = ".run-files"
"""The list of files a run wrote (relative paths, one per line), written as it is published:
`--overwrite` replaces a previous run only when its folder holds nothing else."""


def list_run_files(folder: Path) -> list[str]:
    """Every file under `folder` (relative POSIX paths, sorted), and every empty folder (with a
    trailing slash), except the manifest itself."""
    found = []
    for path in sorted(folder.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                found.append(path.relative_to(folder).as_posix() + "/")
        elif path.name != RUN_FILES or path.parent != folder:
            found.append(path.relative_to(folder).as_posix())
    return found


LEGACY_RUN_FILES = ("report.json", "report.md", "recipe.yaml", "bases.safetensors", "readers.safetensors",
                    "model/config.json", "model/generation_config.json", "model/*.safetensors",
                    "model/model.safetensors.index.json", "model/tokenizer*", "model/special_tokens_map.json",
                    "model/added_tokens.json", "model/chat_template.jinja", "model/vocab.*", "model/merges.txt",
                    "model/modeling_sliced.py", "model/configuration_sliced.py")
"""What a run wrote before runs listed their files: a folder from then is judged by these names."""


def foreign_files(output: Path) -> list[str]:
    """What in a previous run's folder that run did not write (a user's notes, a copied file).
    A folder from before runs listed their files (no `.run-files`) is judged by the names a run
    writes (`LEGACY_RUN_FILES`)."""
    try:
        written = set((output / RUN_FILES).read_text().splitlines())
        return [name for name in list_run_files(output) if name not in written]
    except OSError:
        return [name for name in list_run_files(output)
                if not any(fnmatch.fnmatchcase(name, pattern) for pattern in LEGACY_RUN_FILES)]


def check_output(output: Path, overwrite: bool) -> None:
    """The output may be new, an empty folder, or (with `overwrite`) a previous run's folder
    that holds only what that run wrote.

    Anything else is refused even with `overwrite`: a run never deletes files it did not write.
    """
    if output.is_symlink():
        raise UserError(f"output {output} is a symbolic link; give the folder it points to")
    if not output.exists():
        return
    if not output.is_dir():
        raise UserError(f"output {output} exists and is not a folder; choose another --output")
    if not any(output.iterdir()):
        return
    if not (output / RUN_MARKER).is_file():
        raise UserError(f"output folder {output} is not empty and holds no previous run ({RUN_MARKER}); "
                        f"choose another --output")
    if not overwrite:
        raise UserError(f"output folder {output} already holds a run; pass --overwrite or choose another --output")
    foreign = foreign_files(output)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserError(f"output folder {output} holds files the previous run did not write ({shown}); --overwrite "
                        f"replaces only a run's own files: move them out of the folder, or choose another --output")


def interrupted_with_another_recipe(output: Path, recipe: Recipe) -> bool:
    """Whether an interrupted run to `output` left progress made with another recipe (its model
    and data are checked once loaded, by `Checkpoint.start`)."""
    checkpoint = Checkpoint(staging_folder(output) / CHECKPOINT_FOLDER)
    try:
        saved = json.loads((checkpoint.folder / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return False
    if saved.get("recipe") != recipe_fingerprint(recipe) and checkpoint.has_progress():
        return True
    try:
        trained = json.loads((checkpoint.folder / DISTILLATION_FOLDER / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (recipe.distillation is not None and trained.get("settings") != distillation_fingerprint(recipe)
            and checkpoint.has_distillation_progress())


def check_interrupted(output: Path, recipe: Recipe, restart: bool) -> None:
    """An interrupted run to `output` started with another recipe is refused before any weights
    load; `restart` discards it."""
    if not restart and interrupted_with_another_recipe(output, recipe):
        raise UserError(f"an interrupted run in {staging_folder(output)} was started with a different recipe; "
                        f"rerun with --restart to discard its progress, or choose another --output")


def check_writable(output: Path) -> None:
    """The output's nearest existing ancestor is a folder this process may write in."""
    parent = output.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write the output folder {output}: {parent} is not a folder this user can write in; "
                        f"choose another --output")


CHECKPOINT_FOLDER = "checkpoint"
SCRATCH_FOLDER = "scratch"
"""Activations spilled to disk (`activations: disk`); removed at every start and before publishing."""
LOCK_FILE = ".lock"


def staging_folder(output: Path) -> Path:
    """Where a run to `output` is built, and where its checkpoint lives until it is published."""
    return output.parent / f".{output.name}.partial"


def _prepare_staging(output: Path, overwrite: bool) -> Path:
    """The staging folder beside the output; a previous attempt's is kept, to resume from."""
    check_output(output, overwrite)
    staging = staging_folder(output)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        if staging.is_symlink() or (staging.exists() and not staging.is_dir()):
            raise UserError(f"{staging} is in the way of the run's staging folder; remove it")
        staging.mkdir(exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create the output folder {output}: {error.strerror or error}") from None
    return staging


@contextmanager
def _locked(staging: Path, output: Path) -> Iterator[None]:
    """Hold the staging folder for this process: a second run to the same output is refused.
    The lock file is never unlinked while held; it leaves with the folder (published or removed)."""
    try:
        handle = open(staging / LOCK_FILE, "w")
    except FileNotFoundError:  # another run removed its staging folder just now
        raise UserError(f"another run to {output} has just ended; "
                        f"run the command again") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        handle.close()
        if error.errno in (errno.EAGAIN, errno.EACCES):
            raise UserError(f"another run is writing to {output} "
                            f"(its staging folder {staging} is locked); wait for it or choose another --output") from None
        raise
    try:
        yield
    finally:
        handle.close()


def _current_umask() -> int:
    """The process umask, read without setting it where the OS allows (os.umask is process-wide)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _give_default_modes(folder: Path) -> None:
    """The modes a plain `mkdir`/`open` would have given (mkdtemp makes the staging folder 0700,
    and the safetensors writer makes its file 0600), so the published run is readable as usual.
    Best effort: a filesystem that refuses chmod must not cost a finished run."""
    mask = _current_umask()
    try:
        folder.chmod(0o777 & ~mask)
        for path in folder.rglob("*"):
            if not path.is_symlink():
                path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
    except OSError:
        pass


def _publish(staging: Path, output: Path) -> None:
    """Put the finished run in place; a previous run is moved aside first and removed last.
    The checkpoint goes only once the run is in place (until then a failure can still resume),
    and the lock file last, while it is still held."""
    shutil.rmtree(staging / SCRATCH_FOLDER, ignore_errors=True)
    written = [name for name in list_run_files(staging) if name.split("/")[0] not in (LOCK_FILE, CHECKPOINT_FOLDER)]
    (staging / RUN_FILES).write_text("".join(f"{name}\n" for name in written))
    _give_default_modes(staging)
    previous = None
    try:
        if output.exists():  # check_output allowed only an empty folder or a previous run's
            previous = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            output.rename(previous / output.name)
        staging.rename(output)
    except OSError as error:
        if previous is not None:  # put the previous run back, and leave no empty folder aside
            if (previous / output.name).exists() and not output.exists():
                (previous / output.name).rename(output)
            shutil.rmtree(previous, ignore_errors=True)
        raise ProgressKept(f"cannot put the finished run in place at {output}: {error.strerror or error}; progress is "
                        f"kept in {staging}: fix that and run the same command to continue") from None
    Checkpoint(output / CHECKPOINT_FOLDER).discard()
    (output / LOCK_FILE).unlink(missing_ok=True)
    if previous is not None:
        shutil.rmtree(previous)


@dataclass(frozen=True)
class Plan:
    """Everything a run decides from the recipe and the model's config alone (no weights)."""

    config: PretrainedConfig
    family: ModelFamily
    kept: int | None
    """The uniform kept width (None when an allocator chooses widths per site)."""
    widths: dict[str, int] | None
    pipeline: list[PipelineStep]
    params: ParamModel
    budget: int
    """The most parameters the pruned model may have."""
    shared: list[str]
    allocator: CurveAllocator | None = None
    rounding: dict[str, int] | None = None
    """When a budget decides a uniform width: what rounding it to `slicing.round_to` gave up."""
    tie_head: bool = False
    """`slicing.tie_head` as it applies to this model (unset: on for a global layout of a tied model)."""
    warnings: tuple[str, ...] = ()
    """What a run goes on with but its user should know (`budget_warnings`)."""


def plan(recipe: Recipe, registry: PluginRegistry) -> Plan:
    """Read the model's config and check family, widths and strategy options; load no weights."""
    config = load_config(recipe.model)
    families = {model_type: entry.family for model_type, entry in registry.families().items()}
    family = family_for(config.model_type, families)
    reason = family.refuse(config) if family.refuse is not None else None
    if reason:
        raise UserError(reason)
    check_positions(recipe, config)
    slicing = recipe.slicing
    if family.head_width_is_embedding_width and not slicing.slice_head:
        raise UserError(f"{config.model_type} models keep the embedding's width up to the head; "
                        f"set slicing.slice_head: true")
    if slicing.shared_bases and family.parallel:
        raise UserError(f"slicing.shared_bases lets each layer's MLP keep its attention's basis, but {family.name} "
                        f"layers have one site (attention and MLP in parallel); turn it off")
    one_basis = slicing.layout == "global"
    tie_head = slicing.tie_head if slicing.tie_head is not None else (
        one_basis and bool(getattr(config, "tie_word_embeddings", False)))
    if tie_head:
        check_tie_head(config, family)
    layers, d = config.num_hidden_layers, config.hidden_size
    if one_basis:
        check_stock(family, families.values())
    shared = shared_site_ids(family, layers, slicing.slice_head, tie_head) if slicing.shared_bases else []
    params = (stock_param_model(config, family, tie_head) if one_basis
              else param_model(config, family, shared, tie_head))

    def uniform(kept: int) -> dict[str, int]:
        return site_widths(family, layers, d, kept, one_basis or slicing.slice_head or tie_head)

    required = width_multiple(config, family) if one_basis else 1  # the stock class's own demand

    def widest(budget: int) -> tuple[dict[str, int], dict[str, int]]:
        step = math.lcm(slicing.round_to, required)
        widths = widest_uniform(params, budget, step, uniform)
        exact = widest_uniform(params, budget, required, uniform)
        return widths, {"round_to": slicing.round_to, "class_multiple": required, "step": step,
                        "width": widths[EMBEDDING], "params": params.count(widths),
                        "unrounded_width": exact[EMBEDDING], "unrounded_params": params.count(exact)}

    rounding = None
    if recipe.sparsity is not None:  # the budget: the parameters of SliceGPT's model at this sparsity
        kept = kept_width(d, recipe.sparsity, slicing.round_to)
        widths = site_widths(family, layers, d, kept, slicing.slice_head)
        budget = param_model(config, family).count(widths)
        if shared or tie_head or one_basis:  # fewer parameters to carry: the same budget keeps more width
            widths, rounding = widest(budget)
    else:
        assert recipe.target_params is not None
        budget = int(recipe.target_params * params.original)
        widths, rounding = widest(budget)
    kept: int | None = widths[EMBEDDING]
    allocator = None
    if recipe.allocation.method == "curves":
        kept, allocator = None, curve_allocator(recipe, family, params, budget, shared, d, tie_head)
        widths = None
    pipeline = []
    for step in recipe.pipeline:
        strategy = registry.strategy(step.strategy)
        pipeline.append(PipelineStep(strategy, strategy.parse_options(step.options)))
    required_statistics(pipeline)  # a chain needing what the engine cannot compute stops here, not after loading
    check_evaluation_tasks(recipe)
    if recipe.distillation is not None:
        check_distillation(recipe, config, family, widths or uniform(d), shared, tie_head)
    checked = Plan(config, family, kept, widths, pipeline, params, budget, shared, allocator, rounding, tie_head)
    return dataclasses.replace(checked, warnings=tuple(budget_warnings(recipe, checked)))


WIDE_LOSS = 0.5
"""Keeping less than this share of the hidden width (or of the parameters) warns: past it,
pruning the residual stream alone costs a large part of the model's quality."""


def budget_warnings(recipe: Recipe, checked: Plan) -> list[str]:
    """A budget that keeps under half the width runs, with a warning that names what it keeps."""
    d = checked.config.hidden_size
    if checked.kept is not None and checked.kept < WIDE_LOSS * d:
        what = f"keeps {checked.kept} of {d} dimensions of the residual stream"
    elif checked.kept is None and checked.budget < WIDE_LOSS * checked.params.original:
        what = f"keeps {checked.budget / checked.params.original:.0%} of the parameters"
    else:
        return []
    budget = f"sparsity {recipe.sparsity}" if recipe.sparsity is not None else f"target_params {recipe.target_params}"
    return [f"{budget} {what}: expect a large loss of quality (the report's KL and perplexity say how large); "
            f"consider removing less"]


def check_positions(recipe: Recipe, config: PretrainedConfig) -> None:
    """Windows longer than the model's positions would be scored past what it was trained on (its
    perplexity then means nothing): refused, naming the limit."""
    positions = getattr(config, "max_position_embeddings", None)
    for where, spec in (("calibration", recipe.calibration), ("evaluation", recipe.evaluation)):
        if spec is not None and isinstance(positions, int) and spec.seq_len > positions:
            raise UserError(f"{where}.seq_len is {spec.seq_len}, beyond the model's {positions} positions "
                            f"(max_position_embeddings); set {where}.seq_len to {positions} or less")


def curve_allocator(recipe: Recipe, family: ModelFamily, params: ParamModel, budget: int, shared: list[str],
                    hidden_size: int, tie_head: bool) -> CurveAllocator:
    """The `curves` allocator for this recipe: widths on the allocation grid, from `min_kept` of
    the hidden width up to all of it (the last site stays whole unless `slice_head`)."""
    spec = recipe.allocation
    step = spec.step or recipe.slicing.round_to
    low = max(step, math.ceil(spec.min_kept * hidden_size / step) * step)
    grid = sorted(set(range(low, hidden_size + 1, step)) | {hidden_size})
    choices = {site: grid for site in params.sites}
    if not (recipe.slicing.slice_head or tie_head):
        choices[params.sites[-1]] = [hidden_size]
    narrowest = params.count({site: min(widths) for site, widths in choices.items()})
    if narrowest > budget:
        raise UserError(f"the budget of {budget:,} parameters ({budget / params.original:.1%} of the original) is "
                        f"below the narrowest allocation allowed ({narrowest:,}, every site at "
                        f"allocation.min_kept={spec.min_kept}); lower allocation.min_kept")
    return CurveAllocator(params, budget, choices, shared,
                          tie_ends=family.head_width_is_embedding_width or tie_head)


def check_tie_head(config: PretrainedConfig, family: ModelFamily) -> None:
    """`slicing.tie_head` needs a tied model whose embedding writes the stream and whose head reads it."""
    if not getattr(config, "tie_word_embeddings", False):
        raise UserError("slicing.tie_head keeps a tied head tied, but this model's head is untied "
                        "(tie_word_embeddings: false); turn slicing.tie_head off")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if stream_writers(model, family)[0] is not None or stream_reader(model, family) is not model.get_submodule(family.head):
        raise UserError(f"slicing.tie_head: this {config.model_type} model projects between its embedding and the "
                        f"stream, so its head cannot share the sliced embedding; turn slicing.tie_head off")


def check_distillation(recipe: Recipe, config: PretrainedConfig, family: ModelFamily, widths: dict[str, int],
                       shared: list[str], tie_head: bool) -> None:
    """What the distillation section names exists: its LoRA targets among the student's linear
    layers (the student built on the meta device: the original class for a global layout, else the
    sliced one with its transitions), its extra TrainingArguments among transformers' and valid
    there; its device is one the Trainer can be given."""
    from compressor.distill import check_target_modules, check_training_arguments, linear_names, trainer_keys
    from compressor.budget import layout_config
    from compressor.modeling import apply_slicing_layout

    spec = recipe.distillation
    assert spec is not None
    trainer_keys(spec)
    check_training_arguments(spec)
    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(config)
    if recipe.slicing.layout != "global":
        apply_slicing_layout(student, family, layout_config(student, family, widths, shared, tie_head))
    check_target_modules(spec, linear_names(student))
    index = torch.device(recipe.device).index if recipe.device.startswith("cuda:") else None
    if index not in (None, 0) and "LOCAL_RANK" not in os.environ:
        raise UserError(f"distillation trains on the device accelerate assigns (the first visible GPU); instead of "
                        f"device: {recipe.device}, set device: cuda and CUDA_VISIBLE_DEVICES={index}")


def check_evaluation_tasks(recipe: Recipe) -> None:
    """The recipe's lm-eval task names exist (lm-eval is imported only when there are some)."""
    if recipe.evaluation is not None and recipe.evaluation.lm_eval is not None:
        from compressor.harness import check_suites

        check_suites(recipe.evaluation.lm_eval)


def recipe_fingerprint(recipe: Recipe) -> str:
    """What in the recipe decides the pruned model, with this package's version. Left out: where
    the output goes, evaluation, where model and data come from (their contents are fingerprinted
    instead) and settings that change memory use but not results (activations, H chunking), so
    a run killed for lack of memory can resume with other ones. The checkpoint holds the walk
    only, so `refinement` (after the walk, never checkpointed) is left out too: a killed run may
    resume with other refinement settings. `distillation` has its own checkpoint and fingerprint
    (`distillation_fingerprint`, with the student and its data)."""
    values = recipe.to_dict()
    for key in ("output", "evaluation", "activations", "refinement", "distillation"):
        values.pop(key, None)
    values["model"].pop("path", None)
    values["model"].pop("revision", None)
    values["calibration"].pop("dataset", None)
    for key in ("chunk", "recompute"):
        values["sensitivity"].pop(key, None)
    values["compressor"] = compressor.__version__
    return json_digest(values)


DISTILLATION_MEMORY_KEYS = ("gradient_checkpointing", "teacher")
"""Distillation settings that change memory use, not results: a resumed stage may change them."""


def distillation_fingerprint(recipe: Recipe) -> str:
    """What decides the distillation stage's result besides its data (fingerprinted apart, once
    read): its settings, the walk's recipe fingerprint and the refinement settings that made its
    student (inputs, not the student's bits: a GPU's refinement need not repeat them exactly)."""
    assert recipe.distillation is not None
    values = {k: v for k, v in dataclasses.asdict(recipe.distillation).items() if k not in DISTILLATION_MEMORY_KEYS}
    values["dataset"] = None  # its contents are fingerprinted instead
    refinement = dataclasses.asdict(recipe.refinement) if recipe.refinement is not None else None
    return json_digest({"distillation": values, "walk": recipe_fingerprint(recipe), "refinement": refinement,
                        "compressor": compressor.__version__})


def data_fingerprint(batches: list[Batch]) -> str:
    tensors = []
    for batch in batches:
        tensors += [batch.input_ids, batch.attention_mask]
        if batch.sensitivity_mask is not None:
            tensors.append(batch.sensitivity_mask)
    return tensor_digest(tensors)


def run(
    recipe: Recipe,
    registry: PluginRegistry,
    progress: Progress | None = None,
    overwrite: bool = False,
    restart: bool = False,
    resources: Resources | None = None,
    save_model: bool = True,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run a validated recipe; return the report (also written to `<output>/report.json`).

    A run to the same output that was killed or interrupted continues from its checkpoint
    when the recipe, model and data are unchanged; `restart` discards that checkpoint first.
    `resources` supplies model, data and H (a sweep shares them between its runs);
    `save_model=False` keeps only the bases (`bases.apply_bases` rebuilds the model from them).
    `warn` hears what the run goes on with but a user should know (a very large cut).
    """
    started = time.perf_counter()
    report_progress = progress or (lambda *_: None)
    checked = plan(recipe, registry)
    for warning in checked.warnings if warn is not None else ():
        warn(warning)
    device = resolve_device(recipe.device)
    if device.type != "cpu" and recipe.sensitivity.recompute is False:
        raise UserError("sensitivity.recompute: false keeps every layer's graph, and so every layer, on the device; "
                        "it is for CPU runs: leave it unset (or true) on a GPU")
    if recipe.distillation is not None:
        if not save_model:
            raise UserError("distillation changes the weights, which bases alone cannot rebuild: save the models "
                            "(a sweep's save_models: true), or remove distillation")
        if device.type == "cpu" and recipe.distillation.precision == "float16":
            raise UserError("distillation.precision: float16 has no mixed precision on CPU; use bfloat16 or float32 "
                            "(or auto)")
    ranks, device = parallel.start(device)
    if ranks.world > 1:
        if recipe.refinement is not None:
            raise UserError("refinement runs in one process: remove refinement from the recipe, or launch one process")
        if resources is not None:
            raise UserError("a sweep's runs share their data and H in one process: launch it without torchrun")
        if ranks.rank > 0:
            check_output(Path(recipe.output), overwrite)  # as rank 0 does: every rank stops at once
            return _follow(recipe, checked, device, ranks, Resources(), report_progress)
    output = Path(recipe.output)
    staging = _prepare_staging(output, overwrite)
    check_interrupted(output, recipe, restart)  # its progress kept, refused before anything is loaded
    with _locked(staging, output):
        check_output(output, overwrite)  # again, under the lock: another run may have published meanwhile
        checkpoint = Checkpoint(staging / CHECKPOINT_FOLDER)
        shutil.rmtree(staging / SCRATCH_FOLDER, ignore_errors=True)  # spill files of a killed run
        if restart:
            checkpoint.discard()
        fresh = not checkpoint.has_progress()  # else this run resumes progress made before it
        try:
            with _full_disk_is_a_user_error(output):
                report = _run_in(staging, recipe, checked, device, checkpoint, started, report_progress,
                                 resources or Resources(), save_model, ranks)
            faults.reached("publish")
            _publish(staging, output)
        except UserError as error:  # bad input found on the way: what this run created goes
            if (fresh and not isinstance(error, ProgressKept)) or not checkpoint.has_progress():
                shutil.rmtree(staging, ignore_errors=True)
            raise
        except BaseException:  # an interrupt or a crash: progress is kept, to continue from
            if not checkpoint.has_progress():
                shutil.rmtree(staging, ignore_errors=True)
            raise
    return report


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


@contextmanager
def _full_disk_is_a_user_error(output: Path) -> Iterator[None]:
    """A full disk (or quota) while writing the run or its checkpoint becomes one line; the
    caller then removes what this run wrote. safetensors reports it as its own error type."""
    try:
        yield
    except Exception as error:
        code = getattr(error, "errno", None)
        if code not in FULL_DISK and "os error 28" not in str(error) and "No space left" not in str(error):
            raise
        where = getattr(error, "filename", None) or output.parent
        raise UserError(f"no space left on the device while writing {where}: free some space there, or choose "
                        f"another --output") from None


def fisher_key(recipe: Recipe, model_fingerprint: str, data_fingerprint: str, device: torch.device) -> str:
    """What H depends on: the model (and how it computes: attention kernel, device type), the
    calibration tokens, the H pass's result-deciding options and the seed of its label sampling."""
    options = {k: v for k, v in dataclasses.asdict(recipe.sensitivity).items() if k not in ("chunk", "recompute")}
    return json_digest({"model": model_fingerprint, "data": data_fingerprint, "sensitivity": options,
                        "seed": recipe.seed, "attention": recipe.model.attn_implementation,
                        "device": device.type, "compressor": compressor.__version__})


def baseline_tasks_key(suites: list[Any], model_fingerprint: str, recipe: Recipe, tokenizer: Any,
                       device: torch.device) -> str:
    """What the original model's lm-eval scores depend on: the model, its tokenizer's chat
    template, the device type, the seed and each suite (settings, lm-eval version, local task
    and data files' bytes)."""
    if not suites:
        return ""
    from compressor.harness import suite_digest

    return json_digest({"model": model_fingerprint, "seed": recipe.seed, "device": device.type,
                        "chat_template": str(getattr(tokenizer, "chat_template", None)),
                        "attention": recipe.model.attn_implementation,
                        "suites": [suite_digest(suite) for suite in suites]})


def _prune(model: PreTrainedModel, recipe: Recipe, checked: Plan, calibration: list[Batch], device: torch.device,
           report_progress: Progress, checkpoint: Checkpoint, scratch: Path,
           fisher: dict[str, torch.Tensor] | None, ranks: Ranks) -> PruneResult:
    """The walk as the recipe asks for it: the same call on every rank of a data-parallel run."""
    return prune(model, checked.family, calibration, checked.widths, checked.pipeline, device, report_progress,
                 recipe.sensitivity, seed=recipe.seed, checkpoint=checkpoint, offload=recipe.activations,
                 scratch=scratch, fisher=fisher, correct_readers=recipe.slicing.correct_readers,
                 shared=checked.shared, allocator=checked.allocator, ranks=ranks, layout=recipe.slicing.layout,
                 pooling=recipe.slicing.pooling,
                 tie_head=checked.tie_head and recipe.slicing.layout == "per_site")


def _follow(recipe: Recipe, checked: Plan, device: torch.device, ranks: Ranks, resources: Resources,
            report_progress: Progress) -> dict[str, Any]:
    """A data-parallel run's rank above 0: the walk on its share of the calibration batches, its
    statistics summed with the others'; rank 0 writes the run folder and the checkpoint, which
    this rank only reads (to resume where rank 0 does)."""
    torch.manual_seed(recipe.seed)
    tokenizer = resources.tokenizer(recipe.model)
    calibration = resources.batches(recipe.calibration, tokenizer, "calibration")
    rows = _distillation_data(recipe, tokenizer)
    model = resources.model(recipe.model)
    ranks.barrier()  # rank 0 has prepared the staging folder and checked the checkpoint's fingerprint
    checkpoint = Checkpoint(staging_folder(Path(recipe.output)) / CHECKPOINT_FOLDER, writable=False)
    with tempfile.TemporaryDirectory(prefix=f"compress-rank{ranks.rank}-") as scratch:
        result = _prune(model, recipe, checked, calibration, device, report_progress, checkpoint, Path(scratch),
                        None, ranks)
    if recipe.distillation is not None:  # every rank trains its share; rank 0 saves
        pruned = result.model
        if recipe.slicing.layout == "global":
            pruned, _ = to_stock(pruned, checked.family, checked.config, tie=checked.tie_head,
                                 stream=head_stream(result.head_moment, result.bases[EMBEDDING]))
        _distil(recipe, checked.family, pruned, rows, staging_folder(Path(recipe.output)), device, None, Resources(),
                report_progress, ranks)
    return {"rank": ranks.rank, "world_size": ranks.world, "tokens_by_rank": result.tokens_by_rank}


def _run_in(staging: Path, recipe: Recipe, checked: Plan, device: torch.device, checkpoint: Checkpoint,
            started: float, report_progress: Progress, resources: Resources, save_model: bool,
            ranks: Ranks) -> dict[str, Any]:
    """Everything a run writes, into `staging`; returns the report."""
    config, family, kept = checked.config, checked.family, checked.kept
    timings: dict[str, float] = {}
    torch.manual_seed(recipe.seed)
    tick = time.perf_counter()
    report_progress("tokenising data", 0, 1)
    tokenizer = resources.tokenizer(recipe.model)
    calibration = resources.batches(recipe.calibration, tokenizer, "calibration")
    evaluation = resources.batches(recipe.evaluation, tokenizer, "evaluation") if recipe.evaluation else None
    distillation_rows = _distillation_data(recipe, tokenizer)  # before the walk: a data problem costs nothing
    timings["data_s"] = time.perf_counter() - tick

    tick = time.perf_counter()
    report_progress("loading model", 0, 1)
    model = resources.model(recipe.model)
    baseline_params = parameter_count(model)
    baseline_size = model_size(model)
    timings["load_s"] = time.perf_counter() - tick

    fingerprint = {"recipe": recipe_fingerprint(recipe), "model": model_digest(model),
                   "data": data_fingerprint(calibration)}
    checkpoint.start(fingerprint)
    h_key = fisher_key(recipe, fingerprint["model"], fingerprint["data"], device)
    ranks.barrier()  # the other ranks read the checkpoint once its fingerprint is checked
    tick = time.perf_counter()
    result = _prune(model, recipe, checked, calibration, device, report_progress, checkpoint,
                    staging / SCRATCH_FOLDER, resources.fisher(h_key), ranks)
    if result.fisher is not None:
        resources.keep_fisher(h_key, result.fisher)
    pruned, bases = result.model, result.bases
    timings["fisher_s"] = result.fisher_seconds  # shared work in a sweep: reported apart from the prune
    timings["prune_s"] = time.perf_counter() - tick - result.fisher_seconds

    unrefined, refinement = None, None
    one_basis = recipe.slicing.layout == "global"
    keep_tied = False if one_basis else None  # a global layout's head is decided by its stock conversion
    if recipe.refinement is not None:
        tick = time.perf_counter()
        bases, refinement = refine_bases(resources.model(recipe.model), family, calibration, result.bases,
                                         recipe.refinement, device, recipe.seed, report_progress, keep_tied)
        if refinement.kept == "refined":
            unrefined = pruned
            report_progress("applying refined bases", 0, 1)
            pruned = apply_bases(resources.model(recipe.model), family, bases, device, keep_tied=keep_tied)
        timings["refine_s"] = time.perf_counter() - tick

    stock, distillation, undistilled, original = None, None, None, None
    if recipe.distillation is not None:
        if one_basis:  # the student is what users load: the original class at the kept width
            report_progress("converting to the original architecture", 0, 1)
            pruned, stock = to_stock(pruned, family, config, tie=checked.tie_head,
                                     stream=head_stream(result.head_moment, bases[EMBEDDING]))
        tick = time.perf_counter()
        pruned, distillation, undistilled, original = _distil(recipe, family, pruned, distillation_rows, staging,
                                                              device, evaluation, resources, report_progress, ranks)
        timings["distill_s"] = time.perf_counter() - tick

    tick = time.perf_counter()
    report_progress("saving model" if save_model else "saving bases", 0, 1)
    if one_basis and distillation is None:  # the original architecture: saved, then loaded back, so what is
        pruned, stock = to_stock(pruned, family, config,  # evaluated is what users load
                                 staging / "model" if save_model else None,
                                 tie=checked.tie_head, stream=head_stream(result.head_moment, bases[EMBEDDING]))
    elif one_basis and save_model:  # already the original class (distilled): saved and loaded back likewise
        pruned.save_pretrained(staging / "model")
        pruned = load_stock(staging / "model", pruned)
    elif save_model:
        pruned.save_pretrained(staging / "model")
        write_remote_code(staging / "model", family, config.model_type)
    if save_model:
        tokenizer.save_pretrained(staging / "model")
    objectives = {site.name: site.steps for site in result.sites}
    metadata = {"objectives": json.dumps(objectives)}
    if refinement is not None:
        metadata["refinement"] = json.dumps(refinement.to_json())
    save_bases(bases, staging / BASES_FILE, metadata)
    if result.readers is not None:
        save_bases(result.readers, staging / READERS_FILE)
    timings["save_s"] = time.perf_counter() - tick

    metrics: dict[str, Any] = {}
    speed: dict[str, Any] | None = None
    if evaluation is not None:
        tick = time.perf_counter()
        report_progress("evaluating", 0, len(evaluation))
        original = (original if original is not None else resources.model(recipe.model)).to(device)
        suites = recipe.evaluation.lm_eval
        tasks_key = baseline_tasks_key(suites or [], fingerprint["model"], recipe, tokenizer, device)
        metrics = evaluate_models(original, pruned.to(device), evaluation, device, report_progress,
                                  tasks=suites, tokenizer=tokenizer, seed=recipe.seed,
                                  baseline_tasks=resources.baseline_tasks(tasks_key))
        if suites:
            resources.keep_baseline_tasks(tasks_key, metrics["baseline"]["tasks"])
        if undistilled is not None:  # measured before the distillation stage, on the same windows
            metrics["undistilled"] = undistilled
        if unrefined is not None:  # held-out KL before refinement, beside the refined model's
            report_progress("evaluating the unrefined model", 0, len(evaluation))
            metrics["unrefined"] = compare(original, unrefined.to(device), evaluation, device)["pruned"]
            del unrefined
        if recipe.evaluation.throughput:
            report_progress("measuring throughput", 0, 1)
            speed = compare_speed(original, pruned, device, **fitting_lengths([original, pruned]))
        del original
        timings["eval_s"] = time.perf_counter() - tick
    timings["total_s"] = time.perf_counter() - started

    report = {
        "compressor": compressor.__version__,
        "model": {"path": recipe.model.path, "model_type": config.model_type, "family": family.name,
                  "hidden_size": config.hidden_size, "num_layers": config.num_hidden_layers,
                  "dtype": recipe.model.dtype},
        "sparsity": recipe.sparsity,
        "target_params": recipe.target_params,
        "kept_width": kept,
        "layout": recipe.slicing.layout,
        "stock": stock,
        "rounding": checked.rounding,
        "allocation": {"method": recipe.allocation.method, "budget": checked.budget,
                       "predicted_params": checked.params.count(result.widths),
                       "transition_params": checked.params.transition_params(result.widths),
                       "shared_sites": checked.shared,
                       **({k: v for k, v in result.allocation.items() if k not in ("widths", "budget", "params")}
                          if result.allocation else {})},
        "seed": recipe.seed,
        "parallel": {"world_size": ranks.world, "tokens_by_rank": result.tokens_by_rank},
        "pipeline": [{"strategy": s.strategy, "options": s.options} for s in recipe.pipeline],
        "slicing": dataclasses.asdict(recipe.slicing),
        "fingerprint": fingerprint,
        "resumed_from": result.resumed_from,
        "resume": {"sites_loaded": result.loaded_sites, "fisher_loaded": result.fisher_loaded},
        "fisher_source": result.fisher_source,
        "refinement": refinement.to_json() if refinement is not None else None,
        "distillation": distillation.to_json() if distillation is not None else None,
        "metrics": metrics,
        "params": {"baseline": baseline_params, "pruned": parameter_count(pruned),
                   "ratio": parameter_count(pruned) / baseline_params},
        "size": {"baseline": baseline_size, "pruned": model_size(pruned)},
        "speed": speed,
        "warnings": list(checked.warnings),
        "sites": [site.to_json() for site in result.sites],
        "timings": timings,
        "environment": {"device": str(device), "torch": torch.__version__,
                        "transformers": transformers.__version__, "python": platform.python_version()},
    }
    (staging / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (staging / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    write_markdown(report, staging / "report.md")
    if distillation is not None:
        distillation_figure({"held-out KL": distillation.curve}).savefig(staging / "distillation.png", dpi=120,
                                                                         bbox_inches="tight")
    return report


def _distillation_data(recipe: Recipe, tokenizer: Any) -> Any:
    """The distillation stage's windows (None without one)."""
    if recipe.distillation is None:
        return None
    from compressor.distill import distillation_data

    return distillation_data(recipe.distillation, tokenizer)


def _distil(recipe: Recipe, family: ModelFamily, student: PreTrainedModel, data: Any, staging: Path,
            device: torch.device, evaluation: list[Batch] | None, resources: Resources, report_progress: Progress,
            ranks: Ranks) -> tuple[PreTrainedModel, Any, dict[str, float] | None, PreTrainedModel]:
    """The distillation stage on every rank: the original as teacher (beside the student, or its
    targets cached layer by layer), the student's evaluation-window KL before (rank 0, when the
    recipe evaluates), then `distill.distill` on `data` (read before the walk). Returns the
    student, the stage's record, the before-metrics and the original (reused for evaluation). A
    bad setting found here keeps the walk's checkpoint, to continue from once it is fixed."""
    from compressor.distill import CachedTeacher, LiveTeacher, cached_targets, distill

    spec = recipe.distillation
    assert spec is not None
    original = resources.model(recipe.model)
    undistilled = None
    if evaluation is not None and ranks.rank == 0:
        report_progress("evaluating the undistilled model", 0, len(evaluation))
        undistilled = compare(original.to(device), student.to(device), evaluation, device)["pruned"]
    if spec.teacher == "cached":
        original.to("cpu")
        student.to("cpu")
        store = ActivationStore(device, recipe.activations, staging / SCRATCH_FOLDER)  # `activations: disk` spills
        teacher: Any = CachedTeacher(cached_targets(original, family, data.train + data.heldout, spec.top_k, device,
                                                    spec.batch_size, report_progress, store))
    else:
        teacher = LiveTeacher(original, spec.top_k)
    fingerprint = {"settings": distillation_fingerprint(recipe),
                   "data": tensor_digest([row["input_ids"] for row in data.train + data.heldout]),
                   "world": str(ranks.world)}
    folder = staging / CHECKPOINT_FOLDER / DISTILLATION_FOLDER
    try:
        student, record = distill(student, teacher, data, spec, folder, device, fingerprint, recipe.seed,
                                  report_progress, ranks.world)
    except UserError as error:
        if isinstance(error, ProgressKept):
            raise
        raise ProgressKept(f"{error} (the walk's progress is kept in {staging}: fix that and run the same command "
                           f"to continue)") from None
    return student, record, undistilled, original
