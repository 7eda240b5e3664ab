"""The ONNX graph as the int8 recipe sees it: its linear MatMuls, the sensitive ones (FFN output
projections, found by structure), the plan of what to quantize, and the check that the written graph
follows it."""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from outrider.errors import ManifestError, QualityGateError

from .config import QuantizeConfig

if TYPE_CHECKING:
    import onnx

#: ops whose output feeds an FFN output projection (GELU in its exported or fused forms)
_ACTIVATIONS = ("Erf", "Gelu", "FastGelu", "BiasGelu", "Tanh", "Relu")
#: where the walk back from a MatMul's input stops: nodes that mix values across a row or rows
_BARRIERS = ("MatMul", "Gemm", "LayerNormalization", "SkipLayerNormalization", "Softmax", "ReduceMean")
_ACTIVATION_HOPS = 6


def _linear_nodes(model: "onnx.ModelProto") -> list[tuple[str, Any]]:
    weights = {init.name for init in model.graph.initializer}
    linear = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    if any(not n.name for n in linear):
        raise ManifestError("the ONNX graph has unnamed MatMul nodes; cannot name the ones to quantize")
    return [(n.name, n) for n in linear]


def linear_matmuls(model: "onnx.ModelProto") -> list[str]:
    """Names of MatMul nodes whose B input is a weight initializer (the model's linear layers)."""
    return [name for name, _ in _linear_nodes(model)]


def sensitive_matmuls(model: "onnx.ModelProto") -> list[str]:
    """Linear MatMuls whose input comes from an activation: the FFN output projections.

    Found by structure, not by name, so any exporter's naming works: walk back from the MatMul's
    input through elementwise nodes (GELU is Div, Erf, Add, Mul, Mul when exported from torch)
    and stop at anything that mixes values (MatMul, Gemm, LayerNorm, Softmax). Their input is
    the GELU output, whose long positive tail dynamic per-tensor uint8 covers worst.
    """
    producer = {out: node for node in model.graph.node for out in node.output}
    found = []
    for name, node in _linear_nodes(model):
        frontier, seen = [node.input[0]], set()
        for _ in range(_ACTIVATION_HOPS):
            upstream = [producer[t] for t in frontier if t in producer and t not in seen]
            seen.update(frontier)
            if any(p.op_type in _ACTIVATIONS for p in upstream):
                found.append(name)
                break
            frontier = [t for p in upstream if p.op_type not in _BARRIERS for t in p.input]
    return found


def choose_nodes(model: "onnx.ModelProto", config: QuantizeConfig) -> tuple[list[str], list[str]]:
    """(nodes to quantize, linear nodes kept in float) for this graph and config."""
    linear = linear_matmuls(model)
    keep = set(sensitive_matmuls(model)) if config.keep_sensitive else set()
    unmatched = [p for p in config.exclude if not any(fnmatch.fnmatchcase(n, p) for n in linear)]
    if unmatched:
        # A pattern that matches nothing is a typo or a renamed graph: quantizing more than the
        # manifest meant to is exactly the silent failure this module guards against.
        raise ManifestError(
            f"field 'quantize.exclude': patterns {unmatched} match no quantizable MatMul node; "
            f"the graph's are named like {linear[:3]}"
        )
    keep |= {n for n in linear if excluded(n, config)}
    return [n for n in linear if n not in keep], [n for n in linear if n in keep]


def excluded(node: str, config: QuantizeConfig) -> bool:
    """Whether `node` matches one of the section's `exclude` patterns (it then stays float)."""
    return any(fnmatch.fnmatchcase(node, p) for p in config.exclude)


def _float_linear(model: "onnx.ModelProto") -> set[str]:
    weights = {init.name: init for init in model.graph.initializer}
    return {n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights
            and weights[n.input[1]].data_type in (1, 10, 16)}  # FLOAT, FLOAT16, BFLOAT16


def check_quantized(path: Path, quantized: Sequence[str], kept: Sequence[str]) -> None:
    """Raise unless every `kept` node is still a float MatMul and no `quantized` one is."""
    import onnx

    still_float = _float_linear(onnx.load(str(path), load_external_data=False))
    lost = sorted(set(kept) - still_float)
    leaked = sorted(set(quantized) & still_float)
    if lost or leaked:
        raise QualityGateError(
            f"quantized graph {path} does not match the plan: expected float MatMuls {lost} "
            f"(renamed or quantized), expected quantized {leaked} (still float)"
        )
