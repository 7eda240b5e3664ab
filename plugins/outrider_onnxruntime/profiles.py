"""The ONNX Runtime TensorRT provider's side of a TensorRT profile: its option strings and the
graph's input dims read with `onnx`.

The profile bounds themselves are shared with the native `tensorrt` backend and live in the core
(`outrider.onnx.profiles`); what is here only the ORT backend uses, so this plugin owns it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from outrider.onnx.profiles import Dim


def ort_profile_options(shapes: dict[str, tuple[list[int], list[int], list[int]]]) -> dict[str, str]:
    """The TensorRT provider's explicit-profile options: 'input_ids:1x1,attention_mask:1x1'."""
    def spec(which: int) -> str:
        return ",".join(f"{name}:{'x'.join(map(str, bounds[which]))}" for name, bounds in shapes.items())

    if not shapes:
        return {}
    return {"trt_profile_min_shapes": spec(0), "trt_profile_opt_shapes": spec(1), "trt_profile_max_shapes": spec(2)}


def onnx_input_dims(onnx_path: Path) -> Optional[dict[str, list[Dim]]]:
    """Each graph input's dims (int, a symbolic name, or None) read with `onnx`, or None without it."""
    try:
        import onnx
    except ImportError:
        return None
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}  # old exports list weights as inputs too
    dims: dict[str, list[Dim]] = {}
    for value in graph.input:
        if value.name in initializers:
            continue
        shape = value.type.tensor_type.shape
        dims[value.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in shape.dim]
    return dims
