"""The step memory policy: which unsharded state a rank keeps through an optimizer step, per FSDP2 param group.

Parameters do not change inside a step, so a rank may gather a param group once and keep it until
``pre_optimizer_step`` (``params``); and it may keep its unsharded gradient through its microbatches and reduce it
once, at ``pre_optimizer_step`` (``grads``), instead of scatter-adding it after every microbatch. ``both`` keeps both,
``neither`` neither (memory bounded by the shard, the accumulator and one microbatch). Under FSDP2 every rank must
make the same choice (its collectives pair up); under ODC each rank chooses for itself, so ``auto`` picks per rank
from that rank's free memory, and again after every optimizer step.

A policy is written as one choice for every group (``"both"``), ``"auto"``, or ``pattern=choice`` pairs separated by
commas, matched against each group's FQN with `fnmatch` (first match wins, unmatched groups keep ``neither``; the
root group's FQN is ``<root>``): ``"<root>=params,layers.*=both"``.

`choose` and `apply_choices` run a policy over an engine's param groups (after every optimizer step); the memory
readings at the end (`free_and_total`, `PeakMemory`, `out_of_memory_text`) are the package's, the transports' too.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .._compat.torch import fsdp as compat
from .._compat.torch import keep as keep_compat

if TYPE_CHECKING:  # pragma: no cover
    from ._setup import ServedGroup

#: The fixed choices, as (keep gathered params, keep unsharded grads).
CHOICES: dict[str, tuple[bool, bool]] = {
    "neither": (False, False),
    "params": (True, False),
    "grads": (False, True),
    "both": (True, True),
}
AUTO = "auto"
#: The default: bounded memory (shard + accumulator + one microbatch), as FSDP2 with gradient sync every microbatch.
DEFAULT_POLICY = "neither"
#: The default headroom of ``auto``: the part of this rank's memory it leaves free for activations and the optimizer.
DEFAULT_HEADROOM = "30%"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|b|kib|mib|gib|tib|kb|mb|gb|tb)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_UNITS["tb"] = 10**12


def parse_policy(value: str | Mapping[str, str]) -> str | list[tuple[str, str]]:
    """Check a memory policy; returns ``"auto"``, or the ``(pattern, choice)`` pairs it stands for.

    Raises:
        ValueError: an unknown choice or a malformed ``pattern=choice`` list, saying what is accepted.
    """
    accepted = f"one of {', '.join([*CHOICES, AUTO])}, or pattern=choice pairs such as '<root>=params,layers.*=both'"
    if isinstance(value, Mapping):
        pairs = [(str(k), str(v).strip().lower()) for k, v in value.items()]
    elif isinstance(value, str):
        text = value.strip().lower() if "=" not in value else value.strip()
        if text in CHOICES:
            return [("*", text)]
        if text == AUTO:
            return AUTO
        if "=" not in text:
            raise ValueError(f"memory policy {value!r} is not valid: use {accepted}")
        pairs = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            pattern, sep, choice = item.partition("=")
            if not sep or not pattern.strip():
                raise ValueError(f"memory policy {value!r}: {item!r} is not pattern=choice; use {accepted}")
            pairs.append((pattern.strip(), choice.strip().lower()))
    else:
        raise ValueError(f"memory policy must be a string or a mapping, got {type(value).__name__}: use {accepted}")
    bad = [c for _, c in pairs if c not in CHOICES]
    if bad or not pairs:
        raise ValueError(
            f"memory policy {value!r}: {bad[0] if bad else 'no pairs'!r} is not a choice per group; each group "
            f"takes one of {', '.join(CHOICES)}"
        )
    return pairs


def parse_headroom(value: str | float | int) -> tuple[float, bool]:
    """Check a headroom: ``"30%"`` of this rank's memory, or a size (``"4GiB"``, ``"512MB"``; a bare number is bytes).

    Returns:
        `tuple[float, bool]`: the amount and whether it is a fraction (of the rank's total memory) or bytes.

    Raises:
        ValueError: anything else, naming the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"memory headroom must be a percentage or a size, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"memory headroom must not be negative, got {value!r}")
        return float(value), False
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(
            f"memory headroom {value!r} is not valid: give a percentage of the rank's memory ('30%') or a size "
            "('4GiB', '512MiB', '2GB')"
        )
    amount, unit = float(match.group(1)), (match.group(2) or "b").lower()
    if unit == "%":
        if amount > 100:
            raise ValueError(f"memory headroom {value!r} is over 100%")
        return amount / 100, True
    return amount * _UNITS[unit], False


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
def group_costs(groups: Sequence[ServedGroup], *, world_size: int, frozen: bool) -> list[GroupCost]:
    """What keeping each served group's unsharded state costs on this rank (a frozen engine keeps no gradient)."""
    costs = []
    for g in groups:
        grad_bytes = 0
        if g.reduce_dtype is not None and not frozen:
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
) -> dict[str, tuple[bool, bool]]:
    """(keep params, keep grads) per group FQN under ``policy`` (`parse_policy`'s result): ``auto`` from this rank's
    free memory on ``device`` now, less ``headroom`` (`parse_headroom`'s result)."""
    if policy == AUTO:
        free, total = free_and_total(device)
        budget = free - headroom_bytes(headroom, total)
        return choose_auto(group_costs(groups, world_size=world_size, frozen=frozen), budget)
    return choose_fixed(policy, [g.fqn for g in groups])


def apply_choices(
    groups: Sequence[ServedGroup], choices: Mapping[str, tuple[bool, bool]], *, frozen: bool
) -> tuple[int, int]:
    """Set each group's ``keep`` and FSDP2's switches for it from ``choices``; no peer is involved.

    A group without trainable parameters, or a frozen engine's, keeps no gradient whatever the choice.

    Returns:
        `tuple[int, int]`: how many groups keep their gathered params, and how many their unsharded grads.
    """
    for g in groups:
        keep_params, keep_grads = choices[g.fqn]
        g.keep = (keep_params, keep_grads and g.reduce_dtype is not None and not frozen)
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


# ---------------------------------------------------------------------- memory readings
def local_ranks() -> int:
    """Ranks sharing this host's RAM (``LOCAL_WORLD_SIZE`` from torchrun / accelerate; 1 if unset)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * 1024
    return out


def free_and_total(device: torch.device, *, release_cache: bool = False) -> tuple[int, int]:
    """This rank's share of free and total memory on ``device``, in bytes: every reading of free memory in the package.

    CUDA: the device's free memory and its total. What torch's caching allocator holds unused counts as free either
    way: with ``release_cache`` it is given back first (``torch.cuda.empty_cache()``), so that the figure is what an
    allocation outside that allocator can get (the 'cuda' transport's segment comes from ``cuMemCreate``, which cannot
    reuse its blocks) and what an out-of-memory refusal names; without it (``auto``, chosen again after every step)
    the unused blocks are added to the device's figure rather than released every step. CPU: available RAM
    (``MemAvailable``) and total RAM, each divided by the ranks on this host (they share it).
    """
    if device.type == "cuda":
        if release_cache:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            return int(free), int(total)
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached), int(total)
    info = _meminfo()
    share = local_ranks()
    return info.get("MemAvailable", info.get("MemFree", 0)) // share, info.get("MemTotal", 0) // share


def out_of_memory_text(
    who: str,
    what: str,
    *,
    free: int | None,
    advice: str,
    need: int | None = None,
    detail: str = "",
    ran_out: str = "",
) -> str:
    """The wording of every refusal for too little GPU memory: the 'cuda' transport's check before it allocates, and
    an out-of-memory error met in FSDP2's lazy initialisation, in the engine's set-up or in the transport's allocation.

    It reads ``"{who} need(s) {need} of GPU memory for {what} ({detail}), but only {free} is free ({ran_out}).
    {advice}."``, e.g. ``"rank 1 need(s) 130.0 MiB of GPU memory for the 'cuda' ODC transport (...), but only 1.0 MiB
    is free. Lower the staging pool (...)"``.

    Args:
        who (`str`): the rank(s) short of memory: ``"rank 1"``, ``"ranks [0, 1] (one GPU)"``.
        what (`str`): what needs the memory: ``"the 'cuda' ODC transport"``.
        free (`int` or `None`): bytes free on the GPU, read with `free_and_total` (``release_cache=True``); `None` where
            the device has no such reading (a CPU rank that emulates a GPU).
        advice (`str`): what to change, one sentence without its full stop.
        need (`int`, *optional*): bytes needed, where they are known; else the text says "more".
        detail (`str`, *optional*): what the need is made of, or when it arises.
        ran_out (`str`, *optional*): what ran out of memory, for an error already met; empty for a check made before
            anything is allocated.
    """
    amount = f"{need / 2**20:.1f} MiB of GPU memory" if need is not None else "more GPU memory"
    text = f"{who} need(s) {amount} for {what}"
    if detail:
        text += f" ({detail})"
    text += f", but only {free / 2**20:.1f} MiB is free" if free is not None else ", but how much is free is unknown"
    if ran_out:
        text += f" ({ran_out})"
    return f"{text}. {advice}."


def headroom_bytes(headroom: tuple[float, bool], total: int) -> float:
    amount, fraction = headroom
    return amount * total if fraction else amount


class PeakMemory:
    """This process's peak memory, in bytes: on CUDA torch's allocator peak (``max_memory_allocated``), on CPU the
    peak resident set size (``VmHWM``).

    `reset` starts a new window; the engine never calls it: on CPU it also lowers what ``getrusage`` reports as the
    process's maximum RSS, and on CUDA it clears torch's peak for every other reader.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass

    def read(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        try:
            with open("/proc/self/status") as f:
                match = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
            return int(match.group(1)) * 1024 if match else 0
        except OSError:
            return 0
