"""The one way HTTP requests reach the models: `Server.submit`, bridged to the event loop.

The core answers from its own threads (an instance, the supervisor, the I/O loop, or the
caller's thread when a trivial backend runs inline); each answer is handed to the event loop
with `call_soon_threadsafe` and read there from the request's `Call`. A client that leaves
while its request waits or streams is answered `cancelled` through `Server.cancel`, so its
queued request is dropped and its generation frees its slot at the next step.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable, Optional, Sequence, TypeVar

from outrider.errors import OutriderError, OverloadedError, TooLargeError
from outrider.front import AsyncCall

#: HTTP status for each error code (KServe and OpenAI routes alike)
STATUS = {
    "protocol_error": 400,
    "bad_request": 400,
    "too_large": 413,  # Content Too Large: a body, a tensor or a count past its limit
    "model_not_found": 404,
    "model_not_ready": 503,
    "overloaded": 503,
    "unavailable": 503,
    "insufficient_memory": 503,  # a load that does not fit --memory-budget until busy models go idle
    "manifest_error": 400,  # model control: the manifest to load does not validate
    "load_failed": 400,
    "quality_gate_failed": 400,
    "bad_artifact": 400,
    "backend_unavailable": 400,
    "timeout": 504,
    "cancelled": 499,  # nginx's "client closed request": nobody reads it
    "execution_error": 500,
    "internal": 500,
}


def status_of(code: str) -> int:
    return STATUS.get(code, 500)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready; its request was cancelled."""


# One request in flight: its chunks and final reply, as they reach the event loop.
Call = AsyncCall


class Dispatcher:
    """Submits requests for the routes of one HTTP front and waits for their answers."""

    def __init__(self, server: Any, front: str = "http") -> None:
        self.server = server
        self.front = front
        self._anonymous = itertools.count()
        # Bytes of request bodies being read, over all connections: each body is bounded by the
        # message limit, and all of them together by this (16 stalled 59 MiB uploads held 919 MB).
        self.body_budget = BODY_BUDGET_MESSAGES * server.limits.max_message_bytes
        self.body_bytes = 0

    def client_key(self, scope: dict) -> bytes:
        """The connection a request came on: each counts as its own client for queue fairness."""
        client = scope.get("client")
        if client:
            return f"{self.front} {client[0]}:{client[1]}".encode()
        return f"{self.front} #{next(self._anonymous)}".encode()  # a unix socket: one key per request

    def submit(self, scope: dict, kind: str, model: str, parameters: dict,
               inputs: Sequence[dict] = (), buffers: Sequence[Any] = (), stream: bool = False) -> Call:
        """Queue the request (raises its OutriderError when refused at once) and return its Call."""
        call = Call(asyncio.get_running_loop())
        call.request = self.server.submit(
            kind, model, parameters, inputs, buffers, client=self.client_key(scope),
            on_reply=call.on_reply, on_chunk=call.on_chunk if stream else None,
        )
        return call

    async def next(self, call: Call, receive: Any) -> tuple[str, dict, Optional[dict]]:
        """The call's next item; if the client disconnects first, cancel the request, raise ClientGone."""
        if not call.items.empty():
            return await call.next()
        item = asyncio.ensure_future(call.next())
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({item, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not item.done():
                item.cancel()
            gone.cancel()
        if item.done() and not item.cancelled():
            return item.result()
        self.cancel(call)
        raise ClientGone()

    async def final(self, call: Call, receive: Any) -> tuple[dict, Optional[dict]]:
        """The final reply (chunks, if any, are skipped), cancelling the request if the client leaves."""
        while True:
            kind, header, outputs = await self.next(call, receive)
            if kind == "reply":
                return header, outputs

    def cancel(self, call: Call, why: str = "the HTTP client disconnected") -> None:
        if call.request is not None and not call.finished:
            self.server.cancel(call.request, why)


async def _disconnected(receive: Any) -> None:
    # The body has been read: what the server receives next is the client going away.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


BODY_BUDGET_MESSAGES = 4
INLINE_BYTES = 64 * 1024  # bodies parsed on the event loop; larger ones on a thread

T = TypeVar("T")


async def off_loop(work: Callable[[], T], size: int, inline_below: int = INLINE_BYTES) -> T:
    """`work()` (parsing, tokenizing) here when `size` is small, else on a thread, so a client's
    million-element JSON does not stall every other client's requests on the event loop (the
    GIL is shared, but the loop gets its turns: other requests wait milliseconds, not seconds)."""
    if size <= inline_below:
        return work()
    return await asyncio.to_thread(work)


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, refused (too_large) past `limit` bytes before it is all read, and
    (overloaded, 503) when the bodies being read by all connections would pass the budget of the
    app's dispatcher (build_app sets `app.state.dispatch`; an app without one has no shared budget)."""
    from starlette.requests import ClientDisconnect

    dispatch = getattr(getattr(request.scope.get("app"), "state", None), "dispatch", None)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and (len(declared) > 19 or int(declared) > limit):
        raise TooLargeError(f"request body is {declared[:24]} bytes; the limit is {limit} (--max-message-mb)")
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise TooLargeError(f"request body exceeds {limit} bytes (--max-message-mb)")
            if dispatch is not None:
                if dispatch.body_bytes + len(part) > dispatch.body_budget:
                    raise OverloadedError(f"the server is reading {dispatch.body_bytes} bytes of request bodies, "
                                          f"its budget; retry")
                dispatch.body_bytes += len(part)
            parts.append(part)
    except ClientDisconnect:  # the client left mid-body: nobody to answer, nothing to log
        raise ClientGone() from None
    finally:
        if dispatch is not None:
            dispatch.body_bytes -= sum(map(len, parts))
    return b"".join(parts)


def error_code(exc: BaseException) -> tuple[str, str]:
    """(code, message) for an exception raised while handling a request."""
    if isinstance(exc, OutriderError):
        return exc.code, exc.message
    return "internal", f"{type(exc).__name__}: {exc}"
