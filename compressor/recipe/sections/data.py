"""The `calibration` section (and the windows every data section shares): dataset, windows, format."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import StrictInt, StrictStr

from compressor.errors import UserError
from compressor.recipe.paths import resolve_data_files
from compressor.recipe.sections.contract import Section, SectionContext
from compressor.validation import FORBID, described, options

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe


Format = Literal["text", "chat"]
FORMATS = get_args(Format)


@options(frozen=True, config=FORBID)
class DataSpec:
    dataset: dict[StrictStr, Any]
    num_samples: Annotated[StrictInt, described("how many windows", ge=1)]
    seq_len: Annotated[StrictInt, described("tokens per window", ge=2)]
    batch_size: Annotated[StrictInt, described("windows per batch", ge=1)] = 8
    format: Format = "text"
    text_field: StrictStr = "text"
    messages_field: StrictStr = "messages"


def check_data(spec: DataSpec, where: str, base: Path) -> DataSpec:
    """`dataset` names a loader or dataset, and its local files (resolved against `base`) exist."""
    return dataclasses.replace(spec, dataset=check_dataset(spec.dataset, where, base))


def check_dataset(dataset: dict[str, Any], where: str, base: Path) -> dict[str, Any]:
    """A dataset spec with a `path`, its local files resolved against `base` (and existing)."""
    if "path" not in dataset:
        raise UserError(f"{where}.dataset needs a 'path' (a dataset name or a loader such as json)")
    loader = dataset["path"]
    if loader in FILE_LOADERS and not any(dataset.get(key) for key in ("data_files", "data_dir")):
        raise UserError(
            f"{where}.dataset: path {loader} is the loader of {loader} files and reads the files data_files "
            f"(or data_dir) names; add data_files: <your file>"
        )
    dataset = dict(dataset)
    for key in ("data_files", "data_dir"):
        if key in dataset:
            dataset[key] = resolve_data_files(dataset[key], base, f"{where}.dataset.{key}")
    return dataset


FILE_LOADERS = ("json", "csv", "text", "parquet", "arrow", "pandas", "xml", "webdataset")
"""datasets' loaders of local files by format: without data_files they read nothing (a hub dataset
of that name is never what was meant)."""


def check_calibration(spec: DataSpec, recipe: Recipe, context: SectionContext) -> DataSpec:
    return check_data(spec, "calibration", context.base)


SECTION = Section("calibration", DataSpec, check_calibration)
