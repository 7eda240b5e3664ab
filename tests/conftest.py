"""Shared fixtures: real server processes on ipc:// addresses, with exactly the plugins a test names."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

from outrider.harness import ServerProcess, free_port  # noqa: F401  (tests import both from here)

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
TEST_PLUGINS = Path(__file__).resolve().parent / "plugins"

# Nothing in tests/ loads plugins through entry points by accident: each test registers what it needs.
os.environ["OUTRIDER_PLUGINS"] = "none"


def start_server(
    tmp_path: Path,
    manifests: list[str | Path],
    plugins: list[str],
    args: Optional[list[str]] = None,
    env: Optional[dict[str, str]] = None,
    address: Optional[str] = None,
) -> ServerProcess:
    """`outrider serve` with exactly `plugins` (the test plugins importable), its log in `tmp_path`."""
    address = address or f"ipc://{tmp_path}/outrider-{time.monotonic_ns()}.sock"
    paths = os.pathsep.join(filter(None, [str(TEST_PLUGINS), os.environ.get("PYTHONPATH")]))
    return ServerProcess.start(manifests, address, plugins=plugins, args=args, env={"PYTHONPATH": paths, **(env or {})},
                               log_path=tmp_path / f"server-{time.monotonic_ns()}.log", cwd=ROOT)


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh OUTRIDER_CACHE_DIR for the whole session (server processes inherit it): tests never
    depend on, or write to, a user's cache; the ONNX export happens once per session."""
    path = tmp_path_factory.mktemp("outrider-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OUTRIDER_CACHE_DIR", str(path))
        yield path


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator:
    started: list[ServerProcess] = []

    def factory(manifests, plugins, args=None, env=None, address=None, wait=True) -> ServerProcess:
        server = start_server(tmp_path, manifests, plugins, args, env, address)
        started.append(server)
        if wait:
            server.wait_ready()
        return server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture
def echo_server(server_factory) -> ServerProcess:
    return server_factory([MANIFESTS / "echo.yaml"], ["outrider_echo"])


def raw_dealer(address: str, **options):
    """A bare DEALER socket (LINGER 0) for tests that speak the wire protocol frame by frame;
    options are socket option names: raw_dealer(addr, RCVHWM=100)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    return sock


def write_manifest(tmp_path: Path, text: str, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(scope="session")
def smollm2_http(tmp_path_factory) -> Iterator[ServerProcess]:
    """smollm2-int8 (the native int4 path, speculation on) over ZeroMQ and HTTP (`.base`), shared by
    the test files that drive the HTTP routes with real SDKs: one server start for all of them."""
    pytest.importorskip("gguf")
    pytest.importorskip("starlette")
    port = free_port()
    server = start_server(tmp_path_factory.mktemp("smollm2-http"), [MANIFESTS / "smollm2-int8.yaml"],
                          ["outrider_llm", "outrider_speculative", "outrider_quantize", "outrider_http"],
                          args=["--http", f"127.0.0.1:{port}", "--set", "options.max_sequences=4",
                                "--set", "options.max_length=1024"])
    try:
        server.wait_ready(timeout=600)
        server.base = f"http://127.0.0.1:{port}"
        yield server
    finally:
        server.stop()
