"""`fixed_layout`: widths chosen by hand are checked once, where the layout is made, so the walk
takes a layout as it is."""

from __future__ import annotations

import pytest

from compressor.models.families import family_for
from compressor.models.layout import fixed_layout
from compressor.models.sites import layer_site_ids, site_ids, site_widths
from tests.conftest import tiny_model


def _llama():
    family = family_for("llama")
    config = tiny_model("llama").config
    return family, config, site_widths(family, config.num_hidden_layers, config.hidden_size, 48, True)


def test_a_fixed_layout_costs_its_widths() -> None:
    family, config, widths = _llama()
    layout = fixed_layout(config, family, widths)
    assert layout.widths == widths and layout.budget == layout.params.count(widths) < layout.params.original
    assert layout.sites == tuple(site_ids(family, config.num_hidden_layers)) and layout.slice_head
    assert fixed_layout(config, family, None).budget == layout.params.original  # an allocator chooses


def test_a_fixed_layout_refuses_widths_that_do_not_fit() -> None:
    family, config, widths = _llama()
    with pytest.raises(ValueError, match="expected widths for the sites"):
        fixed_layout(config, family, {k: v for k, v in widths.items() if k != "embedding"})
    attn, mlp = layer_site_ids(family, 0)
    next_attn = layer_site_ids(family, 1)[0]
    with pytest.raises(ValueError, match="its own layer"):
        fixed_layout(config, family, widths, shared=[next_attn])  # the basis of layer 0's MLP
    with pytest.raises(ValueError, match="same width"):
        fixed_layout(config, family, {**widths, mlp: 40}, shared=[mlp])
    with pytest.raises(ValueError, match="one width for every site"):
        fixed_layout(config, family, {**widths, mlp: 40}, layout="global")
    assert fixed_layout(config, family, widths, layout="global").reused == tuple(
        site_ids(family, config.num_hidden_layers)[1:]
    )
