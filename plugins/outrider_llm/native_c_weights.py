"""Weights in the native kernels' layouts on numpy, for the C library (native_c.py), without torch.

- `a8_matmul`: fp32 [rows, out] = x (quantized to int8 per row and group) @ W.T for W in the 4-, 5-
  or 8-bit layout (`nibble_tiles`, `pack_w5`, `byte_tiles`), fp16 or fp32 tables, or a symmetric
  type's offset; `bits` is the code of `native_c.bits_flags`.
- `Part`: one such weight (or one of a matrix's parts side by side), checked once at construction.
- the packers: numpy ports of native.py's torch packers, byte for byte; `scale_tables` is the one
  rule for a symmetric type's offset (linear.py's 8- and 5-bit kernels take their tables from it).
- `pack_gguf`: a GGUF tensor's blocks as the file holds them (csrc/gguf_pack.cpp).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from .native_c import (ERR_SIZE, PACKED_TYPES, TILE, address, bits_flags, check_weight, checked_array,
                       loaded_library, raise_error)

# ---- matmul ----------------------------------------------------------------------------------------

def a8_matmul(x: np.ndarray, w: np.ndarray, d: np.ndarray, m: Optional[np.ndarray], bits: int, group: int,
              out: Optional[int] = None, y: Optional[np.ndarray] = None) -> np.ndarray:
    """float32 [rows, out] = x (float32 [rows, in], C-contiguous; quantized to int8 per row and group)
    @ W.T, W = (w, d, m) in the layout and tables `bits` says (`bits_flags`). `out`: the output count,
    checked against w where given. `y`: where to write, float32 [rows, out] with rows of contiguous
    floats at any stride (a column slice of a wider array: wide[:, a:a + out]); returned. (A `Part`'s
    `matmul` checks its weight once, at construction: less to do a call.)"""
    lib = loaded_library()
    inp = check_weight(w, d, m, bits, group, "a8_matmul")
    n = w.shape[0] * TILE
    if out is not None and out != n:
        raise ValueError(f"a8_matmul: w holds {n} outputs, out says {out}")
    return _matmul(lib, x, inp, n, group, w.ctypes.data, address(d), address(m), bits, y)


def _matmul(lib: ctypes.CDLL, x: np.ndarray, inp: int, n: int, group: int, w: int, d: Optional[int], m: Optional[int],
            bits: int, y: Optional[np.ndarray]) -> np.ndarray:
    checked_array(x, np.float32, (None, inp), "a8_matmul: x")
    rows = x.shape[0]
    if y is None:
        y = np.empty((rows, n), np.float32)
    elif not (isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == (rows, n) and y.flags.writeable
              and y.strides[1] == 4 and y.strides[0] % 4 == 0 and (rows <= 1 or y.strides[0] >= 4 * n)):
        raise ValueError(f"a8_matmul: y must be a writeable float32 [{rows}, {n}] with contiguous rows, got "
                         f"{getattr(y, 'dtype', type(y).__name__)} {list(getattr(y, 'shape', ()))} strides "
                         f"{getattr(y, 'strides', None)}")
    stride = y.strides[0] // 4 if rows > 1 else n
    err = ctypes.create_string_buffer(ERR_SIZE)
    raise_error(lib.outrider_a8_matmul(x.ctypes.data, rows, inp, group, w, d, m, n, bits, y.ctypes.data, stride,
                                       err, ERR_SIZE), err)
    return y


# ---- a weight --------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Part:
    """A weight matrix, or the part of one that a matrix's parts stand side by side in: w uint8 in the
    layout of `bits` (`bits_flags`), tables d and m [out/16, in/group, 16] (m None for a symmetric
    type; both None for a super-block layout, SUPER_BLOCKS | 4, 5 or 6). Checked at construction, and
    holds the arrays (a layer table points into them)."""

    w: np.ndarray
    d: Optional[np.ndarray]
    m: Optional[np.ndarray]
    bits: int
    group: int
    inputs: int = field(init=False, repr=False)
    pointers: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        inputs = check_weight(self.w, self.d, self.m, self.bits, self.group, "Part")
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "pointers", (self.w.ctypes.data, address(self.d), address(self.m)))

    @property
    def out(self) -> int:
        return self.w.shape[0] * TILE

    def matmul(self, x: np.ndarray, y: Optional[np.ndarray] = None, library: Optional[ctypes.CDLL] = None) -> np.ndarray:
        """`a8_matmul` of x float32 [rows, inputs] with this weight (into y where given), by the loaded
        library or another build of it (`native_c.open_library`: a benchmark comparing two builds)."""
        return _matmul(library or loaded_library(), x, self.inputs, self.out, self.group, *self.pointers, self.bits, y)

    @classmethod
    def from_affine(cls, groups: Any, symmetric: bool = True) -> "Part":
        """The kernel layout of `gguf_blocks.AffineGroups` (see `pack_affine`); with `symmetric`, a
        type whose minimums are all -offset * d (Q8_0, Q6_K, Q5_0, Q4_0) gets the offset and no m
        table, as linear.py's tables do (the same results: the minimums the kernel forms are the
        table's values)."""
        q = np.ascontiguousarray(groups.q)
        pack = _packer(groups.bits)
        d = np.asarray(groups.d).astype(np.float32)
        m = np.asarray(groups.m).astype(np.float32)
        if symmetric:
            dt, mt, offset = scale_tables(d, m)
        else:
            dt, mt = per_tile(d, m, dtype=table_dtype(d, m))
            offset = 0
        return cls(pack(q), dt, mt, bits_flags(groups.bits, dt.dtype, offset), int(groups.group))


# ---- GGUF blocks as they are (gguf_pack.cpp) ---------------------------------------------------------

@dataclass(frozen=True)
class PackedShape:
    """How a GGUF type packs for rows of `cols` inputs (super blocks or group blocks: w alone): the bits
    code, group, and bytes of w per tile of 16 outputs."""

    bits: int
    group: int
    w_tile_bytes: int

    def w_shape(self, tiles: int, cols: int) -> tuple[int, int, int]:
        """The shape of w (uint8) for `tiles` tiles: what `Part` takes."""
        return tiles, cols // self.group, self.w_tile_bytes // (cols // self.group)


def packed_shape(type_name: str, cols: int, five_bit: bool = True) -> PackedShape:
    """How the GGUF block type `type_name` packs for rows of `cols` inputs; ValueError naming why not."""
    if type_name not in PACKED_TYPES:
        raise ValueError(f"GGUF type {type_name} is not one the kernels take as it is ({', '.join(PACKED_TYPES)})")
    bits, group, tile_bytes = ctypes.c_int32(), ctypes.c_int64(), ctypes.c_int64()
    err = ctypes.create_string_buffer(ERR_SIZE)
    raise_error(loaded_library().outrider_packed_shape(PACKED_TYPES[type_name], int(cols), int(five_bit),
                                                       ctypes.byref(bits), ctypes.byref(group),
                                                       ctypes.byref(tile_bytes), err, ERR_SIZE), err)
    return PackedShape(bits.value, group.value, tile_bytes.value)


def pack_gguf(type_name: str, blocks: np.ndarray, cols: int, rows_out: Optional[int] = None,
              row_map: Optional[np.ndarray] = None, five_bit: bool = True) -> Part:
    """The `Part` of a GGUF tensor's raw blocks (uint8 [rows, row bytes], gguf-py's `tensor.data`, a view
    of the mapped file: read in place), rows_out rows (default: the tensor's, padded to 16; row r is source
    row row_map[r], zeros where that is -1)."""
    src = np.asarray(blocks)
    if src.dtype != np.uint8 or src.ndim != 2 or not src.flags.c_contiguous:
        raise ValueError(f"pack_gguf: blocks must be C-contiguous uint8 [rows, row bytes], got {src.dtype} "
                         f"{list(src.shape)}")
    shape = packed_shape(type_name, cols, five_bit)
    src_rows = src.shape[0]
    rows_out = rows_out if rows_out is not None else -(-src_rows // TILE) * TILE
    if row_map is not None:
        row_map = checked_array(np.ascontiguousarray(row_map, dtype=np.int64), np.int64, (rows_out,),
                                "pack_gguf: row_map")
    w = np.empty(shape.w_shape(max(0, rows_out // TILE), cols), np.uint8)
    err = ctypes.create_string_buffer(ERR_SIZE)
    raise_error(loaded_library().outrider_pack_gguf(PACKED_TYPES[type_name], src.ctypes.data, src_rows, int(cols),
                                                    address(row_map), rows_out, int(five_bit), w.ctypes.data, err,
                                                    ERR_SIZE), err)
    return Part(w, None, None, shape.bits, shape.group)


def dequantize_super_rows(part: Part, ids: np.ndarray) -> np.ndarray:
    """fp32 [n, inputs]: rows `ids` of a super-block weight, as gguf-py dequantizes the file's blocks (or
    of a group-block weight: q d + m, as the separate tables' lookups compute)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= part.out):
        raise ValueError(f"row ids must be in 0 .. {part.out - 1}, got {int(ids.min())} .. {int(ids.max())}")
    out = np.empty((ids.size, part.inputs), np.float32)
    err = ctypes.create_string_buffer(ERR_SIZE)
    raise_error(loaded_library().outrider_dequantize_super_rows(part.w.ctypes.data, part.bits, part.inputs,
                                                                ids.ctypes.data, ids.size, out.ctypes.data, err,
                                                                ERR_SIZE), err)
    return out


# ---- packing (numpy ports of native.py's torch packers, byte for byte) -----------------------------

def nibble_tiles(q: np.ndarray) -> np.ndarray:
    """uint8 [out, in] values 0..15 -> the 4-bit layout uint8 [out/16, in/8, 64] (csrc/kernels.h)."""
    out, inp = q.shape
    if out % TILE or inp % 8:
        raise ValueError(f"w4a8 tiles need out % {TILE} == 0 and in % 8 == 0, got {tuple(q.shape)}")
    tiles = np.asarray(q).astype(np.uint8).reshape(out // TILE, TILE, inp // 8, 2, 4)  # [t, i, oct, half, p]
    packed = tiles[:, :, :, 0, :] | (tiles[:, :, :, 1, :] << 4)
    return np.ascontiguousarray(packed.transpose(0, 2, 1, 3)).reshape(out // TILE, inp // 8, 64)  # [t, oct, i, p]


def byte_tiles(q: np.ndarray) -> np.ndarray:
    """uint8 [out, in] values 0..255 -> the 8-bit layout uint8 [out/16, in/4, 64] (csrc/kernels.h)."""
    out, inp = q.shape
    if out % TILE or inp % 4:
        raise ValueError(f"w8a8 tiles need out % {TILE} == 0 and in % 4 == 0, got {tuple(q.shape)}")
    tiles = np.asarray(q).astype(np.uint8).reshape(out // TILE, TILE, inp // 4, 4)  # [t, i, quad, p]
    return np.ascontiguousarray(tiles.transpose(0, 2, 1, 3)).reshape(out // TILE, inp // 4, 64)  # [t, quad, i, p]


def pack_w5(q: np.ndarray) -> np.ndarray:
    """5-bit values q uint8 [out, in] (0..31) -> the 5-bit layout uint8 [out/16, in/8, 80]: per tile and
    8 inputs, the 4-bit layout's 64 bytes of low nibbles, then 16 bytes of fifth bits."""
    out, inp = q.shape
    if out % TILE or inp % 8:
        raise ValueError(f"w5a8 tiles need out % {TILE} == 0 and in % 8 == 0, got {tuple(q.shape)}")
    q = np.asarray(q).astype(np.uint8)
    nibbles = nibble_tiles(q & 15)  # [t, oct, 64]
    high = (q >> 4).reshape(out // TILE, TILE, inp // 8, 2, 4).transpose(0, 2, 3, 1, 4)  # [t, oct, half, i, p]
    lanes = high.reshape(out // TILE, inp // 8, 2, 8, 8).astype(np.int32)  # lane 4i+p, in bytes of 8 bits
    weights = np.array([1 << k for k in range(8)], dtype=np.int32)
    plane = (lanes * weights).sum(axis=-1).astype(np.uint8).reshape(out // TILE, inp // 8, 16)
    return np.ascontiguousarray(np.concatenate([nibbles, plane], axis=2))


_PACKERS = {4: nibble_tiles, 5: pack_w5, 8: byte_tiles}


def _packer(bits: int) -> Callable[[np.ndarray], np.ndarray]:
    """The packer of affine values of `bits` bits; ValueError for a width the kernels do not take."""
    pack = _PACKERS.get(bits)
    if pack is None:
        raise ValueError(f"affine groups of {bits} bits: the kernels take 4, 5 or 8")
    return pack


def per_tile(*values: np.ndarray, dtype: Any = np.float16) -> tuple[np.ndarray, ...]:
    """[out, groups] -> `dtype` (fp16, or fp32 for scales fp16 would round) [out/16, groups, 16], each."""
    out, groups = values[0].shape
    return tuple(np.ascontiguousarray(np.asarray(v).astype(dtype).reshape(out // TILE, TILE, groups)
                                      .transpose(0, 2, 1)) for v in values)


def table_dtype(*values: np.ndarray) -> Any:
    """np.float16 when every value of the scale/minimum tables is exact in it, else np.float32 (then
    bits carries F32_TABLES)."""
    with np.errstate(over="ignore", invalid="ignore"):
        fits = all(np.array_equal(np.asarray(v).astype(np.float32).astype(np.float16).astype(np.float32),
                                  np.asarray(v).astype(np.float32)) for v in values)
    return np.float16 if fits else np.float32


_OFFSETS = (128, 32, 16, 8)  # Q8_0, Q6_K, Q5_0, Q4_0: w = (q - offset) d (linear.py's)


def scale_tables(scale: np.ndarray, minimum: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray], int]:
    """(d, m, offset) per-tile tables (linear.py `_scale_tables`): m None and `offset` its power of two
    where every minimum is -offset * d (a symmetric type), else the table and 0; fp16 where the values
    fit, else fp32."""
    scale = np.asarray(scale).astype(np.float32)
    minimum = np.asarray(minimum).astype(np.float32)
    dtype = table_dtype(scale, minimum)
    for offset in _OFFSETS:
        if np.array_equal(minimum, scale * np.float32(-offset)):
            return per_tile(scale, dtype=dtype)[0], None, offset
    d, m = per_tile(scale, minimum, dtype=dtype)
    return d, m, 0


def pack_affine(groups: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel layout of `gguf_blocks.AffineGroups` (w = q * d + m, q uint8 [out, in] of
    `groups.bits` bits, d and m [out, in / group]): (w, d, m) as native.py's `pack_affine`, tables in
    fp16 or fp32 (`table_dtype`; bits_flags(groups.bits, d) is their code). `Part.from_affine` also
    takes a symmetric type's offset."""
    q = np.ascontiguousarray(groups.q)
    d = np.ascontiguousarray(groups.d).astype(np.float32)
    m = np.ascontiguousarray(groups.m).astype(np.float32)
    return (_packer(groups.bits)(q), *per_tile(d, m, dtype=table_dtype(d, m)))
