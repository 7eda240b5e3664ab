"""Triton's model repository extension over the server's model repository (serving/repository.py).

  POST /v2/repository/index                      [{"name", "version", "state", "reason"}]
  POST /v2/repository/models/{name}/load         200 once the model is ready (warmed up)
  POST /v2/repository/models/{name}/unload       200 once it is drained and its memory freed

`state` is Triton's word (READY, LOADING, UNLOADING, UNAVAILABLE); `outrider_state` is ours
(available, loading, ready, unloading, failed). Loads and unloads run on threads (they take
seconds), a few at a time; Triton's `config` and `file:` load parameters are refused (a model
is changed by changing its manifest, under `--watch`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from outrider.errors import BadRequestError, OutriderError, OverloadedError

from .dispatch import Dispatcher, error_code, read_body, status_of

#: a control request's body: a few parameters
MAX_BODY = 64 << 10
#: loads and unloads under way at once, over all connections
MAX_CONTROL = 8
#: how long a load waits for its model to be ready before answering (it goes on loading after)
LOAD_WAIT_S = 600.0
_TRITON_STATE = {"ready": "READY", "loading": "LOADING", "unloading": "UNLOADING",
                 "available": "UNAVAILABLE", "failed": "UNAVAILABLE"}


def routes(dispatch: Dispatcher) -> list[Route]:
    server = dispatch.server
    repository = server.repository
    slots = asyncio.Semaphore(MAX_CONTROL)

    def error(exc: BaseException) -> JSONResponse:
        code, message = error_code(exc)
        return JSONResponse({"error": message}, status_code=status_of(code))

    async def document(request: Request) -> dict[str, Any]:
        """The request's JSON object; an empty body is an empty one."""
        body = await read_body(request, MAX_BODY)
        if not body.strip():
            return {}
        try:
            found = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise BadRequestError(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(found, dict):
            raise BadRequestError("the request body must be a JSON object")
        return found

    async def parameters(request: Request, allowed: set[str]) -> dict[str, Any]:
        given = (await document(request)).get("parameters", {})
        if not isinstance(given, dict):
            raise BadRequestError("'parameters' must be a JSON object")
        unknown = sorted(k for k in given if k not in allowed)
        if unknown:
            raise BadRequestError(f"parameters {unknown[:8]} are not supported here; supported: {sorted(allowed)} "
                                  "(a model's configuration is its manifest: change the file, under --watch)")
        return given

    async def control(work: Any) -> None:
        if slots.locked():
            raise OverloadedError(f"{MAX_CONTROL} model-control requests are already under way; retry")
        async with slots:
            await asyncio.to_thread(work)

    async def index(request: Request) -> Response:
        try:
            ready = (await document(request)).get("ready", False)
            if not isinstance(ready, bool):
                raise BadRequestError("'ready' must be true or false")
        except OutriderError as exc:
            return error(exc)
        items = []
        for item in repository.index(ready):
            entry = {"name": item["name"], "version": item["version"], "state": _TRITON_STATE[item["state"]],
                     "outrider_state": item["state"]}
            entry["reason"] = item.get("reason", "" if item["state"] == "ready" else item["state"])
            items.append(entry)
        return JSONResponse(items)

    async def load(request: Request) -> Response:
        name = request.path_params["name"]
        try:
            await parameters(request, set())
            await control(lambda: repository.load(name, wait_s=LOAD_WAIT_S))
        except OutriderError as exc:
            return error(exc)
        return Response(status_code=200)

    async def unload(request: Request) -> Response:
        name = request.path_params["name"]
        try:
            given = await parameters(request, {"unload_dependents", "cancel_streams"})
            cancel = given.get("cancel_streams", False)
            if not isinstance(cancel, bool):
                raise BadRequestError("parameter 'cancel_streams' must be true or false")
            await control(lambda: repository.unload(name, cancel_streams=cancel))
        except OutriderError as exc:
            return error(exc)
        return Response(status_code=200)

    return [
        Route("/v2/repository/index", index, methods=["POST"]),
        Route("/v2/repository/models/{name}/load", load, methods=["POST"]),
        Route("/v2/repository/models/{name}/unload", unload, methods=["POST"]),
    ]
