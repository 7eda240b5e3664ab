"""The ZeroMQ front: one ROUTER socket and the I/O thread that reads it.

Request path: ROUTER -> I/O loop (decode, check, queue: never blocks, never computes)
-> a free instance pulls it, computes, and sends its reply itself (`send`).

The ROUTER is shared under a lock instead of being owned by one thread: a second thread hop
for every reply (inproc PUSH/PULL back to the I/O thread) cost more than the whole echo model.
Nobody blocks inside ZeroMQ while holding the lock: the I/O thread sleeps in `select.poll`
on the socket's ZMQ_FD plus a wake-up pipe. Because ZMQ_FD is edge-triggered, whoever touches
the socket re-reads ZMQ_EVENTS afterwards and wakes the I/O thread if input is pending.

Also here: replies that meet a full pipe wait in a bounded backlog, and a client whose
connection closes has its requests and streams cancelled (the socket monitor's events).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import struct
import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Protocol

import zmq

from .errors import InternalError, OutriderError, ProtocolError, TooLargeError
from .front import Submitter
from .protocol import REQUEST_KINDS, encode_message, parse_type_frame, unpack_header
from .serving.request import PendingRequest, cancel_error
from .transport import CurveServerKeys, recv_message, send_frames, server_socket, start_authenticator

log = logging.getLogger("outrider.server")

_MAX_ID_LENGTH = 256
# Plain ints: pyzmq's enum constants cost ~2 us per use (enum construction and Flag.__and__).
_EVENTS, _POLLIN, _SRCFD = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.SRCFD)
_BURST = 256  # messages moved per socket per wake-up, so neither direction starves the other
# ... and bytes: a burst is held in full before it is handled, so big messages end it early.
_BURST_BYTES = 4 << 20
# Final replies that met a full pipe (a client that stopped reading) wait here to be retried,
# this many at most and this long at most; chunks are not kept (the final reply carries all).
_BACKLOG_MAX = 4096
_BACKLOG_S = 30.0
# Model control (load, unload) runs on threads of its own, this many at once at most.
_CONTROL_THREADS = 8
#: the longest a `load` may wait for its model to be ready (it goes on loading after that)
MAX_LOAD_WAIT_S = 3600.0



class ZmqServer(Submitter, Protocol):
    """What the ZeroMQ front uses of its server beyond a front's `Submitter` (server.Server)."""

    address: str
    curve: Optional[CurveServerKeys]
    inflight: dict[tuple[bytes, Any], PendingRequest]

    def enqueue(self, kind: str, route: bytes, request_id: Any, model_name: Any, parameters: Any,
                specs: Any, frames: list, send: Callable[..., None]) -> PendingRequest: ...

    def expire_deadlines(self, now: float) -> None: ...


class ZmqFront:
    """The server's ZeroMQ socket, its I/O thread, and the replies sent through it."""

    def __init__(self, server: ZmqServer) -> None:
        self.server = server
        self._io_stop = threading.Event()
        self._io_thread: Optional[threading.Thread] = None
        self._io_ident: Optional[int] = None
        # Reentrant: a reply sent while handling a request (a cancel answering its target) nests.
        self._socket_lock = threading.RLock()
        self._auth = None
        self.ctx: Optional[zmq.Context] = None
        # Final replies waiting for room in a slow client's pipe: (give up at, route, frames).
        self._backlog: deque[tuple[float, bytes, list[Any]]] = deque()
        self._backlog_dropped, self._backlog_warned = 0, 0.0
        # The connection (file descriptor) each route with requests in flight came in on, so a
        # disconnect reported by the socket monitor can cancel that client's requests and streams.
        self._route_fd: dict[bytes, int] = {}
        self._control_slots = threading.BoundedSemaphore(_CONTROL_THREADS)

    def start(self) -> None:
        """Bind the ROUTER and start the I/O thread."""
        server = self.server
        self.ctx = zmq.Context()
        if server.curve is not None:
            self._auth = start_authenticator(self.ctx, server.curve)
        self.router = server_socket(self.ctx, server.address, server.limits, server.curve)
        # libzmq's ZMQ_ROUTER_NOTIFY is a draft option the released wheels lack; the monitor's
        # DISCONNECTED event names the connection's descriptor, which each message carries too.
        self._monitor = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._io_thread = threading.Thread(target=self._io_loop, name="outrider-io", daemon=True)
        self._io_thread.start()

    def stop(self) -> None:
        """Stop the I/O thread, send what the backlog still holds (LINGER lets it leave), close."""
        self._io_stop.set()
        if self._io_thread is not None:
            self._io_thread.join(5.0)
        with self._socket_lock:
            self._flush_backlog(time.monotonic())
            self.router.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()

    # -- the I/O loop ----------------------------------------------------------------------

    def _io_loop(self) -> None:
        self._io_ident = threading.get_ident()
        waiter = select.poll()
        waiter.register(self.router.getsockopt(zmq.FD), select.POLLIN)
        waiter.register(self._wake_read, select.POLLIN)
        monitor_fd = self._monitor.getsockopt(zmq.FD)
        waiter.register(monitor_fd, select.POLLIN)
        next_sweep = 0.0
        watch = True
        while not self._io_stop.is_set():
            # Departures are looked at when the monitor's descriptor says there may be events, and
            # at least every sweep; a look at any time is safe (see _watch_departures).
            if watch:
                self._watch_departures()
                watch = False
            # The lock is held only to read: handling (checks, queueing) runs without it, so an
            # instance sending a reply never waits for the I/O thread to finish a burst.
            with self._socket_lock:
                messages, cut_short = self._receive_burst()
            for frames, dropped, size in messages:
                self._handle(frames, dropped, size)
            if cut_short:
                continue  # more may be waiting
            # The burst read until ZMQ_EVENTS said nothing was left, which re-arms the router's
            # edge-triggered descriptor; a reply sent since then looked again and, if input was
            # waiting, wrote to the wake pipe. So poll cannot sleep through a message.
            for fd, _ in waiter.poll(20):  # ms: also the period of the deadline sweep
                if fd == self._wake_read:
                    try:
                        os.read(self._wake_read, 4096)
                    except BlockingIOError:
                        pass
                elif fd == monitor_fd:
                    watch = True
            now = time.monotonic()
            if now >= next_sweep:
                watch = True
                self.server.expire_deadlines(now)
                next_sweep = now + 0.01
            if self._backlog:
                with self._socket_lock:
                    self._flush_backlog(now)
        with self._socket_lock:
            self.router.disable_monitor()
        self._monitor.close(0)

    def _receive_burst(self) -> tuple[list[tuple[list[Any], int, int]], bool]:
        """Up to _BURST waiting messages, or until they hold _BURST_BYTES, as (frames, frames dropped
        past the limit, bytes of the frames kept), and whether it was cut short. Caller holds the
        socket lock; otherwise it reads until ZMQ_EVENTS says nothing is left."""
        max_frames = self.server.limits.max_tensors + 3  # identity, type, header, tensors
        messages = []
        held = 0
        for _ in range(_BURST):
            received = recv_message(self.router, max_frames)
            if received is None:
                return messages, False
            frames, dropped = received
            size = sum(map(len, frames))  # zmq.Frame: its length in bytes
            messages.append((frames, dropped, size))
            held += size
            if held >= _BURST_BYTES:
                return messages, True
        return messages, True

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full, so the I/O thread is awake anyway

    def _send_frames(self, frames: list[Any], final: bool = True) -> int:
        """Send now, never block: 0, or the errno that stopped it (caller holds the socket lock).

        EHOSTUNREACH: the client left, nothing to do. EAGAIN: it stopped reading and its pipe is
        full; a final reply then waits in the backlog (retried by the I/O loop), a chunk is dropped.
        """
        try:
            send_frames(self.router, frames, nonblock=True)
            return 0
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EAGAIN and final:
                if len(self._backlog) >= _BACKLOG_MAX:
                    self._backlog.popleft()
                    self._backlog_dropped += 1
                    if time.monotonic() >= self._backlog_warned + 1.0:  # one line a second at most
                        self._backlog_warned = time.monotonic()
                        log.warning("reply backlog full (%d): %d final replies dropped so far, oldest first, "
                                    "to clients that stopped reading", _BACKLOG_MAX, self._backlog_dropped)
                self._backlog.append((time.monotonic() + _BACKLOG_S, frames[0], frames))
            else:
                log.debug("dropping a %s to a client that cannot take it: %s", "reply" if final else "chunk", exc)
            return exc.errno

    def _flush_backlog(self, now: float) -> None:
        # Caller holds the socket lock. Oldest first; stop at the first that still finds no room.
        while self._backlog:
            give_up, route, frames = self._backlog[0]
            try:
                send_frames(self.router, frames, nonblock=True)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EAGAIN and now < give_up:
                    return
                log.warning("dropped a final reply after %.0fs: the client did not read it (%s)", _BACKLOG_S, exc)
            self._backlog.popleft()

    def _watch_departures(self) -> None:
        """Cancel the requests and streams of clients whose connection closed.

        Events name a descriptor, which the OS reuses: a DISCONNECTED(fd) followed in the same
        look by ACCEPTED(fd) may have a new client's requests already noted under that fd, so it
        is skipped (that client's streams still stop at their next chunk, which finds it gone).
        A new client's ACCEPTED is queued before any of its messages can be read, and a look
        drains every queued event, so a look after reading one of its messages sees its ACCEPTED
        after the old DISCONNECTED; a DISCONNECTED without a later ACCEPTED for the fd therefore
        concerns only the old connection, whenever the look happens.
        """
        events = []
        while self._monitor.getsockopt(_EVENTS) & _POLLIN:  # no exception raised per look
            try:
                events.append(_monitor_event(self._monitor.recv_multipart(zmq.NOBLOCK)))
            except zmq.Again:
                break
        for index, event in enumerate(events):
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            fd = int(event["value"])
            if any(e["event"] == zmq.EVENT_ACCEPTED and int(e["value"]) == fd for e in events[index + 1:]):
                continue
            gone = {route for route, route_fd in self._route_fd.items() if route_fd == fd}
            for route in gone:
                del self._route_fd[route]
            if not gone:
                continue
            departed = [r for (route, _), r in list(self.server.inflight.items()) if route in gone]
            for request in departed:
                self.server.cancel(request)
            if departed:
                log.info("a client disconnected: cancelled its %d request(s) in flight", len(departed))

    def _handle(self, frames: list[Any], dropped: int, size: int) -> None:
        # `size`: bytes of all the frames, the routing identity's included.
        route = frames[0].bytes
        request_id = None
        if dropped:
            # The frames past the limit were read and dropped, never kept.
            max_frames = self.server.limits.max_tensors + 3
            error = TooLargeError(
                f"message has {len(frames) + dropped - 1} frames; the limit is {max_frames - 1} "
                f"(type, header and {self.server.limits.max_tensors} tensors)"
            )
            self._reply_now(route, {"id": None, "ok": False, "error": error.to_wire()})
            return
        try:
            if len(frames) < 3:
                raise ProtocolError(
                    f"a message needs a type frame and a header frame; got {len(frames) - 1} frame(s)"
                )
            size -= len(route)
            if size > self.server.limits.max_message_bytes:
                raise TooLargeError(f"message is {size} bytes; the limit is {self.server.limits.max_message_bytes}")
            kind = parse_type_frame(frames[1], REQUEST_KINDS)
            header = unpack_header(frames[2].buffer, self.server.limits)
            request_id = _request_id(header)
            # A routing id the ROUTER made (a zero byte, then a counter) names one connection for
            # the socket's life: its descriptor is noted once. A client's own id may come back on
            # a new connection, so it is noted every time.
            if kind in ("infer", "generate") and not (route[0] == 0 and route in self._route_fd):
                self._note_connection(route, frames[1])
            getattr(self, "_on_" + kind)(route, request_id, header, frames[3:])
        except OutriderError as exc:
            # Expected for hostile or broken input: one debug line, never a traceback.
            log.debug("refused a request (%s): %.200s", exc.code, exc.message)
            self._reply_now(route, {"id": request_id, "ok": False, "error": exc.to_wire()})
        except Exception as exc:  # a bug must cost one request, never the loop
            log.exception("internal error while handling a request")
            error = InternalError(f"{type(exc).__name__}: {exc}")
            self._reply_now(route, {"id": request_id, "ok": False, "error": error.to_wire()})

    # -- request kinds ---------------------------------------------------------------------

    def _on_health(self, route: bytes, request_id: Any, header: dict, tensors: list) -> None:
        self._reply_now(route, {"id": request_id, "ok": True, **self.server.health()})

    def _on_models(self, route: bytes, request_id: Any, header: dict, tensors: list) -> None:
        self._reply_now(route, {"id": request_id, "ok": True,
                                "models": [m.describe() for m in list(self.server.models.values())]})

    def _on_repository(self, route: bytes, request_id: Any, header: dict, tensors: list) -> None:
        ready = header.get("ready", False)
        if not isinstance(ready, bool):
            raise ProtocolError(f"'ready' must be true or false, got {type(ready).__name__}")
        self._reply_now(route, {"id": request_id, "ok": True, "models": self.server.repository.index(ready)})

    def _on_load(self, route: bytes, request_id: Any, header: dict, tensors: list) -> None:
        name = _model_name(header)
        wait_s = header.get("timeout_s", 600.0)
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not (0 < wait_s <= MAX_LOAD_WAIT_S):
            raise ProtocolError(f"'timeout_s' must be a number of seconds in (0, {MAX_LOAD_WAIT_S:g}]")
        repository = self.server.repository
        self._control(route, request_id, lambda: repository.load(name, wait_s=float(wait_s)),
                      lambda: {"model": name, "state": repository.entries[name].state,
                               "version": str(repository.entries[name].version)})

    def _on_unload(self, route: bytes, request_id: Any, header: dict, tensors: list) -> None:
        name = _model_name(header)
        cancel = header.get("cancel_streams", False)
        if not isinstance(cancel, bool):
            raise ProtocolError(f"'cancel_streams' must be true or false, got {type(cancel).__name__}")
        repository = self.server.repository
        self._control(route, request_id, lambda: repository.unload(name, cancel_streams=cancel),
                      lambda: {"model": name, "state": repository.entries[name].state})

    def _control(self, route: bytes, request_id: Any, act: Callable[[], Any], result: Callable[[], dict]) -> None:
        """Run a model-control action on a thread of its own (it loads or drains: seconds) and
        reply when it is done; at most _CONTROL_THREADS at once."""
        if not self._control_slots.acquire(blocking=False):
            from .errors import OverloadedError

            raise OverloadedError(f"{_CONTROL_THREADS} model-control requests are already under way; retry")

        def run() -> None:
            try:
                act()
                reply = {"id": request_id, "ok": True, **result()}
            except OutriderError as exc:
                reply = {"id": request_id, "ok": False, "error": exc.to_wire()}
            except Exception as exc:
                log.exception("model control failed")
                reply = {"id": request_id, "ok": False,
                         "error": InternalError(f"{type(exc).__name__}: {exc}").to_wire()}
            finally:
                self._control_slots.release()
            self.reply_later(route, reply)

        threading.Thread(target=run, name="outrider-control", daemon=True).start()

    def _on_infer(self, route: bytes, request_id: Any, header: dict, tensors: list) -> None:
        self.server.enqueue("infer", route, request_id, header.get("model"), header.get("parameters", {}),
                      header.get("inputs", []), tensors, self.send)

    def _on_generate(self, route: bytes, request_id: Any, header: dict, tensors: list) -> None:
        self.server.enqueue("generate", route, request_id, header.get("model"), header.get("parameters", {}),
                      header.get("inputs") or [], tensors, self.send)

    def _on_cancel(self, route: bytes, request_id: Any, header: dict, tensors: list) -> None:
        target = _request_id(header, "target")
        request = self.server.inflight.get((route, target))
        # The engine sees `done` and drops the request (a queued one is skipped, a generating
        # one frees its cache at the next step).
        cancelled = request is not None and request.answer(cancel_error(request))
        model = self.server.models.get(request.model) if cancelled else None
        if model is not None:
            model.stats.failure("cancelled")
        self._reply_now(route, {"id": request_id, "ok": True, "cancelled": bool(cancelled)})

    def _note_connection(self, route: bytes, frame: Any) -> None:
        # The descriptor the message came in on (-1 or absent for inproc). I/O thread only.
        try:
            fd = frame.get(_SRCFD)
        except (zmq.ZMQError, AttributeError):
            return
        if fd >= 0:
            self._route_fd[route] = fd
        if len(self._route_fd) > 4 * max(64, len(self.server.inflight)):
            # Routes with nothing in flight need no watching; their disconnects may never be seen
            # (a client connected through a proxy), so prune rather than grow.
            live = {key[0] for key in list(self.server.inflight)}
            self._route_fd = {r: f for r, f in self._route_fd.items() if r in live or r == route}

    # -- replies ---------------------------------------------------------------------------

    def _reply_now(self, route: bytes, header: dict) -> None:
        """Reply from the I/O thread (health, refused requests)."""
        frames = [route, *encode_message("reply", header)]
        with self._socket_lock:
            self._send_frames(frames)

    def reply_later(self, route: bytes, header: dict) -> None:
        """A final reply from another thread than the I/O loop (model control)."""
        frames = [route, *encode_message("reply", header)]
        with self._socket_lock:
            self._send_frames(frames, True)
            pending = self.router.getsockopt(_EVENTS) & _POLLIN
        if pending:
            self._wake()

    def send(self, request: PendingRequest, kind: str, header: dict, outputs: Optional[dict]) -> None:
        """Send a reply or chunk from any thread (an instance, the supervisor, the I/O loop).

        Never raises: a request that reached here was claimed (or is streaming), so the caller
        moves on to the rest of its batch. A final reply that cannot be encoded becomes an error
        reply; a chunk after the final reply is never sent.
        """
        final = kind == "reply"
        try:
            frames = [request.route, *encode_message(kind, header, outputs, key="outputs")]
        except Exception as exc:  # a backend output or field msgpack cannot carry
            log.error("model %s: could not encode the %s to request %r: %s: %s", request.model, kind,
                      request.id, type(exc).__name__, exc)
            if not final:
                return  # the final reply still comes, and says what happened if it fails too
            error = InternalError(f"the reply could not be encoded: {type(exc).__name__}: {exc}")
            frames = [request.route, *encode_message("reply", {"id": request.id, "ok": False,
                                                               "error": error.to_wire()})]
        with self._socket_lock:
            # The final reply is claimed before it is sent, and sent under this lock: a chunk
            # that finds the request answered here would arrive after it, so it is dropped.
            if not final and request.done:
                return
            status = self._send_frames(frames, final)
            # Sending may have consumed the ZMQ_FD edge that announced new input. The I/O thread
            # reads ZMQ_EVENTS again after handling a burst anyway: only other threads look here.
            pending = threading.get_ident() != self._io_ident and self.router.getsockopt(_EVENTS) & _POLLIN
        if pending:
            self._wake()
        if status == errno.EHOSTUNREACH and not final:
            # A stream whose client left: stop generating for nobody and free its slot.
            self.server.cancel(request)


def _monitor_event(frames: list[bytes]) -> dict[str, int]:
    """A socket monitor message: the event (uint16) and its value (uint32), native byte order, as
    zmq.utils.monitor.parse_monitor_message reads them (importing that module imports asyncio)."""
    event, value = struct.unpack("=hi", frames[0][:6])
    return {"event": event, "value": value}


def _model_name(header: dict) -> str:
    name = header.get("model")
    if not isinstance(name, str) or not 0 < len(name) <= 256:
        raise ProtocolError("'model' must be a string of 1 to 256 characters naming a model")
    return name


def _request_id(header: dict, field: str = "id") -> Any:
    """A request id (or a cancel's target): a string of 1-256 characters or a 64-bit integer."""
    request_id = header.get(field)
    if isinstance(request_id, bool) or not (
        (isinstance(request_id, str) and 0 < len(request_id) <= _MAX_ID_LENGTH)
        or (isinstance(request_id, int) and -(2**63) <= request_id < 2**64)
    ):
        got = type(request_id).__name__ if not isinstance(request_id, (str, int)) else (
            f"a string of {len(request_id)} characters" if isinstance(request_id, str) else f"{request_id}")
        raise ProtocolError(
            f"{field!r} must be a non-empty string of at most {_MAX_ID_LENGTH} characters or an integer "
            f"from -2**63 to 2**64-1, got {got}"
        )
    return request_id
