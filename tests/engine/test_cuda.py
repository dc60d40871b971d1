"""The engine on a CUDA device computes what it computes on the host (skipped without a GPU).

Layers travel to the device one at a time and activations stay on the host, so these check the
moves as much as the maths: a rotation without slicing stays exact, a walk on the GPU picks the
subspaces the CPU walk picks (given the same H: a GPU generator draws other labels), and the H
pass gives the same H with and without recomputing layers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from compressor.cli import main
from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout
from compressor.recipe.sections.sensitivity import SensitivityOptions
from compressor.strategies.registry import PluginRegistry
from tests.conftest import (
    FAMILY_CONFIGS,
    copy_model,
    max_relative_logit_error,
    random_batches,
    save_tiny_checkpoint,
    tiny_model,
    widths_for,
)
from tests.run.test_cli import _DELETE, write_recipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def _steps(name: str) -> list[PipelineStep]:
    strategy = PluginRegistry().strategy(name)
    return [PipelineStep(strategy, strategy.parse_options({}))]


@pytest.mark.parametrize("family_name", sorted(FAMILY_CONFIGS))
def test_rotation_on_the_gpu_reproduces_logits(family_name: str) -> None:
    original = tiny_model(family_name)
    batches = random_batches(original.config.vocab_size, padded=True)
    d = original.config.hidden_size
    result = prune(
        copy_model(original),
        fixed_layout(
            original.config, family_for(family_name), widths_for(family_name, original.config, d, slice_head=True)
        ),
        batches,
        _steps("pca"),
        WalkOptions(device=CUDA),
    )
    assert next(result.model.parameters()).device.type == "cpu"  # layers go back to the host
    assert max_relative_logit_error(original, result.model, batches) <= 1e-4


@pytest.mark.parametrize("strategy", ["pca", "sensitivity"])
@pytest.mark.parametrize("family_name", ["llama", "gemma2", "phi"])
def test_a_gpu_walk_chooses_what_the_cpu_walk_chooses(family_name: str, strategy: str) -> None:
    original = tiny_model(family_name)
    batches = random_batches(original.config.vocab_size, count=3)
    family = family_for(family_name)
    widths = widths_for(family_name, original.config, 48, slice_head=True)
    on_cpu = prune(copy_model(original), fixed_layout(original.config, family, widths), batches, _steps(strategy))
    on_gpu = prune(
        copy_model(original),
        fixed_layout(original.config, family, widths),
        batches,
        _steps(strategy),
        WalkOptions(device=CUDA, fisher=on_cpu.fisher),
    )
    for site, cpu in on_cpu.bases.items():  # V_s, d × k_s: the same kept subspace
        gpu = on_gpu.bases[site]
        assert torch.dist(cpu @ cpu.T, gpu @ gpu.T) <= 1e-6 * cpu.shape[1], site
    assert max_relative_logit_error(on_cpu.model, on_gpu.model, batches) <= 1e-4


def test_h_on_the_gpu_does_not_depend_on_recomputation() -> None:
    original = tiny_model("llama")
    batches = random_batches(original.config.vocab_size, count=3)
    family = family_for("llama")
    widths = widths_for("llama", original.config, 48, slice_head=True)
    kept, recomputed = (
        prune(
            copy_model(original),
            fixed_layout(original.config, family, widths),
            batches,
            _steps("sensitivity"),
            WalkOptions(device=CUDA, sensitivity=SensitivityOptions(recompute=flag, chunk=2)),
        ).fisher
        for flag in (False, True)
    )
    for site in kept:
        assert torch.allclose(kept[site], recomputed[site], rtol=1e-4, atol=1e-6 * kept[site].abs().max()), site


@pytest.mark.parametrize("name", ["gemma3_text", "olmo2"])
def test_a_stock_run_of_the_mlp_alone_on_the_gpu_keeps_what_the_cpu_run_keeps(name: str, tmp_path: Path) -> None:
    """A global layout that keeps the stream whole (`models.mlp_only`): its MLP stage on the GPU
    chooses the CPU's neurons and refits the same down projections, the stream's weights untouched."""
    checkpoint = save_tiny_checkpoint(tmp_path / "original", name)
    saved = {}
    for device in ("cpu", "cuda"):
        (tmp_path / device).mkdir()
        recipe = write_recipe(
            tmp_path / device,
            checkpoint,
            device=device,
            sparsity=_DELETE,
            target_params=0.98,
            slicing={"layout": "global"},
            mlp={},
            evaluation=None,
            model__attn_implementation="eager",
            output=str(tmp_path / device / "out"),
        )
        assert main(["run", str(recipe)]) == 0
        saved[device] = load_file(tmp_path / device / "out" / "model" / "model.safetensors")
    original = load_file(checkpoint / "model.safetensors")
    assert saved["cpu"].keys() == saved["cuda"].keys()
    for key, cpu in saved["cpu"].items():
        gpu = saved["cuda"][key]
        assert cpu.shape == gpu.shape, key
        if cpu.shape == original[key].shape:  # everything but the MLPs is the original's
            assert torch.equal(cpu, original[key]) and torch.equal(gpu, original[key]), key
        else:
            assert torch.allclose(cpu, gpu, rtol=1e-4, atol=1e-5 * cpu.abs().max()), key
