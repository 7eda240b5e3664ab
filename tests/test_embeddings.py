"""Embeddings as users of text-embeddings-inference, vLLM and OpenAI ask for them, on a real server.

`dimensions` (Matryoshka: the first k components, renormalized) only for a model whose manifest
says it was trained so; a truncation policy in the manifest and per request (`truncate`); token
counts in `usage`; `input` as token ids; vLLM's /tokenize and /detokenize, for embedding and
generating models; and vectors that do not depend on the batch a sentence lands in.
"""

from __future__ import annotations

import base64
import concurrent.futures
import random

import numpy as np
import pytest
import yaml

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from conftest import MANIFESTS, free_port, start_server, write_manifest  # noqa: E402

from outrider.errors import BadRequestError  # noqa: E402

PLUGINS = ["outrider_echo", "outrider_text", "outrider_onnxruntime", "outrider_torch", "outrider_batching",
           "outrider_test_hf_llama", "outrider_http"]
SENTENCES = ["A man is eating food.", "Outrider serves models beside your application.", "short"]
# Over 256 tokens (the model's limit): one "word{i}" is several word pieces.
LONG = " ".join(f"word{i} and another clause about item number {i}" for i in range(60))
#: |alone - in a batch| per component on the torch backend (CPU): measured up to 1.2e-7 there;
#: ONNX Runtime on CPU gives identical bits (docs/HTTP.md)
TORCH_BATCH_TOLERANCE = 1e-6


def _manifest(name: str, **changes) -> str:
    data = yaml.safe_load((MANIFESTS / "minilm.yaml").read_text())
    data["name"] = name
    for key, value in changes.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return yaml.safe_dump(data)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The shipped minilm (not Matryoshka-trained: cuts long texts); minilm-mrl, a copy whose
    manifest declares Matryoshka widths and refuses long texts; minilm on torch with batching;
    echo (no tokenizer); a tiny generating model."""
    tmp = tmp_path_factory.mktemp("embeddings")
    mrl = write_manifest(tmp, _manifest("minilm-mrl", options={"matryoshka": True, "truncate": False}), "mrl.yaml")
    torch_minilm = yaml.safe_load((MANIFESTS / "minilm-torch.yaml").read_text())
    torch_minilm.update(device="cpu", batching={"max_batch_size": 32, "max_queue_delay_ms": 5})
    torch_path = write_manifest(tmp, yaml.safe_dump(torch_minilm), "torch.yaml")
    tiny = write_manifest(tmp, yaml.safe_dump({"name": "tiny", "backend": "hf-llama", "options": {"seed": 3}}),
                          "tiny.yaml")
    port = free_port()
    process = start_server(tmp, [MANIFESTS / "minilm.yaml", mrl, torch_path, MANIFESTS / "echo.yaml", tiny], PLUGINS,
                           args=["--http", f"127.0.0.1:{port}"])
    try:
        process.wait_ready()
        process.url = f"http://127.0.0.1:{port}"
        yield process
    finally:
        process.stop()


def _openai(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def _vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)


def _refused(response: httpx.Response, param: str, *words: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


# -- usage and token ids ----------------------------------------------------------------------


def test_usage_counts_the_tokens_the_model_was_fed(server):
    counts = [_post(server, "/tokenize", {"model": "minilm", "prompt": s}).json()["count"] for s in SENTENCES]
    answer = _openai(server).embeddings.create(model="minilm", input=SENTENCES)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(counts) > 3 * 2  # [CLS] and [SEP] too
    long = _post(server, "/v1/embeddings", {"model": "minilm", "input": [LONG, "short"]}).json()
    assert long["usage"]["prompt_tokens"] == 256 + 3  # cut to the model's limit: what it saw


def test_token_ids_in_give_the_vectors_of_their_text(server):
    with server.client() as zmq:
        expected = zmq.infer("minilm", {"text": np.array(SENTENCES, dtype=object)})["embedding"]
    ids = [_post(server, "/tokenize", {"model": "minilm", "prompt": s}).json()["tokens"] for s in SENTENCES]
    from_ids = _vectors(_post(server, "/v1/embeddings", {"model": "minilm", "input": ids}))
    np.testing.assert_array_equal(from_ids, expected)  # the same feeds, so the same bits
    one = _post(server, "/v1/embeddings", {"model": "minilm", "input": ids[0]})  # one list of ints: one input
    np.testing.assert_array_equal(_vectors(one), expected[:1])
    assert one.json()["usage"]["prompt_tokens"] == len(ids[0])
    client = _openai(server)  # the openai client sends token lists as they are
    assert np.allclose(client.embeddings.create(model="minilm", input=ids).data[2].embedding, expected[2], atol=1e-6)
    # ZeroMQ clients send ids as a `text` element: the 0xFF mark, then little-endian uint32 ids.
    element = b"\xff" + np.array(ids[1], dtype="<u4").tobytes()
    with server.client() as zmq:
        mixed = zmq.infer("minilm", {"text": np.array([element, SENTENCES[0].encode()], dtype=object)})["embedding"]
        np.testing.assert_array_equal(mixed, expected[[1, 0]])
        with pytest.raises(BadRequestError, match="outside the vocabulary"):
            zmq.infer("minilm", {"text": np.array([b"\xff" + np.array([30522], "<u4").tobytes()], dtype=object)})
        with pytest.raises(BadRequestError, match="4 bytes each"):
            zmq.infer("minilm", {"text": np.array([b"\xff\x01\x02"], dtype=object)})


@pytest.mark.parametrize("given, words", [
    ([[101, 30522, 102]], ["input[0]", "30522", "vocabulary"]),
    ([101, -1, 102], ["input[0]", "-1", "vocabulary"]),
    ([[101, 102], []], ["input[1]", "0 token ids"]),
    ([list(range(1000, 1300))], ["input[0]", "300 token ids", "256"]),
    ([101, True, 102], []),
    ([101, 1.5, 102], []),
    ([[101, 102], "text"], []),
    ([], ["must not be empty"]),
])
def test_bad_token_ids_are_a_400_naming_input(server, given, words):
    _refused(_post(server, "/v1/embeddings", {"model": "minilm", "input": given}), "input", *words)


def test_token_ids_are_never_cut(server):
    response = _post(server, "/v1/embeddings", {"model": "minilm", "input": [101, 102], "truncate": True})
    _refused(response, "truncate", "never cut")
    _refused(_post(server, "/v1/embeddings", {"model": "echo", "input": [1, 2]}), "model", "does not embed")


# -- truncation ---------------------------------------------------------------------------------


def test_truncation_policy_per_request_and_from_the_manifest(server):
    cut = _vectors(_post(server, "/v1/embeddings", {"model": "minilm", "input": LONG}))
    explicit = _vectors(_post(server, "/v1/embeddings", {"model": "minilm", "input": LONG, "truncate": True}))
    np.testing.assert_array_equal(cut, explicit)  # minilm's manifest cuts by default (as before)
    refused = _post(server, "/v1/embeddings", {"model": "minilm", "input": ["short", LONG], "truncate": False})
    message = _refused(refused, "input", "input[1]", "542 tokens", "256")
    assert "truncate" in message
    # minilm-mrl's manifest says truncate: false, so it refuses unless the request says otherwise.
    _refused(_post(server, "/v1/embeddings", {"model": "minilm-mrl", "input": [LONG]}), "input", "input[0]", "542")
    allowed = _vectors(_post(server, "/v1/embeddings", {"model": "minilm-mrl", "input": LONG, "truncate": True}))
    np.testing.assert_array_equal(allowed, cut)
    short = _post(server, "/v1/embeddings", {"model": "minilm-mrl", "input": "short"})
    assert short.status_code == 200
    huge = _post(server, "/v1/embeddings", {"model": "minilm", "input": "word " * 20000, "truncate": False})
    _refused(huge, "input", "at least")  # only a prefix is tokenized, and it is already over the limit
    with server.client() as zmq:  # ZeroMQ clients get the manifest's policy, from the task itself
        with pytest.raises(BadRequestError, match="element 1 has 542 tokens.*options.truncate is false"):
            zmq.infer("minilm-mrl", {"text": np.array(["short", LONG], dtype=object)})
        assert zmq.infer("minilm", {"text": np.array([LONG], dtype=object)})["embedding"].shape == (1, 384)


# -- dimensions -------------------------------------------------------------------------------


def test_dimensions_on_a_matryoshka_model_are_renormalized_prefixes(server):
    full = _vectors(_post(server, "/v1/embeddings", {"model": "minilm-mrl", "input": SENTENCES}))
    for k in (128, 1, 383):
        short = _vectors(_post(server, "/v1/embeddings", {"model": "minilm-mrl", "input": SENTENCES, "dimensions": k}))
        want = full[:, :k].astype(np.float64)
        want /= np.linalg.norm(want, axis=1, keepdims=True)
        assert short.shape == (3, k)
        np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-6)
        np.testing.assert_allclose(short, want, atol=1e-6)
    as_base64 = _openai(server).embeddings.create(model="minilm-mrl", input="short", dimensions=64)
    assert len(as_base64.data[0].embedding) == 64
    raw = _post(server, "/v1/embeddings", {"model": "minilm-mrl", "input": "short", "dimensions": 64,
                                           "encoding_format": "base64"}).json()
    assert np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4").shape == (64,)


def test_dimensions_are_refused_where_the_manifest_does_not_declare_them(server):
    # all-MiniLM-L6-v2 was not trained for shortened embeddings: the shipped manifest refuses them.
    with pytest.raises(openai.BadRequestError) as refused:
        _openai(server).embeddings.create(model="minilm", input=SENTENCES, dimensions=128)
    assert refused.value.body["param"] == "dimensions" and "options.matryoshka" in refused.value.body["message"]
    same = _post(server, "/v1/embeddings", {"model": "minilm", "input": "short", "dimensions": 384})
    assert _vectors(same).shape == (1, 384)  # its own width changes nothing
    for bad in (0, -3, 385):
        _refused(_post(server, "/v1/embeddings", {"model": "minilm-mrl", "input": "x", "dimensions": bad}),
                 "dimensions", "1 to 384")


def test_matryoshka_widths_listed_in_the_manifest_are_the_only_ones():
    from outrider.errors import ManifestError
    from outrider.manifest import validate_manifest
    from outrider.plugins import create_registry

    registry = create_registry(modules=["outrider_text"], load_entry_points=False)

    def task(**options):
        data = yaml.safe_load(_manifest("m", options=options))
        return registry.make_task(validate_manifest(data, where="m.yaml"))

    listed = task(matryoshka_dimensions=[256, 128])
    assert listed.matryoshka and listed.dimensions == {384, 256, 128}
    assert task().dimensions == {384} and not task().matryoshka and task().truncate is True
    for options, field in (({"matryoshka_dimensions": [512]}, "options.matryoshka_dimensions"),
                           ({"matryoshka": "yes"}, "options.matryoshka"), ({"truncate": 1}, "options.truncate")):
        with pytest.raises(ManifestError, match=field):
            task(**options)


# -- /tokenize and /detokenize ----------------------------------------------------------------


def test_tokenize_and_detokenize_an_embedding_model(server):
    answer = _post(server, "/tokenize", {"model": "minilm", "prompt": "Hello world", "return_token_strs": True}).json()
    assert answer == {"count": 4, "max_model_len": 256, "tokens": [101, 7592, 2088, 102],
                      "token_strs": ["[CLS]", "hello", "world", "[SEP]"]}
    bare = _post(server, "/tokenize", {"model": "minilm", "prompt": "Hello world", "add_special_tokens": False})
    assert bare.json()["tokens"] == [7592, 2088]
    assert _post(server, "/tokenize", {"model": "minilm", "prompt": LONG}).json()["count"] == 542  # not cut
    text = _post(server, "/detokenize", {"model": "minilm", "tokens": [101, 7592, 2088, 102]}).json()
    assert text == {"prompt": "[CLS] hello world [SEP]"}
    skipped = _post(server, "/detokenize", {"model": "minilm", "tokens": [101, 7592, 2088, 102],
                                            "skip_special_tokens": True})
    assert skipped.json() == {"prompt": "hello world"}
    _refused(_post(server, "/detokenize", {"model": "minilm", "tokens": [7592, 40000]}), "tokens", "tokens[1]")
    _refused(_post(server, "/detokenize", {"model": "minilm", "tokens": ["a"]}), "tokens")
    _refused(_post(server, "/tokenize", {"model": "minilm", "messages": [{"role": "user", "content": "x"}]}),
             "messages", "chat template")
    _refused(_post(server, "/tokenize", {"model": "echo", "prompt": "x"}), "model", "no tokenizer")
    missing = _post(server, "/tokenize", {"model": "nope", "prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_tokenize_a_generating_model_as_its_engine_does(server):
    answer = _post(server, "/tokenize", {"model": "tiny", "prompt": "abc abc"}).json()
    assert answer["tokens"] == [0, 1, 2, 26, 0, 1, 2] and answer["max_model_len"] == 256
    completion = _openai(server).completions.create(model="tiny", prompt="abc abc", max_tokens=2, temperature=0)
    assert completion.usage.prompt_tokens == answer["count"]  # what the engine was fed
    chat = [{"role": "user", "content": "abc"}, {"role": "user", "content": [{"type": "text", "text": "de"}]}]
    rendered = _post(server, "/tokenize", {"model": "tiny", "messages": chat}).json()
    reply = _openai(server).chat.completions.create(model="tiny", messages=chat, max_tokens=2, temperature=0)
    assert rendered["count"] == reply.usage.prompt_tokens
    assert _post(server, "/detokenize", {"model": "tiny", "tokens": answer["tokens"]}).json() == {"prompt": "abc abc"}
    _refused(_post(server, "/tokenize", {"model": "tiny", "prompt": "ABC"}), "prompt", "alphabet")
    _refused(_post(server, "/tokenize", {"model": "tiny", "prompt": "a", "add_special_tokens": True}),
             "add_special_tokens")
    _refused(_post(server, "/detokenize", {"model": "tiny", "tokens": [0, 999]}), "tokens")
    _refused(_post(server, "/tokenize", {"model": "tiny"}), "prompt", "exactly one")


# -- batch invariance -------------------------------------------------------------------------


def _mixed_sentences(count: int, seed: int = 0) -> list[str]:
    words = "the quick brown fox jumps over a lazy dog while models serve text beside applications".split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.choice((1, 3, 8, 20, 60, 150)))) for _ in range(count)]


@pytest.mark.parametrize("model, tolerance", [("minilm", 0.0), ("minilm-torch", TORCH_BATCH_TOLERANCE)])
def test_a_sentence_gets_the_same_vector_alone_and_in_any_batch(server, model, tolerance):
    sentences = _mixed_sentences(24) + [LONG, "", "Ünïcödé façade — 東京は雨です 🚀"]
    alone = np.concatenate([_vectors(_post(server, "/v1/embeddings", {"model": model, "input": s}))
                            for s in sentences])
    with server.client() as zmq:
        before = zmq.health()["models"][model]["stats"]["batch_size"]
    # One request of mixed lengths: one call, every row padded to the longest.
    together = _vectors(_post(server, "/v1/embeddings", {"model": model, "input": sentences}))
    np.testing.assert_allclose(together, alone, rtol=0, atol=tolerance)
    # Many clients at once: the dynamic batcher joins their requests into shared calls.
    order = list(range(len(sentences))) * 2
    random.Random(1).shuffle(order)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(
            lambda i: _vectors(_post(server, "/v1/embeddings", {"model": model, "input": sentences[i]})), order))
    for i, vector in zip(order, answers):
        np.testing.assert_allclose(vector, alone[i:i + 1], rtol=0, atol=tolerance)
    with server.client() as zmq:
        after = zmq.health()["models"][model]["stats"]["batch_size"]
    batches = after["count"] - before["count"]
    assert batches < len(order) + 1, "the concurrent requests were never batched together"
