"""API keys for the HTTP front: `Authorization: Bearer KEY` (or `x-api-key: KEY`, as Anthropic's
clients send it) on every route but health.

`--api-key-file FILE` holds one key per line, as it is or hashed (`sha256:HEX`, the hex SHA-256
of the key, so the file need not hold the key itself); blank lines and `# comments` are skipped.
The file must be private (no group or other access), as a CURVE secret key file must. It is
read again when it changes (checked at most once a second), so keys rotate without a restart; a
file that turns unreadable or empty keeps the keys last read, and says so in the log.

A request's key is compared with every key in constant time (hmac.compare_digest on SHA-256
digests), so neither which key matched nor how much of one matched shows in the timing. A
missing or wrong key is a 401 with `WWW-Authenticate: Bearer`, logged (rate-limited) with the
peer and path, never the key. `/v2/health/*` stays open (probes carry no keys), and `/metrics`
too with `--metrics-without-key` (a Prometheus scrape inside the cluster).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from typing import Any, Awaitable, Callable

from outrider.errors import OutriderError
from outrider.transport import check_private_file

log = logging.getLogger("outrider.http")

RELOAD_EVERY_S = 1.0
MAX_KEY_FILE_BYTES = 1 << 20
LOG_EVERY_S = 10.0


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_key_file(path: str) -> list[bytes]:
    """The SHA-256 digests of the keys in `path`; OutriderError (code bad_key) says what is wrong."""
    info = check_private_file(path, "--api-key-file")  # as a CURVE secret key file
    if info.st_size > MAX_KEY_FILE_BYTES:
        raise OutriderError(f"--api-key-file {path} is {info.st_size} bytes; the limit is {MAX_KEY_FILE_BYTES}",
                            code="bad_key")
    digests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("sha256:"):
                try:
                    digest = bytes.fromhex(line[7:])
                except ValueError:
                    digest = b""
                if len(digest) != 32:
                    raise OutriderError(f"--api-key-file {path}, line {number}: 'sha256:' must be followed by 64 "
                                        f"hex digits", code="bad_key")
                digests.append(digest)
            else:
                digests.append(_digest(line))
    if not digests:
        raise OutriderError(f"--api-key-file {path} holds no key", code="bad_key")
    return digests


class ApiKeys:
    """The keys of one key file, reloaded when it changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._digests = read_key_file(path)
        self._stamp = self._stat()
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def _stat(self) -> tuple[float, int, int]:
        try:
            info = os.stat(self.path)
            return info.st_mtime, info.st_size, info.st_ino
        except OSError:
            return 0.0, -1, -1

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < RELOAD_EVERY_S:
            return
        with self._lock:
            self._checked = now
            stamp = self._stat()
            if stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                self._digests = read_key_file(self.path)
                log.info("API keys reloaded from %s (%d keys)", self.path, len(self._digests))
            except OutriderError as exc:
                log.error("%s; keeping the %d keys read before", exc, len(self._digests))

    def allows(self, presented: str) -> bool:
        self._refresh()
        digest = _digest(presented)
        found = False
        for known in self._digests:  # every key compared, whichever matches
            found |= hmac.compare_digest(digest, known)
        return found


class RequireKey:
    """ASGI middleware: a Bearer key on every HTTP request but the open paths."""

    def __init__(self, app: Any, keys: ApiKeys, open_metrics: bool = False) -> None:
        self.app, self.keys, self.open_metrics = app, keys, open_metrics
        self._refused = 0
        self._logged = 0.0

    def _open(self, path: str) -> bool:
        return path.startswith("/v2/health/") or (self.open_metrics and path == "/metrics")

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable) -> None:
        if scope["type"] != "http" or self._open(scope.get("path", "")):
            return await self.app(scope, receive, send)
        header = api_key = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                header = value
            elif name == b"x-api-key":  # Anthropic's clients send the key so
                api_key = value
        scheme, _, key = header.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and key.strip() and self.keys.allows(key.strip()):
            return await self.app(scope, receive, send)
        if api_key.strip() and self.keys.allows(api_key.decode("latin-1").strip()):
            return await self.app(scope, receive, send)
        await self._refuse(scope, send, "a missing" if not (header or api_key) else "a wrong")

    async def _refuse(self, scope: dict, send: Callable, what: str) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            client = scope.get("client") or ("?", 0)
            log.warning("HTTP 401: %s API key from %s:%s for %s (%d refused since the last such line)",
                        what, client[0], client[1], scope.get("path", "")[:200], self._refused)
            self._logged, self._refused = now, 0
        message = "this server needs an API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
        path = scope.get("path", "")
        error: dict = {"error": message}
        if path.startswith("/v1/messages"):  # Anthropic's error shape
            error = {"type": "error", "error": {"type": "authentication_error", "message": message}}
        elif path.startswith("/v1/"):
            error = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                               "code": "unauthorized"}}
        body = json.dumps(error).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="outrider"')]})
        await send({"type": "http.response.body", "body": body})
