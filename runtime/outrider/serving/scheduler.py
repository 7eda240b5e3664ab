"""How an instance's work is chosen, as data: a policy's `next_batch` says which requests an
instance runs next (the plan), its `execute` how they go through the backend (cut, padded, joined);
the instance takes the plan, runs it, answers every request of it and counts (serving/instance.py).
A policy never calls back into the instance.

`Scheduler` is the default policy, one request per execute. The dynamic batcher (a
`batch_policy` accelerator) subclasses it; a generating backend brings its own
(`GeneratingBackend.make_scheduler`), a `stateful` one whose plan is the requests of one engine
step (answered by the engine, in that step or a later one).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

from ..backend import Backend
from ..manifest import Manifest
from .queue import RequestQueue
from .request import PendingRequest


class Scheduler:
    """Default policy: one request per execute. The batching accelerator replaces it."""

    #: the most rows one execute carries (None: what one request brings); an engine that is
    #: built for a batch size (TensorRT profiles) sizes itself by it
    max_batch_size: Optional[int] = None
    #: the batch sizes the policy aims for (it dispatches when a batch reaches one)
    preferred_batch_sizes: frozenset[int] = frozenset()
    #: True for a policy whose requests live in a stateful engine across turns (generation): its
    #: `execute` returns DEFERRED for each (the engine answers them), the instance never puts them
    #: back in the queue, and a turn is not counted as a batch
    stateful: ClassVar[bool] = False

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest

    def next_batch(self, queue: RequestQueue, idle: Optional[Callable[[], None]] = None,
                   backend: Optional[Backend] = None) -> list[PendingRequest]:
        """What the instance runs next (empty: nothing came within a short wait). `idle` is called
        while waiting; `backend` is the instance's (a stateful policy plans with its engine)."""
        request = queue.take(timeout=0.25, idle=idle)
        return [request] if request is not None else []

    def execute(self, backend: Backend, batch: list[PendingRequest]) -> list[Any]:
        """Outputs (or an OutriderError) per request, in order."""
        return [backend.execute(batch[0].inputs)]
