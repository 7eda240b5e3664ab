"""Hostile input and bounded work, through real server processes on ipc:// addresses.

Every header field the server reads is fed values of the wrong type and out of range; each must
get its own error code (never `internal`, never a traceback in the log) and the server must keep
serving. Requests over a model's `limits` are refused before decoding; requests with more rows
than a batch are split and answered in order while other clients keep being served.
"""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest
import yaml
import zmq

from outrider import Client
from outrider.errors import TooLargeError
from outrider.protocol import encode_message

from conftest import write_manifest

GOOD = [b"outrider/1 infer", msgpack.packb({"id": "good", "model": "echo",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4]}]}), np.ones((1, 4), np.float32).tobytes()]


def _manifest(tmp_path, name="echo", backend="echo", **fields) -> str:
    data = {"name": name, "backend": backend, "device": "cpu", "warmup": {"iterations": 0}, **fields}
    return write_manifest(tmp_path, yaml.safe_dump(data), f"{name}.yaml")


def _dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _raw_call(address: str, frames: list, timeout_ms: int = 10000) -> dict:
    sock = _dealer(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(timeout_ms), f"no reply to {frames[:2]!r}"
        reply = sock.recv_multipart()
        assert reply[0] == b"outrider/1 reply"
        return msgpack.unpackb(reply[1])
    finally:
        sock.close()


def _infer(*tensor_specs, frames=None, **fields) -> list:
    header = {"id": 1, "model": "echo", **fields}
    if tensor_specs:
        header["inputs"] = list(tensor_specs)
    return [b"outrider/1 infer", msgpack.packb(header), *(frames or [])]


def _bytes_frame(items: list[bytes]) -> bytes:
    return b"".join(len(x).to_bytes(4, "little") + x for x in items)


def _rss_kb(pid: int, field: str = "VmRSS") -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _spec(shape, datatype="FP32", name="x"):
    return {"name": name, "datatype": datatype, "shape": shape}


# Each case: frames, the expected code, and a phrase the message must hold (the field or the limit).
HOSTILE = {
    "zero-size overflow shape": (_infer(_spec([0, 2**62, 2**62]), frames=[b""]), "too_large", "dimension 1"),
    "16 dims with one zero": (_infer(_spec([0] + [1 << 20] * 15), frames=[b""]), "too_large", "spans"),
    "dim beyond int64": (_infer(_spec([2**64 - 1]), frames=[b""]), "too_large", "dimension 0"),
    "float dim": (_infer(_spec([1.0, 4]), frames=[b"\0" * 16]), "protocol_error", "dimension 0 is 1.0"),
    "bool dim": (_infer(_spec([True, 4]), frames=[b"\0" * 16]), "protocol_error", "dimension 0 is True"),
    "string dim": (_infer(_spec(["1"]), frames=[b"\0" * 4]), "protocol_error", "dimension 0"),
    "nested dim": (_infer(_spec([[1]]), frames=[b"\0" * 4]), "protocol_error", "dimension 0"),
    "nil dim": (_infer(_spec([None]), frames=[b""]), "protocol_error", "dimension 0"),
    "shape a map": (_infer(_spec({"a": 1}), frames=[b""]), "protocol_error", "shape must be a list"),
    "17 dims": (_infer(_spec([1] * 17), frames=[b"\0" * 4]), "protocol_error", "at most 16"),
    "datatype a list": (_infer(_spec([1], datatype=["FP32"]), frames=[b"\0" * 4]), "protocol_error", "datatype"),
    "datatype a map": (_infer(_spec([1], datatype={"a": 1}), frames=[b"\0" * 4]), "protocol_error", "datatype"),
    "name a list": (_infer(_spec([1], name=["x"]), frames=[b"\0" * 4]), "protocol_error", "'name'"),
    "spec not a map": (_infer([1, 2], frames=[b""]), "protocol_error", "must be a map"),
    "inputs a map": ([b"outrider/1 infer", msgpack.packb({"id": 1, "model": "echo", "inputs": {"x": 1}})],
                     "protocol_error", "'inputs' must be a list"),
    "BYTES frame too short": (_infer(_spec([1000], "BYTES"), frames=[b"\0" * 12]), "protocol_error", "ends inside"),
    "cancel target a list": ([b"outrider/1 cancel", msgpack.packb({"id": 2, "target": [1, 2]})],
                             "protocol_error", "'target'"),
    "cancel target a map": ([b"outrider/1 cancel", msgpack.packb({"id": 2, "target": {"a": 1}})],
                            "protocol_error", "'target'"),
    "cancel target a float": ([b"outrider/1 cancel", msgpack.packb({"id": 2, "target": 1.5})],
                              "protocol_error", "'target'"),
    "cancel without target": ([b"outrider/1 cancel", msgpack.packb({"id": 2})], "protocol_error", "'target'"),
    "id a float": ([b"outrider/1 health", msgpack.packb({"id": 1.5})], "protocol_error", "'id'"),
    "id a map": ([b"outrider/1 health", msgpack.packb({"id": {"a": 1}})], "protocol_error", "'id'"),
    "id too long": ([b"outrider/1 health", msgpack.packb({"id": "x" * 300})], "protocol_error", "'id'"),
    "model a map": (_infer(model={"a": 1}), "protocol_error", "'model'"),
    "parameters a list": (_infer(parameters=[1]), "protocol_error", "'parameters'"),
    "timeout_ms NaN": (_infer(parameters={"timeout_ms": float("nan")}), "bad_request", "timeout_ms"),
    "timeout_ms inf": (_infer(parameters={"timeout_ms": float("inf")}), "bad_request", "at most 86400000"),
    "timeout_ms -inf": (_infer(parameters={"timeout_ms": float("-inf")}), "bad_request", "timeout_ms"),
    "timeout_ms 1e300": (_infer(parameters={"timeout_ms": 1e300}), "bad_request", "at most 86400000"),
    "timeout_ms huge int": (_infer(parameters={"timeout_ms": 2**64 - 1}), "bad_request", "timeout_ms"),
    "timeout_ms negative": (_infer(parameters={"timeout_ms": -1}), "bad_request", "positive"),
    "timeout_ms zero": (_infer(parameters={"timeout_ms": 0}), "bad_request", "positive"),
    "timeout_ms bool": (_infer(parameters={"timeout_ms": True}), "bad_request", "timeout_ms"),
    "timeout_ms a list": (_infer(parameters={"timeout_ms": [1]}), "bad_request", "timeout_ms"),
    "header with ext type": ([b"outrider/1 infer", msgpack.packb({"id": 1, "t": msgpack.ExtType(5, b"abcd")})],
                             "protocol_error", "ext type"),
    "header with timestamp": ([b"outrider/1 infer", msgpack.packb({"id": 1, "t": msgpack.Timestamp(1, 0)})],
                              "protocol_error", "ext type"),
    "header with int keys": ([b"outrider/1 infer", msgpack.packb({1: 2})], "protocol_error", "msgpack"),
    "header declares a huge array": ([b"outrider/1 infer", b"\x81\xa2id\xdd\xff\xff\xff\xff"], "protocol_error",
                                     "msgpack"),
    "type frame of 1 MiB": ([b"outrider/1 infer" + b"x" * (1 << 20), msgpack.packb({"id": 1})], "protocol_error",
                            "type frame"),
    "200 frames": ([b"outrider/1 infer", msgpack.packb({"id": 1, "model": "echo"}), *([b""] * 198)], "too_large",
                   "frames"),
}


def test_hostile_headers_get_clean_errors_and_the_server_keeps_serving(server_factory, tmp_path):
    server = server_factory([_manifest(tmp_path)], ["outrider_echo"])
    for case, (frames, code, phrase) in HOSTILE.items():
        reply = _raw_call(server.address, frames)
        assert reply["ok"] is False, case
        assert reply["error"]["code"] == code, (case, reply)
        assert phrase in reply["error"]["message"], (case, reply)
        assert _raw_call(server.address, GOOD)["ok"] is True, case
    log = server.log()
    assert "Traceback" not in log and "internal" not in log, log
    assert server.proc.poll() is None


def test_generate_carries_no_tensors(server_factory, tmp_path):
    server = server_factory([_manifest(tmp_path, name="gen", backend="fake-generator")], ["outrider_test_backends"])
    header = {"id": 1, "model": "gen", "parameters": {"prompt": "hi"}}
    assert _raw_call(server.address, [b"outrider/1 generate", msgpack.packb(header)])["ok"] is True
    with_tensor = {**header, "inputs": [_spec([1])]}
    reply = _raw_call(server.address, [b"outrider/1 generate", msgpack.packb(with_tensor), b"\0" * 4])
    assert reply["error"]["code"] == "bad_request" and "no tensors" in reply["error"]["message"], reply
    assert "Traceback" not in server.log()


# -- limits: refused before decoding, naming the limit and the value -----------------------------


def test_limits_refuse_before_decoding_and_name_the_limit(server_factory, tmp_path):
    limits = {"max_rows": 100, "max_element_bytes": 1000, "max_elements": 500, "max_request_bytes": 3000}
    server = server_factory([_manifest(tmp_path, limits=limits)], ["outrider_echo"])
    cases = [
        ({"t": np.array([b""] * 101, dtype=object)}, "limits.max_rows = 100", "101 rows"),
        ({"x": np.zeros((50, 11), np.uint8)}, "limits.max_elements = 500", "550 elements"),
        ({"x": np.zeros((10, 40), np.float64)}, "limits.max_request_bytes = 3000", "3200 bytes"),
        ({"t": np.array([b"a" * 1001], dtype=object)}, "limits.max_element_bytes = 1000", "1001 bytes"),
        # fits the quick check on the whole frame; the second element is refused while decoding
        ({"t": np.array([b"", b"b" * 1500], dtype=object)}, "limits.max_element_bytes = 1000", "element 1 is 1500"),
    ]
    with server.client() as client:
        for inputs, limit, value in cases:
            with pytest.raises(TooLargeError) as info:
                client.infer("echo", inputs)
            assert limit in info.value.message and value in info.value.message, info.value.message
        ok = client.infer("echo", {"t": np.array([b"a" * 1000, b""], dtype=object)})
        assert ok["t"].tolist() == [b"a" * 1000, b""]
        stats = client.health()["models"]["echo"]["stats"]
    assert stats["failures"] == {"too_large": 1}  # only the one found while decoding reached the model
    assert "Traceback" not in server.log()


def test_a_100000_row_request_is_refused_by_default_without_growing_memory(server_factory, tmp_path):
    manifest = _manifest(tmp_path, batching={"max_batch_size": 32})
    server = server_factory([manifest], ["outrider_echo", "outrider_batching"])
    before = _rss_kb(server.proc.pid)
    frames = encode_message("infer", {"id": 1, "model": "echo"}, {"text": np.array([b""] * 100_000, dtype=object)})
    t0 = time.monotonic()
    reply = _raw_call(server.address, frames)
    elapsed = time.monotonic() - t0
    assert reply["error"]["code"] == "too_large", reply
    assert "100000 rows" in reply["error"]["message"] and "limits.max_rows = 2048" in reply["error"]["message"]
    assert elapsed < 2.0, elapsed
    assert _rss_kb(server.proc.pid) - before < 20_000  # KiB: the 400 kB message, not 100,000 objects


def test_a_100000_row_request_is_split_in_order_with_bounded_memory(server_factory, tmp_path):
    manifest = _manifest(tmp_path, batching={"max_batch_size": 1000}, limits={"max_rows": 200_000})
    server = server_factory([manifest], ["outrider_echo", "outrider_batching"])
    text = np.array([str(i).encode() for i in range(100_000)], dtype=object)
    peak_before = _rss_kb(server.proc.pid, "VmHWM")
    with server.client(timeout=60) as client:
        out = client.infer("echo", {"text": text})
        stats = client.health()["models"]["echo"]["stats"]
    assert out["text"].shape == (100_000,) and out["text"].tolist() == text.tolist()
    # 100 pieces of 1000 rows went through execute, plus the turn that cut the request.
    assert stats["batch_size"]["count"] >= 100 and stats["successes"] == 1, stats
    assert _rss_kb(server.proc.pid, "VmHWM") - peak_before < 150_000  # KiB


def test_a_small_request_is_answered_while_a_large_split_request_runs(server_factory, tmp_path):
    # row-time sleeps 0.2 ms per row: 5000 rows cost 1 s in one call, 20 ms per 100-row piece.
    manifest = _manifest(tmp_path, name="rows", backend="row-time", options={"row_ms": 0.2},
                         batching={"max_batch_size": 100, "max_queue_delay_ms": 1}, limits={"max_rows": 10_000})
    server = server_factory([manifest], ["outrider_test_backends", "outrider_batching"])
    big = np.arange(5000 * 2, dtype=np.float32).reshape(5000, 2)
    done: dict = {}

    def send_big():
        with server.client(timeout=30) as client:
            done["big"] = client.infer("rows", {"x": big})
            done["big_at"] = time.monotonic()

    thread = threading.Thread(target=send_big)
    thread.start()
    time.sleep(0.25)
    with server.client(timeout=30) as client:
        t0 = time.monotonic()
        small = client.infer("rows", {"x": np.full((1, 2), -1, np.float32)})
        small_at = time.monotonic()
    thread.join(30)
    assert small["x"].tolist() == [[-1, -1]]
    assert small_at - t0 < 0.3, small_at - t0
    assert small_at < done["big_at"], "the small request waited for the whole large one"
    np.testing.assert_array_equal(done["big"]["x"], big)


def test_decoding_does_not_stall_the_io_thread(server_factory, tmp_path):
    # A legal message of a million small strings: decoding it takes the instance thread about a
    # second; health requests sent meanwhile are answered by the I/O thread at once.
    manifest = _manifest(tmp_path, name="count", backend="count",
                         limits={"max_rows": 2_000_000, "max_elements": 2_000_000})
    server = server_factory([manifest], ["outrider_test_backends"])
    frames = encode_message("infer", {"id": 1, "model": "count"},
                            {"t": np.array([b"ab"] * 1_000_000, dtype=object)})
    big = _dealer(server.address)
    probe = _dealer(server.address)
    try:
        t0 = time.monotonic()
        big.send_multipart(frames)
        time.sleep(0.05)
        latencies = []
        for i in range(5):
            start = time.monotonic()
            probe.send_multipart([b"outrider/1 health", msgpack.packb({"id": i})])
            assert probe.poll(10000)
            probe.recv_multipart()
            latencies.append(time.monotonic() - start)
        # Every probe was answered while the big message was still being decoded: the I/O thread
        # was free the whole time (no absolute duration: a fast CPU decodes it in a quarter second).
        decoded_after_probes = not big.poll(0)
        assert big.poll(30000)
        reply = msgpack.unpackb(big.recv_multipart()[1])
        big_latency = time.monotonic() - t0
    finally:
        big.close()
        probe.close()
    assert reply["ok"] is True, reply
    assert decoded_after_probes, (latencies, big_latency)  # the decode is real work...
    assert max(latencies) < 0.5 * big_latency, (latencies, big_latency)  # ...done off the I/O thread


def test_queue_byte_budget_answers_overloaded(server_factory, tmp_path):
    mib = 1 << 20
    manifest = _manifest(tmp_path, name="rows", backend="row-time", options={"row_ms": 400},
                         limits={"max_request_bytes": mib}, scheduling={"max_queue_bytes": 2 * mib})
    server = server_factory([manifest], ["outrider_test_backends"])
    payload = np.zeros((1, mib // 4 - 16), np.float32)  # just under 1 MiB, one row: 400 ms each
    socks = [_dealer(server.address) for _ in range(3)]
    try:
        for i, sock in enumerate(socks):
            sock.send_multipart(encode_message("infer", {"id": i, "model": "rows"}, {"x": payload}))
            time.sleep(0.05)
        replies = []
        for sock in socks:
            assert sock.poll(10000)
            replies.append(msgpack.unpackb(sock.recv_multipart()[1]))
    finally:
        for sock in socks:
            sock.close()
    # The first is executing and the second waits: both count against the 2 MiB budget.
    assert [r["ok"] for r in replies] == [True, True, False], replies
    assert replies[2]["error"]["code"] == "overloaded"
    assert "scheduling.max_queue_bytes" in replies[2]["error"]["message"]
    with Client(server.address, timeout=10) as client:  # answered requests gave their bytes back
        assert client.infer("rows", {"x": payload})["x"].shape == payload.shape
