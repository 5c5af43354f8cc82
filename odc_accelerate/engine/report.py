"""`EngineReport`: what an `ODCEngine` chose at set-up and why, which its log line and the Trainer's banner format."""

from __future__ import annotations

from dataclasses import dataclass

from ..reduction import ReductionName


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineReport:
    """What an engine runs with, and why (`ODCEngine.report`).

    Attributes:
        transport (`str`): the transport's name. transport_reason (`str`): why it (``"auto: ..."``, ...).
        accumulate_path (`str | None`): how the transport adds (the ``cuda`` transport's ``"kernel"`` or
            ``"index_add_"``); None where it has one way or accumulates nothing. accumulate_reason (`str`): why.
        reduction (`ReductionName | None`): the gradient reduction; None for a frozen engine.
            reduction_reason (`str`): why it (``"auto: ..."``, ``"set by odc_reduction"``).
        param_groups (`int`): FSDP2 param groups served. frozen (`bool`): gather-only.
        ranks (`int`): the shard group's ranks. replicas (`int`): HSDP replicas (1 without HSDP).
            replicate_buckets (`int`): HSDP all-reduces per optimizer step (0 without).
        memory_policy (`str`): the policy as configured. memory (`str`): what it keeps on this rank this step.
    """

    transport: str
    transport_reason: str
    accumulate_path: str | None
    accumulate_reason: str
    reduction: ReductionName | None
    reduction_reason: str
    param_groups: int
    frozen: bool
    ranks: int
    replicas: int
    replicate_buckets: int
    memory_policy: str
    memory: str

    def describe(self) -> str:
        """One line: what the engine serves, over what, and what the memory policy keeps."""
        frozen = " (frozen, gather-only)" if self.frozen else ""
        reduction = "" if self.reduction is None else f", {self.reduction} reduction ({self.reduction_reason})"
        hsdp = (
            f", HSDP: {self.replicas} replicas, {self.replicate_buckets} all-reduce bucket(s) per step"
            if self.replicate_buckets
            else ""
        )
        return (
            f"{self.param_groups} param groups{frozen}, transport {self.transport}{reduction}{hsdp}, "
            f"memory policy {self.memory_policy}: {self.memory}"
        )
