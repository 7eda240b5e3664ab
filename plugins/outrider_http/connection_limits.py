"""Limits uvicorn's httptools protocol does not have: header size and count, and read timeouts.

uvicorn (0.55) on httptools reads a request's header section for as long as it grows (a header
that never ends was read past 8 MiB), takes any number of headers, and never times out a client
that sends a byte at a time. `BoundedHttpToolsProtocol` adds, per connection:

- at most MAX_HEAD_BYTES of request line and headers, and MAX_HEADERS headers: past either, a
  431 and the connection closes;
- HEAD_TIMEOUT_S from a request's first byte to the end of its headers: past it, a 408;
- BODY_IDLE_TIMEOUT_S without a byte while a body is being read: the connection closes (the
  route sees the client gone, answers nobody and logs nothing).

Idle keep-alive connections are uvicorn's (`timeout_keep_alive`), the number of connections
its `limit_concurrency` (MAX_CONNECTIONS; a 503 past it). Where httptools is missing, uvicorn's
h11 protocol runs instead, which bounds the header section itself (h11_max_incomplete_event_size)
but has no read timeouts.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Optional

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # no httptools: protocol_class() says "h11"
    HttpToolsProtocol = object  # type: ignore[misc,assignment]

MAX_CONNECTIONS = 1024  # open connections (and requests in flight): uvicorn answers 503 past it
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
# Seconds; the environment may change them (a slow uplink, or a test that cannot wait 30 s).
HEAD_TIMEOUT_S = float(os.environ.get("OUTRIDER_HTTP_HEAD_TIMEOUT_S", "10"))
BODY_IDLE_TIMEOUT_S = float(os.environ.get("OUTRIDER_HTTP_BODY_IDLE_TIMEOUT_S", "30"))

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._reading_head = True  # between requests, or inside a request line and headers
        self._head_bytes = 0
        self._header_count = 0
        self._timer: Optional[asyncio.TimerHandle] = None

    def _arm(self, seconds: float, status: int) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired, status)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, status: int) -> None:
        self._timer = None
        if status == 408 and (self.cycle is None or self.cycle.response_complete):
            self._refuse(408, "the request's headers did not arrive in time")
        elif not self.transport.is_closing():
            self.transport.close()  # a stalled body: the route sees the client gone

    def _refuse(self, status: int, message: str) -> None:
        if self.transport.is_closing():
            return
        body = message.encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, _REASONS[status], len(body), body))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._reading_head:
            if self._head_bytes == 0 and self._timer is None:
                self._arm(HEAD_TIMEOUT_S, 408)  # from a request's first byte
            self._head_bytes += len(data)
        super().data_received(data)
        # Counted before the parse, checked after: bytes of a body that arrived with the headers
        # do not count once the headers are complete.
        if self._reading_head and self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > MAX_HEADERS:
            self._refuse(431, f"more than {MAX_HEADERS} headers")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_head, self._head_bytes = False, 0
        self._disarm()
        if self.transport.is_closing():
            return
        super().on_headers_complete()
        if self.parser.get_method() not in (b"GET", b"HEAD"):
            self._arm(BODY_IDLE_TIMEOUT_S, 0)

    def on_body(self, body: bytes) -> None:
        if self._timer is not None:
            self._arm(BODY_IDLE_TIMEOUT_S, 0)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        self._reading_head, self._head_bytes = True, 0
        super().on_message_complete()


def protocol_class() -> Any:
    """The protocol for uvicorn's `http` setting: the bounded one, or "h11" without httptools."""
    return BoundedHttpToolsProtocol if HttpToolsProtocol is not object else "h11"
