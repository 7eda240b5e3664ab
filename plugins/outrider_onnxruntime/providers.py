"""ONNX Runtime's execution providers: which to ask for, and what ORT did with them (the providers
it activated, the provider that ran each node), in words for the log and `health()`."""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Optional

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
GPU_PROVIDERS = (TENSORRT, CUDA)
#: what to install for a provider this build lacks
INSTALL_HINT = {TENSORRT: "install onnxruntime-gpu and TensorRT", CUDA: "install onnxruntime-gpu"}
#: ops whose place on the CPU, in a GPU session, costs real time (shape ops are put there on purpose)
COMPUTE_OPS = frozenset({
    "MatMul", "Gemm", "Conv", "ConvTranspose", "Attention", "MultiHeadAttention", "GroupQueryAttention",
    "FusedMatMul", "MatMulInteger", "QLinearMatMul", "MatMulNBits", "LSTM", "GRU", "Softmax",
    "LayerNormalization", "SkipLayerNormalization", "EmbedLayerNormalization", "BiasGelu", "FastGelu", "Gelu",
})


def providers_to_request(device: str, providers: Iterable[str], built: Iterable[str],
                         take_what_is_built: bool) -> list[str]:
    """The providers to ask ORT for: CPU on a CPU device; else the backend's, or those this build has."""
    if not device.startswith("cuda"):
        return [CPU]
    if take_what_is_built:
        built = set(built)
        return [p for p in providers if p in built] or [CPU]
    return list(providers)


def device_id(device: str) -> int:
    """'cuda:3' -> 3; 'cuda' and 'cpu' -> 0."""
    return int(device.split(":")[1]) if ":" in device else 0


def fallback_report(requested: list[str], active: list[str]) -> Optional[str]:
    """What ORT left out of the providers asked for, in words, or None when it took them all."""
    missing = [p for p in requested if p not in active]
    if not missing:
        return None
    return (f"asked for {', '.join(requested)}; onnxruntime activated only {', '.join(active)} "
            f"({', '.join(missing)} failed to load or is not in this build)")


def node_placement(events: list[dict[str, Any]]) -> dict[str, Counter]:
    """{provider: Counter(op type)} of the nodes ORT's profiler saw run (each node once)."""
    seen: dict[str, tuple[str, str]] = {}
    for event in events:
        args = event.get("args") or {}
        if event.get("cat") == "Node" and "provider" in args and "op_name" in args:
            seen[event.get("name", "").removesuffix("_kernel_time")] = (args["provider"], args["op_name"])
    placement: dict[str, Counter] = {}
    for provider, op in seen.values():
        placement.setdefault(provider, Counter())[op] += 1
    return placement


def node_fallback_report(placement: dict[str, Counter], active: list[str]) -> Optional[str]:
    """Compute nodes (COMPUTE_OPS) that ran on the CPU in a session led by a GPU provider, or None."""
    if not active or active[0] == CPU:
        return None
    on_cpu = {op: n for op, n in placement.get(CPU, Counter()).items() if op in COMPUTE_OPS}
    if not on_cpu:
        return None
    listed = ", ".join(f"{op} x{n}" for op, n in sorted(on_cpu.items()))
    return f"{sum(on_cpu.values())} compute node(s) ran on CPUExecutionProvider, not {active[0]}: {listed}"
