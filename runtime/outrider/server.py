"""The server: one I/O loop thread in front, model instances behind, the main thread for signals.

Request path: ROUTER -> I/O loop (decode, check, queue: never blocks, never computes)
-> a free instance pulls it, computes, and sends its reply itself.

The ROUTER is shared under a lock instead of being owned by one thread: a second thread hop
for every reply (inproc PUSH/PULL back to the I/O thread) cost more than the whole echo model.
Nobody blocks inside ZeroMQ while holding the lock: the I/O thread sleeps in `select.poll`
on the socket's ZMQ_FD plus a wake-up pipe. Because ZMQ_FD is edge-triggered, whoever touches
the socket re-reads ZMQ_EVENTS afterwards and wakes the I/O thread if input is pending.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import select
import signal
import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import __version__, devices
from .backend import check_options, check_request
from .errors import (
    BadRequestError,
    CancelledError,
    InternalError,
    ManifestError,
    ModelNotFoundError,
    OutriderError,
    ProtocolError,
    TooLargeError,
    UnavailableError,
)
from .front import Front
from .manifest import Manifest
from .model import PendingRequest, Scheduler, ServedModel, cancel_error
from .plugins import PluginRegistry
from .protocol import (
    DEFAULT_LIMITS,
    REQUEST_KINDS,
    Limits,
    encode_message,
    parse_tensors,
    parse_type_frame,
    unpack_header,
)
from .transport import DEFAULT_ADDRESS, CurveServerKeys, recv_message, send_frames, server_socket, start_authenticator

log = logging.getLogger("outrider.server")

_MAX_ID_LENGTH = 256
#: the longest deadline a request may ask for (24 hours); longer is a mistake, not a deadline
MAX_TIMEOUT_MS = 86_400_000
# Plain ints: pyzmq's enum constants cost ~2 us per use (enum construction and Flag.__and__).
_EVENTS, _POLLIN, _SRCFD = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.SRCFD)
_BURST = 256  # messages moved per socket per wake-up, so neither direction starves the other
# ... and bytes: a burst is held in full before it is handled, so big messages end it early.
_BURST_BYTES = 4 << 20
# Final replies that met a full pipe (a client that stopped reading) wait here to be retried,
# this many at most and this long at most; chunks are not kept (the final reply carries all).
_BACKLOG_MAX = 4096
_BACKLOG_S = 30.0


class Server:
    """Serves a set of models on one address until told to stop."""

    def __init__(
        self,
        manifests: list[Manifest],
        registry: PluginRegistry,
        address: str = DEFAULT_ADDRESS,
        limits: Limits = DEFAULT_LIMITS,
        curve: Optional[CurveServerKeys] = None,
        drain_timeout: float = 30.0,
        metrics_port: Optional[int] = None,
        fronts: Sequence[tuple[type[Front], str]] = (),
    ) -> None:
        names = [m.name for m in manifests]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ManifestError(f"two manifests name the same model: {duplicates}")
        self.registry = registry
        self.address = address
        self.limits = limits
        self.curve = curve
        self.drain_timeout = drain_timeout
        self.metrics_port = metrics_port
        #: other front-ends (class, address) started beside the ZeroMQ socket (`--http`)
        self.front_specs = list(fronts)
        self.fronts: list[Front] = []
        self.models: dict[str, ServedModel] = {}
        for manifest in manifests:
            self.models[manifest.name] = self._build_model(manifest)
        self.inflight: dict[tuple[bytes, Any], PendingRequest] = {}
        self.draining = False
        self.started = time.time()
        self._io_stop = threading.Event()
        self._stop_requested = threading.Event()
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
        # Ids of requests from other fronts (their `client` keys keep them apart from ZeroMQ's).
        self._front_ids = itertools.count(1)

    # -- set-up ---------------------------------------------------------------------------

    def _build_model(self, manifest: Manifest) -> ServedModel:
        choice = self.registry.choose_backend(manifest)
        if manifest.model and manifest.model.task and manifest.model.task not in self.registry.tasks:
            raise ManifestError(
                f"{manifest.source_file}: field 'model.task': no plugin registers task "
                f"{manifest.model.task!r}; known: {sorted(self.registry.tasks)}"
            )
        check_options(manifest, choice.backend)
        accelerators = self.registry.accelerators_for(manifest, choice.backend)
        scheduler: Optional[Scheduler] = accelerators.batch_policy
        make_scheduler = getattr(choice.backend, "make_scheduler", None)
        if make_scheduler is not None:  # stateful engines (generation) bring their own loop
            if manifest.scheduling.instance_kind != "thread":
                # Its loop drives the engine object of an in-process backend across steps; a
                # worker process only answers execute(batch), so it could never serve.
                raise ManifestError(
                    f"{manifest.source_file or manifest.name}: field 'scheduling.instance_kind': backend "
                    f"{choice.backend.name!r} keeps its sequences in an engine of its own and runs only as "
                    f"'thread' instances, got {manifest.scheduling.instance_kind!r}"
                )
            scheduler = make_scheduler(manifest)
        return ServedModel(
            manifest,
            choice,
            make_task=lambda m=manifest: self.registry.make_task(m),
            scheduler=scheduler,
            on_state=self.registry.notify_state,
            plugin_modules=self.registry.modules,
            accelerators=accelerators,
        )

    def start(self) -> None:
        """Bind, start the I/O loop, then load and warm up every model in the background."""
        self.ctx = zmq.Context()
        if self.curve is not None:
            self._auth = start_authenticator(self.ctx, self.curve)
        self.router = server_socket(self.ctx, self.address, self.limits, self.curve)
        # libzmq's ZMQ_ROUTER_NOTIFY is a draft option the released wheels lack; the monitor's
        # DISCONNECTED event names the connection's descriptor, which each message carries too.
        self._monitor = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._io_thread = threading.Thread(target=self._io_loop, name="outrider-io", daemon=True)
        self._io_thread.start()
        if self.metrics_port is not None:
            from .stats import start_metrics_server

            start_metrics_server(self.metrics_port, lambda: self.models)
            log.info("metrics on http://127.0.0.1:%d/metrics", self.metrics_port)
        for cls, address in self.front_specs:  # listening before the models load, like the socket
            front = cls(self, address)
            front.start()
            self.fronts.append(front)
        log.info("listening on %s (models loading: %s)", self.address, ", ".join(self.models))
        devices.inventory()  # probed once here, so a health request only ever reads the snapshot
        for model in self.models.values():
            model.start()
        self._supervisor = threading.Thread(target=self._supervise, name="outrider-supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        """Replace dead or hung instances; off the I/O loop since a restart loads a model."""
        while not self._io_stop.wait(0.05):
            now = time.monotonic()
            for model in self.models.values():
                try:
                    model.supervise(now)
                except Exception:
                    log.exception("model %s: supervision failed", model.name)

    @property
    def ready(self) -> bool:
        return not self.draining and all(m.ready for m in self.models.values())

    def wait_ready(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.ready:
                return True
            if any(m.state == "failed" for m in self.models.values()):
                return False
            time.sleep(0.01)
        return self.ready

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
                for model in self.models.values():
                    expired = model.queue.expire(now)
                    if expired:
                        model.stats.failure("timeout", expired)
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
        max_frames = self.limits.max_tensors + 3  # identity, type, header, tensors
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
                events.append(recv_monitor_message(self._monitor, zmq.NOBLOCK))
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
            departed = [r for (route, _), r in list(self.inflight.items()) if route in gone]
            for request in departed:
                self.cancel(request)
            if departed:
                log.info("a client disconnected: cancelled its %d request(s) in flight", len(departed))

    def _handle(self, frames: list[Any], dropped: int, size: int) -> None:
        # `size`: bytes of all the frames, the routing identity's included.
        route = frames[0].bytes
        request_id = None
        if dropped:
            # The frames past the limit were read and dropped, never kept.
            max_frames = self.limits.max_tensors + 3
            error = TooLargeError(
                f"message has {len(frames) + dropped - 1} frames; the limit is {max_frames - 1} "
                f"(type, header and {self.limits.max_tensors} tensors)"
            )
            self._reply_now(route, {"id": None, "ok": False, "error": error.to_wire()})
            return
        try:
            if len(frames) < 3:
                raise ProtocolError(
                    f"a message needs a type frame and a header frame; got {len(frames) - 1} frame(s)"
                )
            size -= len(route)
            if size > self.limits.max_message_bytes:
                raise TooLargeError(f"message is {size} bytes; the limit is {self.limits.max_message_bytes}")
            kind = parse_type_frame(frames[1], REQUEST_KINDS)
            header = unpack_header(frames[2].buffer, self.limits)
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
        self._reply_now(route, {"id": request_id, "ok": True, **self.health()})

    def _on_models(self, route: bytes, request_id: Any, header: dict, tensors: list) -> None:
        self._reply_now(route, {"id": request_id, "ok": True, "models": [m.describe() for m in self.models.values()]})

    def _on_infer(self, route: bytes, request_id: Any, header: dict, tensors: list) -> None:
        self._enqueue("infer", route, request_id, header.get("model"), header.get("parameters", {}),
                      header.get("inputs", []), tensors, self._send)

    def _on_generate(self, route: bytes, request_id: Any, header: dict, tensors: list) -> None:
        self._enqueue("generate", route, request_id, header.get("model"), header.get("parameters", {}),
                      header.get("inputs") or [], tensors, self._send)

    def _on_cancel(self, route: bytes, request_id: Any, header: dict, tensors: list) -> None:
        target = _request_id(header, "target")
        request = self.inflight.get((route, target))
        # The engine sees `done` and drops the request (a queued one is skipped, a generating
        # one frees its cache at the next step).
        cancelled = request is not None and request.fail(cancel_error(request))
        if cancelled:
            self.models[request.model].stats.failure("cancelled")
        self._reply_now(route, {"id": request_id, "ok": True, "cancelled": bool(cancelled)})

    def _model(self, name: Any) -> ServedModel:
        if not isinstance(name, str):
            raise ProtocolError("'model' must be a string naming a served model")
        model = self.models.get(name)
        if model is None:
            raise ModelNotFoundError(f"no model named {name[:128]!r}; served here: {sorted(self.models)}")
        return model

    def submit(
        self,
        kind: str,
        model: str,
        parameters: Optional[dict] = None,
        inputs: Sequence[dict] = (),
        buffers: Sequence[Any] = (),
        *,
        client: bytes,
        on_reply: Callable[[dict, Optional[dict]], None],
        on_chunk: Optional[Callable[[dict], None]] = None,
    ) -> PendingRequest:
        """Queue one `infer` or `generate` request from an in-process front-end (HTTP, gRPC...).

        The same path as a ZeroMQ request: `inputs` are OIP tensor descriptions and `buffers`
        their raw bytes in the wire layout (PROTOCOL.md), checked against the same limits; the
        request waits in the same queue (`client` names the connection, for fairness between
        connections), is batched, timed out and counted the same. Raises the request's
        OutriderError when it is refused at once (unknown model, bad input, overloaded, not ready);
        otherwise `on_reply(header, outputs)` is called exactly once and `on_chunk(header)` for
        each streamed chunk before it, from any thread (the caller's own included), so they must
        only hand the result over (e.g. `loop.call_soon_threadsafe`). Returns the request, for
        `cancel`.
        """
        request_id = next(self._front_ids)
        relay = _Relay(on_reply, on_chunk)
        return self._enqueue(kind, client, request_id, model, {} if parameters is None else parameters,
                             list(inputs), list(buffers), relay.send)

    def cancel(self, request: PendingRequest, why: str = "the client disconnected") -> bool:
        """Answer `request` as cancelled (a queued one is dropped, a generation frees its slot at
        its next step); False when it was already answered."""
        if request.fail(CancelledError(f"request {request.id!r}: {why}")):
            self.models[request.model].stats.failure("cancelled")
            return True
        return False

    def _enqueue(self, kind: str, route: bytes, request_id: Any, model_name: Any, parameters: Any,
                 specs: Any, frames: list, send: Callable[..., None]) -> PendingRequest:
        # Everything here is O(number of tensors): shapes and frame lengths are checked against
        # the protocol and the model's limits; the buffers are decoded by the instance that runs
        # the request (PendingRequest.decode), never on this thread.
        model = self._model(model_name)
        generates = model.generates
        if kind == "infer" and generates:
            raise BadRequestError(f"model {model.name!r} generates text; send generate")
        if kind == "generate" and not generates:
            raise BadRequestError(f"model {model.name!r} does not generate text; use infer")
        if self.draining:
            raise UnavailableError("server is shutting down and takes no new requests")
        if not isinstance(parameters, dict):
            raise ProtocolError("'parameters' must be a map")
        deadline_s = _timeout_seconds(parameters.get("timeout_ms"))
        if kind == "generate":
            # A generation reads its prompt from parameters; tensors would only be held in memory.
            if specs or frames:
                raise BadRequestError(
                    f"generate takes its prompt in 'parameters' and no tensors; this request carries "
                    f"{max(len(frames), len(specs) if isinstance(specs, list) else 1)}"
                )
            tensors = []
        else:
            tensors = parse_tensors(specs, frames, self.limits)
            check_request(model.manifest, tensors)
        key = (route, request_id)
        if key in self.inflight:
            raise BadRequestError(f"request id {request_id!r} is already in flight on this connection")
        request = PendingRequest(
            route=route,
            id=request_id,
            kind=kind,
            model=model.name,
            inputs={},
            parameters=parameters,
            send=send,
            on_done=self._forget,
            tensors=tensors,
            nbytes=sum(t.nbytes for t in tensors),
            max_element_bytes=model.manifest.limits.max_element_bytes,
        )
        if deadline_s is not None:
            request.deadline = request.received + deadline_s
        self.inflight[key] = request
        try:
            model.submit(request)
        except OutriderError:
            self.inflight.pop(key, None)
            raise
        return request

    def _forget(self, request: PendingRequest) -> None:
        self.inflight.pop((request.route, request.id), None)

    def _note_connection(self, route: bytes, frame: Any) -> None:
        # The descriptor the message came in on (-1 or absent for inproc). I/O thread only.
        try:
            fd = frame.get(_SRCFD)
        except (zmq.ZMQError, AttributeError):
            return
        if fd >= 0:
            self._route_fd[route] = fd
        if len(self._route_fd) > 4 * max(64, len(self.inflight)):
            # Routes with nothing in flight need no watching; their disconnects may never be seen
            # (a client connected through a proxy), so prune rather than grow.
            live = {key[0] for key in list(self.inflight)}
            self._route_fd = {r: f for r, f in self._route_fd.items() if r in live or r == route}

    # -- replies ---------------------------------------------------------------------------

    def _reply_now(self, route: bytes, header: dict) -> None:
        """Reply from the I/O thread (health, refused requests)."""
        frames = [route, *encode_message("reply", header)]
        with self._socket_lock:
            self._send_frames(frames)

    def _send(self, request: PendingRequest, kind: str, header: dict, outputs: Optional[dict]) -> None:
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
            self.cancel(request)

    # -- health and shutdown ---------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        models = {name: m.health() for name, m in self.models.items()}
        if self.draining:
            status = "draining"
        elif all(m["ready"] for m in models.values()):
            status = "ready"
        elif any(m["state"] == "failed" for m in models.values()):
            status = "failed"
        elif any(m["state"] == "degraded" for m in models.values()):
            status = "degraded"  # was serving; no instance of some model can serve now (being replaced)
        else:
            status = "loading"
        found = devices.inventory()  # the snapshot taken at start, refreshed in the background
        return {
            "ready": status == "ready",
            "status": status,
            "models": models,
            # Per GPU: memory, utilization, temperature, error (only where there are GPUs).
            **({"devices": found.health(), "devices_source": found.source} if found.gpus else {}),
            "server": {
                "version": __version__,
                "pid": os.getpid(),
                "address": self.address,
                "uptime_seconds": round(time.time() - self.started, 3),
                "inflight": len(self.inflight),
            },
        }

    def request_stop(self) -> None:
        self._stop_requested.set()

    def shutdown(self, drain_timeout: Optional[float] = None) -> None:
        """Take no new work, let in-flight requests finish (bounded), answer the rest, close."""
        timeout = self.drain_timeout if drain_timeout is None else drain_timeout
        self.draining = True
        log.info("draining: %d request(s) in flight, up to %.1fs", len(self.inflight), timeout)
        end = time.monotonic() + timeout
        while self.inflight and time.monotonic() < end:
            time.sleep(0.005)
        gone = UnavailableError("server shut down before this request finished")
        for model in self.models.values():
            for request in model.stop():
                request.fail(gone)
        for request in list(self.inflight.values()):
            request.fail(gone)
        for model in self.models.values():
            model.join(timeout=5.0)
        for front in self.fronts:  # every request it passed on has had its final reply by now
            try:
                front.stop()
            except Exception:
                log.exception("front %s on %s: stopping failed", front.name, front.address)
        self._io_stop.set()
        if self._io_thread is not None:
            self._io_thread.join(5.0)
        with self._socket_lock:
            self._flush_backlog(time.monotonic())
            self.router.close()  # LINGER lets the last replies leave
        os.close(self._wake_read)
        os.close(self._wake_write)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
        log.info("stopped")

    def serve_forever(self, on_ready: Optional[Callable[[], None]] = None) -> int:
        """Run until SIGTERM/SIGINT (drain), a second signal forces exit. Returns the exit code."""
        signals_seen = []

        def on_signal(signum: int, frame: Any) -> None:
            signals_seen.append(signum)
            if len(signals_seen) > 1:
                log.warning("second signal: exiting without draining")
                os._exit(1)
            self.request_stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        self.start()
        announced = False
        while not self._stop_requested.wait(0.05):
            if not announced and self.ready:
                announced = True
                log.info("ready: %s on %s", ", ".join(self.models), self.address)
                if on_ready:
                    on_ready()
        self.shutdown()
        return 0


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


def _timeout_seconds(timeout_ms: Any) -> Optional[float]:
    """The `timeout_ms` parameter in seconds (None when absent); a finite number in (0, 24 h]."""
    if timeout_ms is None:
        return None
    if (
        isinstance(timeout_ms, bool)
        or not isinstance(timeout_ms, (int, float))
        or not (0 < timeout_ms <= MAX_TIMEOUT_MS)  # False for NaN too
    ):
        shown = repr(timeout_ms) if isinstance(timeout_ms, (int, float)) else type(timeout_ms).__name__
        raise BadRequestError(
            f"parameter 'timeout_ms' must be a positive number of milliseconds, at most {MAX_TIMEOUT_MS} "
            f"(24 hours), got {shown[:40]}"
        )
    return timeout_ms / 1000


class _Relay:
    """Turns the core's `send(request, kind, header, outputs)` into a front's two callbacks."""

    __slots__ = ("on_reply", "on_chunk")

    def __init__(self, on_reply: Callable[[dict, Optional[dict]], None],
                 on_chunk: Optional[Callable[[dict], None]]) -> None:
        self.on_reply, self.on_chunk = on_reply, on_chunk

    def send(self, request: PendingRequest, kind: str, header: dict, outputs: Optional[dict]) -> None:
        # Never raises (the sender moves on to the rest of its batch), like Server._send.
        try:
            if kind == "reply":
                self.on_reply(header, outputs)
            elif self.on_chunk is not None and not request.done:
                self.on_chunk(header)
        except Exception:
            log.exception("model %s: a front's %s callback for request %r failed", request.model, kind, request.id)
