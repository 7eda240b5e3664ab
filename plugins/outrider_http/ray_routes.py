"""The HTTP a Ray Serve replica answers behind Serve's proxy: the routes of `outrider serve --http`
(app.py) plus `GET /outrider/replica`, every response naming its replica (`x-outrider-replica`)."""

from __future__ import annotations

from typing import Any, Callable


def replica_app(server: Any, info: dict[str, Any]) -> Any:
    """The ASGI app of a replica's Outrider `server` (starlette, from ray[serve]); `info` says which replica."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from .app import routes as app_routes
    from .dispatch import Dispatcher

    dispatch = Dispatcher(server, "ray")

    async def replica(request: Request) -> Response:
        return JSONResponse({**info, "ready": bool(server.ready)})

    # The same routes as `outrider serve --http` (app.routes), plus which replica this is.
    routes = [*app_routes(dispatch), Route("/outrider/replica", replica)]
    return ReplicaHeader(Starlette(routes=routes), str(info.get("replica_id", "")))


class ReplicaHeader:
    """ASGI middleware: every HTTP response says which replica answered (`x-outrider-replica`)."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.value = replica.encode("latin-1", "replace")

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_replica(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-outrider-replica", self.value)]}
            await send(message)

        await self.app(scope, receive, send_with_replica)
