"""A served model: its manifest, queue, instances, state and stats, and the way in for requests.

`submit` queues a request (or runs it inline on the caller's thread when that is cheaper than a
thread hop, see `_run_inline`); instances (serving/instance.py) take it from the queue through
the model's scheduler; the supervisor (serving/supervisor.py) replaces instances that die or hang.
The model is ready while one instance is warmed up and healthy by its backend's own account.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from ..accelerators import AcceleratorSet
from ..backend import Backend, BackendChoice
from ..devices import Inventory, inventory, place
from ..errors import ExecutionError, ModelNotReadyError, OutriderError, UnavailableError
from ..manifest import DEFAULT_PROCESS_EXECUTE_TIMEOUT_MS, Manifest
from ..stats import ModelStats
from .instance import Instance
from .queue import RequestQueue
from .request import ModelState, PendingRequest
from .scheduler import Scheduler
from .supervisor import Supervisor

log = logging.getLogger("outrider.model")


class ServedModel:
    """Everything the server knows about one manifest's model, and the supervision of its instances."""

    def __init__(
        self,
        manifest: Manifest,
        choice: BackendChoice,
        make_task: Callable[[], Any],
        scheduler: Optional[Scheduler] = None,
        on_state: Optional[Callable[[str, str, str], None]] = None,
        accelerators: Optional[AcceleratorSet] = None,
        backend_factory: Optional[Callable[[str, int], Backend]] = None,
        stats: Optional[ModelStats] = None,
    ) -> None:
        self.manifest = manifest
        self.accelerators = accelerators if accelerators is not None else AcceleratorSet()
        self.name = manifest.name
        self.choice = choice
        #: the backend keeps sequences and answers `generate`, never `infer`
        self.generates = choice.backend.generates
        self.make_task = make_task
        self.scheduler = scheduler or Scheduler(manifest)
        # Requests may run on the caller's thread (`_run_inline`) only under the default policy
        # and in-process instances; whether an instance's backend allows it is asked per request.
        self._inline_policy = type(self.scheduler) is Scheduler and manifest.scheduling.instance_kind == "thread"
        self.queue = RequestQueue(manifest.scheduling.max_queue_size, manifest.scheduling.max_queue_bytes)
        # Shared by the versions of one name (a reload), so its counters carry on.
        self.stats = stats if stats is not None else ModelStats()
        self.instances: list[Instance] = []
        #: the repository's version number of this load (1, 2, ... per reload)
        self.version = 1
        #: the server's readiness waits for this model (loaded at start); a model loaded later,
        #: on demand or by model control, never makes a serving server unready
        self.required = True
        #: requests wait in the queue while the model loads (load on demand) instead of being
        #: answered model_not_ready
        self.accept_while_loading = False
        #: requests taken and not yet answered: what an unload or a reload drains
        self.outstanding: set[PendingRequest] = set()
        #: time.monotonic() of the last request (idle unload, least-recently-used eviction)
        self.last_used = time.monotonic()
        self.state = ModelState.LOADING
        self.reason = ""
        self._backend_factory = backend_factory
        self._on_state = on_state
        self._lock = threading.Lock()
        self.stopped = False
        self._ever_ready = False
        self._last_reason = ""
        self.supervisor = Supervisor(self)

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
        """A backend for instance `index`: the one the assembly gave (`backend_factory`: a proxy to a
        worker process for `instance_kind: process`), else the chosen backend in this process."""
        if self._backend_factory is not None:
            return self._backend_factory(device, index)
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
            if self.stopped:
                state, reason = ModelState.STOPPED, ""
            elif ready == self.manifest.instances:
                state, reason = ModelState.READY, ""
            elif self._ever_ready:
                # Was serving: some instance failed and is being replaced (ready iff one still is).
                state, reason = ModelState.DEGRADED, reasons or self._last_reason
            elif ModelState.FAILED in states or self.supervisor.failures:
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
                request.answer(ModelNotReadyError(f"model {self.name!r} failed: {reason}"))

    def supervise(self, now: float) -> None:
        """Detect hung and dead instances, answer their requests, and replace them (serving/supervisor.py)."""
        self.supervisor.check(now)

    def instance_ready(self, inst: Instance) -> None:
        self.supervisor.instance_ready(inst)

    def submit(self, request: PendingRequest) -> None:
        """Queue a request, or answer it here when it can run inline (`_run_inline`); raise when
        it cannot be taken (not ready, overloaded, unavailable)."""
        self.last_used = time.monotonic()
        if self._inline_policy and self._run_inline(request):
            return
        waits = self.accept_while_loading and self.state == ModelState.LOADING and not self.stopped
        if not self.ready and not waits:
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
        self.outstanding.add(request)
        try:
            self.queue.put(request)
        except OutriderError as exc:
            self.outstanding.discard(request)
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
            if instance.serving and instance.backend.runs_inline:
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
        stats = self.stats
        if not request.answer(result, stats):  # never queued, so nobody else answers it; but never answer twice
            return True
        stats.request()
        stats.batch(1, (start - request.received,), computed - start)
        stats.observe("request_seconds", computed - request.received)
        return True

    def answer(self, request: PendingRequest, result: Any) -> None:
        """Send `result` (outputs, or an OutriderError) as the request's final reply, counted first
        so a client that asks for health next sees it; nothing if it was answered meanwhile
        (cancelled, timed out, abandoned)."""
        request.answer(result, self.stats)

    def _answered(self, request: PendingRequest) -> None:
        self.outstanding.discard(request)
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
            if inst.final:  # failed for good (deterministically): the supervisor will not restart it
                entry["final"] = True
            if inst.backend is not None and inst.state == ModelState.READY:
                try:
                    entry["backend"] = inst.backend.health()
                except Exception as exc:
                    entry["backend"] = {"healthy": False, "error": repr(exc)}
                if inst.backend.artifact_reports:
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

    def text_tokenizer(self) -> tuple[Any, int]:
        """(tokenizer, context length) of a generating model's serving instance: what fronts tokenize
        with (outrider.generation.contract.Tokenizer), without reaching into a backend themselves.
        ModelNotReadyError when no instance serves; BadRequestError for a model that does not generate."""
        from ..errors import BadRequestError, ModelNotReadyError

        if not self.generates:
            raise BadRequestError(f"model {self.name!r} does not generate text: it has no text tokenizer")
        for inst in self.instances:
            backend = inst.backend
            if inst.serving and backend is not None and backend.tokenizer is not None and backend.engine is not None:
                return backend.tokenizer, int(backend.engine.max_length)
        raise ModelNotReadyError(f"model {self.name!r} has no instance serving now")

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
            "accelerators": {section: {"name": spec.name, "role": spec.role}
                             for section, spec in self.accelerators.specs.items()},
            # The batch policy's settings, under the name the `models` reply has given them (PROTOCOL.md).
            "batching": next((_settings(self.accelerators.configs[section])
                              for section in self.accelerators.sections_for("batch_policy")), None),
            "generate": self.generates,
            **({"metadata": meta} if meta else {}),
        }

    def stop(self) -> list[PendingRequest]:
        """Stop the instances after their current batch; return what was still queued."""
        self.stopped = True
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


def _settings(config: Any) -> Optional[dict[str, Any]]:
    """A validated section as plain data (a pydantic model, or the mapping as written)."""
    if config is None:
        return None
    return config.model_dump() if hasattr(config, "model_dump") else dict(config)
