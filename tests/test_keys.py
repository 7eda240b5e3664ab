"""CURVE keys through the real CLI: private files, refused permissions, allow-any only by name."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from outrider import Client
from outrider.errors import ModelNotReadyError, RequestTimeoutError
from outrider.transport import CurveClientKeys

from conftest import MANIFESTS, ROOT


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUTRIDER_PLUGINS="none")
    return subprocess.run([sys.executable, "-m", "outrider.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _serve(tmp_path, *curve_args: str) -> subprocess.CompletedProcess:
    return _cli("serve", str(MANIFESTS / "echo.yaml"), "--plugin", "outrider_echo",
                "--bind", f"ipc://{tmp_path}/k.sock", *curve_args)


def test_keygen_writes_private_files_and_never_overwrites(tmp_path):
    keys = tmp_path / "keys"
    result = _cli("keygen", str(keys), "--name", "server")
    assert result.returncode == 0, result.stderr
    assert _mode(keys) == 0o700
    assert _mode(keys / "server.key_secret") == 0o600
    assert _mode(keys / "server.key") == 0o644
    from zmq.auth import load_certificate

    public, secret = load_certificate(str(keys / "server.key_secret"))
    assert len(public) == 40 and len(secret) == 40
    assert load_certificate(str(keys / "server.key"))[0] == public

    again = _cli("keygen", str(keys), "--name", "server")
    assert again.returncode == 2 and "already exists" in again.stderr
    assert load_certificate(str(keys / "server.key_secret"))[1] == secret  # untouched

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    refused = _cli("keygen", str(shared))
    assert refused.returncode == 2 and "has mode 0755" in refused.stderr and "chmod 700" in refused.stderr
    assert not list(shared.iterdir())


def test_a_secret_key_others_can_read_is_refused(tmp_path):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    assert _cli("keygen", str(keys), "--name", "server").returncode == 0
    allowed.mkdir(mode=0o700)
    for mode in (0o640, 0o604):
        os.chmod(keys / "server.key_secret", mode)
        result = _serve(tmp_path, "--curve-secret-key", str(keys / "server.key_secret"), "--curve-allow", str(allowed))
        assert result.returncode == 2, result.stderr
        assert f"has mode {mode:04o}" in result.stderr and "chmod 600" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr

    # The client side refuses its own secret key the same way.
    assert _cli("keygen", str(keys), "--name", "client").returncode == 0
    os.chmod(keys / "client.key_secret", 0o644)
    probe = _cli("health", "--connect", f"ipc://{tmp_path}/none.sock", "--curve-server-key", str(keys / "server.key"),
                 "--curve-client-key", str(keys / "client.key_secret"))
    assert probe.returncode == 1 and "has mode 0644" in probe.stdout, probe.stdout + probe.stderr

    # A folder of allowed keys that others may write to would let them add their own key.
    os.chmod(keys / "server.key_secret", 0o600)
    os.chmod(allowed, 0o777)
    result = _serve(tmp_path, "--curve-secret-key", str(keys / "server.key_secret"), "--curve-allow", str(allowed))
    assert result.returncode == 2 and "others can add keys" in result.stderr, result.stderr


def test_allowing_any_client_key_needs_its_own_flag(tmp_path, server_factory):
    keys = tmp_path / "keys"
    assert _cli("keygen", str(keys), "--name", "server").returncode == 0
    secret = str(keys / "server.key_secret")
    star = _serve(tmp_path, "--curve-secret-key", secret, "--curve-allow", "*")
    assert star.returncode == 2 and "--curve-allow-any" in star.stderr, star.stderr
    neither = _serve(tmp_path, "--curve-secret-key", secret)
    assert neither.returncode == 2 and "--curve-allow DIR" in neither.stderr, neither.stderr

    server = server_factory([MANIFESTS / "echo.yaml"], ["outrider_echo"], wait=False,
                            args=["--curve-secret-key", secret, "--curve-allow-any"])
    assert _cli("keygen", str(tmp_path / "stranger"), "--name", "anyone").returncode == 0
    anyone = CurveClientKeys(str(keys / "server.key"), str(tmp_path / "stranger" / "anyone.key_secret"))
    deadline = time.monotonic() + 30
    with Client(server.address, timeout=1.0, curve=anyone) as client:
        while True:
            try:
                assert client.infer("echo", {"x": np.ones(2, np.float32)})["x"].sum() == 2
                break
            except (RequestTimeoutError, ModelNotReadyError):
                assert time.monotonic() < deadline, server.log()
    assert "every client key is admitted (--curve-allow-any)" in server.log()
    with Client(server.address, timeout=0.5) as plain:  # still no plaintext
        with pytest.raises(RequestTimeoutError):
            plain.health()
