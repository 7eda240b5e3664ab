"""The HTTP front's API keys and TLS, against a real server: every route but health needs the key
(the openai and httpx clients send it), a wrong or missing one is a 401 with WWW-Authenticate,
keys rotate by editing the file, a key file others can read is refused, HTTPS with a
self-signed certificate the test makes, and a non-loopback bind without TLS and keys refused."""

from __future__ import annotations

import hashlib
import os
import shutil
import ssl
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from conftest import MANIFESTS, ROOT, free_port, start_server  # noqa: E402

PLUGINS = ["outrider_echo", "outrider_http"]
ECHO = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}


def _key_file(tmp_path, *lines: str):
    path = tmp_path / "keys"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    keys = _key_file(tmp, "# team A", "key-one", "sha256:" + hashlib.sha256(b"key-two").hexdigest())
    port = free_port()
    server = start_server(tmp, [MANIFESTS / "echo.yaml"], PLUGINS,
                          args=["--http", f"127.0.0.1:{port}", "--api-key-file", str(keys)])
    try:
        server.wait_ready(timeout=120)
        yield f"http://127.0.0.1:{port}", keys, server
    finally:
        server.stop()


def test_every_route_but_health_needs_a_key(keyed):
    base, _, server = keyed
    for path in ("/v2/health/ready", "/v2/health/live"):
        assert httpx.get(base + path).status_code == 200
    for method, path, body in (("POST", "/v2/models/echo/infer", ECHO), ("GET", "/v2/models/echo", None),
                               ("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/v2", None)):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic a2V5LW9uZQ=="},
                        {"Authorization": "Bearer"}, {"Authorization": "Bearer key-one-but-longer"}):
            answer = httpx.request(method, base + path, json=body, headers=headers)
            assert answer.status_code == 401, (path, headers, answer.text)
            assert answer.headers["www-authenticate"].startswith("Bearer")
        for key in ("key-one", "key-two"):  # as it is, and hashed in the file
            answer = httpx.request(method, base + path, json=body, headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 200, (path, key, answer.text)
        # Anthropic's clients send x-api-key: the same keys, the same refusals
        assert httpx.request(method, base + path, json=body, headers={"x-api-key": "key-two"}).status_code == 200
        for headers in ({"x-api-key": "nope"}, {"x-api-key": ""}, {"x-api-key": "Bearer key-one"}):
            assert httpx.request(method, base + path, json=body, headers=headers).status_code == 401, headers
    log = server.log()
    assert "HTTP 401" in log and "nope" not in log and "key-one" not in log
    api = openai.OpenAI(base_url=base + "/v1", api_key="key-one", max_retries=0)
    assert [m.id for m in api.models.list()] == ["echo"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    refused = httpx.post(base + "/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


def test_keys_rotate_by_editing_the_file(keyed):
    base, keys, _ = keyed
    original = keys.read_text()
    try:
        keys.write_text("key-three\n")
        keys.chmod(0o600)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if httpx.get(base + "/v1/models", headers={"Authorization": "Bearer key-three"}).status_code == 200:
                break
            time.sleep(0.2)
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer key-three"}).status_code == 200
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer key-one"}).status_code == 401
        keys.write_text("")  # an empty file keeps the keys read before
        time.sleep(1.5)
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer key-three"}).status_code == 200
    finally:
        keys.write_text(original)
        keys.chmod(0o600)


def _serve_fails(tmp_path, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "outrider.cli", "serve", str(MANIFESTS / "echo.yaml"),
                             "--bind", f"ipc://{tmp_path}/refused.sock", *args],
                            capture_output=True, text=True, timeout=60, cwd=ROOT,
                            env={**os.environ, "OUTRIDER_PLUGINS": "none", "PYTHONPATH": os.pathsep.join(
                                [str(ROOT / "runtime"), str(ROOT / "plugins")])})
    assert result.returncode != 0, result.stderr[-2000:]
    return result.stderr


def test_bad_key_files_and_open_binds_are_refused(tmp_path):
    port = free_port()
    plugins = ["--plugin", "outrider_echo", "--plugin", "outrider_http"]
    readable = _key_file(tmp_path, "k")
    readable.chmod(0o644)
    assert "has mode 0644" in _serve_fails(tmp_path, *plugins, "--http", f"127.0.0.1:{port}", "--api-key-file",
                                           str(readable))
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    empty.chmod(0o600)
    assert "holds no key" in _serve_fails(tmp_path, *plugins, "--http", f"127.0.0.1:{port}", "--api-key-file",
                                          str(empty))
    assert "needs TLS and API keys" in _serve_fails(tmp_path, *plugins, "--http", f"0.0.0.0:{port}")
    assert "give --http HOST:PORT too" in _serve_fails(tmp_path, *plugins, "--api-key-file", str(empty))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_with_a_self_signed_certificate(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    keys = _key_file(tmp_path, "tls-key")
    port = free_port()
    server = start_server(tmp_path, [MANIFESTS / "echo.yaml"], PLUGINS,
                          args=["--http", f"127.0.0.1:{port}", "--tls-cert", str(cert), "--tls-key", str(key),
                                "--api-key-file", str(keys)])
    try:
        server.wait_ready(timeout=120)
        trust = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=trust) as client:
            answer = client.post(f"https://127.0.0.1:{port}/v2/models/echo/infer", json=ECHO,
                                 headers={"Authorization": "Bearer tls-key"})
            assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [1.0, 2.0]
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port gets no answer
            httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5)
        api = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="tls-key", max_retries=0,
                            http_client=httpx.Client(verify=trust))
        assert [m.id for m in api.models.list()] == ["echo"]
    finally:
        server.stop()
