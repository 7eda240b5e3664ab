"""The dynamic batcher, served for real: server processes, ZeroMQ, echo and MiniLM on ONNX Runtime."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import yaml

from outrider import AsyncClient
from outrider.errors import BadRequestError, ExecutionError
from outrider.manifest import validate_manifest
from outrider.serving.request import PendingRequest

from conftest import MANIFESTS, write_manifest

ECHO = ["outrider_echo", "outrider_batching"]


def _echo_manifest(tmp_path, name="echo", delay_ms=50, backend="echo", **batching) -> str:
    text = yaml.safe_dump({"name": name, "backend": backend, "device": "cpu", "options": {"delay_ms": delay_ms},
                           "warmup": {"iterations": 0}, "batching": batching})
    return write_manifest(tmp_path, text, f"{name}.yaml")


def _batches(client, model: str) -> dict:
    """(number of batches, requests in them, largest batch bucket that saw any) from health()."""
    hist = client.health()["models"][model]["stats"]["batch_size"]
    largest, previous = 0, 0
    for bound, running in hist["buckets"]:
        if running > previous:
            largest = bound
        previous = running
    return {"count": hist["count"], "requests": hist["sum"], "largest": largest}


async def _gather(address: str, model: str, inputs: list[dict], timeout: float = 60) -> list:
    """Send every request at once on one AsyncClient; results (or exceptions) in order."""
    async with AsyncClient(address, timeout=timeout) as client:
        return await asyncio.gather(*(client.infer(model, x) for x in inputs), return_exceptions=True)


# -- echo: forming batches ------------------------------------------------------------------


def test_lone_request_is_answered_in_a_batch_of_one(server_factory, tmp_path):
    server = server_factory([_echo_manifest(tmp_path, max_batch_size=8, max_queue_delay_ms=200)], ECHO)
    with server.client() as client:
        t0 = time.monotonic()
        out = client.infer("echo", {"x": np.arange(4, dtype=np.float32).reshape(1, 4)})
        elapsed = time.monotonic() - t0
        np.testing.assert_array_equal(out["x"], np.arange(4, dtype=np.float32).reshape(1, 4))
        assert _batches(client, "echo") == {"count": 1, "requests": 1, "largest": 1}
    # The model was idle and nobody else was sending: the request did not sit out the delay.
    assert elapsed < 0.2 + 0.05, elapsed


def test_concurrent_requests_form_batches_and_get_their_own_rows(server_factory, tmp_path):
    server = server_factory([_echo_manifest(tmp_path, max_batch_size=8, max_queue_delay_ms=200)], ECHO)
    inputs = [{"x": np.full((1, 4), i, np.float32)} for i in range(16)]
    results = asyncio.run(_gather(server.address, "echo", inputs))
    for i, out in enumerate(results):
        np.testing.assert_array_equal(out["x"], inputs[i]["x"])
    with server.client() as client:
        seen = _batches(client, "echo")
        stats = client.health()["models"]["echo"]["stats"]
    assert seen["requests"] == 16 and seen["count"] < 16 and 1 < seen["largest"] <= 8, seen
    assert stats["successes"] == 16 and not stats["failures"]


def test_max_batch_size_counts_rows_not_requests(server_factory, tmp_path):
    server = server_factory([_echo_manifest(tmp_path, max_batch_size=6, max_queue_delay_ms=100)], ECHO)
    inputs = [{"x": np.full((2, 3), i, np.int32)} for i in range(12)]
    results = asyncio.run(_gather(server.address, "echo", inputs))
    for sent, got in zip(inputs, results):
        np.testing.assert_array_equal(got["x"], sent["x"])
    with server.client() as client:
        seen = _batches(client, "echo")
    assert seen["requests"] == 12 and seen["count"] >= 4 and 1 < seen["largest"] <= 4, seen  # at most 3 requests


def test_different_shapes_sizes_and_names_each_get_correct_results(server_factory, tmp_path):
    server = server_factory([_echo_manifest(tmp_path, max_batch_size=6, max_queue_delay_ms=100)], ECHO)
    rng = np.random.default_rng(0)
    inputs = [
        {"x": rng.standard_normal((1, 4)).astype(np.float32)},
        {"x": rng.standard_normal((3, 4)).astype(np.float32)},
        {"x": rng.standard_normal((2, 8)).astype(np.float32)},  # other non-batch shape
        {"x": rng.standard_normal((1, 4)).astype(np.float64)},  # other dtype
        {"x": rng.standard_normal((10, 4)).astype(np.float32)},  # more rows than a batch: runs alone
        {"x": rng.standard_normal((2, 4)).astype(np.float32), "y": np.arange(2, dtype=np.int64)},
        {"x": np.zeros((0, 4), np.float32)},  # no rows at all
        {"x": rng.standard_normal((2, 2, 3)).astype(np.float32)},
        {"x": rng.standard_normal((1, 8)).astype(np.float32)},
        {"x": rng.standard_normal((4, 4)).astype(np.float32)},
        {"x": np.array(7, np.int32)},  # no batch dimension: runs alone
        {"t": np.array([b"a", b"bb" * 300, b"ccc"], dtype=object)},  # BYTES, very different lengths
        {"t": np.array([b"dddd" * 200], dtype=object)},
        {"t": np.array([b"e"], dtype=object)},
    ]
    results = asyncio.run(_gather(server.address, "echo", inputs * 2))
    for sent, got in zip(inputs * 2, results):
        assert not isinstance(got, Exception), got
        assert sorted(got) == sorted(sent)
        for name in sent:
            assert got[name].dtype == sent[name].dtype and got[name].shape == sent[name].shape
            assert got[name].tolist() == sent[name].tolist()
    with server.client() as client:
        assert _batches(client, "echo")["largest"] > 1


def test_failing_request_fails_alone(server_factory, tmp_path):
    # The `raising` test backend raises on negative input: the batched call fails, then each
    # request runs alone and only the culprit gets the error.
    manifest = _echo_manifest(tmp_path, name="raising", backend="raising", max_batch_size=16, max_queue_delay_ms=100)
    server = server_factory([manifest], ["outrider_test_backends", "outrider_batching"])
    inputs = [{"x": np.full((2, 3), -1.0 if i == 5 else i, np.float32)} for i in range(12)]
    results = asyncio.run(_gather(server.address, "raising", inputs))
    for i, got in enumerate(results):
        if i == 5:
            assert isinstance(got, ExecutionError) and "negative input" in got.message
        else:
            np.testing.assert_array_equal(got["x"], inputs[i]["x"])
    with server.client() as client:
        stats = client.health()["models"]["raising"]["stats"]
    assert stats["successes"] == 11 and stats["failures"] == {"execution_error": 1}


def test_preferred_batch_sizes_must_fit_the_batch(server_factory, tmp_path):
    manifest = _echo_manifest(tmp_path, max_batch_size=8, preferred_batch_sizes=[4, 16])
    server = server_factory([manifest], ECHO, wait=False)
    assert server.proc.wait(60) != 0
    assert "batching.preferred_batch_sizes" in server.log() and "16" in server.log()


# -- the batcher in process: planning and early replies ---------------------------------------


def _request(i: int, **inputs: np.ndarray) -> PendingRequest:
    return PendingRequest(b"", i, "infer", "m", inputs, {}, lambda *a: None)


def _batcher(**batching):
    from outrider_batching import DynamicBatcher

    return DynamicBatcher(validate_manifest({"name": "m", "backend": "echo", "batching": batching}))


def test_text_of_very_different_lengths_is_bucketed_and_similar_text_is_not():
    batcher = _batcher(max_batch_size=32)
    short = [_request(i, text=np.array([b"a short sentence"], dtype=object)) for i in range(6)]
    long = [_request(6 + i, text=np.array([b"word " * 200], dtype=object)) for i in range(2)]
    mixed = [short[0], long[0], *short[1:4], long[1], *short[4:]]
    subs = batcher.plan(mixed, list(range(len(mixed))))
    assert sorted(map(sorted, subs)) == [[0, 2, 3, 4, 6, 7], [1, 5]]
    assert batcher.plan(short, list(range(6))) == [list(range(6))]


def test_outputs_without_a_batch_dimension_fall_back_to_one_call_per_request():
    class Summing:
        calls = 0

        def execute(self, inputs):
            Summing.calls += 1
            return {"total": np.array(inputs["x"].sum())}  # one number for the whole call

    batch = [_request(i, x=np.full((2, 2), i)) for i in range(3)]
    results = _batcher().execute(Summing(), batch)
    assert [int(r["total"]) for r in results] == [0, 4, 8] and Summing.calls == 4


# -- MiniLM: batching changes no result -------------------------------------------------------

MINILM_PLUGINS = ["outrider_text", "outrider_onnxruntime", "outrider_batching"]
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 25)
SENTENCES = [
    "A man is eating food.", "short", "", "Ünïcødé text, emoji 🚀 and 中文 all tokenize.",
    LONG, "Outrider serves models beside your application.", "Batching must not change any embedding.",
    LONG[:400], "one more", "A dynamic batcher concatenates requests along the first dimension.",
]


@pytest.fixture(scope="module")
def minilm_manifests(tmp_path_factory):
    """The shipped minilm.yaml (batching on) and the same model without batching, as `minilm-plain`."""
    data = yaml.safe_load((MANIFESTS / "minilm.yaml").read_text())
    assert data.get("batching"), "manifests/minilm.yaml turns batching on"
    data.pop("batching")
    data["name"] = "minilm-plain"
    plain = tmp_path_factory.mktemp("manifests") / "minilm-plain.yaml"
    plain.write_text(yaml.safe_dump(data))
    return [MANIFESTS / "minilm.yaml", plain]


def test_minilm_batched_results_equal_unbatched(server_factory, minilm_manifests):
    pytest.importorskip("onnxruntime")
    server = server_factory(minilm_manifests, MINILM_PLUGINS)
    rng = np.random.default_rng(1)
    requests = []
    for i in range(30):
        size = (1, 3, 7)[i % 3]
        requests.append({"text": np.array(rng.choice(SENTENCES, size).tolist(), dtype=object)})
    requests.append({"text": np.array([], dtype=object)})
    with server.client(timeout=60) as client:
        expected = [client.infer("minilm-plain", r)["embedding"] for r in requests]
    got = asyncio.run(_gather(server.address, "minilm", requests))
    for want, result in zip(expected, got):
        assert not isinstance(result, Exception), result
        assert result["embedding"].shape == want.shape
        np.testing.assert_allclose(result["embedding"], want, atol=2e-5)
    with server.client() as client:
        seen = _batches(client, "minilm")
        unbatched = _batches(client, "minilm-plain")
    assert seen["largest"] > 1 and unbatched["largest"] == 1


def test_minilm_bad_text_fails_alone(server_factory, minilm_manifests):
    pytest.importorskip("onnxruntime")
    server = server_factory(minilm_manifests[:1], MINILM_PLUGINS)
    requests = [{"text": np.array([s.encode() for s in SENTENCES[i % 4: i % 4 + 2]], dtype=object)} for i in range(12)]
    requests[6] = {"text": np.array([b"fine", b"\xff\xfe not utf-8"], dtype=object)}
    with server.client(timeout=60) as client:
        expected = [None if i == 6 else client.infer("minilm", r)["embedding"] for i, r in enumerate(requests)]
    got = asyncio.run(_gather(server.address, "minilm", requests))
    for i, result in enumerate(got):
        if i == 6:
            assert isinstance(result, BadRequestError) and "UTF-8" in result.message
        else:
            np.testing.assert_allclose(result["embedding"], expected[i], atol=2e-5)
    with server.client() as client:
        stats = client.health()["models"]["minilm"]["stats"]
        assert _batches(client, "minilm")["largest"] > 1
    assert stats["failures"] == {"bad_request": 1} and stats["successes"] == 22


def _drive(batcher, queue, backend, turns: int) -> list[list]:
    """Run `turns` batches as an instance would; returns the ids (and piece rows) of each batch."""
    from outrider.serving.request import DEFERRED

    seen = []
    for _ in range(turns):
        batch = batcher.next_batch(queue)
        seen.append([(r.id, getattr(r, "start", None)) for r in batch])
        for request, result in zip(batch, batcher.execute(backend, batch)):
            if result is not DEFERRED and request.claim():
                (request.fail if isinstance(result, Exception) else request.reply)(result, claimed=True)
    return seen


def test_a_request_larger_than_a_batch_is_split_takes_turns_and_is_joined_in_order():
    from outrider.serving.queue import RequestQueue

    class Echo:
        calls: list = []

        def execute(self, inputs):
            Echo.calls.append(len(inputs["x"]))
            return {"x": inputs["x"] * 10}

    replies = {}

    def request(i, rows):
        send = lambda r, kind, header, outputs: replies.__setitem__(r.id, (header, outputs))
        return PendingRequest(b"", i, "infer", "m", {"x": np.arange(rows).reshape(rows, 1) + 100 * i}, {}, send)

    batcher, queue = _batcher(max_batch_size=4), RequestQueue(100)
    queue.put(request(0, 10))
    queue.put(request(1, 1))  # arrived while the big one waited
    turns = _drive(batcher, queue, Echo(), 5)
    # The turn that cut the big request, then pieces and the small request alternate.
    assert turns == [[(0, None)], [(0, 0)], [(1, None)], [(0, 4)], [(0, 8)]], turns
    assert Echo.calls == [4, 1, 4, 2]
    header, outputs = replies[0]
    assert header["ok"] and outputs["x"].ravel().tolist() == [10 * i for i in range(10)]
    assert replies[1][1]["x"].tolist() == [[1000]]


def test_a_split_request_fails_once_when_a_piece_fails_or_its_outputs_cannot_be_joined():
    from outrider.serving.queue import RequestQueue

    class Summing:
        def execute(self, inputs):
            return {"total": np.array(inputs["x"].sum())}  # no batch dimension

    class FailsOnSeven:
        def execute(self, inputs):
            if (inputs["x"] == 7).any():
                raise ValueError("seven")
            return dict(inputs)

    for backend, code in ((Summing(), "too_large"), (FailsOnSeven(), "execution_error")):
        sent = []
        req = PendingRequest(b"", "big", "infer", "m", {"x": np.arange(10).reshape(10, 1)}, {},
                             lambda r, kind, header, outputs: sent.append(header))
        batcher, queue = _batcher(max_batch_size=4), RequestQueue(10)
        queue.put(req)
        _drive(batcher, queue, backend, 4)
        assert len(sent) == 1 and sent[0]["error"]["code"] == code, sent
        assert not batcher._splits  # nothing left to run
