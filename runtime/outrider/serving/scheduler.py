"""How an instance's work is chosen: a policy hands the instance its next batch, the instance
runs it and answers every request of it (serving/instance.py).

`Scheduler` is the default policy, one request per execute. The dynamic batcher (a
`batch_policy` accelerator) subclasses it; a generating backend brings its own
(`GeneratingBackend.make_scheduler`), which overrides `serve` to drive a stateful engine step by
step. A policy sees its instance only through `InstanceHandle`.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Protocol

from ..backend import Backend
from ..manifest import Manifest
from .queue import RequestQueue
from .request import PendingRequest


class InstanceHandle(Protocol):
    """What a scheduler may use of the instance it serves (serving.instance.Instance)."""

    backend: Optional[Backend]

    def idle(self) -> None:
        """Nothing to do for a moment: the backend may hand back what it holds (Backend.idle)."""

    def execute(self, batch: list[PendingRequest]) -> None:
        """Run `batch` through this policy's `execute` on the instance's backend and answer each request once."""

    def working_on(self, requests: list[PendingRequest]) -> ContextManager[None]:
        """While inside: `requests` are what the instance runs (answered by the supervisor if it hangs or dies)."""


class Scheduler:
    """Default policy: one request per execute. The batching accelerator replaces it."""

    #: the most rows one execute carries (None: what one request brings); an engine that is
    #: built for a batch size (TensorRT profiles) sizes itself by it
    max_batch_size: Optional[int] = None
    #: the batch sizes the policy aims for (it dispatches when a batch reaches one)
    preferred_batch_sizes: frozenset[int] = frozenset()

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest

    def serve(self, instance: InstanceHandle, queue: RequestQueue) -> None:
        """One turn of an instance's loop: wait for work, have the instance execute it. Stateful
        engines override this."""
        batch = self.next_batch(queue, idle=instance.idle)
        if batch:
            instance.execute(batch)

    def next_batch(self, queue: RequestQueue, idle: Optional[Callable[[], None]] = None) -> list[PendingRequest]:
        request = queue.take(timeout=0.25, idle=idle)
        return [request] if request is not None else []

    def execute(self, backend: Backend, batch: list[PendingRequest]) -> list[Any]:
        """Outputs (or an OutriderError) per request, in order."""
        return [backend.execute(batch[0].inputs)]
