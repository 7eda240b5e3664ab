"""Linear kernels for the Llama forward: y = x @ W.T with W dense (fp32/bf16) or quantized (int8/int4).

Every kernel is a callable `k(x) -> y` over rows x [n, in]; it takes any float x and returns y in
its `dtype` (the matmul input dtype: fp32 for dense fp32, bf16 for everything else). The model
converts its activations to that dtype once per projection and back to fp32 after.

- `QuantizedLinear`: dense, prepacked for oneDNN once at load (`mkldnn._reorder_linear_weight`).
- `Int8Linear`: per-output-channel symmetric int8, w = q * scale; `aten._weight_int8pack_mm`.
- `Int4Linear`: group-wise asymmetric 4 bit, w = (q - 8) * scale + zero per group of `group_size`
  input columns; `aten._convert_weight_to_int4pack_for_cpu` + `aten._weight_int4pack_mm_for_cpu`.
  Scales and zeros are rounded to bf16 there (the kernel wants them in the input dtype).

Which of them serves a process's weights, and whether a quantized one keeps a dense bf16 copy for
calls of many rows, is kernel_choice.py's (`choose_kernel`); the weights' formats are
quantized_weights.py's (`QuantTensor`).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from outrider.generation.weights import pack_int4, unpack_int4
from outrider.hardware import cpu_flags

from .native_c_weights import scale_tables
from .quantized_weights import QuantTensor

log = logging.getLogger("outrider.llm")

# oneDNN packs weights for this many rows; 32 was best or tied for 1..128 rows on the dev machine.
PACK_ROWS = 32
# Inner k tiles of torch's CPU int4 layout (the only value its CPU kernel is tuned for).
INT4_INNER_K_TILES = 2
# Dense-copy threshold when it cannot be measured: a quantized GEMV lost to AMX bf16 from 8 rows.
DEFAULT_DENSE_FROM_ROWS = 8


# ---- CPU features ---------------------------------------------------------------------------


def cpu_has_native_bf16() -> bool:
    """True when oneDNN can run bf16 matmuls in hardware (AVX512-BF16 or AMX)."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except Exception:
        return False
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


# ---- dense -----------------------------------------------------------------------------------


class QuantizedLinear:
    """y = x @ W.T, with W prepacked for oneDNN when that works here (plain `F.linear` otherwise).

    Input and output in `dtype` (the caller converts x).
    """

    __slots__ = ("weight", "packed", "dtype")
    kernel = "dense"  # every linear kernel says which it is: `NATIVE_KERNELS` decides the layer stack

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, use_onednn: bool) -> None:
        self.dtype = dtype
        self.weight = weight.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        self.packed = None
        if use_onednn:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS)
            self.weight = None  # the packed copy is all we read; don't hold the weight twice

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        """Bytes of weight this kernel holds."""
        t = self.packed if self.packed is not None else self.weight
        return t.numel() * t.element_size()


def onednn_works(dtype: torch.dtype) -> bool:
    """Whether prepacked oneDNN linears exist here and agree with `F.linear`."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=gen).to(dtype)
        x = torch.randn(3, 64, generator=gen).to(dtype)
        lin = QuantizedLinear(w, dtype, use_onednn=True)
        tol = 1e-4 if dtype == torch.float32 else 0.1
        return bool(torch.allclose(lin(x).float(), F.linear(x, w).float(), atol=tol, rtol=tol))
    except Exception:
        return False


def dense_linear(weight: torch.Tensor, dtype: torch.dtype, device: "torch.device | str" = "cpu") -> QuantizedLinear:
    """A dense kernel for an fp32 weight, prepacked when oneDNN works for `dtype` here."""
    device = torch.device(device)
    onednn = device.type == "cpu" and onednn_usable(dtype)
    return QuantizedLinear(weight.to(device, torch.float32), dtype, onednn)


_ONEDNN: dict[torch.dtype, bool] = {}


def onednn_usable(dtype: torch.dtype) -> bool:
    """`onednn_works(dtype)`, checked once per process."""
    if dtype not in _ONEDNN:
        _ONEDNN[dtype] = onednn_works(dtype)
    return _ONEDNN[dtype]



# ---- quantized kernels ---------------------------------------------------------------------------


class _PackedLinear:
    """What both packed weight-only kernels share: bf16 activations, and an optional dense bf16 copy
    (a `QuantizedLinear` of the same weight) that serves calls of `dense_from` rows or more."""

    __slots__ = ("dense", "dense_from", "dtype")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_from:
            return self.dense(x)
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        return self._mm(x)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _own_bytes(self) -> int:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of weight this kernel holds (dense copy included)."""
        return self._own_bytes() + (self.dense.nbytes if self.dense is not None else 0)


class Int4Linear(_PackedLinear):
    """Group-wise int4 weight; one of three kernels serves every call of a weight (so a row's
    result never depends on how many rows share the call), `self.kernel` says which:

    - "int4pack": torch's `aten._weight_int4pack_mm_for_cpu`, bf16 activations, scales and zeros
      rounded to bf16, output bf16;
    - "int4native": outrider's own (native.py: AMX or AVX512-BF16), bf16 activations, scales and
      minimums in fp16, output fp32;
    - "w4a8": outrider's own on every CPU (native.py), activations quantized to int8 per row and
      group as llama.cpp does, scales and minimums in fp16, fp32 in and out.

    A native kernel that cannot run here or take the shape falls back to "int4pack". With `dense`
    (a bf16 `QuantizedLinear` of the same weight), calls of `dense_from` rows or more go there.
    """

    __slots__ = ("packed", "scales_zeros", "minimums", "group", "kernel", "float_out")

    def __init__(self, weight: QuantTensor, dense: Optional[QuantizedLinear] = None,
                 dense_from: int = DEFAULT_DENSE_FROM_ROWS, kernel: str = "int4pack") -> None:
        if weight.mode != "int4":
            raise ValueError(f"Int4Linear needs an int4 weight, got {weight.mode}")
        from . import native

        self.group = weight.group_size
        out, inp = weight.shape
        if kernel == "int4native" and not (out % native.TILE == 0 and self.group % 4 == 0 and native.int4_kernel()[0]):
            kernel = "int4pack"
        # A model whose other linears run w4a8 computes in fp32: a fallback answers in fp32 too.
        self.float_out = kernel == "w4a8"
        if kernel == "w4a8" and not (out % native.TILE == 0 and self.group % 16 == 0 and native.w4a8_kernel()[0]):
            kernel = "int4pack"
        self.kernel = kernel
        self.dtype = torch.float32 if kernel == "w4a8" else torch.bfloat16
        values = unpack_int4(weight.q)
        if kernel in ("int4native", "w4a8"):
            # packed: the kernel's tiles; scales_zeros / minimums: fp16 d and m (w = q d + m).
            pack = native.pack_w4a8 if kernel == "w4a8" else native.pack_int4_tiles
            self.packed, self.scales_zeros, self.minimums = pack(values, weight.scale, weight.zero)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32),
                                                                             INT4_INNER_K_TILES)
            # [in / group, out, 2]: (scale, zero) pairs, in the activation dtype as the kernel demands.
            self.scales_zeros = torch.stack([weight.scale.float().t(), weight.zero.float().t()], dim=-1)
            self.scales_zeros = self.scales_zeros.to(self.dtype).contiguous()
            self.minimums = None
        self.dense, self.dense_from = dense, dense_from

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "w4a8" and x.dtype == torch.bfloat16 and self.dense is None:
            return self._mm(x)  # the kernel reads bf16 as it is: no fp32 copy
        return super().__call__(x)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "w4a8":
            return torch.ops.outrider.w4a8_mm(x, self.packed, self.scales_zeros, self.minimums, self.group)
        if self.kernel == "int4native":
            return torch.ops.outrider.int4_mm(x, self.packed, self.scales_zeros, self.minimums, self.group)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)
        return y.float() if self.float_out else y

    def _own_bytes(self) -> int:
        extra = 0 if self.minimums is None else self.minimums.nbytes
        return self.packed.numel() + self.scales_zeros.nbytes + extra

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 weight rows `index` (q * d + m) read from the w4a8 tiles: a tied embedding's lookups."""
        if self.kernel != "w4a8":
            raise ValueError(f"rows() reads w4a8 tiles; this weight runs {self.kernel}")
        tiles, octs, _ = self.packed.shape
        t, i = index // 16, index % 16
        b = self.packed.view(tiles, octs, 16, 4)[t, :, i, :]  # [n, oct, p]: inputs 8j + p and 8j + 4 + p
        q = torch.stack([b & 15, b >> 4], dim=2).reshape(len(index), octs * 8)
        return _dequantize_rows(q, self.scales_zeros, self.minimums, t, i, self.group)


def _dequantize_rows(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, t: torch.Tensor, i: torch.Tensor,
                     group: int, offset: int = 0) -> torch.Tensor:
    """fp32 [n, in] = q * d + m per group, d and m taken from per-tile [tiles, groups, 16] tables
    (m = -offset * d where `offset` is set and there is no table)."""
    n, cols = q.shape
    scale = d[t, :, i].float()[..., None]
    minimum = scale * -offset if offset else m[t, :, i].float()[..., None]
    return (q.view(n, cols // group, group).float() * scale + minimum).view(n, cols)


class TiedRows:
    """Rows of the LM head's weight read from its own tiles (no second copy): a tied embedding's
    lookups, or a draft head's restricted vocabulary."""

    __slots__ = ("head", "shape")

    def __init__(self, head: "Int4Linear | W5A8Linear | W8A8Linear", shape: tuple[int, int]) -> None:
        self.head, self.shape = head, shape

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise ValueError("TiedRows looks up rows only")
        return self.head.rows(index)

    @property
    def nbytes(self) -> int:
        return 0  # the head's, counted there


class W8A8Linear:
    """Block-wise int8 weight (w = q * scale per block of `group` inputs, GGUF's Q8_0) with int8
    activations (native.py `w8a8_mm`, every CPU): the LM head next to "w4a8" layers, read
    from the file's own Q8_0 values. fp32 or bf16 in, fp32 out."""

    __slots__ = ("packed", "scales", "minimums", "offset", "group", "dtype")
    kernel = "w8a8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: Optional[torch.Tensor] = None) -> None:
        """Signed q with w = q * scale (Q8_0); or, with `minimum`, unsigned q (0..255) with
        w = q * scale + minimum (an affine weight of 8 bits: Q5_x, Q8_0, Q5_K, Q6_K)."""
        from .native import byte_tiles, pack_w8a8

        self.group = q.shape[1] // scale.shape[1]
        self.dtype = torch.float32
        if minimum is None:
            self.packed, self.scales, _ = pack_w8a8(q, scale)
            self.minimums, self.offset = _NO_TABLE, 128  # w = (q + 128 - 128) d: Q8_0
        else:
            self.packed = byte_tiles(q)
            self.scales, self.minimums, self.offset = _scale_tables(scale, minimum)

    @staticmethod
    def usable(out: int, inp: int, group: int = 32) -> bool:
        """Whether the kernel runs here and takes an [out, inp] weight in blocks of `group`."""
        from .native import TILE, w4a8_kernel

        return out % TILE == 0 and inp % group == 0 and group % 16 == 0 and w4a8_kernel()[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        return torch.ops.outrider.w8a8_mm(x, self.packed, self.scales, self.minimums, self.group, self.offset)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 weight rows `index` (q * d + m), read from the tiles: a tied embedding's lookups."""
        tiles, quads, _ = self.packed.shape
        t, i = index // 16, index % 16
        q = self.packed.view(tiles, quads, 16, 4)[t, :, i, :].reshape(len(index), quads * 4)
        return _dequantize_rows(q, self.scales, self.minimums, t, i, self.group, self.offset)

    @property
    def nbytes(self) -> int:
        """Bytes of weight this kernel holds."""
        return self.packed.numel() + self.scales.nbytes + self.minimums.nbytes


_NO_TABLE = torch.empty(0)  # the minimums of a symmetric type: -offset * d, formed in the kernel


def _scale_tables(scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(d, m, offset) per-tile tables for an 8- or 5-bit kernel: m is empty and `offset` its power of
    two where every minimum is -offset * d (a symmetric type: that table would be half the bytes of
    scale, for nothing), else the table and 0. Tables in fp16 where their values fit, else fp32.
    The torch-free model's rule (native_c_weights.scale_tables), so both models hold the same tables."""
    d, m, offset = scale_tables(scale.float().numpy(), minimum.float().numpy())
    return torch.from_numpy(d), _NO_TABLE if m is None else torch.from_numpy(m), offset


class Int8Linear(_PackedLinear):
    """Per-channel int8 weight, bf16 activations: `aten._weight_int8pack_mm`. Output bf16.

    With `dense` (a bf16 `QuantizedLinear` of the same weight), calls of `dense_from` rows or more go there.
    """

    __slots__ = ("q", "scale")
    kernel = "int8pack"

    def __init__(self, weight: QuantTensor, dense: Optional[QuantizedLinear] = None,
                 dense_from: int = DEFAULT_DENSE_FROM_ROWS) -> None:
        if weight.mode != "int8":
            raise ValueError(f"Int8Linear needs an int8 weight, got {weight.mode}")
        self.dtype = torch.bfloat16
        # A copy we own: q may point into a safetensors mmap, which would stay mapped and resident.
        self.q = weight.q.to(torch.int8).clone(memory_format=torch.contiguous_format)
        self.scale = weight.scale.to(self.dtype).contiguous()
        self.dense, self.dense_from = dense, dense_from

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    def _own_bytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 2


class W5A8Linear:
    """5-bit affine weight (w = q * d + m, q 0..31: GGUF Q5_0, Q5_1, Q5_K) with int8 activations
    (native.py `w5a8_mm`, every CPU): 5 bits a weight plus the tables, where 8-bit groups took 8.
    fp32 or bf16 in, fp32 out."""

    __slots__ = ("packed", "scales", "minimums", "offset", "group", "dtype")
    kernel = "w5a8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> None:
        from .native import pack_w5

        self.group = q.shape[1] // scale.shape[1]
        self.dtype = torch.float32
        self.packed = pack_w5(q)
        self.scales, self.minimums, self.offset = _scale_tables(scale, minimum)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        return torch.ops.outrider.w5a8_mm(x, self.packed, self.scales, self.minimums, self.group, self.offset)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 weight rows `index` (q * d + m), read from the tiles."""
        from .native import unpack_w5_rows

        t, i = index // 16, index % 16
        return _dequantize_rows(unpack_w5_rows(self.packed, t, i), self.scales, self.minimums, t, i, self.group,
                                self.offset)

    @property
    def nbytes(self) -> int:
        """Bytes of weight this kernel holds."""
        return self.packed.numel() + self.scales.nbytes + self.minimums.nbytes


class ConcatLinear:
    """Projections fused in the model's layout (QKV, gate/up) whose weights a GGUF file holds in
    different block types (a Q4_K_M file: Q4_K q and k, Q6_K v): each part runs its own kernel,
    the outputs are concatenated. fp32 out."""

    __slots__ = ("parts", "kernel", "dtype")

    def __init__(self, parts: list) -> None:
        self.parts = parts
        kernels = {p.kernel for p in parts}
        self.kernel = "native" if kernels <= NATIVE_KERNELS else "mixed"
        self.dtype = torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x).float() for part in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        """Bytes of weight its parts hold."""
        return sum(p.nbytes for p in self.parts)


#: kernels that compute with outrider's native int8-activation matmuls (w4a8_mm / w5a8_mm / w8a8_mm)
NATIVE_KERNELS = {"int4native", "w4a8", "w5a8", "w8a8", "native"}


def affine_linear(weight: QuantTensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The native kernel for an affine weight (the file's own groups): w4a8 for 4 bits (as an
    `Int4Linear`, so the fused layer stack takes it), w5a8 for 5, w8a8 for 8; where the native kernels cannot
    run or take the shape, a dense fp32 copy of the same weights (logged once)."""
    from . import native

    out, inp = weight.shape
    group = weight.group_size
    if native.w4a8_kernel()[0] and out % native.TILE == 0 and group % 16 == 0:
        if weight.bits == 4:
            # (q - 8) * scale + zero = q * d + m: zero = m + 8 d in fp32, and the kernel's m = zero - 8 d again.
            int4 = QuantTensor("int4", pack_int4(weight.q), weight.scale, weight.zero + 8 * weight.scale)
            linear = Int4Linear(int4, kernel="w4a8")
            if linear.kernel == "w4a8":
                # d and m exactly as the file has them (not through zero's fp32 sum), in fp16
                # where they fit (half the bytes), else fp32 (a K type's sub-block scales).
                linear.scales_zeros, linear.minimums = native.per_tile(
                    weight.scale, weight.zero, dtype=native.table_dtype(weight.scale, weight.zero))
                return linear
        elif weight.bits == 5 and inp % 8 == 0 and native.five_bit_tiles():
            return W5A8Linear(weight.q, weight.scale, weight.zero)
        else:
            return W8A8Linear(weight.q, weight.scale, weight.zero)
    _note_dense_affine(weight, "" if native.w4a8_kernel()[0] else native.w4a8_kernel()[1])
    return dense_linear(weight.dequantize(), torch.float32)


_DENSE_NOTED: set = set()


def _note_dense_affine(weight: QuantTensor, why: str) -> None:
    key = (weight.shape, weight.group_size, why)
    if key not in _DENSE_NOTED:
        _DENSE_NOTED.add(key)
        log.warning("a %s weight %s (groups of %s) runs dense fp32: %s", weight.source or "GGUF", weight.shape,
                    weight.group_size, why or "its shape does not fit the native kernels' tiles of 16 outputs")
