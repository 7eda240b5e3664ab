"""Parsing an OIP v2 infer request body: the JSON document, its inputs' shapes bounded by the
limits, and each input's bytes in the wire layout (JSON `data` packed, or its slice of the binary
part after the JSON header). Pure CPU work with no server state: the HTTP front runs it on its
loop for small bodies and `json_worker.py`'s child process runs it for large ones."""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional

import numpy as np

from outrider.errors import BadRequestError, ProtocolError
from outrider.protocol import DATATYPES, DEFAULT_LIMITS, Limits, check_shape, encode_bytes_tensor, numpy_dtype, preview

def split_body(body: bytes, header_length: Optional[str]) -> tuple[memoryview, memoryview]:
    """(JSON text, binary tensor data) of an infer body, split at Inference-Header-Content-Length."""
    view = memoryview(body)
    if header_length is None:
        return view, view[:0]
    # ASCII digits only, and no more of them than a body length can have: str.isdigit() takes
    # "¹²" (which int() refuses) and int() of thousands of digits is slow.
    if not (0 < len(header_length) <= 19 and header_length.isascii() and header_length.isdigit()) \
            or int(header_length) > len(body):
        raise ProtocolError(f"Inference-Header-Content-Length {header_length[:20]!r} does not fit a body of "
                            f"{len(body)} bytes")
    split = int(header_length)
    return view[:split], view[split:]


def parse_document(text: Any, limits: Limits = DEFAULT_LIMITS) -> tuple[dict, list[dict]]:
    """(the JSON document, its inputs with string names and shapes bounded by `limits`)."""
    try:
        document = json.loads(bytes(text))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"the request is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ProtocolError("the request must be a JSON object")
    requested = document.get("outputs")  # checked before inference runs, not after
    if requested is not None and (not isinstance(requested, list) or not all(
            isinstance(r, dict) and isinstance(r.get("name"), str) for r in requested)):
        raise ProtocolError("'outputs' must be a list of JSON objects, each with a string 'name'")
    specs = document.get("inputs")
    if not isinstance(specs, list):
        raise ProtocolError("'inputs' must be a list of tensors")
    for index, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise ProtocolError(f"input #{index} must be a JSON object")
        if not isinstance(spec.get("name"), str):
            raise ProtocolError(f"input #{index}: 'name' must be a string, got {preview(spec.get('name'))}")
        spec["shape"] = list(check_shape(spec["name"], spec.get("shape"), limits))  # bounded before any use
    return document, specs


def pack_inputs(specs: list[dict], binary: memoryview) -> list[Any]:
    """Each input's bytes in the wire layout: its JSON `data` packed, or its slice of `binary`."""
    buffers, offset = [], 0
    for spec in specs:
        name, datatype, shape = spec["name"], spec.get("datatype"), spec["shape"]
        parameters = spec.get("parameters") or {}
        size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise ProtocolError(f"input {name!r}: binary_data_size {preview(size)} does not fit the "
                                    f"{len(binary) - offset} binary bytes left in the body")
            buffers.append(binary[offset:offset + size])
            offset += size
        elif "data" in spec:
            buffers.append(_pack_json(name, datatype, shape, spec["data"]))
        else:
            raise ProtocolError(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
    if offset != len(binary):
        raise ProtocolError(f"the body carries {len(binary) - offset} binary bytes no input claims")
    return buffers


def parse_infer_request(body: bytes, header_length: Optional[str], limits: Limits = DEFAULT_LIMITS,
                        check: Optional[Callable[[dict], None]] = None) -> tuple[dict, list[dict], list[Any]]:
    """(the JSON document, tensor descriptions, buffers in the wire layout) of an infer request;
    `check({name: (datatype, shape)})` runs once the shapes are known, before JSON data is packed."""
    text, binary = split_body(body, header_length)
    document, specs = parse_document(text, limits)
    if check is not None:
        check({s["name"]: (s.get("datatype"), tuple(s["shape"])) for s in specs})
    inputs = [{"name": s["name"], "datatype": s.get("datatype"), "shape": s["shape"]} for s in specs]
    return document, inputs, pack_inputs(specs, binary)


def _pack_json(name: Any, datatype: Any, shape: Any, data: Any) -> bytes:
    """JSON `data` (flat or nested, row-major) as the tensor's bytes in the wire layout."""
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise ProtocolError(f"input {name!r}: unknown datatype {preview(datatype)}; expected one of {sorted(DATATYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f"input {name!r}: shape must be a list of non-negative integers")
    count = math.prod(shape)
    if datatype == "BYTES":
        items = _flatten(data)
        if len(items) != count:
            raise BadRequestError(f"input {name!r}: shape {shape} holds {count} elements, 'data' has {len(items)}")
        if not all(isinstance(item, str) for item in items):
            raise BadRequestError(f"input {name!r}: BYTES data in JSON must be strings")
        return encode_bytes_tensor(np.array(items, dtype=object))
    try:
        array = np.asarray(data, dtype=numpy_dtype(datatype))
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequestError(f"input {name!r}: 'data' is not {datatype} values: {exc}") from None
    if array.size != count:
        raise BadRequestError(f"input {name!r}: shape {shape} holds {count} elements, 'data' has {array.size}")
    return array.tobytes()


def _flatten(data: Any) -> list:
    if not isinstance(data, list):
        return [data]
    out: list = []
    stack = [iter(data)]
    while stack:  # iterative: a hostile nesting depth costs no recursion
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out
