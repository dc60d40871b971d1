"""The `model` section: which checkpoint, in what precision, loaded how."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal, get_args

from pydantic import StrictBool, StrictStr

from compressor.recipe.paths import resolve_model_path
from compressor.recipe.sections.contract import Section, SectionContext
from compressor.validation import FORBID, options

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe


Dtype = Literal["float32", "float16", "bfloat16", "float64"]
Attention = Literal["sdpa", "eager"]
ModelLoad = Literal["memory", "stream", "auto"]
DTYPES = get_args(Dtype)


@options(frozen=True, config=FORBID)
class ModelSpec:
    path: StrictStr
    dtype: Dtype = "float32"
    revision: StrictStr | None = None
    attn_implementation: Attention = "sdpa"
    trust_remote_code: StrictBool = False
    """Run the model's own Python code from its folder or hub repository (auto_map); off unless asked."""
    load: ModelLoad = "memory"
    """memory: the whole model in host memory; stream: a shell whose decoder layers are read from the
    safetensors shards when a layer-by-layer pass reaches them (capture, H, survey, walk, MLP stage),
    the result bit-identical. Whole-model stages (refinement, distillation's teacher, throughput,
    lm-eval unless `evaluation.device_map`, measuring splits) still load the original in memory. auto: memory where the memory plan fits this
    machine so, else stream."""


def check_model(spec: ModelSpec, recipe: Recipe, context: SectionContext) -> ModelSpec:
    """The model's folder resolved against the recipe's (or kept as a hub id)."""
    return dataclasses.replace(spec, path=resolve_model_path(spec.path, context.base))


SECTION = Section("model", ModelSpec, check_model)
