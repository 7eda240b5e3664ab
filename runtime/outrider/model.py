"""A served model: its request queue, its instances, its state and its stats.

Instances are threads that each own one backend instance and pull work from the model's
queue when free (nobody pushes onto a busy instance). ORT and PyTorch release the GIL
while they compute, so threads overlap compute with the I/O loop.
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
from .errors import (
    CancelledError,
    ExecutionError,
    ModelNotReadyError,
    OutriderError,
    OverloadedError,
    RequestTimeoutError,
    UnavailableError,
)
from .manifest import Manifest
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
    """One request waiting for its single final reply. Replies after the first are dropped."""

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
    _done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def done(self) -> bool:
        return self._done

    def _finish(self) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done = True
        if self.on_done is not None:
            self.on_done(self)
        return True

    def reply(self, outputs: Optional[dict[str, np.ndarray]] = None, **fields: Any) -> bool:
        """Send the final successful reply; False if the request was already answered."""
        if not self._finish():
            return False
        self.send(self, "reply", {"id": self.id, "ok": True, **fields}, outputs)
        return True

    def fail(self, error: OutriderError) -> bool:
        """Send the final error reply; False if the request was already answered."""
        if not self._finish():
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
    """Bounded FIFO per model: full means 'overloaded' now, not unbounded memory later."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._items: deque[PendingRequest] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, request: PendingRequest) -> None:
        with self._cond:
            if self._closed:
                raise UnavailableError("model is shutting down")
            if len(self._items) >= self.max_size:
                raise OverloadedError(
                    f"model {request.model!r}: queue is full ({self.max_size} waiting); retry later"
                )
            self._items.append(request)
            self._cond.notify()

    def take(self, timeout: float) -> Optional[PendingRequest]:
        """The oldest live request, waiting up to `timeout` s; None on timeout or close."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                while self._items:
                    request = self._items.popleft()
                    if not request.done:  # cancelled or timed out while queued
                        return request
                if self._closed:
                    return None
                left = end - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    if not self._items:
                        return None

    def take_more(self, limit: int) -> list[PendingRequest]:
        """Up to `limit` more live requests without waiting (for batchers)."""
        out: list[PendingRequest] = []
        with self._cond:
            while self._items and len(out) < limit:
                request = self._items.popleft()
                if not request.done:
                    out.append(request)
        return out

    def wait_for_items(self, timeout: float) -> bool:
        with self._cond:
            if self._items or self._closed:
                return bool(self._items)
            self._cond.wait(timeout)
            return bool(self._items)

    def expire(self, now: float) -> int:
        """Answer queued requests whose deadline passed; returns how many."""
        expired = []
        with self._cond:
            if not any(r.deadline is not None and r.deadline <= now for r in self._items):
                return 0
            keep: deque[PendingRequest] = deque()
            for r in self._items:
                (expired if r.deadline is not None and r.deadline <= now else keep).append(r)
            self._items = keep
        for r in expired:
            r.fail(RequestTimeoutError(f"request {r.id!r} timed out after waiting in the queue of model {r.model!r}"))
        return len(expired)

    def close(self) -> list[PendingRequest]:
        """Stop taking work; return what was still queued so the caller can answer it."""
        with self._cond:
            self._closed = True
            items = [r for r in self._items if not r.done]
            self._items.clear()
            self._cond.notify_all()
        return items


class Instance(threading.Thread):
    """One backend instance: load, warm up, then pull and execute until stopped."""

    def __init__(self, model: "ServedModel", index: int, device: str) -> None:
        super().__init__(name=f"outrider-{model.name}-{index}", daemon=True)
        self.model = model
        self.index = index
        self.device = device
        self.backend: Optional[Backend] = None
        self.state = ModelState.LOADING
        self.reason = ""
        self.busy_since: Optional[float] = None
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        model = self.model
        try:
            task = model.make_task()
            backend = model.choice.backend(model.manifest, self.device, task)
            t0 = time.perf_counter()
            backend.load()
            t1 = time.perf_counter()
            backend.warmup()
            t2 = time.perf_counter()
        except Exception as exc:
            self.state, self.reason = ModelState.FAILED, f"{type(exc).__name__}: {exc}"
            log.error("model %s instance %d failed to load or warm up: %s", model.name, self.index, self.reason)
            model.instance_changed()
            return
        self.backend = backend
        model.stats.load_seconds = max(model.stats.load_seconds, t1 - t0)
        model.stats.warmup_seconds = max(model.stats.warmup_seconds, t2 - t1)
        log.info("model %s instance %d on %s: loaded in %.2fs, warmed up in %.2fs",
                 model.name, self.index, self.device, t1 - t0, t2 - t1)
        self.state = ModelState.READY
        model.instance_changed()
        try:
            while not self._stopping.is_set():
                batch = model.scheduler.next_batch(model.queue)
                if batch:
                    self._execute(batch)
        finally:
            try:
                backend.unload()
            except Exception:
                log.exception("model %s instance %d: unload failed", model.name, self.index)
            self.state = ModelState.STOPPED

    def _execute(self, batch: list[PendingRequest]) -> None:
        model = self.model
        start = time.monotonic()
        self.busy_since = start
        try:
            results = model.scheduler.execute(self.backend, batch)
        except OutriderError as exc:
            results = [exc] * len(batch)
        except Exception as exc:  # one failing batch must not take the instance down
            log.exception("model %s: execute failed", model.name)
            results = [ExecutionError(f"model {model.name!r}: {type(exc).__name__}: {exc}")] * len(batch)
        finally:
            self.busy_since = None
        compute = time.monotonic() - start
        model.stats.batch(len(batch), (start - r.received for r in batch), compute)
        for request, result in zip(batch, results):
            if isinstance(result, OutriderError):
                if request.fail(result):
                    model.stats.failure(result.code)
            elif request.reply(result):
                model.stats.success()


class Scheduler:
    """Default policy: one request per execute. The batching accelerator replaces it."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest

    def next_batch(self, queue: RequestQueue) -> list[PendingRequest]:
        request = queue.take(timeout=0.25)
        return [request] if request is not None else []

    def execute(self, backend: Backend, batch: list[PendingRequest]) -> list[Any]:
        """Outputs (or an OutriderError) per request, in order."""
        return [backend.execute(batch[0].inputs)]


class ServedModel:
    """Everything the server knows about one manifest's model."""

    def __init__(
        self,
        manifest: Manifest,
        choice: BackendChoice,
        make_task: Callable[[], Any],
        scheduler: Optional[Scheduler] = None,
        on_state: Optional[Callable[[str, str, str], None]] = None,
    ) -> None:
        self.manifest = manifest
        self.name = manifest.name
        self.choice = choice
        self.make_task = make_task
        self.scheduler = scheduler or Scheduler(manifest)
        self.queue = RequestQueue(manifest.scheduling.max_queue_size)
        self.stats = ModelStats()
        self.instances: list[Instance] = []
        self.state = ModelState.LOADING
        self.reason = ""
        self._on_state = on_state
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self.state in (ModelState.READY, ModelState.DEGRADED)

    def devices(self) -> list[str]:
        """Spread instances over GPUs when the device is 'cuda' and several exist."""
        device = self.choice.device
        if device != "cuda":
            return [device] * self.manifest.instances
        count = _cuda_device_count()
        return [f"cuda:{i % max(count, 1)}" for i in range(self.manifest.instances)]

    def start(self) -> None:
        for index, device in enumerate(self.devices()):
            instance = Instance(self, index, device)
            self.instances.append(instance)
            instance.start()

    def instance_changed(self) -> None:
        """Recompute the model state from its instances."""
        with self._lock:
            states = [i.state for i in self.instances]
            ready = states.count(ModelState.READY)
            if ready == len(states) and ready:
                state, reason = ModelState.READY, ""
            elif ready:
                state = ModelState.DEGRADED
                reason = "; ".join(i.reason for i in self.instances if i.reason)
            elif ModelState.LOADING in states:
                state, reason = ModelState.LOADING, ""
            else:
                state = ModelState.FAILED
                reason = "; ".join(i.reason for i in self.instances if i.reason) or "no instance running"
            changed = (state, reason) != (self.state, self.reason)
            self.state, self.reason = state, reason
        if changed:
            log.info("model %s: %s%s", self.name, state, f" ({reason})" if reason else "")
            if self._on_state:
                self._on_state(self.name, state, reason)
        if state == ModelState.FAILED:
            for request in self.queue.close():
                request.fail(ModelNotReadyError(f"model {self.name!r} failed: {reason}"))

    def submit(self, request: PendingRequest) -> None:
        """Queue a request or raise (not ready, overloaded)."""
        if not self.ready:
            detail = f": {self.reason}" if self.reason else ""
            raise ModelNotReadyError(f"model {self.name!r} is {self.state}{detail}")
        if request.deadline is None and self.manifest.scheduling.timeout_ms:
            request.deadline = request.received + self.manifest.scheduling.timeout_ms / 1000
        self.stats.request()
        try:
            self.queue.put(request)
        except OutriderError as exc:
            self.stats.failure(exc.code)
            raise

    def queue_depth(self) -> int:
        return len(self.queue)

    def health(self) -> dict[str, Any]:
        instances = []
        for inst in self.instances:
            entry: dict[str, Any] = {"index": inst.index, "device": inst.device, "state": inst.state}
            if inst.reason:
                entry["reason"] = inst.reason
            if inst.backend is not None:
                try:
                    entry["backend"] = inst.backend.health()
                except Exception as exc:
                    entry["backend"] = {"healthy": False, "error": repr(exc)}
            instances.append(entry)
        out = {
            "state": self.state,
            "ready": self.ready,
            "backend": self.choice.backend.name,
            "device": self.choice.device,
            "queue_depth": self.queue_depth(),
            "instances": instances,
            "stats": self.stats.snapshot(),
        }
        if self.reason:
            out["reason"] = self.reason
        if self.choice.skipped:
            out["skipped_backends"] = self.choice.skipped
        return out

    def describe(self) -> dict[str, Any]:
        """Metadata for `models` replies: readiness and the tensor contract."""
        m = self.manifest
        meta: dict[str, Any] = {}
        for inst in self.instances:
            if inst.backend is not None:
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
            "generate": bool(getattr(self.choice.backend, "generates", False)),
            **({"metadata": meta} if meta else {}),
        }

    def stop(self) -> list[PendingRequest]:
        """Stop the instances after their current batch; return what was still queued."""
        left = self.queue.close()
        for inst in self.instances:
            inst.stop()
        return left

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for inst in self.instances:
            inst.join(max(0.0, end - time.monotonic()))
        self.state = ModelState.STOPPED


def cancel_error(request: PendingRequest) -> CancelledError:
    return CancelledError(f"request {request.id!r} was cancelled by the client")


def _cuda_device_count() -> int:
    import sys

    torch = sys.modules.get("torch")  # the core never imports torch itself
    if torch is not None:
        try:
            return int(torch.cuda.device_count())
        except Exception:
            return 1
    return 1
