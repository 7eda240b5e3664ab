"""Wire format: a type/version frame, a msgpack header, one frame per tensor buffer.

Every size that comes from a peer is checked against `Limits` before any buffer is viewed.
The full specification, for clients in other languages, is docs/PROTOCOL.md.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import msgpack
import numpy as np

from .errors import ProtocolError, TooLargeError

MAGIC = b"outrider/1"
REQUEST_KINDS = frozenset({"infer", "generate", "health", "models", "cancel", "repository", "load", "unload"})
REPLY_KINDS = frozenset({"reply", "chunk"})
_TYPE_FRAME_OF = {kind: MAGIC + b" " + kind.encode("ascii") for kind in REQUEST_KINDS | REPLY_KINDS}
_TYPE_FRAMES = {frame: kind for kind, frame in _TYPE_FRAME_OF.items()}

# Open Inference Protocol datatype names -> little-endian numpy dtypes.
_DTYPES: dict[str, str] = {
    "BOOL": "|b1",
    "UINT8": "|u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "INT8": "|i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
}
DATATYPES = frozenset([*_DTYPES, "BF16", "BYTES"])
_NUMPY_DTYPES = {name: np.dtype(dt) for name, dt in _DTYPES.items()}
_ITEMSIZE = {**{name: dt.itemsize for name, dt in _NUMPY_DTYPES.items()}, "BF16": 2}
_ITEMSIZE_OR_BYTES = {**_ITEMSIZE, "BYTES": 0}  # every datatype, in one lookup (BYTES: variable)
_MAX_DIMS = 16
_MAX_NAME = 256


@dataclass(frozen=True)
class Limits:
    """Bounds on untrusted input. Defaults suit a sidecar; all can be raised in the server config."""

    max_message_bytes: int = 64 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    max_header_depth: int = 8
    max_tensors: int = 64
    max_tensor_elements: int = 16 * 1024 * 1024


DEFAULT_LIMITS = Limits()


def _bf16_dtype() -> np.dtype:
    import ml_dtypes  # numpy has no bfloat16; ml_dtypes is the common answer (JAX, ONNX)

    return np.dtype(ml_dtypes.bfloat16)


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype for a protocol datatype name (BYTES -> object)."""
    if datatype == "BYTES":
        return np.dtype(object)
    if datatype == "BF16":
        return _bf16_dtype()
    try:
        return _NUMPY_DTYPES[datatype]
    except KeyError:
        raise ProtocolError(
            f"unknown datatype {datatype!r}; expected one of {sorted(DATATYPES)}"
        ) from None


_NAME_OF: dict[np.dtype, str] = {np.dtype(dt): name for name, dt in _DTYPES.items()}
_NAME_OF.update({np.dtype(dt).newbyteorder(">"): name for name, dt in _DTYPES.items()})


def datatype_of(array: np.ndarray) -> str:
    """The protocol datatype name for a numpy array; str/bytes/object arrays are BYTES."""
    name = _NAME_OF.get(array.dtype)
    if name is not None:
        return name
    if array.dtype.kind in "OSU":
        return "BYTES"
    if array.dtype.name == "bfloat16":
        return "BF16"
    raise ProtocolError(f"numpy dtype {array.dtype} has no protocol datatype")


def encode_bytes_tensor(array: np.ndarray) -> bytes:
    """BYTES elements as <uint32 little-endian length><bytes>, in C order (as Triton does)."""
    parts = []
    for index, item in enumerate(array.reshape(-1)):
        if isinstance(item, str):
            try:
                item = item.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate (JSON's "\ud800") is no UTF-8 text
                raise ProtocolError(f"BYTES element {index} is not valid text: {exc.reason} at character "
                                    f"{exc.start}") from None
        elif not isinstance(item, (bytes, bytearray, memoryview)):
            raise ProtocolError(
                f"BYTES tensor element of type {type(item).__name__}; expected str or bytes"
            )
        parts.append(struct.pack("<I", len(item)))
        parts.append(bytes(item))
    return b"".join(parts)


def decode_bytes_tensor(
    buffer: memoryview,
    count: int,
    name: str,
    max_element_bytes: Optional[int] = None,
    limit_name: str = "max_element_bytes",
) -> np.ndarray:
    """Parse `count` length-prefixed elements; the buffer must be consumed exactly.

    An element longer than `max_element_bytes` is refused (TooLargeError) before it is copied.
    """
    out = np.empty(count, dtype=object)
    offset, end = 0, len(buffer)
    unpack = _U32.unpack_from
    for i in range(count):
        if offset + 4 > end:
            raise ProtocolError(
                f"tensor {name!r}: BYTES frame ends inside the length of element {i} of {count}"
            )
        (length,) = unpack(buffer, offset)
        offset += 4
        if max_element_bytes is not None and length > max_element_bytes:
            raise TooLargeError(
                f"tensor {name!r}: BYTES element {i} is {length} bytes; the limit is "
                f"{limit_name} = {max_element_bytes}"
            )
        if offset + length > end:
            raise ProtocolError(
                f"tensor {name!r}: BYTES element {i} claims {length} bytes, "
                f"only {end - offset} remain in the frame"
            )
        out[i] = bytes(buffer[offset : offset + length])
        offset += length
    if offset != end:
        raise ProtocolError(
            f"tensor {name!r}: BYTES frame has {end - offset} bytes left after {count} elements"
        )
    return out


_U32 = struct.Struct("<I")
# Tensors of this many bytes or more are sent as views of the array; smaller ones as a copy,
# which costs less than making the view (pyzmq copies frames under 64 KiB in any case).
_VIEW_FROM = 64 * 1024


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    return buf if buf is not None else memoryview(frame)


def _depth(obj: Any, limit: int, level: int = 1) -> None:
    # Recursion is bounded by `limit`, and msgpack's own unpacker stack stops absurd nesting first.
    if level > limit:
        raise TooLargeError(f"header nests deeper than {limit} levels")
    if type(obj) is dict:
        for value in obj.values():
            if type(value) in _CONTAINERS:
                _depth(value, limit, level + 1)
    else:
        for value in obj:
            if type(value) in _CONTAINERS:
                _depth(value, limit, level + 1)


_CONTAINERS = (dict, list)


# One Packer per thread: msgpack.packb builds (and allocates the buffer of) a new Packer per call,
# which is half its cost for a small header; a Packer is not thread-safe, and replies are encoded
# by every instance thread.
_packers = threading.local()


def pack_header(header: dict) -> bytes:
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(header)


def unpack_header(raw: memoryview | bytes, limits: Limits = DEFAULT_LIMITS) -> dict:
    """Decode and bound-check a msgpack header; anything but a map is an error."""
    if len(raw) > limits.max_header_bytes:
        raise TooLargeError(
            f"header is {len(raw)} bytes; the limit is {limits.max_header_bytes}"
        )
    # Explicit bounds on every container and string, so no declared length can make msgpack
    # allocate more than the header itself could hold; ext types (timestamps, custom) are refused.
    bound = limits.max_header_bytes
    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=bound,
            max_bin_len=bound,
            max_array_len=bound,
            max_map_len=bound,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack (or holds an ext type, which is refused): {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    _depth(header, limits.max_header_depth)
    return header


def check_shape(name: str, shape: Any, limits: Limits) -> tuple[int, ...]:
    """`shape` checked against `limits` (TooLargeError past them, ProtocolError if malformed);
    every front's tensor descriptions go through it, before any size is computed or printed."""
    if not isinstance(shape, (list, tuple)) or len(shape) > _MAX_DIMS:
        raise ProtocolError(
            f"tensor {name!r}: shape must be a list of at most {_MAX_DIMS} integers, "
            f"got {preview(shape)}"
        )
    most = limits.max_tensor_elements
    # A zero dimension makes the count 0, but numpy still multiplies the others: bound them too,
    # so `[0, 2**62, 2**62]` is refused here rather than overflowing in reshape.
    spread = 1
    for index, dim in enumerate(shape):
        if type(dim) is not int or dim < 0:  # `type`: a bool is an int to isinstance
            raise ProtocolError(
                f"tensor {name!r}: shape dimension {index} is {preview(dim)}; expected non-negative "
                f"integers (0 to {most})"
            )
        if dim > most:
            raise TooLargeError(
                f"tensor {name!r}: shape dimension {index} is {preview(dim)}; the limit is {most} elements per tensor"
            )
        if dim:
            spread *= dim
    if spread > most:
        raise TooLargeError(
            f"tensor {name!r}: shape {list(shape)} spans {spread} elements"
            f"{' (not counting its zero dimensions)' if 0 in shape else ''}; the limit is {most}"
        )
    return tuple(shape)


def preview(value: Any) -> str:
    """A short repr of an untrusted value for an error message (never raises: an int of thousands
    of digits has no repr under Python's int_max_str_digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, (list, tuple, dict)) and len(value) > 16:
        return f"a {type(value).__name__} of {len(value)} items"
    try:
        text = repr(value)
    except ValueError:
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


class TensorFrame:
    """A tensor described by a header and checked against its frame, not yet decoded.

    Everything here is O(1) per tensor, so the I/O thread can check a request's sizes without
    touching its buffers; `decode()` (O(elements) for BYTES) runs where the request is executed.
    A plain slotted class: one is made per tensor of every request.
    """

    __slots__ = ("name", "datatype", "shape", "buffer", "count")

    def __init__(self, name: str, datatype: str, shape: tuple[int, ...], buffer: memoryview) -> None:
        self.name = name
        self.datatype = datatype
        self.shape = shape
        self.buffer = buffer
        #: elements (the product of the shape)
        self.count = math.prod(shape)

    def __repr__(self) -> str:
        return f"TensorFrame({self.name!r}, {self.datatype}, {list(self.shape)}, {len(self.buffer)} bytes)"

    @property
    def nbytes(self) -> int:
        return len(self.buffer)

    @property
    def rows(self) -> Optional[int]:
        """The first dimension, or None for a scalar."""
        return self.shape[0] if self.shape else None

    def decode(self, max_element_bytes: Optional[int] = None, limit_name: str = "max_element_bytes") -> np.ndarray:
        """The tensor as a numpy array: a zero-copy view for numeric types, objects for BYTES."""
        if self.datatype == "BYTES":
            return decode_bytes_tensor(
                self.buffer, self.count, self.name, max_element_bytes, limit_name
            ).reshape(self.shape)
        # parse_tensors checked that the frame holds exactly shape x item size bytes.
        dtype = _NUMPY_DTYPES.get(self.datatype)
        if dtype is None:  # BF16
            dtype = numpy_dtype(self.datatype)
        return np.ndarray(self.shape, dtype, self.buffer)


def parse_tensors(specs: Any, frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> list[TensorFrame]:
    """Check tensor descriptions against their frames without decoding any buffer.

    Numeric frames must be exactly shape x item size; a BYTES frame must at least hold a 4-byte
    length per element (its elements are checked when it is decoded).
    """
    if not isinstance(specs, list):
        raise ProtocolError(f"'inputs' must be a list of tensor descriptions, got {type(specs).__name__}")
    if len(specs) > limits.max_tensors:
        raise TooLargeError(f"{len(specs)} tensors; the limit is {limits.max_tensors}")
    if len(specs) != len(frames):
        raise ProtocolError(
            f"header describes {len(specs)} tensors but the message carries {len(frames)} tensor frames"
        )
    out: list[TensorFrame] = []
    names: set[str] = set()
    for index, (spec, frame) in enumerate(zip(specs, frames)):
        if not isinstance(spec, dict):
            raise ProtocolError(f"tensor #{index}: description must be a map")
        name = spec.get("name")
        if not isinstance(name, str) or not name or len(name) > _MAX_NAME:
            raise ProtocolError(f"tensor #{index}: 'name' must be a non-empty string of at most {_MAX_NAME} characters")
        if name in names:
            raise ProtocolError(f"tensor {name!r} appears twice")
        names.add(name)
        datatype = spec.get("datatype")
        itemsize = _ITEMSIZE_OR_BYTES.get(datatype) if type(datatype) is str else None
        if itemsize is None:
            raise ProtocolError(
                f"tensor {name!r}: unknown datatype {preview(datatype)}; expected one of {sorted(DATATYPES)}"
            )
        shape = check_shape(name, spec.get("shape"), limits)
        buffer = _buffer(frame)
        tensor = TensorFrame(name, datatype, shape, buffer)
        count = tensor.count
        if not itemsize:  # BYTES
            if len(buffer) < 4 * count:
                raise ProtocolError(
                    f"tensor {name!r}: BYTES frame of {len(buffer)} bytes ends inside the length of an "
                    f"element: {count} elements need at least {4 * count} bytes"
                )
        else:
            expected = count * itemsize
            if len(buffer) != expected:
                raise ProtocolError(
                    f"tensor {name!r}: shape {list(shape)} x {itemsize} bytes ({datatype}) = "
                    f"{expected} bytes, but its frame has {len(buffer)}"
                )
        out.append(tensor)
    return out


def decode_tensors(
    specs: Any, frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS
) -> dict[str, np.ndarray]:
    """View tensor frames as numpy arrays (zero-copy for numeric types), after every check."""
    return {t.name: t.decode() for t in parse_tensors(specs, frames, limits)}


def encode_tensors(tensors: dict[str, np.ndarray]) -> tuple[list[dict], list[Any]]:
    """Tensor descriptions for the header and the buffers to send after it (no copy if contiguous)."""
    specs: list[dict] = []
    buffers: list[Any] = []
    for name, value in tensors.items():
        array = np.asarray(value)
        datatype = datatype_of(array)
        specs.append({"name": name, "datatype": datatype, "shape": list(array.shape)})
        if datatype == "BYTES":
            buffers.append(encode_bytes_tensor(array))
        else:
            if array.dtype.byteorder == ">":
                array = array.astype(array.dtype.newbyteorder("<"))
            if array.nbytes < _VIEW_FROM:
                buffers.append(array.tobytes())  # pyzmq copies a frame this small anyway
            else:
                buffers.append(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
    return specs, buffers


def encode_message(
    kind: str, header: dict, tensors: dict[str, np.ndarray] | None = None, key: str = "inputs"
) -> list[Any]:
    """Frames for one message: type frame, header, then tensor buffers under header[key]."""
    buffers: list[Any] = []
    if tensors is not None:
        header = dict(header)
        header[key], buffers = encode_tensors(tensors)
    type_frame = _TYPE_FRAME_OF.get(kind) or MAGIC + b" " + kind.encode("ascii")
    return [type_frame, pack_header(header), *buffers]




def parse_type_frame(frame: Any, allowed: Iterable[str]) -> str:
    """Check the type/version frame and return the message kind."""
    buffer = _buffer(frame)
    if len(buffer) > 64:  # checked before copying: the frame may be megabytes long
        raise ProtocolError(f"type frame is {len(buffer)} bytes; at most 64 expected")
    raw = bytes(buffer)
    known = _TYPE_FRAMES.get(raw)
    if known is not None and known in allowed:
        return known
    magic, _, kind = raw.partition(b" ")
    if magic != MAGIC:
        if magic.startswith(b"outrider/"):
            raise ProtocolError(
                f"protocol version {magic[9:].decode('ascii', 'replace')!r} is not supported; this server speaks {MAGIC.decode()}"
            )
        raise ProtocolError(f"type frame must start with {MAGIC.decode()!r}")
    text = kind.decode("ascii", "replace")
    if text not in allowed:
        raise ProtocolError(f"unknown message type {text!r}; expected one of {sorted(allowed)}")
    return text
