"""Front-ends: what a plugin implements to take requests in another protocol (HTTP, gRPC, ...).

The ZeroMQ socket is the core's own front. Another front runs in the same process beside it and
hands every request to `Submitter.submit` (the server), so it shares the models' queues, batching, limits,
deadlines, cancellation and metrics with ZeroMQ clients; it never calls a backend itself.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, ClassVar, Mapping, Optional, Protocol, Sequence

from .protocol import Limits
from .serving.request import PendingRequest
from .serving.served_model import ServedModel


class Submitter(Protocol):
    """What a front may use of the server it runs in (`outrider.server.Server` is one).

    `models` is for reading (describe(), health(), `generates`, `manifest`); requests go in
    through `submit` only, and a front never calls a backend itself.
    """

    limits: Limits
    started: float  # time.time() when the server started
    models: Mapping[str, ServedModel]

    @property
    def ready(self) -> bool: ...

    def health(self) -> dict[str, Any]: ...

    def submit(self, kind: str, model: str, parameters: Optional[dict] = None, inputs: Sequence[dict] = (),
               buffers: Sequence[Any] = (), *, client: bytes, on_reply: Callable[[dict, Optional[dict]], None],
               on_chunk: Optional[Callable[[dict], None]] = None) -> PendingRequest: ...

    def cancel(self, request: PendingRequest, why: str = "the client disconnected") -> bool: ...

    # The model a request names: loaded (a ServedModel), or with `load`, an unloaded model whose
    # on-demand load this starts (a serving.pending_load.PendingLoad: it answers `name`, `manifest`,
    # `version`, `generates` and `make_task()` as a ServedModel does). Raises ModelNotFoundError or
    # ModelNotReadyError; never blocks.
    def find_model(self, name: Any, load: bool = True) -> Any: ...

    # The model repository (serving.repository.ModelRepository): index(), load(), unload(), entries.
    repository: Any


class Front:
    """One listening front-end. Lifecycle: `start()` once listening, `stop()` after the core drained.

    `name` is what `outrider serve --front NAME=ADDRESS` selects (`--http ADDRESS` is
    `--front http=ADDRESS`). Requests go in through `server.submit(...)`, each client connection
    passing its own `client` key so the model queues stay fair between connections, and a client
    that goes away is answered with `server.cancel(request, ...)`.
    """

    name: ClassVar[str] = ""

    def __init__(self, server: Submitter, address: str, options: Optional[Mapping[str, Any]] = None) -> None:
        self.server = server
        self.address = address
        # What `outrider serve` was told for this front (the HTTP front: api_key_file, tls_cert,
        # tls_key, insecure, open_metrics); a front ignores what it does not know.
        self.options: Mapping[str, Any] = dict(options or {})

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


class AsyncCall:
    """One submitted request's chunks and final reply, handed over to an asyncio event loop.

    Pass `on_reply` and `on_chunk` to `Server.submit`; `await next()` in the loop. The core
    answers from its own threads (an instance, the supervisor, the I/O loop) or from the caller's
    thread during `submit` (a backend that runs inline); either way the answer reaches the queue
    on the loop's thread. Create it on the loop's thread.
    """

    def __init__(self, loop: Optional["asyncio.AbstractEventLoop"] = None) -> None:
        import asyncio  # here: a server without an asyncio front never pays its import (~18 ms)

        self.loop = loop or asyncio.get_running_loop()
        self.items: asyncio.Queue[tuple[str, dict, Optional[dict]]] = asyncio.Queue()
        self.request: Any = None
        self.finished = False
        self._loop_thread = threading.get_ident()

    def _put(self, item: tuple[str, dict, Optional[dict]]) -> None:
        if threading.get_ident() == self._loop_thread:  # answered inline, during submit
            self.items.put_nowait(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the loop is closed: its front stopped, nobody waits for this
            pass

    def on_reply(self, header: dict, outputs: Optional[dict]) -> None:
        self._put(("reply", header, outputs))

    def on_chunk(self, header: dict) -> None:
        self._put(("chunk", header, None))

    async def next(self) -> tuple[str, dict, Optional[dict]]:
        """The next chunk, or the final reply (after which nothing more comes)."""
        item = await self.items.get()
        if item[0] == "reply":
            self.finished = True
        return item
