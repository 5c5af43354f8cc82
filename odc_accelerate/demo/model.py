"""A small Qwen2 config (random init) sized for the offline tokenizer's vocabulary."""

from __future__ import annotations

from typing import Any

from .tokenizer import offline_bpe_ranks, offline_vocab_size


def tiny_qwen2_config(
    hidden_size: int = 64, num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2
) -> Any:
    """A small `Qwen2Config` (random init) for CPU runs, sized for `load_offline_tokenizer`'s vocabulary: with Qwen's
    full vocabulary about 20M parameters, mostly embeddings (``ODC_OFFLINE_BPE_RANKS`` shrinks them)."""
    from transformers import Qwen2Config

    eos = offline_bpe_ranks()  # <|endoftext|>, the first special token after the kept ranks
    return Qwen2Config(
        vocab_size=offline_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
