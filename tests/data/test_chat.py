"""Chat calibration: the assistant mask covers exactly the assistant tokens, with or without
generation markers in the template; templates that cannot be read are refused."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from compressor.data.chat import ChatRequest, assistant_tokens, chat_batches
from compressor.errors import UserError
from tests.conftest import EXAMPLES

CONVERSATION = [
    {"role": "user", "content": "How do I list files?"},
    {"role": "assistant", "content": "Use ls -la."},
    {"role": "user", "content": "And hidden ones?"},
    {"role": "assistant", "content": "ls -a shows them."},
]
NO_MARKERS = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|eos|>"
    "{% else %}<|assistant|>{{ m['content'] }}<|eos|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def tokenizer():
    return AutoTokenizer.from_pretrained(EXAMPLES / "ref-llama")


def expected(tokenizer) -> tuple[list[int], list[int]]:
    """Built piece by piece: role tags and user turns are 0, assistant content and its EOS are 1."""
    ids, mask = [], []
    for message in CONVERSATION:
        tag = "<|user|>" if message["role"] == "user" else "<|assistant|>"
        body = tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids += tokenizer.convert_tokens_to_ids([tag]) + body
        mask += [0] + [int(message["role"] == "assistant")] * len(body)
    return ids, mask


def test_mask_from_generation_markers(tokenizer) -> None:
    assert "{% generation %}" in tokenizer.chat_template
    assert assistant_tokens(tokenizer, CONVERSATION) == expected(tokenizer)


def test_mask_from_prefix_rendering_without_markers(tokenizer) -> None:
    tokenizer.chat_template = NO_MARKERS
    assert assistant_tokens(tokenizer, CONVERSATION) == expected(tokenizer)


def test_template_that_is_not_prefix_stable_is_refused(tokenizer) -> None:
    # Puts a turn count in front: every rendering changes the beginning of the text.
    tokenizer.chat_template = "{{ messages|length }} turns: " + NO_MARKERS
    with pytest.raises(UserError, match="not prefix-stable"):
        assistant_tokens(tokenizer, CONVERSATION)


def test_missing_template_is_refused(tokenizer) -> None:
    tokenizer.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        assistant_tokens(tokenizer, CONVERSATION)


def test_chat_batches_pad_truncate_and_mark(tokenizer) -> None:
    short = [CONVERSATION[0], CONVERSATION[1]]
    records = [{"messages": CONVERSATION}, {"messages": short}, {"messages": CONVERSATION}]
    batches = chat_batches(records, tokenizer, ChatRequest(seq_len=20, num_samples=3, batch_size=2))
    full_ids, full_mask = expected(tokenizer)
    first = batches[0]
    assert first.input_ids.shape == (2, 20)
    assert first.input_ids[0].tolist() == full_ids[:20]
    # position t counts when token t+1 is an assistant token: it predicts (generates) the response
    assert first.sensitivity_mask[0].tolist() == full_mask[1:21]
    short_ids, short_mask = assistant_tokens(tokenizer, short)
    short_len = len(short_ids)
    assert first.attention_mask[1].tolist() == [1] * short_len + [0] * (20 - short_len)
    assert first.sensitivity_mask[1, :short_len].tolist() == short_mask[1:] + [0]
    assert first.sensitivity_mask[1, short_len:].sum() == 0
    assert batches[1].input_ids.shape[0] == 1
    with pytest.raises(UserError, match="has 3 conversations"):
        chat_batches(records, tokenizer, ChatRequest(seq_len=20, num_samples=4, batch_size=2))


def test_conversation_the_template_rejects_is_a_user_error(tokenizer) -> None:
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('system messages are not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    records = [{"messages": CONVERSATION}, {"messages": [{"role": "system", "content": "be brief"}] + CONVERSATION}]
    with pytest.raises(UserError, match="record 1: the chat template refused the conversation: system messages"):
        chat_batches(records, tokenizer, ChatRequest(seq_len=20, num_samples=2, batch_size=2))


def test_the_first_assistant_token_is_predicted_from_the_prompt(tokenizer) -> None:
    """The output at the last prompt position (<|assistant|>) predicts the answer's first token."""
    batch = chat_batches(
        [{"messages": CONVERSATION[:2]}], tokenizer, ChatRequest(seq_len=64, num_samples=1, batch_size=1)
    )[0]
    ids = batch.input_ids[0].tolist()
    first_answer = ids.index(tokenizer.convert_tokens_to_ids("<|assistant|>"))
    assert batch.sensitivity_mask[0, first_answer] == 1
    assert batch.sensitivity_mask[0, first_answer - 1] == 0
    assert batch.sensitivity_mask[0, -1] == 0  # the final EOS predicts nothing of the answer


@pytest.mark.parametrize(
    ("messages", "seq_len", "message"),
    [
        ("hi", 64, "must be a list of {role, content} messages"),
        (CONVERSATION, 3, "no assistant tokens remain within seq_len=3"),
    ],
)
def test_unusable_conversations_are_user_errors(tokenizer, messages, seq_len: int, message: str) -> None:
    with pytest.raises(UserError, match=message):
        chat_batches([{"messages": messages}], tokenizer, ChatRequest(seq_len=seq_len, num_samples=1, batch_size=1))
