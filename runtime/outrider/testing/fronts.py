"""Conformance check for a front: beside a real server, seen only through `Submitter`."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from ..manifest import Manifest, validate_manifest
from ..plugins import PluginRegistry, create_registry


SUBMITTER_MEMBERS = ("limits", "started", "models", "ready", "health", "submit", "cancel", "find_model", "repository")


class SubmitterView:
    """The server as a front may see it: the `Submitter` members and nothing else (any other
    attribute is an AttributeError naming it), with each submit and its replies counted."""

    def __init__(self, server: Any) -> None:
        self._server = server
        self.submitted = 0
        self.replied = 0

    def __getattr__(self, name: str) -> Any:
        if name not in SUBMITTER_MEMBERS:
            raise AttributeError(f"a front used server.{name}, which is not part of outrider.front.Submitter "
                                 f"({', '.join(SUBMITTER_MEMBERS)})")
        return getattr(self._server, name)

    def submit(self, *args: Any, on_reply: Any, **kwargs: Any) -> Any:
        assert isinstance(kwargs.get("client"), bytes), "submit(client=...) must be the connection's key (bytes)"
        self.submitted += 1

        def counted(header: dict, outputs: Any) -> None:
            self.replied += 1
            on_reply(header, outputs)

        return self._server.submit(*args, on_reply=counted, **kwargs)


def check_front(front_class: type, roundtrip: Callable[[str], Any], address: str,
                manifests: Optional[list[Manifest | dict]] = None, registry: Optional[PluginRegistry] = None,
                options: Optional[dict] = None, stop_timeout: float = 5.0) -> dict[str, Any]:
    """Run a front plugin (outrider.front.Front) beside a real server: it is built on the server
    seen only through `Submitter` (SubmitterView), listens once `start()` returns, takes the
    request `roundtrip(address)` sends in its own protocol (an echo model is served unless
    `manifests` say otherwise) through `submit` with its client key, hands each reply back, and
    `stop()` returns within `stop_timeout` with the address released. Returns counts."""
    import socket
    import tempfile

    from ..front import Front
    from ..server import Server, ServerConfig

    assert isinstance(front_class, type) and issubclass(front_class, Front) and front_class.name, \
        "a front subclasses outrider.front.Front and has a name"
    available, why = front_class.availability()
    if not available:
        assert why, "an unavailable front must say why"
        return {"available": False, "reason": why}
    registry = registry or create_registry(load_entry_points=False)
    models = [validate_manifest(m, "<conformance manifest>") if isinstance(m, dict) else m
              for m in (manifests or [{"name": "echo", "backend": "echo"}])]
    with tempfile.TemporaryDirectory() as directory:
        server = Server(models, registry, ServerConfig(address=f"ipc://{directory}/conformance.sock"))
        server.start()
        try:
            deadline = time.monotonic() + 120
            while not server.ready:
                assert time.monotonic() < deadline, "the conformance server's models did not get ready"
                time.sleep(0.05)
            view = SubmitterView(server)
            front = front_class(view, address, options or {})
            front.start()
            try:
                roundtrip(address)
                assert view.submitted >= 1, "the request did not reach server.submit"
                assert view.replied == view.submitted, f"{view.submitted} submitted, {view.replied} answered"
            finally:
                t0 = time.perf_counter()
                front.stop(stop_timeout)
                stopped = time.perf_counter() - t0
            assert stopped < stop_timeout + 1.0, f"stop() took {stopped:.1f} s; the limit was {stop_timeout} s"
        finally:
            server.shutdown(1.0)
    host, _, port = address.rpartition(":")
    if port.isdigit():  # a TCP address must be free again
        with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as probe:
            probe.bind((host.strip("[]"), int(port)))
    return {"available": True, "submitted": view.submitted, "stop_seconds": stopped}
