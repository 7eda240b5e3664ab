"""Supervision of a served model's instances, from outside them (the server's supervisor thread
calls `check` every 50 ms): a dead worker process, an execute past `execute_timeout_ms` and a dead
instance thread are noticed, what they were running is answered, and the instance is replaced
with back-off. Queued requests that no instance can serve are answered after a while instead of
waiting for ever. A load that failed deterministically (`Instance.final`) is not retried.
"""

from __future__ import annotations

import logging
from typing import Optional, Protocol

from ..errors import ExecutionError, RequestTimeoutError, UnavailableError
from .instance import Instance, InstanceOwner
from .request import ModelState

log = logging.getLogger("outrider.model")


class SupervisedModel(InstanceOwner, Protocol):
    """What the supervisor needs of a model (ServedModel)."""

    instances: list[Instance]
    execute_timeout_ms: Optional[float]
    stopped: bool
    ready: bool
    reason: str


class Supervisor:
    """Crash and hang detection and restart back-off for one model."""

    #: seconds between restarts of an instance slot that keeps failing (doubling, capped).
    RESTART_BACKOFF = (1.0, 60.0)
    #: seconds queued requests wait for an instance while none can serve; then they are answered
    #: `unavailable` (new requests are answered so at once): a replacement that keeps failing to
    #: load must not hold them until their clients give up
    UNSERVED_QUEUE_WAIT_S = 10.0

    def __init__(self, model: SupervisedModel) -> None:
        self.model = model
        #: per instance slot: consecutive failures (non-empty: the model is being restarted)
        self.failures: dict[int, int] = {}
        self._restart_at: dict[int, float] = {}  # per slot: when the next restart may happen
        self._unserved_since: Optional[float] = None

    def check(self, now: float) -> None:
        """Detect hung and dead instances, answer their requests, and replace them (with backoff)."""
        model = self.model
        if model.stopped:
            return
        timeout_ms = model.execute_timeout_ms
        for slot, inst in enumerate(list(model.instances)):
            serving = inst.state == ModelState.READY and not inst.abandoned and inst.backend is not None
            gone = inst.backend.exited() if serving else None
            if gone is not None:  # idle or busy alike: no request needs to arrive for this to be seen
                self._crashed(inst, gone)
            elif timeout_ms and inst.busy_since is not None and now - inst.busy_since > timeout_ms / 1000:
                self._abandon(inst, f"execute exceeded execute_timeout_ms={timeout_ms:g}")
            elif inst.state == ModelState.READY and not inst.is_alive():
                inst.reason, inst.state = "instance thread exited", ModelState.FAILED
                model.instance_changed()
            if inst.final:
                continue  # failed once for a reason a restart repeats; health says which
            if inst.state == ModelState.FAILED or inst.abandoned:
                self._schedule_restart(slot, inst, now)
        self._answer_unserved(now)

    def instance_ready(self, inst: Instance) -> None:
        """`inst` warmed up: its slot's back-off starts over."""
        self.failures.pop(inst.index, None)

    def _crashed(self, inst: Instance, how: str) -> None:
        """A worker process died (the OOM killer, a segfault): say so, answer its batch, replace it."""
        where = f"model {self.model.name!r} instance {inst.index}"
        inst.reason, inst.state = how, ModelState.FAILED  # the reason first: health shows both or neither
        log.error("%s: %s; replacing it", where, how)
        self.model.instance_changed()  # before anyone hears of it, so health already says not ready
        error = ExecutionError(f"{where}: {how} while running this request; the instance is being replaced")
        for request in list(inst.current):
            request.answer(error, self.model.stats)

    def _answer_unserved(self, now: float) -> None:
        """Queued requests do not wait for ever on a model none of whose instances can serve."""
        if self.model.ready or not len(self.model.queue):
            self._unserved_since = None
            return
        if self._unserved_since is None:
            self._unserved_since = now
        elif now - self._unserved_since > self.UNSERVED_QUEUE_WAIT_S:
            detail = f": {self.model.reason}" if self.model.reason else ""
            error = UnavailableError(
                f"model {self.model.name!r} has had no instance able to serve for {self.UNSERVED_QUEUE_WAIT_S:g}s{detail}"
            )
            for request in self.model.queue.take_more(len(self.model.queue)):
                request.answer(error, self.model.stats)

    def _abandon(self, inst: Instance, reason: str) -> None:
        inst.abandoned = True
        inst.reason, inst.state = reason, ModelState.FAILED
        log.error("model %s instance %d: %s", self.model.name, inst.index, reason)
        self.model.instance_changed()  # before anyone hears of it, so health already says degraded
        killable = inst.backend is not None and inst.backend.killable
        what = "its worker process was killed" if killable else "its thread was abandoned"
        error = RequestTimeoutError(
            f"model {self.model.name!r} instance {inst.index}: {reason}; {what} and the instance is being replaced"
        )
        for request in list(inst.current):
            request.answer(error, self.model.stats)
        if killable:  # a worker process can be killed; a thread can only be left behind
            inst.backend.kill()

    def _schedule_restart(self, slot: int, inst: Instance, now: float) -> None:
        due = self._restart_at.get(slot)
        if due is None:
            failures = self.failures.get(slot, 0)
            low, high = self.RESTART_BACKOFF
            delay = 0.0 if failures == 0 else min(high, low * 2 ** (failures - 1))
            self._restart_at[slot] = now + delay
            if delay:
                log.warning("model %s instance %d: restarting in %.0fs", self.model.name, inst.index, delay)
            return
        if now < due:
            return
        del self._restart_at[slot]
        self.failures[slot] = self.failures.get(slot, 0) + 1
        replacement = Instance(self.model, inst.index, inst.device, inst.generation + 1)
        self.model.instances[slot] = replacement
        self.model.stats.restart()
        log.info("model %s instance %d: starting replacement #%d", self.model.name, inst.index, replacement.generation)
        replacement.start()
        self.model.instance_changed()
