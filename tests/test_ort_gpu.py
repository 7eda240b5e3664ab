"""ONNX Runtime's GPU paths, checked on a CPU: provider lists and options, the fall-back
decision, TensorRT profiles and engine-cache keys, node placement from the profiler, and I/O
binding with reused buffers (which runs the same on the CPU device). What needs onnxruntime-gpu
and a GPU is in tools/gpu_check.sh; docs/GPU.md says what never ran on one.

A small ONNX graph (MatMul, Softmax and a Shape branch) stands in for a model, so no export runs.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from outrider import devices
from outrider.backend import check_options
from outrider.devices import Inventory
from outrider.errors import BackendUnavailableError, ManifestError
from outrider.manifest import validate_manifest
from outrider.onnx.profiles import ProfileBounds, concat_rows, profile_bounds, profile_shapes, row_chunks
from outrider.plugins import create_registry

import outrider_onnxruntime as ortp
from outrider_onnxruntime.options import OrtOptions, build_provider_options
from outrider_onnxruntime.profiles import onnx_input_dims, ort_profile_options
from outrider_onnxruntime.providers import (CPU, CUDA, TENSORRT, fallback_report, node_fallback_report, node_placement,
                                            providers_to_request)

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

H200S = Inventory(tuple(devices.parse_nvidia_smi(
    "0, GPU-1f6c2a53-7c1e-8d4b-0a0e-6b2c1d3e4f50, NVIDIA H200, 143771, 4608, 37, 41, 9.0\n"
    "1, GPU-9a8b7c6d-5e4f-3a2b-1c0d-e9f8a7b6c5d4, NVIDIA H200, 143771, 1, 0, 29, 9.0\n")), "nvml")
A100 = Inventory(tuple(devices.parse_nvidia_smi(
    "0, GPU-3c2b1a09-8f7e-6d5c-4b3a-291807f6e5d4, NVIDIA A100-SXM4-80GB, 81920, 17, 0, 33, 8.0\n")), "nvml")


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """y = softmax(x @ W), plus n = Shape(x) (the kind of node ORT keeps on the CPU on purpose)."""
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Softmax", ["h"], ["y"], axis=-1),
             helper.make_node("Shape", ["x"], ["n"])]
    model = helper.make_model(helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("n", TensorProto.INT64, [2])], [weight]),
        opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    onnx.save(model, str(path))
    return path


def manifest(backend: str, onnx_path: Path, device: str = "cpu", **options):
    return validate_manifest({"name": "tiny", "backend": backend, "device": device,
                              "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
                              "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}],
                              "options": {"onnx": str(onnx_path), "intra_op_threads": 1, **options}},
                             where="tiny.yaml")


def loaded(backend: str, m, device: str = "cpu"):
    registry = create_registry(modules=["outrider_onnxruntime"], load_entry_points=False)
    instance = registry.backends[backend](m, device, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ORT's own UserWarning about a missing provider
        instance.load()
    return instance


@pytest.fixture
def fixed_inventory():
    def install(found: Inventory) -> None:
        devices.set_provider(lambda: found)
    yield install
    devices.set_provider(None)


# -- pure decisions ------------------------------------------------------------------------------

def test_providers_asked_for_by_device_and_backend() -> None:
    built = [CUDA, CPU]
    assert providers_to_request("cpu", (TENSORRT, CUDA, CPU), built, True) == [CPU]
    assert providers_to_request("cuda:1", (TENSORRT, CUDA, CPU), built, True) == [CUDA, CPU]
    # A strict backend asks for exactly its providers, so a missing one shows up as a fall-back.
    assert providers_to_request("cuda", (TENSORRT, CUDA, CPU), built, False) == [TENSORRT, CUDA, CPU]


def test_provider_options_take_placement_defaults_then_the_manifest(tmp_path: Path) -> None:
    opts = OrtOptions(fp16=True, provider_options={
        TENSORRT: {"trt_max_workspace_size": 1 << 30}, CUDA: {"cudnn_conv_algo_search": "HEURISTIC"},
        CPU: {"arena_extend_strategy": "kSameAsRequested"}})
    profile = {"trt_profile_min_shapes": "x:1x4", "trt_profile_opt_shapes": "x:8x4", "trt_profile_max_shapes": "x:32x4"}
    trt = build_provider_options(TENSORRT, "cuda:1", opts, tmp_path, profile)
    assert trt == {"device_id": 1, "trt_engine_cache_enable": True, "trt_engine_cache_path": str(tmp_path),
                   "trt_timing_cache_enable": True, "trt_timing_cache_path": str(tmp_path), "trt_fp16_enable": True,
                   **profile, "trt_max_workspace_size": 1 << 30}
    assert build_provider_options(CUDA, "cuda:3", opts) == {"device_id": 3, "cudnn_conv_algo_search": "HEURISTIC"}
    assert build_provider_options(CPU, "cpu", opts) == {"arena_extend_strategy": "kSameAsRequested"}


@pytest.mark.parametrize("options, field, expected", [
    ({"provider_options": {CUDA: {"device_id": 1}}}, "options.provider_options", "comes from the manifest's device"),
    ({"provider_options": {"CudaProvider": {}}}, "options.provider_options", "expected provider names"),
    ({"on_fallback": "ignore"}, "options.on_fallback", "'warn' or 'error'"),
])
def test_bad_gpu_options_are_manifest_errors_naming_the_field(graph: Path, options, field, expected) -> None:
    with pytest.raises(ManifestError) as caught:
        check_options(manifest("onnxruntime", graph, **options), ortp.OnnxRuntimeBackend)
    assert field in caught.value.message and expected in caught.value.message


def test_fallback_is_what_was_asked_for_and_not_activated() -> None:
    assert fallback_report([CUDA, CPU], [CUDA, CPU]) is None
    assert fallback_report([TENSORRT, CUDA, CPU], [CUDA, CPU]) == (
        f"asked for {TENSORRT}, {CUDA}, {CPU}; onnxruntime activated only {CUDA}, {CPU} "
        f"({TENSORRT} failed to load or is not in this build)")


def test_compute_nodes_on_the_cpu_of_a_gpu_session_are_a_fallback_shape_nodes_are_not() -> None:
    shapes_only = {CUDA: Counter({"MatMul": 12}), CPU: Counter({"Shape": 3, "Gather": 3})}
    assert node_fallback_report(shapes_only, [CUDA, CPU]) is None
    mixed = {CUDA: Counter({"MatMul": 10}), CPU: Counter({"MatMul": 2, "Shape": 1, "LayerNormalization": 1})}
    assert node_fallback_report(mixed, [CUDA, CPU]) == (
        f"3 compute node(s) ran on {CPU}, not {CUDA}: LayerNormalization x1, MatMul x2")
    assert node_fallback_report(mixed, [CPU]) is None  # a CPU session: where else would they run


def test_node_placement_from_a_real_profile(graph: Path, tmp_path: Path) -> None:
    options = onnxruntime.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "p")
    session = onnxruntime.InferenceSession(str(graph), options, providers=[CPU])
    session.run(None, {"x": np.ones((2, 4), np.float32)})
    with open(session.end_profiling()) as f:
        placement = node_placement(json.load(f))
    assert set(placement) == {CPU}
    assert placement[CPU]["MatMul"] == 1 and placement[CPU]["Softmax"] == 1


# -- TensorRT profiles ---------------------------------------------------------------------------

def test_profile_bounds_come_from_batching_and_sequence_settings(graph: Path) -> None:
    plain = manifest("onnxruntime", graph)
    assert profile_bounds(plain, task_max_length=256) == ProfileBounds(32, 1, 256, 128)
    batched = validate_manifest({**plain.model_dump(exclude={"source_file"}),
                                 "batching": {"max_batch_size": 64, "preferred_batch_sizes": [8, 16]}}, where="b.yaml")
    from outrider_batching import DynamicBatcher  # the batch policy the batching section turns on

    assert profile_bounds(batched, task_max_length=96, batch_policy=DynamicBatcher(batched)) == \
        ProfileBounds(64, 16, 96, 96)
    own = manifest("onnxruntime", graph, max_batch=4, max_seq_length=512)
    assert profile_bounds(own, task_max_length=256) == ProfileBounds(4, 1, 512, 128)
    with pytest.raises(ManifestError, match="'options.max_seq_length': 64 is shorter than the 256 tokens"):
        profile_bounds(manifest("onnxruntime", graph, max_seq_length=64), task_max_length=256)


def test_profile_shapes_bound_batch_and_sequence_and_keep_fixed_dims() -> None:
    bounds = ProfileBounds(max_batch=32, opt_batch=8, max_seq=256, opt_seq=128)
    shapes = profile_shapes({"input_ids": ["batch", "sequence"], "pixel": [-1, 3, 224, 224]}, bounds)
    assert shapes["input_ids"] == ([1, 1], [8, 128], [32, 256])
    assert shapes["pixel"] == ([1, 3, 224, 224], [8, 3, 224, 224], [32, 3, 224, 224])
    assert ort_profile_options({"input_ids": shapes["input_ids"], "mask": shapes["input_ids"]}) == {
        "trt_profile_min_shapes": "input_ids:1x1,mask:1x1",
        "trt_profile_opt_shapes": "input_ids:8x128,mask:8x128",
        "trt_profile_max_shapes": "input_ids:32x256,mask:32x256"}
    with pytest.raises(ManifestError, match="dynamic dimension 2"):
        profile_shapes({"x": ["batch", 3, "height"]}, bounds)


def test_graph_inputs_are_read_without_a_session(graph: Path) -> None:
    assert onnx_input_dims(graph) == {"x": ["batch", 4]}


def test_rows_past_the_profile_run_in_pieces_and_join_back() -> None:
    feeds = {"ids": np.arange(10 * 3).reshape(10, 3), "mask": np.ones((10, 3))}
    pieces = list(row_chunks(feeds, 4))
    assert [p["ids"].shape[0] for p in pieces] == [4, 4, 2]
    assert np.array_equal(concat_rows([{"y": p["ids"] * 2} for p in pieces])["y"], feeds["ids"] * 2)
    assert list(row_chunks(feeds, 10)) == [feeds]


def test_the_engine_cache_is_keyed_by_the_gpu_and_options(graph: Path, fixed_inventory) -> None:
    registry = create_registry(modules=["outrider_onnxruntime"], load_entry_points=False)

    def cache_dir(found: Inventory, **options) -> Path:
        fixed_inventory(found)
        backend = registry.backends["onnxruntime-tensorrt"](manifest("onnxruntime-tensorrt", graph, "cuda", **options),
                                                            "cuda:0", None)
        backend.onnx_path = graph
        return backend._tensorrt_cache_dir({"trt_profile_max_shapes": "x:32x4"})

    first = cache_dir(H200S)
    assert cache_dir(H200S) == first  # a second start finds the same engines
    assert cache_dir(A100) != first  # another GPU model or compute capability builds its own
    assert cache_dir(H200S, fp16=True) != first
    assert first.parent.name == "ort-tensorrt" and first.is_relative_to(devices_root())


def devices_root() -> Path:
    from outrider.artifacts import cache_root
    return cache_root()


# -- a real CPU session --------------------------------------------------------------------------

def test_a_cpu_session_asked_for_cpu_reports_no_fallback(graph: Path) -> None:
    backend = loaded("onnxruntime-cpu", manifest("onnxruntime-cpu", graph))
    backend.warmup()
    health = backend.health()
    assert health["requested_providers"] == health["active_providers"] == [CPU]
    assert health["fallback"] is None and health["io_binding"] is False
    assert "nodes_by_provider" not in health  # the profiler runs only where a GPU provider was asked


def test_io_binding_reuses_its_buffers_and_matches_a_plain_run(graph: Path) -> None:
    plain = loaded("onnxruntime-cpu", manifest("onnxruntime-cpu", graph))
    bound = loaded("onnxruntime-cpu", manifest("onnxruntime-cpu", graph, io_binding=True))
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    first = bound.execute({"x": x})
    assert np.array_equal(first["y"], plain.execute({"x": x})["y"]) and first["n"].tolist() == [5, 4]
    buffers = bound.io_binding.buffers
    (key, (inputs, outputs)), = buffers.items()
    pointers = (inputs["x"].data_ptr(), outputs[0].data_ptr())
    x_was = x.copy()
    again = bound.execute({"x": x + 1})  # same shapes: the same buffers, updated in place
    bound.execute({"x": x})
    assert np.array_equal(x, x_was)  # the caller's arrays are copied in, never written to
    again = bound.execute({"x": x + 1})
    assert (buffers[key][0]["x"].data_ptr(), buffers[key][1][0].data_ptr()) == pointers
    assert np.allclose(again["y"], plain.execute({"x": x + 1})["y"])
    assert not np.array_equal(again["y"], first["y"])  # the results are copies, not views of the buffers
    bound.execute({"x": x[:2]})
    assert len(buffers) == 2


def test_a_fallback_to_cpu_fails_the_load_when_the_manifest_says_error(graph: Path) -> None:
    if CUDA in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime build has the CUDA provider")
    warned = loaded("onnxruntime-cuda", manifest("onnxruntime-cuda", graph, "cuda"), "cuda")
    assert CUDA in warned.health()["fallback"] and warned.execute({"x": np.ones((1, 4), np.float32)})["y"].shape == (1, 3)
    with pytest.raises(BackendUnavailableError, match="options.on_fallback is 'error': asked for CUDAExecutionProvider"):
        loaded("onnxruntime-cuda", manifest("onnxruntime-cuda", graph, "cuda", on_fallback="error"), "cuda")


def test_auto_on_a_cpu_build_says_why_it_did_not_take_the_gpus(graph: Path, fixed_inventory) -> None:
    if CUDA in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime build has the CUDA provider")
    fixed_inventory(H200S)
    assert ortp.OnnxRuntimeBackend.choose_device("auto") == (
        "cpu", f"cpu: 2 GPU(s) found, but this onnxruntime build has no {CUDA} (install onnxruntime-gpu)")
    fixed_inventory(Inventory((), "none", ("nvidia-smi: not on PATH",)))
    assert ortp.OnnxRuntimeBackend.choose_device("auto") == ("cpu", "cpu: no GPU found: nvidia-smi: not on PATH")
    assert ortp.OnnxRuntimeBackend.choose_device("cuda:1") == ("cuda:1", "cuda:1: as the manifest asks")
