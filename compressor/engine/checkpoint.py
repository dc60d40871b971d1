"""Per-site checkpoints: what a killed run needs to continue from its last finished site.

A checkpoint folder holds a fingerprint of what the run depends on (recipe, model, data), H once
computed, the widths once allocated, and one file per finished site (its kept basis, its report record and the RNG states
after it). Every file is written to a temporary name, flushed to disk and renamed into place,
so a kill at any moment leaves either the old state or the new one. The fingerprint is written
first and removed first: site files without one are never trusted. Only safetensors and JSON
are read back: nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from compressor.engine.streaming import streamed
from compressor.errors import UserError

FINGERPRINT_FILE = "fingerprint.json"
FISHER_FILE = "fisher.safetensors"
ALLOCATION_FILE = "allocation.json"
SPLIT_FILE = "split.json"
DEPTH_FILE = "depth.json"
"""The split of the budget between the residual and the MLP width, once a run has chosen it."""
DISTILLATION_FOLDER = "distillation"
"""The distillation stage's Trainer checkpoints (`compressor.training.distill`)."""
TRAINER_CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE_FILE = "trainer_state.json"
"""How transformers' Trainer names its checkpoints there, and the file it writes last in each."""
SITES_FOLDER = "sites"
WRITTEN_FILE = "written.json"
"""The tensors of the output's shards written so far by a walk that writes as it goes (`engine.written`)."""


def _read_tensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(name)


@dataclass
class SavedSite:
    path: Path
    record: dict[str, Any]
    rng: dict[str, torch.Tensor]
    has_reader: bool = False

    @property
    def basis(self) -> torch.Tensor:
        """Read from the site's file when asked (a 70B walk resumes without all its bases in memory)."""
        return _read_tensor(self.path, "basis")

    @property
    def reader(self) -> torch.Tensor | None:
        """The site's reader map, when readers are corrected."""
        return _read_tensor(self.path, "reader") if self.has_reader else None


class OnDisk(Mapping[str, torch.Tensor]):
    """Tensors left in safetensors files and read when asked (key → file and tensor name): what a
    walk that writes as it goes keeps instead of every site's basis and H in memory."""

    def __init__(self, places: Mapping[str, tuple[Path, str]] | None = None) -> None:
        self.places: dict[str, tuple[Path, str]] = dict(places or {})

    def __getitem__(self, key: str) -> torch.Tensor:
        return _read_tensor(*self.places[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.places)

    def __len__(self) -> int:
        return len(self.places)

    def meta(self, key: str) -> torch.Tensor:
        """A meta tensor of the stored shape and dtype (nothing read but the header and no rows)."""
        path, name = self.places[key]
        with safe_open(str(path), framework="pt") as handle:
            stored = handle.get_slice(name)
            shape, dtype = stored.get_shape(), stored[:0].dtype
        return torch.empty(shape, dtype=dtype, device="meta")


def digest(parts: Iterable[bytes]) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


def json_digest(value: Any) -> str:
    return digest([json.dumps(value, sort_keys=True, default=str).encode()])


def tensor_digest(tensors: Iterable[torch.Tensor]) -> str:
    return digest(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def model_digest(model: torch.nn.Module, sample: int = 4096) -> str:
    """The config (rope, norm eps, soft-caps…) and, for every tensor, its name, shape, dtype and an
    evenly strided sample of its values: tells two checkpoints apart without hashing tens of GB. A
    streamed model's digest equals the same model's in memory (each unread tensor read once here)."""
    config = getattr(model, "config", None)
    values = {} if config is None else config.to_dict()
    for key in ("_name_or_path", "transformers_version"):
        values.pop(key, None)
    parts = [json.dumps(values, sort_keys=True, default=str).encode()]
    source = streamed(model)
    for name, tensor in model.state_dict().items():
        if tensor.is_meta and source is not None:  # a streamed layer not read yet: its values from the shards
            tensor = source.index.read(name).to(tensor.dtype)
            source.index.close()  # one shard mapped at a time
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // sample)
        parts.append(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        parts.append(flat[::step].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest(parts)


def write_atomic(path: Path, write: Any) -> None:
    """Write through a temporary file, flushed to disk before it is renamed into place."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        write(temporary)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
    except BaseException:  # a full disk, an interrupt: no half-written file stays behind
        temporary.unlink(missing_ok=True)
        raise
    os.replace(temporary, path)


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            states[f"rng_cuda_{index}"] = state
    return states


def restore_rng(states: Mapping[str, torch.Tensor]) -> None:
    """Put back the RNG states saved with a site (CPU, and each GPU's where there are GPUs)."""
    torch.set_rng_state(states["rng"])
    cuda = [states[key] for key in sorted(states) if key.startswith("rng_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def trainer_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """The Trainer's checkpoint folders in `folder` (`checkpoint-<step>`), newest first."""
    start = len(TRAINER_CHECKPOINT_PREFIX)
    found = [(int(p.name[start:]), p) for p in folder.glob(f"{TRAINER_CHECKPOINT_PREFIX}*") if p.name[start:].isdigit()]
    return sorted(found, reverse=True)


class Checkpoint:
    """A run's resumable state in `folder` (inside the run's staging folder). A data-parallel
    run's other ranks read it (`writable=False`: their saves are skipped; rank 0 writes)."""

    def __init__(self, folder: Path, writable: bool = True) -> None:
        self.folder = folder
        self.sites_folder = folder / SITES_FOLDER
        self.writable = writable

    def start(self, fingerprint: Mapping[str, str]) -> None:
        """Begin, or continue a run with the same fingerprint; a different one is refused when
        the checkpoint holds progress (else it is simply replaced)."""
        path = self.folder / FINGERPRINT_FILE
        if path.is_file():
            saved = json.loads(path.read_text())
            changed = sorted(key for key in set(saved) | set(fingerprint) if saved.get(key) != fingerprint.get(key))
            if not changed:
                return
            if self.has_progress():
                raise UserError(
                    f"an interrupted run in {self.folder.parent} was started with a different "
                    f"{' and '.join(changed)}; rerun with --restart to discard it"
                )
        self.discard()  # no fingerprint: whatever is left cannot be trusted
        self.sites_folder.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda p: p.write_text(json.dumps(dict(fingerprint), indent=2) + "\n"))

    def discard(self) -> None:
        """Remove the checkpoint, fingerprint first, so that a kill half-way leaves nothing trusted."""
        (self.folder / FINGERPRINT_FILE).unlink(missing_ok=True)
        shutil.rmtree(self.folder, ignore_errors=True)

    def has_progress(self) -> bool:
        return (
            self.has_fisher()
            or any((self.folder / name).is_file() for name in (ALLOCATION_FILE, SPLIT_FILE, DEPTH_FILE))
            or bool(self.site_files())
            or self.has_distillation_progress()
        )

    def has_fisher(self) -> bool:
        return (self.folder / FISHER_FILE).is_file()

    def site_files(self) -> list[Path]:
        """The finished sites' files, in the order they were chosen."""
        return sorted(self.sites_folder.glob("[0-9]*.safetensors"))

    def distillation_step(self) -> int | None:
        """The step of the newest Trainer checkpoint of the distillation stage whose state file
        (written last) is there; None without one."""
        complete = [
            step
            for step, path in trainer_checkpoints(self.folder / DISTILLATION_FOLDER)
            if (path / TRAINER_STATE_FILE).is_file()
        ]
        return complete[0] if complete else None

    def has_distillation_progress(self) -> bool:
        return self.distillation_step() is not None

    def fisher_on_disk(self) -> OnDisk | None:
        """H by site, each read from the checkpoint when asked; None before H is saved."""
        path = self.folder / FISHER_FILE
        if not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as handle:
            return OnDisk({site: (path, site) for site in handle.keys()})

    def load_fisher(self) -> dict[str, torch.Tensor] | None:
        path = self.folder / FISHER_FILE
        if not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as handle:
            return {site: handle.get_tensor(site) for site in handle.keys()}

    def save_fisher(self, fisher: Mapping[str, torch.Tensor]) -> None:
        if not self.writable:
            return
        tensors = {site: h.detach().cpu().contiguous() for site, h in fisher.items()}
        write_atomic(self.folder / FISHER_FILE, lambda p: save_file(tensors, str(p)))

    def drop_fisher(self) -> None:
        """Forget the saved H (it was another model's: the split choice kept blocks this run's model is without)."""
        if self.writable:
            (self.folder / FISHER_FILE).unlink(missing_ok=True)

    def load_allocation(self) -> dict[str, Any] | None:
        """The widths an allocator chose (and its record), once chosen."""
        return self._load_choice(ALLOCATION_FILE)

    def save_allocation(self, allocation: Mapping[str, Any]) -> None:
        self._save_choice(ALLOCATION_FILE, allocation)

    def load_split(self) -> dict[str, Any] | None:
        """The split of the budget a run chose between the residual and the MLP's width (`mlp`), once chosen."""
        return self._load_choice(SPLIT_FILE)

    def save_split(self, split: Mapping[str, Any]) -> None:
        self._save_choice(SPLIT_FILE, split)

    def load_depth(self) -> dict[str, Any] | None:
        """The decoder blocks a run chose to remove (`depth`) and what it chose them from, once chosen."""
        return self._load_choice(DEPTH_FILE)

    def save_depth(self, depth: Mapping[str, Any]) -> None:
        self._save_choice(DEPTH_FILE, depth)

    def _load_choice(self, name: str) -> dict[str, Any] | None:
        """A choice made once per run (a small JSON file), or None before it is made."""
        path = self.folder / name
        return json.loads(path.read_text()) if path.is_file() else None

    def _save_choice(self, name: str, value: Mapping[str, Any]) -> None:
        if self.writable:
            write_atomic(self.folder / name, lambda p: p.write_text(json.dumps(dict(value)) + "\n"))

    @property
    def written_record(self) -> Path | None:
        """Where a walk that writes as it goes records the tensors it wrote (None: another rank writes)."""
        return self.folder / WRITTEN_FILE if self.writable else None

    def save_site(
        self, position: int, site: str, basis: torch.Tensor, record: dict[str, Any], reader: torch.Tensor | None = None
    ) -> Path | None:
        """The site's file (None where another rank writes it)."""
        if not self.writable:
            return None
        tensors = {"basis": basis.detach().to("cpu", torch.float64).contiguous(), **_rng_states()}
        if reader is not None:
            tensors["reader"] = reader.detach().to("cpu", torch.float64).contiguous()
        metadata = {"site": site, "record": json.dumps(record)}
        path = self.sites_folder / f"{position:05d}.safetensors"
        write_atomic(path, lambda p: save_file(tensors, str(p), metadata=metadata))
        return path

    def finished_sites(self) -> dict[str, SavedSite]:
        """Finished sites in the order they were chosen (their bases read from disk when asked)."""
        saved = {}
        for path in self.site_files():
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata()
                saved[metadata["site"]] = SavedSite(
                    path=path,
                    record=json.loads(metadata["record"]),
                    rng={key: handle.get_tensor(key) for key in handle.keys() if key.startswith("rng")},
                    has_reader="reader" in handle.keys(),
                )
        return saved
