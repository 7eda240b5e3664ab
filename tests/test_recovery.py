"""Crash isolation that isolates: worker processes killed at any moment, through a real server.

A killed worker (SIGKILL, as the OOM killer sends) must be noticed without a request arriving,
its in-flight requests answered once each, health must say so and recover by itself, and the
instance must be replaced. Every test is bounded in time, uses ipc:// addresses it made, and
registers its plugins explicitly (never through entry points).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from outrider import Client
from outrider.errors import OutriderError, UnavailableError
from outrider.protocol import encode_message

from conftest import MANIFESTS, write_manifest

PLUGINS = ["outrider_test_recovery"]
BATCHING = [*PLUGINS, "outrider_batching"]


def _x(value: float, n: int = 2, sleep_s: float | None = None) -> dict:
    inputs = {"x": np.full(n, value, np.float32)}
    if sleep_s is not None:
        inputs["s"] = np.full(n, sleep_s, np.float32)
    return inputs


def _model_health(client: Client, model: str) -> dict:
    return client.health(timeout=5)["models"][model]


def _worker_pids(client: Client, model: str) -> dict[int, int]:
    """Instance index -> worker pid, for instances that serve now."""
    out = {}
    for inst in _model_health(client, model)["instances"]:
        pid = (inst.get("backend") or {}).get("worker_pid")
        if pid and inst["state"] == "ready":
            out[inst["index"]] = pid
    return out


def _wait_for(client: Client, model: str, predicate, timeout: float, what: str) -> dict:
    end = time.monotonic() + timeout
    health = None
    while time.monotonic() < end:
        health = _model_health(client, model)
        if predicate(health):
            return health
        time.sleep(0.02)
    raise AssertionError(f"model {model}: {what} not within {timeout}s; last health: {health}")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    """Until the killed process has exited, every thread of it (a zombie, or reaped already).

    The main thread turns zombie before the others (ZeroMQ's) have exited, and only then can the
    parent see the exit: a zombie main thread alone does not mean the process is gone.
    """
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            threads = len(os.listdir(f"/proc/{pid}/task"))
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return
        if state in ("Z", "X") and threads <= 1:
            return
        time.sleep(0.002)
    raise AssertionError(f"process {pid} still runs {timeout}s after SIGKILL")


class RawClient:
    """A DEALER that counts replies per request id: 'exactly one reply' is checked on the wire."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.replies: dict[str, list[dict]] = {}
        self.sent: list[str] = []

    def send(self, rid: str, model: str, inputs: dict) -> None:
        self.sock.send_multipart(encode_message("infer", {"id": rid, "model": model}, inputs))
        self.sent.append(rid)

    def receive(self, timeout: float) -> bool:
        """Read one reply (False if none came within `timeout` s)."""
        if not self.sock.poll(int(timeout * 1000)):
            return False
        frames = self.sock.recv_multipart()
        assert frames[0].endswith(b"reply"), frames[0]
        header = msgpack.unpackb(frames[1])
        self.replies.setdefault(header["id"], []).append(header)
        return True

    def outstanding(self) -> list[str]:
        return [rid for rid in self.sent if rid not in self.replies]

    def collect(self, timeout: float) -> None:
        """Read until every request sent has a reply, then a little longer for duplicates."""
        end = time.monotonic() + timeout
        while self.outstanding() and time.monotonic() < end:
            self.receive(max(0.0, end - time.monotonic()))
        while self.receive(0.2):
            pass

    def check_one_reply_each(self) -> None:
        missing = self.outstanding()
        assert not missing, f"{len(missing)} request(s) never answered: {missing[:10]}"
        doubled = {rid: r for rid, r in self.replies.items() if len(r) > 1}
        assert not doubled, f"requests answered more than once: {doubled}"
        assert set(self.replies) <= set(self.sent), set(self.replies) - set(self.sent)

    def close(self) -> None:
        self.sock.close(0)


def test_killed_idle_worker_is_noticed_answered_and_replaced(server_factory):
    """SIGKILL an idle worker: health flips within a second without any request, the next request
    is answered (replacement or an immediate `unavailable`), and the model recovers by itself."""
    server = server_factory([MANIFESTS / "echo.yaml"], ["outrider_echo"],
                            args=["--set", "scheduling.instance_kind=process"])
    with server.client(timeout=15) as client:
        assert client.infer("echo", _x(1))["x"][0] == 1
        pid = _worker_pids(client, "echo")[0]

        # 1. Nobody sends anything: the death alone must show in health, naming pid and signal.
        killed = time.monotonic()
        _kill(pid)
        health = _wait_for(client, "echo", lambda h: not h["ready"], 1.0, "not ready after the worker was killed")
        assert client.health()["ready"] is False
        assert f"worker process {pid} was killed by signal SIGKILL" in health["reason"], health
        # 2. The next request is answered at once or by the replacement, never left waiting.
        start = time.monotonic()
        try:
            assert client.infer("echo", _x(2))["x"][0] == 2
        except UnavailableError as exc:
            assert "SIGKILL" in exc.message and "retry" in exc.message, exc.message
        assert time.monotonic() - start < 5
        # 3. Back to ready by itself, with a new worker.
        health = _wait_for(client, "echo", lambda h: h["ready"], 10.0, "ready again")
        recovered = time.monotonic() - killed
        assert client.health()["ready"] is True and client.health()["status"] == "ready"
        assert health["stats"]["instance_restarts"] == 1
        assert health["instances"][0]["generation"] == 1
        new_pid = _worker_pids(client, "echo")[0]
        assert new_pid != pid
        assert client.infer("echo", _x(3))["x"][0] == 3
        assert recovered < 10

        # 4. Killed again, and a request sent the moment the process is gone (before the
        #    supervisor's next look): answered by the replacement or `unavailable`, within seconds.
        _kill(new_pid)
        _wait_gone(new_pid)
        start = time.monotonic()
        try:
            assert client.infer("echo", _x(4))["x"][0] == 4
        except UnavailableError as exc:
            assert f"worker process {new_pid}" in exc.message, exc.message
        assert time.monotonic() - start < 5
        _wait_for(client, "echo", lambda h: h["ready"] and h["stats"]["instance_restarts"] == 2, 10.0, "ready again")
        assert client.infer("echo", _x(5))["x"][0] == 5
    assert server.proc.poll() is None
    assert "was killed by signal SIGKILL" in server.log()


def test_wedged_idle_worker_is_found_by_heartbeat_and_replaced(server_factory):
    """A worker that is alive but answers nothing (SIGSTOP stands in for a deadlock) is found by
    the instance's heartbeat, not by a request: killed, reported, replaced."""
    server = server_factory([MANIFESTS / "echo.yaml"], ["outrider_echo"],
                            args=["--set", "scheduling.instance_kind=process"])
    with server.client(timeout=15) as client:
        pid = _worker_pids(client, "echo")[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            health = _wait_for(client, "echo", lambda h: not h["ready"], 10.0, "not ready after the worker froze")
            assert f"worker process {pid} did not answer health within 5s and was killed" in health["reason"], health
            health = _wait_for(client, "echo", lambda h: h["ready"], 10.0, "ready again")
        finally:
            _kill(pid)
        assert health["stats"]["instance_restarts"] == 1
        assert _worker_pids(client, "echo")[0] != pid
        assert client.infer("echo", _x(1))["x"][0] == 1


def test_worker_killed_mid_batch_answers_each_request_once(server_factory, tmp_path):
    """The batcher must hand the crash to the instance: each request of the killed batch gets
    one error reply naming the instance and the signal; queued requests are served afterwards."""
    journal = tmp_path / "journal.jsonl"
    manifest = write_manifest(tmp_path, f"""
name: b
backend: sleepy
options: {{journal: "{journal}"}}
scheduling: {{instance_kind: process}}
batching: {{max_batch_size: 4, max_queue_delay_ms: 200}}
warmup: {{iterations: 0}}
""")
    server = server_factory([manifest], BATCHING)
    raw = RawClient(server.address)
    try:
        with server.client(timeout=15) as client:
            pid = _worker_pids(client, "b")[0]
            # r0 keeps the worker busy for a second while r1-r5 queue up behind it: the next
            # batch is r1-r4 (a batched call of four requests), and r5 waits for the one after.
            raw.send("r0", "b", _x(0, n=1, sleep_s=1.0))
            time.sleep(0.2)
            for i in range(1, 6):
                raw.send(f"r{i}", "b", _x(i, n=1, sleep_s=4.0))
            end = time.monotonic() + 15
            while len(journal.read_text().splitlines() if journal.exists() else []) < 2:
                assert time.monotonic() < end, "the worker never started the second batch"
                time.sleep(0.01)
            running = json.loads(journal.read_text().splitlines()[1])
            assert running["pid"] == pid
            in_flight = {f"r{int(v)}" for v in running["x"]}
            assert in_flight == {"r1", "r2", "r3", "r4"}, in_flight
            _kill(pid)
            raw.collect(timeout=30)
            raw.check_one_reply_each()
            assert raw.replies["r0"][0]["ok"] is True
            for rid in sorted(in_flight):
                reply = raw.replies[rid][0]
                assert reply["ok"] is False, (rid, reply)
                assert reply["error"]["code"] == "execution_error", (rid, reply)
                message = reply["error"]["message"]
                assert f"worker process {pid} was killed by signal SIGKILL" in message, message
                assert "instance 0" in message, message
            # r5 waited: served by the replacement
            assert raw.replies["r5"][0]["ok"] is True, raw.replies["r5"]
            health = _wait_for(client, "b", lambda h: h["ready"], 15.0, "ready again")
            assert health["stats"]["instance_restarts"] == 1
            assert health["stats"]["failures"] == {"execution_error": len(in_flight)}
    finally:
        raw.close()
    assert server.proc.poll() is None


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_ready_follows_the_backends_own_health(server_factory, tmp_path, kind):
    """A backend whose health() says unhealthy takes its instance out of service: not ready,
    requests answered `unavailable` at once; ready again when the backend says healthy."""
    flag = tmp_path / "unhealthy"
    manifest = write_manifest(tmp_path, f"""
name: u
backend: sleepy
options: {{unhealthy_file: "{flag}"}}
scheduling: {{instance_kind: {kind}}}
warmup: {{iterations: 0}}
""")
    server = server_factory([manifest], PLUGINS)
    with server.client(timeout=15) as client:
        assert client.infer("u", _x(1))["x"][0] == 1
        flag.write_text("disk on fire")
        health = _wait_for(client, "u", lambda h: not h["ready"], 5.0, "not ready while the backend is unhealthy")
        assert "disk on fire" in health["reason"], health
        assert health["instances"][0]["serving"] is False
        assert client.health()["ready"] is False
        with pytest.raises(UnavailableError, match="disk on fire"):
            client.infer("u", _x(2))
        flag.unlink()
        health = _wait_for(client, "u", lambda h: h["ready"], 5.0, "ready once the backend is healthy again")
        assert health["stats"]["instance_restarts"] == 0  # out of service, not replaced
        assert client.infer("u", _x(3))["x"][0] == 3


def test_two_instances_one_killed_one_busy(server_factory, tmp_path):
    """With two worker instances: a killed idle worker costs no request (the other instance takes
    the work, and the model stays ready), and a free instance serves while the other is busy."""
    manifest = write_manifest(tmp_path, """
name: two
backend: sleepy
instances: 2
scheduling: {instance_kind: process}
warmup: {iterations: 0}
""")
    server = server_factory([manifest], PLUGINS)
    with server.client(timeout=15) as client:
        _wait_for(client, "two", lambda h: h["state"] == "ready", 30.0, "both instances serving")
        pids = _worker_pids(client, "two")
        assert len(pids) == 2
        victim = pids[0]
        _kill(victim)
        _wait_gone(victim)
        # Whichever instance pulls these, each is served: none is lost to the dead worker.
        for i in range(8):
            assert client.infer("two", _x(i))["x"][0] == i
            assert client.health()["models"]["two"]["ready"] is True
        health = _wait_for(client, "two", lambda h: h["state"] == "ready" and h["stats"]["instance_restarts"] == 1,
                           10.0, "both instances serving again")
        assert health["stats"]["failures"] == {}

        # One instance busy for 3 s; the other answers at once.
        slow: dict = {}

        def run_slow() -> None:
            with server.client(timeout=15) as other:
                start = time.monotonic()
                slow["x"] = other.infer("two", _x(100, sleep_s=3.0))["x"][0]
                slow["seconds"] = time.monotonic() - start

        thread = threading.Thread(target=run_slow)
        thread.start()
        time.sleep(0.5)
        start = time.monotonic()
        assert client.infer("two", _x(7))["x"][0] == 7
        quick = time.monotonic() - start
        thread.join(20)
        assert slow.get("x") == 100, slow
        assert quick < 1.5, f"the free instance took {quick:.2f}s to answer while the other was busy"
        assert slow["seconds"] >= 2.9


def test_process_instances_get_a_default_execute_timeout(tmp_path):
    from outrider.backend import Backend, BackendChoice
    from outrider.manifest import DEFAULT_PROCESS_EXECUTE_TIMEOUT_MS, validate_manifest
    from outrider.serving.served_model import ServedModel

    def served(scheduling: str) -> ServedModel:
        manifest = validate_manifest({"name": "m", "backend": "echo", "scheduling": json.loads(scheduling)}, "<test>")
        return ServedModel(manifest, BackendChoice(backend=Backend, device="cpu"), make_task=lambda: None)

    assert DEFAULT_PROCESS_EXECUTE_TIMEOUT_MS == 60_000
    assert served('{"instance_kind": "process"}').execute_timeout_ms == DEFAULT_PROCESS_EXECUTE_TIMEOUT_MS
    assert served('{"instance_kind": "process", "execute_timeout_ms": 1500}').execute_timeout_ms == 1500
    assert served('{"instance_kind": "thread"}').execute_timeout_ms is None  # a thread cannot be killed
    assert served('{"instance_kind": "thread", "execute_timeout_ms": 200}').execute_timeout_ms == 200


@pytest.mark.slow
def test_chaos_kill_workers_under_load(server_factory, tmp_path):
    """Workers killed again and again under load from a few clients for ~20 s: every request gets
    exactly one reply (a result, or an error that names the crash), and the server ends healthy."""
    manifest = write_manifest(tmp_path, """
name: chaos
backend: sleepy
instances: 2
options: {sleep_ms: 3}
scheduling: {instance_kind: process}
batching: {max_batch_size: 4, max_queue_delay_ms: 2}
warmup: {iterations: 0}
""")
    server = server_factory([manifest], BATCHING)
    duration = 20.0
    stop = threading.Event()
    clients = [RawClient(server.address) for _ in range(3)]
    failures: list[str] = []

    def load(n: int, raw: RawClient) -> None:
        count = 0
        try:
            while not stop.is_set():
                while len(raw.outstanding()) < 4 and not stop.is_set():
                    raw.send(f"c{n}-{count}", "chaos", _x(count % 1000, n=1 + count % 3))
                    count += 1
                raw.receive(0.05)
            raw.collect(timeout=30)
        except Exception as exc:  # reported by the main thread
            failures.append(f"client {n}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=load, args=(n, raw)) for n, raw in enumerate(clients)]
    kills = 0
    rng = random.Random(8)
    with server.client(timeout=15) as client:
        _wait_for(client, "chaos", lambda h: h["state"] == "ready", 30.0, "both instances serving")
        for t in threads:
            t.start()
        end = time.monotonic() + duration
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.3, 1.2))
            pids = list(_worker_pids(client, "chaos").values())
            if pids:
                _kill(rng.choice(pids))
                kills += 1
        stop.set()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a load thread did not finish"
        assert not failures, failures

        codes: dict[str, int] = {}
        for raw in clients:
            raw.check_one_reply_each()
            for rid in raw.sent:
                reply = raw.replies[rid][0]
                code = "ok" if reply["ok"] else reply["error"]["code"]
                codes[code] = codes.get(code, 0) + 1
                if not reply["ok"]:
                    assert code in ("execution_error", "unavailable"), reply
                    assert "SIGKILL" in reply["error"]["message"] or "no instance able to serve" in \
                        reply["error"]["message"], reply
            raw.close()
        print(f"chaos: {kills} kills in {duration:g}s, replies by code: {codes}")
        assert kills >= 10
        assert codes.get("ok", 0) > 100, codes

        health = _wait_for(client, "chaos", lambda h: h["state"] == "ready", 20.0, "healthy after the chaos")
        assert client.health()["ready"] is True
        assert health["stats"]["instance_restarts"] >= kills
        assert client.infer("chaos", _x(1))["x"][0] == 1
    assert server.proc.poll() is None
