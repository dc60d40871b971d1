"""The units contract (issue 80): one selector contract and one hook for every axis that keeps some
of its units. The built-ins register through `compressor_selectors` and are found by unit; each
axis's older hook still works and refuses another axis's selector; a plugin axis's unit gets its
own kind; `checked_choice` is the one check of a choice, by count, range and the axis's rule,
whether the selector names what stays or what goes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from compressor.cli import main
from compressor.errors import UserError
from compressor.strategies.block_contract import BlockProblem
from compressor.strategies.expert_contract import ExpertProblem
from compressor.strategies.head_contract import HeadProblem, HeadSelector
from compressor.strategies.neuron_contract import NeuronProblem, NeuronSelector
from compressor.strategies.registry import PluginRegistry, hookimpl
from compressor.strategies.units import RemovedUnits, UnitChoice, UnitProblem, UnitSelector, checked_choice

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ShelfProblem(UnitProblem):
    """A plugin axis's problem: keep `keep` of a row of shelves; shelf 0 is load-bearing."""

    unit: ClassVar[str] = "shelf"
    keep: int
    weights: list[float]

    @property
    def units(self) -> int:
        return len(self.weights)

    def refusal(self, kept: torch.Tensor) -> str | None:
        return None if 0 in kept.tolist() else "removed shelf 0, which holds the others up"


class Heaviest(UnitSelector[ShelfProblem]):
    unit: ClassVar[str] = "shelf"
    name = "heaviest"
    description = "keeps the heaviest shelves"

    def select(self, problem: ShelfProblem) -> UnitChoice:
        order = sorted(range(problem.units), key=lambda i: -problem.weights[i])
        return UnitChoice(order[: problem.keep], {"weights": problem.weights})


class Fixed(UnitSelector[ShelfProblem]):
    """Returns what it was built with."""

    unit: ClassVar[str] = "shelf"
    name = "fixed"

    def __init__(self, choice: UnitChoice | RemovedUnits) -> None:
        self.choice = choice

    def select(self, problem: ShelfProblem) -> UnitChoice | RemovedUnits:
        return self.choice


class ShelfPlugin:
    @hookimpl
    def compressor_selectors(self) -> list[UnitSelector[ShelfProblem]]:
        return [Heaviest()]


class LoudNeurons(NeuronSelector):
    name = "obs"  # the head selector 'obs' is another unit's: no clash
    description = "a neuron selector of a third party"

    def select(self, problem: NeuronProblem) -> UnitChoice:
        return UnitChoice(torch.arange(problem.keep))


def test_the_built_in_selectors_register_through_the_one_hook_and_are_found_by_unit() -> None:
    registry = PluginRegistry()
    found = {unit: set(registry.unit_selectors(unit)) for unit in ("neuron", "expert", "block", "head")}
    assert found == {
        "neuron": {"magnitude", "leverage", "obs"},
        "expert": {"frequency", "reap", "output"},
        "block": {"influence", "kl"},
        "head": {"norm", "obs"},
    }
    assert registry.unit_selector("head", "obs") is registry.head_selector("obs")
    assert registry.unit_selector("neuron", "obs") is not registry.unit_selector("head", "obs")
    with pytest.raises(UserError, match=r"^unknown head selector 'ob' \(did you mean 'obs'\?\)"):
        registry.unit_selector("head", "ob")


def test_a_plugin_axis_s_selectors_get_a_kind_of_their_own_and_compress_strategies_lists_them() -> None:
    registry = PluginRegistry(extra_plugins=[ShelfPlugin()])
    assert [kind.unit for kind in registry.selector_kinds()] == ["neuron", "expert", "block", "head", "shelf"]
    assert isinstance(registry.unit_selector("shelf", "heaviest"), Heaviest)
    with pytest.raises(UserError, match="^unknown shelf selector 'heavy'"):
        registry.unit_selector("shelf", "heavy")
    assert [kind.unit for kind in PluginRegistry().selector_kinds()] == ["neuron", "expert", "block", "head"]


def test_compress_strategies_lists_each_unit_s_selectors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    titles = ["MLP neuron selectors", "MoE expert selectors", "depth selectors", "attention-head selectors"]
    assert [out.index(title) for title in titles] == sorted(out.index(title) for title in titles)


def test_an_axis_s_older_hook_still_registers_and_refuses_another_axis_s_selector() -> None:
    class Older:
        @hookimpl
        def compressor_neuron_selectors(self) -> list[NeuronSelector]:
            return [LoudNeurons()]

    with pytest.raises(UserError, match="^neuron selector 'obs' is provided twice, by plugins '.+' and 'neurons'"):
        PluginRegistry(extra_plugins=[Older()])  # the built-in 'obs' came through the generic hook

    class Renamed(LoudNeurons):
        name = "loud"

    class OlderRenamed:
        @hookimpl
        def compressor_neuron_selectors(self) -> list[NeuronSelector]:
            return [Renamed()]

    assert isinstance(PluginRegistry(extra_plugins=[OlderRenamed()]).selector("loud"), Renamed)

    class Mixed:
        @hookimpl
        def compressor_head_selectors(self) -> list[UnitSelector[NeuronProblem]]:
            return [Renamed()]

    with pytest.raises(UserError) as refused:
        PluginRegistry(extra_plugins=[Mixed()])
    assert re.fullmatch(
        r"plugin '.+' returns neuron selector 'loud' from compressor_head_selectors, which takes head "
        r"selectors; return it from compressor_selectors",
        str(refused.value),
    )


def test_a_selector_without_a_unit_is_refused_in_one_line() -> None:
    class Unitless:
        name = "unitless"

    class Plugin:
        @hookimpl
        def compressor_selectors(self) -> list[object]:
            return [Unitless()]

    with pytest.raises(UserError, match="returns selector 'unitless' without a unit; subclass one of"):
        PluginRegistry(extra_plugins=[Plugin()])


def test_checked_choice_takes_what_stays_or_what_goes_and_sorts_it() -> None:
    problem = ShelfProblem(keep=2, weights=[3.0, 1.0, 2.0, 0.5])
    assert checked_choice(Heaviest().select(problem), Heaviest(), problem).tolist() == [0, 2]
    assert checked_choice(RemovedUnits([3, 1]), Fixed(RemovedUnits([])), problem).tolist() == [0, 2]
    assert checked_choice(UnitChoice(torch.tensor([2, 0])), Fixed(UnitChoice([])), problem).tolist() == [0, 2]


@pytest.mark.parametrize(
    ("choice", "line"),
    [
        (UnitChoice([0, 0]), "shelf selector 'fixed' returned 1 distinct shelfs; it must return 2"),
        (UnitChoice([0, 1, 2]), "shelf selector 'fixed' returned 3 distinct shelfs; it must return 2"),
        (UnitChoice([0, 4]), "shelf selector 'fixed' returned a shelf outside 0..3"),
        (RemovedUnits([1]), "shelf selector 'fixed' returned 1 distinct shelfs; it must return 2"),
        (UnitChoice([1, 2]), "shelf selector 'fixed' removed shelf 0, which holds the others up"),
    ],
)
def test_checked_choice_refuses_a_wrong_choice_in_one_line(choice: UnitChoice | RemovedUnits, line: str) -> None:
    problem = ShelfProblem(keep=2, weights=[3.0, 1.0, 2.0, 0.5])
    with pytest.raises(UserError) as refused:
        checked_choice(choice, Fixed(choice), problem)
    assert str(refused.value) == line


def test_each_built_in_axis_states_its_units_and_its_rule() -> None:
    """Heads: every KV group keeps as many; experts: protected ones stay; blocks: `keep` is what is
    left after `remove`; neurons: the layer and the expert are where."""
    heads = HeadProblem(
        layer=2, keep=2, heads=4, groups=2, head_dim=1, C=torch.eye(4), activation=torch.ones(4),
        down=torch.eye(4), damping=0.0,
    )  # fmt: skip
    norm = PluginRegistry().head_selector("norm")
    assert isinstance(norm, HeadSelector) and heads.units == 4
    with pytest.raises(UserError, match=r"^head selector 'norm' at layer 2 kept \[2, 0\] heads per KV group"):
        checked_choice(UnitChoice([0, 1]), norm, heads)
    assert checked_choice(UnitChoice([3, 0]), norm, heads).tolist() == [0, 3]

    protected = torch.tensor([False, True, False])
    experts = ExpertProblem(
        layer=1, keep=2, top_k=1, normalise=True, tokens=torch.ones(3), gate=torch.ones(3), reap=torch.ones(3),
        peak=torch.ones(3), protected=protected,
    )  # fmt: skip
    reap = PluginRegistry().expert_selector("reap")
    with pytest.raises(
        UserError, match=r"^expert selector 'reap' at layer 1 removed protected \(super\) expert\(s\) \[1\]"
    ):
        checked_choice(UnitChoice([0, 2]), reap, experts)

    blocks = BlockProblem(blocks=5, remove=2, influence=[0.0] * 5)
    kl = PluginRegistry().block_selector("kl")
    assert (blocks.keep, blocks.units) == (3, 5)
    assert checked_choice(RemovedUnits([4, 1]), kl, blocks).tolist() == [0, 2, 3]
    with pytest.raises(UserError, match="^block selector 'kl' returned a block outside 0..4"):
        checked_choice(RemovedUnits([1, 5]), kl, blocks)

    neurons = NeuronProblem(
        layer=0, keep=1, C=torch.eye(2), activation=torch.ones(2), down=torch.eye(2), damping=0.0, expert=3
    )
    with pytest.raises(UserError, match="^neuron selector 'obs' at layer 0, expert 3 returned 2 distinct"):
        checked_choice(UnitChoice([0, 1]), LoudNeurons(), neurons)


def test_the_guide_s_units_example_registers_through_the_one_hook_and_chooses() -> None:
    """docs/writing-a-strategy.md's selectors register through `compressor_selectors` under their unit."""
    guide = (ROOT / "docs" / "writing-a-strategy.md").read_text()
    blocks = [block.split("```")[0] for block in guide.split("```python\n")[1:]]
    with_hook = [block for block in blocks if "def compressor_selectors()" in block]
    assert len(with_hook) == 5  # the units contract's example and one per axis
    problem = NeuronProblem(
        layer=0, keep=2, C=torch.eye(4), activation=torch.arange(4.0), down=torch.eye(4), damping=0.0
    )
    for block in with_hook:
        namespace: dict[str, object] = {}
        exec(compile(block, "writing-a-strategy.md", "exec"), namespace)
        plugin = type("GuidePlugin", (), {"compressor_selectors": staticmethod(namespace["compressor_selectors"])})
        registry = PluginRegistry(extra_plugins=[plugin()])
        (selector,) = namespace["compressor_selectors"]()  # type: ignore[operator]
        assert type(registry.unit_selector(selector.unit, selector.name)) is type(selector)
        if selector.unit == "neuron":
            assert checked_choice(selector.select(problem), selector, problem).tolist() == [2, 3]
