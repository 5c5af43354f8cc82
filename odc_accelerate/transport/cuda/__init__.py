"""The ``"cuda"`` transport: the GPUs of one node, torch symmetric memory for data, shared memory for control.

=============  =======================================================================================================
``transport``  `CudaTransport`: the segments, reads, atomic adds, flush and barrier.
``device``     this rank's device facts, gathered from every rank, and the accumulate path they decide.
``segments``   the host-side plan, independent of any GPU: segment layout, memory budget, refusals, the staging pool.
``kernels``    the Triton accumulate kernel, ``accumulate_``, with its CPU path under ``TRITON_INTERPRET=1``.
``watchdog``   ends a rank blocked in a set-up call that has no timeout (symmetric memory's rendezvous).
=============  =======================================================================================================
"""

from .device import cuda_unavailable_reason, gather_device_facts, local_device_facts
from .segments import DeviceFacts, device_refusal
from .transport import CudaTransport

__all__ = [
    "CudaTransport",
    "DeviceFacts",
    "cuda_unavailable_reason",
    "device_refusal",
    "gather_device_facts",
    "local_device_facts",
]
