"""Memory bounds, measured with a live-tensor tracker: the walk holds one copy of the calibration
activations plus the batch in flight, the layer-wise H pass holds one layer's graph, and on an
accelerator (emulated by the meta device) nothing the device holds grows with the calibration tokens."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch.utils._pytree import tree_leaves

from compressor.engine.activations import held_on
from compressor.engine.calibration import capture_layer_inputs
from compressor.engine.fisher import estimate_fisher
from compressor.engine.pooling import PipelineStep
from compressor.engine.transforms import fuse_norms
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.evaluation.memtrack import LiveBytes, emulated_accelerator
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor.recipe.sections.sensitivity import SensitivityOptions
from compressor_plugins.pca import PCA
from compressor_plugins.sensitivity import Sensitivity
from tests.conftest import copy_model, random_batches, tiny_model, widths_for

BATCH, LENGTH = 4, 64


def _batch_bytes(model) -> int:
    return BATCH * LENGTH * model.config.hidden_size * 4  # one batch of float32 activations


def _walk_peak(model, batches: int) -> int:
    widths = widths_for("llama", model.config, kept_width(model.config.hidden_size, 0.25, 8), False)
    tracker = LiveBytes()
    with tracker:
        prune(
            copy_model(model),
            fixed_layout(model.config, family_for("llama"), widths),
            random_batches(128, count=batches, batch=BATCH, length=LENGTH),
            [PipelineStep(PCA())],
        )
    return tracker.peak["cpu"]


def test_tracker_counts_live_tensors_and_forgets_freed_ones() -> None:
    tracker = LiveBytes()
    with tracker:
        a = torch.zeros(1000)
        b = torch.zeros(500)
        del a
        c = b + 1
    assert tracker.peak["cpu"] == 6000 and tracker.live["cpu"] == 4000
    del b, c


def _captured_bytes_per_batch(model) -> int:
    """One batch's captured layer arguments (mask, position embeddings), each storage once."""
    family = family_for("llama")
    fused = copy_model(model)
    fuse_norms(fused, family)
    inputs = capture_layer_inputs(
        fused, family, random_batches(128, count=1, batch=BATCH, length=LENGTH), torch.device("cpu")
    )
    leaves = [t for kwargs in inputs.layer_kwargs[0] for t in tree_leaves(kwargs) if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in leaves}
    return sum(storages.values())


def test_the_walk_holds_one_copy_of_the_activations() -> None:
    """Fourteen more batches cost one more copy of their activations (the store) and of their
    captured layer arguments, not two or three copies (inputs, block outputs and their
    projection at once)."""
    model = tiny_model("llama")
    per_batch = _batch_bytes(model) + _captured_bytes_per_batch(model)
    growth = _walk_peak(model, 16) - _walk_peak(model, 2)
    assert 14 * per_batch * 0.9 <= growth <= 14 * per_batch * 1.1


def _h_working_set(layers: int, recompute: bool) -> int:
    """Peak bytes the H pass adds to what exists when it starts, one batch per chunk."""
    model = tiny_model("llama", num_hidden_layers=layers, intermediate_size=512)
    family = family_for("llama")
    fuse_norms(model, family)
    inputs = capture_layer_inputs(
        model, family, random_batches(128, count=2, batch=BATCH, length=LENGTH), torch.device("cpu")
    )
    tracker = LiveBytes()
    with tracker:
        estimate_fisher(
            model, family, inputs, SensitivityOptions(chunk=BATCH, recompute=recompute), torch.device("cpu")
        )
    return tracker.peak["cpu"]


def test_the_layerwise_h_pass_holds_one_layers_graph() -> None:
    """Four more layers cost their stored inputs and their sites' H totals when layers are
    recomputed, not four more layers' graphs (which keeping the graphs costs, as a whole-model
    backward pass does)."""
    d = 64
    recomputed = _h_working_set(6, True) - _h_working_set(2, True)
    kept = _h_working_set(6, False) - _h_working_set(2, False)
    stored_inputs_and_totals = 4 * _batch_bytes(tiny_model("llama")) + 8 * d * d * 4
    assert recomputed <= 1.1 * stored_inputs_and_totals
    assert kept > 3 * recomputed  # the measure tells the two apart


def test_a_read_only_visit_gives_back_the_very_host_tensors() -> None:
    """The H pass and the survey only run layers: they come back without a copy (on a GPU, a
    device-to-host copy of every weight per visit), as the tensors they were."""
    layer = tiny_model("llama").model.layers[0]
    tensors = [*layer.parameters(), *layer.buffers()]
    storages = [t.data_ptr() for t in tensors]
    values = [t.clone() for t in tensors]
    with held_on([layer], torch.device("meta"), read_only=True):  # meta: a device with no data to copy back
        assert all(t.device.type == "meta" for t in (*layer.parameters(), *layer.buffers()))
    after = [*layer.parameters(), *layer.buffers()]
    assert [t.data_ptr() for t in after] == storages
    assert all(torch.equal(a, b) for a, b in zip(after, values))
    assert all(p.device.type == "cpu" for p in layer.parameters())


def test_the_emulated_accelerator_counts_what_moves_there_and_what_comes_back() -> None:
    """The meta device as a data-less accelerator: moves and results are counted on its side,
    copies back are host tensors of the same size, checks read off it pass, and a generator
    asked for there is the host's."""
    host = torch.ones(256, 256)
    size = host.untyped_storage().nbytes()
    with emulated_accelerator() as device, LiveBytes() as tracker:
        moved = [host.to(device) for _ in range(3)]
        back = (moved[0] * 2).to("cpu")
        assert dict(tracker.peak) == {"meta": 4 * size, "cpu": size}  # three copies and the product; the
        # copy back (`host` was made before the tracker)
        assert back.device.type == "cpu" and back.shape == host.shape and back.dtype == host.dtype
        assert bool(torch.isfinite(moved[1]).all())
        assert torch.Generator(device=device).device.type == "cpu"
    assert torch.Generator is torch._C.Generator  # the host generator stood in only inside


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "masked"])
def test_attention_on_the_emulated_accelerator_never_forms_the_attention_weights(masked: bool) -> None:
    """A GPU's fused attention keeps the output and a log-sum-exp per row; the meta device alone
    would take the math path and hold every head's L x L weights. Grouped key/value heads and
    gradients come out in their own shapes."""
    batch, heads, groups, length, dim = 2, 8, 2, 512, 16
    weights = batch * heads * length * length * 2

    def peak(emulate: bool) -> int:
        with emulated_accelerator() if emulate else nullcontext():
            query = torch.empty(batch, heads, length, dim, device="meta", dtype=torch.bfloat16, requires_grad=True)
            key = torch.empty(batch, groups, length, dim, device="meta", dtype=torch.bfloat16, requires_grad=True)
            mask = torch.ones(batch, 1, length, length, dtype=torch.bool, device="meta") if masked else None
            with LiveBytes() as tracker:
                out = torch.nn.functional.scaled_dot_product_attention(
                    query, key, key, attn_mask=mask, is_causal=not masked, enable_gqa=True
                )
                out.sum().backward()
            assert out.shape == query.shape and query.grad.shape == query.shape and key.grad.shape == key.shape
        return tracker.peak["meta"]

    assert peak(emulate=True) < weights < peak(emulate=False)
    assert torch.nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def _emulated_peaks(strategy, batches: int) -> dict[str, int]:
    """Peak live bytes on the device and on the host of a whole prune on the emulated accelerator."""
    model = tiny_model("llama")
    widths = widths_for("llama", model.config, kept_width(model.config.hidden_size, 0.25, 8), False)
    tracker = LiveBytes()
    with emulated_accelerator() as device, tracker:
        tracker.adopt(*model.parameters(), *model.buffers())
        prune(
            model,
            fixed_layout(model.config, family_for("llama"), widths),
            random_batches(128, count=batches, batch=BATCH, length=LENGTH),
            [PipelineStep(strategy, strategy.parse_options({}))],
            WalkOptions(device=device, sensitivity=SensitivityOptions(chunk=2 * BATCH)),
        )
    return dict(tracker.peak)


@pytest.mark.parametrize("strategy", [PCA(), Sensitivity()], ids=["pca", "sensitivity"])
def test_on_an_accelerator_only_the_host_grows_with_the_calibration_tokens(strategy) -> None:
    """Four times the batches: the device's peak (one layer, one batch, the statistics, the head
    in the H pass) is the same to the byte, while the host holds every batch's activations."""
    few, many = _emulated_peaks(strategy, 2), _emulated_peaks(strategy, 8)
    assert many["meta"] == few["meta"] > 0
    assert many["cpu"] - few["cpu"] >= 6 * _batch_bytes(tiny_model("llama"))
