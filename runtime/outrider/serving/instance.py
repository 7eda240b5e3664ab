"""One instance of a served model: a thread that owns one backend, loads and warms it up, then
takes work from the model's queue through the model's scheduler until stopped.

The instance answers every request of a batch it runs exactly once, whatever fails (the backend,
a scheduler bug, a crashed worker process); the supervisor watches it from outside
(supervisor.py). It knows its model only through `InstanceOwner`.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Protocol

from .. import timeline
from ..backend import Backend
from ..devices import inventory, is_out_of_memory, out_of_memory_reason
from ..errors import ExecutionError, InstanceCrashed, InternalError, OutriderError, UnavailableError
from ..stats import ModelStats
from .queue import RequestQueue
from .request import DEFERRED, ModelState, PendingRequest
from .scheduler import Scheduler

log = logging.getLogger("outrider.model")


class InstanceOwner(Protocol):
    """What an instance needs of the model it serves (ServedModel)."""

    name: str
    stats: ModelStats
    queue: RequestQueue
    scheduler: Scheduler

    def make_backend(self, device: str, index: int = 0) -> Backend: ...

    def instance_ready(self, instance: "Instance") -> None: ...

    def instance_changed(self) -> None: ...

    def answer(self, request: PendingRequest, result: Any) -> None: ...


class Instance(threading.Thread):
    """One backend instance: load, warm up, then pull and execute until stopped.

    With `scheduling.instance_kind: process` the backend runs in a worker process behind a
    `WorkerBackend` proxy: a crash or hang there cannot take the server down.
    """

    #: seconds between two checks of the backend's own health() (a worker: a round trip to it)
    HEALTH_INTERVAL_S = 1.0

    def __init__(self, model: InstanceOwner, index: int, device: str, generation: int = 0) -> None:
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
        try:
            report = backend.heartbeat()
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
        return self.backend.exited() if self.backend is not None else None

    def run(self) -> None:
        model = self.model
        try:
            backend = model.make_backend(self.device, self.index)
            self.backend = backend  # visible early so the supervisor can kill a worker process
            t0 = time.perf_counter()
            backend.prepare_artifact()  # the manifest's artifact transforms (export, quantize, ...)
            timeline.mark(f"{model.name}: artifact ready")
            backend.load()
            t1 = time.perf_counter()
            timeline.mark(f"{model.name}: loaded")
            backend.warmup()
            t2 = time.perf_counter()
            timeline.mark(f"{model.name}: warmed up")
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
                    batch = model.scheduler.next_batch(model.queue, self.idle, self.backend)
                    if batch:
                        self.execute(batch)
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

    @contextmanager
    def working_on(self, requests: list[PendingRequest]) -> Iterator[None]:
        """Mark `requests` as what this instance runs now: what the supervisor answers if the
        instance hangs (past execute_timeout_ms) or its worker dies meanwhile."""
        self.current, self.busy_since = requests, time.monotonic()
        try:
            yield
        finally:
            self.busy_since, self.current = None, []

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
                request.answer(exc, self.model.stats)
                continue
            live.append(request)
        return live

    def execute(self, batch: list[PendingRequest]) -> None:
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
                    request.answer(error, self.model.stats)
            raise

    def _run_batch(self, batch: list[PendingRequest]) -> None:
        model = self.model
        gone = self._gone()
        if gone is not None:
            if model.scheduler.stateful:  # held by this instance's engine: nobody else can serve them
                error = UnavailableError(f"model {model.name!r} instance {self.index}: {gone}")
                for request in batch:
                    request.answer(error, model.stats)
                raise InstanceCrashed(str(error), reason=gone)
            # Taken from the queue after the worker died but before anyone noticed: nothing was
            # sent, so the requests go back in front for another instance or the replacement.
            for request in model.queue.put_back(batch):
                request.answer(UnavailableError(f"model {model.name!r} instance {self.index}: {gone}"))
            raise InstanceCrashed(f"model {model.name!r} instance {self.index}: {gone}", delivered=False, reason=gone)
        batch = self._decode(batch)
        if not batch:
            return
        start = time.monotonic()
        crashed: Optional[InstanceCrashed] = None
        try:
            with self.working_on(batch):
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
        compute = time.monotonic() - start
        if len(results) != len(batch):  # a scheduler bug: _execute answers the batch `internal`
            raise RuntimeError(f"the scheduler returned {len(results)} results for {len(batch)} requests")
        if crashed is not None:  # health says so before the clients hear of it
            self._fail(crashed.reason)
        if batch and not model.scheduler.stateful:  # an engine step is not a batch of answers
            model.stats.batch(len(batch), (start - r.received for r in batch), compute)
        for request, result in zip(batch, results):
            if result is DEFERRED:
                continue  # a stateful scheduler (generation) answers this request in a later step
            model.answer(request, result)
        if crashed is not None:
            raise crashed
