"""A request on its way through a served model: waits for its single final reply.

The front that received it made it (`Server.submit`, the ZeroMQ front); whoever answers it first
(an instance, the supervisor, a cancel, the deadline sweep) claims it, and every later answer is
dropped, so a request is answered exactly once whatever races.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ..errors import CancelledError, OutriderError
from ..protocol import TensorFrame


#: a scheduler's result for a request it keeps and answers later itself (streaming generation).
DEFERRED = object()


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

    def answer(self, result: Any, counts: Any = None, **fields: Any) -> bool:
        """The one way the core answers a request: claim it (False when it was answered already:
        cancelled, timed out, abandoned), count it in `counts` (the model's ModelStats, or None)
        before the client can ask for health again, then send `result`: an OutriderError as the
        error reply, else outputs (None for a generation, whose reply is `fields`) as the final reply."""
        if not self.claim():
            return False
        if isinstance(result, OutriderError):
            if counts is not None:
                counts.failure(result.code)
            self.fail(result, claimed=True)
        else:
            if counts is not None:
                counts.success(rows=self.rows)
            self.reply(result, claimed=True, **fields)
        return True

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


def cancel_error(request: PendingRequest) -> CancelledError:
    return CancelledError(f"request {request.id!r} was cancelled by the client")
