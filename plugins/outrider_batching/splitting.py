"""Requests with more rows than a batch: how their rows are ordered and cut into pieces
(`row_plan`), and the pieces themselves (`SplitRequest`, `Piece`), scheduled like requests and
joined back into the request's one reply in its own row order (see the package docstring)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Optional

import numpy as np

from outrider.backend import Backend
from outrider.errors import ExecutionError, OutriderError, TooLargeError
from outrider.serving.request import DEFERRED, PendingRequest

log = logging.getLogger("outrider.batching")

# Cutting a split request's rows, ordered longest first, into pieces (in tokens: the text task's
# cost key; BYTES rows count 4 bytes a token): a piece stops taking rows once their padding would
# pass 5% of its padded size, or one call's cost when that is more (all-MiniLM-L6-v2 on ORT CPU:
# a call costs about as much as 20-25 more token-rows; padding cheaper than a call is worth it).
# Cutting the sorted rows every 32 instead padded 256 mixed sentences (6,761 tokens) to 9,280
# token-rows, as the 32 longest span 47-131 tokens; these cuts pad them to 7,187 in 19 calls,
# and the ORT engine alone ran them 2x as fast (241 against 119 sentences/s, same run).
_PIECE_WASTE = 0.05
_PIECE_CALL_TOKENS = 24


def row_plan(backend: Backend, request: PendingRequest, rows: int, size: int,
             model: str) -> Optional[tuple[np.ndarray, list[int]]]:
    """How to cut a split request: its rows costliest first, and where each piece stops in that
    order; None cuts it in its own order, `size` rows a piece (`model` names it in warnings).

    Raises the request's OutriderError when costing finds its input bad (not UTF-8).
    """
    per_token = 1
    try:
        costs = backend.row_costs(request.inputs)  # Backend.row_costs: None when rows cost alike
    except OutriderError:
        raise
    except Exception as exc:  # a broken cost key must not fail requests that would run
        log.warning("model %s: row_costs failed (%s: %s); cutting the request in its own order",
                    model, type(exc).__name__, exc)
        return None
    if costs is None:
        costs, per_token = byte_costs(request.inputs), 4  # about 4 bytes a token
        if costs is None:
            return None
    costs = np.asarray(costs)
    if costs.shape != (rows,) or not np.issubdtype(costs.dtype, np.number):
        log.warning("model %s: row_costs gave %s for %d rows; cutting the request in its own order",
                    model, costs.shape, rows)
        return None
    if costs.min() == costs.max():
        return None  # nothing to group: pieces stay views of the request's own rows
    # Costliest first (as sentence-transformers does): a backend's buffers reach their largest
    # size once, on the first piece, instead of growing piece by piece.
    order = np.argsort(-costs, kind="stable")
    return order, cut_pieces((costs[order] / per_token).tolist(), size)


class SplitRequest:
    """A request with more rows than a batch: cut into pieces, their outputs joined in order."""

    def __init__(self, request: PendingRequest, rows: int, size: int, order: Optional[np.ndarray] = None,
                 stops: Optional[list[int]] = None) -> None:
        self.request = request
        self.rows = rows
        self.size = size
        #: the request's row indices in the order pieces are cut from (None: its own order)
        self.order = order
        #: where each piece stops in that order (None: every `size` rows)
        self._stops = deque(stops) if stops is not None else None
        self.offset = 0  # where the next piece starts, in that order
        # The joined outputs, allocated when the first piece returns and filled in place: holding
        # every piece's outputs and then concatenating them would need twice the memory.
        self._out: Optional[dict[str, np.ndarray]] = None
        self._finished_rows = 0
        self._lock = threading.Lock()

    @property
    def exhausted(self) -> bool:
        return self.offset >= self.rows

    def next_piece(self) -> "Piece":
        start = self.offset
        stop = self._stops.popleft() if self._stops else min(start + self.size, self.rows)
        self.offset = stop
        return Piece(self, start, stop)

    def add(self, piece: "Piece", outputs: Any) -> Any:
        """Keep a piece's outputs; the joined outputs once every piece is in, else DEFERRED."""
        rows = piece.stop - piece.start
        if not isinstance(outputs, dict) or any(
            not isinstance(v, np.ndarray) or v.ndim == 0 or v.shape[0] != rows for v in outputs.values()
        ):
            return TooLargeError(
                f"model {self.request.model!r}: a request of {self.rows} rows is more than "
                f"batching.max_batch_size = {self.size}, and this model's outputs have no batch dimension "
                f"to join its pieces along; send at most {self.size} rows"
            )
        with self._lock:
            if self._out is None:
                self._out = {n: np.empty((self.rows, *v.shape[1:]), v.dtype) for n, v in outputs.items()}
            out = self._out
            if set(outputs) != set(out) or any(
                v.shape[1:] != out[n].shape[1:] or v.dtype != out[n].dtype for n, v in outputs.items()
            ):
                shapes = {n: (list(v.shape), str(v.dtype)) for n, v in outputs.items()}
                return ExecutionError(
                    f"model {self.request.model!r}: the pieces of a request of {self.rows} rows returned outputs "
                    f"that do not join (this piece: {shapes}); send at most {self.size} rows"
                )
            where = piece.index if piece.index is not None else slice(piece.start, piece.stop)
            for name, value in outputs.items():
                out[name][where] = value  # back to the caller's order
            self._finished_rows += rows
            if self._finished_rows < self.rows:
                return DEFERRED
            self._out = None
        return out


class Piece:
    """Positions [start, stop) of a split request's row order, scheduled like a request of its own.

    Answering a piece answers its request: a piece that fails (or times out, or is abandoned with
    a hung instance) fails the whole request, and the last piece to finish replies with all rows.
    """

    tensors = None

    def __init__(self, split: SplitRequest, start: int, stop: int) -> None:
        parent = split.request
        self.split, self.start, self.stop = split, start, stop
        self.parent = parent
        #: the request's rows this piece holds, when the split reordered them (else rows start:stop)
        self.index = None if split.order is None else split.order[start:stop]
        where = slice(start, stop) if self.index is None else self.index
        self.inputs = {name: array[where] for name, array in parent.inputs.items()}
        self.route, self.id, self.kind, self.model = parent.route, parent.id, parent.kind, parent.model
        self.parameters = parent.parameters
        self.deadline = parent.deadline
        self.received = time.monotonic()  # queue-wait stats count from when the piece was cut

    @property
    def done(self) -> bool:
        return self.parent.done

    def decode(self) -> None:
        pass  # the parent was decoded before it was split

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(array.shape) for name, array in self.inputs.items()}

    @property
    def rows(self) -> int:
        """The request's rows: a piece that is answered (not DEFERRED) answers its whole request."""
        return self.parent.rows

    def finish(self, result: Any) -> Any:
        """This piece's result as the scheduler should report it: an error, DEFERRED, or all rows."""
        if isinstance(result, OutriderError):
            return result
        return self.split.add(self, result)

    def claim(self) -> bool:
        return self.parent.claim()

    def answer(self, result: Any, counts: Any = None, **fields: Any) -> bool:
        return self.parent.answer(result, counts, **fields)

    def reply(self, outputs: Optional[dict[str, np.ndarray]] = None, claimed: bool = False, **fields: Any) -> bool:
        return self.parent.reply(outputs, claimed=claimed, **fields)

    def fail(self, error: OutriderError, claimed: bool = False) -> bool:
        return self.parent.fail(error, claimed=claimed)


def cut_pieces(costs: list[float], size: int) -> list[int]:
    """Where each piece stops, for rows whose costs (tokens) come longest first; at most `size` a piece."""
    stops: list[int] = []
    start, n = 0, len(costs)
    while start < n:
        top, stop, padding = costs[start], start + 1, 0
        while stop < n and stop - start < size:
            more = padding + top - costs[stop]
            if more > max(_PIECE_WASTE * (stop - start + 1) * top, _PIECE_CALL_TOKENS):
                break
            padding, stop = more, stop + 1
        stops.append(stop)
        start = stop
    return stops


def byte_costs(inputs: dict[str, np.ndarray]) -> Optional[np.ndarray]:
    """Bytes per row over a request's BYTES inputs; None when it has none (numeric rows cost alike)."""
    costs = None
    for array in inputs.values():
        if array.dtype != object or array.ndim == 0:
            continue
        lengths = np.fromiter(map(byte_length, array.ravel()), dtype=np.int64, count=array.size)
        per_row = lengths.reshape(len(array), -1).sum(axis=1) if len(array) else lengths
        costs = per_row if costs is None else costs + per_row
    return costs


def byte_length(item: Any) -> int:
    """len() of a BYTES element (its bytes, or characters of a str); 0 for what has none."""
    try:
        return len(item)
    except TypeError:
        return 0
