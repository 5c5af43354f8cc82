"""The step memory policy's spelling and the package's memory readings: below the options, the engine and the
transports, which all use them.

A policy is written as one choice for every group (``"both"``), ``"auto"``, or ``pattern=choice`` pairs separated by
commas, matched against each group's FQN with `fnmatch` (first match wins, unmatched groups keep ``neither``; the
root group's FQN is ``<root>``): ``"<root>=params,layers.*=both"``. `parse_policy` and `parse_headroom` check what
the options hold; `odc_accelerate.engine.memory` runs a policy. The readings (`free_and_total`, `PeakMemory`,
`out_of_memory_text`) are every reading of free memory in the package, the transports' too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch

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


def headroom_bytes(headroom: tuple[float, bool], total: int) -> float:
    amount, fraction = headroom
    return amount * total if fraction else amount


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
