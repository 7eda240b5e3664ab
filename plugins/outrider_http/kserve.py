"""Open Inference Protocol v2 (KServe, Triton): health, metadata and infer, JSON or binary tensors.

A request's tensors become the same (description, buffer) pairs a ZeroMQ message carries: JSON
`data` is packed into the wire layout, binary tensor data (Triton's extension, which
`tritonclient.http` sends by default) is used in place. Both are checked by the core against the
same limits and decoded by the instance that runs the request.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from outrider import __version__
from outrider.backend import check_shapes
from outrider.errors import BadRequestError, ModelNotFoundError, OutriderError, ProtocolError
from outrider.protocol import datatype_of, encode_bytes_tensor, preview

from .dispatch import ClientGone, Dispatcher, error_code, off_loop, read_body, status_of
from .infer_request import parse_infer_request
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
        serving = str(model.version)
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
            return infer_response(model.name, document, outputs or {}, str(model.version))
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
