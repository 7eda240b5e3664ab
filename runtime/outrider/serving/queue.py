"""The bounded, fair queue in front of a model's instances."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from ..errors import OverloadedError, RequestTimeoutError, UnavailableError
from .request import PendingRequest


class RequestQueue:
    """Bounded queue per model, fair between connections: full means 'overloaded' now, not
    unbounded memory later, and no connection can take the whole model from the others.

    Two bounds: how many requests wait (`max_size`), and how many input bytes the model holds
    (`max_bytes`): a request's bytes count from `put` until it is answered, so requests being
    split or executed count too, not only those waiting.

    Fairness (requests are grouped by `route`, the client connection):
    - taking is round-robin over the connections with requests waiting, oldest first within
      each, so a connection that queued 60 requests delays another's one by at most one turn
      each, not 60 (one connection alone gets plain FIFO order);
    - when the queue is full, a request from a connection holding fewer places than the largest
      holder takes the place of that holder's newest request, which is answered `overloaded`.
      One connection may use the whole queue while nobody else needs it.
    """

    #: seconds without work after which a waiting instance is told it is idle (Backend.idle):
    #: longer than a client's round trip between requests, so a busy stream never pays for it
    IDLE_AFTER_S = 0.005

    def __init__(self, max_size: int, max_bytes: Optional[int] = None) -> None:
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.bytes = 0
        self._routes: dict[bytes, deque[PendingRequest]] = {}  # waiting requests per connection
        self._turns: deque[bytes] = deque()  # connections with requests waiting, next turn first
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        return self._count

    def put(self, request: PendingRequest) -> None:
        evicted = None
        with self._cond:
            if self._closed:
                raise UnavailableError("model is shutting down")
            if self._count >= self.max_size:
                evicted = self._evict_for(request)
                if evicted is None:
                    raise OverloadedError(
                        f"model {request.model!r}: queue is full ({self.max_size} waiting); retry later"
                    )
            size = request.nbytes
            if size and self.max_bytes is not None and self.bytes + size > self.max_bytes:
                if evicted is not None:
                    self._append(evicted, left=False)  # the place was not needed after all
                raise OverloadedError(
                    f"model {request.model!r}: requests in progress hold {self.bytes} bytes and this one "
                    f"{size}; the budget is scheduling.max_queue_bytes = {self.max_bytes}; retry later"
                )
            if size:
                self.bytes += size
                request._on_claim.append(self._release)
            self._append(request, left=False)
            self._cond.notify()
        if evicted is not None:
            evicted.answer(OverloadedError(
                f"model {evicted.model!r}: queue is full ({self.max_size} waiting) and this connection held "
                f"the most places; its newest request gave its place to another connection's; retry later"
            ))

    def _evict_for(self, request: PendingRequest) -> Optional[PendingRequest]:
        """Caller holds the lock. The newest request of the connection holding the most places,
        when that is more than the newcomer's connection would hold with this request."""
        mine = len(self._routes.get(request.route, ()))
        route, waiting = max(self._routes.items(), key=lambda item: len(item[1]), default=(None, None))
        if waiting is None or route == request.route or len(waiting) <= mine + 1:
            return None
        victim = waiting.pop()
        self._count -= 1
        if not waiting:
            del self._routes[route]
            self._turns.remove(route)
        return victim

    def _append(self, request: PendingRequest, left: bool) -> None:
        # Caller holds the lock.
        waiting = self._routes.get(request.route)
        if waiting is None:
            waiting = self._routes[request.route] = deque()
            if left:
                self._turns.appendleft(request.route)
            else:
                self._turns.append(request.route)
        if left:
            waiting.appendleft(request)
        else:
            waiting.append(request)
        self._count += 1

    def _pop(self) -> Optional[PendingRequest]:
        """Caller holds the lock. The next live request in round-robin order, or None."""
        while self._turns:
            route = self._turns.popleft()
            waiting = self._routes[route]
            request = waiting.popleft()
            self._count -= 1
            if waiting:
                self._turns.append(route)
            else:
                del self._routes[route]
            if not request.done:  # cancelled or timed out while queued
                return request
        return None

    def _release(self, request: PendingRequest) -> None:
        with self._cond:
            self.bytes -= request.nbytes

    def put_back(self, requests: list[Any]) -> list[Any]:
        """Return taken, unanswered requests to the front, in order (an instance that could not
        run them); what a closed queue cannot take back is returned for the caller to answer."""
        live = [r for r in requests if not r.done]
        with self._cond:
            if self._closed:
                return live
            for request in reversed(live):
                self._append(request, left=True)
                # Its connection's turn comes first again.
                self._turns.remove(request.route)
                self._turns.appendleft(request.route)
            self._cond.notify(len(live))
        return []

    def take(self, timeout: float, idle: Optional[Callable[[], None]] = None) -> Optional[PendingRequest]:
        """The next live request, waiting up to `timeout` s; None on timeout or close.

        `idle` (an instance's `idle`) is called, without the lock, when nothing came within
        IDLE_AFTER_S and the wait goes on: the caller's thread is about to sleep."""
        if idle is not None and timeout > self.IDLE_AFTER_S:
            request = self._take(self.IDLE_AFTER_S)
            if request is not None or self._closed:
                return request
            idle()
            timeout -= self.IDLE_AFTER_S
        return self._take(timeout)

    def _take(self, timeout: float) -> Optional[PendingRequest]:
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                request = self._pop()
                if request is not None:
                    return request
                if self._closed:
                    return None
                left = end - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    if not self._count:
                        return None

    def take_more(self, limit: int) -> list[PendingRequest]:
        """Up to `limit` more live requests without waiting (for batchers)."""
        out: list[PendingRequest] = []
        with self._cond:
            while self._count and len(out) < limit:
                request = self._pop()
                if request is None:
                    break
                out.append(request)
        return out

    def wait_for_items(self, timeout: float) -> bool:
        with self._cond:
            if self._count or self._closed:
                return bool(self._count)
            self._cond.wait(timeout)
            return bool(self._count)

    def _all(self) -> list[PendingRequest]:
        return [r for waiting in self._routes.values() for r in waiting]

    def expire(self, now: float) -> int:
        """Answer queued requests whose deadline passed; returns how many were answered."""
        expired = []
        with self._cond:
            if not any(r.deadline is not None and r.deadline <= now for r in self._all()):
                return 0
            for route in list(self._routes):
                waiting = self._routes[route]
                keep = deque(r for r in waiting if not (r.deadline is not None and r.deadline <= now))
                expired.extend(r for r in waiting if r.deadline is not None and r.deadline <= now)
                self._count -= len(waiting) - len(keep)
                if keep:
                    self._routes[route] = keep
                else:
                    del self._routes[route]
                    self._turns.remove(route)
        # Cancelled ones still in line are skipped: count only the requests this answered.
        return sum(r.answer(RequestTimeoutError(f"request {r.id!r} timed out after waiting in the queue of model {r.model!r}"))
                   for r in expired)

    def close(self) -> list[PendingRequest]:
        """Stop taking work; return what was still queued so the caller can answer it."""
        with self._cond:
            self._closed = True
            items = [r for r in self._all() if not r.done]
            self._routes.clear()
            self._turns.clear()
            self._count = 0
            self._cond.notify_all()
        return items
