"""The ``"network"`` transport: one-sided reads and accumulates over TCP, served by a background thread on each owner.

=============  =======================================================================================================
``transport``  `NetworkTransport`, the training thread's side: connections to the peers, reads, adds, claims, barrier.
``service``    `NetworkService`, the side that serves this rank's buffers to its peers from background threads.
``wire``       the message header and operations, and the socket helpers both sides use.
=============  =======================================================================================================
"""

from .service import DEFAULT_CHUNK_BYTES, NetworkService
from .transport import NetworkTransport
from .wire import default_address

__all__ = ["DEFAULT_CHUNK_BYTES", "NetworkService", "NetworkTransport", "default_address"]
