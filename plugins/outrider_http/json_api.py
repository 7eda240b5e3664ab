"""What every JSON API route of the HTTP front shares (OpenAI's, Anthropic's, vLLM's tokenize):
reading a body into its schema, the errors (OpenAI's shape; a route with another API's shape maps
`ApiError` onto it), finding the model a request names, and running one generate request whole
or streamed through the dispatcher, with the client's departure cancelling it."""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Optional

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from outrider.errors import ModelNotFoundError, OutriderError

from .dispatch import Call, ClientGone, Dispatcher, error_code, off_loop, read_body, status_of

log = logging.getLogger("outrider.http")


class Schema(BaseModel):
    # Clients send fields this server has no use for (user, metadata, store...): they are kept
    # aside and ignored, except those in UNSUPPORTED, refused when set to anything but the default.
    model_config = ConfigDict(extra="allow")


# Fields refused unless absent or at their default (value that means "off").
UNSUPPORTED = {
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "repetition_penalty": (None, 1, 1.0),
    "functions": (None, []), "audio": (None,), "prediction": (None,), "modalities": (None, ["text"]),
}


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, code: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    @classmethod
    def of(cls, exc: BaseException, param: Optional[str] = None) -> "ApiError":
        if isinstance(exc, ApiError):
            return exc
        code, message = error_code(exc)
        return cls(status_of(code), message, code, param or _param_named(message))

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.code in ("overloaded", "unavailable") else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _param_named(message: str) -> Optional[str]:
    # The engine's messages name the parameter: "parameter 'top_p' must be ..."
    if message.startswith("parameter '"):
        return message.split("'", 2)[1]
    return None


def bad_request(message: str, param: Optional[str] = None) -> ApiError:
    return ApiError(400, message, "bad_request", param)


def served_model(server: Any, name: str, load: bool = True) -> Any:
    """The model `name` serves (with `load`, an on-demand model starts loading: its PendingLoad),
    or the OpenAI-shaped error: a 404 naming the models served, a 503 for one not loaded."""
    try:
        return server.find_model(name, load)
    except ModelNotFoundError:
        raise ApiError(404, f"The model '{name[:128]}' does not exist; served here: {sorted(server.models)}",
                       "model_not_found", "model") from None
    except OutriderError as exc:
        raise ApiError.of(exc, "model") from None


async def parse_body(request: Request, schema: type[BaseModel], limit: int) -> Any:
    body = await read_body(request, limit)
    try:
        data = await off_loop(lambda: json.loads(body), len(body))
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        parsed = schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{where}: {first['msg']}", str(first["loc"][0]) if first["loc"] else None) from None
    for name, value in (parsed.model_extra or {}).items():
        if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
            raise bad_request(f"'{name}' is not supported by this server", name)
    return parsed


def failure_error(header: dict) -> ApiError:
    failure = header.get("error") or {}
    code, message = failure.get("code", "internal"), failure.get("message", "")
    return ApiError(status_of(code), message, code, _param_named(message))


def generating_model(server: Any, name: str) -> Any:
    """The generating model `name` (served_model's errors, and a 400 for one that does not generate)."""
    model = served_model(server, name)
    if not model.generates:
        raise bad_request(f"model '{name}' does not generate text", "model")
    return model


async def generate_whole(dispatch: Dispatcher, request: Request, model: str, parameters: dict) -> dict:
    """The final reply header of one generate request (an ApiError when it failed)."""
    call = dispatch.submit(request.scope, "generate", model, parameters)
    try:
        header, _ = await dispatch.final(call, request.receive)
    finally:
        dispatch.cancel(call, "the HTTP request failed")  # a no-op once answered
    if not header.get("ok"):
        raise failure_error(header)
    return header


async def generate_stream(dispatch: Dispatcher, request: Request, model: str,
                          parameters: dict) -> tuple[Call, tuple[str, dict, Optional[dict]]]:
    """(the call, its first event) of one streamed generate request. The first event is awaited
    before the route answers, so a request the engine refuses gets its 4xx, not a 200 stream that
    ends in an error."""
    call = dispatch.submit(request.scope, "generate", model, parameters, stream=True)
    try:
        first = await dispatch.next(call, request.receive)
    except BaseException:
        dispatch.cancel(call, "the HTTP request failed")
        raise
    if first[0] == "reply" and not first[1].get("ok"):
        raise failure_error(first[1])
    return call, first


def failed(request: Request, exc: BaseException,
           respond: Optional[Callable[[BaseException], Response]] = None) -> Response:
    """A route's answer to `exc`: 499 for a client that left, else `respond(exc)` (OpenAI's error
    shape by default); an exception that is not an API error is logged with its traceback."""
    if isinstance(exc, ClientGone):
        return Response(status_code=499)
    if not isinstance(exc, (ApiError, OutriderError)):
        log.exception("HTTP %s failed", request.url.path)
    return respond(exc) if respond is not None else ApiError.of(exc).response()
