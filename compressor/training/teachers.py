"""What distillation trains on: the distillation data as rows (plain text windows or chat turns
with their assistant mask), and the teacher's targets for them, computed live from the original
on the device or cached once, layer by layer, and kept off the device (`cached_targets`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compressor.data.batches import Batch
from compressor.data.chat import ChatRequest, chat_batches
from compressor.data.text import batches_of, load_records, token_windows
from compressor.engine.activations import ActivationStore, held_on
from compressor.engine.calibration import capture_layer_inputs
from compressor.engine.layerwise import decoder_layers, visit_layers
from compressor.engine.refine import TeacherTarget, teacher_target
from compressor.errors import UserError
from compressor.models.families import ModelFamily
from compressor.recipe.sections.distillation import DistillationSpec

Progress = Callable[[str, int, int], None]
Row = dict[str, torch.Tensor]


@dataclass
class DistillationData:
    """Training rows and held-out rows (never trained on), each a dict of 1-D tensors:
    `input_ids`, `attention_mask`, `loss_mask` (the positions that count) and `row` (an index
    over both lists, training rows first, for a cached teacher)."""

    train: list[Row]
    heldout: list[Row]
    seq_len: int


def _rows(batches: list[Batch], first: int = 0) -> list[Row]:
    rows: list[Row] = []
    for batch in batches:
        counted = batch.attention_mask if batch.sensitivity_mask is None else batch.sensitivity_mask
        for i in range(batch.input_ids.shape[0]):
            rows.append(
                {
                    "input_ids": batch.input_ids[i],
                    "attention_mask": batch.attention_mask[i],
                    "loss_mask": (counted[i].bool() & batch.attention_mask[i].bool()).long(),
                    "row": torch.tensor(first + len(rows)),
                }
            )
    return rows


def distillation_data(spec: DistillationSpec, tokenizer: PreTrainedTokenizerBase) -> DistillationData:
    """Windows of the distillation dataset: enough for the token budget (fewer when the dataset is
    smaller: training then repeats them), the last `heldout_windows` of them held out."""
    assert spec.seq_len is not None and spec.dataset is not None
    wanted = math.ceil(spec.tokens / spec.seq_len) + spec.heldout_windows
    least = spec.heldout_windows + 1
    try:
        records = load_records(spec.dataset)
        if spec.format == "chat":
            request = ChatRequest(spec.seq_len, wanted, 1, spec.messages_field or "messages", minimum=least)
            batches = chat_batches(records, tokenizer, request)
        else:
            windows = token_windows(records, tokenizer, spec.seq_len, wanted, spec.text_field or "text", minimum=least)
            batches = batches_of(windows, 1)
    except UserError as error:
        raise UserError(f"distillation: {error} (held-out windows included)") from None
    rows = _rows(batches)
    return DistillationData(rows[: -spec.heldout_windows], rows[-spec.heldout_windows :], spec.seq_len)


def collate(rows: list[Row]) -> dict[str, torch.Tensor]:
    """Rows right-padded to the longest (chat rows differ in length; pads count for nothing)."""
    width = max(int(row["input_ids"].shape[0]) for row in rows)
    out: dict[str, torch.Tensor] = {}
    for key in ("input_ids", "attention_mask", "loss_mask"):
        out[key] = torch.stack([F.pad(row[key], (0, width - row[key].shape[0])) for row in rows])
    out["row"] = torch.stack([row["row"] for row in rows])
    return out


class Teacher(Protocol):
    def target(self, inputs: dict[str, torch.Tensor], counted: torch.Tensor) -> TeacherTarget: ...


class LiveTeacher:
    """The original model beside the student: its targets computed for every batch."""

    def __init__(self, model: PreTrainedModel, top_k: int) -> None:
        self.model = model.eval().requires_grad_(False)
        self.top_k = top_k

    @torch.no_grad()
    def target(self, inputs: dict[str, torch.Tensor], counted: torch.Tensor) -> TeacherTarget:
        logits = self.model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False
        ).logits
        return teacher_target(logits, counted, self.top_k, host=False)


class CachedTeacher:
    """Targets computed once for every row (`cached_targets`, by row id) and kept on the host."""

    def __init__(self, targets: dict[int, TeacherTarget]) -> None:
        self.targets = targets

    def target(self, inputs: dict[str, torch.Tensor], counted: torch.Tensor) -> TeacherTarget:
        return TeacherTarget.cat([self.targets[int(row)] for row in inputs["row"]], counted.device)


@torch.no_grad()
def cached_targets(
    model: PreTrainedModel,
    family: ModelFamily,
    rows: list[Row],
    spec: DistillationSpec,
    store: ActivationStore,
    progress: Progress,
) -> dict[int, TeacherTarget]:
    """Every row's teacher target (by its `row` id, the section's `top_k` bins), computed as the H
    pass runs the model: one layer on the store's device at a time over all rows, `batch_size` rows
    a batch (their activations in `store`: on the host, or spilled to disk), then the head."""
    device, top_k, batch_size = store.device, spec.top_k, spec.batch_size
    batches = [collate(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
    inputs = capture_layer_inputs(
        model, family, [Batch(b["input_ids"], b["attention_mask"]) for b in batches], device, store
    )
    try:
        layers = len(decoder_layers(model, family))
        for index, layer in visit_layers(model, family, device, read_only=True):
            progress(f"distillation: teacher targets, layer {index + 1}/{layers}", index, layers + 1)
            for b in range(len(batches)):
                out = layer(inputs.hidden.get(b, device), **inputs.kwargs(b, index, device))
                inputs.hidden.put(b, out[0] if isinstance(out, tuple) else out)
        targets: dict[int, TeacherTarget] = {}
        with held_on(family.head_modules(model), device, read_only=True):
            for b, batch in enumerate(batches):
                counted = batch["loss_mask"].bool().to(device)
                whole = teacher_target(family.logits(model, inputs.hidden.get(b, device)), counted, top_k)
                sizes = batch["loss_mask"].sum(1).tolist()
                parts = [whole.values.split(sizes)]
                parts += [None if t is None else t.split(sizes) for t in (whole.indices, whole.tail)]
                for i, row in enumerate(batch["row"].tolist()):
                    targets[row] = TeacherTarget(
                        parts[0][i],
                        None if parts[1] is None else parts[1][i],
                        None if parts[2] is None else parts[2][i],
                    )
        progress("distillation: teacher targets", layers + 1, layers + 1)
        return targets
    finally:
        inputs.hidden.close()
