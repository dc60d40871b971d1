"""Datasets become consecutive, non-overlapping windows of tokenised records joined by EOS."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from compressor.data.text import batches_of, token_windows
from compressor.errors import UserError
from tests.conftest import EXAMPLES

RECORDS = [{"text": "fn main() { println!(\"hi\"); }"}, {"text": "set nocompatible"}, {"text": "man ls"}] * 10


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EXAMPLES / "ref-llama")


def test_windows_are_the_eos_joined_token_stream_cut_in_order(tokenizer) -> None:
    stream: list[int] = []
    for record in RECORDS:
        stream += tokenizer(record["text"])["input_ids"] + [tokenizer.eos_token_id]
    assert stream[0] == tokenizer.bos_token_id  # the tokenizer's own special tokens are kept
    with_blanks = [RECORDS[0], {"text": ""}, {"text": " \n"}, {"text": None}, *RECORDS[1:]]  # blanks carry nothing
    windows = token_windows(with_blanks, tokenizer, seq_len=7, num_samples=5, chunk=4)
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
