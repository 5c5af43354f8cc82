"""Real long-tailed text from the 79 help topics of Python's ``pydoc_data`` (28 to 8,571 words each, median 241), as
SFT samples and as preference pairs.
"""

from __future__ import annotations

import re
from typing import Any


def offline_texts(max_words: int = 600, min_words: int = 30, seed: int = 0) -> list[str]:
    """Real English text with long-tailed lengths from Python's ``pydoc_data.topics``.

    The 79 help topics (sorted by name) are split at paragraph boundaries (blank lines) and the paragraphs of each
    topic are grouped, in order, into chunks. Each chunk gets a target size drawn log-uniformly from
    ``[min_words, max_words]`` words (``random.Random(seed)``, one draw per chunk) and takes whole paragraphs until
    it reaches the target; a topic's last chunk may be shorter, and a single paragraph longer than the target stays
    whole. Log-uniform targets give many short samples and a few long ones (a long tail, as in post-training data).
    """
    import math
    import random
    from pydoc_data.topics import topics

    rng = random.Random(seed)

    def target() -> int:
        return int(math.exp(rng.uniform(math.log(min_words), math.log(max_words))))

    out: list[str] = []
    for name in sorted(topics):
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", topics[name]) if p.strip()]
        chunk: list[str] = []
        words, goal = 0, target()
        for paragraph in paragraphs:
            chunk.append(paragraph)
            words += len(paragraph.split())
            if words >= goal:
                out.append("\n\n".join(chunk))
                chunk, words, goal = [], 0, target()
        if chunk:
            out.append("\n\n".join(chunk))
    return out


def offline_sft_dataset(max_words: int = 600) -> Any:
    """`datasets.Dataset` with a ``text`` column of `offline_texts` (language-modelling SFT on every token)."""
    from datasets import Dataset

    return Dataset.from_dict({"text": offline_texts(max_words)})


def offline_preference_pairs(max_words: int = 600, prompt_fraction: float = 0.25) -> list[dict[str, str]]:
    """Preference pairs built from real text (`offline_texts`): the true continuation is preferred over a foreign one.

    For each text chunk, the prompt is its opening (about ``prompt_fraction`` of its words, 8 to 64, cut at a space
    between two words so the original spacing is kept), ``chosen`` is the rest of the same chunk (what the document really says
    next) and ``rejected`` is the continuation of the chunk half the corpus away (fluent text from another help topic
    that does not follow the prompt). Chosen and rejected lengths are independent draws of the same long-tailed
    distribution, so pairs range from a few dozen to over a thousand tokens.
    """
    texts = offline_texts(max_words)
    cuts = []
    for text in texts:
        # Cut only at a single space between two letters or digits: prompt and completion then tokenize the same
        # alone as joined (BPE merges punctuation with the whitespace after it).
        spaces = [m.start() for m in re.finditer(r"(?<=[A-Za-z0-9]) (?=[A-Za-z0-9])", text)]
        n = min(64, max(8, int(len(text.split()) * prompt_fraction)))
        cut = spaces[min(n, len(spaces) - 1)] if spaces else len(text) // 2
        cuts.append((text[:cut], text[cut:]))
    half = len(texts) // 2
    return [
        {"prompt": prompt, "chosen": rest, "rejected": cuts[(i + half) % len(cuts)][1]}
        for i, (prompt, rest) in enumerate(cuts)
        if rest.strip() and cuts[(i + half) % len(cuts)][1].strip()
    ]


def offline_dpo_dataset(max_words: int = 600) -> Any:
    """`datasets.Dataset` with ``prompt`` / ``chosen`` / ``rejected`` columns of `offline_preference_pairs`."""
    from datasets import Dataset

    pairs = offline_preference_pairs(max_words)
    return Dataset.from_dict({key: [p[key] for p in pairs] for key in ("prompt", "chosen", "rejected")})
