"""What a plugin adds without a core edit: an accelerator section of its own (validated by its
own model, shown in `models`) and a front in another protocol, through a real server."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

from conftest import TEST_PLUGINS, free_port, write_manifest

PLUGINS = ["outrider_echo", "outrider_test_extension"]


def _ask(port: int, body: dict) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(json.dumps(body).encode() + b"\n")
        return json.loads(sock.makefile().readline())


def test_a_plugin_section_and_a_plugin_front_serve_with_no_core_edit(server_factory, tmp_path):
    manifest = write_manifest(tmp_path, "name: e\nbackend: echo\nwarmup: {iterations: 0}\nstamp: {value: 7}\n")
    port = free_port()
    server = server_factory([manifest], PLUGINS, args=["--front", f"jsonline=127.0.0.1:{port}"])
    answer = _ask(port, {"model": "e", "x": [1.5, 2.5]})
    assert answer["ok"] is True and answer["outputs"] == {"x": [1.5, 2.5], "stamp": [7]}, answer
    refused = _ask(port, {"model": "nope", "x": [1.0]})
    assert refused["ok"] is False and "no model named 'nope'" in refused["error"], refused
    with server.client() as client:
        described = next(m for m in client.models() if m["name"] == "e")
        assert described["accelerators"] == {"stamp": {"name": "stamper", "role": "batch_policy"}}
        assert client.infer("e", {"x": np.ones(2, "float32")})["stamp"].tolist() == [7]


def test_a_plugin_section_is_validated_by_its_own_model_and_an_unknown_one_named(tmp_path, monkeypatch):
    from outrider.errors import ManifestError
    from outrider.manifest import load_manifest
    from outrider.plugins import create_registry
    from outrider.serving.assembly import build_model

    monkeypatch.syspath_prepend(str(TEST_PLUGINS))
    registry = create_registry(PLUGINS, load_entry_points=False)
    bad = write_manifest(tmp_path, "name: e\nbackend: echo\nstamp: {value: -1}\n", "bad.yaml")
    with pytest.raises(ManifestError, match=r"bad.yaml: field 'stamp.value': Input should be greater than or equal to 0"):
        load_manifest(bad, check_section=registry.check_section)
    typo = load_manifest(write_manifest(tmp_path, "name: e\nbackend: echo\nstmap: {value: 1}\n", "typo.yaml"))
    with pytest.raises(ManifestError, match=r"typo.yaml: field 'stmap': no loaded plugin provides this accelerator "
                                            r"\(sections the loaded plugins provide: stamp\)"):
        build_model(typo, registry)
