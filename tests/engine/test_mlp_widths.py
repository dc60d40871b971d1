"""Per-layer MLP widths (`engine.mlp_widths`, the heterogeneous layout): the allocation is the
least summed error within the total (checked against every combination), the predicted error is
the G-weighted error of the pruned MLP's output on the tokens it was measured on, the curves are
measured without changing the model, and `prune_mlp` keeps a width per layer, 0 removing the
MLP's output exactly. A removable attention joins the allocation at its neurons' worth, its
removal's predicted error the G-weighted energy of what it writes."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch

from compressor.engine.mlp_widths import WidthCurve, allocate, weighted_error, width_grid
from compressor.engine.neurons import CurveOptions, MlpOptions, mlp_width_curves, prune_mlp
from compressor.engine.refit import refit_down
from compressor.errors import UserError
from compressor.models.families import family_for
from compressor.strategies.neuron_contract import NeuronProblem
from compressor.strategies.registry import PluginRegistry
from tests.conftest import copy_model, max_relative_logit_error, random_batches, tiny_model


def _curves(layers: int, seed: int) -> list[WidthCurve]:
    generator = torch.Generator().manual_seed(seed)
    curves = []
    for layer in range(layers):
        drops = torch.rand(4, generator=generator, dtype=torch.float64).sort(descending=True).values
        errors = [float(drops[i:].sum()) for i in range(4)] + [0.0]  # falling with the width
        curves.append(WidthCurve(layer, {w: e for w, e in zip(range(0, 1025, 256), errors, strict=True)}))
    return curves


@pytest.mark.parametrize("seed", range(5))
def test_the_allocation_is_the_best_combination_within_the_total(seed: int) -> None:
    curves = _curves(4, seed)
    for total in (0, 256, 1000, 1536, 2304, 4096):
        widths = allocate(curves, total).widths
        assert sum(widths) <= total
        best = min(
            sum(c.errors[w] for c, w in zip(curves, combo, strict=True))
            for combo in itertools.product(*(c.errors for c in curves))
            if sum(combo) <= total
        )
        assert sum(c.errors[w] for c, w in zip(curves, widths, strict=True)) == pytest.approx(best)


@pytest.mark.parametrize("seed", range(5))
def test_with_removable_attentions_the_allocation_is_the_best_combination_of_widths_and_attentions(
    seed: int,
) -> None:
    generator = torch.Generator().manual_seed(seed + 10)
    removal = torch.rand(4, generator=generator, dtype=torch.float64) * 1.5
    curves = [WidthCurve(c.layer, c.errors, float(removal[c.layer])) for c in _curves(4, seed)]
    curves[2] = WidthCurve(2, curves[2].errors)  # this one's attention cannot go
    units, removable = 512, 3
    removed_any = False
    for total in (1024, 2048, 2560, 4096):
        allocation = allocate(curves, total + units * removable, units)
        gone = set(allocation.attention_removed)
        assert 2 not in gone
        removed_any |= bool(gone)
        assert sum(allocation.widths) + units * (removable - len(gone)) <= total + units * removable

        def error(widths: tuple[int, ...], removed: set[int]) -> float:
            return sum(c.errors[w] + (c.attention if c.layer in removed else 0.0) for c, w in zip(curves, widths))

        best = min(
            error(combo, removed)
            for combo in itertools.product(*(c.errors for c in curves))
            for removed in map(
                set, itertools.chain.from_iterable(itertools.combinations((0, 1, 3), k) for k in range(4))
            )
            if sum(combo) + units * (removable - len(removed)) <= total + units * removable
        )
        assert error(tuple(allocation.widths), gone) == pytest.approx(best)
    assert removed_any  # the seeds reach a removal: the test sees both choices
    assert allocate(curves, 2048, 0).attention_removed == []  # an attention worth no neurons stays


def test_a_total_below_the_narrowest_widths_is_refused() -> None:
    curves = [WidthCurve(0, {256: 1.0, 512: 0.0})]
    with pytest.raises(UserError, match="raise the budget"):
        allocate(curves, 128)
    removable = [WidthCurve(0, {256: 1.0, 512: 0.0}, attention=0.5)]  # kept: 256 neurons' worth
    with pytest.raises(UserError, match="cannot fit 128 neurons \\(each attention that may change counted as 256"):
        allocate(removable, 128, attention_units=256)
    assert width_grid(768, 256) == [0, 256, 512, 768]
    with pytest.raises(UserError, match="not a multiple of 256"):
        width_grid(700, 256)


def test_the_predicted_error_is_the_weighted_error_of_the_refitted_output() -> None:
    generator = torch.Generator().manual_seed(0)
    tokens, f, d = 300, 10, 6
    h = torch.randn(tokens, f, generator=generator, dtype=torch.float64)
    h = h @ torch.randn(f, f, generator=generator, dtype=torch.float64)
    W = torch.randn(d, f, generator=generator, dtype=torch.float64)
    A = torch.randn(d, d, generator=generator, dtype=torch.float64)
    G = A @ A.T
    C = h.T @ h / tokens
    kept = torch.tensor([1, 4, 5, 8])
    for down in (refit_down(W, C, kept, 0.1), W[:, kept]):
        error = h @ W.T - h[:, kept] @ down.T  # tokens × d
        measured = float(torch.einsum("ti,ij,tj->", error, G, error) / tokens)
        assert weighted_error(W, C, kept, down, G) == pytest.approx(measured, rel=1e-9)
        assert weighted_error(W, C, kept, down, None) == pytest.approx(float((error**2).sum() / tokens), rel=1e-9)


def test_the_curves_fall_to_zero_at_the_full_width_and_leave_the_model_alone() -> None:
    original = tiny_model("llama", intermediate_size=512)
    model, family = copy_model(original), family_for("llama")
    batches = random_batches(original.config.vocab_size, padded=True)
    curves = mlp_width_curves(model, family, batches, 256, MlpOptions(PluginRegistry().selector("obs")))
    assert [sorted(c.errors) for c in curves] == [[0, 256, 512]] * 2
    for curve in curves:
        assert curve.errors[0] > curve.errors[256] > abs(curve.errors[512])
        assert abs(curve.errors[512]) < 1e-9 * curve.errors[0]
    assert max_relative_logit_error(original, model, batches) == 0
    # one pass per layer (each batch advanced as the MLP is measured) gives the two-pass curves
    two_passes = mlp_width_curves(
        model,
        family,
        batches,
        256,
        MlpOptions(PluginRegistry().selector("obs")),
        CurveOptions(attention={0: None, 1: None}),
    )
    assert [c.errors for c in curves] == [c.errors for c in two_passes]
    # given widths: those alone; one width is the grid's at it, several come from one selector path
    obs = PluginRegistry().selector("obs")
    grid = mlp_width_curves(model, family, batches, 128, MlpOptions(obs))
    one = mlp_width_curves(model, family, batches, 1, MlpOptions(obs), CurveOptions(widths=[256]))
    assert [c.errors for c in one] == [{256: c.errors[256]} for c in grid]
    path = mlp_width_curves(model, family, batches, 1, MlpOptions(obs), CurveOptions(widths=[384, 128]))
    for along, alone in zip(path, grid, strict=True):
        # the path's blocks stop at 384 on the way (a partial block there), so 128 is close, not equal
        assert along.errors[128] == pytest.approx(alone.errors[128], rel=0.1)
        assert 0 < along.errors[384] < along.errors[128]


def test_an_attentions_removal_error_is_the_weighted_energy_of_what_it_writes() -> None:
    original = tiny_model("llama", intermediate_size=512, num_hidden_layers=3)
    model, family = copy_model(original), family_for("llama")
    batches = random_batches(original.config.vocab_size, padded=True)
    generator = torch.Generator().manual_seed(3)
    G = {}
    for layer in range(3):
        A = torch.randn(64, 64, generator=generator, dtype=torch.float64)
        G[layer] = A @ A.T
    written: dict[int, list[torch.Tensor]] = {i: [] for i in range(3)}
    mask: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.o_proj.register_forward_hook(lambda _m, _a, out, i=i: written[i].append(out[mask[0]]))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        for batch in batches:  # the model's own forward: what each attention writes on the counted tokens
            mask[:] = [batch.attention_mask.bool()]
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    for hook in hooks:
        hook.remove()
    selector = PluginRegistry().selector("obs")
    weighed = mlp_width_curves(model, family, batches, 256, MlpOptions(selector), CurveOptions(attention=G))
    plain = mlp_width_curves(
        model, family, batches, 256, MlpOptions(selector), CurveOptions(attention={i: None for i in range(3)})
    )
    for i in range(3):
        a = torch.cat(written[i]).to(torch.float64)
        assert weighed[i].attention == pytest.approx(float(torch.einsum("ti,ij,tj->", a, G[i], a)) / len(a), rel=1e-6)
        assert plain[i].attention == pytest.approx(float((a**2).sum()) / len(a), rel=1e-6)
        assert weighed[i].errors == plain[i].errors  # the MLP's curve as without the attention's
    assert all(c.attention is None for c in mlp_width_curves(model, family, batches, 256, MlpOptions(selector)))
    assert max_relative_logit_error(original, model, batches) == 0


def test_each_layer_keeps_its_own_width_and_zero_removes_the_mlp() -> None:
    original = tiny_model("llama", intermediate_size=512, num_hidden_layers=3)
    model, family = copy_model(original), family_for("llama")
    batches = random_batches(original.config.vocab_size, padded=True)
    records = prune_mlp(
        model, family, batches, [512, 0, 256], MlpOptions(PluginRegistry().selector("obs"), feedback=0.0)
    )
    assert [layer.mlp.down_proj.in_features for layer in model.model.layers] == [512, 0, 256]
    assert [r.kept for r in records] == [512, 0, 256] and records[1].error_dropped == pytest.approx(1.0)
    expected = copy_model(original)
    expected.model.layers[1].mlp.down_proj.weight.data.zero_()  # the middle MLP writes nothing
    hand_built = copy.deepcopy(model)
    hand_built.model.layers[2] = expected.model.layers[2]  # the last layer as it was: compare the first two
    assert max_relative_logit_error(expected, hand_built, batches) < 1e-5


def test_obs_walks_one_path_for_several_widths_and_other_selectors_choose_at_each() -> None:
    """`select_widths`: OBS's choices at several widths nest (one greedy path, blocks sized by the
    narrowest) and at one width are `select`'s; a selector without a path chooses at each width."""
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(400, 64, generator=generator, dtype=torch.float64)
    problem = NeuronProblem(
        layer=0,
        keep=32,
        C=X.T @ X / 400,
        activation=X.abs().mean(0),
        down=torch.randn(16, 64, generator=generator, dtype=torch.float64),
        damping=1e-3,
        G=None,
        tokens=400,
    )
    registry = PluginRegistry()
    obs = registry.selector("obs")
    choices = obs.select_widths(problem, [48, 16, 32])
    assert sorted(choices) == [16, 32, 48]
    kept = {width: set(choices[width].kept.tolist()) for width in choices}
    assert kept[16] < kept[32] < kept[48] and [len(kept[w]) for w in (16, 32, 48)] == [16, 32, 48]
    assert torch.equal(obs.select_widths(problem, [32])[32].kept, obs.select(problem).kept)
    magnitude = registry.selector("magnitude")
    at = magnitude.select_widths(problem, [16, 48])
    assert torch.equal(at[16].kept, magnitude.select(dataclasses.replace(problem, keep=16)).kept)
