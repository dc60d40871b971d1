"""The depth selectors (issue 49, item 2) on constructed problems: ShortGPT's influence removes
the blocks that turn the stream least, all at once; the measured one removes greedily by the KL
it measures, so it sees what removals cost together (two neighbours here), and its shortlist
bounds what it measures; a third party's selector registers and is found by name."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from compressor.errors import UserError
from compressor.strategies.block_contract import BlockChoice, BlockProblem, BlockSelector, lowest
from compressor.strategies.registry import PluginRegistry, hookimpl

COSTS = [5.0, 1.0, 1.2, 3.0, 2.0]
"""Each block's KL when removed alone; removing two neighbours costs 10 more."""


def kl_of(removed: Sequence[int]) -> float:
    blocks = sorted(removed)
    together = sum(10.0 for a, b in zip(blocks, blocks[1:]) if b == a + 1)
    return sum(COSTS[i] for i in blocks) + together


def problem(remove: int, shortlist: int | None = None) -> BlockProblem:
    built = BlockProblem(blocks=len(COSTS), remove=remove, influence=list(COSTS), shortlist=shortlist)

    def measure(removed: Sequence[int]) -> float:
        built.measured[tuple(sorted(removed))] = kl_of(removed)
        return kl_of(removed)

    built.measure = measure
    return built


def registry() -> PluginRegistry:
    return PluginRegistry()


def test_influence_removes_the_blocks_that_turn_the_stream_least() -> None:
    choice = registry().block_selector("influence").select(problem(2))
    assert choice.removed == [1, 2]  # blind to the two being neighbours
    assert choice.objectives["influence"] == [1.0, 1.2]
    assert lowest([1.0, 0.5, 0.5], 2) == [1, 2]  # ties to the lower index


def test_the_measured_selector_sees_what_neighbours_cost_together() -> None:
    measured = problem(2)
    choice = registry().block_selector("kl").select(measured)
    assert choice.removed == [1, 4]  # after 1 goes, 2 beside it would cost 12.2, block 4 costs 3
    assert kl_of(choice.removed) < kl_of([1, 2])
    assert choice.objectives["kl_after_each"] == [1.0, 3.0]
    assert len(measured.measured) == 5 + 4  # every block left, at each step


def test_the_shortlist_measures_only_the_lowest_influence_blocks_left() -> None:
    measured = problem(2, shortlist=2)
    choice = registry().block_selector("kl").select(measured)
    assert set(measured.measured) == {(1,), (2,), (1, 2), (1, 4)}
    assert choice.removed == [1, 4]


class KeepTheEnds(BlockSelector):
    name = "keep-the-ends"
    description = "removes the middle blocks (a third party's selector)"

    def select(self, problem: BlockProblem) -> BlockChoice:
        middle = (problem.blocks - problem.remove) // 2
        return BlockChoice(list(range(middle, middle + problem.remove)))


class ThirdParty:
    @hookimpl
    def compressor_block_selectors(self) -> list[BlockSelector]:
        return [KeepTheEnds()]


def test_a_third_party_depth_selector_registers_beside_the_built_ins() -> None:
    plugins = PluginRegistry(extra_plugins=[ThirdParty()])
    assert {"influence", "kl", "keep-the-ends"} <= set(plugins.block_selectors())
    assert plugins.block_selector("keep-the-ends").select(problem(2)).removed == [1, 2]
    with pytest.raises(UserError, match="unknown depth selector 'infuence' \\(did you mean 'influence'\\?\\)"):
        plugins.block_selector("infuence")
