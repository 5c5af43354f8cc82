"""Offline demo assets for the scripts, examples and tests: Qwen's tokenizer (`tokenizer`), real long-tailed text
(`text`), a tiny Qwen2 config (`model`) and GRPO prompts, rewards and rollout (`prompts`, `rewards`, `rollout`).
Nothing here touches the network; names load on first use (the rollout imports torch and transformers).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "QWEN_BPE_RANKS": "tokenizer",
    "QWEN_VOCAB_SIZE": "tokenizer",
    "load_offline_tokenizer": "tokenizer",
    "offline_bpe_ranks": "tokenizer",
    "offline_vocab_size": "tokenizer",
    "offline_dpo_dataset": "text",
    "offline_preference_pairs": "text",
    "offline_sft_dataset": "text",
    "offline_texts": "text",
    "tiny_qwen2_config": "model",
    "offline_grpo_dataset": "prompts",
    "offline_grpo_rows": "prompts",
    "ascii_text_reward": "rewards",
    "continuation_overlap_reward": "rewards",
    "TargetLengthRollout": "rollout",
    "TargetLengthStoppingCriteria": "rollout",
    "generate_to_target_lengths": "rollout",
    "limit_vllm_to_target_lengths": "rollout",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
