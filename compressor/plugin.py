"""The public face for plugins: everything a strategy or a model-family plugin needs, in one place.

This module is the stable API. A strategy plugin subclasses `Strategy`, receives a `SiteProblem`
(its `SiteStatistics`) and the previous step's `Basis`, returns a `Basis`, declares its options as
an `options` dataclass (`FORBID`, `described`, `Number`), and registers with `hookimpl`. Every
axis that keeps some of its units shares one selector contract (`UnitSelector`: a `UnitProblem`
in, a `UnitChoice` of the kept units, or `RemovedUnits`, out), registered through the
`compressor_selectors` hook: an MLP neuron selector subclasses `NeuronSelector` (a
`NeuronProblem` in), a Mixture-of-Experts expert selector `ExpertSelector` (`ExpertProblem`), a
depth selector `BlockSelector` (`BlockProblem`), an attention-head selector `HeadSelector`
(`HeadProblem`); each axis's older hook (`compressor_neuron_selectors`, ...) still works, and
`NeuronChoice`, `HeadChoice`, `ExpertChoice` are `UnitChoice`, `BlockChoice` is `RemovedUnits`. A family
plugin returns `ModelFamily` descriptions from its hook and may call `register_family` so saved
models of that family load through the transformers Auto classes. A stage plugin subclasses `Stage`
(`compressor_stages`); an axis plugin adds an `Axis` (`compressor_axes`) with a stage and selectors
of its unit, found by `unit_selector`, and narrows MLPs with `mlp_linears` and `narrow_mlp`. The helpers are the linear
algebra the built-in strategies share.

Everything else in `compressor` is internal and may move between versions: the built-in plugins
(`plugins/`), the examples and the guides import only from here, and `tests/test_architecture.py`
fails when one imports anything else. Importing this module imports torch but not transformers,
so loading plugins stays cheap for `compress --help`-like paths and recipe checks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compressor._post_import import after_import
from compressor.errors import UserError
from compressor.models.axes import Axis
from compressor.models.families import ModelFamily
from compressor.stages.contract import Candidate, Stage
from compressor.stages.costs import Phase, TimedPhase, UnitCosts, Work
from compressor.strategies.block_contract import BlockChoice, BlockProblem, BlockSelector, lowest
from compressor.strategies.contract import (
    DEFAULT_TAUS,
    Basis,
    SiteProblem,
    SiteStatistics,
    Strategy,
    StrategyOptionError,
    complete_basis,
    coupled_loss,
    coupled_losses,
    eigh_descending,
    frobenius_normalised,
    removed_energy,
    tau_candidates,
)
from compressor.strategies.expert_contract import (
    ExpertChoice,
    ExpertProblem,
    ExpertSelector,
    keep_highest,
    routing_weights,
)
from compressor.strategies.head_contract import HeadChoice, HeadProblem, HeadSelector, top_per_group
from compressor.strategies.neuron_contract import NeuronChoice, NeuronProblem, NeuronSelector, top_k
from compressor.strategies.registry import PluginRegistry, hookimpl
from compressor.strategies.units import RemovedUnits, UnitChoice, UnitProblem, UnitSelector, checked_choice
from compressor.validation import FORBID, Number, described, options


def mlp_linears(layer: nn.Module, family: ModelFamily) -> tuple[list[nn.Linear], nn.Linear]:
    """A decoder layer's MLP input linears (they compute the intermediate activation h) and its
    output linear (it reads h), wherever `family` keeps them: what a plugin axis reads the MLP by."""
    from compressor.engine.neurons import mlp_linears as linears  # the model stack, only when a plugin asks

    return linears(layer, family)


def narrow_mlp(layer: nn.Module, family: ModelFamily, kept: torch.Tensor) -> None:
    """Keep the neurons `kept` of a decoder layer's MLP, in place: each input linear's rows (every
    block of a fused one, biases too) and the output linear's columns, as the built-in MLP axis
    drops them (without its refit). The caller sets the config's width (`docs/adding-an-axis.md`)."""
    from compressor.engine.refit import drop_neurons

    inputs, output = mlp_linears(layer, family)
    kept = torch.as_tensor(kept, dtype=torch.long).to(output.weight.device)
    drop_neurons(inputs, output, kept, output.weight.data[:, kept])


def unit_selector(unit: str, name: str) -> UnitSelector[Any]:
    """The installed selector `name` of `unit`, or the line that refuses an unknown name: what a
    plugin axis's stage looks up for the selector its recipe section names (in `check_plan`, so a
    wrong name stops the run before any weight loads)."""
    return PluginRegistry().unit_selector(unit, name)


def register_family(family: ModelFamily) -> None:
    """Register the `sliced_<model_type>` classes of `family` with the transformers Auto classes,
    when transformers is imported (at once if it is), so `import your_plugin` stays cheap."""

    def register() -> None:
        from compressor.models.sliced import register_family as register_now

        register_now(family)

    after_import("transformers", register)


__all__ = [
    "Axis",
    "DEFAULT_TAUS",
    "FORBID",
    "Basis",
    "BlockChoice",
    "BlockProblem",
    "BlockSelector",
    "Candidate",
    "ExpertChoice",
    "ExpertProblem",
    "ExpertSelector",
    "HeadChoice",
    "HeadProblem",
    "HeadSelector",
    "ModelFamily",
    "Phase",
    "RemovedUnits",
    "NeuronChoice",
    "NeuronProblem",
    "NeuronSelector",
    "Number",
    "SiteProblem",
    "SiteStatistics",
    "Stage",
    "Strategy",
    "StrategyOptionError",
    "TimedPhase",
    "UnitChoice",
    "UnitCosts",
    "UnitProblem",
    "UnitSelector",
    "UserError",
    "Work",
    "complete_basis",
    "coupled_loss",
    "checked_choice",
    "coupled_losses",
    "described",
    "eigh_descending",
    "frobenius_normalised",
    "hookimpl",
    "keep_highest",
    "lowest",
    "routing_weights",
    "options",
    "register_family",
    "removed_energy",
    "tau_candidates",
    "unit_selector",
    "top_k",
    "top_per_group",
    "mlp_linears",
    "narrow_mlp",
]
