"""Paths in a recipe: relative ones resolve against the recipe file's folder; `bundled:NAME` is a
file or folder the package ships (the demo model `bundled:ref-llama` and its text
`bundled:data/calib-demo.jsonl`, `bundled:data/valid-demo.jsonl`), wherever the recipe lies; a
model is a local folder or a hub id; a missing reference file says where the reference data is
expected.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from compressor.errors import UserError
from compressor.validation import shown


def _is_remote(path: str) -> bool:
    return "://" in path


BUNDLED = "bundled:"
"""A recipe path's prefix for what the package ships (`compressor_demo`: the checkout's `examples/`
demo model and text)."""


def bundled(name: str) -> Path:
    """The shipped file or folder `name` (`ref-llama`, `data/calib-demo.jsonl`); a missing one is a
    one-line UserError listing what is shipped."""
    import compressor_demo  # noqa: PLC0415 (only a recipe that names it needs it)

    root = Path(compressor_demo.__file__).parent
    found = (root / name).resolve()
    if not name or root.resolve() not in found.parents or not found.exists():
        shipped = ["ref-llama", *(f"data/{p.name}" for p in sorted((root / "data").glob("*.jsonl")))]
        raise UserError(f"{BUNDLED}{name}: the package ships no such file; it ships {', '.join(shipped)}")
    return found


def resolve_path(path: str, base: Path) -> str:
    """`path` made absolute against `base`, unless it is absolute already or a URL; `bundled:NAME`
    the package's own."""
    if path.startswith(BUNDLED):
        return str(bundled(path[len(BUNDLED) :]))
    return path if _is_remote(path) or Path(path).is_absolute() else str((base / path).resolve())


def resolve_model_path(path: str, base: Path, where: str = "model.path, relative to the recipe's folder") -> str:
    """A folder relative to `base` if it looks like a path or exists; else a hub id."""
    local = base / path
    if path.startswith(BUNDLED):
        return resolve_path(path, base)
    if path.startswith((".", "/", "~")) or local.exists():
        resolved = Path(path).expanduser() if path.startswith("~") else Path(resolve_path(path, base))
        if not resolved.is_dir():
            raise UserError(f"model folder not found: {resolved} ({where}){_reference_hint(resolved)}")
        return str(resolved)
    if not _is_hub_id(path):
        raise UserError(
            f"model folder not found: {local} ({where}), and {shown(path)} is not a hub id "
            f"(name or organisation/name) either; give the folder of a model, or its hub id"
        )
    near = _near_folder(path, base) if "/" not in path else None
    if near is not None:  # a typo of a folder beside it, not one of the hub's few ids without an organisation
        raise UserError(
            f"model folder not found: {local} ({where}); did you mean '{near}'? (a name without a slash "
            f"beside a folder so named is read as a typo; give a hub model as organisation/name)"
        )
    return path


def _near_folder(name: str, base: Path) -> str | None:
    """A folder in `base` whose name is close to `name` (difflib's ratio ≥ 0.8), or None."""
    try:
        folders = [entry.name for entry in base.iterdir() if entry.is_dir()]
    except OSError:
        return None
    close = difflib.get_close_matches(name, folders, n=1, cutoff=0.8)
    return close[0] if close else None


def _is_hub_id(path: str) -> bool:
    """Whether `path` could name a model on the hub (huggingface_hub's own rule)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _reference_hint(missing: Path) -> str:
    """The benchmark recipes read the reference model and corpus from a `shared/` folder beside the
    checkout: say so, and where the demo's own copies are, instead of a bare "not found"."""
    if "shared" not in missing.parts:
        return ""
    return (
        "; the ref_llama_* recipes expect the reference data (models/ref-llama, corpus/) in a shared/ folder "
        "beside the checkout; without it, recipes/demo.yaml runs on the copies in examples/ref-llama and "
        "examples/data"
    )


def resolve_data_files(files: Any, base: Path, where: str) -> Any:
    """A dataset's `data_files` (a path, a list, or split -> paths) resolved against `base`; a local
    file that is missing (globs aside) is a one-line UserError naming `where`."""
    if isinstance(files, str):
        resolved = resolve_path(files, base)
        if not _is_remote(resolved) and not any(ch in resolved for ch in "*?[") and not Path(resolved).exists():
            raise UserError(
                f"data file not found: {resolved} ({where}, relative to the recipe's folder)"
                f"{_reference_hint(Path(resolved))}"
            )
        return resolved
    if isinstance(files, list):
        return [resolve_data_files(f, base, where) for f in files]
    if isinstance(files, dict):
        return {k: resolve_data_files(v, base, f"{where}.{k}") for k, v in files.items()}
    raise UserError(f"{where} must be a path, a list of paths or a mapping of split to paths")
