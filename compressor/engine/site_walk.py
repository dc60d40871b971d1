"""One walk down the model, site by site (`SiteWalk`): the activation store, the basis the stored
activations still have to be projected on, and the sites chosen or loaded so far. `prune`'s walk,
its survey of the original model and the memory plan's fake layer all go through it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compressor import faults
from compressor.engine.bases import (
    prediction_error,
    reader_map,
)
from compressor.engine.calibration import LayerInputs, SecondMoment
from compressor.engine.checkpoint import Checkpoint, OnDisk, SavedSite, restore_rng
from compressor.engine.parallel import Ranks
from compressor.engine.pooling import (
    Pooled,
    SiteChooser,
    SiteRecord,
)
from compressor.errors import UserError


@dataclass(frozen=True)
class SitePlan:
    """How a walk that chooses settles its sites (a survey's walk, which only measures, needs
    none): the chooser and the kept widths, the sites a checkpoint already holds and the one that
    keeps the chosen ones, and which sites keep an earlier site's basis instead of choosing."""

    chooser: SiteChooser | None = None
    widths: Mapping[str, int] = field(default_factory=dict)
    saved: Mapping[str, SavedSite] = field(default_factory=dict)
    checkpoint: Checkpoint | None = None
    correct_readers: bool = False
    shared: Collection[str] = ()
    """Sites that keep the previous site's basis (the layout's reused sites)."""
    copies: Mapping[str, str] = field(default_factory=dict)
    """Sites that keep an earlier site's basis (site → that site), e.g. a tied head's."""
    bases_on_disk: bool = False
    """Leave the bases in the checkpoint's site files (a walk that writes as it goes)."""


class SiteWalk:
    """The state of one walk down the model: the activation store, the basis the stored
    activations still have to be projected on, and the sites chosen or loaded so far (as `plan`
    says; without one, the walk only measures)."""

    def __init__(
        self,
        inputs: LayerInputs,
        device: torch.device,
        plan: SitePlan | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        plan = plan or SitePlan()
        self.inputs, self.device, self.chooser, self.widths = inputs, device, plan.chooser, plan.widths
        self.ranks = ranks or Ranks()
        """Data-parallel: each site's C is summed over the ranks' batches before anything reads it."""
        self.saved, self.checkpoint, self.correct_readers = plan.saved, plan.checkpoint, plan.correct_readers
        self.shared = set(plan.shared)
        self.copies = dict(plan.copies)
        """Sites that keep an earlier site's basis (site → that site), e.g. a tied head's."""
        on_disk = plan.bases_on_disk and plan.checkpoint is not None and plan.checkpoint.writable
        self.readers: dict[str, torch.Tensor] | OnDisk = OnDisk() if on_disk else {}
        self.width = inputs.hidden.host(0).shape[-1]  # d: the stream is stored in full coordinates
        self.pending: torch.Tensor | None = None
        self.records: list[SiteRecord] = []
        self.bases: dict[str, torch.Tensor] | OnDisk = OnDisk() if on_disk else {}
        """Every basis so far: in memory, or (`bases_on_disk`, with a checkpoint this process
        writes) left in the checkpoint's site files and read when asked; a data-parallel rank that
        writes no checkpoint then keeps only the bases a later site copies. Readers alike."""
        self.drop_bases = plan.bases_on_disk and not on_disk
        self.resumed_from: str | None = None

    def advance(
        self, site: str, block: Callable[..., torch.Tensor] | None, layer: int, measure: bool = False
    ) -> SecondMoment | None:
        """Push every batch through `block` (None: just read the stream); return C of the result
        unless the site is already finished (a replay needs the activations, not their
        statistics) and not to be `measure`d all the same."""
        if site in self.saved and block is None and not measure:
            return None  # nothing to compute and nothing to change
        moment = None if site in self.saved and not measure else SecondMoment(self.width, self.device)
        store = self.inputs.hidden
        for b in range(len(store)):
            hidden = store.get(b, self.device)
            if block is not None:
                if self.pending is not None:
                    hidden = hidden @ self.pending.to(hidden.dtype)
                hidden = block(hidden, **self.inputs.kwargs(b, layer, self.device))
                store.put(b, hidden)
            if moment is not None:
                moment.add(hidden, self.inputs.token_masks[b], self.inputs.token_counts[b])
        return None if moment is None else moment.sum_over(self.ranks)

    def look_ahead(self, block: Callable[..., torch.Tensor], layer: int) -> SecondMoment:
        """C after `block` run on the stored stream, which stays as it is: the statistics of the
        next site as the unsliced block would make them (the block must not be opened yet)."""
        moment = SecondMoment(self.width, self.device)
        store = self.inputs.hidden
        for b in range(len(store)):
            hidden = block(store.get(b, self.device), **self.inputs.kwargs(b, layer, self.device))
            moment.add(hidden, self.inputs.token_masks[b], self.inputs.token_counts[b])
        return moment.sum_over(self.ranks)

    def settle(
        self,
        site: str,
        moment: SecondMoment | None,
        pooled: Callable[[], list[tuple[str, SecondMoment]]] | None = None,
        given: Callable[[], Pooled] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The site's kept basis and what reads its stream (the basis, or with `correct_readers`
        its reader map): loaded from the checkpoint, or chosen now and checkpointed. `pooled`
        gives (only if the basis is chosen now) the C of later sites that will keep this basis;
        their statistics join this site's in the choice. `given` gives the whole problem instead
        (a global layout's: every site's statistics, pooled)."""
        if site in self.saved:
            return self._load(site)
        assert moment is not None
        if self.saved and self.resumed_from is None:
            self.resumed_from = site
        basis, record = self._choose(site, moment, pooled, given)
        return self._commit(site, moment, basis, record)

    def _load(self, site: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A finished site's basis and reader as the checkpoint holds them, checked against this
        run's widths, with its record and the RNG state it left (so a replay draws on as before)."""
        entry = self.saved[site]
        saved = entry.basis
        if tuple(saved.shape) != (self.width, self.widths[site]):
            raise UserError(
                f"the checkpoint's basis for {site} has shape {tuple(saved.shape)}, which this "
                f"run's widths do not allow; rerun with --restart to discard the checkpoint"
            )
        if self.correct_readers and not entry.has_reader:
            raise UserError(f"the checkpoint has no reader map for {site}; rerun with --restart")
        self.records.append(SiteRecord.from_json(entry.record))
        restore_rng(entry.rng)
        self._keep(site, saved, entry.path)
        self.pending = basis = saved.to(self.device)
        reader = basis
        if self.correct_readers:
            saved_reader = entry.reader
            assert saved_reader is not None
            self._keep(site, saved_reader, entry.path, "reader")
            reader = saved_reader.to(self.device)
        return basis, reader

    def _choose(
        self,
        site: str,
        moment: SecondMoment,
        pooled: Callable[[], list[tuple[str, SecondMoment]]] | None,
        given: Callable[[], Pooled] | None,
    ) -> tuple[torch.Tensor, SiteRecord]:
        """The basis chosen now and its record: an earlier site's kept as it is (a shared site, a
        tied head), or the pipeline's choice from this site's statistics (and `pooled`, or `given`)."""
        if site in self.shared or site in self.copies:  # keeps an earlier site's basis: nothing to choose
            assert self.pending is not None and self.records
            source = self.copies.get(site, self.records[-1].name)
            basis = self.bases[source].to(self.device) if site in self.copies else self.pending
            record = SiteRecord(
                name=site,
                width=self.width,
                kept=self.widths[site],
                tokens=moment.tokens,
                steps=[{"strategy": "shared", "objectives": {"with": source}}],
            )
            return basis, record
        assert self.chooser is not None
        problem = given() if given is not None else self.chooser.pool(site, moment, pooled() if pooled else ())
        return self.chooser.choose(self.widths[site], problem)

    def _commit(
        self, site: str, moment: SecondMoment, basis: torch.Tensor, record: SiteRecord
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the chosen site (its reader map fitted with `correct_readers`), save it to the
        checkpoint before anything else can fail, and keep it; returns the basis and its reader."""
        reader = basis
        if self.correct_readers:
            C = moment.value()
            reader = reader_map(C, basis)
            record.correction = {
                "error_basis": prediction_error(C, basis, basis),
                "error_reader": prediction_error(C, basis, reader),
            }
        self.records.append(record)
        path = None
        if self.checkpoint is not None:
            path = self.checkpoint.save_site(
                len(self.records) - 1, site, basis, record.to_json(), reader if self.correct_readers else None
            )
        faults.reached(f"site:{site}")
        self._keep(site, basis, path)
        if self.correct_readers:
            self._keep(site, reader, path, "reader")
        self.pending = basis
        return basis, reader

    def _keep(self, site: str, tensor: torch.Tensor, path: Path | None, key: str = "basis") -> None:
        """Keep the site's basis (or reader map): its place in the checkpoint, or the tensor."""
        kept = self.bases if key == "basis" else self.readers
        if isinstance(kept, OnDisk) and path is not None:
            kept.places[site] = (path, key)
        elif not self.drop_bases or site in self.copies.values():
            kept[site] = tensor.to("cpu")
