"""Loading the model, and the checkpoint's fingerprint: progress made with another recipe, model
or data is refused before any work."""

from __future__ import annotations

from compressor.engine.checkpoint import model_digest
from compressor.evaluation.metrics import parameter_count
from compressor.evaluation.throughput import model_size
from compressor.runtime.resume import data_fingerprint, keep_decode_budget, recipe_fingerprint, save_recipe_values
from compressor.stages.base import RunState
from compressor.stages.contract import Stage
from compressor.stages.costs import TimedPhase, Work


class LoadModel(Stage):
    name = "loading model"
    timing = "load_s"

    def seconds(self, work: Work) -> list[TimedPhase]:
        return []  # reading, loading and writing files: not estimated, small beside the passes

    def run(self, state: RunState) -> None:
        """ "loading model", and its size before pruning."""
        state.progress("loading model", 0, 1)
        state.model = state.resources.model(state.recipe.model)
        state.baseline_params = parameter_count(state.model)
        state.baseline_size = model_size(state.model)


class StartCheckpoint(Stage):
    name = "checkpoint"
    checkpoint_key = "fingerprint"

    def seconds(self, work: Work) -> list[TimedPhase]:
        return []  # reading, loading and writing files: not estimated, small beside the passes

    def run(self, state: RunState) -> None:
        """The checkpoint's fingerprint checked (or written): progress of another recipe, model or data is refused."""
        state.fingerprint = {
            "recipe": recipe_fingerprint(state.recipe),
            "model": model_digest(state.model),
            "data": data_fingerprint(state.calibration),
        }
        state.checkpoint.start(state.fingerprint)
        save_recipe_values(state.checkpoint, state.recipe)
        if state.decode is not None and state.checkpoint.writable:  # a resumed run plans at the same widths
            keep_decode_budget(state.checkpoint.folder, state.recipe, state.decode)
