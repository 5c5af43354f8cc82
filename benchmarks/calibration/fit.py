"""Least-squares fit of measured step times to ``intercept + linear * L + quadratic * L**2`` (pure numpy)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from odc_accelerate.planning import QuadraticCost


@dataclass(frozen=True)
class QuadraticFit:
    """``seconds(L) = intercept_s + linear_s * L + quadratic_s * L**2``, fitted to measured points.

    Attributes:
        intercept_s (`float`): fixed seconds per forward + backward (kernel launches, Python), independent of ``L``.
        linear_s (`float`): seconds per token.
        quadratic_s (`float`): seconds per squared token (attention).
        lengths (`tuple[int, ...]`): the measured lengths.
        seconds (`tuple[float, ...]`): the measured seconds.
    """

    intercept_s: float
    linear_s: float
    quadratic_s: float
    lengths: tuple[int, ...]
    seconds: tuple[float, ...]

    def predict(self, lengths) -> np.ndarray:
        """Fitted seconds at ``lengths`` (the intercept included)."""
        x = np.asarray(lengths, dtype=np.float64)
        return self.intercept_s + self.linear_s * x + self.quadratic_s * x * x

    @property
    def rel_errors(self) -> tuple[float, ...]:
        """``(fit - measured) / measured`` at each measured point."""
        y = np.asarray(self.seconds)
        return tuple(float(e) for e in (self.predict(self.lengths) - y) / y)

    @property
    def max_rel_error(self) -> float:
        """Largest ``|fit - measured| / measured`` over the points."""
        return max(abs(e) for e in self.rel_errors)

    @property
    def cost(self) -> QuadraticCost:
        """The planner's `QuadraticCost` in seconds (the intercept, which it has no term for, left out)."""
        return QuadraticCost(linear=self.linear_s, quadratic=self.quadratic_s)


def nonnegative_lstsq(columns: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray] | None:
    """``argmin |columns @ coef - target|`` with every coefficient ``>= 0``, solved exactly for a few columns: the best
    fit over every subset of the columns whose own least-squares coefficients are all non-negative. Returns
    ``(sum of squared residuals, coefficients)``, or None when no subset has non-negative coefficients."""
    n = columns.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for size in range(n, 0, -1):
        for subset in itertools.combinations(range(n), size):
            coef, *_ = np.linalg.lstsq(columns[:, subset], target, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(n)
            full[list(subset)] = coef
            ssr = float(np.sum((columns @ full - target) ** 2))
            if best is None or ssr < best[0] - 1e-15:
                best = (ssr, full)
    return best


def fit_quadratic(lengths, seconds) -> QuadraticFit:
    """Fit ``seconds ~ c + a * L + b * L**2`` with ``a, b, c >= 0`` by least squares on the relative error.

    Relative, not absolute, residuals: step times span two to three orders of magnitude over the lengths, and an
    absolute fit would leave the short lengths (most of a real length distribution) with large relative errors. The
    non-negativity constraint (every coefficient is a cost) is solved exactly by trying every subset of the three
    terms and keeping the best fit whose coefficients are all non-negative. Times that a constant fits best (they do
    not grow with ``L``) have no `QuadraticCost` and are refused.

    Args:
        lengths (array of `int`): sequence lengths in tokens, at least 3 distinct values.
        seconds (array of `float`): measured seconds at each length, positive and finite.

    Raises:
        ValueError: fewer than 3 distinct lengths, mismatched sizes, non-positive lengths or times.
    """
    x = np.asarray(lengths, dtype=np.float64).ravel()
    y = np.asarray(seconds, dtype=np.float64).ravel()
    if x.size != y.size:
        raise ValueError(f"fit_quadratic needs one time per length, got {x.size} lengths and {y.size} times.")
    if not (np.all(np.isfinite(x)) and np.all(x > 0)):
        raise ValueError(f"fit_quadratic needs positive lengths, got {x.tolist()}.")
    if not (np.all(np.isfinite(y)) and np.all(y > 0)):
        raise ValueError(f"fit_quadratic needs positive, finite times, got {y.tolist()}.")
    if np.unique(x).size < 3:
        raise ValueError(
            f"fit_quadratic needs at least 3 distinct lengths for its 3 coefficients, got {sorted(set(x.tolist()))}."
        )
    scale = float(x.max())  # columns in units of the longest length: keeps the system well conditioned
    u = x / scale
    columns = np.stack([np.ones_like(u), u, u * u], axis=1) / y[:, None]  # divided by y: relative residuals
    best = nonnegative_lstsq(columns, np.ones_like(y))
    if best is None or not (best[1][1] > 0 or best[1][2] > 0):  # a constant fits best: no QuadraticCost
        raise ValueError(
            f"fit_quadratic found no non-negative fit with a length-dependent term: the times {y.tolist()} do not "
            "grow with the length. Measure longer lengths."
        )
    c, a, b = best[1]
    return QuadraticFit(
        intercept_s=float(c),
        linear_s=float(a / scale),
        quadratic_s=float(b / (scale * scale)),
        lengths=tuple(int(v) for v in x),
        seconds=tuple(float(v) for v in y),
    )


def fit_scaled(lengths, seconds, cost) -> tuple[float, float, tuple[float, ...]]:
    """Fit ``seconds ~ c + k * cost(L)`` by least squares on the relative error: how well a planner cost model, up to
    its unit (``k``) and a fixed cost per sequence (``c``), predicts measured times.

    Only the ratios of a cost model's values matter to the planner, so this is the test of one: a model that charges
    the right terms fits with a small error, whatever its unit.

    Args:
        lengths (array of `int`): sequence lengths in tokens, at least 2 distinct values.
        seconds (array of `float`): measured seconds at each length, positive.
        cost (`Callable`): the cost model, mapping an array of lengths to an array of costs.

    Returns:
        `tuple`: ``(c, k, rel_errors)``, the relative error ``(fit - measured) / measured`` at each length.
    """
    x = np.asarray(lengths, dtype=np.int64).ravel()
    y = np.asarray(seconds, dtype=np.float64).ravel()
    if np.unique(x).size < 2 or x.size != y.size or not np.all(y > 0):
        raise ValueError(f"fit_scaled needs one positive time per length and 2 distinct lengths, got {x.tolist()}.")
    costs = np.asarray(cost(x), dtype=np.float64)
    columns = np.stack([np.ones_like(costs), costs / costs.max()], axis=1) / y[:, None]
    (c, k), *_ = np.linalg.lstsq(columns, np.ones_like(y), rcond=None)
    errors = columns @ np.array([c, k]) - 1.0
    return float(c), float(k / costs.max()), tuple(float(e) for e in errors)


def describe_fit(fit: QuadraticFit) -> str:
    """One line: the coefficients in readable units and the worst point."""
    ratio = f"{fit.quadratic_s / fit.linear_s:.3e} per token" if fit.linear_s > 0 else "n/a: no linear term"
    return (
        f"time(L) = {fit.intercept_s * 1e3:.4g} ms + {fit.linear_s * 1e6:.4g} us * L + "
        f"{fit.quadratic_s * 1e9:.4g} ns * L^2 (quadratic/linear {ratio}); max relative error {fit.max_rel_error:.2%}"
    )
