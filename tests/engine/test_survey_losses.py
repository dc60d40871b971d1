"""`engine.walk.survey_losses`: a global layout's predicted KL at each residual width, from the
survey a global walk runs first, before any walk (issue 49, item 4: the splits ranked by
prediction before any is pruned)."""

from __future__ import annotations

import pytest
import torch

from compressor.engine.allocation import loss_curve
from compressor.engine.pooling import PipelineStep
from compressor.engine.survey import SurveyMemo, survey_losses
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout
from compressor.models.sites import EMBEDDING, site_ids
from compressor_plugins.sensitivity import Sensitivity
from tests.conftest import random_batches, tiny_model


def _layout(config, family, width: int):  # noqa: ANN001, ANN202
    widths = {site: width for site in site_ids(family, config.num_hidden_layers)}
    return fixed_layout(config, family, widths, layout="global")


def _site_moments(model, batches) -> list[torch.Tensor]:  # noqa: ANN001
    """E[x xᵀ] over the counted tokens at every site of the unfused model, read by hooks: the
    embedding's output, then each layer's stream after its attention and after its MLP."""
    streams: dict[str, list[torch.Tensor]] = {}
    mask: list[torch.Tensor] = []

    def keep(site: str, x: torch.Tensor) -> None:
        streams.setdefault(site, []).append(x[mask[0]].to(torch.float64))

    hooks = [model.model.embed_tokens.register_forward_hook(lambda _m, _a, out: keep(EMBEDDING, out))]
    for i, layer in enumerate(model.model.layers):
        hooks.append(
            layer.post_attention_layernorm.register_forward_hook(lambda _m, a, _o, i=i: keep(f"layers.{i}.attn", a[0]))
        )
        hooks.append(
            layer.register_forward_hook(
                lambda _m, _a, out, i=i: keep(f"layers.{i}.mlp", out[0] if isinstance(out, tuple) else out)
            )
        )
    with torch.no_grad():
        for batch in batches:
            mask[:] = [batch.attention_mask.bool()]
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    for hook in hooks:
        hook.remove()
    moments = []
    for site in site_ids(family_for("llama"), model.config.num_hidden_layers):
        x = torch.cat(streams[site])
        moments.append(x.T @ x / len(x))
    return moments


def test_the_prediction_is_the_loss_curve_of_every_sites_statistics_and_a_walk_recalls_its_survey(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The predicted loss at each width is `loss_curve` of the sites' own C (measured here by
    hooks on the unfused model: fusing the norms leaves the stream alone) with the H returned,
    pooled over every site: zero at the full width, never rising with it. The survey it ran is
    the one the next walk recalls (no second pass), and with its H that walk prunes tensor for
    tensor as a walk that surveys and estimates H itself."""
    from compressor.engine import survey as survey_module

    family = family_for("llama")
    original = tiny_model("llama")
    config = original.config
    batches = random_batches(config.vocab_size, padded=True)
    widths = [16, 32, 48, 64]
    passes: list[int] = []
    real_survey = survey_module.survey_pass
    monkeypatch.setattr(survey_module, "survey_pass", lambda *args: passes.append(1) or real_survey(*args))
    memo = SurveyMemo()
    found = survey_losses(tiny_model("llama"), _layout(config, family, 48), batches, widths, WalkOptions(survey=memo))
    assert found.fisher_source == "computed" and len(passes) == 1 and memo.passes == 1
    sites = site_ids(family, config.num_hidden_layers)
    members = [(C, found.fisher[site].to(torch.float64)) for C, site in zip(_site_moments(original, batches), sites)]
    expected = loss_curve(*members[0], widths, pooled=members[1:])
    assert [found.losses[w] for w in widths] == pytest.approx(expected, rel=1e-5)
    assert found.losses[64] == pytest.approx(0.0, abs=1e-12) and found.losses[16] > found.losses[32] > found.losses[48]
    strategy = Sensitivity()
    pipeline = [PipelineStep(strategy, strategy.parse_options({}))]
    recalled = prune(
        tiny_model("llama"),
        _layout(config, family, 48),
        batches,
        pipeline,
        WalkOptions(survey=memo, fisher=found.fisher),
    )
    assert len(passes) == 1 and recalled.fisher_source == "given"
    own = prune(tiny_model("llama"), _layout(config, family, 48), batches, pipeline, WalkOptions())
    assert len(passes) == 2 and own.fisher_source == "computed"
    ours, theirs = recalled.model.state_dict(), own.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_without_a_block_the_prediction_is_the_loss_curve_of_the_other_blocks_sites_alone() -> None:
    """For a set of blocks, the loss over the sites of the blocks kept (the basis chosen from them
    alone): the candidate without those blocks, as far as the survey of the whole model can say."""
    family = family_for("llama")
    original = tiny_model("llama")
    config = original.config
    assert config.num_hidden_layers == 2
    batches = random_batches(config.vocab_size, padded=True)
    widths = [16, 48, 64]
    found = survey_losses(tiny_model("llama"), _layout(config, family, 48), batches, widths, without=[[1]])
    sites = site_ids(family, config.num_hidden_layers)
    members = [
        (C, found.fisher[site].to(torch.float64))
        for C, site in zip(_site_moments(original, batches), sites)
        if not site.startswith("layers.1.")
    ]
    assert len(members) == 3  # the embedding and layer 0's two sites
    expected = loss_curve(*members[0], widths, pooled=members[1:])
    assert [found.without[(1,)][w] for w in widths] == pytest.approx(expected, rel=1e-5)
    assert found.without[(1,)][16] < found.losses[16]  # fewer sites pay for the same cut


def test_a_per_site_layout_is_refused() -> None:
    family = family_for("llama")
    config = tiny_model("llama").config
    widths = {site: 48 for site in site_ids(family, config.num_hidden_layers)}
    layout = fixed_layout(config, family, widths, layout="per_site")
    with pytest.raises(ValueError, match="global layout"):
        survey_losses(tiny_model("llama"), layout, random_batches(config.vocab_size), [48])
