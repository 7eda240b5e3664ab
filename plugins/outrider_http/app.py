"""The ASGI application: OIP v2 routes, Triton's generate and model-repository extensions, OpenAI routes (generation in
openai_api.py; embeddings, tokenize and detokenize in embeddings_api.py), Anthropic's Messages
(anthropic_messages.py), OpenAI's Responses (openai_responses.py) and /metrics,
over one dispatch path; Ray Serve replicas (ray_serve.py) serve the same `routes`."""

from __future__ import annotations

import logging
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from outrider.stats import metrics_text

from . import kserve, repository_api, triton_generate
from .dispatch import Dispatcher

log = logging.getLogger("outrider.http")


def routes(dispatch: Dispatcher) -> list[Route]:
    """Every route of the HTTP front over `dispatch`, /metrics included."""
    server = dispatch.server

    async def metrics(request: Request) -> Response:
        body, content_type = metrics_text(lambda: server.models, server.repository.index)
        return Response(body, media_type=content_type)

    async def openapi(request: Request) -> Response:
        from .openapi import document

        return JSONResponse(document())

    found = [*kserve.routes(dispatch), *triton_generate.routes(dispatch), Route("/metrics", metrics),
             *repository_api.routes(dispatch)]
    try:
        from . import anthropic_messages, embeddings_api, openai_api, openai_responses, tokenize_api
    except ImportError as exc:  # sse-starlette is in outrider[http], not in ray[serve] (a Ray replica)
        log.info("OpenAI-compatible routes off (%s): pip install 'outrider[http]'", exc)
    else:
        found += [*openai_api.routes(dispatch), *embeddings_api.routes(dispatch), *tokenize_api.routes(dispatch),
                  *anthropic_messages.routes(dispatch),
                  *openai_responses.routes(dispatch), Route("/openapi.json", openapi)]
    return found


def build_app(server: Any, front: str = "http") -> Starlette:
    """Routes for `server`'s models; every infer and generate goes through `Server.submit`."""
    dispatch = Dispatcher(server, front)
    app = Starlette(routes=routes(dispatch))
    app.state.dispatch = dispatch  # read_body counts every route's bodies against its budget
    return app
