"""A load under way before its model exists (`PendingLoad`): requests to it wait, then move to the
model's queue once it is built, or are answered with the load's error."""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from ..errors import ModelNotReadyError, OutriderError
from .entries import ModelEntry
from .served_model import ServedModel

log = logging.getLogger("outrider.repository")


class PendingLoad:
    """A load whose model is not built yet (room is being made, the backend chosen and checked):
    requests to it wait here and move to the model's queue once it exists; if the load fails
    they are answered with its error. `submit` never blocks (called on I/O threads)."""

    def __init__(self, repository: Any, entry: ModelEntry, on_demand: bool) -> None:
        # repository: the ModelRepository that finishes the load (`_finish_load`)
        self.repository, self.entry, self.on_demand = repository, entry, on_demand
        manifest = entry.manifest
        assert manifest is not None
        self.name, self.manifest = entry.name, manifest
        #: the version the load will serve (a ServedModel's `version`): fronts ask either the same
        self.version = entry.version + 1
        # Known before the build from the backend classes named (None: the candidates differ).
        backends = repository.registry.backends
        kinds = {backends[n].generates if n in backends else None for n in manifest.backend_preferences}
        self.generates: Optional[bool] = kinds.pop() if len(kinds) == 1 else None
        self.served: Optional[ServedModel] = None
        self.error: Optional[OutriderError] = None
        self._waiting: list[Any] = []
        self._closed = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._limit = manifest.scheduling.max_queue_size

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"outrider-load-{self.name}", daemon=True).start()

    def make_task(self) -> Any:
        """The manifest's task (fronts tokenize with it before the model exists), as ServedModel's."""
        return self.repository.registry.make_task(self.manifest)

    def submit(self, request: Any) -> None:
        with self._lock:
            if not self._closed:
                if len(self._waiting) >= self._limit:
                    from ..errors import OverloadedError

                    raise OverloadedError(f"model {self.name!r} is loading and {len(self._waiting)} requests wait "
                                          f"for it (scheduling.max_queue_size)")
                self._waiting.append(request)
                return
        self._hand_over(request)

    def _hand_over(self, request: Any) -> None:
        if request.done:
            return
        if self.error is not None:
            request.answer(self.error)
            return
        served = self.served
        assert served is not None
        if (request.kind == "generate") != served.generates:
            from ..errors import BadRequestError

            request.answer(BadRequestError(f"model {self.name!r} " + (
                "generates text; send generate" if served.generates else "does not generate text; use infer")))
            return
        if request.deadline is None and served.manifest.scheduling.timeout_ms:
            request.deadline = request.received + served.manifest.scheduling.timeout_ms / 1000
        try:
            served.submit(request)
        except OutriderError as exc:
            request.answer(exc)

    def wait(self, timeout: float) -> ServedModel:
        if not self._done.wait(timeout):
            raise ModelNotReadyError(f"model {self.name!r} is still loading after {timeout:g}s")
        if self.error is not None:
            raise self.error
        assert self.served is not None
        return self.served

    def _run(self) -> None:
        try:
            self.served = self.repository._finish_load(self)
        except OutriderError as exc:
            self.error = exc
            self.entry.reason = f"load failed: {exc.message}"
            log.error("model %s: load failed: %s", self.name, exc.message)
        except Exception as exc:  # a bug must not leave its requests waiting for ever
            log.exception("model %s: load failed", self.name)
            from ..errors import InternalError

            self.error = InternalError(f"loading model {self.name!r}: {type(exc).__name__}: {exc}")
            self.entry.reason = f"load failed: {self.error.message}"
        finally:
            with self.entry.lock:
                if self.entry.loader is self:
                    self.entry.loader = None
            with self._lock:
                self._closed = True
                waiting, self._waiting = self._waiting, []
            for request in waiting:
                self._hand_over(request)
            self._done.set()
