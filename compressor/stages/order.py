"""The stages of a run, in order: each a unit that declares its section, checks, memory, what it
hands on and whether the guard judges it (`contract.Stage`). A plugin's stages (the
`compressor_stages` hook) are placed after the stage each names (`Stage.after`)."""

from __future__ import annotations

from collections.abc import Iterable

from compressor.errors import UserError
from compressor.stages.contract import Stage
from compressor.stages.data import ReadData
from compressor.stages.depth import PruneDepth
from compressor.stages.distil import Distil, ToStudent
from compressor.stages.evaluate import Evaluate
from compressor.stages.experts import PruneExperts
from compressor.stages.heads import PruneHeads
from compressor.stages.load import LoadModel, StartCheckpoint
from compressor.stages.mlp import PruneMlp
from compressor.stages.refine import Refine
from compressor.stages.report import WriteReport
from compressor.stages.save import Save
from compressor.stages.split import ChooseSplit
from compressor.stages.walk import Walk

BUILTIN_STAGES: tuple[Stage, ...] = (
    ReadData(),
    LoadModel(),
    StartCheckpoint(),
    PruneDepth(),
    ChooseSplit(),
    Walk(),
    Refine(),
    PruneExperts(),
    PruneHeads(),
    PruneMlp(),
    ToStudent(),
    Distil(),
    Save(),
    Evaluate(),
    WriteReport(),
)
"""Every run's stages in the order they run; each runs when the recipe asks for it (`Stage.runs`)."""

PLACEABLE = ("walk", "refinement", "experts", "attention heads", "MLP neurons", "distillation")
"""The stages a plugin's stage that changes the model may follow: after it is pruned, before it is saved."""

AFTER_SAVING = (Save.name,)
"""What a plugin's stage that reads the saved model may follow (it writes beside `model/`, e.g. a
quantized file, and changes neither the model nor anything the guard judges)."""


def run_order(plugin_stages: Iterable[Stage]) -> tuple[Stage, ...]:
    """The built-in stages with each plugin stage placed after the one it names (in the order the
    plugins gave them); one named nowhere, or outside the model's pruned-to-saved span (or, for a stage
    that only reads the saved model, right after saving), is refused."""
    order = list(BUILTIN_STAGES)
    builtin = {stage.name for stage in BUILTIN_STAGES}
    for stage in plugin_stages:
        if stage.name in builtin or not stage.name:
            raise UserError(f"a plugin stage is named '{stage.name}', which a built-in stage is; rename it")
        if stage.after in AFTER_SAVING and (stage.changes_model or stage.guarded):
            raise UserError(
                f"plugin stage '{stage.name}' follows '{stage.after}' and changes the model: a stage after saving "
                f"reads what was saved; set its `after` to one of: {', '.join(PLACEABLE)}"
            )
        placeable = (*PLACEABLE, *AFTER_SAVING)
        if stage.after not in placeable and stage.after not in {s.name for s in order if s.name not in builtin}:
            raise UserError(
                f"plugin stage '{stage.name}' follows '{stage.after}', which is not a stage it may follow; "
                f"set its `after` to one of: {', '.join(placeable)}"
            )
        at = next(i for i, s in enumerate(order) if s.name == stage.after) + 1
        while at < len(order) and order[at].name not in builtin:  # after the plugin stages already there
            at += 1
        order.insert(at, stage)
    return tuple(order)
