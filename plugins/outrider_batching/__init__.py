"""`batching` accelerator: a dynamic batcher between a model's queue and its instances.

Turned on by a manifest's `batching` section, with the knobs of Triton's dynamic batcher:

  max_batch_size         most rows (first-dimension entries) one backend call gets; a request
                         with more rows than this is split (below)
  max_queue_delay_ms     hard cap on how long the first request of a batch waits for company
  preferred_batch_sizes  dispatch at once when the batch reaches one of these sizes

(Triton's `preserve_ordering` is not offered: replies are matched to requests by id, and a
manifest that sets it is refused at load.)

A batch is dispatched as soon as it is full (or reaches a preferred size) or when its first
request has waited `max_queue_delay_ms` since it arrived; requests that queued while the
instance was busy have already waited, so they go at once, as many as fit. The delay is a cap,
and it is only spent while company is coming:
- a lone client (its request finds nothing queued and the previous batch held one request)
  is served at once, so batching costs it no latency;
- a batch stops waiting when no request has arrived for 1 ms, the end of a burst.
With several instances, whole batches may still finish out of order.

Requests are concatenated along the first dimension, the backend runs once per sub-batch, and
the outputs are split back by each request's row count. A batch splits into sub-batches when
its requests cannot be concatenated (numeric inputs whose non-batch shapes differ are grouped
by shape), and when text lengths differ a lot: the text task pads every row to the longest in
its call, so BYTES requests are sorted by length and cut where the padding saved outweighs the
cost of one more call (bucketing). One bad request fails alone: when a batched call raises,
each of its requests is run by itself.

A request with more rows than `max_batch_size` (all its inputs sharing that first dimension) is
split into pieces of at most `max_batch_size` rows, as text-embeddings-inference does. Its rows
are first ordered by what each costs, costliest first (the backend's `row_costs`: tokens per
sentence for the text task; else bytes per row of BYTES inputs; numeric rows keep their order),
and pieces are cut from that order where rows stop sharing a length (a piece ends before its
padding passes 5% of it, or one call's cost), so each call pads to the longest row of rows alike
instead of the longest of a random 32: 1,024 mixed sentences of 1-45 words (27k tokens) pad to
28k token-rows in 39 calls instead of 99k in 32. Pieces run one batch at a time, taking turns
with the other requests that wait (a lone small request waits for at most one piece), and each
piece's outputs are written back to its rows' places in the request's one reply, so the caller
gets them in its own order. A model whose outputs have no batch dimension to join along answers
such a request `too_large`. Rows per request are bounded before that by `limits.max_rows`.
The ordering, the cuts and the pieces are in `splitting.py`; forming and running batches here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from outrider import hookimpl
from outrider.backend import Backend
from outrider.errors import (
    CancelledError,
    ExecutionError,
    ManifestError,
    OutriderError,
    RequestTimeoutError,
)
from outrider.accelerators import AcceleratorSpec
from outrider.errors import InstanceCrashed
from outrider.manifest import Manifest
from outrider.serving.queue import RequestQueue
from outrider.serving.request import DEFERRED, PendingRequest
from outrider.serving.scheduler import Scheduler

from .splitting import Piece, SplitRequest, byte_length, row_plan

__version__ = "0.1.0"

log = logging.getLogger("outrider.batching")

# Bucketing cost model, in byte-rows of BYTES input: one backend call costs about as much as
# padding this many extra bytes (all-MiniLM-L6-v2 on ORT CPU: ~2 ms a call against ~0.07 ms a
# token-row, ~4 bytes a token, with margin), and every row pays for its special tokens.
_CALL_COST = 384
_ROW_COST = 8
# Split only when the model predicts a clear win: it is rough, and a wrong split costs a call.
_MIN_SAVING = 0.15
# Sorting and cutting are O(n^2) in the requests of one batch; beyond this, no bucketing.
_MAX_BUCKETED = 256
_IDLE_POLL_S = 0.25
# A forming batch stops waiting once no request has arrived for this long: clients answering
# their replies arrive about 0.1 ms apart here, so a longer silence means the burst is over and
# the rest of the delay would be spent waiting for nobody. Measured on minilm, 8 closed-loop
# clients: max_queue_delay_ms 5 without this gap, 490 sentences/s; with it, 715-875.
_QUIET_GAP_S = 0.001


class BatchingSpec(BaseModel):
    """The manifest's `batching` section (Triton's dynamic batcher knobs)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)  # schema built on first use

    max_batch_size: int = Field(32, ge=1, le=65536)
    max_queue_delay_ms: float = Field(2.0, ge=0, le=60000)
    preferred_batch_sizes: list[int] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "preserve_ordering" in data:
            # It never did anything in the server (the batcher's early-reply hook was never given
            # a deliver callback), and holding a connection's replies in arrival order across
            # instances would make every reply wait behind its slowest predecessor.
            raise ValueError(
                "field 'preserve_ordering': was removed: replies are matched to requests by id, "
                "never by order (docs/PROTOCOL.md), and the server never held replies back to keep an order; "
                "delete the field (a client that needs order reads replies by id)"
            )
        return data

    @field_validator("preferred_batch_sizes")
    @classmethod
    def _preferred_fit(cls, value: list[int], info: ValidationInfo) -> list[int]:
        largest = info.data.get("max_batch_size", 65536)
        bad = [size for size in value if not 1 <= size <= largest]
        if bad:
            raise ValueError(f"expected sizes from 1 to max_batch_size ({largest}) (got {bad})")
        return value


@hookimpl
def outrider_register_accelerators(register: Callable[..., None]) -> None:
    """Register the dynamic batcher: the batch policy of the manifest section `batching`, any backend."""
    register(AcceleratorSpec(
        name="dynamic-batching", role="batch_policy", section="batching", factory=DynamicBatcher,
        backends=("*",), config=BatchingSpec,
        description="concatenates queued requests along the first dimension (Triton's dynamic batcher knobs)",
    ))


class DynamicBatcher(Scheduler):
    """Forms batches from a model's queue and runs each as few backend calls as it can."""

    def __init__(self, manifest: Manifest, spec: Optional[BatchingSpec] = None) -> None:
        super().__init__(manifest)
        if spec is None:  # built outside a server (tests, tools): read the manifest's own section
            section = manifest.section("batching")
            if section is None:
                raise ManifestError(f"{manifest.where}: the batcher needs a 'batching' section")
            spec = BatchingSpec.model_validate(section)
        self.max_batch_size = spec.max_batch_size
        self.max_queue_delay = spec.max_queue_delay_ms / 1000
        self.preferred_batch_sizes = frozenset(spec.preferred_batch_sizes)
        # Requests taken from the queue that did not fit the batch being formed: the queue has
        # no way to put them back in front, so they open the next batch.
        self._held: deque[PendingRequest] = deque()
        self._held_lock = threading.Lock()
        # Whether the last batch held more than one request: evidence of concurrent clients,
        # the only case in which waiting for company can pay.
        self._busy = False
        self._warned_unsplittable = False
        # Requests with more rows than a batch, handing out pieces round-robin; and whose turn
        # it is: after a piece the next batch opens with waiting requests, after those a piece.
        self._splits: deque[SplitRequest] = deque()
        self._splits_lock = threading.Lock()
        self._piece_turn = True

    # -- forming batches ------------------------------------------------------------------

    def next_batch(self, queue: RequestQueue, idle: Optional[Callable[[], None]] = None,
                   backend: Optional[Backend] = None) -> list[PendingRequest]:
        """Wait for a first request, then gather more until full, preferred-sized or out of delay."""
        first: Any = self._take_piece() if self._piece_turn else None
        if first is None:
            first = self._take_held() or queue.take(timeout=0.0 if self._splits else _IDLE_POLL_S, idle=idle)
        if first is None:
            first = self._take_piece()  # nothing else waits: the next piece goes now
        if first is None:
            return []
        self._piece_turn = not isinstance(first, Piece)
        batch, rows = [first], self._rows(first)
        if rows >= self.max_batch_size:
            return batch
        deadline = first.received + self.max_queue_delay
        while True:
            overflow = False
            for request in self._take_held_all() + queue.take_more(self.max_batch_size - rows):
                size = self._rows(request)
                if overflow or rows + size > self.max_batch_size:
                    overflow = True
                    self._hold(request)
                else:
                    batch.append(request)
                    rows += size
            if overflow or rows >= self.max_batch_size or rows in self.preferred_batch_sizes:
                break
            left = deadline - time.monotonic()
            # Alone, and the last batch was alone too: nobody else is sending, so waiting
            # would only add the delay to this request's latency.
            if left <= 0 or (len(batch) == 1 and not self._busy):
                break
            if not queue.wait_for_items(min(left, _QUIET_GAP_S)):
                break  # the burst is over (or the delay is)
        self._busy = len(batch) > 1
        return batch

    def _rows(self, request: PendingRequest) -> int:
        """The request's first dimension; more than a batch holds when it has none to share."""
        rows = _shared_rows(request)
        return self.max_batch_size + 1 if rows is None else rows

    # -- splitting requests larger than a batch -------------------------------------------

    def _start_split(self, request: PendingRequest, rows: int,
                     plan: Optional[tuple[np.ndarray, list[int]]] = None) -> None:
        with self._splits_lock:
            self._splits.append(SplitRequest(request, rows, self.max_batch_size, *(plan or (None, None))))

    def _take_piece(self) -> Optional[Piece]:
        """The next piece of the oldest split request (round-robin over several), or None."""
        if not self._splits:  # unlocked peek: the common case costs nothing
            return None
        with self._splits_lock:
            while self._splits:
                split = self._splits.popleft()
                if split.request.done:  # cancelled, timed out or failed: drop its other pieces
                    continue
                piece = split.next_piece()
                if not split.exhausted:
                    self._splits.append(split)
                return piece
        return None

    def _hold(self, request: PendingRequest) -> None:
        with self._held_lock:
            self._held.append(request)

    def _take_held(self) -> Optional[PendingRequest]:
        with self._held_lock:
            while self._held:
                request = self._held.popleft()
                if not request.done:
                    return request
        return None

    def _take_held_all(self) -> list[PendingRequest]:
        if not self._held:  # unlocked peek: the common case costs nothing
            return []
        with self._held_lock:
            out = [r for r in self._held if not r.done]
            self._held.clear()
        return out

    # -- executing batches ----------------------------------------------------------------

    def execute(self, backend: Backend, batch: list[PendingRequest]) -> list[Any]:
        """Outputs (or an OutriderError) per request, in batch order."""
        results: list[Any] = [None] * len(batch)
        now = time.monotonic()
        live = []
        for index, request in enumerate(batch):
            if request.deadline is not None and request.deadline <= now:
                results[index] = RequestTimeoutError(
                    f"request {request.id!r} timed out while its batch formed in model {request.model!r}"
                )
            elif request.done:  # cancelled while the batch formed; its reply is already sent
                results[index] = CancelledError(f"request {request.id!r} was cancelled")
            elif not isinstance(request, Piece) and (_shared_rows(request) or 0) > self.max_batch_size:
                # Too many rows for one call: its pieces come back through next_batch, taking
                # turns with other requests, and the last one to finish replies for all.
                try:
                    plan = row_plan(backend, request, _shared_rows(request), self.max_batch_size, self.manifest.name)
                except OutriderError as exc:  # bad input found while costing it: fail it now
                    results[index] = exc
                    continue
                self._start_split(request, _shared_rows(request), plan)
                results[index] = DEFERRED
            else:
                live.append(index)
        try:
            for group in self.plan(batch, live):
                for index, result in zip(group, self._run(backend, [batch[i] for i in group])):
                    request = batch[index]
                    results[index] = request.finish(result) if isinstance(request, Piece) else result
        except InstanceCrashed as exc:
            # The instance is gone: it must hear of it to be replaced, and it answers the rest of
            # the batch with the crash; what finished before keeps its result.
            exc.partial = results
            raise
        return results

    def plan(self, batch: list[PendingRequest], indices: list[int]) -> list[list[int]]:
        """Sub-batches of `indices`, each concatenable and worth its call, earliest arrival first."""
        groups: dict[Any, list[int]] = {}
        for index in indices:
            request = batch[index]
            if self._rows(request) > self.max_batch_size:
                key: Any = ("alone", index)
            else:
                key = tuple(sorted((n, a.dtype.str, a.shape[1:]) for n, a in request.inputs.items()))
            groups.setdefault(key, []).append(index)
        subs: list[list[int]] = []
        for key, group in groups.items():
            texts = [n for n, dtype, _ in key if dtype == "|O"] if key[0] != "alone" else []
            subs.extend(self._buckets(batch, group, texts) if texts and len(group) > 1 else [group])
        return sorted(subs, key=lambda sub: sub[0])

    def _buckets(self, batch: list[PendingRequest], group: list[int], texts: list[str]) -> list[list[int]]:
        """Cut a group of text requests, sorted by length, where padding costs more than a call."""
        if len(group) > _MAX_BUCKETED:
            return [group]
        length = {i: max((byte_length(x) for n in texts for x in batch[i].inputs[n].ravel()), default=0)
                  for i in group}
        rows = {i: self._rows(batch[i]) for i in group}
        order = sorted(group, key=length.__getitem__)
        whole = _CALL_COST + sum(rows.values()) * (_ROW_COST + length[order[-1]])
        unpadded = _CALL_COST + sum(rows[i] * (_ROW_COST + length[i]) for i in group)
        if unpadded > whole * (1 - _MIN_SAVING):  # lengths alike: no cut can save enough
            return [group]
        # best[j]: cheapest cost of order[:j]; cut[j]: where its last sub-batch starts.
        best = [0.0] + [float("inf")] * len(order)
        cut = [0] * (len(order) + 1)
        for j in range(1, len(order) + 1):
            longest, taken = length[order[j - 1]], 0
            for i in range(j, 0, -1):
                taken += rows[order[i - 1]]
                cost = best[i - 1] + _CALL_COST + taken * (_ROW_COST + longest)
                if cost < best[j]:
                    best[j], cut[j] = cost, i - 1
        if best[-1] > whole * (1 - _MIN_SAVING):
            return [group]
        subs, j = [], len(order)
        while j > 0:
            subs.append(sorted(order[cut[j]:j]))
            j = cut[j]
        return subs

    def _run(self, backend: Backend, requests: list[PendingRequest]) -> list[Any]:
        """One backend call for the sub-batch; each request alone if that call fails."""
        if len(requests) == 1:
            return [_execute_alone(backend, requests[0])]
        names = list(requests[0].inputs)
        inputs = {n: np.concatenate([r.inputs[n] for r in requests]) for n in names}
        try:
            outputs = backend.execute(inputs)
        except InstanceCrashed:
            raise  # not a bad request: running each alone would only hit the dead instance again
        except Exception as exc:
            # Usually one bad element (text that is not UTF-8): find it by running each alone,
            # so only its request fails.
            log.debug("model %s: a batch of %d failed (%s); running each request alone",
                      self.manifest.name, len(requests), exc)
            return [_execute_alone(backend, r) for r in requests]
        sizes = [self._rows(r) for r in requests]
        split = _split(outputs, sizes)
        if split is None:
            if not self._warned_unsplittable:
                self._warned_unsplittable = True
                shapes = {n: getattr(v, "shape", None) for n, v in outputs.items()} if isinstance(outputs, dict) else outputs
                log.warning("model %s: outputs %s have no batch dimension of %d rows to split; running each "
                            "request alone (turn batching off for this model)", self.manifest.name, shapes, sum(sizes))
            return [_execute_alone(backend, r) for r in requests]
        return split


def _shared_rows(request: Any) -> Optional[int]:
    """The first dimension all of a request's inputs share, or None (a scalar, or dims differ)."""
    dims = {shape[0] if shape else -1 for shape in request.shapes().values()}
    if len(dims) != 1 or -1 in dims:
        return None
    return dims.pop()


def _execute_alone(backend: Backend, request: PendingRequest) -> Any:
    try:
        return backend.execute(request.inputs)
    except InstanceCrashed:
        raise  # the instance's failure, not this request's: the instance must be replaced
    except OutriderError as exc:
        return exc
    except Exception as exc:
        log.exception("model %s: execute failed", request.model)
        return ExecutionError(f"model {request.model!r}: {type(exc).__name__}: {exc}")


def _split(outputs: Any, sizes: list[int]) -> Optional[list[dict[str, np.ndarray]]]:
    """Per-request views of the batched outputs; None when an output has no batch dimension."""
    total = sum(sizes)
    if not isinstance(outputs, dict) or any(
        not isinstance(v, np.ndarray) or v.ndim == 0 or v.shape[0] != total for v in outputs.values()
    ):
        return None
    offsets = np.cumsum([0, *sizes])
    return [{n: v[offsets[k]:offsets[k + 1]] for n, v in outputs.items()} for k in range(len(sizes))]
