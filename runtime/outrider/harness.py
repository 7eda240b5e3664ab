"""Running a real server from a test or a benchmark: start `outrider serve`, wait until it is ready,
stop it, read a process's memory, find a free loopback port. One copy for tests and tools alike
(re-exported by `outrider.testing`).

    server = ServerProcess.start(["manifests/minilm.yaml"], log_path=Path("server.log"))
    server.wait_ready()
    with server.client() as client: ...
    print(rss_mb(server.pid), server.stop())
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

PathLike = Union[str, Path]


def free_port() -> int:
    """A loopback TCP port nobody listens on now (for a server about to start)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _status(pid: Union[int, str]) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}


def rss_mb(pid: Union[int, str, None] = None, field: str = "VmRSS") -> float:
    """A process's resident memory in MB (`field`: VmRSS now, VmHWM its peak) from /proc; 0.0 where
    the process or /proc is gone. `pid` None: this process."""
    value = _status("self" if pid is None else pid).get(field, "0 kB").split()
    return int(value[0]) / 1024 if value and value[0].isdigit() else 0.0


def process_tree(pid: int) -> list[int]:
    """`pid` and every process under it (from /proc/PID/task/*/children), at most 4096."""
    out, todo = [], [pid]
    while todo and len(out) < 4096:
        current = todo.pop()
        out.append(current)
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def tree_rss_mb(pid: int, field: str = "VmRSS") -> float:
    """`rss_mb` summed over `pid` and every process under it (a server and its worker processes)."""
    return sum(rss_mb(p, field) for p in process_tree(pid))


class ServerProcess:
    """A real `outrider serve` child process: started, waited for, stopped (SIGTERM, then SIGKILL)."""

    def __init__(self, proc: subprocess.Popen, address: str, log_path: Optional[Path]) -> None:
        self.proc = proc
        self.address = address
        self.log_path = log_path

    @classmethod
    def start(cls, manifests: Sequence[PathLike], address: Optional[str] = None, *,
              plugins: Optional[Sequence[str]] = None, args: Optional[Sequence[str]] = None,
              env: Optional[dict[str, str]] = None, log_path: Optional[Path] = None,
              cwd: Optional[PathLike] = None) -> "ServerProcess":
        """`outrider serve MANIFESTS --bind ADDRESS [--plugin P]... [ARGS]` with this interpreter.

        `address` defaults to a fresh ipc:// path in the temp folder; `plugins`, when given, are the
        only ones loaded (OUTRIDER_PLUGINS=none and one --plugin each); `env` is laid over this
        process's environment; stdout and stderr go to `log_path` (None: discarded)."""
        address = address or f"ipc://{tempfile.gettempdir()}/outrider-{os.getpid()}-{time.monotonic_ns()}.sock"
        cmd = [sys.executable, "-m", "outrider.cli", "serve", *map(str, manifests), "--bind", address]
        full_env = dict(os.environ)
        if plugins is not None:
            for plugin in plugins:
                cmd += ["--plugin", plugin]
            full_env["OUTRIDER_PLUGINS"] = "none"
        cmd += list(args or [])
        full_env.update(env or {})
        if log_path is None:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=full_env, cwd=cwd)
        else:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd)
        return cls(proc, address, log_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        """What the server wrote so far ("" when its output is discarded)."""
        return self.log_path.read_text(errors="replace") if self.log_path is not None else ""

    def client(self, timeout: float = 30.0) -> Any:
        from outrider import Client

        return Client(self.address, timeout=timeout)

    def wait_ready(self, timeout: float = 120.0, interval: float = 0.02) -> float:
        """Block until every model is ready (health asked every `interval` seconds); the moment it was
        (time.monotonic()). RuntimeError with the server's log when it exits or the time runs out first."""
        from outrider import Client, OutriderError

        with Client(self.address, timeout=1.0) as client:
            try:
                client.wait_ready(timeout, interval=interval, process=self.proc)
            except OutriderError as exc:
                raise RuntimeError(f"{exc.message}:\n{self.log()[-20000:]}") from None
        return time.monotonic()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after `timeout` seconds; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
