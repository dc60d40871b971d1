"""`engine.width_search`: moves keep the total and the grid; the evolution finds the measured best
where the per-layer errors' sum points elsewhere, keeps the start where nothing measures better,
and stays within its measurements; a model assembled from the solutions computes what the model
pruned to them computes, and is the original again after."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.engine.neurons import mlp_linears
from compressor.engine.refit import drop_neurons
from compressor.engine.width_search import SearchSettings, WidthSolution, assembled, evolve, mutate
from compressor.models.families import family_for
from tests.conftest import random_batches, save_tiny_checkpoint

GRID = [0, 256, 512, 768, 1024]


@pytest.mark.parametrize("seed", range(5))
def test_a_move_keeps_the_total_and_every_width_on_its_grid(seed: int) -> None:
    rng = random.Random(seed)
    widths = [rng.choice(GRID) for _ in range(6)]
    for moves in (1, 3, 10):
        moved = mutate(widths, [GRID] * 6, rng, moves)
        assert sum(moved) == sum(widths) and all(w in GRID for w in moved)
    assert mutate([0, 0, 0], [GRID] * 3, rng, 2) == [0, 0, 0]  # nothing to take from: no move


def _interacting(widths: list[int]) -> float:
    """A KL-like cost that rewards layers 0 and 1 kept wide together (a product no per-layer sum
    sees): alone, each layer's error falls with width alike."""
    alone = sum((1024 - w) / 1024 for w in widths)
    together = 2.0 * (widths[0] / 1024) * (widths[1] / 1024)
    return alone - together + 4.0


def test_the_search_finds_the_measured_best_where_the_summed_errors_point_elsewhere() -> None:
    start = [512] * 6  # every layer's own error alike: the sum is indifferent to the split
    everything = [list(ws) for ws in itertools.product(GRID, repeat=6) if sum(ws) == sum(start)]
    best = min(_interacting(ws) for ws in everything)
    calls: list[list[int]] = []

    def fitness(widths: list[int]) -> float:
        calls.append(list(widths))
        return _interacting(widths)

    result = evolve(start, [GRID] * 6, fitness, SearchSettings(evaluations=60, seed=0))
    assert len(everything) > 10 * 60  # the search measures a small share of the allocations
    assert calls[0] == start and result.start_kl == _interacting(start)
    assert result.kl == pytest.approx(best) and result.widths[:2] == [1024, 1024]
    assert sum(result.widths) == sum(start) and result.kl == _interacting(result.widths)
    assert len(calls) == result.measured <= 60 and len({tuple(c) for c in calls}) == len(calls)  # each once
    assert result.accepted >= 1


def test_where_nothing_measures_better_the_start_is_kept() -> None:
    start = [768, 256, 512]
    result = evolve(start, [GRID] * 3, lambda ws: sum(abs(a - b) for a, b in zip(ws, start)), SearchSettings(20))
    assert result.widths == start and result.accepted == 0 and result.kl == result.start_kl == 0


def test_grids_of_different_steps_are_refused() -> None:
    with pytest.raises(ValueError, match="different steps"):
        evolve([256, 128], [GRID, [0, 128, 256]], lambda ws: 0.0, SearchSettings(4))


def test_an_assembled_model_computes_the_pruned_models_logits_and_is_restored_after(tmp_path) -> None:
    folder = save_tiny_checkpoint(tmp_path / "m", "llama", intermediate_size=512, num_hidden_layers=3)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    family = family_for("llama")
    layers = model.model.layers
    torch.manual_seed(0)
    widths = [256, 0, 512]
    solutions = []
    for layer, width in zip(layers, widths):
        _, output = mlp_linears(layer, family)
        kept = torch.randperm(512)[:width].sort().values
        solutions.append({width: WidthSolution(kept, torch.randn(output.out_features, width))} if width < 512 else {})
    batch = random_batches(model.config.vocab_size)[0]
    with torch.no_grad():
        before = model(batch.input_ids).logits
        with assembled([mlp_linears(layer, family) for layer in layers], solutions, widths):
            inside = model(batch.input_ids).logits
        after = model(batch.input_ids).logits
        pruned = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        for layer, width, options in zip(pruned.model.layers, widths, solutions):
            if width < 512:
                inputs, output = mlp_linears(layer, family)
                drop_neurons(inputs, output, options[width].kept, options[width].down)
        expected = pruned(batch.input_ids).logits
    assert torch.equal(before, after)
    assert torch.allclose(inside, expected, atol=1e-6, rtol=0) and not torch.allclose(inside, before)
    mlps = [mlp_linears(layer, family) for layer in layers]
    with pytest.raises(RuntimeError, match="a candidate failed"), assembled(mlps, solutions, widths):
        raise RuntimeError("a candidate failed")
    with torch.no_grad():
        assert torch.equal(model(batch.input_ids).logits, before)  # restored when the block raised too
