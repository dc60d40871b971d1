"""Built-in depth selectors (issue 49): which whole decoder blocks go.

- `influence` (ShortGPT, Men et al., 2024): the blocks that turn the stream least, the lowest
  1 − cos of a block's input and output, all at once from the original model's statistics.
- `kl` (measured, the output-aware choice): greedily, each step removes the block whose removal,
  beside those already removed, gives the lowest KL to the original on held-out windows. Blocks
  interact (removing two neighbours costs more than the sum of each), which a one-shot score
  cannot see and a measurement does; `shortlist` measures only the lowest-influence blocks left
  at each step, for models with many blocks.
"""

from __future__ import annotations

from compressor.plugin import BlockChoice, BlockProblem, BlockSelector, hookimpl, lowest


class InfluenceSelector(BlockSelector):
    name = "influence"
    description = "ShortGPT: remove the blocks whose output stream is most like their input (1 − cos)"

    def select(self, problem: BlockProblem) -> BlockChoice:
        removed = lowest(problem.influence, problem.remove)
        return BlockChoice(removed, {"influence": [problem.influence[i] for i in removed]})


class MeasuredKlSelector(BlockSelector):
    name = "kl"
    description = "greedy: remove the block whose removal gives the lowest measured KL on held-out windows"
    requires = ("measure",)

    def select(self, problem: BlockProblem) -> BlockChoice:
        assert problem.measure is not None, "the engine measures for a selector that requires it"
        removed: list[int] = []
        steps: list[float] = []
        for _ in range(problem.remove):
            left = [i for i in range(problem.blocks) if i not in removed]
            if problem.shortlist is not None:
                left = lowest(problem.influence, problem.shortlist, left)
            kls = {i: problem.measure([*removed, i]) for i in left}
            best = min(left, key=lambda i: (kls[i], i))
            removed.append(best)
            steps.append(kls[best])
        return BlockChoice(removed, {"kl_after_each": steps, "measurements": len(problem.measured)})


@hookimpl
def compressor_selectors() -> list[BlockSelector]:
    return [InfluenceSelector(), MeasuredKlSelector()]
