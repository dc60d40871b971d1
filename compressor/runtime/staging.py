"""Where a run writes: the output folder's checks, the hidden staging folder beside it, its lock,
and publishing it in one rename once everything succeeded (a failed run leaves no half-written
output; a killed one leaves its checkpoint in the staging folder, to continue from)."""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from compressor.engine.checkpoint import Checkpoint
from compressor.errors import ProgressKept, UserError

RUN_MARKER = "report.json"
"""A folder holding this file was written by a run, and only such a folder is ever replaced."""


RUN_FILES = ".run-files"
"""The list of files a run wrote (relative paths, one per line), written as it is published:
`--overwrite` replaces a previous run only when its folder holds nothing else."""


def list_run_files(folder: Path) -> list[str]:
    """Every file under `folder` (relative POSIX paths, sorted), and every empty folder (with a
    trailing slash), except the manifest itself."""
    found = []
    for path in sorted(folder.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                found.append(path.relative_to(folder).as_posix() + "/")
        elif path.name != RUN_FILES or path.parent != folder:
            found.append(path.relative_to(folder).as_posix())
    return found


LEGACY_RUN_FILES = (
    "report.json",
    "report.md",
    "recipe.yaml",
    "bases.safetensors",
    "readers.safetensors",
    "model/config.json",
    "model/generation_config.json",
    "model/*.safetensors",
    "model/model.safetensors.index.json",
    "model/tokenizer*",
    "model/special_tokens_map.json",
    "model/added_tokens.json",
    "model/chat_template.jinja",
    "model/vocab.*",
    "model/merges.txt",
    "model/modeling_sliced.py",
    "model/configuration_sliced.py",
)
"""What a run wrote before runs listed their files: a folder from then is judged by these names."""


def foreign_files(output: Path) -> list[str]:
    """What in a previous run's folder that run did not write (a user's notes, a copied file).
    A folder from before runs listed their files (no `.run-files`) is judged by the names a run
    writes (`LEGACY_RUN_FILES`)."""
    try:
        written = set((output / RUN_FILES).read_text().splitlines())
        return [name for name in list_run_files(output) if name not in written]
    except OSError:
        return [
            name
            for name in list_run_files(output)
            if not any(fnmatch.fnmatchcase(name, pattern) for pattern in LEGACY_RUN_FILES)
        ]


def check_output(output: Path, overwrite: bool) -> None:
    """The output may be new, an empty folder, or (with `overwrite`) a previous run's folder
    that holds only what that run wrote.

    Anything else is refused even with `overwrite`: a run never deletes files it did not write.
    """
    if output.is_symlink():
        raise UserError(f"output {output} is a symbolic link; give the folder it points to")
    if not output.exists():
        return
    if not output.is_dir():
        raise UserError(f"output {output} exists and is not a folder; choose another --output")
    if not any(output.iterdir()):
        return
    if not (output / RUN_MARKER).is_file():
        raise UserError(
            f"output folder {output} is not empty and holds no previous run ({RUN_MARKER}); choose another --output"
        )
    if not overwrite:
        raise UserError(f"output folder {output} already holds a run; pass --overwrite or choose another --output")
    foreign = foreign_files(output)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserError(
            f"output folder {output} holds files the previous run did not write ({shown}); --overwrite "
            f"replaces only a run's own files: move them out of the folder, or choose another --output"
        )


def check_writable(output: Path) -> None:
    """The output's nearest existing ancestor is a folder this process may write in."""
    parent = output.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write the output folder {output}: {parent} is not a folder this user can write in; "
            f"choose another --output"
        )


CHECKPOINT_FOLDER = "checkpoint"


SCRATCH_FOLDER = "scratch"
"""Activations spilled to disk (`activations: disk`); removed at every start and before publishing."""


LOCK_FILE = ".lock"


def staging_folder(output: Path) -> Path:
    """Where a run to `output` is built, and where its checkpoint lives until it is published."""
    return output.parent / f".{output.name}.partial"


def prepare_staging(output: Path, overwrite: bool) -> Path:
    """The staging folder beside the output; a previous attempt's is kept, to resume from."""
    check_output(output, overwrite)
    staging = staging_folder(output)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        if staging.is_symlink() or (staging.exists() and not staging.is_dir()):
            raise UserError(f"{staging} is in the way of the run's staging folder; remove it")
        staging.mkdir(exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create the output folder {output}: {error.strerror or error}") from None
    return staging


@contextmanager
def locked(staging: Path, output: Path) -> Iterator[None]:
    """Hold the staging folder for this process: a second run to the same output is refused.
    The lock file is never unlinked while held; it leaves with the folder (published or removed)."""
    try:
        handle = open(staging / LOCK_FILE, "w")
    except FileNotFoundError:  # another run removed its staging folder just now
        raise UserError(f"another run to {output} has just ended; run the command again") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        handle.close()
        if error.errno in (errno.EAGAIN, errno.EACCES):
            raise UserError(
                f"another run is writing to {output} "
                f"(its staging folder {staging} is locked); wait for it or choose another --output"
            ) from None
        raise
    try:
        yield
    finally:
        handle.close()


def _current_umask() -> int:
    """The process umask, read without setting it where the OS allows (os.umask is process-wide)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _give_default_modes(folder: Path) -> None:
    """The modes a plain `mkdir`/`open` would have given (mkdtemp makes the staging folder 0700,
    and the safetensors writer makes its file 0600), so the published run is readable as usual.
    Best effort: a filesystem that refuses chmod must not cost a finished run."""
    mask = _current_umask()
    try:
        folder.chmod(0o777 & ~mask)
        for path in folder.rglob("*"):
            if not path.is_symlink():
                path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
    except OSError:
        pass


def publish(staging: Path, output: Path) -> None:
    """Put the finished run in place; a previous run is moved aside first and removed last.
    The checkpoint goes only once the run is in place (until then a failure can still resume),
    and the lock file last, while it is still held."""
    shutil.rmtree(staging / SCRATCH_FOLDER, ignore_errors=True)
    written = [name for name in list_run_files(staging) if name.split("/")[0] not in (LOCK_FILE, CHECKPOINT_FOLDER)]
    (staging / RUN_FILES).write_text("".join(f"{name}\n" for name in written))
    _give_default_modes(staging)
    previous = None
    try:
        if output.exists():  # check_output allowed only an empty folder or a previous run's
            previous = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            output.rename(previous / output.name)
        staging.rename(output)
    except OSError as error:
        if previous is not None:  # put the previous run back, and leave no empty folder aside
            if (previous / output.name).exists() and not output.exists():
                (previous / output.name).rename(output)
            shutil.rmtree(previous, ignore_errors=True)
        raise ProgressKept(
            f"cannot put the finished run in place at {output}: {error.strerror or error}; progress is "
            f"kept in {staging}: fix that and run the same command to continue"
        ) from None
    Checkpoint(output / CHECKPOINT_FOLDER).discard()
    (output / LOCK_FILE).unlink(missing_ok=True)
    if previous is not None:
        shutil.rmtree(previous)


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


@contextmanager
def full_disk_is_a_user_error(output: Path) -> Iterator[None]:
    """A full disk (or quota) while writing the run or its checkpoint becomes one line; the
    caller then removes what this run wrote. safetensors reports it as its own error type."""
    try:
        yield
    except Exception as error:
        code = getattr(error, "errno", None)
        if code not in FULL_DISK and "os error 28" not in str(error) and "No space left" not in str(error):
            raise
        where = getattr(error, "filename", None) or output.parent
        raise UserError(
            f"no space left on the device while writing {where}: free some space there, or choose another --output"
        ) from None
