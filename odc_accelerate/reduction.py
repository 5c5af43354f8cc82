"""How a step's gradients reach their owners: the ``odc_reduction`` option's names (see ``docs/reduction.md``).

* ``auto`` (the default): the transport decides, ``atomic`` where its adds are atomic (every CPU transport; the
  ``cuda`` transport where every pair of GPUs adds natively and deterministic algorithms are off), else ``ordered``.
* ``atomic``: after each microbatch's backward a rank adds its gradient slices into their owners'
  accumulators (`Transport.accumulate`), in whatever order the ranks get there, so two runs may differ in the last
  bits of a sum.
* ``ordered``: each rank sums its own gradient for the step locally, in its microbatches' order, and each owner sums
  the ranks' contributions to its shard in rank order once per step (`odc_accelerate.transport.ordered`): the same
  inputs give the same bits, and no transport needs remote atomics.
"""

from __future__ import annotations

import enum

__all__ = ["REDUCTIONS", "ReductionName", "normalize_reduction"]


class ReductionName(str, enum.Enum):
    """A gradient reduction's name. A `str`: each member equals, prints and goes to JSON as its value
    (``ReductionName.ORDERED == "ordered"``), as `~odc_accelerate.planning.PlanName` does."""

    AUTO = "auto"
    ATOMIC = "atomic"
    ORDERED = "ordered"

    # As PlanName: str(), repr() and format() give the value, so messages and reprs read as with plain strings.
    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


REDUCTIONS: tuple[str, ...] = tuple(r.value for r in ReductionName)
"""The reduction names, the default first."""


def normalize_reduction(value: ReductionName | str, where: str = "reduction") -> ReductionName:
    """Check a reduction name and return it as a `ReductionName`.

    Args:
        value (`ReductionName` or `str`): one of `REDUCTIONS`, spelled exactly.
        where (`str`, *optional*, defaults to `"reduction"`): the option's name in messages, e.g.
            ``"odc_reduction (ODC_REDUCTION)"``.

    Raises:
        ValueError: the name is not one of `REDUCTIONS`; the message lists them.
    """
    if isinstance(value, str) and value in REDUCTIONS:
        return ReductionName(value)
    raise ValueError(f"{where} must be one of {', '.join(REDUCTIONS)}, got {value!r}.")
