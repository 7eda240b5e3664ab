"""Writing the int8 graph: quantize_onnx runs ONNX Runtime's dynamic or static quantizer on the
planned nodes, with SmoothQuant (weights scaled, a Mul put before each DynamicQuantizeLinear) and
LLM.int8()'s outlier-channel split as the recipe asks."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

import numpy as np

from outrider.errors import ManifestError, QualityGateError

from .config import QuantizeConfig
from .onnx_graph import check_quantized, choose_nodes, excluded
from .onnx_recipe import check_config, cpu_class, recipe_for
from .onnx_sentences import Feeds

if TYPE_CHECKING:
    import onnx


def _weight_options(weights: str) -> dict[str, Any]:
    """quantize_dynamic / quantize_static arguments for a resolved `weights` encoding."""
    from onnxruntime.quantization import QuantType

    if weights == "uint8":
        return {"weight_type": QuantType.QUInt8}
    if weights in ("int8", "int7"):
        return {"weight_type": QuantType.QInt8, "reduce_range": weights == "int7"}
    raise ManifestError(f"field 'quantize.weights': expected int8, int7 or uint8 once resolved, got {weights!r}")


class _Calibration:
    """A CalibrationDataReader over a list of feeds (built lazily so onnxruntime loads late)."""

    def __new__(cls, feeds: list[Feeds], input_names: Sequence[str]):  # type: ignore[misc]
        from onnxruntime.quantization import CalibrationDataReader

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self._it = iter([{k: v for k, v in f.items() if k in input_names} for f in feeds])

            def get_next(self) -> Optional[Feeds]:
                return next(self._it, None)

        return Reader()


def activation_ranges(src: Union[Path, "onnx.ModelProto"], tensors: Sequence[str],
                      feeds: Iterable[Feeds]) -> dict[str, np.ndarray]:
    """Per-channel max |x| of each named tensor of `src` over the feeds (last axis = channels)."""
    import onnx

    if isinstance(src, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(src)  # the outputs added below stay out of the caller's graph
    else:
        model = onnx.load(str(src))
    have = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None)
                              for t in tensors if t not in have)
    import onnxruntime

    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    amax: dict[str, np.ndarray] = {}
    for batch in feeds:
        outputs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {n: batch[n] for n in names})))
        for t in tensors:
            # Padded positions included: in a batch, their values enter the dynamic range too.
            value = np.abs(outputs[t].reshape(-1, outputs[t].shape[-1])).max(axis=0)
            amax[t] = np.maximum(amax[t], value) if t in amax else value
    if not amax:
        raise ManifestError("quantize.smooth_alpha needs calibration feeds; none were given")
    return amax


def _smooth_weights(model: "onnx.ModelProto", nodes: Sequence[str], amax: dict[str, np.ndarray],
                    alpha: float) -> dict[str, np.ndarray]:
    """Scale the weights of `nodes` in place by s per input channel; return {input tensor: s}."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    groups: dict[str, list[Any]] = {}
    for node in model.graph.node:
        if node.name in nodes:
            groups.setdefault(node.input[0], []).append(node)
    scales = {}
    for tensor, consumers in groups.items():
        weights = [numpy_helper.to_array(inits[c.input[1]]) for c in consumers]
        if len({id(inits[c.input[1]]) for c in consumers}) != len(consumers):
            raise ManifestError(f"quantize.smooth_alpha: MatMuls reading {tensor} share a weight; cannot smooth")
        # Q, K and V read one LayerNorm output: one s for all three, from their joint weight range.
        wmax = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
        s = (np.maximum(amax[tensor], 1e-5) ** alpha / np.maximum(wmax, 1e-5) ** (1 - alpha)).astype(np.float32)
        for c, w in zip(consumers, weights):
            inits[c.input[1]].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(np.float32), c.input[1]))
        scales[tensor] = s
    return scales


def split_outlier_channels(model: "onnx.ModelProto", nodes: Sequence[str], amax: dict[str, np.ndarray],
                           channels: int) -> tuple[list[str], list[str]]:
    """Split each MatMul y = x W in `nodes` in two, in place: the `channels` input channels with
    the largest max |x| (`amax`, calibrated) go through a float MatMul of their own, and the
    rest (x with those channels zeroed) through the original weight, which is then quantized:
    y = (x * mask) W + x[..., idx] W[idx]. This is LLM.int8()'s decomposition: dynamic int8
    activations have one scale per tensor, and a single channel ten times larger than the others
    (BERT's FFN output projections have them) would spend most of the 256 levels on itself.
    Returns (the inlier MatMuls, to quantize; the outlier MatMuls, to keep in float)."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    readers = Counter(name for n in model.graph.node for name in n.input)
    inliers, outliers = [], []
    rewritten = []
    for node in model.graph.node:
        if node.name not in nodes:
            rewritten.append(node)
            continue
        if readers[node.input[1]] != 1:
            raise ManifestError(f"quantize.outlier_channels: the weight of {node.name} is shared; cannot split it")
        x, weight = node.input[0], numpy_helper.to_array(inits[node.input[1]])
        if channels >= weight.shape[0]:
            raise ManifestError(f"field 'quantize.outlier_channels': {channels} is not fewer than the "
                                f"{weight.shape[0]} input channels of {node.name}")
        index = np.sort(np.argsort(amax[x])[::-1][:channels]).astype(np.int64)
        mask = np.ones(weight.shape[0], np.float32)
        mask[index] = 0.0
        p = node.name
        inlier_weight = weight.copy()
        inlier_weight[index] = 0.0  # read only through zeros; left out, they no longer widen a column's scale
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(inlier_weight, node.input[1]))
        model.graph.initializer.extend([
            numpy_helper.from_array(mask, f"{p}_inlier_mask"),
            numpy_helper.from_array(index, f"{p}_outlier_index"),
            numpy_helper.from_array(np.ascontiguousarray(weight[index]), f"{p}_outlier_weight"),
        ])
        rewritten += [
            helper.make_node("Mul", [x, f"{p}_inlier_mask"], [f"{p}_inlier_x"], name=f"{p}_inlier_Mul"),
            helper.make_node("MatMul", [f"{p}_inlier_x", node.input[1]], [f"{p}_inlier_y"], name=f"{p}_inlier"),
            helper.make_node("Gather", [x, f"{p}_outlier_index"], [f"{p}_outlier_x"], name=f"{p}_outlier_Gather",
                             axis=-1),
            helper.make_node("MatMul", [f"{p}_outlier_x", f"{p}_outlier_weight"], [f"{p}_outlier_y"],
                             name=f"{p}_outlier"),
            helper.make_node("Add", [f"{p}_inlier_y", f"{p}_outlier_y"], list(node.output), name=f"{p}_sum"),
        ]
        inliers.append(f"{p}_inlier")
        outliers.append(f"{p}_outlier")
    del model.graph.node[:]
    model.graph.node.extend(rewritten)
    return inliers, outliers


def _insert_smoothing(path: Path, scales: dict[str, np.ndarray]) -> None:
    """Put x * (1/s) in front of each DynamicQuantizeLinear that reads a smoothed tensor."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    # Done after quantize_dynamic, not before: ORT's own topological sort rejects the graph when
    # the Mul is already there, and this way the residual path keeps reading the unscaled x.
    for tensor, s in scales.items():
        quant = [n for n in model.graph.node if n.op_type == "DynamicQuantizeLinear" and n.input[0] == tensor]
        if len(quant) != 1:
            raise QualityGateError(f"expected one DynamicQuantizeLinear reading {tensor}, found {len(quant)}")
        smoothed = f"{tensor}_smoothed"
        model.graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), f"{smoothed}_inv_scale"))
        index = list(model.graph.node).index(quant[0])
        model.graph.node.insert(index, helper.make_node("Mul", [tensor, f"{smoothed}_inv_scale"], [smoothed],
                                                        name=f"{smoothed}_Mul"))
        quant[0].input[0] = smoothed
    onnx.save(model, str(path))


def quantize_onnx(src: Path, dst: Path, config: QuantizeConfig,
                  calibration_feeds: Optional[Iterable[Feeds]] = None) -> dict[str, Any]:
    """Write `src` quantized to int8 at `dst`; return the method, per_channel and nodes kept in float."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    if config.weights == "auto" or config.by_cpu:
        config = recipe_for(config, cpu_class())  # not resolved by the caller: this CPU's recipe
    check_config(config)
    model = onnx.load(str(src))
    quantize, kept = choose_nodes(model, config)
    if not quantize:
        raise ManifestError(f"{src}: no MatMul with a weight initializer to quantize (op types: MatMul)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    feeds = list(calibration_feeds or [])
    split: Optional[dict[str, Any]] = None
    if config.outlier_channels is not None:
        if not feeds:
            raise ManifestError("quantize.outlier_channels needs calibration feeds; none were given")
        # keep_sensitive is on (check_config), so what is kept and not excluded is the sensitive set.
        sensitive = [n for n in kept if not excluded(n, config)]
        inputs = sorted({n.input[0] for n in model.graph.node if n.name in sensitive})
        amax = activation_ranges(model, inputs, feeds)
        inliers, outliers = split_outlier_channels(model, sensitive, amax, config.outlier_channels)
        quantize = quantize + inliers
        kept = [n for n in kept if n not in sensitive] + outliers
        split = {"split_nodes": len(inliers), "outlier_channels": config.outlier_channels}
    weights = config.weights
    common = dict(op_types_to_quantize=["MatMul"], per_channel=config.per_channel, nodes_to_quantize=quantize,
                  **_weight_options(weights))
    quiet = logging.getLogger()
    level = quiet.level
    quiet.setLevel(max(level, logging.ERROR))  # ORT's "consider pre-processing" warning, once per build
    scales: dict[str, np.ndarray] = {}
    try:
        if config.method == "dynamic":
            source: Union[Path, "onnx.ModelProto"] = src if split is None else model
            if config.smooth_alpha is not None:
                inputs = sorted({n.input[0] for n in model.graph.node if n.name in quantize})
                scales = _smooth_weights(model, quantize, activation_ranges(model, inputs, feeds), config.smooth_alpha)
                source = model
            quantize_dynamic(source, dst, **common, extra_options={"MatMulConstBOnly": True})
            if scales:
                _insert_smoothing(dst, scales)
        else:
            if not feeds:
                raise ManifestError("quantize.method 'static' needs calibration feeds; none were given")
            names = [i.name for i in model.graph.input]
            quantize_static(src, dst, _Calibration(feeds, names), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QUInt8, calibrate_method=CalibrationMethod.MinMax,
                            extra_options={"MatMulConstBOnly": True, "WeightSymmetric": True}, **common)
    finally:
        quiet.setLevel(level)
    check_quantized(dst, quantize, kept)
    return {"method": config.method, "per_channel": config.per_channel, "op_types": ["MatMul"], "weights": weights,
            "smooth_alpha": config.smooth_alpha, "quantized_nodes": len(quantize), "float_nodes": kept,
            **(split or {})}
