"""Shared fixtures: real server processes on ipc:// addresses, with exactly the plugins a test names."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
TEST_PLUGINS = Path(__file__).resolve().parent / "plugins"

# Nothing in tests/ loads plugins through entry points by accident: each test registers what it needs.
os.environ["OUTRIDER_PLUGINS"] = "none"


class ServerProcess:
    """A real `outrider serve` process; stopped (SIGTERM, then SIGKILL) by the fixture."""

    def __init__(self, proc: subprocess.Popen, address: str, log_path: Path) -> None:
        self.proc = proc
        self.address = address
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout: float = 30.0):
        from outrider import Client

        return Client(self.address, timeout=timeout)

    def wait_ready(self, timeout: float = 120.0) -> None:
        from outrider import Client, OutriderError

        with Client(self.address, timeout=1.0) as client:
            try:
                client.wait_ready(timeout, process=self.proc)
            except OutriderError as exc:
                raise AssertionError(f"{exc.message}:\n{self.log()}") from None

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    tmp_path: Path,
    manifests: list[str | Path],
    plugins: list[str],
    args: Optional[list[str]] = None,
    env: Optional[dict[str, str]] = None,
    address: Optional[str] = None,
) -> ServerProcess:
    address = address or f"ipc://{tmp_path}/outrider-{time.monotonic_ns()}.sock"
    log_path = tmp_path / f"server-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "outrider.cli", "serve", *map(str, manifests), "--bind", address]
    for plugin in plugins:
        cmd += ["--plugin", plugin]
    cmd += args or []
    full_env = dict(os.environ)
    full_env["OUTRIDER_PLUGINS"] = "none"
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TEST_PLUGINS), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    return ServerProcess(proc, address, log_path)


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


def free_port() -> int:
    """A loopback TCP port nobody listens on now (for a server a test starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_manifest(tmp_path: Path, text: str, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path
