"""What a run loads: model, config and tokenizer (one-line errors, offline advice), the device,
and the data windows; `Resources`, which a sweep replaces with one that shares them."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

from compressor.data.batches import Batch
from compressor.data.chat import ChatRequest, chat_batches
from compressor.data.text import batches_of, first_record, load_records, token_windows
from compressor.engine.refine import rebatch
from compressor.errors import UserError, first_line
from compressor.hub import cached, model_advice, unreachable
from compressor.models.towers import text_fields, text_model, tower_for
from compressor.recipe.sections.data import DataSpec
from compressor.recipe.sections.model import ModelSpec
from compressor.runtime.staging import RUN_MARKER
from compressor.validation import replaced, shown

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
            raise UserError(
                f"model '{spec.path}' ships its own Python code (auto_map in its config), which is not run "
                f"unless the recipe sets model.trust_remote_code: true (read that code first)"
            ) from None
        hint = model_advice(error) if on_hub else ""
        raise UserError(f"cannot load {what}: {first_line(error)}{hint}") from None


DIMENSIONS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)
"""Config fields a model is built from: each, where set, a positive integer."""

MAX_LAYERS = 1024
"""More layers than any published model has (Llama 3.1 405B: 126); beyond it a config is a mistake,
and building it on the meta device alone would take minutes."""

MAX_WIDTH = 1 << 22
"""More than any published model's widths, heads or vocabulary (4,194,304; Gemma 3's vocabulary:
262,144); beyond it a config is a mistake whose tensor sizes overflow the memory plan's arithmetic."""


def load_config(spec: ModelSpec) -> PretrainedConfig:
    """The model's config, its dimensions checked (`check_dimensions`); a config.json that is not a
    JSON object, or whose fields transformers cannot read, is a one-line UserError."""
    what = f"the config of model '{spec.path}'"
    local = Path(spec.path) / "config.json"
    if local.is_file():
        try:
            raw = json.loads(local.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise UserError(f"cannot load {what}: {local} is not JSON ({first_line(error)})") from None
        if not isinstance(raw, dict):
            raise UserError(f"cannot load {what}: {local} must be a JSON object of fields, got {type(raw).__name__}")
        check_dimensions(text_fields(raw), what)  # before transformers divides by them
    try:
        config = _load(
            what,
            spec,
            lambda: AutoConfig.from_pretrained(
                spec.path, revision=spec.revision, trust_remote_code=spec.trust_remote_code
            ),
        )
    except (TypeError, ZeroDivisionError, StrictDataclassError) as error:  # a field the config class refuses
        problem = first_line(error.__cause__ if isinstance(error, StrictDataclassError) and error.__cause__ else error)
        raise UserError(f"cannot load {what}: config.json: {problem}") from None
    text = getattr(config, "text_config", None)
    check_dimensions(vars(text if isinstance(text, PretrainedConfig) else config), what)
    return config


def check_dimensions(fields: Mapping[str, Any], what: str) -> None:
    """Every dimension the model is built from (`fields`: a config's) is a positive integer, the
    layers not more than `MAX_LAYERS` and the rest not more than `MAX_WIDTH`: a negative width or
    zero heads would fail deep inside transformers, a million layers would take minutes to build."""
    for key in DIMENSIONS:
        value = fields.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"cannot load {what}: config.json's {key} must be a positive integer, got {shown(value)}")
        if key != "num_hidden_layers" and value > MAX_WIDTH:
            raise UserError(
                f"cannot load {what}: config.json's {key} is {value:,}, more than any model has "
                f"(compressor takes at most {MAX_WIDTH:,})"
            )
    layers = fields.get("num_hidden_layers")
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise UserError(
            f"cannot load {what}: config.json's num_hidden_layers is {layers:,}, more than any model has "
            f"(compressor takes at most {MAX_LAYERS:,})"
        )


def load_model(spec: ModelSpec, placement: dict[str, Any] | None = None) -> PreTrainedModel:
    """The model `spec` names; a run folder's model only from safetensors (nothing in a run
    folder is ever unpickled). `model.load: stream` gives a shell whose layers are read when a
    pass reaches them (`engine.streaming`). `placement`: accelerate's `device_map`, `max_memory`
    and `offload_folder`, handed to `from_pretrained` (the model spread over GPUs, host and disk)."""
    if spec.load == "stream":  # `auto` is decided by the run's memory plan; anywhere else it means memory
        return _streamed(spec)
    tower = tower_for(load_config(spec))
    if tower is not None:  # a vision-language checkpoint: its text model (`models.towers`)
        return text_model(load_whole(spec, placement), tower)
    return _from_pretrained(AutoModelForCausalLM, spec, placement)


def load_whole(spec: ModelSpec, placement: dict[str, Any] | None = None) -> PreTrainedModel:
    """A vision-language checkpoint as its own class, vision encoder included."""
    return _from_pretrained(AutoModelForImageTextToText, spec, placement)


def _from_pretrained(auto: Any, spec: ModelSpec, placement: dict[str, Any] | None) -> PreTrainedModel:
    from_run = (Path(spec.path).parent / RUN_MARKER).is_file()
    return _load(
        f"model '{spec.path}'",
        spec,
        lambda: auto.from_pretrained(
            spec.path,
            revision=spec.revision,
            dtype=getattr(torch, spec.dtype),
            attn_implementation=spec.attn_implementation,
            trust_remote_code=spec.trust_remote_code,
            **({"use_safetensors": True} if from_run else {}),
            **dequantized(spec),
            **(placement or {}),
        ),
    ).eval()


def dequantized(spec: ModelSpec) -> dict[str, Any]:
    """Loading arguments that give a checkpoint with MXFP4 experts (gpt-oss's, on the hub) its
    experts in the run's dtype: pruning rewrites every weight, and transformers' MXFP4 kernels,
    where installed, would keep them packed where no linear can read them."""
    quantization = getattr(load_config(spec), "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def _streamed(spec: ModelSpec) -> PreTrainedModel:
    """A local folder, or a hub model's files in the cache (fetched there first where the hub can
    be reached): its safetensors shards streamed."""
    from compressor.engine.streaming import streamed_model
    from compressor.models.families import family_for

    folder = Path(spec.path)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors"]
        folder = Path(
            _load(
                f"model '{spec.path}'",
                spec,
                lambda: snapshot_download(spec.path, revision=spec.revision, allow_patterns=patterns),
            )
        )
    config = load_config(spec)
    try:
        family = family_for(config.model_type)
    except UserError as error:
        raise UserError(f"model.load: stream supports the built-in families: {error}") from None
    return streamed_model(
        folder,
        family,
        getattr(torch, spec.dtype),
        config,
        attn_implementation=spec.attn_implementation,
        trust_remote_code=spec.trust_remote_code,
    )


def load_tokenizer(spec: ModelSpec) -> Any:
    return _load(
        f"the tokenizer of '{spec.path}'",
        spec,
        lambda: AutoTokenizer.from_pretrained(
            spec.path, revision=spec.revision, trust_remote_code=spec.trust_remote_code
        ),
    )


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
            request = ChatRequest(spec.seq_len, spec.num_samples, spec.batch_size, spec.messages_field)
            return chat_batches(records, tokenizer, request)
        windows = token_windows(records, tokenizer, spec.seq_len, spec.num_samples, spec.text_field)
    except UserError as error:
        raise UserError(f"{where}: {error}") from None
    return batches_of(windows, spec.batch_size)


def heldout_batches(spec: DataSpec, tokenizer: Any, count: int, where: str) -> list[Batch]:
    """`count` windows of `spec`'s dataset that follow its `num_samples` windows (read by the same
    reader, so the windows before them are the calibration windows themselves): text no step
    that trains on the calibration windows has seen, for the held-out guard (`reports.guard`)."""
    try:
        rows = token_batches(replaced(spec, num_samples=spec.num_samples + count), tokenizer, where)
    except UserError:
        raise UserError(
            f"{where}.heldout_windows: {count} windows after the {spec.num_samples} calibration windows "
            f"need {spec.num_samples + count} windows of {spec.seq_len} tokens, more than the calibration "
            f"dataset holds; lower {where}.heldout_windows or calibration.num_samples, or give more "
            f"text"
        ) from None
    joined = rebatch(rows, sum(len(b.input_ids) for b in rows))[0]
    counted = joined.sensitivity_mask
    return [
        Batch(
            joined.input_ids[start : start + spec.batch_size],
            joined.attention_mask[start : start + spec.batch_size],
            None if counted is None else counted[start : start + spec.batch_size],
        )
        for start in range(spec.num_samples, spec.num_samples + count, spec.batch_size)
    ]


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
        raise UserError(
            f"{where}: the dataset's records have no field '{name}' (fields: {', '.join(record)}); "
            f"set {where}.{key} in the recipe"
        )


class Resources:
    """Where a run gets its tokenizer, data windows, model and H. This one loads everything
    afresh and keeps nothing; a sweep's (`compressor.commands.sweep.SharedResources`) keeps what its
    runs share, so each is loaded or computed once."""

    def tokenizer(self, spec: ModelSpec) -> Any:
        return load_tokenizer(spec)

    def batches(self, spec: DataSpec, tokenizer: Any, where: str) -> list[Batch]:
        return token_batches(spec, tokenizer, where)

    def model(self, spec: ModelSpec) -> PreTrainedModel:
        """A model the caller may change (pruning works in place); a streamed shell with `model.load: stream`."""
        return load_model(spec)

    def whole_model(self, spec: ModelSpec) -> PreTrainedModel:
        """The original in memory, for a stage that runs it whole (evaluation, refinement, a teacher)."""
        return self.model(replaced(spec, load="memory"))

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
