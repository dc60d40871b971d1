"""What every consumer of text reads: token windows in batches, with their masks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """Token ids, their padding mask (1 = real token) and, optionally, the tokens that count
    for output-sensitivity statistics (e.g. assistant tokens of a chat; default: all real)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    sensitivity_mask: torch.Tensor | None = None
