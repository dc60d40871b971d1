"""Datasets become consecutive, non-overlapping windows of tokenised records joined by EOS."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import compressor.data.text
from compressor.data.text import batches_of, load_records, token_windows
from compressor.errors import UserError
from tests.conftest import EXAMPLES

RECORDS = [{"text": 'fn main() { println!("hi"); }'}, {"text": "set nocompatible"}, {"text": "man ls"}] * 10


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EXAMPLES / "ref-llama")


def test_windows_are_the_eos_joined_token_stream_cut_in_order(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compressor.data.text, "RECORDS_PER_CALL", 4)  # several tokenizer calls
    stream: list[int] = []
    for record in RECORDS:
        stream += tokenizer(record["text"])["input_ids"] + [tokenizer.eos_token_id]
    assert stream[0] == tokenizer.bos_token_id  # the tokenizer's own special tokens are kept
    with_blanks = [RECORDS[0], {"text": ""}, {"text": " \n"}, {"text": None}, *RECORDS[1:]]  # blanks carry nothing
    windows = token_windows(with_blanks, tokenizer, seq_len=7, num_samples=5)
    assert windows.shape == (5, 7)
    assert windows.flatten().tolist() == stream[:35]


def test_too_few_tokens_is_a_user_error(tokenizer) -> None:
    with pytest.raises(UserError, match="yields 0 windows of 4096 tokens"):
        token_windows(RECORDS[:2], tokenizer, seq_len=4096, num_samples=1)


def test_batches_cover_all_windows_without_padding(tokenizer) -> None:
    windows = token_windows(RECORDS, tokenizer, seq_len=5, num_samples=7)
    batches = batches_of(windows, batch_size=3)
    assert [b.input_ids.shape[0] for b in batches] == [3, 3, 1]
    assert all(b.attention_mask.all() for b in batches)


def test_a_non_text_field_is_a_user_error(tokenizer) -> None:
    with pytest.raises(UserError, match="record 1: field 'text' is int, not text"):
        token_windows([RECORDS[0], {"text": 7}], tokenizer, seq_len=4, num_samples=1)


def test_the_guard_windows_follow_the_calibration_windows(tokenizer) -> None:
    """The held-out guard reads the windows after the calibration set: the same reader, so they
    continue the calibration windows' token stream and none of them is a calibration window."""
    from compressor.recipe.sections.data import DataSpec
    from compressor.runtime.loading import heldout_batches, token_batches

    spec = DataSpec(
        dataset={"path": "json", "data_files": str(EXAMPLES / "data" / "calib-demo.jsonl")},
        num_samples=5,
        seq_len=32,
        batch_size=2,
    )
    calibration = torch.cat([b.input_ids for b in token_batches(spec, tokenizer, "calibration")])
    heldout = heldout_batches(spec, tokenizer, 3, "refinement")
    assert [b.input_ids.shape for b in heldout] == [(2, 32), (1, 32)]
    longer = token_windows(load_records(spec.dataset), tokenizer, 32, 8)
    assert torch.equal(longer[:5], calibration)
    assert torch.equal(torch.cat([b.input_ids for b in heldout]), longer[5:])
    with pytest.raises(UserError, match="^refinement.heldout_windows: 100000 windows after the 5 calibration windows"):
        heldout_batches(spec, tokenizer, 100_000, "refinement")
