"""A real server process, real ZeroMQ: the echo model, malformed input, health, drain, security."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import msgpack
import numpy as np
import pytest
import zmq

import outrider
from outrider import AsyncClient, Client
from outrider.errors import (
    BadRequestError,
    ModelNotFoundError,
    ModelNotReadyError,
    ProtocolError,
    RequestTimeoutError,
    TooLargeError,
    UnavailableError,
)

from conftest import MANIFESTS, ROOT, write_manifest

GOOD = [b"outrider/1 infer", msgpack.packb({"id": "good", "model": "echo",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4]}]}), np.ones((1, 4), np.float32).tobytes()]


def _raw_call(address: str, frames: list, timeout_ms: int = 5000) -> dict:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(timeout_ms), "no reply to a malformed request"
        reply = sock.recv_multipart()
        assert reply[0] == b"outrider/1 reply"
        return msgpack.unpackb(reply[1])
    finally:
        sock.close()


def _header(**fields) -> bytes:
    return msgpack.packb({"id": 1, "model": "echo", **fields})


def _deep(n: int) -> dict:
    root: dict = {}
    node = root
    for _ in range(n):
        node["a"] = {}
        node = node["a"]
    return root


MALFORMED = {
    "one frame": ([b"outrider/1 infer"], "protocol_error"),
    "unknown type": ([b"outrider/1 explode", _header()], "protocol_error"),
    "wrong version": ([b"outrider/7 infer", _header()], "protocol_error"),
    "not outrider": ([b"GET / HTTP/1.0", b"\r\n"], "protocol_error"),
    "header not msgpack": ([b"outrider/1 infer", b"\xc1\xc1"], "protocol_error"),
    "header not a map": ([b"outrider/1 infer", msgpack.packb([1, 2, 3])], "protocol_error"),
    "id missing": ([b"outrider/1 infer", msgpack.packb({"model": "echo"})], "protocol_error"),
    "id wrong type": ([b"outrider/1 infer", msgpack.packb({"id": [1], "model": "echo"})], "protocol_error"),
    "model not a string": ([b"outrider/1 infer", _header(model=5)], "protocol_error"),
    "unknown model": ([b"outrider/1 infer", _header(model="nope")], "model_not_found"),
    "unknown datatype": ([b"outrider/1 infer", _header(inputs=[{"name": "x", "datatype": "FP8", "shape": [1]}]), b"\0"], "protocol_error"),
    "shape x itemsize != frame": ([b"outrider/1 infer", _header(inputs=[{"name": "x", "datatype": "FP32", "shape": [2, 3]}]), b"\0" * 20], "protocol_error"),
    "missing tensor frame": ([b"outrider/1 infer", _header(inputs=[{"name": "x", "datatype": "FP32", "shape": [1]}])], "protocol_error"),
    "extra tensor frame": ([b"outrider/1 infer", _header(inputs=[]), b"\0\0\0\0"], "protocol_error"),
    "negative dim": ([b"outrider/1 infer", _header(inputs=[{"name": "x", "datatype": "FP32", "shape": [-1]}]), b""], "protocol_error"),
    "too many elements": ([b"outrider/1 infer", _header(inputs=[{"name": "x", "datatype": "UINT8", "shape": [1 << 30, 1 << 10]}]), b""], "too_large"),
    "bad BYTES encoding": ([b"outrider/1 infer", _header(inputs=[{"name": "s", "datatype": "BYTES", "shape": [1]}]), b"\xff\xff\0\0abc"], "protocol_error"),
    "header too big": ([b"outrider/1 infer", msgpack.packb({"id": 1, "model": "echo", "pad": "x" * 70000})], "too_large"),
    "header too deep": ([b"outrider/1 infer", msgpack.packb({"id": 1, "model": "echo", "p": _deep(40)})], "too_large"),
    "parameters not a map": ([b"outrider/1 infer", _header(parameters=[1])], "protocol_error"),
    "bad timeout_ms": ([b"outrider/1 infer", _header(parameters={"timeout_ms": -5})], "bad_request"),
    "generate on echo": ([b"outrider/1 generate", _header(parameters={"prompt": "hi"})], "bad_request"),
    "message too big": ([b"outrider/1 infer", _header(inputs=[{"name": "x", "datatype": "UINT8", "shape": [3 << 20]}]), b"\0" * (3 << 20)], "too_large"),
}


def test_echo_roundtrip_all_datatypes(echo_server):
    import ml_dtypes

    inputs = {
        "f32": np.random.default_rng(1).standard_normal((2, 384)).astype(np.float32),
        "i64": np.arange(6, dtype=np.int64).reshape(3, 2),
        "u8": np.frombuffer(b"abc", np.uint8),
        "b": np.array([True, False]),
        "bf16": np.array([1.5, 2.0], dtype=ml_dtypes.bfloat16),
        "text": np.array(["héllo", "wörld"]),
        "empty": np.zeros((0, 3), np.float32),
    }
    with echo_server.client() as client:
        out = client.infer("echo", inputs)
    for name, value in inputs.items():
        if name == "text":
            assert out[name].tolist() == [s.encode() for s in value]
        else:
            np.testing.assert_array_equal(out[name], value)
            assert out[name].dtype == value.dtype


def test_every_malformed_request_gets_an_error_and_the_server_keeps_serving(server_factory):
    server = server_factory([MANIFESTS / "echo.yaml"], ["outrider_echo"], args=["--max-message-mb", "2"])
    for case, (frames, code) in MALFORMED.items():
        reply = _raw_call(server.address, frames)
        assert reply["ok"] is False, case
        assert reply["error"]["code"] == code, (case, reply)
        assert reply["error"]["message"], case
        good = _raw_call(server.address, GOOD)
        assert good["ok"] is True and good["id"] == "good", case
    assert server.proc.poll() is None


def test_errors_reach_the_client_as_exceptions(echo_server):
    with echo_server.client() as client:
        with pytest.raises(ModelNotFoundError, match="no model named 'missing'") as info:
            client.infer("missing", {"x": np.zeros(1, np.float32)})
        assert isinstance(info.value, outrider.OutriderError) and info.value.code == "model_not_found"
        with pytest.raises(BadRequestError, match="timeout_ms"):
            client.infer("echo", {"x": np.zeros(1, np.float32)}, timeout_ms="soon")
        # still usable
        assert client.infer("echo", {"x": np.ones(1, np.float32)})["x"][0] == 1


def test_health_models_and_duplicate_id(echo_server):
    with echo_server.client() as client:
        health = client.health()
        assert health["ready"] is True and health["status"] == "ready"
        assert health["models"]["echo"]["state"] == "ready"
        models = client.models()
        assert [m["name"] for m in models] == ["echo"] and models[0]["ready"]
    result = subprocess.run([sys.executable, "-m", "outrider.cli", "health", "--connect", echo_server.address, "--json"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["models"]["echo"]["stats"]["load_seconds"] >= 0


def test_health_exit_status_when_nothing_listens(tmp_path):
    result = subprocess.run([sys.executable, "-m", "outrider.cli", "health", "--connect", f"ipc://{tmp_path}/none.sock",
                             "--timeout", "0.3"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "not ready" in result.stdout


def test_not_ready_before_warmup_then_ready(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: slow\nbackend: slow-warmup\noptions: {warmup_s: 6.0}\n")
    server = server_factory([manifest], ["outrider_test_backends"], wait=False)
    deadline = time.monotonic() + 30
    seen_loading = False
    with Client(server.address, timeout=1.0) as client:
        while time.monotonic() < deadline:
            try:
                health = client.health()
            except RequestTimeoutError:
                continue  # not bound yet
            if not health["ready"]:
                if seen_loading:  # checked once, early in the 6 s warmup; now wait for ready
                    time.sleep(0.05)
                    continue
                seen_loading = True
                assert health["models"]["slow"]["state"] == "loading"
                with pytest.raises(ModelNotReadyError, match="is loading"):
                    client.infer("slow", {"x": np.zeros(1, np.float32)})
                probe = subprocess.run([sys.executable, "-m", "outrider.cli", "health", "--connect", server.address],
                                       capture_output=True, timeout=30)
                assert probe.returncode == 1
            else:
                break
            time.sleep(0.05)
        assert seen_loading and health["ready"]
        assert client.infer("slow", {"x": np.ones(1, np.float32)})["x"][0] == 1


def test_failed_warmup_is_not_ready_with_reason(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: broken\nbackend: failing-warmup\n")
    server = server_factory([manifest], ["outrider_test_backends"], wait=False)
    with Client(server.address, timeout=2.0) as client:
        for _ in range(100):
            try:
                health = client.health()
            except RequestTimeoutError:
                continue
            if health["models"]["broken"]["state"] == "failed":
                break
            time.sleep(0.05)
        assert health["ready"] is False and health["status"] == "failed"
        assert "warmup exploded on purpose" in health["models"]["broken"]["reason"]
        with pytest.raises(ModelNotReadyError, match="warmup exploded"):
            client.infer("broken", {"x": np.zeros(1, np.float32)})


def test_execute_error_answers_the_request_and_the_model_keeps_serving(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: r\nbackend: raising\n")
    server = server_factory([manifest], ["outrider_test_backends"])
    with server.client() as client:
        with pytest.raises(outrider.ExecutionError, match="negative input on purpose"):
            client.infer("r", {"x": -np.ones(2, np.float32)})
        assert client.infer("r", {"x": np.ones(2, np.float32)})["x"].sum() == 2
        stats = client.health()["models"]["r"]["stats"]
        assert stats["failures"] == {"execution_error": 1} and stats["successes"] >= 1


def test_backend_preference_list_falls_back_with_reason(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: fb\nbackend: [never-available, echo]\n")
    server = server_factory([manifest], ["outrider_test_backends", "outrider_echo"])
    with server.client() as client:
        health = client.health()["models"]["fb"]
    assert health["backend"] == "echo"
    assert any("never available" in s for s in health["skipped_backends"])
    assert "skipped backend never-available" in server.log()


def test_input_contract_is_checked(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, """
name: typed
backend: echo
inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
outputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
""")
    server = server_factory([manifest], ["outrider_echo"])
    with server.client() as client:
        assert client.infer("typed", {"x": np.ones((3, 4), np.float32)})["x"].shape == (3, 4)
        with pytest.raises(BadRequestError, match=r"input 'x' has shape \[3, 5\]; expected \[-1, 4\]"):
            client.infer("typed", {"x": np.ones((3, 5), np.float32)})
        with pytest.raises(BadRequestError, match="input 'x' is INT32; expected FP32"):
            client.infer("typed", {"x": np.ones((1, 4), np.int32)})
        with pytest.raises(BadRequestError, match="has no input 'y'"):
            client.infer("typed", {"x": np.ones((1, 4), np.float32), "y": np.ones(1, np.float32)})
        with pytest.raises(BadRequestError, match="input 'x' is missing"):
            client.infer("typed", {})
        models = client.models()
    assert models[0]["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]


def test_client_timeout_is_clear_and_client_stays_usable(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: slow\nbackend: echo\noptions: {delay_ms: 400}\nwarmup: {iterations: 0}\n")
    server = server_factory([manifest], ["outrider_echo"])
    with server.client(timeout=0.1) as client:
        with pytest.raises(RequestTimeoutError, match="no reply .* within 0.1s"):
            client.infer("slow", {"x": np.zeros(1, np.float32)})
        time.sleep(0.5)  # the late reply arrives and must be ignored
        out = client.infer("slow", {"x": np.full(1, 7, np.float32)}, timeout=5)
        assert out["x"][0] == 7


def test_queued_request_deadline(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: slow\nbackend: echo\noptions: {delay_ms: 300}\nwarmup: {iterations: 0}\n")
    server = server_factory([manifest], ["outrider_echo"])

    async def run():
        async with AsyncClient(server.address, timeout=10) as client:
            first = asyncio.ensure_future(client.infer("slow", {"x": np.zeros(1, np.float32)}))
            await asyncio.sleep(0.05)
            second = client.infer("slow", {"x": np.zeros(1, np.float32)}, timeout_ms=50)
            return await asyncio.gather(first, second, return_exceptions=True)

    first, second = asyncio.run(run())
    assert isinstance(first, dict)
    assert isinstance(second, outrider.RequestTimeoutError) and "timed out" in second.message


def test_async_client_many_in_flight(echo_server):
    async def run():
        async with AsyncClient(echo_server.address, timeout=10) as client:
            outs = await asyncio.gather(*[client.infer("echo", {"x": np.full(3, i, np.float32)}) for i in range(50)])
            health = await client.health()
        return outs, health

    outs, health = asyncio.run(run())
    assert [int(o["x"][0]) for o in outs] == list(range(50))
    assert health["models"]["echo"]["stats"]["successes"] >= 50


def test_sigterm_drains_in_flight_requests(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: slow\nbackend: echo\noptions: {delay_ms: 300}\nwarmup: {iterations: 0}\n")
    server = server_factory([manifest], ["outrider_echo"], args=["--drain-timeout", "10"])

    async def run():
        async with AsyncClient(server.address, timeout=10) as client:
            pending = [asyncio.ensure_future(client.infer("slow", {"x": np.full(1, i, np.float32)})) for i in range(4)]
            await asyncio.sleep(0.15)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.1)
            late = await asyncio.gather(client.infer("slow", {"x": np.zeros(1, np.float32)}), return_exceptions=True)
            return await asyncio.gather(*pending, return_exceptions=True), late[0]

    results, late = asyncio.run(run())
    assert [float(r["x"][0]) for r in results] == [0.0, 1.0, 2.0, 3.0], results
    assert isinstance(late, UnavailableError)
    assert server.proc.wait(15) == 0
    assert "draining" in server.log()


def test_manifest_error_names_file_and_field(tmp_path):
    """Every error at once, the core's fields and the accelerator sections of the plugins loaded
    (the batching section belongs to the batching plugin)."""
    bad = write_manifest(tmp_path, "name: x\nbackend: echo\ninstances: zero\nbatching: {max_batch_size: -1}\n", "bad.yaml")
    result = subprocess.run([sys.executable, "-m", "outrider.cli", "serve", str(bad), "--plugin", "outrider_echo",
                             "--plugin", "outrider_batching",
                             "--bind", f"ipc://{tmp_path}/b.sock"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "bad.yaml: field 'instances'" in result.stderr
    assert "bad.yaml: field 'batching.max_batch_size': Input should be greater than or equal to 1" in result.stderr


def test_unknown_backend_and_misspelled_field(tmp_path):
    from outrider.errors import BackendUnavailableError, ManifestError
    from outrider.manifest import load_manifest
    from outrider.plugins import create_registry

    with pytest.raises(ManifestError, match="field 'instnaces': unknown field"):
        load_manifest(write_manifest(tmp_path, "name: x\nbackend: echo\ninstnaces: 2\n"))
    registry = create_registry(["outrider_echo"], load_entry_points=False)
    with pytest.raises(BackendUnavailableError, match="warp-drive: no plugin registers this backend"):
        registry.choose_backend(load_manifest(write_manifest(tmp_path, "name: x\nbackend: warp-drive\n")))


def test_overrides_from_cli_and_environment(tmp_path, monkeypatch):
    from outrider.manifest import load_manifest

    path = write_manifest(tmp_path, "name: m\nbackend: echo\ninstances: 1\n")
    monkeypatch.setenv("OUTRIDER_SET_INSTANCES", "3")
    monkeypatch.setenv("OUTRIDER_SET_SCHEDULING__MAX_QUEUE_SIZE", "7")
    manifest = load_manifest(path, ["device=cpu", "other:instances=9", "m:options.delay_ms=5"])
    assert manifest.instances == 3 and manifest.scheduling.max_queue_size == 7
    assert manifest.device == "cpu" and manifest.options == {"delay_ms": 5}
    assert load_manifest(path, ["instances=2"]).instances == 2  # the command line wins over env


def test_non_loopback_bind_needs_curve(tmp_path):
    manifest = MANIFESTS / "echo.yaml"
    result = subprocess.run([sys.executable, "-m", "outrider.cli", "serve", str(manifest), "--plugin", "outrider_echo",
                             "--bind", "tcp://0.0.0.0:57431"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "refusing to bind tcp://0.0.0.0:57431 without encryption" in result.stderr


def test_curve_encrypted_server_admits_only_allowed_clients(server_factory, tmp_path):
    from outrider.transport import CurveClientKeys, make_keys

    keys = tmp_path / "keys"
    allowed = tmp_path / "allowed"
    make_keys(str(keys), "server")
    client_public, client_secret = make_keys(str(keys), "client")
    make_keys(str(tmp_path / "stranger"), "stranger")
    allowed.mkdir()
    (allowed / "client.key").write_text(open(client_public).read())
    server = server_factory([MANIFESTS / "echo.yaml"], ["outrider_echo"], address="tcp://0.0.0.0:57433", wait=False,
                            args=["--curve-secret-key", str(keys / "server.key_secret"), "--curve-allow", str(allowed)])
    good = CurveClientKeys(str(keys / "server.key"), client_secret)
    deadline = time.monotonic() + 30
    with Client("tcp://127.0.0.1:57433", timeout=1.0, curve=good) as client:
        while True:
            try:
                assert client.infer("echo", {"x": np.ones(2, np.float32)})["x"].sum() == 2
                break
            except (RequestTimeoutError, ModelNotReadyError):
                assert time.monotonic() < deadline, server.log()
    stranger = CurveClientKeys(str(keys / "server.key"), str(tmp_path / "stranger" / "stranger.key_secret"))
    with Client("tcp://127.0.0.1:57433", timeout=1.0, curve=stranger) as client:
        with pytest.raises(RequestTimeoutError):
            client.infer("echo", {"x": np.ones(2, np.float32)})
    with Client("tcp://127.0.0.1:57433", timeout=1.0) as plain:
        with pytest.raises(RequestTimeoutError):
            plain.health()


def test_prometheus_metrics(server_factory):
    server = server_factory([MANIFESTS / "echo.yaml"], ["outrider_echo"], args=["--metrics-port", "57441"])
    with server.client() as client:
        for _ in range(3):
            client.infer("echo", {"x": np.ones(1, np.float32)})
    text = urllib.request.urlopen("http://127.0.0.1:57441/metrics", timeout=10).read().decode()
    assert 'outrider_requests_total{model="echo"} 3.0' in text
    assert 'outrider_model_ready{model="echo"} 1.0' in text
    assert "outrider_compute_seconds_bucket" in text


def test_plugins_command_lists_hooks_and_availability():
    env = dict(os.environ, OUTRIDER_PLUGINS="echo")
    result = subprocess.run([sys.executable, "-m", "outrider.cli", "plugins", "--json"], capture_output=True,
                            text=True, timeout=60, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert set(plugins) == {"echo"}  # the allow-list kept every other entry point out
    assert plugins["echo"]["hooks"] == ["outrider_register_backends"]
    assert plugins["echo"]["backends"] == [{"name": "echo", "available": True, "reason": ""}]
    assert plugins["echo"]["version"] == "0.1.0"


def test_import_outrider_is_light():
    code = "import sys, outrider; from outrider import Client; import outrider.server, outrider.cli; " \
           "print(sorted(m for m in ('torch', 'onnxruntime', 'tensorrt', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_echo_server_imports_no_framework(echo_server):
    maps = open(f"/proc/{echo_server.proc.pid}/maps").read()
    for lib in ("libtorch", "onnxruntime", "libnvinfer"):
        assert lib not in maps


class TestEchoConformance(__import__("outrider.testing", fromlist=["BackendConformance"]).BackendConformance):
    plugins = ["outrider_echo"]
    backend = "echo"
    manifest = {"name": "e", "backend": "echo",
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
                "outputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}]}
    sample_inputs = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}


def test_wait_ready_times_out_without_a_server_and_stops_when_its_process_exits(tmp_path):
    address = f"ipc://{tmp_path}/nobody.sock"
    with Client(address, timeout=1.0) as client:
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError, match="not ready within 0.3s"):
            client.wait_ready(0.3)
        assert time.monotonic() - started < 2.0
        exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        exited.wait()
        with pytest.raises(UnavailableError, match="exited with 3"):
            client.wait_ready(30, process=exited)
