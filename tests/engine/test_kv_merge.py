"""Fewer KV heads per layer (`models.kv_heads`, `engine.kv_merge`; issue 49, item 3): merging KV
heads that are alike changes nothing, merged heads are their groups' mean, the output
projection's refit is the damped least-squares fit, the curves' predicted error is the G-weighted
error the merged and refitted attention writes on the tokens it was measured on (the model left
alone), and the allocation with KV-head options is the best combination within the total."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from compressor.engine.kv_merge import KvMerge, refit_output
from compressor.engine.mlp_widths import WidthCurve, allocate
from compressor.engine.neurons import CurveOptions, MlpOptions, mlp_width_curves
from compressor.models.families import family_for
from compressor.models.kv_heads import kv_options, layer_kv_heads, merge_kv_heads, set_output
from compressor.strategies.registry import PluginRegistry
from tests.conftest import copy_model, max_relative_logit_error, random_batches, tiny_model


def test_kv_heads_that_are_alike_merge_without_changing_the_logits_and_others_merge_to_their_mean() -> None:
    original = tiny_model("llama", num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2)
    config = original.config
    width = config.head_dim
    assert kv_options(config) == [1, 2]
    batches = random_batches(config.vocab_size, padded=True)
    alike = copy_model(original)
    for layer in alike.model.layers:  # KV heads 0 and 1 alike, and 2 and 3
        for linear in (layer.self_attn.k_proj, layer.self_attn.v_proj):
            linear.weight.data[width : 2 * width] = linear.weight.data[:width]
            linear.weight.data[3 * width :] = linear.weight.data[2 * width : 3 * width]
    merged = copy_model(alike)
    for layer in merged.model.layers:
        merge_kv_heads(layer.self_attn, config, 2)
        assert layer_kv_heads(layer.self_attn, config) == 2 and layer.self_attn.num_key_value_groups == 2
    assert max_relative_logit_error(alike, merged, batches) < 1e-6
    one = copy_model(original).model.layers[0].self_attn
    merge_kv_heads(one, config, 1)
    key = original.model.layers[0].self_attn.k_proj.weight.data.reshape(4, width, -1)
    assert torch.allclose(one.k_proj.weight.data, key.mean(0))
    with pytest.raises(ValueError, match="cannot merge into 3"):
        merge_kv_heads(copy.deepcopy(original.model.layers[0].self_attn), config, 3)


def test_the_output_refit_is_the_damped_least_squares_fit() -> None:
    generator = torch.Generator().manual_seed(0)
    tokens, width, d = 500, 12, 5
    z = torch.randn(tokens, width, generator=generator, dtype=torch.float64)
    z_merged = z @ torch.randn(width, width, generator=generator, dtype=torch.float64) * 0.3 + 0.1 * z
    W = torch.randn(d, width, generator=generator, dtype=torch.float64)
    cross, merged = z.T @ z_merged / tokens, z_merged.T @ z_merged / tokens
    for damping in (0.0, 0.05):
        delta = damping * float(merged.diagonal().mean())
        # ridge towards W: rows of sqrt(δ·tokens)·I asking W' to stay W
        rows = torch.cat([z_merged, (delta * tokens) ** 0.5 * torch.eye(width, dtype=torch.float64)])
        targets = torch.cat([z @ W.T, (delta * tokens) ** 0.5 * W.T])
        expected = torch.linalg.lstsq(rows, targets).solution.T
        assert torch.allclose(refit_output(W, cross, merged, damping), expected, atol=1e-9)
    assert torch.allclose(refit_output(W, z.T @ z / tokens, z.T @ z / tokens, 0.01), W, atol=1e-9)  # nothing merged


def test_the_predicted_error_is_what_the_merged_refitted_attention_writes_and_the_model_is_left_alone() -> None:
    original = tiny_model("llama", intermediate_size=512, num_hidden_layers=3)
    model, family = copy_model(original), family_for("llama")
    batches = random_batches(original.config.vocab_size, padded=True)
    generator = torch.Generator().manual_seed(5)
    G = {}
    for layer in range(3):
        A = torch.randn(64, 64, generator=generator, dtype=torch.float64)
        G[layer] = A @ A.T
    curves = mlp_width_curves(
        model,
        family,
        batches,
        256,
        MlpOptions(PluginRegistry().selector("obs")),
        CurveOptions(kv_counts=[1], kv_weights=G),
    )
    assert max_relative_logit_error(original, model, batches) == 0
    assert all(curve.attention is None and [m.kv for m in curve.kv_merges] == [1] for curve in curves)
    plain = mlp_width_curves(
        model, family, batches, 256, MlpOptions(PluginRegistry().selector("obs")), CurveOptions(kv_counts=[1])
    )
    for index, curve in enumerate(curves):
        merge = curve.kv_merges[0]
        changed = copy_model(original)  # this layer alone merged: its input is the unpruned model's
        attention = changed.model.layers[index].self_attn
        merge_kv_heads(attention, changed.config, 1)
        set_output(attention, family, merge.output)
        written: dict[str, list[torch.Tensor]] = {name: [] for name in ("before", "after")}
        mask: list[torch.Tensor] = []

        def recorder(name: str, found: dict[str, list[torch.Tensor]], counted: list[torch.Tensor]) -> object:
            return lambda _m, _a, out: found[name].append(out[counted[0]].to(torch.float64))

        hooks = [
            m.model.layers[index].self_attn.o_proj.register_forward_hook(recorder(name, written, mask))
            for m, name in ((original, "before"), (changed, "after"))
        ]
        with torch.no_grad():
            for batch in batches:
                mask[:] = [batch.attention_mask.bool()]
                original(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
                changed(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        for hook in hooks:
            hook.remove()
        error = torch.cat(written["before"]) - torch.cat(written["after"])
        measured = float(torch.einsum("ti,ij,tj->", error, G[index], error)) / len(error)
        assert merge.error == pytest.approx(measured, rel=1e-4)
        assert plain[index].kv_merges[0].error == pytest.approx(float((error**2).sum()) / len(error), rel=1e-4)
        assert curve.errors == plain[index].errors  # the MLP's curve as without the merges


@pytest.mark.parametrize("seed", range(4))
def test_with_kv_options_the_allocation_is_the_best_combination_of_widths_and_attention_states(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    units, at = 500, {1: 300, 2: 420}  # an attention as it was, and at 1 or 2 KV heads
    curves = []
    for layer in range(3):
        drops = torch.rand(3, generator=generator, dtype=torch.float64).sort(descending=True).values
        errors = {w: float(drops[i:].sum()) for i, w in enumerate((0, 256, 512))} | {768: 0.0}
        merges = torch.rand(2, generator=generator, dtype=torch.float64) * 0.6
        removal = float(torch.rand(1, generator=generator, dtype=torch.float64)) * 2 if layer != 1 else None
        kv = (KvMerge(1, float(merges.max()), torch.zeros(1)), KvMerge(2, float(merges.min()), torch.zeros(1)))
        curves.append(WidthCurve(layer, errors, removal, kv))
    states: list[list[tuple[int, float, int | None]]] = []
    for curve in curves:
        options = [(units, 0.0, None)] + [(at[m.kv], m.error, m.kv) for m in curve.kv_merges]
        states.append(options + ([(0, curve.attention, 0)] if curve.attention is not None else []))
    merged_any = False
    for total in (1500, 2000, 2400, 3000):
        allocation = allocate(curves, total, units, at)
        chosen = [
            next(o for o in options if o[2] == (0 if i in allocation.attention_removed else allocation.kv_heads.get(i)))
            for i, options in enumerate(states)
        ]
        assert sum(allocation.widths) + sum(c[0] for c in chosen) <= total
        merged_any |= bool(allocation.kv_heads)
        found = sum(c.errors[w] + s[1] for c, w, s in zip(curves, allocation.widths, chosen, strict=True))
        best = min(
            sum(c.errors[w] + s[1] for c, w, s in zip(curves, combo, picked, strict=True))
            for combo in itertools.product(*(c.errors for c in curves))
            for picked in itertools.product(*states)
            if sum(combo) + sum(s[0] for s in picked) <= total
        )
        assert found == pytest.approx(best)
    assert merged_any  # the seeds reach a merge: the test sees that choice
