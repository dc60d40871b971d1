"""Chat calibration: conversations rendered with the tokenizer's chat template, with a mask of
the assistant-response tokens (the outputs whose sensitivity the chat recipes measure).

With `{% generation %}` markers in the template, transformers computes the mask. Without them,
the conversation is rendered prefix by prefix: the text an assistant message adds after the
generation prompt is its span. That needs a prefix-stable template (each rendering extends
the previous one); anything else is refused rather than guessed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from compressor.data.batches import Batch
from compressor.errors import UserError

GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")

Messages = Sequence[Mapping[str, Any]]


def _render(tokenizer: PreTrainedTokenizerBase, messages: Messages, prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=prompt)


def _spans_by_prefix(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the character spans of the assistant responses in it."""
    text, spans = "", []
    for k, message in enumerate(messages):
        head = _render(tokenizer, messages[:k], prompt=True) if message["role"] == "assistant" else text
        rendered = _render(tokenizer, messages[: k + 1])
        if not head.startswith(text) or not rendered.startswith(head):
            raise UserError(
                "the chat template is not prefix-stable (rendering a conversation prefix by prefix does not "
                "extend the text), so assistant tokens cannot be located; use a template with "
                "{% generation %} markers"
            )
        if message["role"] == "assistant":
            spans.append((len(head), len(rendered)))
        text = rendered
    return text, spans


def assistant_tokens(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask of its assistant-response tokens."""
    template = tokenizer.chat_template
    if not template:
        raise UserError("the tokenizer has no chat template; chat calibration (format: chat) needs one")
    if GENERATION_MARKER.search(template if isinstance(template, str) else str(template)):
        out = tokenizer.apply_chat_template(
            list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), list(out["assistant_masks"])
    text, spans = _spans_by_prefix(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(start <= begin < end for start, end in spans)) for begin, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


@dataclass(frozen=True)
class ChatRequest:
    """Which conversations `chat_batches` takes and how it batches them: what a calibration set or
    a distillation dataset asks of its records."""

    seq_len: int
    """Each conversation truncated to this many tokens."""
    num_samples: int
    """The first this many conversations."""
    batch_size: int
    messages_field: str = "messages"
    minimum: int | None = None
    """With it: as many conversations as there are up to `num_samples`, refused below this."""


def chat_batches(
    records: Iterable[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase, request: ChatRequest
) -> list[Batch]:
    """The first `num_samples` conversations (with `minimum`: as many as there are up to that,
    refused below `minimum`), each truncated to `seq_len` tokens and right-padded within its batch.
    `sensitivity_mask` marks the positions whose *next* token is an assistant token: the outputs
    that predict the response, and the activations that generate it."""
    seq_len, num_samples, minimum = request.seq_len, request.num_samples, request.minimum
    messages_field = request.messages_field
    rows: list[tuple[list[int], list[int]]] = []
    for index, record in enumerate(records):
        if len(rows) == num_samples:
            break
        if messages_field not in record:
            raise UserError(
                f"dataset record {index} has no field '{messages_field}' "
                f"(fields: {', '.join(record)}); set messages_field in the recipe"
            )
        try:
            ids, mask = assistant_tokens(tokenizer, record[messages_field])
        except TemplateError as error:
            raise UserError(f"dataset record {index}: the chat template refused the conversation: {error}") from None
        except (TypeError, KeyError, AttributeError):
            raise UserError(
                f"dataset record {index}: '{messages_field}' must be a list of {{role, content}} messages"
            ) from None
        except NotImplementedError:
            raise UserError(
                "chat calibration needs a fast tokenizer (character offsets); this tokenizer has none"
            ) from None
        rows.append((ids[:seq_len], mask[1 : seq_len + 1] + [0] * (len(mask) <= seq_len)))
    if len(rows) < (num_samples if minimum is None else minimum):
        wanted = f"num_samples is {num_samples}" if minimum is None else f"it needs at least {minimum}"
        raise UserError(f"the dataset has {len(rows)} conversations, but {wanted}; lower that or use more data")
    if not any(any(mask) for _, mask in rows):
        raise UserError(
            f"no assistant tokens remain within seq_len={seq_len} in the {len(rows)} conversations; "
            f"raise seq_len (output sensitivity is measured on assistant tokens only)"
        )
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    batches = []
    for start in range(0, len(rows), request.batch_size):
        chunk = rows[start : start + request.batch_size]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        real = torch.zeros((len(chunk), width), dtype=torch.long)
        assistant = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (tokens, mask) in enumerate(chunk):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            real[row, : len(tokens)] = 1
            assistant[row, : len(mask)] = torch.tensor(mask)
        batches.append(Batch(ids, real, assistant))
    return batches
