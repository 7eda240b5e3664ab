"""Hostile input: codec properties (hypothesis) and the socket fuzzer against real servers.

The fuzzer itself is tests/fuzz_socket.py (also a command); here it runs bounded: 5,000 messages
in the default suite, 100,000 (and hostile generation parameters next to well-formed streams) in
the slow one.
"""

from __future__ import annotations

import sys

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from conftest import MANIFESTS, TEST_PLUGINS, write_manifest
from outrider.errors import OutriderError
from outrider.protocol import Limits, decode_tensors, encode_tensors, parse_tensors, unpack_header

sys.path.insert(0, str(TEST_PLUGINS))

import fuzz_socket  # noqa: E402

SMALL = Limits(max_header_bytes=4096, max_tensors=8, max_tensor_elements=4096)
NUMERIC_DTYPES = st.sampled_from(["|b1", "|u1", "<u2", "<u4", "<u8", "|i1", "<i2", "<i4", "<i8", "<f2", "<f4", "<f8"])
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(NUMERIC_DTYPES, SHAPES))
def test_numeric_tensors_round_trip_bit_exactly(array):
    specs, buffers = encode_tensors({"t": array})
    out = decode_tensors(specs, [bytes(b) for b in buffers])["t"]
    assert out.dtype == array.dtype and out.shape == array.shape
    assert out.tobytes() == array.tobytes()  # bit-exact, NaN payloads included


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=40) | st.text(max_size=20), min_size=0, max_size=12))
def test_bytes_tensors_round_trip(items):
    array = np.array(items + [b""], dtype=object)[:-1] if items else np.zeros(0, dtype=object)
    specs, buffers = encode_tensors({"t": array})
    out = decode_tensors(specs, [bytes(b) for b in buffers])["t"]
    assert [x if isinstance(x, bytes) else x.encode() for x in items] == list(out)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_any_header_bytes_decode_or_raise_an_outrider_error(raw):
    try:
        header = unpack_header(raw, SMALL)
    except OutriderError:
        return
    assert isinstance(header, dict)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"name": st.text(max_size=4) | JSONISH, "datatype": st.sampled_from(["FP32", "BYTES", "INT8", "BF16", "X"]) | JSONISH,
             "shape": st.lists(st.integers(min_value=-2, max_value=2**63) | JSONISH, max_size=4) | JSONISH}
        ) | JSONISH,
        max_size=3,
    ) | JSONISH,
    st.lists(st.binary(max_size=64), max_size=3),
)
def test_any_tensor_description_parses_or_raises_an_outrider_error(specs, frames):
    # The header passes through msgpack on the wire; what survives a round trip is what a peer can send.
    specs = msgpack.unpackb(msgpack.packb(specs, use_bin_type=True), raw=False, strict_map_key=False)
    try:
        tensors = parse_tensors(specs, frames, SMALL)
        for tensor in tensors:
            tensor.decode(max_element_bytes=64)
    except OutriderError:
        return


def _fuzz(server, count: int, seed: int, generate_model=None) -> "fuzz_socket.FuzzReport":
    report = fuzz_socket.fuzz(server.address, "echo", count, seed=seed, drain_s=60.0,
                              server_pid=server.proc.pid, alive=lambda: server.proc.poll() is None,
                              generate_model=generate_model)
    detail = f"{report} \n{server.log()[-3000:]}"
    assert report.answered == report.sent == count, detail
    assert not report.crashed, detail
    assert report.codes.get("internal", 0) == 0, detail
    assert report.collateral == 0, detail
    assert "Traceback" not in server.log(), server.log()[-5000:]
    return report


def test_fuzz_echo_server_answers_every_hostile_message(echo_server):
    report = _fuzz(echo_server, 5_000, seed=11)
    assert report.codes["ok"] > 0 and report.codes["protocol_error"] > 0  # both kinds were exercised


@pytest.mark.slow
def test_fuzz_100k_messages_bounded_memory(echo_server):
    report = _fuzz(echo_server, 100_000, seed=12)
    assert report.rss_peak_mb - report.rss_before_mb < 200, report


@pytest.mark.slow
def test_fuzz_hostile_generation_parameters_next_to_well_formed_streams(server_factory, tmp_path):
    import yaml

    manifest = write_manifest(tmp_path, yaml.safe_dump({
        "name": "tiny", "backend": "hf-llama", "options": {"seed": 3},
    }), "tiny.yaml")
    server = server_factory([MANIFESTS / "echo.yaml", manifest], ["outrider_echo", "outrider_test_hf_llama"])
    report = _fuzz(server, 3_000, seed=13, generate_model="tiny")
    assert report.codes["ok"] > 0
