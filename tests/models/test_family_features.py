"""What the newer families needed of the engine, each checked on its own: a hybrid layer's own kind
of attention (readers, writer and keys by the block the layer holds), blocks with no norm before
them, a folded residual multiplier, a divisor of the logits, a model class without sdpa attention,
and what `compress families` says each family allows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from compressor.cli import main
from compressor.engine.pooling import PipelineStep
from compressor.engine.transforms import fuse_norms
from compressor.engine.walk import prune
from compressor.models.axes import AXES
from compressor.models.families import BUILTIN_FAMILIES, family_for
from compressor.models.layout import fixed_layout
from compressor.models.sliced import SlicedDecoderLayer
from compressor.stages.order import BUILTIN_STAGES
from compressor_plugins.pca import PCA
from tests.conftest import (
    FAMILY_CONFIGS,
    copy_model,
    max_relative_logit_error,
    random_batches,
    save_tiny_checkpoint,
    tiny_model,
    widths_for,
)
from tests.engine.test_equivalence import RandomRotation
from tests.run.test_cli import write_recipe


def test_a_hybrid_layer_is_sliced_through_the_block_it_holds() -> None:
    original = tiny_model("qwen3_5_text")
    family = family_for("qwen3_5_text")
    assert [family.mixer_of(layer).path for layer in original.model.layers] == ["linear_attn", "self_attn"]
    widths = widths_for("qwen3_5_text", original.config, 40, slice_head=True)
    model = prune(
        copy_model(original), fixed_layout(original.config, family, widths), random_batches(128), [PipelineStep(PCA())]
    ).model
    linear, full = model.model.layers
    assert linear.attention_name == "linear_attn" and full.attention_name == "self_attn"
    readers = [site.readers for site in linear.sites(family)][0]
    assert readers == [
        getattr(linear.linear_attn, name) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    ]
    assert all(reader.in_features == 40 for reader in readers)
    assert (
        linear.writers("attn", family) == [linear.linear_attn.out_proj]
        and linear.linear_attn.out_proj.out_features == 40
    )
    assert full.writers("attn", family) == [full.self_attn.o_proj]
    # the sliced model keeps the original's keys (norm scales are folded away; transitions are new)
    kept = {k for k in model.state_dict() if "_shortcut" not in k}
    assert kept == {k for k in original.state_dict() if "layernorm" not in k and k != "model.norm.weight"}


def test_blocks_without_a_norm_before_them_read_the_stream_as_it_is() -> None:
    model = tiny_model("olmo2")
    fuse_norms(model, family_for("olmo2"))
    for layer in model.model.layers:
        assert isinstance(layer, SlicedDecoderLayer)
        assert isinstance(layer.input_layernorm, nn.Identity) and isinstance(
            layer.post_attention_layernorm, nn.Identity
        )
        assert layer.attn_writer is not None and layer.mlp_writer is not None  # the norms after the blocks


@pytest.mark.parametrize("name", ["granite"])
def test_the_residual_multiplier_is_folded_and_the_logits_divided(name: str) -> None:
    original = tiny_model(name)
    assert original.config.residual_multiplier != 1 and original.config.logits_scaling != 1
    family = family_for(name)
    d = original.config.hidden_size
    batches = random_batches(128)
    widths = widths_for(name, original.config, d, slice_head=True)
    rotation = [PipelineStep(RandomRotation())]
    exact = prune(copy_model(original), fixed_layout(original.config, family, widths), batches, rotation).model
    assert max_relative_logit_error(original, exact, batches) <= 1e-5
    unfolded = replace(family, residual_multiplier=None)  # the guard: without the fold the model is another
    wrong = prune(copy_model(original), fixed_layout(original.config, unfolded, widths), batches, rotation).model
    assert max_relative_logit_error(original, wrong, batches) > 1e-2
    hidden = torch.randn(2, 3, d)
    head = original.lm_head(original.model.norm(hidden))
    assert torch.allclose(family.logits(original, hidden), head / original.config.logits_scaling)


def test_a_class_without_sdpa_is_told_to_use_eager_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "model", "gemma2")
    recipe = write_recipe(tmp_path, checkpoint)
    capsys.readouterr()
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: model.attn_implementation: sdpa: Gemma2ForCausalLM has no sdpa attention in this transformers; "
        "set model.attn_implementation: eager\n"
    )
    recipe = write_recipe(tmp_path, checkpoint, model__attn_implementation="eager")
    assert main(["run", str(recipe), "--dry-run"]) == 0


def test_compress_families_says_what_each_model_type_can_save_and_prune(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["families"]) == 0
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.count("│") > 4}
    for family in BUILTIN_FAMILIES:
        for model_type in family.model_types:
            cells = [cell.strip() for cell in rows[model_type].split("│")[1:-1]]
            assert cells[1] == family.name
            residual = ["residual"] if family.stock_refusal is None else []
            experts = ["experts"] if family.experts else []
            stock = residual + (["mlp"] if family.mlp_width else []) + (experts if residual else [])
            layouts = ("per_site, global" if stock else "per_site") + (
                ", heterogeneous" if model_type == "llama" else ""
            )
            assert cells[2] == layouts  # GPT-2: nothing stock to prune; DeciLM: Llama's blocks
            shared = ["shared-expert"] if family.shared_expert_width else []
            heads = ["heads"] if "q_proj" in family.attn_inputs else []  # GPT-2, Phi-3: one fused projection
            per_layer = ["per-layer", "kv-heads"] if model_type == "llama" else []
            mlp = ["mlp"] if family.mlp_width else []
            assert cells[3] == ", ".join(["residual", *mlp, *experts, *shared, *heads, "depth", *per_layer])
            stock += [*shared, *heads, "depth"] if residual else []  # a stream kept whole: the MLP alone
            assert cells[4] == (", ".join(stock) or "none")
    assert set(FAMILY_CONFIGS) == {t for f in BUILTIN_FAMILIES for t in f.model_types}  # every one in the suite
    listed = {axis for line in rows.values() for axis in line.split("│")[4].strip().split(", ")}
    assert listed == {axis.key for axis in AXES}, "an axis no family lists, or a listed one that is no axis"


def test_every_section_a_pruning_stage_reads_is_an_axis_s() -> None:
    """A new pruning stage (one that changes the model through a recipe section) needs its axis in
    `models.axes.AXES`, else `compress families` and the dry run do not show it."""
    pruning = {stage.section for stage in BUILTIN_STAGES if stage.section and stage.changes_model}
    pruning.discard("distillation")  # trains the weights it is handed: no axis of its own
    pruning.discard("refinement")
    assert pruning and pruning <= {axis.section for axis in AXES}, pruning - {axis.section for axis in AXES}


def test_the_dry_run_says_the_axes_and_the_embeddings_share(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "model", "gemma3_text")  # vocabulary 8192 × 64: most of it
    recipe = write_recipe(tmp_path, checkpoint, mlp={"kept": 96}, model__attn_implementation="eager")
    capsys.readouterr()
    assert main(["run", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    model = tiny_model("gemma3_text", vocab_size=8192)
    share = model.model.embed_tokens.weight.numel() / sum(p.numel() for p in model.parameters())
    assert f"the embedding is {share:.0%} of the parameters" in out and share > 0.5
    assert "checked: axes: residual width, MLP width (this family allows residual, mlp, heads, depth)" in out


def test_a_hybrid_layers_block_gets_the_arguments_its_own_layer_gives_it() -> None:
    """Qwen3.5's layer passes its linear attention no position embeddings; fast kernels (fla,
    causal-conv1d) may refuse arguments they do not know, so the sliced layer leaves them out too."""
    original = tiny_model("qwen3_5_text")
    family = family_for("qwen3_5_text")
    widths = widths_for("qwen3_5_text", original.config, 40, slice_head=True)
    batches = random_batches(128, count=1)
    model = prune(copy_model(original), fixed_layout(original.config, family, widths), batches, [PipelineStep(PCA())])
    seen: dict[str, set[str]] = {}

    def record(label: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen[label] = set(kwargs)

        return hook

    original.model.layers[0].linear_attn.register_forward_pre_hook(record("original"), with_kwargs=True)
    model.model.model.layers[0].linear_attn.register_forward_pre_hook(record("sliced"), with_kwargs=True)
    with torch.no_grad():
        for m in (original, model.model):
            m(input_ids=batches[0].input_ids, attention_mask=batches[0].attention_mask)
    assert seen["sliced"] == seen["original"] and "position_embeddings" not in seen["sliced"]
