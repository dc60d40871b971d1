"""`models.split`: the splits of one budget between the residual width and the MLP's width that a
run chooses from (issue 34): the residual width alone first, each spending the budget."""

from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import LlamaConfig

from compressor.errors import UserError
from compressor.models.families import family_for
from compressor.models.layout import LayoutRequest, sliced_layout
from compressor.models.split import depth_counts, split_layouts

FAMILY = family_for("llama")
CONFIG = LlamaConfig(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
    tie_word_embeddings=True,
)


@pytest.mark.parametrize("layout", ["global", "per_site"])
@pytest.mark.parametrize("budget", [{"target_params": 0.75}, {"target_params": 0.6}, {"sparsity": 0.25}])
def test_every_split_spends_the_budget_with_the_residual_width_alone_first(layout: str, budget: dict) -> None:
    slicing = LayoutRequest(layout=layout, round_to=8, slice_head=layout == "per_site", mlp_round_to=8, **budget)
    splits = split_layouts(CONFIG, FAMILY, [FAMILY], slicing, min_kept=0.25, candidates=4)
    alone = sliced_layout(CONFIG, FAMILY, [FAMILY], slicing)
    assert splits[0].mlp_width is None and splits[0].widths == alone.widths and splits[0].budget == alone.budget
    assert 2 <= len(splits) <= 4
    widths = [split.kept for split in splits]
    assert widths == sorted(set(widths))  # fewer neurons, a wider stream: one split per residual width
    for split in splits[1:]:
        m = split.mlp_width
        assert m is not None and m % 8 == 0 and 0.25 * 512 <= m < 512
        assert split.params.count(split.widths) <= split.budget == alone.budget
        # the most neurons at this width: 8 more and the budget leaves a narrower stream
        assert sliced_layout(CONFIG, FAMILY, [FAMILY], replace(slicing, mlp_kept=m + 8)).kept < split.kept


def test_two_candidates_are_the_residual_width_alone_and_the_widest_stream_min_kept_allows() -> None:
    slicing = LayoutRequest(layout="global", target_params=0.7, mlp_round_to=8)
    splits = split_layouts(CONFIG, FAMILY, [FAMILY], slicing, min_kept=0.5, candidates=2)
    assert len(splits) == 2 and splits[0].mlp_width is None
    widest = sliced_layout(CONFIG, FAMILY, [FAMILY], replace(slicing, mlp_kept=256)).kept  # the MLP at min_kept
    assert widest is not None and splits[1].kept == widest > splits[0].kept
    assert splits[1].mlp_width is not None and 256 <= splits[1].mlp_width < 512


def test_a_family_without_an_mlp_width_is_refused() -> None:
    gpt2 = family_for("gpt2")
    from transformers import GPT2Config

    with pytest.raises(UserError, match=r"does not describe its MLP's width \(ModelFamily.mlp_width\)"):
        split_layouts(
            GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=100),
            gpt2,
            [gpt2],
            LayoutRequest(target_params=0.8, slice_head=True),
            min_kept=0.5,
            candidates=3,
        )


@pytest.mark.parametrize(
    ("layers", "most", "candidates", "expected"),
    [
        (6, None, 2, [0, 1]),
        (30, None, 3, [0, 4, 7]),
        (30, 6, 4, [0, 2, 4, 6]),
        (6, 2, 5, [0, 1, 2]),
        (2, None, 3, [0, 1]),
    ],
)
def test_depth_counts_start_with_every_block_and_space_the_rest_up_to_the_most(
    layers: int, most: int | None, candidates: int, expected: list[int]
) -> None:
    """None removed first; up to `max_removed` (a quarter of the blocks by default, at least one)."""
    assert depth_counts(layers, most, candidates) == expected


def test_depth_counts_that_remove_every_block_are_refused() -> None:
    with pytest.raises(UserError, match="depth.max_removed 6 removes every one of the model's 6 blocks"):
        depth_counts(6, 6, 2)
