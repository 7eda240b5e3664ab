"""Taking a loaded version out of service (`Unloader`): for an unload, a reload's replaced version,
an idle or removed model. What it took is answered first (queued and running requests finish
within the drain timeout, streams are cancelled with a reason when asked; what is left goes to the
version now serving the name, else is answered `unavailable`), then its instances stop and its
memory is handed back."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ..errors import OutriderError, UnavailableError
from ..hardware import release_memory, resident_bytes
from .entries import ModelEntry
from .memory_budget import mib as _mib
from .served_model import ServedModel

log = logging.getLogger("outrider.repository")


class Unloader:
    """Drains and stops the repository's ServedModels; keeps the threads that drain in the
    background, so that shutdown can join them."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.retiring: list[threading.Thread] = []

    def unload(self, entry: ModelEntry, cancel_streams: bool, wait: bool, why: str) -> None:
        """Take `entry`'s versions out of `server.models` and drain them (`retire`), now or, without
        `wait`, on a thread of their own."""
        name = entry.name
        with entry.lock:
            served, pending = entry.served, entry.pending
            if served is None and pending is None:
                return  # not loaded: nothing to do (Triton answers success too)
            entry.unloading = True
            entry.pending = None
            if self.server.models.get(name) is served:
                del self.server.models[name]
            log.info("model %s: unloading version %d (%s)", name, entry.version, why)
        def drain() -> None:
            try:
                if pending is not None:
                    self.stop_quietly(pending)
                if served is not None:
                    self.retire(served, cancel_streams, why)
            finally:
                with entry.lock:
                    if entry.served is served:
                        entry.served = None
                    entry.unloading = False
                release_memory()
                log.info("model %s: unloaded; resident %s", name, _mib(resident_bytes()))

        if wait:
            drain()
        else:
            self.in_background(drain, f"outrider-unload-{name}")

    def in_background(self, target: Callable[..., None], name: str, *args: Any) -> None:
        """Run `target(*args)` on a thread of its own, joined at shutdown (`join`)."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self.retiring.append(thread)
        thread.start()

    def retire(self, served: ServedModel, cancel_streams: bool, why: str) -> None:
        """Answer what `served` took, then stop it: queued and running requests finish (a stream
        is cancelled with the reason when `cancel_streams`), bounded by the drain timeout; what is
        left goes to the version now serving the name, else is answered `unavailable`."""
        name = served.name
        if cancel_streams:
            for request in list(served.outstanding):
                if request.kind == "generate":
                    self.server.cancel(request, f"model {name!r} was {why} (unload with cancel)")
        end = time.monotonic() + self.server.drain_timeout
        while served.outstanding and time.monotonic() < end:
            time.sleep(0.005)
        successor = self.server.models.get(name)
        for request in served.stop():  # still queued: taken by nobody yet
            if request.done:
                continue
            if successor is not None and successor is not served:
                try:
                    successor.submit(request)
                    continue
                except OutriderError as exc:
                    request.answer(exc)
                    continue
            request.answer(UnavailableError(f"model {name!r} was {why} before this request ran"))
        for request in list(served.outstanding):
            request.answer(UnavailableError(f"model {name!r} was {why} before this request finished "
                                          f"(drain timeout {self.server.drain_timeout:g}s)"))
        served.join(timeout=30.0)

    def stop_quietly(self, served: ServedModel) -> None:
        """Stop `served` at once, answering what is still queued `unavailable`."""
        for request in served.stop():
            request.answer(UnavailableError(f"model {served.name!r} version {served.version} was stopped"))
        served.join(timeout=30.0)

    def forget_finished(self) -> None:
        """Drop the background drains that have ended."""
        self.retiring = [t for t in self.retiring if t.is_alive()]

    def join(self) -> None:
        """At shutdown: wait for the drains under way."""
        for thread in self.retiring:
            thread.join(timeout=self.server.drain_timeout + 30.0)
