"""The HTTP front: a real `outrider serve --http` process, driven by the real clients people use.

Open Inference Protocol v2 with `tritonclient.http` (binary tensors, its default) and plain
`httpx` (JSON tensors, errors); the OpenAI routes with the `openai` client (streaming or not,
embeddings as floats and base64, its exceptions for 4xx answers); /metrics parsed with
prometheus_client's parser. HTTP and ZeroMQ requests reach the same models through one dispatch
path, so figures counted for one show up for the other, and a client that disconnects has its
request cancelled like a ZeroMQ client that leaves.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from conftest import MANIFESTS, ROOT, free_port, start_server, write_manifest  # noqa: E402

PLUGINS = ["outrider_echo", "outrider_text", "outrider_onnxruntime", "outrider_batching",
           "outrider_test_hf_llama", "outrider_speculative", "outrider_http"]
SENTENCES = ["A man is eating food.", "Outrider serves models beside your application.", "short"]


class HttpServer:
    def __init__(self, process, port: int) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def zmq(self, timeout: float = 30.0):
        return self.process.client(timeout=timeout)

    def stats(self, model: str) -> dict:
        with self.zmq() as client:
            return client.health()["models"][model]

    def openai(self, **kwargs) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    """echo, a slow echo (delay 200 ms), MiniLM (ORT, batching) and a tiny generating model with
    n-gram speculation, all behind one ZeroMQ socket and one HTTP port."""
    tmp = tmp_path_factory.mktemp("http")
    slow = write_manifest(tmp, "name: slow\nbackend: echo\noptions: {delay_ms: 200}\n", "slow.yaml")
    tiny = write_manifest(tmp, yaml.safe_dump({"name": "tiny", "backend": "hf-llama", "options": {"seed": 3},
                                               "speculative": {"drafters": ["ngram"], "cost_gate": False}}),
                         "tiny.yaml")  # step counts asserted: drafting not gated by timing
    port = free_port()
    process = start_server(tmp, [MANIFESTS / "echo.yaml", slow, MANIFESTS / "minilm.yaml", tiny], PLUGINS,
                           args=["--http", f"127.0.0.1:{port}"])
    try:
        process.wait_ready()
        yield HttpServer(process, port)
    finally:
        process.stop()


# -- Open Inference Protocol v2 ---------------------------------------------------------------


def test_v2_health_and_metadata(http_server):
    with httpx.Client(base_url=http_server.url) as http:
        assert http.get("/v2/health/live").status_code == 200
        ready = http.get("/v2/health/ready")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        assert http.get("/v2").json()["extensions"] == ["binary_tensor_data"]
        meta = http.get("/v2/models/minilm").json()
        assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
        assert meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]
        assert http.get("/v2/models/minilm/ready").status_code == 200
        assert http.get("/v2/models/minilm/versions/1/ready").status_code == 200
        missing = http.get("/v2/models/nope/ready")
        assert missing.status_code == 404 and "nope" in missing.json()["error"]
        assert http.get("/v2/models/minilm/versions/2").status_code == 404
        # A kept-alive connection answers at once: without TCP_NODELAY each response waited ~40 ms
        # for the client's delayed ACK (Nagle). uvloop sets it itself; plain asyncio did not.
        times = []
        for _ in range(15):
            start = time.perf_counter()
            http.get("/v2/health/live")
            times.append(time.perf_counter() - start)
        assert sorted(times)[7] < 0.02, times


def test_tritonclient_infer_matches_zeromq_and_shares_its_stats(http_server):
    import tritonclient.http as triton

    with http_server.zmq() as zmq_client:
        expected = zmq_client.infer("minilm", {"text": np.array(SENTENCES, dtype=object)})["embedding"]
        before = zmq_client.health()["models"]["minilm"]["stats"]
    client = triton.InferenceServerClient(url=f"127.0.0.1:{http_server.port}")
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("minilm")
        assert client.get_model_metadata("minilm")["name"] == "minilm"
        text = triton.InferInput("text", [len(SENTENCES)], "BYTES")
        text.set_data_from_numpy(np.array(SENTENCES, dtype=object))  # binary tensor data: the default
        binary = client.infer("minilm", [text]).as_numpy("embedding")
        text.set_data_from_numpy(np.array(SENTENCES, dtype=object), binary_data=False)  # JSON both ways
        as_json = client.infer("minilm", [text], outputs=[triton.InferRequestedOutput("embedding", binary_data=False)])
        as_json = as_json.as_numpy("embedding")
        # Numeric types survive both encodings unchanged (echo returns its inputs).
        x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
        ids = np.array([[1, -2**40]], dtype=np.int64)
        inputs = [triton.InferInput("x", list(x.shape), "FP32"), triton.InferInput("ids", list(ids.shape), "INT64")]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(ids, binary_data=False)
        echoed = client.infer("echo", inputs)
        with pytest.raises(Exception, match="no model named"):
            client.infer("nope", [text])
    finally:
        client.close()
    assert binary.shape == (3, 384) and binary.dtype == np.float32
    np.testing.assert_allclose(binary, expected, atol=1e-5)
    np.testing.assert_allclose(as_json, expected, atol=1e-5)
    np.testing.assert_array_equal(echoed.as_numpy("x"), x)
    np.testing.assert_array_equal(echoed.as_numpy("ids"), ids)
    after = http_server.stats("minilm")["stats"]
    # One dispatch path: the HTTP requests were queued and counted by the same model as ZeroMQ's.
    assert after["successes"] - before["successes"] == 2
    assert after["inferences"] - before["inferences"] == 2 * len(SENTENCES)


def test_v2_json_infer_and_errors_with_httpx(http_server):
    def infer(model, inputs, **body):
        return http.post(f"/v2/models/{model}/infer", json={"inputs": inputs, **body})

    text = {"name": "text", "datatype": "BYTES", "shape": [2], "data": SENTENCES[:2]}
    with httpx.Client(base_url=http_server.url, timeout=30) as http:
        ok = infer("minilm", [text], id="r1")
        assert ok.status_code == 200, ok.text
        out = ok.json()
        assert out["id"] == "r1" and out["model_name"] == "minilm"
        [embedding] = out["outputs"]
        assert embedding["shape"] == [2, 384] and embedding["datatype"] == "FP32" and len(embedding["data"]) == 768
        nested = infer("echo", [{"name": "b", "datatype": "BOOL", "shape": [2, 2], "data": [[True, False], [False, True]]}])
        assert nested.json()["outputs"][0]["data"] == [True, False, False, True]

        def refused(response, status):
            assert response.status_code == status, response.text
            assert isinstance(response.json()["error"], str) and response.json()["error"]
            return response.json()["error"]

        assert "no input 'words'" in refused(infer("minilm", [{**text, "name": "words"}]), 400)
        assert "FP32" in refused(infer("minilm", [{**text, "datatype": "FP32", "data": [1.0, 2.0]}]), 400)
        assert "holds 3 elements" in refused(infer("minilm", [{**text, "shape": [3]}]), 400)
        refused(infer("echo", [{"name": "x", "datatype": "FP33", "shape": [1], "data": [1]}]), 400)
        refused(infer("echo", [{"name": "x", "datatype": "INT8", "shape": [1], "data": ["seven"]}]), 400)
        refused(infer("nope", [text]), 404)
        assert "generates text" in refused(infer("tiny", [text]), 400)
        refused(http.post("/v2/models/echo/infer", content=b"{not json"), 400)
        rows = infer("minilm", [{"name": "text", "datatype": "BYTES", "shape": [2049], "data": ["a"] * 2049}])
        assert "max_rows" in refused(rows, 413)
        # Binary data that does not match the JSON header's claims.
        head = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":8}}]}'
        short = http.post("/v2/models/echo/infer", content=head + b"\0" * 4,
                          headers={"Inference-Header-Content-Length": str(len(head))})
        refused(short, 400)
        wrong = head.replace(b"[2]", b"[3]")
        refused(http.post("/v2/models/echo/infer", content=wrong + b"\0" * 8,
                          headers={"Inference-Header-Content-Length": str(len(wrong))}), 400)


def test_v2_deadline_is_504_and_a_client_that_leaves_cancels_its_request(http_server):
    x = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}
    before = http_server.stats("slow")["stats"]

    def post(timeout_us=None, client_timeout=30.0):
        body = {"inputs": [x], **({"parameters": {"timeout": timeout_us}} if timeout_us else {})}
        try:
            return httpx.post(f"{http_server.url}/v2/models/slow/infer", json=body, timeout=client_timeout).status_code
        except httpx.TimeoutException:
            return "gave up"

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = pool.submit(post)  # 200 ms of work ahead of the others
        time.sleep(0.05)
        late = pool.submit(post, timeout_us=50_000)  # Triton's `timeout` is in microseconds
        leaving = [pool.submit(post, client_timeout=0.1) for _ in range(2)]  # queued, then gone
        assert busy.result() == 200
        assert late.result() == 504
        assert [f.result() for f in leaving] == ["gave up"] * 2
    end = time.monotonic() + 10
    while time.monotonic() < end:
        stats = http_server.stats("slow")["stats"]
        if stats["failures"].get("cancelled", 0) - before["failures"].get("cancelled", 0) == 2:
            break
        time.sleep(0.05)
    assert stats["failures"].get("timeout", 0) - before["failures"].get("timeout", 0) == 1, stats
    assert stats["failures"].get("cancelled", 0) - before["failures"].get("cancelled", 0) == 2, stats
    assert stats["successes"] - before["successes"] == 1, stats  # the two that left never ran


# -- Triton's generate extension -------------------------------------------------------------


def test_triton_generate_extension_plain_and_streamed(http_server):
    """Triton's generate extension on the HTTP front (the same routes a Ray replica serves): one
    JSON reply, or server-sent events whose text adds up to it; the ZeroMQ result is the same."""
    prompt = "the quick brown fox jumps over the lazy dog. the quick"
    body = {"text_input": prompt, "parameters": {"max_tokens": 24, "temperature": 0}}
    whole = httpx.post(f"{http_server.url}/v2/models/tiny/generate", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    document = whole.json()
    assert document["model_name"] == "tiny" and document["finish_reason"] == "length"
    assert len(document["token_ids"]) == 24 and document["stats"]["new_tokens"] == 24
    with http_server.zmq() as client:
        assert client.generate("tiny", prompt=prompt, max_tokens=24, temperature=0).text == document["text_output"]
    with httpx.stream("POST", f"{http_server.url}/v2/models/tiny/generate_stream", json=body, timeout=60) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1]["finish_reason"] == "length"
    # Each chunk carries its new text; the final event carries the whole text again, with its stats.
    assert "".join(e["text_output"] for e in events[:-1]) == document["text_output"] == events[-1]["text_output"]
    refused = httpx.post(f"{http_server.url}/v2/models/echo/generate", json=body, timeout=30)
    assert refused.status_code == 400 and "does not generate" in refused.json()["error"], refused.text
    missing = httpx.post(f"{http_server.url}/v2/models/nope/generate", json=body, timeout=30)
    assert missing.status_code == 404, missing.text
    for bad in (b"not json", b"[1, 2]", b'{"text_input": "hi", "parameters": [1]}'):
        answer = httpx.post(f"{http_server.url}/v2/models/tiny/generate_stream", content=bad, timeout=30)
        assert answer.status_code == 400 and answer.json()["code"] == "bad_request", answer.text


# -- OpenAI-compatible ------------------------------------------------------------------------


def test_openai_completions_plain_and_streamed(http_server):
    client = http_server.openai()
    prompt = "the quick brown fox jumps over the lazy dog. the quick"
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 40
    assert whole.usage.prompt_tokens == len(prompt)  # one token per character in this test model
    spec = whole.usage.model_extra["speculative"]  # the extension field
    assert spec["draft_tokens"] >= spec["accepted_tokens"] > 0 and spec["steps"] < 40
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text  # greedy: the same tokens either way
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    # Sampling with a seed repeats; a stop string ends the text before it.
    a, b = (client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=1.0, top_p=0.9,
                                      seed=7).choices[0].text for _ in range(2))
    assert a == b
    cut = whole.choices[0].text[5:8]
    stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=[cut])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == whole.choices[0].text[:whole.choices[0].text.index(cut)]


def test_openai_chat_plain_and_streamed(http_server):
    client = http_server.openai()
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "say abc abc abc"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert len(whole.choices[0].message.content) == 24 and whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
    parts = [{"role": "user", "content": [{"type": "text", "text": "say abc "}, {"type": "text", "text": "abc abc"}]}]
    as_parts = client.chat.completions.create(model="tiny", messages=[messages[0], *parts], max_tokens=24,
                                              temperature=0)
    assert as_parts.choices[0].message.content == whole.choices[0].message.content


def test_openai_errors_are_4xx_in_openai_shape(http_server):
    client = http_server.openai()
    chat = [{"role": "user", "content": "abc"}]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=chat, n=17)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=chat, n=2, stream=True)
    assert bad.value.body["param"] == "n"
    for stream in (False, True):  # refused by the engine: a stream is answered 400, not a 200 that fails
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="tiny", prompt="abc", temperature=-1, stream=stream)
        assert bad.value.body["param"] == "temperature" and bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="alphabet"):
        client.completions.create(model="tiny", prompt="ABC", stream=True)
    with pytest.raises(openai.BadRequestError, match="'echo' is not supported"):
        client.completions.create(model="tiny", prompt="abc", echo=True)
    with pytest.raises(openai.BadRequestError) as bad:  # the test model's tokenizer has no vocabulary to give
        client.chat.completions.create(model="tiny", messages=chat, response_format={"type": "json_object"})
    assert "grammar engine" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="does not generate"):
        client.chat.completions.create(model="minilm", messages=chat)
    with pytest.raises(openai.BadRequestError, match="does not embed"):
        client.embeddings.create(model="echo", input="abc")
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=chat)
    assert missing.value.body["code"] == "model_not_found"
    raw = httpx.post(http_server.url + "/v1/completions", json={"model": "tiny", "prompt": 7})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "prompt"


def test_openai_embeddings_float_and_base64(http_server):
    client = http_server.openai()
    with http_server.zmq() as zmq_client:
        expected = zmq_client.infer("minilm", {"text": np.array(SENTENCES, dtype=object)})["embedding"]
    floats = client.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
    as_float = np.array([d.embedding for d in floats.data], dtype=np.float32)
    # The openai client asks for base64 unless told otherwise, and decodes it itself; check the wire too.
    decoded = np.array([d.embedding for d in client.embeddings.create(model="minilm", input=SENTENCES).data])
    raw = httpx.post(http_server.url + "/v1/embeddings",
                     json={"model": "minilm", "input": SENTENCES[0], "encoding_format": "base64"}).json()
    one = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == "minilm"
    np.testing.assert_allclose(as_float, expected, atol=1e-5)
    np.testing.assert_allclose(decoded, expected, atol=1e-5)
    np.testing.assert_allclose(one, expected[0], atol=1e-5)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="minilm", input=SENTENCES, dimensions=128)
    assert {m.id for m in client.models.list()} == {"echo", "slow", "minilm", "tiny"}


# One token a step (no speculation): hundreds of steps still to go when the client leaves.
LONG_GENERATION = {"max_tokens": 240, "temperature": 0, "speculative": False}


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "abc abc abc", "stream": True, **LONG_GENERATION}),
    ("/v2/models/tiny/generate_stream", {"text_input": "abc abc abc", "parameters": LONG_GENERATION}),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "abc abc abc"}], "stream": True,
                      **LONG_GENERATION}),
    ("/v1/responses", {"model": "tiny", "input": "abc abc abc", "stream": True, "max_output_tokens": 240,
                       "temperature": 0, "speculative": False}),
], ids=["openai", "triton", "messages", "responses"])
def test_a_client_that_leaves_mid_stream_frees_its_slot(http_server, route, body):
    def slots() -> tuple[int, int]:
        [instance] = http_server.stats("tiny")["instances"]
        return instance["backend"]["active_sequences"], instance["backend"]["free_slots"]

    before = http_server.stats("tiny")["stats"]
    with httpx.Client(base_url=http_server.url, timeout=30) as http:
        with http.stream("POST", route, json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert slots()[0] == 1  # streaming: holding its slot
    end = time.monotonic() + 10
    while slots() != (0, 4) and time.monotonic() < end:
        time.sleep(0.02)
    assert slots() == (0, 4)
    stats = http_server.stats("tiny")["stats"]
    assert stats["failures"].get("cancelled", 0) - before["failures"].get("cancelled", 0) == 1, stats
    assert stats["successes"] == before["successes"]  # run to the end it would have been a success


# -- Prometheus -------------------------------------------------------------------------------


def test_metrics_carry_outrider_triton_and_vllm_names(http_server):
    from prometheus_client.parser import text_string_to_metric_families

    client = http_server.openai()
    client.completions.create(model="tiny", prompt="abc abc abc abc", max_tokens=16, temperature=0)
    httpx.post(http_server.url + "/v2/models/minilm/infer",
               json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]})
    response = httpx.get(http_server.url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            model = sample.labels.get("model") or sample.labels.get("model_name")
            if "le" not in sample.labels and "code" not in sample.labels and "reason" not in sample.labels:
                samples[(sample.name, model)] = sample.value
    for name in ("outrider_requests_total", "outrider_queue_depth", "nv_inference_request_success_total",
                 "nv_inference_count_total", "nv_inference_queue_duration_us_total",
                 "nv_inference_compute_infer_duration_us_total"):
        assert samples[(name, "minilm")] >= 0, name
    assert samples[("nv_inference_request_success_total", "minilm")] >= 1
    assert samples[("nv_inference_compute_infer_duration_us_total", "minilm")] > 0
    assert samples[("vllm:time_to_first_token_seconds_count", "tiny")] >= 1
    assert samples[("vllm:inter_token_latency_seconds_count", "tiny")] >= 1
    assert samples[("vllm:request_queue_time_seconds_count", "tiny")] >= 1
    assert samples[("vllm:spec_decode_num_draft_tokens_total", "tiny")] >= \
        samples[("vllm:spec_decode_num_accepted_tokens_total", "tiny")] > 0
    assert samples[("vllm:num_requests_running", "tiny")] == 0
    assert samples[("vllm:num_requests_waiting", "tiny")] == 0
    assert ("vllm:time_to_first_token_seconds_count", "minilm") not in samples  # only generating models


def test_sigterm_drains_http_requests_too(server_factory, tmp_path):
    slow = write_manifest(tmp_path, "name: slow\nbackend: echo\noptions: {delay_ms: 600}\n", "slow.yaml")
    port = free_port()
    server = server_factory([slow], ["outrider_echo", "outrider_http"], args=["--http", f"127.0.0.1:{port}"])
    url = f"http://127.0.0.1:{port}/v2/models/slow/infer"
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.5]}]}
    with concurrent.futures.ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as http:
        running = pool.submit(httpx.post, url, json=body, timeout=30)
        time.sleep(0.2)  # executing now
        server.proc.terminate()
        time.sleep(0.1)
        assert http.get(f"http://127.0.0.1:{port}/v2/health/ready").status_code == 503  # draining
        refused = http.post(url, json=body)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
        answered = running.result()
    assert answered.status_code == 200 and answered.json()["outputs"][0]["data"] == [1.5]
    assert server.proc.wait(30) == 0


# -- the core stays free of the HTTP stack ----------------------------------------------------


def test_core_imports_no_http_stack_and_http_needs_its_plugin(tmp_path):
    check = ("import sys, outrider, outrider.server, outrider.cli, outrider.plugins; "
             "assert not {'starlette', 'uvicorn', 'sse_starlette'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", check], check=True, cwd=ROOT)
    refused = subprocess.run([sys.executable, "-m", "outrider.cli", "serve", str(MANIFESTS / "echo.yaml"),
                              "--plugin", "outrider_echo", "--bind", f"ipc://{tmp_path}/s.sock",
                              "--http", "127.0.0.1:1"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert refused.returncode == 2 and "no plugin registers front 'http'" in refused.stderr
    # The built-in front loads through the entry-point group like any plugin, and says it can run here.
    listed = subprocess.run([sys.executable, "-m", "outrider.cli", "plugins", "--json"], capture_output=True,
                            text=True, timeout=60, cwd=ROOT, env={**os.environ, "OUTRIDER_PLUGINS": "http"})
    [http] = json.loads(listed.stdout)
    assert http["hooks"] == ["outrider_register_fronts"]
    assert http["fronts"] == [{"name": "http", "available": True, "reason": ""}]


# -- SmolLM2 ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_streams_over_openai_with_speculation(server_factory):
    port = free_port()
    server = server_factory([MANIFESTS / "smollm2.yaml"], ["outrider_llm", "outrider_speculative", "outrider_http"],
                            args=["--http", f"127.0.0.1:{port}"])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=48, temperature=0)
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=48, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    spec = chunks[-1].usage.model_extra["speculative"]
    assert spec["accepted_tokens"] > 0 and spec["mean_accepted_length"] > 1.0
    with server.client() as zmq_client:
        same = zmq_client.generate("smollm2", messages=messages, max_tokens=48)
    assert same.text == text  # the same engine behind both fronts
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="smollm2"}' in metrics


def test_hostile_requests_get_4xx_never_5xx(http_server):
    """Client mistakes that were 500s with a traceback: each is now a 4xx naming what was wrong,
    found by the shared validation (shapes through the core's check_shape, text through one UTF-8
    check, numbers bounded before they are converted), and the server logs no traceback."""
    import socket

    base = http_server.url
    ok = {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}
    cases = [
        ("/v2/models/echo/infer", '{"inputs": [%s], "parameters": {"timeout": 1%s}}' % (json.dumps(ok), "0" * 400),
         400, "timeout"),
        ("/v2/models/echo/infer", '{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1%s, 1%s], "data": [1]}]}'
         % ("0" * 4000, "0" * 4000), 413, "an integer of"),
        ("/v2/models/minilm/infer", '{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], '
                                    '"data": ["\\ud800"]}]}', 400, "not valid text"),
        ("/v1/embeddings", '{"model": "minilm", "input": "\\ud800"}', 400, "not valid text"),
        ("/v2/models/echo/infer", json.dumps({"inputs": [ok], "outputs": [{"name": ["a"]}]}), 400, "string 'name'"),
        ("/v2/models/echo/infer", json.dumps({"inputs": [ok], "outputs": [{"name": {"a": 1}}]}), 400, "string 'name'"),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
         "not valid text"),
        ("/v1/messages", '{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud800"}]}',
         400, "not valid text"),
        ("/v1/responses", '{"model": "tiny", "input": "\\ud800"}', 400, "not valid text"),
        ("/v1/messages", '{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": '
                         + "[" * 5000 + "]" * 5000 + '}]}', 400, "not valid JSON"),
        ("/v1/responses", json.dumps({"model": "tiny", "input": [{"type": "message", "role": "user",
                                                                  "content": "x"}] * 2000}), 400, "at most 1024"),
    ]
    for path, body, status, words in cases:
        answer = httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert answer.status_code == status and words in answer.text, (path, answer.status_code, answer.text[:300])
        assert len(answer.content) < 2000
    for value in ("\u00b9\u00b2".encode(), b"1" * 5000, b"-5"):  # lying Inference-Header-Content-Length values
        body = b'{"inputs": []}'
        with socket.create_connection(("127.0.0.1", http_server.port), timeout=10) as sock:
            sock.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                         b"Inference-Header-Content-Length: " + value + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert sock.recv(100).startswith(b"HTTP/1.1 400"), value[:20]
    with socket.create_connection(("127.0.0.1", http_server.port), timeout=10) as sock:  # leaves mid-body
        sock.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"inp")
    assert httpx.get(base + "/v2/health/ready").status_code == 200
    time.sleep(0.5)
    assert "Traceback" not in http_server.process.log()


def test_headers_are_bounded_and_slow_clients_time_out(tmp_path):
    """431 past 100 headers or 64 KiB of head (a header that never ends included), 408 for headers
    that do not arrive in time, and a stalled body closed, all while another client is served."""
    import socket

    port = free_port()
    server = start_server(tmp_path, [MANIFESTS / "echo.yaml"], ["outrider_echo", "outrider_http"],
                          args=["--http", f"127.0.0.1:{port}"],
                          env={"OUTRIDER_HTTP_HEAD_TIMEOUT_S": "1", "OUTRIDER_HTTP_BODY_IDLE_TIMEOUT_S": "1"})
    try:
        server.wait_ready()

        def send(data: bytes, wait: float = 10) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
                sock.sendall(data)
                try:
                    return sock.recv(200)
                except ConnectionResetError:
                    return b""

        many = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n"
        assert send(many).startswith(b"HTTP/1.1 431")
        long = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
        assert send(long).startswith(b"HTTP/1.1 431")
        endless = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Endless: " + b"a" * 100_000  # no end of line
        assert send(endless).startswith(b"HTTP/1.1 431")
        begin = time.monotonic()
        assert send(b"GET /v2/health/ready HTTP/1.1\r\nHo").startswith(b"HTTP/1.1 408")
        assert time.monotonic() - begin < 5
        stalled = b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{\"in"
        begin = time.monotonic()
        assert send(stalled) == b""  # closed without an answer
        assert time.monotonic() - begin < 5
        ok = httpx.post(f"http://127.0.0.1:{port}/v2/models/echo/infer", json={
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]})
        assert ok.status_code == 200
        assert "Traceback" not in server.log()
    finally:
        server.stop()


def test_bodies_being_read_share_one_budget(tmp_path):
    """Each body is bounded by --max-message-mb, and all the bodies being read at once by four
    times that: a fifth stalled upload is answered 503 (retry), not buffered."""
    import socket

    port = free_port()
    server = start_server(tmp_path, [MANIFESTS / "echo.yaml"], ["outrider_echo", "outrider_http"],
                          args=["--http", f"127.0.0.1:{port}", "--max-message-mb", "2"])
    head = b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (2 << 20)
    held = []
    try:
        server.wait_ready()
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(head + b"x" * int(1.9 * (1 << 20)))  # then stalls
            held.append(sock)
        time.sleep(0.5)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            try:
                sock.sendall(head + b"x" * int(1.9 * (1 << 20)))
            except (BrokenPipeError, ConnectionResetError):  # answered and closed before all was sent
                pass
            answer = b""
            while b"budget" not in answer:  # the head and the body may come in separate segments
                part = sock.recv(4096)
                if not part:
                    break
                answer += part
        assert answer.startswith(b"HTTP/1.1 503") and b"budget" in answer, answer
    finally:
        for sock in held:
            sock.close()
    try:
        time.sleep(0.5)
        ok = httpx.post(f"http://127.0.0.1:{port}/v2/models/echo/infer", json={
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]})
        assert ok.status_code == 200
    finally:
        server.stop()


def test_large_json_bodies_are_parsed_by_the_worker_process(http_server):
    """A JSON body over 1 MiB is parsed in a child process (json_worker.py): the same answers as
    inline, the model's limits checked before packing, malformed ones refused as inline."""
    base = http_server.url
    values = [float(i % 97) for i in range(200_000)]  # ~1.4 MB of JSON
    answer = httpx.post(base + "/v2/models/echo/infer", timeout=60, json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1000, 200], "data": values}]})
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["outputs"][0]["data"][:3] == [0.0, 1.0, 2.0] and len(answer.json()["outputs"][0]["data"]) == 200_000
    rows = httpx.post(base + "/v2/models/minilm/infer", timeout=60, json={
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [300_000], "data": ["ab"] * 300_000}]})
    assert rows.status_code == 413 and "max_rows" in rows.json()["error"]
    broken = httpx.post(base + "/v2/models/echo/infer", timeout=60,
                        content=b'{"inputs": [' + b"1, " * 600_000 + b"]")
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]
    surrogate = httpx.post(base + "/v2/models/minilm/infer", timeout=60, content=json.dumps({
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["\ud800" + "a" * 1_100_000]}]}))
    assert surrogate.status_code == 400 and "not valid text" in surrogate.json()["error"]
    again = httpx.post(base + "/v2/models/echo/infer", timeout=60, json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1000, 200], "data": values}]})
    assert again.status_code == 200
