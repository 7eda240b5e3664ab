"""The native TensorRT backend: what can be checked without TensorRT or a GPU runs here (engine
cache keys, the fp16 graph, availability); the engine itself needs both and is skipped, saying so."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from outrider import devices
from outrider.artifacts import ArtifactCache
from outrider.devices import Inventory
from outrider.manifest import validate_manifest
from outrider.plugins import create_registry

from outrider_tensorrt import ENGINE_FILE, TensorRTBackend, engine_artifact, fp16_onnx

onnx = pytest.importorskip("onnx")


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), "W")
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])], [weight]),
        opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    onnx.save(model, str(path))
    return path


def test_a_second_start_reads_the_engine_and_builds_nothing(graph: Path, tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)
    builds = []

    def build(engine_path: Path) -> dict:
        builds.append(engine_path)
        engine_path.write_bytes(b"serialized engine")
        return {"gpu": "NVIDIA H200"}

    options = {"bounds": {"max_batch": 32}, "fp16": False}
    first = engine_artifact(cache, graph, "NVIDIA H200", "9.0", "10.13.0.35", options, build)
    second = engine_artifact(cache, graph, "NVIDIA H200", "9.0", "10.13.0.35", options, build)
    assert len(builds) == 1 and first.path == second.path
    assert second.file(ENGINE_FILE).read_bytes() == b"serialized engine"
    assert second.provenance["device"] == "NVIDIA H200 sm9.0" and second.provenance["options"]["tensorrt"] == "10.13.0.35"
    # Anything the engine depends on builds another one.
    for changed in [("NVIDIA A100-SXM4-80GB", "8.0", "10.13.0.35", options),
                    ("NVIDIA H200", "9.0", "11.0.0.9", options),
                    ("NVIDIA H200", "9.0", "10.13.0.35", {**options, "fp16": True})]:
        engine_artifact(cache, graph, *changed, build)
    assert len(builds) == 4


def test_the_fp16_graph_keeps_its_inputs_and_outputs_and_is_made_once(graph: Path, tmp_path: Path) -> None:
    if importlib.util.find_spec("onnxruntime") is None:
        pytest.skip("the fp16 conversion uses onnxruntime's float16 tool")
    import onnxruntime

    cache = ArtifactCache(tmp_path)
    path = fp16_onnx(cache, graph)
    assert fp16_onnx(cache, graph) == path
    model = onnx.load(str(path))
    assert {i.data_type for i in model.graph.initializer} == {onnx.TensorProto.FLOAT16}
    io_types = {v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    assert io_types == {onnx.TensorProto.FLOAT}  # the engine still takes and returns fp32
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    reference = onnxruntime.InferenceSession(str(graph), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    half = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.allclose(half, reference, atol=1e-2)


def test_without_a_gpu_the_backend_says_why(graph: Path) -> None:
    registry = create_registry(modules=["outrider_text", "outrider_tensorrt"], load_entry_points=False)
    manifest = validate_manifest({"name": "t", "backend": "tensorrt", "options": {"onnx": str(graph)}}, where="t.yaml")
    avail = registry.backends["tensorrt"].availability(manifest, "auto")
    assert not avail.available
    if importlib.util.find_spec("tensorrt") is None:
        assert avail.reason == "tensorrt is not installed (pip install 'outrider[tensorrt]')"
    elif importlib.util.find_spec("torch") is not None and not devices.inventory().gpus:
        assert avail.reason.startswith("no GPU found")
    assert TensorRTBackend.resolve_device("auto") == "cuda"


@pytest.mark.gpu
def test_engine_builds_once_and_matches_onnxruntime(graph: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("tensorrt") is None:
        pytest.skip("tensorrt is not installed")
    if not devices.inventory().gpus:
        pytest.skip(devices.inventory().why_none())
    import onnxruntime

    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(tmp_path))
    manifest = validate_manifest({"name": "t", "backend": "tensorrt", "device": "cuda", "batching": {"max_batch_size": 8},
                                  "options": {"onnx": str(graph), "max_seq_length": 4}}, where="t.yaml")
    x = np.random.default_rng(2).standard_normal((20, 4)).astype(np.float32)  # 20 rows: three pieces of <= 8
    reference = onnxruntime.InferenceSession(str(graph), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    from outrider.plugins import create_registry

    # The batching section is the batching plugin's: its policy bounds the engine's profile (8 rows).
    accelerators = create_registry(["outrider_batching"], load_entry_points=False).accelerators_for(
        manifest, TensorRTBackend)
    for start in range(2):
        backend = TensorRTBackend(manifest, "cuda:0")
        backend.accelerators = accelerators
        backend.load()
        assert backend.built_now == (start == 0)
        out = backend.execute({"x": x})["y"]
        assert np.allclose(out, reference, atol=1e-3)
        assert backend.health()["healthy"]
        backend.unload()
