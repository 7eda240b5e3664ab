"""What the server and its worker processes share: the request kinds and the size limits of
their private PAIR socket (the public protocol's framing: msgpack header + raw tensor frames)."""

from __future__ import annotations

from ..protocol import Limits

WORKER_KINDS = frozenset({"load", "warmup", "execute", "health", "metadata", "unload"})
LIMITS = Limits(max_message_bytes=1 << 31, max_header_bytes=16 << 20, max_tensors=4096,
                 max_tensor_elements=1 << 31)
POLL_MS = 100  # how often a wait re-checks the process where no pidfd is available
#: seconds a new worker has to start and connect (imports, plugin registration); load itself is unbounded
CONNECT_TIMEOUT_S = 60.0
#: seconds a worker has to answer a health check; one that does not is wedged and gets killed
HEARTBEAT_TIMEOUT_S = 5.0
#: seconds the worker waits for the server to take a reply before it gives up (the server is gone)
WORKER_SNDTIMEO_MS = 10_000
