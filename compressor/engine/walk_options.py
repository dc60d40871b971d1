"""What `engine.walk.prune` is handed beside the layout (`WalkOptions`), what it returns
(`PruneResult`), the width allocator it may be given, and what its phases share (`PruneCall`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import PreTrainedModel

from compressor.engine.checkpoint import Checkpoint
from compressor.engine.parallel import Ranks
from compressor.engine.pooling import (
    Pooled,
    ProgressCallback,
    SiteRecord,
)
from compressor.models.families import ModelFamily
from compressor.models.layout import SlicedLayout
from compressor.recipe.sections.sensitivity import SensitivityOptions

if TYPE_CHECKING:
    from compressor.engine.survey import SurveyMemo


class WidthAllocator(Protocol):
    """Chooses every site's kept width from statistics of the original model (`compressor.engine.allocation`)."""

    requires: tuple[str, ...]

    def observe(self, site: str, C: torch.Tensor, H: torch.Tensor | None) -> None: ...

    def widths(self) -> dict[str, int]: ...

    def to_json(self, widths: Mapping[str, int]) -> dict[str, Any]: ...


@dataclass
class PruneResult:
    model: PreTrainedModel
    sites: list[SiteRecord]
    slicing: dict[str, Any]
    bases: Mapping[str, torch.Tensor]
    """Each site's kept directions V_s (d × k_s, float64, on the host), keyed by site id (a walk
    that writes as it goes leaves them in the checkpoint's files: `OnDisk`)."""
    readers: Mapping[str, torch.Tensor] | None = None
    """With `correct_readers`: each site's reader map R_s (d × k_s, float64, host; on disk like the bases)."""
    resumed_from: str | None = None
    """The first site this call chose after loading finished sites from a checkpoint."""
    loaded_sites: int = 0
    fisher_loaded: bool = False
    fisher: Mapping[str, torch.Tensor] | None = None
    """H by site (host, accumulation dtype) when the pipeline used it, so a caller can reuse it
    (a walk that writes as it goes leaves it in the checkpoint: `OnDisk`)."""
    fisher_source: str | None = None
    """Where H came from: "computed", "checkpoint", "given" (by the caller), or None (not used)."""
    widths: dict[str, int] = field(default_factory=dict)
    """The kept width of every site (given, or chosen by the allocator)."""
    allocation: dict[str, Any] | None = None
    """The allocator's record (budget, predicted loss, curves), when one chose the widths."""
    tokens_by_rank: list[int] = field(default_factory=list)
    """Calibration tokens each rank walked (one entry in a single process)."""
    head_moment: torch.Tensor | None = None
    """Global layout: C of the last site's stream (d × d, host), what the head reads."""
    fisher_seconds: float = 0.0
    """Time this call spent computing H (0 when H was given, loaded or not needed): work a
    sweep's runs share, reported apart from the prune time."""
    written_before: int = 0
    """`write_to`: layers a killed walk had written there, found committed and not written again."""
    stock: dict[str, Any] | None = None
    """`write_to` with one basis: the stock conversion's record (`models.stock.stock_record`), the
    model having been written as the original class."""
    walked: Pooled | None = None
    """Global layout with `WalkOptions.pool_walked`, a walk that loaded no site: every site's C as
    the sliced model makes it (SliceGPT's statistics: earlier sites sliced), pooled like the
    survey's, H as given."""


@dataclass
class PruneCall:
    """What the phases of one `prune` call share: the model, its layout and the device it visits,
    how progress is said, the ranks and the checkpoint."""

    model: PreTrainedModel
    layout: SlicedLayout
    device: torch.device
    report: ProgressCallback
    ranks: Ranks
    checkpoint: Checkpoint | None
    tie_head: bool
    """The walk keeps the head tied (a per-site layout's tie; a global one ties at export)."""
    correct_readers: bool

    @property
    def family(self) -> ModelFamily:
        return self.layout.family

    @property
    def ids(self) -> list[str]:
        return list(self.layout.sites)

    @property
    def shared(self) -> tuple[str, ...]:
        return self.layout.reused

    @property
    def one_basis(self) -> bool:
        return self.layout.one_basis


@dataclass(frozen=True)
class WalkOptions:
    """How the walk runs, beside the layout it makes: where, what it does with the activations,
    how it estimates H, and two choices of the recipe's `slicing` that change no shape."""

    device: torch.device | str = "cpu"
    sensitivity: SensitivityOptions = field(default_factory=SensitivityOptions)
    seed: int = 0
    offload: str = "host"
    """"host": calibration activations in memory; "disk": memory-mapped files under `scratch`."""
    scratch: Path | None = None
    correct_readers: bool = False
    """What reads each site's stream reads it through the least-squares reader map (`bases.reader_map`)."""
    pooling: str = "trace"
    """How a global layout sums the sites' statistics (`GlobalPool`)."""
    write_to: Path | None = None
    """Write the sliced model there as the walk goes (`engine.written`): each layer when finished,
    then dropped from memory, the bases left in the checkpoint's files; the returned model's
    layers are read back from that folder when a pass needs them. With one basis (the global
    layout) the model is written as the original class (`models.stock`; a tied head by the
    diagonal fit: the symmetric fit rotates every layer after the walk, so it is not written so)."""
    max_shard_size: int | str = "50GB"
    """The written model's shards, split as `save_pretrained` splits them."""
    pool_walked: bool = False
    """Global layout: pool every site's C (and H) as the sliced model makes them, for
    `PruneResult.walked` (SliceGPT's statistics, `benchmarks/global_statistics.py`); off, the walk
    holds no d × d sums beyond the site it is on."""
    allocator: WidthAllocator | None = None
    """Chooses the widths of a layout without them, from the survey's statistics."""
    checkpoint: Checkpoint | None = None
    """Where H and every finished site are saved, and reused from."""
    fisher: Mapping[str, torch.Tensor] | None = None
    """H of this model, data, options and seed, given (a sweep's earlier run): not estimated again."""
    ranks: Ranks | None = None
    """The data-parallel group (by default the initialised `torch.distributed` one, if any)."""
    progress: ProgressCallback | None = None
    """Hears each phase and site as the walk reaches it."""
    survey: SurveyMemo | None = None
    """Keeps the survey of the original model for the next walk over the same model, data and H
    (a split choice's trials, then the run's walk): its statistics do not depend on the widths."""


def check_model(run: PruneCall) -> None:
    """The layout was made for this model (its widths checked when it was made); a tied head
    needs a model whose head weight is its embedding weight."""
    model, layout = run.model, run.layout
    shape = (model.config.num_hidden_layers, model.config.hidden_size)
    if shape != (layout.config.num_hidden_layers, layout.config.hidden_size):
        raise ValueError(
            f"the layout is for {layout.config.num_hidden_layers} layers of width "
            f"{layout.config.hidden_size}, the model has {shape[0]} of width {shape[1]}"
        )
    if run.tie_head:
        head, embedding = model.get_submodule(layout.family.head), model.get_submodule(layout.family.embedding)
        if head.weight is not embedding.weight:
            raise ValueError("tie_head needs a model whose head weight is its embedding weight")
