"""The registry of what a run saves its model as: one `Exporter` per format (`stages.formats`), the plan
choosing one for the recipe and layout (`model_exporter`), so the decision is made once, before any
weight loads. `Save` writes `model/` with the plan's exporter, the held-out guard measures the model
as that exporter would save it (`as_saved`), and `compress export` tells a saved folder's format
from the same descriptors. A new format is a class here and its descriptor in `stages.formats`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import PreTrainedModel

from compressor.models.decilm import save_decilm
from compressor.models.export import write_remote_code
from compressor.models.layout import SlicedLayout
from compressor.models.sites import EMBEDDING
from compressor.models.stock import load_stock, save_own_class, to_stock
from compressor.models.towers import TextTower, copy_processor_files, save_tower
from compressor.recipe.schema import Recipe
from compressor.runtime.loading import load_model, load_whole
from compressor.stages.formats import DECILM, ORIGINAL, PER_SITE, VISION_LANGUAGE, SavedFormat
from compressor.validation import replaced

if TYPE_CHECKING:
    from compressor.stages.base import RunState


class Exporter:
    """One format of the run's `model/` folder: whether the plan chooses it, how it is written, and
    the model as it would be read back."""

    format: ClassVar[SavedFormat]

    def chosen(self, recipe: Recipe, layout: SlicedLayout, tower: TextTower | None) -> bool:
        """This format is the one a run of `recipe` on `layout` saves."""
        raise NotImplementedError

    def save(self, state: RunState, folder: Path | None) -> PreTrainedModel:
        """Write the run's model into `folder` (None: a sweep that keeps only the bases; the stock
        record is still made) and return the run's model from then on (read back where written)."""
        raise NotImplementedError

    def as_saved(self, state: RunState, model: PreTrainedModel, scale: torch.Tensor | None) -> PreTrainedModel:
        """`model` as this format would save it (what the held-out guard measures); `scale`: a stock
        tied head's diagonal, None where the conversion fits it."""
        return model


class PerSite(Exporter):
    """A basis per site: the `sliced_<model_type>` class, its code written beside the weights."""

    format = PER_SITE

    def chosen(self, recipe: Recipe, layout: SlicedLayout, tower: TextTower | None) -> bool:
        return layout.residual and not layout.one_basis

    def save(self, state: RunState, folder: Path | None) -> PreTrainedModel:
        if folder is not None:
            if not state.writes:  # else the walk wrote it, layer by layer
                state.pruned.save_pretrained(folder)
            write_remote_code(folder, state.family, state.config.model_type)
        return state.pruned


class OriginalClass(Exporter):
    """One basis (or the stream kept whole): the original class at the pruned widths, saved and
    loaded back, so what is evaluated is what users load."""

    format = ORIGINAL

    def chosen(self, recipe: Recipe, layout: SlicedLayout, tower: TextTower | None) -> bool:
        return layout.one_basis or not layout.residual

    def save(self, state: RunState, folder: Path | None) -> PreTrainedModel:
        pruned = state.pruned
        if not state.checked.layout.residual:  # the original class with narrower MLPs
            state.stock = mlp_alone_record(state)
            if folder is None:
                return pruned
            save_own_class(pruned, state.family, folder)
            return load_stock(folder, pruned)
        if state.writes:  # the walk wrote the stock model as it went
            state.stock = state.result.stock
            return pruned
        if state.distillation is None:
            pruned, state.stock = to_stock(
                pruned,
                state.family,
                state.config,
                folder,
                tie=state.checked.layout.tie_head,
                stream=state.head_stream(),
                scale=state.head_scale,
            )
            return pruned
        if folder is not None:  # already the original class (distilled): saved and loaded back
            pruned.save_pretrained(folder)
            pruned = load_stock(folder, pruned)
        return pruned

    def as_saved(self, state: RunState, model: PreTrainedModel, scale: torch.Tensor | None) -> PreTrainedModel:
        if not state.one_basis:
            return model
        layout = state.checked.layout
        return to_stock(
            model, state.family, state.config, tie=layout.tie_head, stream=state.head_stream(), scale=scale
        )[0]


class DeciLM(Exporter):
    """`slicing.layout: heterogeneous`: each layer's MLP width its own (an MLP or attention possibly
    removed), written as DeciLM with this project's code beside the weights."""

    format = DECILM

    def chosen(self, recipe: Recipe, layout: SlicedLayout, tower: TextTower | None) -> bool:
        return not layout.residual and recipe.slicing.layout == "heterogeneous"

    def save(self, state: RunState, folder: Path | None) -> PreTrainedModel:
        state.stock = mlp_alone_record(state)
        if folder is None:
            return state.pruned
        decilm = save_decilm(state.pruned, folder)
        state.stock["config"] = {"block_configs": decilm.block_configs}
        state.stock["class"] = "DeciLMForCausalLM"
        return load_stock(folder, state.pruned, remote_code=True)


class VisionLanguage(OriginalClass):
    """A vision-language checkpoint, saved whole as its own class: the original loaded again, its
    text tower replaced by the pruned one, its projector mapped into the pruned stream."""

    format = VISION_LANGUAGE

    def chosen(self, recipe: Recipe, layout: SlicedLayout, tower: TextTower | None) -> bool:
        return tower is not None

    def save(self, state: RunState, folder: Path | None) -> PreTrainedModel:
        pruned = state.pruned
        if not state.checked.layout.residual:  # the projector writes the stream as it was
            state.stock = mlp_alone_record(state)
            return pruned if folder is None else save_whole_tower(state, pruned, folder, None)
        pruned, state.stock = to_stock(
            pruned,
            state.family,
            state.config,
            tie=state.checked.layout.tie_head,
            stream=state.head_stream(),
            scale=state.head_scale,
        )
        if folder is None:
            return pruned
        return save_whole_tower(state, pruned, folder, state.bases[EMBEDDING])


EXPORTERS: tuple[Exporter, ...] = (VisionLanguage(), DeciLM(), PerSite(), OriginalClass())
"""Every format a run's model can be saved in, the most particular first: the plan takes the first
that a recipe and layout choose (`model_exporter`)."""


def model_exporter(recipe: Recipe, layout: SlicedLayout, tower: TextTower | None) -> Exporter:
    """The exporter of a run of `recipe` on `layout` (`tower`: a vision-language checkpoint's text tower)."""
    return next(exporter for exporter in EXPORTERS if exporter.chosen(recipe, layout, tower))


def mlp_alone_record(state: RunState) -> dict[str, Any]:
    """The report's stock record of a layout that prunes the MLP alone: the stream kept whole, the
    config's MLP width the kept one."""
    family, d = state.family, state.config.hidden_size
    assert family.mlp_width is not None and state.checked.layout.kept_stream is not None
    return {
        "norm_scale": 1.0,
        "stream_scale": 1.0,
        "embedding_factor": 1.0,
        "head": "unchanged",
        "hidden_size": d,
        "config": {family.mlp_width: getattr(state.config, family.mlp_width)},
        "residual": f"kept whole: {state.checked.layout.kept_stream}",
    }


def save_whole_tower(
    state: RunState, pruned: PreTrainedModel, folder: Path, basis: torch.Tensor | None
) -> PreTrainedModel:
    """A vision-language checkpoint saved whole (`models.towers.save_tower`): the original
    loaded again, its text tower replaced by `pruned`, its projector mapped into the pruned
    stream; returned as the run's text model, read back from the folder."""
    tower, spec = state.checked.tower, state.recipe.model
    assert tower is not None and state.stock is not None
    save_tower(
        load_whole(replaced(spec, load="memory")),
        tower,
        pruned,
        basis,
        state.stock["stream_scale"],
        folder,
    )
    state.stock["vision_language"] = {
        "class": type(pruned).__name__,
        "projector": tower.projector,
        "copied": copy_processor_files(spec.path, folder),
    }
    return load_model(replaced(spec, path=str(folder), revision=None, load="memory"))
