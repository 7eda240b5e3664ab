"""`http` front: Open Inference Protocol v2, OpenAI-compatible routes and /metrics over HTTP.

`outrider serve MANIFEST --http 127.0.0.1:8000` serves HTTP beside the ZeroMQ socket, in the same
process and from the same models: every request goes through `Server.submit`, so it shares the
queues (each HTTP connection is its own client for fairness), batching, limits, deadlines,
cancellation and metrics with ZeroMQ clients. starlette on uvicorn, sse-starlette for streams;
they are imported only when the front starts (`pip install 'outrider[http]'`).

Reads top to bottom: what it registers, how it starts (bind, then uvicorn on a thread of its
own), how it stops. The routes are gathered in `app.py`, from `kserve.py` (OIP v2),
`triton_generate.py` (Triton's generate extension), `openai_api.py` (OpenAI's generation routes),
`embeddings_api.py` (OpenAI's embeddings) and `tokenize_api.py` (vLLM's tokenize and detokenize),
over the bridge to the core in `dispatch.py`; `ray_serve.py` serves the same routes from Ray Serve replicas (`outrider[ray]`).
Endpoints, error mapping and metric names: docs/HTTP.md.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import socket
import threading
import time
from typing import Any, Callable, Optional

from outrider import hookimpl
from outrider.errors import OutriderError
from outrider.front import Front

__version__ = "0.1.0"

log = logging.getLogger("outrider.http")

_NEEDS = ("starlette", "uvicorn", "sse_starlette")


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT ([::1]:PORT for IPv6; an http:// prefix is allowed) as (host, port)."""
    text = address.removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise OutriderError(f"--http {address!r}: expected HOST:PORT, e.g. 127.0.0.1:8000", code="usage")
    return host, int(port)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class HttpFront(Front):
    """uvicorn on a thread of its own, serving the starlette app of `app.build_app`."""

    name = "http"

    def __init__(self, server: Any, address: str, options: Optional[dict] = None) -> None:
        super().__init__(server, address, options)
        self._uvicorn: Any = None
        self._thread: Optional[threading.Thread] = None
        self._failed: Optional[BaseException] = None
        self.port: Optional[int] = None

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        missing = [name for name in _NEEDS if importlib.util.find_spec(name) is None]
        if missing:
            return False, f"missing {', '.join(missing)}: pip install 'outrider[http]'"
        return True, ""

    def start(self) -> None:
        import uvicorn

        from .app import build_app

        host, port = parse_address(self.address)
        options = self.options
        tls = _tls_files(options)
        keys = None
        if options.get("api_key_file"):
            from .auth import ApiKeys

            keys = ApiKeys(options["api_key_file"])  # a bad or readable-by-others file fails the start
        if not _is_loopback(host) and not (tls and keys) and not options.get("insecure"):
            # As the ZeroMQ side refuses a non-loopback TCP bind without CURVE keys.
            raise OutriderError(
                f"--http {self.address}: a non-loopback address needs TLS and API keys (--tls-cert, --tls-key, "
                f"--api-key-file), or --http-insecure for a private network", code="usage")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets, and without it
        # a kept-alive connection waits ~40 ms per response (Nagle against the client's delayed ACK).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:  # bound here, so a taken port fails the start, not a thread later
            sock.close()
            raise OutriderError(f"--http {self.address}: cannot listen: {exc}", code="usage") from None
        sock.listen(2048)
        self.port = sock.getsockname()[1]
        app: Any = build_app(self.server, self.name)
        if keys is not None:
            from .auth import RequireKey

            app = RequireKey(app, keys, open_metrics=bool(options.get("open_metrics")))
        from .connection_limits import MAX_CONNECTIONS, protocol_class

        config = uvicorn.Config(
            app,
            http=protocol_class(),  # header size and count, header and body read timeouts
            limit_concurrency=MAX_CONNECTIONS,  # past it, a 503
            **({"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}),
            log_config=None,  # the process's logging is Outrider's
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, args=(sock,), name="outrider-http", daemon=True)
        self._thread.start()
        end = time.monotonic() + 30.0
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise OutriderError(f"--http {self.address}: the HTTP server did not start: {self._failed!r}")
            time.sleep(0.005)
        if not _is_loopback(host) and not (tls and keys):
            log.warning("HTTP on %s:%d without %s (--http-insecure): keep it on a private network or behind a "
                        "proxy that has them", host, self.port, "API keys" if tls else "TLS" if keys else "TLS or API keys")
        log.info("HTTP on %s://%s:%d (OIP v2 /v2, OpenAI /v1, /metrics)%s", "https" if tls else "http", host,
                 self.port, "; API keys required" if keys else "")

    def _run(self, sock: socket.socket) -> None:
        try:
            self._uvicorn.run(sockets=[sock])  # its own event loop; signals stay with the main thread
        except BaseException as exc:  # noqa: BLE001 - reported by start() or stop()
            self._failed = exc
            log.exception("the HTTP server stopped")

    def stop(self, timeout: float = 5.0) -> None:
        if self._uvicorn is None or self._thread is None:
            return
        self._uvicorn.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._uvicorn.force_exit = True
            self._thread.join(timeout)


def _tls_files(options: dict) -> Optional[tuple[str, str]]:
    """(certificate, key) when TLS is asked for; both or neither, each readable."""
    cert, key = options.get("tls_cert"), options.get("tls_key")
    if not cert and not key:
        return None
    if not (cert and key):
        raise OutriderError("give both --tls-cert and --tls-key", code="usage")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise OutriderError(f"{flag} {path}: {exc.strerror}", code="usage") from None
    return cert, key


@hookimpl
def outrider_register_fronts(register: Callable[[type], None]) -> None:
    """Register the `http` front."""
    register(HttpFront)
