"""The ASGI application: OIP v2 routes, OpenAI routes and /metrics, over one dispatch path."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from outrider.stats import metrics_text

from . import kserve, openai_api
from .dispatch import Dispatcher


def build_app(server: Any, front: str = "http") -> Starlette:
    """Routes for `server`'s models; every infer and generate goes through `Server.submit`."""
    dispatch = Dispatcher(server, front)

    async def metrics(request: Request) -> Response:
        body, content_type = metrics_text(lambda: server.models)
        return Response(body, media_type=content_type)

    return Starlette(routes=[
        *kserve.routes(dispatch),
        *openai_api.routes(dispatch),
        Route("/metrics", metrics),
    ])
