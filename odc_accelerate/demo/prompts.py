"""GRPO prompts cut from real text, each with its real continuation and that continuation's length in tokens."""

from __future__ import annotations

import re
from typing import Any

from .text import offline_texts
from .tokenizer import load_offline_tokenizer

# A cut only at a single space between two letters or digits: prompt and continuation then tokenize the same alone as
# joined (BPE merges punctuation with the whitespace after it), so ``target_length`` counts exactly the tokens that
# follow the prompt in the tokenized passage.
_CUT = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z0-9])")


def offline_grpo_rows(
    max_words: int = 150,
    min_words: int = 10,
    prompt_words: tuple[int, int] = (8, 32),
    max_prompt_chars: int = 300,
    tokenizer: Any = None,
) -> list[dict[str, Any]]:
    """GRPO prompts cut from real text, each with the real continuation and its length in tokens.

    The passages are `odc_accelerate.demo.offline_texts` (``max_words``, ``min_words``): whole paragraphs of the 79
    help topics of Python's ``pydoc_data``, grouped into chunks of log-uniformly drawn sizes. Each passage is cut at
    a space between two words: the prompt is its opening, about a quarter of its words (``prompt_words`` bounds the
    count; a cut past ``max_prompt_chars`` characters moves back to the last space before it), and ``continuation``
    is the rest of the passage, what the document really says next. ``target_length`` is the number of tokens of
    ``continuation`` under ``tokenizer``. The lengths keep the shape of the help topics: with the defaults a median
    near 60 tokens and a tail past 1,000. Passages with no such space, a prompt shorter than ``prompt_words[0]``
    words or an empty rest are left out, and so is a passage whose prompt repeats an earlier one (a prompt must name
    one target).

    Args:
        max_words (`int`, *optional*, defaults to 150):
            Upper bound of the drawn passage sizes, in words (a single longer paragraph stays whole).
        min_words (`int`, *optional*, defaults to 10):
            Lower bound of the drawn passage sizes, in words.
        prompt_words (`tuple[int, int]`, *optional*, defaults to `(8, 32)`):
            Bounds of the number of words in a prompt.
        max_prompt_chars (`int`, *optional*, defaults to 300):
            Longest prompt in characters (code listings have few spaces between words).
        tokenizer (`PreTrainedTokenizerBase`, *optional*):
            Tokenizer counting ``target_length``; defaults to `odc_accelerate.demo.load_offline_tokenizer`.

    Returns:
        `list[dict]` with keys ``prompt`` (`str`), ``continuation`` (`str`) and ``target_length`` (`int`).
    """
    lo, hi = prompt_words
    if not 1 <= lo <= hi:
        raise ValueError(f"prompt_words must be (low, high) with 1 <= low <= high, got {prompt_words}.")
    tokenizer = tokenizer if tokenizer is not None else load_offline_tokenizer()
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    for text in offline_texts(max_words=max_words, min_words=min_words):
        spaces = [m.start() for m in _CUT.finditer(text)]
        if not spaces:
            continue
        n = min(hi, max(lo, len(text.split()) // 4))
        cut = spaces[min(n, len(spaces) - 1)]
        if cut > max_prompt_chars:
            cut = max([s for s in spaces if s <= max_prompt_chars], default=spaces[0])
        prompt, continuation = text[:cut], text[cut:]
        if len(prompt.split()) < lo or not continuation.strip() or prompt in seen:
            continue
        seen.add(prompt)
        pairs.append((prompt, continuation))
    lengths = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    return [
        {"prompt": prompt, "continuation": continuation, "target_length": len(ids)}
        for (prompt, continuation), ids in zip(pairs, lengths, strict=True)
    ]


def offline_grpo_dataset(max_words: int = 150, min_words: int = 10, tokenizer: Any = None) -> Any:
    """`datasets.Dataset` of GRPO prompts with their real continuations (`offline_grpo_rows`).

    Columns: ``prompt`` (the opening of a help-topic passage, plain text), ``continuation`` (the rest of the passage,
    which `continuation_overlap_reward` compares completions with) and ``target_length`` (the continuation's length
    in tokens, which `TargetLengthRollout` gives the completions of this prompt). TRL passes the extra columns to the
    reward functions as keyword arguments.

    Args:
        max_words (`int`, *optional*, defaults to 150):
            Upper bound of the drawn passage sizes, in words.
        min_words (`int`, *optional*, defaults to 10):
            Lower bound of the drawn passage sizes, in words.
        tokenizer (`PreTrainedTokenizerBase`, *optional*):
            Tokenizer counting ``target_length``; defaults to `odc_accelerate.demo.load_offline_tokenizer`.
    """
    from datasets import Dataset

    rows = offline_grpo_rows(max_words=max_words, min_words=min_words, tokenizer=tokenizer)
    return Dataset.from_dict({key: [row[key] for row in rows] for key in ("prompt", "continuation", "target_length")})
