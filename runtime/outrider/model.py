"""A served model: its request queue, its instances, its state and its stats.

Instances are threads that each own one backend instance and pull work from the model's
queue when free (nobody pushes onto a busy instance). ORT and PyTorch release the GIL
while they compute, so threads overlap compute with the I/O loop.

An instance serves only while it is ready, not abandoned, and its backend's own health()
says healthy (checked every `Instance.HEALTH_INTERVAL_S`); the model is ready while one does.
The supervisor (`ServedModel.supervise`, every 50 ms) notices a dead worker process, a hung
execute and a dead instance thread, answers what they were running, and replaces them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from .backend import Backend, BackendChoice
from .devices import Inventory, inventory, is_out_of_memory, out_of_memory_reason, place
from .errors import (
    CancelledError,
    ExecutionError,
    InternalError,
    ModelNotReadyError,
    OutriderError,
    OverloadedError,
    RequestTimeoutError,
    UnavailableError,
)
from .manifest import DEFAULT_PROCESS_EXECUTE_TIMEOUT_MS, Manifest
from .protocol import TensorFrame
from .stats import ModelStats

log = logging.getLogger("outrider.model")


class ModelState:
    LOADING = "loading"
    READY = "ready"
    DEGRADED = "degraded"  # serving, but fewer healthy instances than asked for
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(eq=False)
class PendingRequest:
    """One request waiting for its single final reply. Replies after the first are dropped.

    The server hands over its tensors checked but not decoded (`tensors`): `decode()` turns them
    into `inputs` on the instance thread that runs the request, so the I/O thread never walks a
    BYTES frame. Requests built in process may pass `inputs` directly.
    """

    route: bytes
    id: Any
    kind: str
    model: str
    inputs: dict[str, np.ndarray]
    parameters: dict[str, Any]
    send: Callable[["PendingRequest", str, dict, Optional[dict]], None]
    received: float = field(default_factory=time.monotonic)
    deadline: Optional[float] = None
    priority: int = 0
    on_done: Optional[Callable[["PendingRequest"], None]] = None
    #: checked, not yet decoded input tensors (None once decoded, or when `inputs` was given)
    tensors: Optional[list[TensorFrame]] = None
    #: bytes of the input frames this request holds (for the model's queue byte budget)
    nbytes: int = 0
    #: the model's limits.max_element_bytes, applied while decoding BYTES
    max_element_bytes: Optional[int] = None
    _done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _on_claim: list = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self._done

    def claim(self) -> bool:
        """Become the one who answers this request; False if it was already answered."""
        with self._lock:
            if self._done:
                return False
            self._done = True
        if self.on_done is not None:
            self.on_done(self)
        for hook in self._on_claim:
            hook(self)
        return True

    def decode(self) -> None:
        """Decode `tensors` into `inputs` (raises the request's OutriderError: malformed BYTES, too large)."""
        tensors = self.tensors
        if tensors is None:
            return
        self.inputs = {
            t.name: t.decode(self.max_element_bytes, "limits.max_element_bytes") for t in tensors
        }
        self.tensors = None

    @property
    def rows(self) -> int:
        """The first dimension of the first input (1 for a scalar or a request without tensors)."""
        if self.tensors is not None:
            shape = self.tensors[0].shape if self.tensors else ()
        else:
            shape = next(iter(self.inputs.values())).shape if self.inputs else ()
        return shape[0] if shape else 1

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Input shapes by name, known before decoding (schedulers plan batches with them)."""
        if self.tensors is not None:
            return {t.name: t.shape for t in self.tensors}
        return {name: tuple(a.shape) for name, a in self.inputs.items()}

    def reply(self, outputs: Optional[dict[str, np.ndarray]] = None, claimed: bool = False, **fields: Any) -> bool:
        """Send the final successful reply; False if the request was already answered."""
        if not claimed and not self.claim():
            return False
        self.send(self, "reply", {"id": self.id, "ok": True, **fields}, outputs)
        return True

    def fail(self, error: OutriderError, claimed: bool = False) -> bool:
        """Send the final error reply; False if the request was already answered."""
        if not claimed and not self.claim():
            return False
        self.send(self, "reply", {"id": self.id, "ok": False, "error": error.to_wire()}, None)
        return True

    def chunk(self, outputs: Optional[dict[str, np.ndarray]] = None, **fields: Any) -> bool:
        """Stream a partial result before the final reply (generation)."""
        if self._done:
            return False
        self.send(self, "chunk", {"id": self.id, **fields}, outputs)
        return True


class RequestQueue:
    """Bounded queue per model, fair between connections: full means 'overloaded' now, not
    unbounded memory later, and no connection can take the whole model from the others.

    Two bounds: how many requests wait (`max_size`), and how many input bytes the model holds
    (`max_bytes`): a request's bytes count from `put` until it is answered, so requests being
    split or executed count too, not only those waiting.

    Fairness (requests are grouped by `route`, the client connection):
    - taking is round-robin over the connections with requests waiting, oldest first within
      each, so a connection that queued 60 requests delays another's one by at most one turn
      each, not 60 (one connection alone gets plain FIFO order);
    - when the queue is full, a request from a connection holding fewer places than the largest
      holder takes the place of that holder's newest request, which is answered `overloaded`.
      One connection may use the whole queue while nobody else needs it.
    """

    #: seconds without work after which a waiting instance is told it is idle (Backend.idle):
    #: longer than a client's round trip between requests, so a busy stream never pays for it
    IDLE_AFTER_S = 0.005

    def __init__(self, max_size: int, max_bytes: Optional[int] = None) -> None:
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.bytes = 0
        self._routes: dict[bytes, deque[PendingRequest]] = {}  # waiting requests per connection
        self._turns: deque[bytes] = deque()  # connections with requests waiting, next turn first
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        return self._count

    def put(self, request: PendingRequest) -> None:
        evicted = None
        with self._cond:
            if self._closed:
                raise UnavailableError("model is shutting down")
            if self._count >= self.max_size:
                evicted = self._evict_for(request)
                if evicted is None:
                    raise OverloadedError(
                        f"model {request.model!r}: queue is full ({self.max_size} waiting); retry later"
                    )
            size = request.nbytes
            if size and self.max_bytes is not None and self.bytes + size > self.max_bytes:
                if evicted is not None:
                    self._append(evicted, left=False)  # the place was not needed after all
                raise OverloadedError(
                    f"model {request.model!r}: requests in progress hold {self.bytes} bytes and this one "
                    f"{size}; the budget is scheduling.max_queue_bytes = {self.max_bytes}; retry later"
                )
            if size:
                self.bytes += size
                request._on_claim.append(self._release)
            self._append(request, left=False)
            self._cond.notify()
        if evicted is not None:
            evicted.fail(OverloadedError(
                f"model {evicted.model!r}: queue is full ({self.max_size} waiting) and this connection held "
                f"the most places; its newest request gave its place to another connection's; retry later"
            ))

    def _evict_for(self, request: PendingRequest) -> Optional[PendingRequest]:
        """Caller holds the lock. The newest request of the connection holding the most places,
        when that is more than the newcomer's connection would hold with this request."""
        mine = len(self._routes.get(request.route, ()))
        route, waiting = max(self._routes.items(), key=lambda item: len(item[1]), default=(None, None))
        if waiting is None or route == request.route or len(waiting) <= mine + 1:
            return None
        victim = waiting.pop()
        self._count -= 1
        if not waiting:
            del self._routes[route]
            self._turns.remove(route)
        return victim

    def _append(self, request: PendingRequest, left: bool) -> None:
        # Caller holds the lock.
        waiting = self._routes.get(request.route)
        if waiting is None:
            waiting = self._routes[request.route] = deque()
            if left:
                self._turns.appendleft(request.route)
            else:
                self._turns.append(request.route)
        if left:
            waiting.appendleft(request)
        else:
            waiting.append(request)
        self._count += 1

    def _pop(self) -> Optional[PendingRequest]:
        """Caller holds the lock. The next live request in round-robin order, or None."""
        while self._turns:
            route = self._turns.popleft()
            waiting = self._routes[route]
            request = waiting.popleft()
            self._count -= 1
            if waiting:
                self._turns.append(route)
            else:
                del self._routes[route]
            if not request.done:  # cancelled or timed out while queued
                return request
        return None

    def _release(self, request: PendingRequest) -> None:
        with self._cond:
            self.bytes -= request.nbytes

    def put_back(self, requests: list[Any]) -> list[Any]:
        """Return taken, unanswered requests to the front, in order (an instance that could not
        run them); what a closed queue cannot take back is returned for the caller to answer."""
        live = [r for r in requests if not r.done]
        with self._cond:
            if self._closed:
                return live
            for request in reversed(live):
                self._append(request, left=True)
                # Its connection's turn comes first again.
                self._turns.remove(request.route)
                self._turns.appendleft(request.route)
            self._cond.notify(len(live))
        return []

    def take(self, timeout: float, idle: Optional[Callable[[], None]] = None) -> Optional[PendingRequest]:
        """The next live request, waiting up to `timeout` s; None on timeout or close.

        `idle` (an instance's `idle`) is called, without the lock, when nothing came within
        IDLE_AFTER_S and the wait goes on: the caller's thread is about to sleep."""
        if idle is not None and timeout > self.IDLE_AFTER_S:
            request = self._take(self.IDLE_AFTER_S)
            if request is not None or self._closed:
                return request
            idle()
            timeout -= self.IDLE_AFTER_S
        return self._take(timeout)

    def _take(self, timeout: float) -> Optional[PendingRequest]:
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                request = self._pop()
                if request is not None:
                    return request
                if self._closed:
                    return None
                left = end - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    if not self._count:
                        return None

    def take_more(self, limit: int) -> list[PendingRequest]:
        """Up to `limit` more live requests without waiting (for batchers)."""
        out: list[PendingRequest] = []
        with self._cond:
            while self._count and len(out) < limit:
                request = self._pop()
                if request is None:
                    break
                out.append(request)
        return out

    def wait_for_items(self, timeout: float) -> bool:
        with self._cond:
            if self._count or self._closed:
                return bool(self._count)
            self._cond.wait(timeout)
            return bool(self._count)

    def _all(self) -> list[PendingRequest]:
        return [r for waiting in self._routes.values() for r in waiting]

    def expire(self, now: float) -> int:
        """Answer queued requests whose deadline passed; returns how many were answered."""
        expired = []
        with self._cond:
            if not any(r.deadline is not None and r.deadline <= now for r in self._all()):
                return 0
            for route in list(self._routes):
                waiting = self._routes[route]
                keep = deque(r for r in waiting if not (r.deadline is not None and r.deadline <= now))
                expired.extend(r for r in waiting if r.deadline is not None and r.deadline <= now)
                self._count -= len(waiting) - len(keep)
                if keep:
                    self._routes[route] = keep
                else:
                    del self._routes[route]
                    self._turns.remove(route)
        # Cancelled ones still in line are skipped: count only the requests this answered.
        return sum(r.fail(RequestTimeoutError(f"request {r.id!r} timed out after waiting in the queue of model {r.model!r}"))
                   for r in expired)

    def close(self) -> list[PendingRequest]:
        """Stop taking work; return what was still queued so the caller can answer it."""
        with self._cond:
            self._closed = True
            items = [r for r in self._all() if not r.done]
            self._routes.clear()
            self._turns.clear()
            self._count = 0
            self._cond.notify_all()
        return items


class InstanceCrashed(ExecutionError):
    """The instance died (its worker process exited, or was killed because it hung); it will be replaced.

    Schedulers must let it propagate to the instance (never turn it into one request's result),
    so that the instance is failed and replaced; the instance answers the batch. `delivered` is
    False when the work never reached the worker (the reply code is then `unavailable`: retrying
    is safe); a scheduler that had results for part of the batch before the crash puts them in
    `partial` (one entry per request of the batch, None where there is none) so they still reply.
    """

    def __init__(self, message: str, code: Optional[str] = None, delivered: bool = True,
                 reason: Optional[str] = None) -> None:
        super().__init__(message, code)
        self.delivered = delivered
        #: what happened, without the model and instance (health shows it under the instance)
        self.reason = reason or message
        self.partial: Optional[list[Any]] = None


class Instance(threading.Thread):
    """One backend instance: load, warm up, then pull and execute until stopped.

    With `scheduling.instance_kind: process` the backend runs in a worker process behind a
    `WorkerBackend` proxy: a crash or hang there cannot take the server down.
    """

    #: seconds between two checks of the backend's own health() (a worker: a round trip to it)
    HEALTH_INTERVAL_S = 1.0

    def __init__(self, model: "ServedModel", index: int, device: str, generation: int = 0) -> None:
        super().__init__(name=f"outrider-{model.name}-{index}.{generation}", daemon=True)
        self.model = model
        self.index = index
        self.device = device
        self.generation = generation
        self.backend: Optional[Backend] = None
        self.state = ModelState.LOADING
        self.reason = ""
        self.busy_since: Optional[float] = None
        self.current: list[PendingRequest] = []
        self.abandoned = False  # set by the supervisor when execute hung; results are dropped
        #: its load failed deterministically (an OutriderError with `deterministic`: a missed
        #: quality gate, a bad artifact, a manifest error): a replacement would fail the same way
        self.final = False
        #: what the backend's own health() said last; an unhealthy instance takes no work
        self.healthy = True
        self.health_reason = ""
        self._next_health_check = 0.0
        self._stopping = threading.Event()
        self._idle_failed = False

    @property
    def serving(self) -> bool:
        """Warmed up, not given up on, and healthy by its backend's own account: it takes work."""
        return self.state == ModelState.READY and not self.abandoned and self.healthy

    def stop(self) -> None:
        self._stopping.set()

    def idle(self) -> None:
        """No work for a moment (RequestQueue.take): the backend may hand back what it holds."""
        backend = self.backend
        if backend is None:
            return
        try:
            backend.idle()
        except Exception:  # never worth failing the instance over; said once
            if not self._idle_failed:
                self._idle_failed = True
                log.exception("model %s instance %d: backend idle() failed", self.model.name, self.index)

    def check_health(self) -> None:
        """Ask the backend for its own health (a worker: a round trip, killed if wedged).

        Runs on this instance's thread, between batches, so it never waits behind one. A worker
        that is gone or does not answer raises InstanceCrashed; an unhealthy report takes the
        instance out of service until a later check says healthy again.
        """
        self._next_health_check = time.monotonic() + self.HEALTH_INTERVAL_S
        backend = self.backend
        if backend is None:
            return
        heartbeat = getattr(backend, "heartbeat", None)
        try:
            report = heartbeat() if heartbeat is not None else backend.health()
        except InstanceCrashed:
            raise
        except Exception as exc:
            report = {"healthy": False, "error": f"health() raised {type(exc).__name__}: {exc}"}
        healthy = not (isinstance(report, dict) and report.get("healthy", True) is False)
        reason = ""
        if not healthy:
            detail = report.get("reason") or report.get("error") or report.get("message")
            reason = f"backend reports unhealthy{f': {detail}' if detail else ''}"
        gpu = inventory().gpu(self.device)  # a cached snapshot
        if healthy and gpu is not None and gpu.error:
            # A lost GPU or uncorrected ECC errors: results from it cannot be trusted.
            healthy, reason = False, f"{gpu.device} ({gpu.name}) reports an error: {gpu.error}"
        if (healthy, reason) != (self.healthy, self.health_reason):
            # The reason first: whoever sees the instance out of service also sees why.
            self.health_reason, self.healthy = reason, healthy
            if healthy:
                log.info("model %s instance %d: backend healthy again", self.model.name, self.index)
            else:
                log.error("model %s instance %d: %s", self.model.name, self.index, reason)
            self.model.instance_changed()

    def _fail(self, reason: str) -> None:
        if self.state == ModelState.FAILED and self.reason:
            return  # the supervisor got there first (dead worker, hung execute) and said why
        self.reason, self.state = reason, ModelState.FAILED
        log.error("model %s instance %d: %s", self.model.name, self.index, reason)
        self.model.instance_changed()

    def _gone(self) -> Optional[str]:
        """Why this instance can no longer run anything (worker process gone, failed), or None."""
        if self.state != ModelState.READY or self.abandoned:
            return self.reason or f"instance is {self.state}"
        exited = getattr(self.backend, "exited", None)
        return exited() if exited is not None else None

    def run(self) -> None:
        model = self.model
        try:
            backend = model.make_backend(self.device, self.index)
            self.backend = backend  # visible early so the supervisor can kill a worker process
            t0 = time.perf_counter()
            backend.load()
            t1 = time.perf_counter()
            backend.warmup()
            t2 = time.perf_counter()
        except Exception as exc:
            if is_out_of_memory(exc):  # say so plainly: the fix is fewer instances or a smaller batch
                self._fail(f"load or warmup failed: {out_of_memory_reason(self.device, exc, inventory())}")
            elif isinstance(exc, OutriderError) and exc.deterministic:
                # Set before _fail publishes the state: the supervisor must never see this
                # instance failed without knowing that a restart cannot help.
                self.final = True
                self._fail(f"load failed, not retried: {exc}")
            else:
                self._fail(f"load or warmup failed: {type(exc).__name__}: {exc}")
            self._unload()
            return
        model.stats.load_seconds = max(model.stats.load_seconds, t1 - t0)
        model.stats.warmup_seconds = max(model.stats.warmup_seconds, t2 - t1)
        log.info("model %s instance %d on %s: loaded in %.2fs, warmed up in %.2fs",
                 model.name, self.index, self.device, t1 - t0, t2 - t1)
        if self._stopping.is_set():
            self._unload()
            return
        self._next_health_check = time.monotonic() + self.HEALTH_INTERVAL_S
        self.state = ModelState.READY
        model.instance_ready(self)
        model.instance_changed()
        try:
            # Until stopped, or the supervisor gives up on it (hung, worker dead: state FAILED).
            while not self._stopping.is_set() and not self.abandoned and self.state == ModelState.READY:
                if self.healthy:
                    model.scheduler.serve(self, model.queue)
                else:
                    self._stopping.wait(0.1)  # out of service: a free healthy instance takes the work
                if time.monotonic() >= self._next_health_check and self.state == ModelState.READY:
                    self.check_health()
        except InstanceCrashed as exc:
            self._fail(exc.reason)
        except Exception as exc:  # a bug in a scheduler: replace the instance, keep serving
            log.exception("model %s instance %d: loop failed", model.name, self.index)
            self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            self._unload()
            if self.state == ModelState.READY:
                self.state = ModelState.STOPPED

    def _unload(self) -> None:
        if self.backend is None:
            return
        try:
            self.backend.unload()
        except Exception:
            log.exception("model %s instance %d: unload failed", self.model.name, self.index)

    def _decode(self, batch: list[PendingRequest]) -> list[PendingRequest]:
        """Decode each request's tensors here, off the I/O thread; one that fails is answered alone."""
        live = []
        for request in batch:
            try:
                request.decode()
            except Exception as exc:
                if not isinstance(exc, OutriderError):
                    log.exception("model %s: decoding a request failed", self.model.name)
                    exc = ExecutionError(f"model {self.model.name!r}: decoding inputs failed: {type(exc).__name__}")
                if request.claim():
                    self.model.stats.failure(exc.code)
                    request.fail(exc, claimed=True)
                continue
            live.append(request)
        return live

    def _execute(self, batch: list[PendingRequest]) -> None:
        """Run one batch and answer every request in it exactly once, whatever goes wrong.

        A bug on the way to or from the backend (not the backend's own exception, which fails
        the batch's requests) still answers each unanswered request with `internal`, then lets
        the loop replace this instance.
        """
        try:
            self._run_batch(batch)
        except Exception as exc:
            if not isinstance(exc, InstanceCrashed):
                error = InternalError(f"model {self.model.name!r}: {type(exc).__name__}: {exc}")
                for request in batch:
                    if request.claim():
                        self.model.stats.failure(error.code)
                        request.fail(error, claimed=True)
            raise

    def _run_batch(self, batch: list[PendingRequest]) -> None:
        model = self.model
        gone = self._gone()
        if gone is not None:
            # Taken from the queue after the worker died but before anyone noticed: nothing was
            # sent, so the requests go back in front for another instance or the replacement.
            for request in model.queue.put_back(batch):
                request.fail(UnavailableError(f"model {model.name!r} instance {self.index}: {gone}"))
            raise InstanceCrashed(f"model {model.name!r} instance {self.index}: {gone}", delivered=False, reason=gone)
        batch = self._decode(batch)
        if not batch:
            return
        start = time.monotonic()
        self.current = batch
        self.busy_since = start
        crashed: Optional[InstanceCrashed] = None
        try:
            results = model.scheduler.execute(self.backend, batch)
        except InstanceCrashed as exc:
            crashed = exc
            partial = exc.partial if exc.partial is not None and len(exc.partial) == len(batch) else [None] * len(batch)
            results = [exc if result is None else result for result in partial]
        except OutriderError as exc:
            results = [exc] * len(batch)
        except Exception as exc:  # one failing batch must not take the instance down
            log.exception("model %s: execute failed", model.name)
            results = [ExecutionError(f"model {model.name!r}: {type(exc).__name__}: {exc}")] * len(batch)
        finally:
            self.busy_since = None
            self.current = []
        compute = time.monotonic() - start
        if len(results) != len(batch):  # a scheduler bug: _execute answers the batch `internal`
            raise RuntimeError(f"the scheduler returned {len(results)} results for {len(batch)} requests")
        if crashed is not None:  # health says so before the clients hear of it
            self._fail(crashed.reason)
        if batch:
            model.stats.batch(len(batch), (start - r.received for r in batch), compute)
        for request, result in zip(batch, results):
            if result is DEFERRED:
                continue  # a stateful scheduler (generation) answers this request in a later step
            model.answer(request, result)
        if crashed is not None:
            raise crashed


#: a scheduler's result for a request it keeps and answers later itself (streaming generation).
DEFERRED = object()


class Scheduler:
    """Default policy: one request per execute. The batching accelerator replaces it."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest

    def serve(self, instance: Instance, queue: RequestQueue) -> None:
        """One turn of an instance's loop: wait for work, execute it. Stateful engines override this."""
        batch = self.next_batch(queue, idle=instance.idle)
        if batch:
            instance._execute(batch)

    def next_batch(self, queue: RequestQueue, idle: Optional[Callable[[], None]] = None) -> list[PendingRequest]:
        request = queue.take(timeout=0.25, idle=idle)
        return [request] if request is not None else []

    def execute(self, backend: Backend, batch: list[PendingRequest]) -> list[Any]:
        """Outputs (or an OutriderError) per request, in order."""
        return [backend.execute(batch[0].inputs)]


class ServedModel:
    """Everything the server knows about one manifest's model, and the supervision of its instances."""

    #: seconds between restarts of an instance slot that keeps failing (doubling, capped).
    RESTART_BACKOFF = (1.0, 60.0)

    def __init__(
        self,
        manifest: Manifest,
        choice: BackendChoice,
        make_task: Callable[[], Any],
        scheduler: Optional[Scheduler] = None,
        on_state: Optional[Callable[[str, str, str], None]] = None,
        plugin_modules: Optional[list[str]] = None,
        accelerators: Optional[dict[str, Any]] = None,
    ) -> None:
        self.manifest = manifest
        self.accelerators = accelerators or {}
        self.name = manifest.name
        self.choice = choice
        #: the backend keeps sequences and answers `generate`, never `infer`
        self.generates = bool(getattr(choice.backend, "generates", False))
        self.make_task = make_task
        self.scheduler = scheduler or Scheduler(manifest)
        # Requests may run on the caller's thread (`_run_inline`) only under the default policy
        # and in-process instances; whether an instance's backend allows it is asked per request.
        self._inline_policy = type(self.scheduler) is Scheduler and manifest.scheduling.instance_kind == "thread"
        self.queue = RequestQueue(manifest.scheduling.max_queue_size, manifest.scheduling.max_queue_bytes)
        self.stats = ModelStats()
        self.instances: list[Instance] = []
        self.state = ModelState.LOADING
        self.reason = ""
        self.plugin_modules = plugin_modules or []
        self._on_state = on_state
        self._lock = threading.Lock()
        self._stopped = False
        self._ever_ready = False
        self._last_reason = ""
        # Per slot: consecutive failures and when the next restart may happen.
        self._failures: dict[int, int] = {}
        self._restart_at: dict[int, float] = {}
        self._unserved_since: Optional[float] = None

    #: seconds queued requests wait for an instance while none can serve; then they are answered
    #: `unavailable` (new requests are answered so at once): a replacement that keeps failing to
    #: load must not hold them until their clients give up
    UNSERVED_QUEUE_WAIT_S = 10.0

    @property
    def ready(self) -> bool:
        """Ready while at least one warmed-up instance is healthy (by its backend's own health too)."""
        return any(i.serving for i in self.instances)

    @property
    def execute_timeout_ms(self) -> Optional[float]:
        """`scheduling.execute_timeout_ms`, defaulting for worker processes (which can be killed)."""
        scheduling = self.manifest.scheduling
        if scheduling.execute_timeout_ms is not None:
            return scheduling.execute_timeout_ms
        return DEFAULT_PROCESS_EXECUTE_TIMEOUT_MS if scheduling.instance_kind == "process" else None

    def devices(self, found: Optional["Inventory"] = None) -> list[str]:
        """The device of each instance: 'cuda' spreads them over the GPUs the inventory lists."""
        if self.choice.device != "cuda":
            return [self.choice.device] * self.manifest.instances
        return place(self.manifest.instances, "cuda", found if found is not None else inventory())

    def make_backend(self, device: str, index: int = 0) -> Backend:
        """A backend in this process, or a proxy to one in a worker process."""
        if self.manifest.scheduling.instance_kind == "process":
            from .worker import WorkerBackend

            return WorkerBackend(self.manifest, device, self.plugin_modules, index=index)
        backend = self.choice.backend(self.manifest, device, self.make_task())
        backend.accelerators = self.accelerators
        backend.stats = self.stats
        return backend

    def start(self) -> None:
        for index, device in enumerate(self.devices()):
            instance = Instance(self, index, device)
            self.instances.append(instance)
            instance.start()

    def instance_changed(self) -> None:
        """Recompute the model state from its instances."""
        with self._lock:
            live = [i for i in self.instances if not i.abandoned]
            states = [i.state for i in live]
            ready = sum(i.serving for i in live)
            reasons = "; ".join(f"instance {i.index}: {i.reason or i.health_reason}"
                                for i in self.instances if i.reason or i.health_reason)
            if ready:
                self._ever_ready = True
            if reasons:
                self._last_reason = reasons
            if self._stopped:
                state, reason = ModelState.STOPPED, ""
            elif ready == self.manifest.instances:
                state, reason = ModelState.READY, ""
            elif self._ever_ready:
                # Was serving: some instance failed and is being replaced (ready iff one still is).
                state, reason = ModelState.DEGRADED, reasons or self._last_reason
            elif ModelState.FAILED in states or self._failures:
                # Never got ready: stays failed (with the reason) while restarts back off.
                state, reason = ModelState.FAILED, reasons or self._last_reason
            else:
                state, reason = ModelState.LOADING, ""
            changed = (state, reason) != (self.state, self.reason)
            self.state, self.reason = state, reason
        if changed:
            log.info("model %s: %s%s", self.name, state, f" ({reason})" if reason else "")
            if self._on_state:
                self._on_state(self.name, state, reason)
        if state == ModelState.FAILED:
            # Nobody can serve what is queued: answer it rather than let it wait for a retry.
            for request in self.queue.take_more(len(self.queue)):
                request.fail(ModelNotReadyError(f"model {self.name!r} failed: {reason}"))

    def supervise(self, now: float) -> None:
        """Detect hung and dead instances, answer their requests, and replace them (with backoff)."""
        if self._stopped:
            return
        timeout_ms = self.execute_timeout_ms
        for slot, inst in enumerate(list(self.instances)):
            exited = getattr(inst.backend, "exited", None) if inst.state == ModelState.READY else None
            gone = exited() if exited is not None and not inst.abandoned else None
            if gone is not None:  # idle or busy alike: no request needs to arrive for this to be seen
                self._crashed(inst, gone)
            elif timeout_ms and inst.busy_since is not None and now - inst.busy_since > timeout_ms / 1000:
                self._abandon(inst, f"execute exceeded execute_timeout_ms={timeout_ms:g}")
            elif inst.state == ModelState.READY and not inst.is_alive():
                inst.reason, inst.state = "instance thread exited", ModelState.FAILED
                self.instance_changed()
            if inst.final:
                continue  # failed once for a reason a restart repeats; health says which
            if inst.state == ModelState.FAILED or inst.abandoned:
                self._schedule_restart(slot, inst, now)
        self._answer_unserved(now)

    def _crashed(self, inst: Instance, how: str) -> None:
        """A worker process died (the OOM killer, a segfault): say so, answer its batch, replace it."""
        where = f"model {self.name!r} instance {inst.index}"
        inst.reason, inst.state = how, ModelState.FAILED  # the reason first: health shows both or neither
        log.error("%s: %s; replacing it", where, how)
        self.instance_changed()  # before anyone hears of it, so health already says not ready
        error = ExecutionError(f"{where}: {how} while running this request; the instance is being replaced")
        for request in list(inst.current):
            if request.claim():
                self.stats.failure(error.code)
                request.fail(error, claimed=True)

    def _answer_unserved(self, now: float) -> None:
        """Queued requests do not wait for ever on a model none of whose instances can serve."""
        if self.ready or not len(self.queue):
            self._unserved_since = None
            return
        if self._unserved_since is None:
            self._unserved_since = now
        elif now - self._unserved_since > self.UNSERVED_QUEUE_WAIT_S:
            detail = f": {self.reason}" if self.reason else ""
            error = UnavailableError(
                f"model {self.name!r} has had no instance able to serve for {self.UNSERVED_QUEUE_WAIT_S:g}s{detail}"
            )
            for request in self.queue.take_more(len(self.queue)):
                if request.claim():
                    self.stats.failure(error.code)
                    request.fail(error, claimed=True)

    def _abandon(self, inst: Instance, reason: str) -> None:
        inst.abandoned = True
        inst.reason, inst.state = reason, ModelState.FAILED
        log.error("model %s instance %d: %s", self.name, inst.index, reason)
        self.instance_changed()  # before anyone hears of it, so health already says degraded
        kill = getattr(inst.backend, "kill", None)
        what = "its worker process was killed" if kill is not None else "its thread was abandoned"
        error = RequestTimeoutError(
            f"model {self.name!r} instance {inst.index}: {reason}; {what} and the instance is being replaced"
        )
        for request in list(inst.current):
            if request.claim():
                self.stats.failure(error.code)
                request.fail(error, claimed=True)
        if kill is not None:  # a worker process can be killed; a thread can only be left behind
            kill()

    def _schedule_restart(self, slot: int, inst: Instance, now: float) -> None:
        due = self._restart_at.get(slot)
        if due is None:
            failures = self._failures.get(slot, 0)
            low, high = self.RESTART_BACKOFF
            delay = 0.0 if failures == 0 else min(high, low * 2 ** (failures - 1))
            self._restart_at[slot] = now + delay
            if delay:
                log.warning("model %s instance %d: restarting in %.0fs", self.name, inst.index, delay)
            return
        if now < due:
            return
        del self._restart_at[slot]
        self._failures[slot] = self._failures.get(slot, 0) + 1
        replacement = Instance(self, inst.index, inst.device, inst.generation + 1)
        self.instances[slot] = replacement
        self.stats.restart()
        log.info("model %s instance %d: starting replacement #%d", self.name, inst.index, replacement.generation)
        replacement.start()
        self.instance_changed()

    def instance_ready(self, inst: Instance) -> None:
        self._failures.pop(inst.index, None)

    def submit(self, request: PendingRequest) -> None:
        """Queue a request, or answer it here when it can run inline (`_run_inline`); raise when
        it cannot be taken (not ready, overloaded, unavailable)."""
        if self._inline_policy and self._run_inline(request):
            return
        if not self.ready:
            detail = f": {self.reason}" if self.reason else ""
            if self._ever_ready and self.state == ModelState.DEGRADED:
                # Was serving; every instance is down or unhealthy and being replaced: retry soon.
                raise UnavailableError(
                    f"model {self.name!r} has no instance able to serve right now{detail}; retry shortly"
                )
            raise ModelNotReadyError(f"model {self.name!r} is {self.state}{detail}")
        if request.deadline is None and self.manifest.scheduling.timeout_ms:
            request.deadline = request.received + self.manifest.scheduling.timeout_ms / 1000
        self.stats.request()
        request._on_claim.append(self._answered)
        try:
            self.queue.put(request)
        except OutriderError as exc:
            self.stats.failure(exc.code)
            raise

    def _run_inline(self, request: PendingRequest) -> bool:
        """Run a request on the calling (I/O) thread when a serving instance's backend says that is
        cheap (`Backend.runs_inline`), the default one-request policy applies (`_inline_policy`)
        and nothing waits ahead of it; False when it must be queued. Answers the request itself, success or failure.

        The reply is sent first and counted after: the echo round trip is mostly this path, and
        the caller (the I/O loop, or a front's event loop) reads no other request in between, so
        a client's next request (a health check) still sees the counts.
        """
        if self.queue or request.kind != "infer":
            return False
        for instance in self.instances:
            if instance.serving and getattr(instance.backend, "runs_inline", False):
                break
        else:
            return False
        start = time.monotonic()
        try:
            request.decode()
            result: Any = instance.backend.execute(request.inputs)
        except OutriderError as exc:
            result = exc
        except Exception as exc:
            log.exception("model %s: inline execute failed", self.name)
            result = ExecutionError(f"model {self.name!r}: {type(exc).__name__}: {exc}")
        computed = time.monotonic()
        if not request.claim():  # never queued, so nobody else answers it; but never answer twice
            return True
        failed = isinstance(result, OutriderError)
        if failed:
            request.fail(result, claimed=True)
        else:
            request.reply(result, claimed=True)
        stats = self.stats
        stats.request()
        stats.batch(1, (start - request.received,), computed - start)
        if failed:
            stats.failure(result.code)
        else:
            stats.success(rows=request.rows)
        stats.observe("request_seconds", computed - request.received)
        return True

    def answer(self, request: PendingRequest, result: Any) -> None:
        """Send `result` (outputs, or an OutriderError) as the request's final reply, counted first
        so a client that asks for health next sees it; nothing if it was answered meanwhile
        (cancelled, timed out, abandoned)."""
        if not request.claim():
            return
        if isinstance(result, OutriderError):
            self.stats.failure(result.code)
            request.fail(result, claimed=True)
        else:
            self.stats.success(rows=request.rows)
            request.reply(result, claimed=True)

    def _answered(self, request: PendingRequest) -> None:
        self.stats.observe("request_seconds", time.monotonic() - request.received)

    def queue_depth(self) -> int:
        return len(self.queue)

    def running(self) -> int:
        """Requests being executed now: generations holding a slot, or the batches instances run."""
        if self.generates:
            return self.stats.running
        return sum(len(i.current) for i in self.instances)

    def health(self) -> dict[str, Any]:
        instances = []
        for inst in self.instances:
            entry: dict[str, Any] = {"index": inst.index, "device": inst.device, "state": inst.state,
                                     "generation": inst.generation, "serving": inst.serving}
            if inst.reason or inst.health_reason:
                entry["reason"] = inst.reason or inst.health_reason
            if inst.backend is not None and inst.state == ModelState.READY:
                try:
                    entry["backend"] = inst.backend.health()
                except Exception as exc:
                    entry["backend"] = {"healthy": False, "error": repr(exc)}
                if getattr(inst.backend, "artifact_reports", None):
                    entry["artifacts"] = inst.backend.artifact_reports
            instances.append(entry)
        # From the same snapshot as the entries: ready exactly when one of them says serving.
        ready = any(e["serving"] for e in instances)
        out = {
            "state": self.state,
            "ready": ready,
            "backend": self.choice.backend.name,
            "device": self.choice.device,
            "device_reason": self.choice.device_reason,
            "queue_depth": self.queue_depth(),
            "instances": instances,
            "stats": self.stats.snapshot(),
        }
        # `ready` is read live from the instances, the state a moment later (instance_changed):
        # a model seen not ready always says why.
        reason = self.reason or ("" if ready else "; ".join(
            f"instance {e['index']}: {e['reason']}" for e in instances if e.get("reason")))
        if reason:
            out["reason"] = reason
        if self.choice.skipped:
            out["skipped_backends"] = self.choice.skipped
        return out

    def describe(self) -> dict[str, Any]:
        """Metadata for `models` replies: readiness and the tensor contract."""
        m = self.manifest
        meta: dict[str, Any] = {}
        for inst in self.instances:
            if inst.backend is not None and inst.state == ModelState.READY:
                meta = inst.backend.metadata()
                break
        return {
            "name": self.name,
            "ready": self.ready,
            "state": self.state,
            "backend": self.choice.backend.name,
            "device": self.choice.device,
            "instances": m.instances,
            "inputs": [t.model_dump() for t in m.inputs],
            "outputs": [t.model_dump() for t in m.outputs],
            "batching": m.batching.model_dump() if m.batching else None,
            "generate": self.generates,
            **({"metadata": meta} if meta else {}),
        }

    def stop(self) -> list[PendingRequest]:
        """Stop the instances after their current batch; return what was still queued."""
        self._stopped = True
        left = self.queue.close()
        for inst in self.instances:
            inst.stop()
        return left

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for inst in self.instances:
            if not inst.abandoned:
                inst.join(max(0.0, end - time.monotonic()))
        self.state = ModelState.STOPPED


def cancel_error(request: PendingRequest) -> CancelledError:
    return CancelledError(f"request {request.id!r} was cancelled by the client")
