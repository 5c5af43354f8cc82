"""Where an `ODCEngine` is in its optimizer-step cycle (`EngineState`), and what a step cost this rank (`StepStats`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EngineState(enum.Enum):
    """Where an `ODCEngine` is in the optimizer-step cycle."""

    IN_STEP = "in_step"  # microbatches run: hooks gather and scatter-accumulate
    IN_OPTIMIZER = "in_optimizer"  # gradients folded (pre_optimizer_step); the optimizer may run, then publish
    CLOSED = "closed"  # FSDP2's own collectives restored; also the state while __init__ builds the engine
    BROKEN = "broken"  # a barrier failed or set-up raised: the step is lost, only close() is allowed


@dataclass
class StepStats:
    """What one optimizer step cost this rank (seconds unless named otherwise).

    Attributes:
        gather_s: time inside all-gather hooks (reading peers' shards).
        scatter_s: time inside reduce-scatter hooks (adding slices into owners' accumulators).
        wait_s: time blocked in barriers: the step boundary's (and every hook's with ``sync_every_hook``).
        fold_s: time folding the accumulators into ``.grad`` (the ordered reduction's exchange excluded).
        exchange_s: ``ordered`` reduction only: time the owner spent reading every rank's contribution to its shards
            and summing them in rank order, after the step's barrier (its bytes count in ``bytes_read``).
        publish_s: time publishing the new shards after the optimizer step.
        flush_s: time waiting, before a barrier, for this rank's own queued device work (its backward, adds and
            publishes; GPU transports only). Busy, not wait: ``wait_s`` is time blocked on peers only.
        replicate_s: HSDP only: time in the step's all-reduce across replicas (packing and waiting; folding excluded).
            Counted in ``wait_s`` too: a rank there is blocked on its replicas.
        replicate_bytes: HSDP only: bytes this rank's step all-reduced across replicas.
        gathers / scatters: hook calls during the step.
        bytes_read / bytes_accumulated: payload moved through the transport (under ``ordered``, ``bytes_accumulated``
            counts the local adds into this rank's own contributions, and ``bytes_read`` the peers' contributions read
            at the step boundary besides the gathers).
        transport_bytes: device memory the transport holds (``Transport.memory_report()["total"]``; 0 on CPU).
        peak_memory_bytes: this rank's peak memory up to the end of the step (GPU: torch's ``max_memory_allocated``;
            CPU: the process's peak resident set size, shared memory mapped from peers included). Not reset by the
            engine, which would change what other readers of these figures see: reset them to measure one step.
        kept_params / kept_grads: param groups whose gathered params / unsharded grads the memory policy kept.
    """

    gather_s: float = 0.0
    scatter_s: float = 0.0
    wait_s: float = 0.0
    fold_s: float = 0.0
    exchange_s: float = 0.0
    publish_s: float = 0.0
    gathers: int = 0
    scatters: int = 0
    bytes_read: int = 0
    bytes_accumulated: int = 0
    flush_s: float = 0.0
    transport_bytes: int = 0
    replicate_s: float = 0.0
    replicate_bytes: int = 0
    peak_memory_bytes: int = 0
    kept_params: int = 0
    kept_grads: int = 0

    def finish(self, transport_bytes: int, peak_memory_bytes: int) -> StepStats:
        """Close the step's figures with the readings taken at its end; returns ``self``."""
        self.transport_bytes = transport_bytes
        self.peak_memory_bytes = peak_memory_bytes
        return self
