"""Bulk requests: rows grouped by length into pieces, answered in the caller's order (issue 8).

In process: the batcher cuts a request larger than a batch from its rows ordered by cost and
writes each piece back to its rows' places. Served: a mixed-length bulk request to MiniLM equals
the same sentences sent one by one, and another client's small request is answered meanwhile.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from outrider.errors import BadRequestError
from outrider.manifest import validate_manifest
from outrider.serving.queue import RequestQueue
from outrider.serving.request import DEFERRED, PendingRequest

from conftest import MANIFESTS, ROOT

sys.path.insert(0, str(ROOT / "tools"))
from bench_bulk import mixed_sentences  # noqa: E402  (the benchmark's own sentence mix)


def _batcher(max_batch_size: int):
    from outrider_batching import DynamicBatcher

    return DynamicBatcher(validate_manifest({"name": "m", "backend": "echo", "batching": {"max_batch_size": max_batch_size}}))


def _serve_one(batcher, inputs: dict, backend) -> dict:
    """Send one request through next_batch/execute as an instance would; its one reply header and outputs."""
    replies = []
    request = PendingRequest(b"", "bulk", "infer", "m", inputs, {},
                             lambda r, kind, header, outputs: replies.append((header, outputs)))
    queue = RequestQueue(10)
    queue.put(request)
    for _ in range(10_000):
        batch = batcher.next_batch(queue)
        if not batch:
            break
        for req, result in zip(batch, batcher.execute(backend, batch)):
            if result is not DEFERRED and req.claim():
                (req.fail if isinstance(result, Exception) else req.reply)(result, claimed=True)
    assert len(replies) == 1, replies
    return replies[0]


class _Recording:
    """A backend double: records each call's rows, returns x * 10, costs rows by `costs`."""

    def __init__(self, costs=None) -> None:
        self.costs = costs
        self.calls: list[np.ndarray] = []

    def row_costs(self, inputs):
        return None if self.costs is None else self.costs[inputs["x"][:, 0]]

    def execute(self, inputs):
        self.calls.append(inputs["x"][:, 0].copy())
        return {"y": inputs["x"] * 10}


def test_a_split_request_is_cut_from_its_rows_by_cost_and_answered_in_the_callers_order():
    rng = np.random.default_rng(0)
    costs = rng.integers(1, 150, 200)
    x = np.arange(200).reshape(200, 1)  # row i holds i, so each call shows which rows it got
    backend = _Recording(costs)
    header, outputs = _serve_one(_batcher(16), {"x": x}, backend)
    assert header["ok"]
    np.testing.assert_array_equal(outputs["y"], x * 10)  # the caller's order, every row once
    ran = np.concatenate(backend.calls)
    assert sorted(ran.tolist()) == list(range(200))
    assert (np.diff(costs[ran]) <= 0).all(), "pieces are cut from the rows ordered costliest first"
    assert all(1 <= len(call) <= 16 for call in backend.calls)
    padded = sum(len(call) * costs[call].max() for call in backend.calls)
    unsorted = sum(16 * costs[i:i + 16].max() for i in range(0, 200, 16))
    assert padded < 1.1 * costs.sum() < unsorted, (padded, costs.sum(), unsorted)


def test_rows_that_cost_alike_keep_their_order_and_numeric_rows_without_a_cost_key_too():
    for backend in (_Recording(np.full(50, 7)), _Recording(None)):
        header, outputs = _serve_one(_batcher(16), {"x": np.arange(50).reshape(50, 1)}, backend)
        np.testing.assert_array_equal(outputs["y"].ravel(), np.arange(50) * 10)
        assert [c.tolist() for c in backend.calls] == [list(range(i, min(i + 16, 50))) for i in range(0, 50, 16)]


def test_bytes_rows_without_a_cost_key_are_ordered_by_their_length():
    class Echo:
        calls: list = []

        def row_costs(self, inputs):
            return None  # as Backend.row_costs without a task: rows cost alike

        def execute(self, inputs):
            Echo.calls.append([len(t) for t in inputs["t"]])
            return dict(inputs)

    rng = np.random.default_rng(1)
    text = np.array([b"w" * int(n) for n in rng.integers(0, 400, 100)], dtype=object)
    header, outputs = _serve_one(_batcher(8), {"t": text}, Echo())
    assert outputs["t"].tolist() == text.tolist()
    lengths = [n for call in Echo.calls for n in call]
    assert lengths == sorted(lengths, reverse=True) and max(map(len, Echo.calls)) <= 8


def test_bad_input_found_while_costing_fails_the_request_once_and_runs_nothing():
    class Bad(_Recording):
        def row_costs(self, inputs):
            raise BadRequestError("input 'x' element 3 is not valid UTF-8")

    backend = Bad()
    header, _ = _serve_one(_batcher(4), {"x": np.arange(10).reshape(10, 1)}, backend)
    assert header["error"]["code"] == "bad_request" and "element 3" in header["error"]["message"]
    assert backend.calls == []


def test_text_task_costs_are_token_counts_and_pieces_pad_little():
    """The real tokenizer: 256 of the benchmark's mixed sentences, pieces of at most 32."""
    from outrider.manifest import load_manifest
    from outrider_text import SentenceEmbeddingTask

    task = SentenceEmbeddingTask(load_manifest(MANIFESTS / "minilm.yaml"))
    text = np.array([s.encode() for s in mixed_sentences(256)], dtype=object)
    tokens = task.row_costs({"text": text})
    np.testing.assert_array_equal(tokens, task.preprocess({"text": text})["attention_mask"].sum(1))

    class Padding:
        padded = 0

        def row_costs(self, inputs):
            return task.row_costs(inputs)

        def execute(self, inputs):
            feeds = task.preprocess(inputs)
            Padding.padded += feeds["input_ids"].size  # rows x the longest row of this call
            return {"row": feeds["attention_mask"].sum(1)}

    header, outputs = _serve_one(_batcher(32), {"text": text}, Padding())
    np.testing.assert_array_equal(outputs["row"], tokens)  # each row's own token count, in order
    in_order = sum(task.preprocess({"text": text[i:i + 32]})["input_ids"].size for i in range(0, 256, 32))
    assert Padding.padded < 1.1 * tokens.sum() and in_order > 3 * tokens.sum(), (Padding.padded, tokens.sum(), in_order)


# -- served: real server, real ZeroMQ, real ONNX Runtime -----------------------------------------

PLUGINS = ["outrider_text", "outrider_onnxruntime", "outrider_batching"]


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _batches(client) -> int:
    return client.health()["models"]["minilm"]["stats"]["batch_size"]["count"]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    from conftest import start_server

    server = start_server(tmp_path_factory.mktemp("bulk"), [MANIFESTS / "minilm.yaml"], PLUGINS)
    try:
        server.wait_ready(timeout=600)
        yield server
    finally:
        server.stop()


def test_mixed_length_bulk_comes_back_in_order_equal_to_one_by_one(minilm):
    sentences = mixed_sentences(96, seed=5)
    with minilm.client(timeout=120) as client:
        one_by_one = np.concatenate([client.infer("minilm", {"text": np.array([s])})["embedding"] for s in sentences])
        before = _batches(client)
        bulk = client.infer("minilm", {"text": np.array(sentences, dtype=object)})["embedding"]
        pieces = _batches(client) - before - 1  # less the turn that cut the request
    assert bulk.shape == (96, 384)
    cos = _cos(bulk, one_by_one)
    assert cos.min() > 0.9999, (cos.argmin(), cos.min())
    # Cut where lengths change, not every 32 rows: more pieces than 96 / 32.
    assert pieces > 3, pieces


def test_a_small_request_from_another_client_is_answered_while_a_bulk_one_runs(minilm):
    sentences = mixed_sentences(384, seed=6)
    done: dict = {}

    def send_bulk() -> None:
        with minilm.client(timeout=300) as client:
            done["bulk"] = client.infer("minilm", {"text": np.array(sentences, dtype=object)})["embedding"]
            done["bulk_at"] = time.monotonic()

    with minilm.client(timeout=60) as watcher:
        before = _batches(watcher)
        thread = threading.Thread(target=send_bulk)
        thread.start()
        end = time.monotonic() + 60
        while _batches(watcher) < before + 2 and time.monotonic() < end:  # cut, then a first piece
            time.sleep(0.005)
        with minilm.client(timeout=60) as other:
            small = other.infer("minilm", {"text": np.array(["A man is eating food."])})["embedding"]
            small_at = time.monotonic()
        thread.join(300)
    assert "bulk_at" in done and small.shape == (1, 384)
    assert small_at < done["bulk_at"], "the small request waited for the whole bulk request"
    with minilm.client(timeout=60) as client:
        check = client.infer("minilm", {"text": np.array(sentences[:3] + sentences[-3:], dtype=object)})["embedding"]
    assert _cos(done["bulk"][[0, 1, 2, -3, -2, -1]], check).min() > 0.9999
