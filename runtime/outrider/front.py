"""Front-ends: what a plugin implements to take requests in another protocol (HTTP, gRPC, ...).

The ZeroMQ socket is the core's own front. Another front runs in the same process beside it and
hands every request to `Server.submit`, so it shares the models' queues, batching, limits,
deadlines, cancellation and metrics with ZeroMQ clients; it never calls a backend itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from .server import Server


class Front:
    """One listening front-end. Lifecycle: `start()` once listening, `stop()` after the core drained.

    `name` is what `outrider serve --front NAME=ADDRESS` selects (`--http ADDRESS` is
    `--front http=ADDRESS`). Requests go in through `server.submit(...)`, each client connection
    passing its own `client` key so the model queues stay fair between connections, and a client
    that goes away is answered with `server.cancel(request, ...)`.
    """

    name: ClassVar[str] = ""

    def __init__(self, server: "Server", address: str) -> None:
        self.server = server
        self.address = address

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """(True, "") when this front can run here, else (False, why): e.g. a missing package."""
        return True, ""

    def start(self) -> None:
        """Bind and serve on threads of its own; return once listening, raise if it cannot bind."""
        raise NotImplementedError

    def stop(self, timeout: float = 5.0) -> None:
        """Stop listening and close connections; called after in-flight requests were answered."""
        raise NotImplementedError
