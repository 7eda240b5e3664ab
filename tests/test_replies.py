"""Exactly one final reply per accepted request, under faults on the reply path, and no work for
clients that left: unencodable outputs, a client that stops reading, a stream cancelled mid-way,
a client that disconnects with requests queued or a stream running."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import yaml
import zmq

from conftest import raw_dealer as _dealer, write_manifest
from outrider.protocol import encode_message


def _read(sock: zmq.Socket, timeout_s: float) -> list[tuple[bytes, dict]]:
    """(kind, header) of every message that arrives within timeout_s of the previous one."""
    out = []
    while sock.poll(int(timeout_s * 1000)):
        frames = sock.recv_multipart()
        out.append((frames[0].split(b" ", 1)[-1], msgpack.unpackb(frames[1], raw=False)))
    return out


def test_unencodable_reply_fails_alone_and_its_batch_neighbours_are_answered(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: enc\nbackend: unencodable\n"
                                        "batching: {max_batch_size: 8, max_queue_delay_ms: 200}\n")
    server = server_factory([manifest], ["outrider_test_backends", "outrider_batching"])
    sock = _dealer(server.address)
    try:
        for rid, value in enumerate([1.0, -1.0, 2.0, 3.0]):  # one batch: sent well within 200 ms
            sock.send_multipart(encode_message("infer", {"id": rid, "model": "enc"},
                                               {"x": np.full((1, 2), value, np.float32)}))
        replies = {h["id"]: h for _, h in _read(sock, 5.0)}
    finally:
        sock.close(0)
    assert sorted(replies) == [0, 1, 2, 3], replies
    assert [replies[i]["ok"] for i in (0, 2, 3)] == [True, True, True]
    assert not replies[1]["ok"] and replies[1]["error"]["code"] == "internal"
    assert "could not be encoded" in replies[1]["error"]["message"]


def test_final_replies_wait_for_a_client_that_stopped_reading(echo_server):
    """More replies than the pipe holds (10,000 messages plus socket buffers), fewer than the
    backlog's 4,096 beyond that: none is lost."""
    count = 13_000
    sock = _dealer(echo_server.address, RCVHWM=100, SNDHWM=0)
    try:
        for rid in range(count):  # cancels of nothing: small, cheap, each answered
            sock.send_multipart(encode_message("cancel", {"id": rid, "target": 10**9 + rid}))
        time.sleep(3.0)  # replies pile up: the pipe fills, the rest meet EAGAIN
        ids = {h["id"] for _, h in _read(sock, 5.0)}
    finally:
        sock.close(0)
    assert len(ids) == count, f"{count - len(ids)} replies lost"
    with echo_server.client() as client:
        assert client.health()["ready"]


def _tiny_llm(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, yaml.safe_dump({"name": "tiny", "backend": "hf-llama", "options": {"seed": 3}}),
                              "tiny.yaml")
    return server_factory([manifest], ["outrider_test_hf_llama"])


def _active(server) -> int:
    with server.client() as client:
        instances = client.health()["models"]["tiny"]["instances"]
    return sum(i.get("backend", {}).get("active_sequences", 0) for i in instances)


def test_no_chunk_after_the_final_reply_of_a_cancelled_stream(server_factory, tmp_path):
    server = _tiny_llm(server_factory, tmp_path)
    sock = _dealer(server.address)
    try:
        for rid in range(10):
            params = {"prompt": "abc abc abc", "max_tokens": 200, "stream": True}
            sock.send_multipart(encode_message("generate", {"id": rid, "model": "tiny", "parameters": params}))
            assert sock.poll(30_000)
            sock.recv_multipart()  # the first chunk: the stream runs
            sock.send_multipart(encode_message("cancel", {"id": f"c{rid}", "target": rid}))
            seen = _read(sock, 0.5)
            mine = [(kind, h) for kind, h in seen if h.get("id") == rid]
            finals = [i for i, (kind, _) in enumerate(mine) if kind == b"reply"]
            assert len(finals) == 1, mine
            assert finals[0] == len(mine) - 1, f"a chunk came after the final reply: {mine}"
    finally:
        sock.close(0)


def test_a_client_that_leaves_mid_stream_frees_its_slot(server_factory, tmp_path):
    server = _tiny_llm(server_factory, tmp_path)
    sock = _dealer(server.address)
    params = {"prompt": "abc abc abc", "max_tokens": 250, "stream": True}
    for rid in range(3):
        sock.send_multipart(encode_message("generate", {"id": rid, "model": "tiny", "parameters": params}))
    assert sock.poll(30_000)
    sock.close(0)  # gone without a cancel, a few tokens into 250
    end = time.monotonic() + 30
    while _active(server) and time.monotonic() < end:
        time.sleep(0.05)
    with server.client() as client:
        stats = client.health()["models"]["tiny"]["stats"]
    # Run to the end, they would count as successes: they were cancelled instead.
    assert stats["failures"].get("cancelled") == 3 and stats["successes"] == 0, stats


def test_a_client_that_leaves_has_its_queued_requests_cancelled(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: slow\nbackend: echo\noptions: {delay_ms: 100}\n")
    server = server_factory([manifest], ["outrider_echo"])
    sock = _dealer(server.address)
    x = np.zeros((1, 2), np.float32)
    for rid in range(30):  # 3 s of work
        sock.send_multipart(encode_message("infer", {"id": rid, "model": "slow"}, {"x": x}))
    time.sleep(0.3)
    sock.close(0)
    time.sleep(0.5)
    with server.client() as client:
        stats = client.health()["models"]["slow"]["stats"]
    assert stats["failures"].get("cancelled", 0) >= 20, stats


def test_a_scheduler_bug_still_answers_every_request_of_its_batch(server_factory, tmp_path):
    """A batch policy that loses its results: each request gets one `internal` reply (not silence),
    the instance is replaced, and the model serves again."""
    manifest = write_manifest(tmp_path, "name: buggy\nbackend: echo\nbatching: {max_batch_size: 4}\n")
    server = server_factory([manifest], ["outrider_echo", "outrider_test_bad_policy"])
    sock = _dealer(server.address)
    try:
        for rid in range(3):
            sock.send_multipart(encode_message("infer", {"id": rid, "model": "buggy"},
                                               {"x": np.zeros((1, 2), np.float32)}))
        replies = [h for _, h in _read(sock, 3.0)]
    finally:
        sock.close(0)
    assert sorted(h["id"] for h in replies) == [0, 1, 2], replies
    codes = {h["error"]["code"] for h in replies}
    assert codes <= {"internal", "unavailable"} and "internal" in codes, replies
    assert "scheduler returned 0 results for" in server.log()
