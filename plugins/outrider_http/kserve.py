"""Open Inference Protocol v2 (KServe, Triton): health, metadata and infer, JSON or binary tensors.

A request's tensors become the same (description, buffer) pairs a ZeroMQ message carries: JSON
`data` is packed into the wire layout, binary tensor data (Triton's extension, which
`tritonclient.http` sends by default) is used in place. Both are checked by the core against the
same limits and decoded by the instance that runs the request.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Callable, Optional

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from outrider import __version__
from outrider.backend import check_shapes
from outrider.errors import BadRequestError, ModelNotFoundError, OutriderError, ProtocolError
from outrider.protocol import (DATATYPES, DEFAULT_LIMITS, Limits, check_shape, datatype_of, encode_bytes_tensor,
                               numpy_dtype, preview)

from .dispatch import ClientGone, Dispatcher, error_code, off_loop, read_body, status_of
from .json_worker import WORKER_BYTES, JsonWorker

log = logging.getLogger("outrider.http")

HEADER_LENGTH = "inference-header-content-length"
MODEL_VERSION = "1"  # a model's first version; each reload is the next (serving/repository.py)
MAX_TIMEOUT_US = 10**13  # about 116 days: past any deadline a request may mean


def routes(dispatch: Dispatcher) -> list[Route]:
    server = dispatch.server
    json_worker = JsonWorker()  # large JSON bodies, parsed outside this interpreter

    def error(exc: BaseException) -> JSONResponse:
        code, message = error_code(exc)
        return JSONResponse({"error": message}, status_code=status_of(code))

    def model_named(request: Request, load: bool = False) -> Any:
        """The model the path names (with `load`, an on-demand one starts loading: inference)."""
        name = request.path_params["name"]
        model = server.find_model(name, load)
        version = request.path_params.get("version")
        serving = str(getattr(model, "version", MODEL_VERSION))
        if version is not None and version != serving:
            raise ModelNotFoundError(f"model {name!r} serves version {serving}, not {version[:32]!r}")
        return model

    async def server_metadata(request: Request) -> Response:
        return JSONResponse({"name": "outrider", "version": __version__, "extensions": ["binary_tensor_data"]})

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        is_ready = server.ready
        return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)

    async def model_metadata(request: Request) -> Response:
        try:
            model = model_named(request)
        except OutriderError as exc:
            return error(exc)
        described = model.describe()
        return JSONResponse({
            "name": model.name,
            "versions": [str(model.version)],
            "platform": f"outrider_{described['backend']}",
            "inputs": [_spec(t) for t in described["inputs"]],
            "outputs": [_spec(t) for t in described["outputs"]],
        })

    async def model_ready(request: Request) -> Response:
        try:
            model = model_named(request)
        except OutriderError as exc:
            return error(exc)
        return JSONResponse({"name": model.name, "ready": model.ready}, status_code=200 if model.ready else 503)

    async def infer(request: Request) -> Response:
        call = None
        try:
            model = model_named(request, load=True)
            body = await read_body(request, server.limits.max_message_bytes)
            check = lambda shapes: check_shapes(model.manifest, shapes)  # noqa: E731
            header_length = request.headers.get(HEADER_LENGTH)
            if header_length is None and len(body) > WORKER_BYTES:  # parsed where it holds no GIL of ours
                document, inputs, buffers = await json_worker.parse(body, server.limits.max_tensor_elements, check)
            else:
                document, inputs, buffers = await off_loop(
                    lambda: parse_infer_request(body, header_length, server.limits, check), len(body))
            parameters = _parameters(document.get("parameters"))
            call = dispatch.submit(request.scope, "infer", model.name, parameters, inputs, buffers)
            header, outputs = await dispatch.final(call, request.receive)
            if not header.get("ok"):
                failure = header.get("error") or {}
                return JSONResponse({"error": failure.get("message", "")}, status_code=status_of(failure.get("code", "")))
            return infer_response(model.name, document, outputs or {}, str(getattr(model, "version", MODEL_VERSION)))
        except ClientGone:
            return Response(status_code=499)
        except OutriderError as exc:
            return error(exc)
        except Exception as exc:  # a bug here costs this request, answered 500
            log.exception("HTTP infer for model %s failed", request.path_params.get("name"))
            return error(exc)

    paths = ["/v2/models/{name}", "/v2/models/{name}/versions/{version}"]
    return [
        Route("/v2", server_metadata),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        *[Route(p, model_metadata) for p in paths],
        *[Route(p + "/ready", model_ready) for p in paths],
        *[Route(p + "/infer", infer, methods=["POST"]) for p in paths],
    ]


def _spec(tensor: dict) -> dict:
    return {"name": tensor["name"], "datatype": tensor["datatype"], "shape": list(tensor["shape"])}


def _parameters(given: Any) -> dict:
    """The core's parameters from an OIP request's: Triton's `timeout` is in microseconds."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise ProtocolError("'parameters' must be a JSON object")
    out: dict[str, Any] = {}
    if "timeout" in given:
        timeout = given["timeout"]
        # A JSON integer has no size limit: 10**400 is a Python int that no float holds.
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= MAX_TIMEOUT_US:
            raise BadRequestError(f"parameter 'timeout' must be a number of microseconds from 0 to {MAX_TIMEOUT_US}, "
                                  f"got {preview(timeout)}")
        out["timeout_ms"] = timeout / 1000
    if "timeout_ms" in given:
        out["timeout_ms"] = given["timeout_ms"]
    return out


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


def infer_response(model: str, document: dict, outputs: dict[str, np.ndarray], version: str = MODEL_VERSION) -> Response:
    """The OIP response: JSON data, or binary data after the JSON header where asked for."""
    parameters = document.get("parameters") if isinstance(document.get("parameters"), dict) else {}
    binary_default = bool(parameters.get("binary_data_output", False))
    requested = document.get("outputs")
    if requested is None:
        wanted = [(name, binary_default) for name in outputs]
    else:
        if not isinstance(requested, list) or not all(isinstance(r, dict) for r in requested):
            raise ProtocolError("'outputs' must be a list of JSON objects")
        wanted = []
        for r in requested:
            if r.get("name") not in outputs:
                raise BadRequestError(f"model {model!r} has no output {r.get('name')!r:.64}; it returns {sorted(outputs)}")
            options = r.get("parameters") if isinstance(r.get("parameters"), dict) else {}
            wanted.append((r["name"], bool(options.get("binary_data", binary_default))))
    described, chunks = [], []
    for name, binary in wanted:
        array = np.asarray(outputs[name])
        datatype = datatype_of(array)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary:
            raw = encode_bytes_tensor(array) if datatype == "BYTES" else np.ascontiguousarray(
                array.astype(array.dtype.newbyteorder("<"), copy=False)).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = _json_data(name, array, datatype)
        described.append(entry)
    reply: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": described}
    if "id" in document:
        reply["id"] = document["id"]
    head = json.dumps(reply, separators=(",", ":")).encode()
    if not chunks:
        return Response(head, media_type="application/json")
    return Response(b"".join([head, *chunks]), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})


def _json_data(name: str, array: np.ndarray, datatype: str) -> list:
    flat = array.reshape(-1)
    if datatype == "BYTES":
        try:
            return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in flat.tolist()]
        except UnicodeDecodeError:
            raise BadRequestError(f"output {name!r} is not UTF-8 text; ask for it as binary data") from None
    if datatype == "BF16":
        flat = flat.astype(np.float32)
    return flat.tolist()
