"""What an audit found untested (issue 8), each through a real `outrider serve` process:

- SIGTERM with 100 requests and 4 streams in flight: each gets exactly one final reply (its
  result, or `unavailable` when the drain could not finish it) and the process exits 0;
- a second signal during the drain exits at once, non-zero;
- the manifest's default deadline (`scheduling.timeout_ms`) and a request's own overriding it;
- `batching.preserve_ordering` is refused with a clear error (it was never honoured);
- a 10x overload burst of 1 MB requests: every request answered once, RSS bounded by the queue.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter, defaultdict

import msgpack
import numpy as np
import yaml
import zmq

from conftest import raw_dealer as _dealer, write_manifest
from outrider.protocol import encode_message
from outrider.zmq_front import _BURST_BYTES
from outrider.transport import SERVER_RCVHWM


def _recv(sock: zmq.Socket, timeout_s: float):
    """(kind, header) of the next message, or None after timeout_s."""
    if not sock.poll(int(timeout_s * 1000)):
        return None
    frames = sock.recv_multipart()
    return frames[0].split(b" ", 1)[-1].decode(), msgpack.unpackb(frames[1], raw=False)


def _manifest(tmp_path, name: str, **fields) -> str:
    data = {"name": name, "backend": "echo", "device": "cpu", "warmup": {"iterations": 0}, **fields}
    return write_manifest(tmp_path, yaml.safe_dump(data), f"{name}.yaml")


def _wait_for_log(server, text: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while text not in server.log():
        assert time.monotonic() < end, f"{text!r} not logged within {timeout_s}s:\n{server.log()[-3000:]}"
        time.sleep(0.01)


# -- 1. SIGTERM drains 100 requests and 4 streams --------------------------------------------

def test_sigterm_answers_every_request_and_stream_once_and_exits_0(server_factory, tmp_path):
    """100 echo requests of 20 ms (2 s of work for one instance) and 4 streams, 2 short and 2
    that need far longer than the 3 s drain: the drain finishes what it can, the rest is
    answered `unavailable`; nothing is answered twice, no chunk follows a final reply."""
    slow = _manifest(tmp_path, "slow", options={"delay_ms": 20})
    # 30 s of work: whatever the machine's speed, the 3 s drain cannot finish it.
    stuck = _manifest(tmp_path, "stuck", options={"delay_ms": 30_000})
    tiny = write_manifest(tmp_path, "{name: tiny, backend: hf-llama, options: {seed: 3}}\n", "tiny.yaml")
    server = server_factory([slow, stuck, tiny], ["outrider_echo", "outrider_test_hf_llama"],
                            args=["--drain-timeout", "3"])
    sock = _dealer(server.address, RCVHWM=0, SNDHWM=0)
    streams = {"s0": 16, "s1": 16, "s2": 240, "s3": 240}  # max_tokens: prompt + 240 fits the 256-token cache
    finals: dict[str, list[dict]] = defaultdict(list)
    chunks: Counter = Counter()
    chunk_text: dict[str, str] = defaultdict(str)
    late_chunks = []
    try:
        for rid, max_tokens in streams.items():
            sock.send_multipart(encode_message("generate", {"id": rid, "model": "tiny", "parameters": {
                "prompt": "abc abc", "max_tokens": max_tokens, "stream": True}}))
        for i in range(100):
            sock.send_multipart(encode_message("infer", {"id": f"e{i}", "model": "slow"},
                                               {"x": np.full((1, 4), i, np.float32)}))
        sock.send_multipart(encode_message("infer", {"id": "stuck", "model": "stuck"},
                                           {"x": np.zeros((1, 4), np.float32)}))

        def take(message) -> None:
            kind, header = message
            rid = header["id"]
            if kind == "chunk":
                if rid in finals:
                    late_chunks.append(rid)
                chunks[rid] += 1
                chunk_text[rid] += header["text"]
            else:
                finals[rid].append(header)

        # Every stream in flight (a chunk seen) before the signal; the echo requests were sent first.
        end = time.monotonic() + 60
        while not all(chunks[rid] for rid in ("s2", "s3")):
            assert time.monotonic() < end, f"streams never started: {dict(chunks)}\n{server.log()[-3000:]}"
            message = _recv(sock, 1.0)
            if message:
                take(message)
        answered_before = set(finals)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while server.proc.poll() is None:
            message = _recv(sock, 0.1)
            if message:
                take(message)
            assert time.monotonic() - signalled < 30, "server still running 30 s after SIGTERM (drain timeout 3 s)"
        while (message := _recv(sock, 0.5)) is not None:  # whatever is left in this socket's pipe
            take(message)
    finally:
        sock.close(0)

    code = server.proc.wait(5)
    expected = {f"e{i}" for i in range(100)} | set(streams) | {"stuck"}
    twice = {rid: len(f) for rid, f in finals.items() if len(f) != 1}
    missing = expected - set(finals)
    outcome = Counter("ok" if f[0]["ok"] else f[0]["error"]["code"] for f in finals.values())
    figures = f"outcomes {dict(outcome)}, answered before SIGTERM {len(answered_before)}, chunks {dict(chunks)}"
    assert not missing, f"{len(missing)} request(s) never answered: {sorted(missing)[:10]}; {figures}"
    assert not twice and set(finals) == expected, f"answered more than once: {twice}; {figures}"
    assert not late_chunks, f"chunks after the final reply: {late_chunks}"
    for rid, (header,) in finals.items():
        if header["ok"]:
            if rid in streams:
                assert header["finish_reason"] == "length" and len(header["token_ids"]) == streams[rid], header
                assert chunk_text[rid] == header["text"]
        else:
            assert header["error"]["code"] == "unavailable", (rid, header)
    # The drain did both of its jobs: work finished after the signal, and what it could not
    # finish in 3 s (the 30 s request) was answered rather than dropped.
    finished_in_drain = {rid for rid, (h,) in finals.items() if h["ok"]} - answered_before
    assert finished_in_drain, f"nothing finished during the drain; {figures}"
    assert not finals["stuck"][0]["ok"], figures
    assert code == 0, f"exit code {code}\n{server.log()[-3000:]}"
    assert "draining" in server.log()


# -- 2. A second signal exits at once --------------------------------------------------------

def test_second_sigterm_during_the_drain_exits_at_once_non_zero(server_factory, tmp_path):
    slow = _manifest(tmp_path, "slow", options={"delay_ms": 20_000})
    server = server_factory([slow], ["outrider_echo"], args=["--drain-timeout", "60"])
    sock = _dealer(server.address)
    try:
        sock.send_multipart(encode_message("infer", {"id": 1, "model": "slow"}, {"x": np.zeros(1, np.float32)}))
        with server.client() as client:  # in flight (being executed) before the signal
            end = time.monotonic() + 10
            while client.health()["server"]["inflight"] != 1:
                assert time.monotonic() < end
                time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        _wait_for_log(server, "draining")
        time.sleep(0.2)
        assert server.proc.poll() is None, "the first SIGTERM did not drain: the server exited"
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = server.proc.wait(30)
        took = time.monotonic() - signalled
    finally:
        sock.close(0)
    assert code != 0, f"forced exit returned {code}"
    assert took < 3.0, f"the second signal took {took:.1f}s to end the server (its request needs 20 s)"
    assert "second signal" in server.log()


# -- 3. The manifest's default deadline ------------------------------------------------------

def test_manifest_default_timeout_applies_and_a_requests_own_overrides_it(server_factory, tmp_path):
    """`scheduling.timeout_ms: 800` on a model busy for 3 s: a request without timeout_ms is
    answered `timeout` after ~0.8 s; one with timeout_ms 100 after ~0.1 s; one with 20,000 waits
    and is served."""
    slow = _manifest(tmp_path, "slow", options={"delay_ms": 3000}, scheduling={"timeout_ms": 800})
    server = server_factory([slow], ["outrider_echo"])
    sock = _dealer(server.address)
    x = {"x": np.zeros(1, np.float32)}
    try:
        sock.send_multipart(encode_message("infer", {"id": "busy", "model": "slow"}, x))
        with server.client() as client:  # "busy" is executing (taken from the queue) before the rest is sent
            end = time.monotonic() + 10
            while not (client.health()["server"]["inflight"] == 1 and client.health()["models"]["slow"]["queue_depth"] == 0):
                assert time.monotonic() < end
                time.sleep(0.01)
        sent = time.monotonic()
        sock.send_multipart(encode_message("infer", {"id": "own-long", "model": "slow", "parameters": {"timeout_ms": 20_000}}, x))
        sock.send_multipart(encode_message("infer", {"id": "default", "model": "slow"}, x))
        sock.send_multipart(encode_message("infer", {"id": "own-short", "model": "slow", "parameters": {"timeout_ms": 100}}, x))
        replies = {}
        while len(replies) < 4 and (message := _recv(sock, 15.0)) is not None:
            replies[message[1]["id"]] = (time.monotonic() - sent, message[1])
    finally:
        sock.close(0)
    assert set(replies) == {"busy", "own-long", "default", "own-short"}, replies
    took = {rid: round(t, 3) for rid, (t, _) in replies.items()}
    code = {rid: "ok" if h["ok"] else h["error"]["code"] for rid, (_, h) in replies.items()}
    assert code == {"busy": "ok", "own-long": "ok", "default": "timeout", "own-short": "timeout"}, (code, took)
    # Sent after "busy" started its 3 s: "default" waited the manifest's 0.8 s, not until served.
    assert 0.8 <= took["default"] < 2.0, took
    assert took["own-short"] < 0.6, took  # its own 100 ms, well before the default's 800
    assert took["own-long"] > 3.0, took  # waited past the default and was served


# -- 4. batching.preserve_ordering is refused ------------------------------------------------

def test_preserve_ordering_is_refused_with_a_clear_error(server_factory, tmp_path):
    manifest = _manifest(tmp_path, "ordered", batching={"max_batch_size": 8, "preserve_ordering": True})
    server = server_factory([manifest], ["outrider_echo", "outrider_batching"], wait=False)
    try:
        code = server.proc.wait(60)
    except Exception:
        raise AssertionError(f"a manifest setting preserve_ordering was served:\n{server.log()[-2000:]}")
    log = server.log()
    assert code == 2, log
    assert "ordered.yaml: field 'batching.preserve_ordering':" in log, log
    assert "matched to requests by id" in log, log
    assert "Traceback" not in log


# -- 5. Memory under a 10x overload burst ----------------------------------------------------

def _status_kb(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def test_overload_burst_answers_every_request_and_memory_stays_bounded(server_factory, tmp_path):
    """20 x max_queue_size requests of 1 MiB at once to a model that takes 200 ms each: every one
    is answered exactly once (ok or `overloaded`), and the server's peak RSS during the burst
    (VmHWM, reset before it) grows by less than what the server may hold by design, whatever the
    burst: the queue and the one executing, a connection's unread messages in libzmq
    (SERVER_RCVHWM, plus one being read) and one burst of the I/O loop (_BURST_BYTES, plus the
    message that crossed it), plus 16 MiB. No timing enters the bound: a loop that falls behind
    makes libzmq stop reading the client, not buffer more."""
    queue, size_mib, burst = 8, 1, 160
    slow = _manifest(tmp_path, "slow", options={"delay_ms": 200}, scheduling={"max_queue_size": queue})
    server = server_factory([slow], ["outrider_echo"])
    pid = server.proc.pid
    payload = np.ones((1, size_mib << 18), np.float32)  # 1 MiB
    sock = _dealer(server.address, SNDHWM=0, RCVHWM=0)
    try:
        for rid in range(3):  # warm the allocator with requests of this size, one at a time
            sock.send_multipart(encode_message("infer", {"id": f"warm{rid}", "model": "slow"}, {"x": payload}))
            assert _recv(sock, 10.0)[1]["ok"]
        time.sleep(0.2)
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = _status_kb(pid, "VmRSS")
        # The whole burst waits for the server at once (the worst case for its reader): sent while
        # the server is stopped, it meets every thread of the server racing to read on resume.
        os.kill(pid, signal.SIGSTOP)
        try:
            for rid in range(burst):
                sock.send_multipart(encode_message("infer", {"id": rid, "model": "slow"}, {"x": payload}), copy=False)
            time.sleep(0.5)
        finally:
            os.kill(pid, signal.SIGCONT)
        replies: dict[int, list[dict]] = defaultdict(list)
        while (message := _recv(sock, 3.0)) is not None:
            replies[message[1]["id"]].append(message[1])
        peak, after = _status_kb(pid, "VmHWM"), _status_kb(pid, "VmRSS")
    finally:
        sock.close(0)
    outcome = Counter("ok" if r[0]["ok"] else r[0]["error"]["code"] for r in replies.values())
    held = (queue + 1) + (SERVER_RCVHWM + 1) + (_BURST_BYTES // (1 << 20) + 1)  # messages of 1 MiB
    bound_kb = (held * size_mib + 16) * 1024
    figures = (f"RSS before {before / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB (+{(peak - before) / 1024:.1f} MiB), "
               f"after {after / 1024:.1f} MiB; bound +{bound_kb / 1024:.0f} MiB; burst {burst} x {size_mib} MiB "
               f"({burst * size_mib} MiB) into a queue of {queue}; outcomes {dict(outcome)}")
    print(figures)
    assert sorted(replies) == list(range(burst)), f"unanswered: {sorted(set(range(burst)) - set(replies))}; {figures}"
    assert all(len(r) == 1 for r in replies.values()), figures
    assert set(outcome) <= {"ok", "overloaded"} and outcome["overloaded"] >= burst - 2 * (queue + 1), figures
    assert outcome["ok"] >= queue, figures
    assert peak - before < bound_kb, figures
