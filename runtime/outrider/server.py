"""The server: the models it serves, the way requests get in, and its start and shutdown.

`Server` builds every manifest's ServedModel (serving/assembly.py), starts the ZeroMQ front
(zmq_front.py) and any other fronts (`--http`: plugins, through `submit`/`cancel`), runs the
supervisor thread, and on SIGTERM drains: no new requests, in-flight ones finish (bounded),
the rest are answered `unavailable`. `enqueue` is the one admission path every front uses.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from . import __version__, devices, timeline
from .backend import check_request
from .errors import (
    BadRequestError,
    CancelledError,
    ManifestError,
    ModelNotFoundError,
    ModelNotReadyError,
    OutriderError,
    ProtocolError,
    UnavailableError,
)
from .front import Front
from .manifest import Manifest
from .plugins import PluginRegistry
from .protocol import DEFAULT_LIMITS, Limits, parse_tensors
from .hardware import bound_malloc_arenas
from .serving.pending_load import PendingLoad
from .serving.repository import ModelRepository
from .serving.request import PendingRequest
from .serving.served_model import ServedModel
from .transport import DEFAULT_ADDRESS, CurveServerKeys
from .zmq_front import ZmqFront

log = logging.getLogger("outrider.server")

#: the longest deadline a request may ask for (24 hours); longer is a mistake, not a deadline
MAX_TIMEOUT_MS = 86_400_000


@dataclass
class ServerConfig:
    """How a server runs (what `outrider serve`'s flags set), apart from its models and plugins."""

    address: str = DEFAULT_ADDRESS  # the ZeroMQ socket
    limits: Limits = DEFAULT_LIMITS
    curve: Optional[CurveServerKeys] = None  # CURVE encryption and client keys
    drain_timeout: float = 30.0  # seconds a stop waits for what is in flight
    metrics_port: Optional[int] = None  # Prometheus on its own port
    fronts: Sequence[tuple] = ()  # other fronts: (Front class, address[, options])
    #: a repository of manifests, of which `load` names those loaded at start (None: all of them;
    #: the rest are available, loaded by model control or on demand)
    models_dir: Optional[str] = None
    load: Optional[Sequence[str]] = None
    watch: bool = False  # reload changed files of models_dir
    memory_budget: Optional[int] = None  # bytes: what loads is bounded by it (serving/repository.py)
    overrides: Optional[list[str]] = None  # `--set` for the directory's files


class Server:
    """Serves a set of models on one address until told to stop."""

    def __init__(self, manifests: list[Manifest], registry: PluginRegistry,
                 config: Optional[ServerConfig] = None) -> None:
        """`manifests` are loaded at start; `config` says how the server runs (ServerConfig)."""
        config = config or ServerConfig()
        self.config = config
        address, limits, curve, drain_timeout, metrics_port, fronts, models_dir, load, watch, memory_budget, \
            overrides = (config.address, config.limits, config.curve, config.drain_timeout, config.metrics_port,
                         config.fronts, config.models_dir, config.load, config.watch, config.memory_budget,
                         config.overrides)
        names = [m.name for m in manifests]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ManifestError(f"two manifests name the same model: {duplicates}")
        if watch and models_dir is None:
            raise ManifestError("--watch reloads the files of --models DIR: give --models too")
        bound_malloc_arenas()
        self.registry = registry
        self.address = address
        self.limits = limits
        self.curve = curve
        self.drain_timeout = drain_timeout
        self.metrics_port = metrics_port
        #: other front-ends (class, address) started beside the ZeroMQ socket (`--http`)
        self.front_specs = list(fronts)
        self.fronts: list[Front] = []
        #: the loaded models (serving or loading), by name; the repository adds and removes them
        self.models: dict[str, ServedModel] = {}
        self.repository = ModelRepository(self, registry, manifests, models_dir, overrides, watch, memory_budget)
        at_start = list(names)
        if models_dir is not None:
            from_dir = [n for n, e in self.repository.entries.items() if n not in names]
            if load is None:
                at_start += from_dir
            else:
                unknown = sorted(set(load) - set(self.repository.entries))
                if unknown:
                    raise ManifestError(f"--load names {unknown}, not in {models_dir}; there: {sorted(from_dir)}")
                at_start += [n for n in load if n not in at_start]
        elif load:
            raise ManifestError("--load chooses among the models of --models DIR: give --models too")
        for name in at_start:  # built now, so a bad manifest stops the start
            entry = self.repository.entries[name]
            if entry.manifest is None:
                raise ManifestError(f"model {name!r}: {entry.reason}")
            self.models[name] = self.repository.build(entry, entry.manifest)
        self.inflight: dict[tuple[bytes, Any], PendingRequest] = {}
        self.draining = False
        self.started = time.time()
        self.zmq = ZmqFront(self)
        self._stopping = threading.Event()  # set by shutdown: the supervisor thread ends
        # Set by a signal handler, read by serve_forever's loop: a plain attribute, never a lock
        # (a handler runs on the main thread, possibly inside a wait on the same Event).
        self._stop_signalled = False
        self._started = False
        # Ids of requests from other fronts (their `client` keys keep them apart from ZeroMQ's).
        self._front_ids = itertools.count(1)

    # -- set-up ---------------------------------------------------------------------------

    def start(self) -> None:
        """Bind, start the I/O loop, then load and warm up every model in the background."""
        self.zmq.start()
        if self.metrics_port is not None:
            from .stats import start_metrics_server

            start_metrics_server(self.metrics_port, lambda: self.models, index=self.repository.index)
            log.info("metrics on http://127.0.0.1:%d/metrics", self.metrics_port)
        for cls, address, *options in self.front_specs:  # listening before the models load, like the socket
            # (class, address) or (class, address, options); a front written before options gets none
            front = cls(self, address, options[0]) if options and options[0] else cls(self, address)
            front.start()
            self.fronts.append(front)
        log.info("listening on %s (models loading: %s)", self.address, ", ".join(self.models))
        devices.inventory()  # probed once here, so a health request only ever reads the snapshot
        for name, model in self.models.items():
            self.repository.adopt(name, model)
            model.start()
        self._supervisor = threading.Thread(target=self._supervise, name="outrider-supervisor", daemon=True)
        self._supervisor.start()
        self._started = True  # every front listens: a server with no model to wait for is ready now

    def _supervise(self) -> None:
        """Replace dead or hung instances, and the repository's reloads and idle unloads; off the
        I/O loop since a restart loads a model."""
        while not self._stopping.wait(0.05):
            now = time.monotonic()
            for model in list(self.models.values()):
                try:
                    model.supervise(now)
                except Exception:
                    log.exception("model %s: supervision failed", model.name)
            if not self.draining:
                try:
                    self.repository.tick(now)
                except Exception:
                    log.exception("model repository: tick failed")

    @property
    def ready(self) -> bool:
        """Started (every front listening), not draining, and every model loaded at start is ready
        (a model loaded later, by model control or on demand, never makes a serving server unready)."""
        return (self._started and not self.draining
                and all(m.ready for m in list(self.models.values()) if m.required))

    def wait_ready(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.ready:
                return True
            if any(m.state == "failed" for m in list(self.models.values()) if m.required):
                return False
            time.sleep(0.01)
        return self.ready

    def find_model(self, name: Any, load: bool = True) -> "ServedModel | PendingLoad":
        """The model a request names: loaded (serving or loading), or with `load`, an unloaded
        `load_on_demand` model whose load this starts (its PendingLoad holds the request until the
        model takes it). Raises ModelNotFoundError, or ModelNotReadyError for a model in the
        repository that is not loaded. Never blocks: fronts call it on their I/O threads."""
        if not isinstance(name, str):
            raise ProtocolError("'model' must be a string naming a served model")
        model = self.models.get(name)
        if model is not None:
            return model
        if load:
            loading = self.repository.on_demand(name)
            if loading is not None:
                return loading
        entry = self.repository.entries.get(name)
        if entry is not None:
            raise ModelNotReadyError(f"model {name[:128]!r} is {entry.state}, not loaded"
                                     + (f" ({entry.reason})" if entry.reason else "")
                                     + "; load it first (outrider load, or POST /v2/repository/models/NAME/load)")
        raise ModelNotFoundError(f"no model named {name[:128]!r}; served here: {sorted(self.models)}")

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
        return self.enqueue(kind, client, request_id, model, {} if parameters is None else parameters,
                             list(inputs), list(buffers), relay.send)

    def cancel(self, request: PendingRequest, why: str = "the client disconnected") -> bool:
        """Answer `request` as cancelled (a queued one is dropped, a generation frees its slot at
        its next step); False when it was already answered."""
        model = self.models.get(request.model)  # gone once unloaded
        return request.answer(CancelledError(f"request {request.id!r}: {why}"), model.stats if model is not None else None)

    def enqueue(self, kind: str, route: bytes, request_id: Any, model_name: Any, parameters: Any,
                 specs: Any, frames: list, send: Callable[..., None]) -> PendingRequest:
        # Everything here is O(number of tensors): shapes and frame lengths are checked against
        # the protocol and the model's limits; the buffers are decoded by the instance that runs
        # the request (PendingRequest.decode), never on this thread.
        model = self.find_model(model_name)
        generates = model.generates  # None: a model loading on demand whose backend decides (checked then)
        if kind == "infer" and generates:
            raise BadRequestError(f"model {model.name!r} generates text; send generate")
        if kind == "generate" and generates is False:
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

    def expire_deadlines(self, now: float) -> None:
        """Answer queued requests whose deadline passed (the I/O loop calls this every 10 ms)."""
        for model in list(self.models.values()):
            expired = model.queue.expire(now)
            if expired:
                model.stats.failure("timeout", expired)

    # -- health and shutdown ---------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        loaded = list(self.models.items())
        models = {name: m.health() for name, m in loaded}
        # The server's status follows the models loaded at start (see `ready`).
        required = [models[name] for name, m in loaded if m.required]
        if self.draining:
            status = "draining"
        elif self._started and all(m["ready"] for m in required):
            status = "ready"
        elif any(m["state"] == "failed" for m in required):
            status = "failed"
        elif any(m["state"] == "degraded" for m in required):
            status = "degraded"  # was serving; no instance of some model can serve now (being replaced)
        else:
            status = "loading"
        found = devices.inventory()  # the snapshot taken at start, refreshed in the background
        return {
            "ready": status == "ready",
            "status": status,
            "models": models,
            # Every model the server may serve, loaded or not, with its state and why.
            "repository": self.repository.index(),
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
        """Ask serve_forever to drain and stop (safe from a signal handler: it only sets a flag)."""
        self._stop_signalled = True

    def shutdown(self, drain_timeout: Optional[float] = None) -> None:
        """Take no new work, let in-flight requests finish (bounded), answer the rest, close."""
        timeout = self.drain_timeout if drain_timeout is None else drain_timeout
        self.draining = True
        log.info("draining: %d request(s) in flight, up to %.1fs", len(self.inflight), timeout)
        end = time.monotonic() + timeout
        while self.inflight and time.monotonic() < end:
            time.sleep(0.005)
        gone = UnavailableError("server shut down before this request finished")
        models = list(self.models.values()) + self.repository.stop_all()
        for model in models:
            for request in model.stop():
                request.answer(gone)
        for request in list(self.inflight.values()):
            request.answer(gone)
        for model in models:
            model.join(timeout=5.0)
        for front in self.fronts:  # every request it passed on has had its final reply by now
            try:
                front.stop()
            except Exception:
                log.exception("front %s on %s: stopping failed", front.name, front.address)
        self._stopping.set()
        self.zmq.stop()
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
        timeline.mark("bound and loads started")
        announced = False
        while not self._stop_signalled:
            time.sleep(0.05 if announced else 0.002)  # the start's phases are timed to the ready
            if not announced and self.ready:
                announced = True
                timeline.report("ready")
                log.info("ready: %s on %s", ", ".join(self.models), self.address)
                if on_ready:
                    on_ready()
        self.shutdown()
        return 0


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
        # Never raises (the sender moves on to the rest of its batch), like ZmqFront.send.
        try:
            if kind == "reply":
                self.on_reply(header, outputs)
            elif self.on_chunk is not None and not request.done:
                self.on_chunk(header)
        except Exception:
            log.exception("model %s: a front's %s callback for request %r failed", request.model, kind, request.id)
