"""DeciLM's configuration (`model_type: nemotron-nas`), written by compressor.

A Llama whose decoder blocks differ: `block_configs` holds one entry per layer, as vLLM
(`nemotron_nas`) and llama.cpp (`deci`) read it. `attention`: `n_heads_in_group` (the layer keeps
`num_attention_heads / n_heads_in_group` key-value heads) or `no_op` (no attention, no norm before
it); `ffn`: `ffn_mult` (the width is int(2·ffn_mult·hidden/3) rounded up to a multiple of 256, the
engines' rule) or `no_op`. This file is copied beside the weights; it imports only transformers.
"""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig, PretrainedConfig


def ffn_width(ffn_mult: float, hidden_size: int) -> int:
    """The intermediate width the engines give `ffn_mult` (vLLM and llama.cpp: round up to 256)."""
    width = int(2 * ffn_mult * hidden_size / 3)
    return width if width % 256 == 0 else width + 256 - width % 256


def ffn_mult(width: int, hidden_size: int) -> float:
    """The `ffn_mult` the engines turn into `width` (a multiple of 256)."""
    if width % 256:
        raise ValueError(f"a DeciLM FFN width is a multiple of 256, got {width}")
    return 1.5 * width / hidden_size


class DeciLMConfig(PretrainedConfig):
    model_type = "nemotron-nas"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 2048,
        rms_norm_eps: float = 1e-6,
        rope_parameters: dict[str, Any] | None = None,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        mlp_bias: bool = False,
        block_configs: list[dict[str, Any]] | None = None,
        intermediate_size: int | None = None,
        num_key_value_heads: int | None = None,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.mlp_bias = mlp_bias
        self.block_configs = (
            block_configs
            or [{"attention": {"n_heads_in_group": 1, "no_op": False}, "ffn": {"ffn_mult": 4.0, "no_op": False}}]
            * num_hidden_layers
        )
        self.intermediate_size = intermediate_size  # None: per layer, in block_configs
        self.num_key_value_heads = num_key_value_heads  # None: per layer, in block_configs
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        if len(self.block_configs) != num_hidden_layers:
            raise ValueError(f"{len(self.block_configs)} block_configs for {num_hidden_layers} layers")

    def layer_config(self, index: int) -> LlamaConfig:
        """Layer `index` as a Llama configuration: its key-value heads and FFN width."""
        block = self.block_configs[index]
        group = block["attention"].get("n_heads_in_group") or 1
        ffn = block["ffn"]
        width = 0 if ffn.get("no_op") else ffn_width(ffn["ffn_mult"], self.hidden_size)
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=max(width, 1),
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads // group,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=self.rope_parameters,
            attention_bias=self.attention_bias,
            attention_dropout=self.attention_dropout,
            mlp_bias=self.mlp_bias,
        )
