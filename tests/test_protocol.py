"""Wire format: round trips for every datatype, and every check on untrusted sizes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from outrider.errors import ProtocolError, TooLargeError
from outrider.protocol import (
    DATATYPES,
    MAGIC,
    REQUEST_KINDS,
    Limits,
    decode_tensors,
    encode_message,
    encode_tensors,
    parse_type_frame,
    unpack_header,
)

NUMERIC = {
    "BOOL": np.array([[True, False]]),
    "UINT8": np.arange(6, dtype=np.uint8).reshape(2, 3),
    "UINT16": np.arange(4, dtype=np.uint16),
    "UINT32": np.arange(4, dtype=np.uint32),
    "UINT64": np.array([2**63 + 5], dtype=np.uint64),
    "INT8": np.array([-128, 127], dtype=np.int8),
    "INT16": np.array([-3], dtype=np.int16),
    "INT32": np.arange(-2, 2, dtype=np.int32),
    "INT64": np.array([[-(2**62)]], dtype=np.int64),
    "FP16": np.array([1.5, -2.25], dtype=np.float16),
    "FP32": np.random.default_rng(0).standard_normal((3, 384)).astype(np.float32),
    "FP64": np.array([np.pi]),
}


def _roundtrip(tensors):
    specs, buffers = encode_tensors(tensors)
    return specs, decode_tensors(specs, [bytes(b) for b in buffers])


@pytest.mark.parametrize("datatype", sorted(NUMERIC))
def test_numeric_roundtrip(datatype):
    specs, out = _roundtrip({"t": NUMERIC[datatype]})
    assert specs[0]["datatype"] == datatype
    np.testing.assert_array_equal(out["t"], NUMERIC[datatype])
    assert out["t"].dtype == NUMERIC[datatype].dtype


def test_bf16_and_bytes_roundtrip():
    import ml_dtypes

    bf = np.array([1.0, -0.5, 3.0], dtype=ml_dtypes.bfloat16)
    text = np.array([["héllo", ""], ["wörld", "x" * 1000]], dtype=object)
    specs, out = _roundtrip({"bf": bf, "text": text})
    assert [s["datatype"] for s in specs] == ["BF16", "BYTES"]
    np.testing.assert_array_equal(out["bf"].astype(np.float32), bf.astype(np.float32))
    assert out["text"].shape == (2, 2)
    assert out["text"][1, 0] == "wörld".encode()


def test_every_datatype_is_covered():
    assert set(NUMERIC) | {"BF16", "BYTES"} == set(DATATYPES)


def test_big_endian_input_is_sent_little_endian():
    big = np.arange(3, dtype=">f4")
    _, out = _roundtrip({"x": big})
    np.testing.assert_array_equal(out["x"], big.astype("<f4"))


def test_numeric_decode_is_zero_copy():
    data = bytearray(np.arange(8, dtype=np.float32).tobytes())
    out = decode_tensors([{"name": "x", "datatype": "FP32", "shape": [2, 4]}], [memoryview(data)])
    data[0:4] = np.float32(42).tobytes()
    assert out["x"][0, 0] == 42  # a view of the frame, not a copy


@pytest.mark.parametrize(
    "spec, frame, error, match",
    [
        ({"name": "x", "datatype": "FP32", "shape": [2, 2]}, b"\0" * 12, ProtocolError, "= 16 bytes, but its frame has 12"),
        ({"name": "x", "datatype": "FP99", "shape": [1]}, b"\0" * 4, ProtocolError, "unknown datatype"),
        ({"name": "x", "datatype": "FP32", "shape": [-1]}, b"", ProtocolError, "non-negative"),
        ({"name": "x", "datatype": "FP32", "shape": "2"}, b"", ProtocolError, "shape must be a list"),
        ({"name": "x", "datatype": "FP32", "shape": [1.5]}, b"", ProtocolError, "non-negative integers"),
        ({"name": "", "datatype": "FP32", "shape": [1]}, b"\0" * 4, ProtocolError, "'name'"),
        ({"name": "x", "datatype": "UINT8", "shape": [1 << 20, 1 << 20]}, b"", TooLargeError, "elements"),
        ({"name": "s", "datatype": "BYTES", "shape": [2]}, b"\x01\0\0\0a", ProtocolError, "ends inside the length"),
        ({"name": "s", "datatype": "BYTES", "shape": [1]}, b"\x09\0\0\0a", ProtocolError, "claims 9 bytes"),
        ({"name": "s", "datatype": "BYTES", "shape": [1]}, b"\x01\0\0\0ab", ProtocolError, "left after"),
    ],
)
def test_bad_tensors_are_rejected(spec, frame, error, match):
    with pytest.raises(error, match=match):
        decode_tensors([spec], [frame])


def test_tensor_count_must_match_frames():
    with pytest.raises(ProtocolError, match="describes 1 tensors but the message carries 0"):
        decode_tensors([{"name": "x", "datatype": "FP32", "shape": [1]}], [])
    with pytest.raises(TooLargeError, match="tensors; the limit"):
        decode_tensors([{"name": f"x{i}", "datatype": "FP32", "shape": [0]} for i in range(3)], [b""] * 3,
                       Limits(max_tensors=2))


def test_duplicate_tensor_names_rejected():
    spec = {"name": "x", "datatype": "UINT8", "shape": [1]}
    with pytest.raises(ProtocolError, match="appears twice"):
        decode_tensors([spec, spec], [b"a", b"b"])


def test_header_checks():
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        unpack_header(b"\xc1")
    with pytest.raises(ProtocolError, match="must be a msgpack map"):
        unpack_header(msgpack.packb([1, 2]))
    deep: dict = {}
    node = deep
    for _ in range(20):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(TooLargeError, match="nests deeper"):
        unpack_header(msgpack.packb(deep))
    with pytest.raises(TooLargeError, match="header is"):
        unpack_header(msgpack.packb({"x": "a" * 100}), Limits(max_header_bytes=50))


def test_type_frame():
    assert parse_type_frame(MAGIC + b" infer", REQUEST_KINDS) == "infer"
    with pytest.raises(ProtocolError, match="version '9' is not supported"):
        parse_type_frame(b"outrider/9 infer", REQUEST_KINDS)
    with pytest.raises(ProtocolError, match="unknown message type 'dance'"):
        parse_type_frame(MAGIC + b" dance", REQUEST_KINDS)
    with pytest.raises(ProtocolError, match="must start with"):
        parse_type_frame(b"GET / HTTP/1.1", REQUEST_KINDS)


def test_encode_message_layout():
    frames = encode_message("infer", {"id": 7, "model": "m"}, {"x": np.zeros(2, np.float32)})
    assert frames[0] == b"outrider/1 infer"
    header = msgpack.unpackb(frames[1])
    assert header["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [2]}]
    assert len(frames) == 3 and len(bytes(frames[2])) == 8


@pytest.mark.parametrize(
    "shape, error, match",
    [
        ([0, 2**62, 2**62], TooLargeError, "dimension 1 is 4611686018427387904"),
        ([0, 1 << 20, 1 << 20], TooLargeError, "not counting its zero dimensions"),
        ([True], ProtocolError, "dimension 0 is True"),
        ([2.0], ProtocolError, "dimension 0 is 2.0"),
        ([None], ProtocolError, "dimension 0 is None"),
        ([[1]], ProtocolError, "dimension 0 is \\[1\\]"),
    ],
)
def test_hostile_shapes_are_refused_before_numpy_sees_them(shape, error, match):
    with pytest.raises(error, match=match):
        decode_tensors([{"name": "x", "datatype": "FP32", "shape": shape}], [b""])


def test_tensors_are_checked_without_decoding_then_decoded_with_an_element_limit():
    from outrider.protocol import parse_tensors

    frame = b"".join(len(x).to_bytes(4, "little") + x for x in (b"ab", b"c" * 10))
    (tensor,) = parse_tensors([{"name": "t", "datatype": "BYTES", "shape": [2]}], [frame])
    assert (tensor.count, tensor.nbytes, tensor.rows) == (2, len(frame), 2)
    assert tensor.decode().tolist() == [b"ab", b"c" * 10]
    with pytest.raises(TooLargeError, match="element 1 is 10 bytes; the limit is limits.max_element_bytes = 9"):
        tensor.decode(9, "limits.max_element_bytes")


def test_header_containers_are_bounded_by_the_header_limit():
    # an array that declares 2**32-1 elements in an 8-byte header: refused by its declared length
    with pytest.raises(ProtocolError, match="exceeds max_array_len"):
        unpack_header(b"\x81\xa1a\xdd\xff\xff\xff\xff")
    with pytest.raises(ProtocolError, match="ext type"):
        unpack_header(msgpack.packb({"a": msgpack.ExtType(3, b"xx")}))
