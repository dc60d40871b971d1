"""Weights streamed from safetensors shards: a walk over a streamed model is bit-identical to the
walk over the same model loaded in memory, each layer is read only when a pass reaches it (and a
read-only pass holds one at a time), and a folder or shard that cannot be streamed is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.engine.pooling import PipelineStep
from compressor.engine.streaming import INDEX_FILE, streamed, streamed_model
from compressor.engine.walk import prune
from compressor.errors import UserError
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor_plugins.pca import PCA
from compressor_plugins.sensitivity import Sensitivity
from tests.conftest import random_batches, tiny_model, widths_for


def _saved(folder: Path, name: str = "llama", **overrides) -> Path:
    """A tiny model saved in several shards (a layer's tensors can straddle two)."""
    tiny_model(name, num_hidden_layers=3, **overrides).save_pretrained(folder, max_shard_size="40KB")
    assert json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    return folder


def _prune(model, name: str, layout: str, strategy) -> dict[str, torch.Tensor]:
    family = family_for(name)
    config = model.config
    d = config.hidden_size
    widths = widths_for(name, config, kept_width(d, 0.25, 8), layout == "global")
    result = prune(
        model,
        fixed_layout(config, family, widths, layout=layout, tie_head=False),
        random_batches(config.vocab_size, count=2),
        [PipelineStep(strategy, strategy.parse_options({}))],
    )
    return {**result.model.state_dict(), **{f"basis.{k}": v for k, v in result.bases.items()}}


@pytest.mark.parametrize(
    ("name", "layout", "strategy"),
    [("llama", "per_site", PCA()), ("llama", "global", Sensitivity()), ("qwen3", "per_site", Sensitivity())],
)
def test_a_streamed_walk_is_bit_identical_to_the_walk_in_memory(
    tmp_path: Path, name: str, layout: str, strategy
) -> None:
    folder = _saved(tmp_path / "model", name)
    in_memory = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    expected = _prune(in_memory, name, layout, strategy)
    model = streamed_model(folder, family_for(name), torch.float32, attn_implementation="eager")
    layers = model.get_submodule(family_for(name).layers)
    assert all(p.is_meta for p in layers.parameters())  # nothing of the layers read yet
    weights = streamed(model)
    assert weights is not None
    actual = _prune(model, name, layout, strategy)
    assert actual.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), key
    layer_reads = {n: c for n, c in weights.reads.items()}
    assert set(layer_reads) == {n for n in weights.index.weight_map if n.startswith(f"{family_for(name).layers}.")}
    # each layer: read by the H pass going down and coming back up for each of its chunks (on CPU,
    # without recomputation, one chunk per batch: 2), by a global layout's survey, and by the walk,
    # which keeps it
    visits = 1 + (2 * 2 if isinstance(strategy, Sensitivity) else 0) + (1 if layout == "global" else 0)
    assert set(layer_reads.values()) == {visits}
    assert weights.peak_resident == 1 and weights.resident == 0  # one layer at a time, none left over


def test_a_folder_without_safetensors_or_a_shard_without_its_tensor_is_one_line(tmp_path: Path) -> None:
    family = family_for("llama")
    empty = tmp_path / "empty"
    tiny_model("llama").config.save_pretrained(empty)
    with pytest.raises(UserError, match="has no safetensors weights") as raised:
        streamed_model(empty, family, torch.float32)
    assert "\n" not in str(raised.value)
    folder = _saved(tmp_path / "model")
    index = json.loads((folder / INDEX_FILE).read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    other = next(file for file in sorted(set(index["weight_map"].values())) if file != index["weight_map"][name])
    index["weight_map"][name] = other  # the index points at a shard that lacks the tensor
    (folder / INDEX_FILE).write_text(json.dumps(index))
    model = streamed_model(folder, family, torch.float32)
    layout = fixed_layout(model.config, family, widths_for("llama", model.config, 48, False))
    with pytest.raises(UserError, match=f"lacks tensor '{name}'"):
        prune(model, layout, random_batches(128), [PipelineStep(PCA())])
    del index["weight_map"]["model.embed_tokens.weight"]
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(UserError, match="no tensor 'model.embed_tokens.weight'"):
        streamed_model(folder, family, torch.float32)


@pytest.mark.parametrize("layout", ["per_site", "global"])
def test_layerwise_evaluation_of_a_streamed_original_gives_the_whole_model_figures(tmp_path: Path, layout: str) -> None:
    from compressor.evaluation.metrics import compare
    from compressor.models.stock import to_stock
    from compressor.runtime.layerwise_eval import layerwise_compare

    folder = _saved(tmp_path / "model")
    family = family_for("llama")
    load = dict(dtype=torch.float32, attn_implementation="eager")
    original = AutoModelForCausalLM.from_pretrained(folder, **load).eval()
    config = original.config
    widths = widths_for("llama", config, kept_width(config.hidden_size, 0.25, 8), layout == "global")
    pruned = prune(
        AutoModelForCausalLM.from_pretrained(folder, **load).eval(),
        fixed_layout(config, family, widths, layout=layout),
        random_batches(config.vocab_size, count=2),
        [PipelineStep(PCA())],
    ).model
    if layout == "global":
        pruned = to_stock(pruned, family, config)[0].eval()
    batches = random_batches(config.vocab_size, count=3, padded=True, seed=7)
    expected = compare(original, pruned, batches, torch.device("cpu"))
    shell = streamed_model(folder, family, torch.float32, attn_implementation="eager")
    found = layerwise_compare(shell, pruned, family, batches, torch.device("cpu"))
    assert found["tokens"] == expected["tokens"]
    for model in ("baseline", "pruned"):
        for key, value in expected[model].items():
            assert found[model][key] == value, (model, key)  # the same operations on the same tensors
    weights = streamed(shell)
    assert weights is not None and weights.peak_resident == 1 and weights.resident == 0


def test_a_pass_that_stops_early_or_raises_gives_its_layer_back(tmp_path: Path) -> None:
    from compressor.engine.layerwise import visit_layers

    family = family_for("llama")
    model = streamed_model(_saved(tmp_path / "model"), family, torch.float32)
    layers = model.get_submodule(family.layers)
    weights = streamed(model)
    assert weights is not None
    for index, _ in visit_layers(model, family, torch.device("cpu"), read_only=True):
        if index == 1:
            break  # the generator is closed: its `finally` gives layer 1 back
    with pytest.raises(RuntimeError, match="a pass failed"):
        for _index, _layer in visit_layers(model, family, torch.device("cpu"), read_only=True):
            raise RuntimeError("a pass failed")
    assert weights.resident == 0 and all(p.is_meta for p in layers.parameters())
