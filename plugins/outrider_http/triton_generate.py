"""Triton's generate extension: `POST /v2/models/{name}/generate` (one JSON reply) and
`.../generate_stream` (server-sent events, one per chunk, then the final one), for models that
generate text. The body is `{"text_input": ..., "parameters": {...}}` (or `prompt`/`messages`);
each event is `{"model_name", "model_version", "text_output", "token_ids"}`, the last with
`finish_reason` and `stats`. The same dispatch path as every other route (Server.submit).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from outrider.errors import OutriderError, error_from_wire

from .dispatch import ClientGone, Dispatcher, error_code, read_body, status_of


def routes(dispatch: Dispatcher) -> list[Route]:
    """The two generate routes over `dispatch`."""
    server = dispatch.server

    def error(exc: BaseException) -> JSONResponse:
        code, message = error_code(exc)
        return JSONResponse({"error": message, "code": code}, status_code=status_of(code))

    async def generate_call(request: Request, stream: bool) -> tuple[str, Any]:
        name = request.path_params["name"]
        body = await read_body(request, server.limits.max_message_bytes)
        try:
            document = json.loads(body or b"{}")
        except ValueError as exc:
            raise OutriderError(f"the body is not JSON: {exc}", code="bad_request") from None
        if not isinstance(document, dict):
            raise OutriderError("the body must be a JSON object", code="bad_request")
        parameters = document.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise OutriderError("'parameters' must be a JSON object", code="bad_request")
        parameters = dict(parameters)
        if "text_input" in document:  # Triton's generate extension
            parameters["prompt"] = document["text_input"]
        for key in ("prompt", "messages"):
            if key in document:
                parameters[key] = document[key]
        parameters["stream"] = stream
        return name, dispatch.submit(request.scope, "generate", name, parameters, stream=stream)

    async def generate(request: Request) -> Response:
        try:
            name, call = await generate_call(request, stream=False)
            header, _ = await dispatch.final(call, request.receive)
        except ClientGone:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - answered with its code
            return error(exc)
        if not header.get("ok", True):
            return error(error_from_wire(header.get("error") or {}))
        return JSONResponse(_generate_document(name, header, final=True))

    async def generate_stream(request: Request) -> Response:
        try:
            name, call = await generate_call(request, stream=True)
            first = await dispatch.next(call, request.receive)  # refused requests get a status, not a stream
        except ClientGone:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001
            return error(exc)
        if first[0] == "reply" and not first[1].get("ok", True):
            return error(error_from_wire(first[1].get("error") or {}))

        async def events() -> AsyncIterator[bytes]:
            item = first
            try:
                while True:
                    kind, header, _ = item
                    if kind == "reply" and not header.get("ok", True):
                        failure = header.get("error") or {}
                        yield _sse({"error": failure.get("message", ""), "code": failure.get("code", "")})
                        return
                    yield _sse(_generate_document(name, header, final=kind == "reply"))
                    if kind == "reply":
                        return
                    item = await call.next()
            finally:  # the client left: starlette cancels this generator
                dispatch.cancel(call, "the HTTP client disconnected")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    return [
        Route("/v2/models/{name}/generate", generate, methods=["POST"]),
        Route("/v2/models/{name}/generate_stream", generate_stream, methods=["POST"]),
    ]


def _generate_document(model: str, header: dict, final: bool) -> dict[str, Any]:
    document: dict[str, Any] = {"model_name": model, "model_version": "1", "text_output": header.get("text", ""),
                                "token_ids": list(header.get("token_ids", []))}
    if final:
        document["finish_reason"] = header.get("finish_reason", "")
        document["stats"] = dict(header.get("stats", {}))
    return document


def _sse(document: dict) -> bytes:
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"
