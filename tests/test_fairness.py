"""Fairness between client connections: the model queue's round-robin order and its eviction
rule (in process), and a flooding client that cannot starve another one (real server)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from conftest import write_manifest
from outrider.errors import OverloadedError
from outrider.serving.queue import RequestQueue
from outrider.serving.request import PendingRequest

SENT: list[tuple[PendingRequest, dict]] = []


def _request(route: bytes, rid: int, deadline=None) -> PendingRequest:
    return PendingRequest(route=route, id=rid, kind="infer", model="m", inputs={}, parameters={},
                          send=lambda req, kind, header, outputs: SENT.append((req, header)), deadline=deadline)


def _drain(queue: RequestQueue) -> list[tuple[bytes, int]]:
    return [(r.route, r.id) for r in queue.take_more(100)]


def test_one_connection_gets_fifo_order():
    queue = RequestQueue(8)
    for i in range(5):
        queue.put(_request(b"a", i))
    assert _drain(queue) == [(b"a", i) for i in range(5)]


def test_connections_take_turns():
    queue = RequestQueue(16)
    for i in range(4):
        queue.put(_request(b"hog", i))
    queue.put(_request(b"b", 100))
    queue.put(_request(b"c", 200))
    queue.put(_request(b"b", 101))
    order = [queue.take(0).id for _ in range(7)]
    assert order == [0, 100, 200, 1, 101, 2, 3]
    assert queue.take(0) is None and len(queue) == 0


def test_full_queue_evicts_the_largest_holders_newest_request():
    SENT.clear()
    queue = RequestQueue(4)
    hog = [_request(b"hog", i) for i in range(4)]
    for request in hog:
        queue.put(request)
    queue.put(_request(b"small", 100))  # takes the place of hog's newest
    assert hog[3].done and SENT[-1][1]["error"]["code"] == "overloaded"
    assert "gave its place" in SENT[-1][1]["error"]["message"]
    assert len(queue) == 4
    queue.put(_request(b"small", 101))  # hog holds 3, small 1: still more than small + 1
    assert hog[2].done
    # Now hog 2, small 2: a third from small would hold more than hog; refused like any full queue.
    with pytest.raises(OverloadedError):
        queue.put(_request(b"small", 102))
    assert sorted(_drain(queue)) == sorted([(b"hog", 0), (b"hog", 1), (b"small", 100), (b"small", 101)])


def test_one_connection_alone_may_fill_the_queue():
    queue = RequestQueue(3)
    for i in range(3):
        queue.put(_request(b"a", i))
    with pytest.raises(OverloadedError, match="queue is full"):
        queue.put(_request(b"a", 3))


def test_put_back_and_expire_keep_order_and_counts():
    queue = RequestQueue(8)
    for i in range(3):
        queue.put(_request(b"a", i))
    queue.put(_request(b"b", 10, deadline=time.monotonic() - 1))
    taken = queue.take_more(2)
    assert [r.id for r in taken] == [0, 10]
    queue.put_back([taken[0]])
    assert queue.expire(time.monotonic()) == 0  # the expired one was taken already
    queue.put(_request(b"b", 11, deadline=time.monotonic() - 1))
    assert queue.expire(time.monotonic()) == 1
    assert [r.id for r in queue.take_more(10)] == [0, 1, 2]
    assert len(queue) == 0


def test_flooding_connection_does_not_starve_another(server_factory, tmp_path):
    """Client A keeps the queue full of slow requests; client B still gets served promptly."""
    manifest = write_manifest(tmp_path, "name: slow\nbackend: echo\noptions: {delay_ms: 40}\n"
                                        "scheduling: {max_queue_size: 8}\n")
    server = server_factory([manifest], ["outrider_echo"])
    stop = threading.Event()
    flood_replies = {"ok": 0, "overloaded": 0}

    def flood() -> None:
        import msgpack
        import zmq

        from outrider.protocol import encode_message

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        outstanding, next_id = 0, 0
        x = np.zeros((1, 4), np.float32)
        while not stop.is_set():
            while outstanding < 16:  # twice the queue: A alone would keep it full
                next_id += 1
                sock.send_multipart(encode_message("infer", {"id": next_id, "model": "slow"}, {"x": x}))
                outstanding += 1
            if sock.poll(50):
                header = msgpack.unpackb(sock.recv_multipart()[1])
                outstanding -= 1
                flood_replies["ok" if header["ok"] else header["error"]["code"]] += 1
        sock.close(0)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        time.sleep(0.5)  # the flood has filled the queue
        waits = []
        with server.client(timeout=10) as client:
            for _ in range(5):
                start = time.monotonic()
                out = client.infer("slow", {"x": np.ones((1, 4), np.float32)})
                waits.append(time.monotonic() - start)
                np.testing.assert_array_equal(out["x"], np.ones((1, 4), np.float32))
    finally:
        stop.set()
        flooder.join(10)
    assert flood_replies["ok"] > 0 and flood_replies["overloaded"] > 0, flood_replies
    # FIFO behind a full queue of 40 ms requests would be >= 8 * 40 ms; round-robin is one turn.
    assert sorted(waits)[2] < 0.25, waits
