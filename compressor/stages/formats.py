"""The formats a run saves its model in, and which of them llama.cpp's converter reads: the one
decision `Save` (through `stages.exporters`, which writes each format) and `compress export` (which
reads a saved folder) share. Stdlib only, like `commands.gguf`, which runs beside llama.cpp's own Python:
a saved folder's format is told from its `config.json` alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SavedFormat:
    """One format of a saved `model/` folder."""

    name: str
    description: str
    recognises: Callable[[dict[str, Any]], bool]
    """Whether a saved config.json (as a dict) is in this format."""
    gguf_refusal: str | None = None
    """None: llama.cpp's converter reads this format; else why not and what to prune with instead."""
    own_code: bool = False
    """Its modelling code is the run's own, written beside the weights, which transformers loads only
    with `trust_remote_code` (DeciLM); the per-site classes are registered by `import compressor`."""


PER_SITE = SavedFormat(
    "per-site",
    "the sliced_<model_type> class (a basis per site, transition matrices on the residual path), "
    "its code written beside the weights (trust_remote_code)",
    lambda config: str(config.get("model_type", "")).startswith("sliced_"),
    "a class llama.cpp does not read; prune with slicing.layout: global (saved as the original class) or "
    "heterogeneous (DeciLM) to serve it",
)
DECILM = SavedFormat(
    "decilm",
    "DeciLM (nemotron-nas): each layer's MLP width and attention its own, this project's code beside the weights",
    lambda config: "block_configs" in config,
    own_code=True,
)
VISION_LANGUAGE = SavedFormat(
    "vision-language",
    "the whole vision-language checkpoint as its own class, its text tower pruned",
    lambda config: isinstance(config.get("text_config"), dict),
)
ORIGINAL = SavedFormat(
    "original",
    "the original class at the pruned widths (stock transformers loads it)",
    lambda config: True,
)

FORMATS: tuple[SavedFormat, ...] = (PER_SITE, DECILM, VISION_LANGUAGE, ORIGINAL)
"""Every format, the most particular first: a folder is in the first that recognises its config."""


def saved_format(config: dict[str, Any]) -> SavedFormat:
    """The format of a saved folder whose config.json is `config`."""
    return next(found for found in FORMATS if found.recognises(config))
