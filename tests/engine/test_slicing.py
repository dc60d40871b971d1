"""Slicing at 25%: every linear gets the expected shape and the parameter count drops accordingly."""

from __future__ import annotations

import pytest
import torch

from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.errors import UserError
from compressor.evaluation.metrics import parameter_count
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor.models.sites import site_ids, site_widths
from compressor_plugins.pca import PCA
from tests.conftest import FAMILY_CONFIGS, copy_model, random_batches, tiny_model, widths_for


@pytest.mark.parametrize(
    ("hidden", "sparsity", "round_to", "expected"),
    [
        (256, 0.25, 8, 192),
        (256, 0.1, 8, 224),
        (256, 0.2, 8, 200),
        (256, 0.3, 8, 176),
        (64, 0.25, 1, 48),
        (64, 0.0, 8, 64),
    ],
)
def test_kept_width_is_floored_to_the_interval(hidden: int, sparsity: float, round_to: int, expected: int) -> None:
    assert kept_width(hidden, sparsity, round_to) == expected


def test_impossible_sparsity_is_refused() -> None:
    with pytest.raises(UserError, match="leaves no width"):
        kept_width(64, 0.95, 8)


def test_site_widths_keep_the_head_input_unless_asked() -> None:
    llama = family_for("llama")
    assert site_widths(llama, 2, 64, 48, slice_head=False) == {
        "embedding": 48,
        "layers.0.attn": 48,
        "layers.0.mlp": 48,
        "layers.1.attn": 48,
        "layers.1.mlp": 64,
    }
    assert list(site_widths(llama, 2, 64, 48, slice_head=True).values()) == [48] * 5
    assert site_ids(family_for("phi"), 2) == ["embedding", "layers.0", "layers.1"]


def _expected_opt_parameters(config, widths: list[int]) -> int:
    """OPT: biases on every linear, learned positions, and a head bias (the final LayerNorm's β)."""
    d, ffn, vocab = config.hidden_size, config.ffn_dim, config.vocab_size
    total = vocab * widths[0] + (config.max_position_embeddings + 2) * widths[0]  # tokens, positions (offset 2)
    total += vocab * widths[-1] + vocab  # head and its bias
    for i in range(config.num_hidden_layers):
        w_in, w_attn, w_mlp = widths[2 * i], widths[2 * i + 1], widths[2 * i + 2]
        total += 3 * (w_in * d + d) + d * w_attn + w_attn  # q, k, v, out_proj with biases
        total += w_attn * ffn + ffn + ffn * w_mlp + w_mlp  # fc1, fc2 with biases
        total += w_in * w_attn + w_attn * w_mlp  # residual transitions
    return total


def _expected_gpt2_parameters(config, widths: list[int]) -> int:
    """GPT-2: fused qkv (c_attn), biases on every linear, learned positions, and a head bias (ln_f's β)."""
    d, inner, vocab = config.hidden_size, config.n_inner or 4 * config.hidden_size, config.vocab_size
    total = vocab * widths[0] + config.n_positions * widths[0] + vocab * widths[-1] + vocab
    for i in range(config.num_hidden_layers):
        w_in, w_attn, w_mlp = widths[2 * i], widths[2 * i + 1], widths[2 * i + 2]
        total += w_in * 3 * d + 3 * d + d * w_attn + w_attn  # c_attn, attn c_proj
        total += w_attn * inner + inner + inner * w_mlp + w_mlp  # c_fc, mlp c_proj
        total += w_in * w_attn + w_attn * w_mlp  # residual transitions
    return total


def _expected_phi_parameters(config, widths: list[int]) -> int:
    """Phi-2: one site per layer (parallel blocks), biases everywhere, a head bias."""
    inter, vocab = config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    total = vocab * widths[0] + vocab * widths[-1] + vocab
    for i in range(config.num_hidden_layers):
        w_in, w_out = widths[i], widths[i + 1]
        total += (w_in + 1) * (q + 2 * kv) + q * w_out + w_out  # q, k, v, dense with biases
        total += w_in * inter + inter + inter * w_out + w_out  # fc1, fc2 with biases
        total += w_in * w_out  # the one residual transition
    return total


def _is_moe_layer(config, index: int) -> bool:
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    return bool(experts) and index not in (getattr(config, "mlp_only_layers", None) or [])


def _expected_moe_parameters(config, reads: int, writes: int) -> int:
    """A sparse MoE block's: the router (E × reads), every expert's gate and up (2f × reads) and down
    (writes × f), and a shared expert with its gate where there is one."""
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    total = experts * reads + experts * (2 * width * reads + width * writes)
    if config.model_type == "gpt_oss":  # the router's bias, every expert's gate/up and down biases
        total += experts + experts * (2 * width + writes)
    shared = getattr(config, "shared_expert_intermediate_size", 0)
    if shared:
        total += 2 * shared * reads + shared * writes + reads  # gate, up, down; its sigmoid gate
    return total


def _expected_parameters(config, widths: list[int]) -> int:
    """Parameter count of the sliced layout, computed from the config alone."""
    if config.model_type == "phi":
        return _expected_phi_parameters(config, widths)
    if config.model_type == "opt":
        return _expected_opt_parameters(config, widths)
    if config.model_type == "gpt2":
        return _expected_gpt2_parameters(config, widths)
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    inter, vocab = config.intermediate_size, config.vocab_size
    qkv_bias = getattr(config, "attention_bias", False) or config.model_type in ("qwen2", "qwen2_moe")
    attn_bias = (heads + 2 * kv) * hd if qkv_bias else 0
    total = vocab * widths[0] + vocab * widths[-1]  # embedding, head (untied)
    post_norms = config.model_type in ("gemma2", "gemma3_text", "olmo2", "olmo3")  # o and down keep width d;
    # writers d → kept follow
    d = config.hidden_size
    for i in range(config.num_hidden_layers):
        w_in, w_attn, w_mlp = widths[2 * i], widths[2 * i + 1], widths[2 * i + 2]
        if getattr(config, "layer_types", None) and config.layer_types[i] == "linear_attention":  # Gated DeltaNet
            keys, values, heads_v = (
                config.linear_num_key_heads * config.linear_key_head_dim,
                config.linear_num_value_heads * config.linear_value_head_dim,
                config.linear_num_value_heads,
            )
            total += w_in * (2 * keys + values + values + 2 * heads_v)  # in_proj_qkv, _z, _b, _a
            total += (2 * keys + values) * config.linear_conv_kernel_dim + 2 * heads_v  # conv1d, dt_bias, A_log
            total += config.linear_value_head_dim + values * w_attn  # gated norm, out_proj
        else:
            # Qwen3.5's q_proj also yields a gate
            gated = 2 if config.model_type in ("qwen3_5_text", "qwen3_5_moe_text") else 1
            total += w_in * (gated * heads + 2 * kv) * hd + attn_bias  # q, k, v
            total += heads * hd * d + d * w_attn if post_norms else heads * hd * w_attn  # o (+ writer)
            if config.model_type == "gpt_oss":
                total += w_attn + heads  # o_proj's bias; one attention sink per head
            if config.model_type in ("qwen3", "gemma3_text", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_moe"):
                total += 2 * hd  # per-head q and k norms
            if config.model_type in ("olmo2", "olmo3", "olmoe"):
                total += (heads + kv) * hd  # q and k norms over the whole projection
        if _is_moe_layer(config, i):
            total += _expected_moe_parameters(config, w_attn, w_mlp)
        else:
            total += 2 * w_attn * inter  # gate, up
            total += inter * d + d * w_mlp if post_norms else inter * w_mlp  # down (+ writer)
        total += w_in * w_attn + w_attn * w_mlp  # residual transitions
    return total


@pytest.mark.parametrize("family_name", sorted(FAMILY_CONFIGS))
@pytest.mark.parametrize("slice_head", [False, True])
def test_slicing_25_percent_shapes_and_parameters(family_name: str, slice_head: bool) -> None:
    if family_for(family_name).head_width_is_embedding_width and not slice_head:
        pytest.skip("this family slices the head input like the embedding (refused otherwise: tests/run/test_cli.py)")
    original = tiny_model(family_name)
    config = original.config
    d = config.hidden_size
    kept = kept_width(d, 0.25, 8)
    by_site = widths_for(family_name, config, kept, slice_head)
    result = prune(
        copy_model(original),
        fixed_layout(original.config, family_for(family_name), by_site),
        random_batches(config.vocab_size),
        [PipelineStep(PCA())],
    )
    widths = list(by_site.values())
    model = result.model
    family = family_for(family_name)
    assert model.config.model_type == f"sliced_{family_name}"
    assert model.get_submodule(family.embedding).weight.shape == (config.vocab_size, kept)
    for i, layer in enumerate(model.get_submodule(family.layers)):
        if family.parallel:  # one site: both blocks read the layer input and write the layer output
            w_in, w_attn, w_mlp, mlp_reads = widths[i], widths[i + 1], widths[i + 1], widths[i]
        else:
            w_in, w_attn, w_mlp = widths[2 * i], widths[2 * i + 1], widths[2 * i + 2]
            mlp_reads = w_attn
        for name in layer.mixer(family).inputs:
            assert layer.attention.get_submodule(name).in_features == w_in
        assert [w.out_features for w in layer.writers("attn", family)] == [w_attn]
        readers, writers = family.mlp_readers(layer.mlp), layer.writers("mlp", family)
        assert readers and all(linear.in_features == mlp_reads for linear in readers)  # a router and every expert
        assert writers and all(linear.out_features == w_mlp for linear in writers)
        assert layer.attn_shortcut.weight.shape == (w_attn, w_in)
        if family.parallel:
            assert layer.mlp_shortcut is None
        else:
            assert layer.mlp_shortcut.weight.shape == (w_mlp, w_attn)
    assert model.get_submodule(family.head).in_features == (kept if slice_head else d)
    assert parameter_count(model) == _expected_parameters(config, widths)
    with torch.no_grad():
        logits = model(random_batches(config.vocab_size, count=1)[0].input_ids).logits
    assert torch.isfinite(logits).all()


def test_sliced_model_stays_close_on_its_calibration_data() -> None:
    """Slicing a quarter of a tiny random model perturbs, but does not destroy, its output."""
    original = tiny_model("llama")
    d, layers = original.config.hidden_size, original.config.num_hidden_layers
    batches = random_batches(128)
    result = prune(
        copy_model(original),
        fixed_layout(
            original.config,
            family_for("llama"),
            site_widths(family_for("llama"), layers, d, kept_width(d, 0.25, 8), False),
        ),
        batches,
        [PipelineStep(PCA())],
    )
    with torch.no_grad():
        ref = torch.log_softmax(original(batches[0].input_ids).logits, -1)
        out = torch.log_softmax(result.model(batches[0].input_ids).logits, -1)
    kl = (ref.exp() * (ref - out)).sum(-1).mean().item()
    assert 0 < kl < 0.5


@pytest.mark.parametrize(("name", "layout", "tie_head"), [("llama", "global", False), ("qwen2", "per_site", True)])
def test_a_kept_survey_is_recalled_by_the_next_walk_and_prunes_as_its_own_would(
    name: str, layout: str, tie_head: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Walks that differ only in their widths (the splits of one budget) share one survey of the
    original model (`SurveyMemo`): the second walk runs no survey pass and gives the tensors a walk
    that surveyed for itself gives; another pooling surveys again."""
    from compressor.engine import survey as survey_module
    from compressor.engine.survey import SurveyMemo
    from compressor.engine.walk_options import WalkOptions

    config, family = tiny_model(name).config, family_for(name)
    batches = random_batches(config.vocab_size, padded=True)
    passes: list[int] = []
    real_survey = survey_module.survey_pass
    monkeypatch.setattr(survey_module, "survey_pass", lambda *args: passes.append(1) or real_survey(*args))

    def pruned(sparsity: float, options: WalkOptions) -> dict[str, torch.Tensor]:
        k = kept_width(config.hidden_size, sparsity, 8)
        widths = {site: k for site in site_ids(family, config.num_hidden_layers)}
        sliced = fixed_layout(config, family, widths, layout=layout, tie_head=tie_head)
        model = tiny_model(name)  # the same weights; a copy would share (and see edited) its config
        return prune(model, sliced, batches, [PipelineStep(PCA())], options).model.state_dict()

    memo = SurveyMemo()
    pruned(0.25, WalkOptions(survey=memo))
    recalled = pruned(0.5, WalkOptions(survey=memo))
    assert len(passes) == 1 and memo.passes == 1
    own = pruned(0.5, WalkOptions())
    assert len(passes) == 2
    assert recalled.keys() == own.keys() and all(torch.equal(recalled[name], own[name]) for name in own)
    pruned(0.5, WalkOptions(survey=memo, pooling="sum"))
    assert len(passes) == 3 and memo.passes == 2
