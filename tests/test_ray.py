"""outrider_http.ray_serve: Outrider models as Ray Serve replicas (skipped without `ray[serve]`).

In process (no Ray cluster): a replica's server, its handle methods, its HTTP routes, its health
check, and the builders' options. On a local Ray cluster (slow: Ray's start alone takes ~20 s
here): two echo replicas that share the requests (HTTP ingress and handle calls), one of them
killed under load and replaced with every request answered exactly once, and streamed
generation with speculative decoding inside a replica, through a handle and over HTTP.
Ray is started with 2 CPUs, no dashboard, a small object store, and shut down at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import MANIFESTS, ROOT, TEST_PLUGINS, free_port

sys.path.insert(0, str(TEST_PLUGINS))  # in-process replicas register test plugins by module name

ECHO = str(MANIFESTS / "echo.yaml")
TINY = {"name": "tiny", "backend": "hf-llama", "options": {"seed": 3},
        "speculative": {"drafters": ["ngram"], "max_draft_tokens": 8, "cost_gate": False}}  # drafts counted
RAYSERVICE = ROOT / "deploy" / "ray" / "rayservice.yaml"


def test_importing_outrider_does_not_import_ray() -> None:
    """The core, its CLI and the HTTP plugin stay free of Ray; the Ray module says what to install."""
    code = (
        "import sys\n"
        "import outrider, outrider.server, outrider.cli, outrider.client, outrider_http\n"
        "assert 'ray' not in sys.modules, 'importing outrider imported ray'\n"
        "sys.modules['ray'] = None  # as if Ray were not installed\n"
        "try:\n"
        "    import outrider_http.ray_serve\n"
        "except ImportError as exc:\n"
        "    assert \"outrider[ray]\" in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('imported without ray')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def orray():
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'outrider[ray]'")
    pytest.importorskip("ray.serve", reason="needs ray[serve]: pip install 'outrider[ray]'")
    from outrider_http import ray_serve as module

    return module


# -- in process: no Ray cluster ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_replica_serves_its_models_in_process(orray) -> None:
    httpx = pytest.importorskip("httpx")
    from outrider import ModelNotFoundError, UnavailableError

    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()  # a replica killed with SIGKILL leaves its socket directory behind: the next one sweeps it
    stale = Path(tempfile.gettempdir()) / f"outrider-ray-{exited.pid}-killed"
    stale.mkdir()
    (stale / "outrider.sock").touch()
    replica = orray.OutriderReplica([ECHO], ["outrider_echo"])
    tmp = Path(replica.address[len("ipc://"):]).parent
    assert not stale.exists()
    try:
        assert replica.address.startswith("ipc://") and tmp.is_dir()
        replica.check_health()  # ready: does not raise
        health = replica.health()
        assert health["ready"] and health["replica"]["address"] == replica.address

        async def calls():
            out = await replica.infer("echo", {"x": np.arange(5, dtype=np.float32), "s": np.array(["a", "b"])})
            with pytest.raises(ModelNotFoundError):
                await replica.infer("nope", {})
            transport = httpx.ASGITransport(app=replica.asgi_app())
            async with httpx.AsyncClient(transport=transport, base_url="http://replica") as http:
                body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.5, 2.5]}]}
                reply = await http.post("/v2/models/echo/infer", json=body)
                who = await http.get("/outrider/replica")
                missing = await http.post("/v2/models/nope/infer", json=body)
                not_generating = await http.post("/v2/models/echo/generate", json={"text_input": "hi"})
                metrics = await http.get("/metrics")  # the HTTP front's own routes, /metrics included
            return out, reply, who, missing, not_generating, metrics

        out, reply, who, missing, not_generating, metrics = asyncio.run(calls())
        assert out["x"].tolist() == [0, 1, 2, 3, 4] and [s.decode() for s in out["s"]] == ["a", "b"]
        assert reply.status_code == 200, reply.text
        assert reply.json()["outputs"][0]["data"] == [1.5, 2.5]
        assert reply.headers["x-outrider-replica"] == replica.info["replica_id"] == who.json()["replica_id"]
        assert missing.status_code == 404 and not_generating.status_code == 400
        assert metrics.status_code == 200 and 'outrider_requests_total{model="echo"}' in metrics.text
        assert replica.health()["models"]["echo"]["stats"]["requests"] >= 2

        replica.server.draining = True  # what a SIGTERM does: not ready, so Serve's check fails
        with pytest.raises(UnavailableError, match="not ready: draining"):
            replica.check_health()
    finally:
        replica._close(1.0)
    assert not tmp.exists(), "the replica's temporary directory outlived it"
    with pytest.raises(UnavailableError):
        replica.check_health()


@pytest.mark.timeout(60)
def test_replica_refuses_to_start_when_a_model_fails(orray) -> None:
    """Serve only routes to a replica whose constructor returned: a model that fails raises there."""
    from outrider import ManifestError, OutriderError

    with pytest.raises(OutriderError, match="warmup exploded on purpose"):
        orray.OutriderReplica([{"name": "broken", "backend": "failing-warmup"}], ["outrider_test_backends"])
    with pytest.raises(ManifestError, match="instances"):
        orray.OutriderReplica([ECHO], ["outrider_echo"], overrides=["instances=0"])


@pytest.mark.timeout(60)
def test_a_cancelled_call_cancels_its_request_in_the_replica(orray) -> None:
    """Serve cancels a call whose caller left (response.cancel(), an HTTP client gone): the queued
    request is answered `cancelled` in Outrider and never runs."""
    replica = orray.OutriderReplica([{"name": "slow", "backend": "row-time", "options": {"row_ms": 1500}}],
                                    ["outrider_test_backends"])
    try:
        async def calls():
            running = asyncio.ensure_future(replica.infer("slow", {"x": np.ones(1, np.float32)}))
            await asyncio.sleep(0.3)
            queued = asyncio.ensure_future(replica.infer("slow", {"x": np.full(1, 2, np.float32)}))
            await asyncio.sleep(0.3)
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            return await running

        assert asyncio.run(calls())["x"].tolist() == [1.0]
        stats = replica.health()["models"]["slow"]["stats"]
        assert stats["failures"].get("cancelled") == 1 and stats["successes"] == 1, stats
    finally:
        replica._close(1.0)


def _options(app) -> dict:
    deployment = app._bound_deployment  # Serve keeps the options on the bound deployment
    config = deployment._deployment_config
    autoscaling = config.autoscaling_config
    return {"name": deployment.name, "num_replicas": config.num_replicas,
            "max_ongoing_requests": config.max_ongoing_requests, "actor": deployment.ray_actor_options,
            "autoscaling": autoscaling.model_dump() if hasattr(autoscaling, "model_dump") else autoscaling}


def test_builders_set_replicas_autoscaling_and_resources(orray) -> None:
    from ray.serve.config import AutoscalingConfig

    fixed = _options(orray.deployment([ECHO], ["outrider_echo"], num_replicas=3, ray_actor_options={"num_gpus": 1}))
    assert fixed["num_replicas"] == 3 and fixed["autoscaling"] is None
    assert fixed["max_ongoing_requests"] == orray.DEFAULT_MAX_ONGOING_REQUESTS
    assert fixed["actor"]["num_cpus"] == 1 and fixed["actor"]["num_gpus"] == 1

    scaled = _options(orray.deployment([ECHO], autoscaling={"max_replicas": 8}))
    assert scaled["autoscaling"]["max_replicas"] == 8 and scaled["autoscaling"]["min_replicas"] == 1
    assert scaled["autoscaling"]["target_ongoing_requests"] == orray.DEFAULT_AUTOSCALING["target_ongoing_requests"]

    # `serve run outrider_http.ray_serve:build key=value ...` passes strings
    built = _options(orray.build({"manifests": f"{ECHO},{MANIFESTS / 'minilm.yaml'}", "plugins": "outrider_echo",
                                  "autoscaling": '{"max_replicas": 3, "target_ongoing_requests": 4}',
                                  "num_cpus": "2", "max_ongoing_requests": "32"}))
    assert built["autoscaling"]["max_replicas"] == 3 and built["autoscaling"]["target_ongoing_requests"] == 4
    assert built["actor"]["num_cpus"] == 2.0 and built["max_ongoing_requests"] == 32
    assert _options(orray.build({"manifests": ECHO, "num_replicas": "2"}))["num_replicas"] == 2

    with pytest.raises(ValueError, match="not both"):
        orray.deployment([ECHO], num_replicas=2, autoscaling=True)
    with pytest.raises(ValueError, match="above max_ongoing_requests"):
        orray.deployment([ECHO], autoscaling={"target_ongoing_requests": 100}, max_ongoing_requests=64)
    with pytest.raises(Exception, match="max_replicas"):
        orray.autoscaling_config({"min_replicas": 5, "max_replicas": 2})  # Serve's own check
    with pytest.raises(ValueError, match="unknown arguments"):
        orray.build({"manifests": ECHO, "replicas": "2"})
    with pytest.raises(ValueError, match="needs manifests"):
        orray.build({})
    AutoscalingConfig(**orray.DEFAULT_AUTOSCALING)


def test_rayservice_serve_config_builds_the_app(orray) -> None:
    """deploy/ray/rayservice.yaml's serveConfigV2 is a valid Serve config whose import path and
    arguments build this deployment (the RayService object is checked against KubeRay's CRD in
    tests/test_deploy.py)."""
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load(RAYSERVICE.read_text())
    config = ServeDeploySchema(**yaml.safe_load(doc["spec"]["serveConfigV2"]))
    (application,) = config.applications
    module, _, attribute = application.import_path.partition(":")
    assert (module, attribute) == ("outrider_http.ray_serve", "build")
    app = orray.build(application.args)
    options = _options(app)
    assert options["name"] == orray.DEPLOYMENT_NAME
    assert options["autoscaling"]["target_ongoing_requests"] <= options["max_ongoing_requests"]
    assert [d.name for d in application.deployments] == [orray.DEPLOYMENT_NAME]
    for path in application.args["manifests"]:  # what the image in docs/RAY.md provides
        assert path in ("/opt/outrider/models/minilm/manifest.yaml",) or path.startswith("/opt/outrider/manifests/")


# -- a local Ray cluster -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(orray, cache_dir):
    """A local Ray cluster (2 CPUs, no dashboard) with Serve's proxy on a free loopback port."""
    import ray
    from ray import serve

    if ray.is_initialized():
        pytest.skip("a Ray instance is already running in this process")
    env = {
        "OUTRIDER_PLUGINS": "none",  # replicas register exactly the plugins a test names
        "OUTRIDER_CACHE_DIR": str(cache_dir),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TEST_PLUGINS), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
    }
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 1024 * 1024,
             runtime_env={"env_vars": env}, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def echo_app(orray, cluster):
    from ray import serve

    # 10 ms of compute per request (an override, as `--set` would give): a replica killed under load
    # holds requests (with 2 ms, 0-6 of them), and the router sees queues to balance (an inline echo
    # answers before it looks: 59 of 60 requests went to one replica)
    app = orray.deployment([ECHO], ["outrider_echo"], overrides=["options.delay_ms=10"], num_replicas=2,
                           ray_actor_options={"num_cpus": 0.5})
    handle = serve.run(app, name="echo", route_prefix="/echo")
    yield handle, f"http://127.0.0.1:{cluster}/echo"
    serve.delete("echo")


def _replicas(handle, want: int = 2, timeout_s: float = 120.0, exclude: frozenset = frozenset()) -> dict:
    """Replica id -> info, asked through the handle until `want` distinct live replicas answered."""
    seen: dict = {}
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        responses = [handle.replica.remote() for _ in range(8)]
        for response in responses:
            try:
                info = response.result(timeout_s=30)
            except Exception:  # noqa: BLE001 - a replica going away meanwhile
                continue
            if info["replica_id"] not in exclude:
                seen[info["replica_id"]] = info
        if len(seen) >= want:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"only {sorted(seen)} answered within {timeout_s}s")


def _served(handle, ids) -> dict:
    """Per replica: echo requests its own Outrider server counted (health is asked through the handle)."""
    counts: dict = {}
    end = time.monotonic() + 60
    while set(counts) < set(ids) and time.monotonic() < end:
        health = handle.health.remote().result(timeout_s=30)
        counts[health["replica"]["replica_id"]] = health["models"]["echo"]["stats"]["requests"]
    assert set(counts) >= set(ids), f"health never reached {set(ids) - set(counts)}"
    return counts


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_requests_spread_over_both_replicas(orray, echo_app) -> None:
    import httpx

    from outrider import ModelNotFoundError

    handle, url = echo_app
    replicas = _replicas(handle)
    assert len({r["pid"] for r in replicas.values()}) == 2, "two replicas, two actor processes"

    # handle calls: each replica's own server counts some of them, all of them between the two
    before = _served(handle, replicas)
    responses = [handle.infer.remote("echo", {"i": np.array([i], np.int64)}) for i in range(60)]
    assert [int(r.result(timeout_s=60)["i"][0]) for r in responses] == list(range(60))
    after = _served(handle, replicas)
    delta = {rid: after[rid] - before[rid] for rid in replicas}
    print(f"\nhandle infer per replica: {delta}")
    assert sum(delta.values()) == 60 and all(n > 0 for n in delta.values()), delta
    with pytest.raises(ModelNotFoundError) as refused:  # Outrider's exceptions through Ray, code included
        handle.infer.remote("nope", {"i": np.array([1])}).result(timeout_s=60)
    assert refused.value.code == "model_not_found"

    # Serve's HTTP ingress: OIP v2 JSON, each answer names its replica
    def post(i: int) -> tuple[int, str]:
        body = {"inputs": [{"name": "i", "datatype": "INT64", "shape": [1], "data": [i]}]}
        with httpx.Client(timeout=60) as http:
            reply = http.post(f"{url}/v2/models/echo/infer", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["outputs"][0]["data"][0], reply.headers["x-outrider-replica"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(48)))
    assert [a for a, _ in answers] == list(range(48))
    by_replica = {rid: sum(1 for _, r in answers if r == rid) for rid in replicas}
    print(f"HTTP infer per replica: {by_replica}")
    assert sum(by_replica.values()) == 48 and all(n > 0 for n in by_replica.values()), by_replica


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_replica_is_replaced_without_a_lost_request(orray, echo_app) -> None:
    import ray

    handle, _ = echo_app
    replicas = _replicas(handle)
    victim_id = sorted(replicas)[0]
    victim = ray.get_actor(replicas[victim_id]["actor_name"], namespace="serve")

    total, answers, retries = 400, defaultdict(list), []
    lock = threading.Lock()
    done = threading.Semaphore(0)

    def send(i: int) -> None:
        out = orray.call(handle.infer, "echo", {"i": np.array([i], np.int64)}, timeout_s=60, attempts=8,
                         on_retry=lambda exc, attempt: retries.append(type(exc).__name__))
        with lock:
            answers[i].append(int(out["i"][0]))
        done.release()

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(send, i) for i in range(total)]
        for _ in range(total // 4):  # a quarter answered: the load is on, kill one replica mid-stream
            assert done.acquire(timeout=120)
        ray.kill(victim, no_restart=True)
        killed_at = time.monotonic()
        for future in futures:
            future.result(timeout=240)  # raises if a request failed after its retries
    assert sorted(answers) == list(range(total))
    assert all(got == [i] for i, got in answers.items()), "a request answered twice or with another's data"
    print(f"\n{total} requests, 1 replica killed, each answered once; retries: "
          f"{len(retries)} ({', '.join(sorted(set(retries))) or 'none: Serve routed around it'})")

    # Serve replaces the dead replica: two live replicas again, the victim not among them
    after = _replicas(handle, exclude=frozenset({victim_id}))
    assert victim_id not in after and len(after) == 2
    print(f"replaced in {time.monotonic() - killed_at:.1f}s: {victim_id} -> "
          f"{sorted(set(after) - set(replicas))}")
    out = handle.infer.remote("echo", {"x": np.ones(3, np.float32)}).result(timeout_s=60)
    assert out["x"].tolist() == [1, 1, 1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_streaming_generation_through_a_handle_and_http(orray, cluster) -> None:
    import httpx
    from ray import serve

    from outrider.client import GenerateChunk, GenerateResult

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    app = orray.deployment([TINY], ["outrider_test_hf_llama", "outrider_speculative"], num_replicas=1,
                           ray_actor_options={"num_cpus": 0.5}, name="tiny")
    handle = serve.run(app, name="tiny", route_prefix="/tiny")
    try:
        accepted, finals = 0, {}
        for prompt in ["abc abc abc abc abc", "the cat sat. the cat sat. the"]:
            items = list(handle.stream.options(stream=True).remote("tiny", prompt=prompt, max_tokens=24))
            chunks, final = items[:-1], items[-1]
            assert isinstance(final, GenerateResult) and chunks and all(isinstance(c, GenerateChunk) for c in chunks)
            assert "".join(c.text for c in chunks) == final.text
            assert [t for c in chunks for t in c.token_ids] == final.token_ids and len(final.token_ids) == 24
            plain = handle.generate.remote("tiny", prompt=prompt, max_tokens=24, speculative=False).result(timeout_s=120)
            assert plain.token_ids == final.token_ids, "speculation changed greedy output"
            assert plain.stats["draft_tokens"] == 0
            accepted += final.stats["accepted_tokens"]
            finals[prompt] = final
        assert accepted > 0, "speculative decoding never accepted a draft inside the replica"

        again = list(handle.generate.options(stream=True).remote("tiny", prompt="abc abc abc abc abc",
                                                                  max_tokens=24, stream=True))
        assert isinstance(again[-1], GenerateResult) and again[-1].token_ids == finals["abc abc abc abc abc"].token_ids

        # the same stream over Serve's HTTP ingress (Triton's generate_stream: server-sent events)
        url = f"http://127.0.0.1:{cluster}/tiny/v2/models/tiny/generate_stream"
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", url, json={"text_input": "abc abc abc abc abc",
                                               "parameters": {"max_tokens": 24}}) as reply:
                assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
                events = [json.loads(line[len("data: "):]) for line in reply.iter_lines() if line.startswith("data: ")]
            assert len(events) >= 2 and events[-1]["finish_reason"] == "length"
            assert "".join(e["text_output"] for e in events[:-1]) == events[-1]["text_output"] == again[-1].text
            refused = http.post(f"http://127.0.0.1:{cluster}/tiny/v2/models/tiny/generate_stream",
                                json={"text_input": "UPPER CASE is not in the alphabet"})
            assert refused.status_code == 400 and "alphabet" in refused.json()["error"]
    finally:
        serve.delete("tiny")
