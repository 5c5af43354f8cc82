"""Model shapes the calibration builds (random weights, no hub access): transformers ``Qwen2Config`` keyword
arguments, copied from the published ``config.json`` files, or another config's with its ``model_type``."""

from __future__ import annotations

from typing import Any

_QWEN2_5_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "initializer_range": 0.02,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}

MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        **_QWEN2_5_COMMON,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        **_QWEN2_5_COMMON,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    },
    # Not timed by default (twice the 1.5B's time budget on one H100); the simulator's other at-scale model.
    "qwen2.5-7b": {
        **_QWEN2_5_COMMON,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    # A 2-layer toy for tests on CPU: the same code path in a second.
    "tiny": {
        **_QWEN2_5_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
}

# A small Qwen3.5-MoE hybrid (3 Gated DeltaNet layers, 1 full attention; text only) and the same shape with every
# layer full attention: timed side by side on CPU, they check the cost model's attention term per layer kind.
_HYBRID_SMALL: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
MODEL_CONFIGS["qwen3.5-moe-small-hybrid"] = _HYBRID_SMALL
MODEL_CONFIGS["qwen3.5-moe-small-full"] = {**_HYBRID_SMALL, "layer_types": ["full_attention"] * 4}

DEFAULT_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b")
DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
