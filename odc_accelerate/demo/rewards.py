"""Rule-based GRPO rewards computed from the completion's text alone (no reward model)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

_WORD = re.compile(r"\w+")


def _text(completion: Any) -> str:
    # TRL passes strings for plain-text prompts and [{"role": "assistant", "content": ...}] for conversational ones.
    if isinstance(completion, str):
        return completion
    return "".join(message["content"] for message in completion if isinstance(message.get("content"), str))


def continuation_overlap_reward(completions: Sequence[Any], continuation: Sequence[str], **kwargs: Any) -> list[float]:
    """Clipped unigram precision of each completion against the passage's real continuation (BLEU-1 precision).

    Words are the lower-cased ``\\w+`` runs of the text. Each word of the completion counts as a hit as many times as
    it occurs in the continuation at most; the reward is hits / number of words of the completion, in ``[0, 1]``, and
    0 for a completion without words. A policy that writes what the document says next scores high; a random model's
    completions score near 0.

    Args:
        completions (`list[str]` or `list[list[dict]]`):
            The decoded completions (TRL's ``completions`` argument).
        continuation (`list[str]`):
            The dataset's ``continuation`` column for the same rows.

    Returns:
        `list[float]`: one reward per completion.
    """
    rewards = []
    for completion, reference in zip(completions, continuation, strict=True):
        words = _WORD.findall(_text(completion).lower())
        if not words:
            rewards.append(0.0)
            continue
        available = Counter(_WORD.findall(reference.lower()))
        hits = sum(min(count, available[word]) for word, count in Counter(words).items())
        rewards.append(hits / len(words))
    return rewards


def ascii_text_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """Fraction of a completion's characters that are printable ASCII or whitespace, in ``[0, 1]``.

    The help topics are plain English and code, so this rewards completions that look like them: a dense signal even
    for a random model, whose samples from Qwen's 152k-token vocabulary mix scripts and symbols, so the completions of
    one prompt differ and GRPO's advantages are not all zero. An empty completion scores 0.

    Args:
        completions (`list[str]` or `list[list[dict]]`):
            The decoded completions (TRL's ``completions`` argument).

    Returns:
        `list[float]`: one reward per completion.
    """
    rewards = []
    for completion in completions:
        text = _text(completion)
        ok = sum(1 for c in text if c.isascii() and (c.isprintable() or c.isspace()))
        rewards.append(ok / len(text) if text else 0.0)
    return rewards
