"""The step memory policy: which unsharded state a rank keeps through an optimizer step, per FSDP2 param group.

``params`` keeps the gathered parameters until ``pre_optimizer_step``, ``grads`` the unsharded gradients (reduced once,
there), ``both`` or ``neither``; ``auto`` chooses per rank from its free memory after every optimizer step, and
``pattern=choice`` pairs choose per group. Under the ordered reduction the gradient half is ignored. `choose` and
`apply_choices` run a policy over an engine's groups; its spelling and the memory readings are in
`odc_accelerate.memory_spec`. See docs/memory.md.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import memory_spec
from .._compat.torch import fsdp as compat
from .._compat.torch import keep as keep_compat
from ..memory_spec import AUTO, CHOICES, headroom_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ._common import ServedGroup


@dataclass(frozen=True)
class GroupCost:
    """What keeping one param group's unsharded state costs and saves, per microbatch after the first.

    Attributes:
        fqn: the group's FQN.
        param_bytes: its unsharded parameters (the gather output: every rank's shard, in the parameter dtype).
        grad_bytes: its unsharded gradient in the reduce dtype (0 for a group without trainable params).
        gathers_per_microbatch: how many times a microbatch gathers it (2 when FSDP2 reshards it after forward, else 1;
            0 without a backward, e.g. a frozen model, where it is 1).
        world_size: ranks of the mesh.
    """

    fqn: str
    param_bytes: int
    grad_bytes: int
    gathers_per_microbatch: int
    world_size: int

    def candidates(self) -> list[tuple[float, int, str]]:
        """``(gain per byte, bytes, "params" | "grads")`` for each thing keeping could save.

        The gain is the bytes copied per microbatch that keeping avoids, per byte kept. A gather copies the shard in
        (1/world), reads the peers' shards ((world-1)/world) and copies the output out (1) per byte of unsharded
        parameters: ~2 per gather. A gradient's reduce copies it into the reduce-scatter input (1) and adds it into
        the owners' accumulators (a read and a write: 2): 3 per byte.
        """
        out = []
        if self.param_bytes:
            out.append((2.0 * self.gathers_per_microbatch, self.param_bytes, "params"))
        if self.grad_bytes:
            out.append((3.0, self.grad_bytes, "grads"))
        return out


def choose_auto(costs: Sequence[GroupCost], budget: float) -> dict[str, tuple[bool, bool]]:
    """Keep what saves the most copying per byte first, while the kept bytes fit in ``budget``.

    Returns:
        `dict[str, tuple[bool, bool]]`: (keep params, keep grads) per group FQN.
    """
    chosen = {c.fqn: [False, False] for c in costs}
    items = [(gain, nbytes, what, c.fqn) for c in costs for gain, nbytes, what in c.candidates()]
    # Largest gain per byte first; among equals the smaller item first (more of them fit).
    items.sort(key=lambda item: (-item[0], item[1]))
    used = 0.0
    for _, nbytes, what, fqn in items:
        if used + nbytes <= budget:
            used += nbytes
            chosen[fqn][0 if what == "params" else 1] = True
    return {fqn: (p, g) for fqn, (p, g) in chosen.items()}


def choose_fixed(pairs: list[tuple[str, str]], fqns: Sequence[str]) -> dict[str, tuple[bool, bool]]:
    """(keep params, keep grads) per group for a fixed policy: the first pattern matching the FQN, else neither."""
    out = {}
    for fqn in fqns:
        choice = next((c for pattern, c in pairs if fnmatch.fnmatchcase(fqn, pattern)), "neither")
        out[fqn] = CHOICES[choice]
    return out


def may_keep_grads(
    policy: str | list[tuple[str, str]], groups: Sequence[ServedGroup], *, frozen: bool, ordered: bool
) -> bool:
    """Whether ``policy`` (`parse_policy`'s result) may keep some group's unsharded gradients through a step on some
    rank: ``auto`` may (where a rank's free memory allows), a fixed policy where it gives a trainable group ``grads``
    or ``both``. Decided from the policy as configured, so the same on every rank."""
    trainable = [g.fqn for g in groups if g.reduce_dtype is not None]
    if frozen or ordered or not trainable:
        return False
    if policy == AUTO:
        return True
    return any(keep_grads for _, keep_grads in choose_fixed(policy, trainable).values())


def choice_name(keep: tuple[bool, bool]) -> str:
    return next(name for name, flags in CHOICES.items() if flags == keep)


def summarize(choices: Mapping[str, tuple[bool, bool]]) -> str:
    """``"both x3, neither x1"`` (how many groups got each choice), in `CHOICES` order."""
    counts: dict[str, int] = {}
    for keep in choices.values():
        name = choice_name(keep)
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} x{counts[name]}" for name in CHOICES if name in counts)


# ---------------------------------------------------------------------- the policy over an engine's param groups
def group_costs(
    groups: Sequence[ServedGroup], *, world_size: int, frozen: bool, ordered: bool = False
) -> list[GroupCost]:
    """What keeping each served group's unsharded state costs on this rank (a frozen engine keeps no gradient, nor
    does one under the ordered reduction: its contribution buffers hold it already)."""
    costs = []
    for g in groups:
        grad_bytes = 0
        if g.reduce_dtype is not None and not frozen and not ordered:
            grad_bytes = g.reduce_numel * world_size * g.reduce_dtype.itemsize
        costs.append(
            GroupCost(
                fqn=g.fqn,
                param_bytes=g.gather_numel * world_size * g.gather_dtype.itemsize,
                grad_bytes=grad_bytes,
                gathers_per_microbatch=1 if frozen else keep_compat.gathers_per_microbatch(g.group, g.saved_keep),
                world_size=world_size,
            )
        )
    return costs


def choose(
    policy: str | list[tuple[str, str]],
    headroom: tuple[float, bool],
    device: torch.device,
    groups: Sequence[ServedGroup],
    *,
    world_size: int,
    frozen: bool,
    ordered: bool = False,
) -> dict[str, tuple[bool, bool]]:
    """(keep params, keep grads) per group FQN under ``policy`` (`parse_policy`'s result): ``auto`` from this rank's
    free memory on ``device`` now, less ``headroom`` (`parse_headroom`'s result). The reading is taken after the
    transport's buffers exist (the ordered reduction's contribution buffers among them), so what they hold is not
    free. Under the ordered reduction (``ordered``) no gradient is kept."""
    if policy == AUTO:
        free, total = memory_spec.free_and_total(device)  # through the module: tests give ranks known budgets
        budget = free - headroom_bytes(headroom, total)
        return choose_auto(group_costs(groups, world_size=world_size, frozen=frozen, ordered=ordered), budget)
    choices = choose_fixed(policy, [g.fqn for g in groups])
    if ordered:
        choices = {fqn: (params, False) for fqn, (params, _) in choices.items()}
    return choices


def apply_choices(
    groups: Sequence[ServedGroup], choices: Mapping[str, tuple[bool, bool]], *, frozen: bool, ordered: bool = False
) -> tuple[int, int]:
    """Set each group's ``keep`` and FSDP2's switches for it from ``choices``; no peer is involved.

    A group without trainable parameters, a frozen engine's, or one under the ordered reduction (``ordered``) keeps no
    gradient whatever the choice.

    Returns:
        `tuple[int, int]`: how many groups keep their gathered params, and how many their unsharded grads.
    """
    for g in groups:
        keep_params, keep_grads = choices[g.fqn]
        g.keep = (keep_params, keep_grads and g.reduce_dtype is not None and not frozen and not ordered)
        keep_compat.set_keep(g.group, g.saved_keep, *g.keep)
    return sum(g.keep[0] for g in groups), sum(g.keep[1] for g in groups)


def kept_summary(groups: Sequence[ServedGroup], *, world_size: int, frozen: bool) -> str:
    """How many groups keep what (``"both x3, neither x1"``), and the bytes kept unsharded."""
    costs = zip(groups, group_costs(groups, world_size=world_size, frozen=frozen), strict=True)
    kept = sum(c.param_bytes * g.keep[0] + c.grad_bytes * g.keep[1] for g, c in costs)
    return f"{summarize({g.fqn: g.keep for g in groups})} ({kept / 2**20:.1f} MiB kept unsharded)"


def reduce_kept_grads(groups: Sequence[ServedGroup]) -> None:
    """Scatter-add every unsharded gradient still held (kept by the policy, or left by a caller's ``no_sync``), through
    FSDP2's own post-backward and so the engine's reduce-scatter hook."""
    for g in groups:
        if g.reduce_dtype is not None and keep_compat.has_pending_grads(g.group):
            keep_compat.reduce_pending_grads(g.group)


def drop_kept_params(groups: Sequence[ServedGroup]) -> None:
    """Drop every gathered copy of the parameters still held (the next forward gathers again)."""
    for g in groups:
        if compat.is_unsharded(g.group):
            compat.reshard(g.group)
