"""Shared fixtures: tiny random models of each supported family, and paths."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
BUILTIN_PLUGINS = "pca,sensitivity,stiefel,neurons,experts,depth,heads"
os.environ["COMPRESS_PLUGINS"] = BUILTIN_PLUGINS  # the suite means the built-ins: a user's own plugin, installed
# in the same venv, must not change what it sees (tests of third-party plugins name theirs)

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel  # noqa: E402

import compressor  # noqa: E402,F401  (registers the sliced architectures)
from compressor.data.batches import Batch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SHARED = ROOT.parent / "shared"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=128,
)

QWEN3_5_LAYERS: dict = dict(  # hybrid: a Gated DeltaNet (linear attention) layer, then a full attention layer
    tie_word_embeddings=True,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
"""Qwen3.5's layers as its dense and MoE text configs share them."""

FAMILY_CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "mistral": dict(model_type="mistral", sliding_window=8, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True),  # per-head q/k norms
    "phi3": dict(model_type="phi3", tie_word_embeddings=False, pad_token_id=0),  # fused qkv and gate_up
    "gemma": dict(model_type="gemma", tie_word_embeddings=True),  # scaled embeddings, (1 + w) norms
    "gemma2": dict(model_type="gemma2", tie_word_embeddings=True, sliding_window=8),  # norms after blocks
    # LayerNorm with bias, learned positions, biases everywhere, tied head
    "opt": dict(
        model_type="opt",
        ffn_dim=128,
        word_embed_proj_dim=64,
        enable_bias=True,
        do_layer_norm_before=True,
        pad_token_id=1,
        tie_word_embeddings=True,
    ),
    "gpt2": dict(model_type="gpt2", tie_word_embeddings=True),  # Conv1D weights, LayerNorm, learned positions
    "phi": dict(model_type="phi", tie_word_embeddings=False),  # Phi-2: parallel attention and MLP on one LayerNorm
    # Gemma 3: sandwich norms, QK-norm, sliding and full layers with two RoPE bases, √d embedding scale, tied head
    "gemma3_text": dict(
        model_type="gemma3_text",
        tie_word_embeddings=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "smollm3": dict(
        model_type="smollm3",
        tie_word_embeddings=True,
        no_rope_layers=[1, 0],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),  # NoPE on layer 1
    "olmo2": dict(model_type="olmo2", tie_word_embeddings=False),  # norms after the blocks, none before
    "olmo3": dict(
        model_type="olmo3",
        tie_word_embeddings=False,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # multipliers on the embedding, every block's output, the attention scores and the logits
    "granite": dict(
        model_type="granite",
        tie_word_embeddings=True,
        embedding_multiplier=3.0,
        residual_multiplier=0.4,
        attention_multiplier=0.1,
        logits_scaling=2.5,
    ),
    "qwen3_5_text": dict(model_type="qwen3_5_text", **QWEN3_5_LAYERS),
    # Mixture-of-Experts: fused experts [E, 2f, d] and [E, d, f], routed top-2 of 4 (renormalised or not)
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # a dense MLP on the second layer
    ),
    "mixtral": dict(model_type="mixtral", tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_5_moe_text": dict(  # Qwen3.5's hybrid layers, each MLP routed experts and a gated shared expert
        model_type="qwen3_5_moe_text",
        **QWEN3_5_LAYERS,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "qwen2_moe": dict(  # a shared expert beside the routed ones, gated by sigmoid(shared_expert_gate)
        model_type="qwen2_moe",
        tie_word_embeddings=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "gpt_oss": dict(  # router bias; experts [E, d, 2f] gate/up interleaved, with biases, clamped SwiGLU; sinks
        model_type="gpt_oss",
        tie_word_embeddings=False,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        sliding_window=8,
        swiglu_limit=0.3,  # low enough that the clamps act on a tiny random model
        rope_parameters=dict(  # YaRN as gpt-oss's, scaled to the tiny context
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4,
        ),
    ),
    "olmoe": dict(  # top-k weights not renormalised; q/k norms over the whole projection
        model_type="olmoe",
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        eos_token_id=1,
        pad_token_id=1,
    ),
}

MOE_FAMILIES = [name for name, values in FAMILY_CONFIGS.items() if "num_experts_per_tok" in values]
"""The configs above with routed experts (every MoE test runs each)."""


SLOW_TESTS = Path(__file__).parent / "slow_tests.txt"
"""Tests measured slow in a CI run (`.ci/slow_tests.py`), marked slow here so `make test` leaves them out."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests `slow_tests.txt` lists slow (unless SLOW_TESTS_LIST=off, as the script that writes it asks)."""
    if os.environ.get("SLOW_TESTS_LIST") == "off" or not SLOW_TESTS.is_file():
        return
    listed = {line.strip() for line in SLOW_TESTS.read_text().splitlines() if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)


def widths_for(family_name: str, config, kept: int, slice_head: bool) -> dict[str, int]:
    """Kept width per site id for a family (2 sites per layer, or 1 for parallel blocks)."""
    from compressor.models.families import family_for
    from compressor.models.sites import site_widths

    return site_widths(family_for(family_name), config.num_hidden_layers, config.hidden_size, kept, slice_head)


def tiny_model(name: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """A random model with non-trivial norm scales and biases, so fusion and rotation matter."""
    values = {**COMMON, **FAMILY_CONFIGS[name], **overrides}
    config = AutoConfig.for_model(**values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name or ".ln_" in param_name:  # GPT-2 names its norms ln_1, ln_2, ln_f
                param.copy_(1 + 0.5 * torch.randn_like(param))
            elif param_name.endswith("mlp.router.bias"):  # gpt-oss: small beside the logits, so that
                param.copy_(0.01 * torch.randn_like(param))  # each token's experts depend on the token
            elif param_name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model


def copy_model(model: PreTrainedModel) -> PreTrainedModel:
    clone = AutoModelForCausalLM.from_config(model.config, attn_implementation=model.config._attn_implementation)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


def random_batches(
    vocab: int, count: int = 2, batch: int = 4, length: int = 24, padded: bool = False, seed: int = 1
) -> list[Batch]:
    """Random token batches; with `padded`, rows are left-padded by different amounts."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (batch, length), generator=generator)
        mask = torch.ones_like(ids)
        if padded:
            for row in range(batch):
                mask[row, : row * 3] = 0
                ids[row, : row * 3] = 0
        out.append(Batch(ids, mask))
    return out


def max_relative_logit_error(original: PreTrainedModel, candidate: PreTrainedModel, batches: list[Batch]) -> float:
    """max |Δlogit| / max |logit| over the real (unpadded) positions of all batches."""
    worst = 0.0
    with torch.no_grad():
        for batch in batches:
            keep = batch.attention_mask.bool()
            expected = original(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[keep]
            actual = candidate(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[keep]
            worst = max(worst, ((expected - actual).abs().max() / expected.abs().max()).item())
    return worst


def save_tiny_checkpoint(folder: Path, name: str = "llama", **overrides) -> Path:
    """A tiny model saved with the reference tokenizer (vocab 8192), for CLI runs."""
    model = tiny_model(name, vocab_size=8192, **overrides)
    model.save_pretrained(folder)
    for file in TOKENIZER_FILES:
        shutil.copy(EXAMPLES / "ref-llama" / file, folder / file)
    return folder


def install_plugin(monkeypatch: pytest.MonkeyPatch, folder: Path, module: str, code: str, entry: str) -> Path:
    """`code` as an installed package in `folder` (put on sys.path): the module `module`, and its
    distribution's entry point `entry` in the `compressor` group, allowed beside the suite's built-ins."""
    (folder / f"{module}.py").write_text(code)
    info = folder / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[compressor]\n{entry} = {module}\n")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("COMPRESS_PLUGINS", f"{os.environ['COMPRESS_PLUGINS']},{entry}")
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def needs_shared() -> Path:
    if not (SHARED / "models" / "ref-llama").is_dir():
        pytest.skip("../shared (reference model and corpus) is not beside the checkout")
    return SHARED
