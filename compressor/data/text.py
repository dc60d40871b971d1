"""Text datasets to token windows: tokenise each non-empty record (with the tokenizer's own
special tokens), append EOS, concatenate in order, cut consecutive windows of `seq_len`."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from compressor.data.batches import Batch
from compressor.errors import UserError, first_line
from compressor.hub import dataset_advice


def load_records(dataset: Mapping[str, Any], streaming: bool = False) -> Iterable[Mapping[str, Any]]:
    """`datasets.load_dataset(**dataset)` (split defaults to "train"), with readable errors."""
    import datasets

    kwargs = dict(dataset)
    kwargs.setdefault("split", "train")
    if streaming:
        kwargs["streaming"] = True
    try:
        return datasets.load_dataset(**kwargs)
    except Exception as error:  # datasets raises many types; all mean "cannot read this dataset"
        hint = "" if is_local(dataset) else dataset_advice()
        raise UserError(f"cannot load dataset {kwargs.get('path')!r}: {first_line(error)}{hint}") from None


def is_local(dataset: Mapping[str, Any]) -> bool:
    """Whether a dataset spec reads local files (a loader such as json with data_files, or a folder)."""
    path = dataset.get("path")
    return "data_files" in dataset or "data_dir" in dataset or (isinstance(path, str) and os.path.exists(path))


def first_record(dataset: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The dataset's first record, streamed: a check of its fields that reads nothing more."""
    records = load_records(dataset, streaming=True)
    try:
        return next(iter(records), None)
    except Exception as error:  # a malformed first line, an unreadable file
        raise UserError(f"cannot read dataset {dataset.get('path')!r}: {first_line(error)}") from None


def _texts(records: Iterable[Mapping[str, Any]], field: str) -> Iterator[str]:
    for index, record in enumerate(records):
        if field not in record:
            raise UserError(
                f"dataset record {index} has no field '{field}' (fields: {', '.join(record)}); "
                f"set text_field in the recipe"
            )
        yield record[field]


RECORDS_PER_CALL = 64
"""Records the tokenizer gets in one call while `token_windows` reads: enough to amortise the
call, few enough that it reads hardly more records than the windows need."""


def token_windows(
    records: Iterable[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    num_samples: int,
    text_field: str = "text",
    minimum: int | None = None,
) -> torch.Tensor:
    """The first `num_samples` windows of `seq_len` tokens, as a (num_samples, seq_len) tensor;
    with `minimum`, as many as the dataset holds up to `num_samples`, refused below `minimum`.

    Reads only as many records as it needs.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the tokenizer has no EOS token; windows are separated by EOS")
    needed = seq_len * num_samples
    stream: list[int] = []
    pending: list[str] = []

    def flush() -> None:
        for ids in tokenizer(pending, verbose=False)["input_ids"]:
            stream.extend(ids)
            stream.append(eos)
        pending.clear()

    for index, text in enumerate(_texts(records, text_field)):
        if text is None or (isinstance(text, str) and not text.strip()):  # blank: only BOS/EOS noise
            continue
        if not isinstance(text, str):
            raise UserError(f"dataset record {index}: field '{text_field}' is {type(text).__name__}, not text")
        pending.append(text)
        if len(pending) == RECORDS_PER_CALL:
            flush()
            if len(stream) >= needed:
                break
    if pending:
        flush()
    found = min(num_samples, len(stream) // seq_len)
    if found < (num_samples if minimum is None else minimum):
        wanted = "num_samples is" if minimum is None else "it needs at least"
        raise UserError(
            f"the dataset yields {found} windows of {seq_len} tokens, "
            f"but {wanted} {num_samples if minimum is None else minimum}; lower that or seq_len, or use more data"
        )
    return torch.tensor(stream[: found * seq_len], dtype=torch.long).view(found, seq_len)


def batches_of(windows: torch.Tensor, batch_size: int) -> list[Batch]:
    """Full (unpadded) windows grouped into batches."""
    return [Batch(chunk, torch.ones_like(chunk)) for chunk in windows.split(batch_size)]
