"""Linear kernels for the Llama forward: y = x @ W.T with W dense (fp32/bf16) or quantized (int8/int4).

Every kernel is a callable `k(x) -> y` over rows x [n, in]; it takes any float x and returns y in
its `dtype` (the matmul input dtype: fp32 for dense fp32, bf16 for everything else). The model
converts its activations to that dtype once per projection and back to fp32 after.

- `QuantizedLinear`: dense, prepacked for oneDNN once at load (`mkldnn._reorder_linear_weight`).
- `Int8Linear`: per-output-channel symmetric int8, w = q * scale; `aten._weight_int8pack_mm`.
- `Int4Linear`: group-wise asymmetric 4 bit, w = (q - 8) * scale + zero per group of `group_size`
  input columns; `aten._convert_weight_to_int4pack_for_cpu` + `aten._weight_int4pack_mm_for_cpu`.
  Scales and zeros are rounded to bf16 there (the kernel wants them in the input dtype).

Both quantized kernels read 1/4 (int8) or 1/8 (int4) of the fp32 bytes, which is what a decode
step is bound by, but they are GEMV-shaped: their cost grows ~linearly with rows, while bf16 on
AMX barely grows from 1 to 32 rows. Measured on the Xeon (AMX) machine, 2 threads, microseconds,
fp32 / bf16 / int8 / int4: 576->3072 at 1 row 170 / 84 / 74 / 68, at 16 rows 334 / 101 / 582 / 519;
the LM head 576->49152 at 1 row 3227 / 1575 / 1869 / 1063, at 16 rows 5972 / 1478 / 9657 / 6944.
So a quantized kernel may carry a second, dense bf16 copy that serves calls of many rows (draft
verification, prefill): 4x cheaper verification there, for +2 bytes per weight (SmolLM2: +270 MB).
"auto" leaves it out; "auto+bf16" keeps it where native bf16 wins early; "int4pack+bf16" asks for
it outright. Measured end to end (SmolLM2 int4, speculation with n-gram + draft head, HumanEval,
Xeon with AMX, 2 threads), small draft trees on the packed kernel alone beat big trees on the
copy: 3 draft tokens, int4pack: 98 tokens/s; 16 draft tokens, int4pack+bf16: 70 tokens/s.

The quantized tensor format is `outrider.generation.weights` (shared with outrider_quantize).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from outrider.generation.weights import dequantize_int4, dequantize_int8, pack_int4, unpack_int4
from outrider.hardware import cpu_flags

log = logging.getLogger("outrider.llm")

# oneDNN packs weights for this many rows; 32 was best or tied for 1..128 rows on the dev machine.
PACK_ROWS = 32
# Inner k tiles of torch's CPU int4 layout (the only value its CPU kernel is tuned for).
INT4_INNER_K_TILES = 2
# Dense-copy threshold when it cannot be measured: a quantized GEMV lost to AMX bf16 from 8 rows.
DEFAULT_DENSE_FROM_ROWS = 8
# The packed kernel is chosen unless a dense one measured more than this much faster: real
# failures are large (fp32 activations: 7-20x), while a busy shared 2-core machine skews a
# few-ms benchmark by tens of percent either way.
PACKED_TIE_MARGIN = 2.0
KERNELS = ("auto", "auto+bf16", "int4pack", "int8pack", "dense", "int4pack+bf16", "int8pack+bf16", "int4native", "w4a8")
# "auto+bf16" keeps a dense bf16 copy only where it wins from this many rows or fewer: a draft
# tree's verification feeds 2-17 rows per sequence.
MULTIROW_COPY_MAX_ROWS = 8


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
    onednn = device.type == "cpu" and _onednn_cached(dtype)
    return QuantizedLinear(weight.to(device, torch.float32), dtype, onednn)


_ONEDNN: dict[torch.dtype, bool] = {}


def _onednn_cached(dtype: torch.dtype) -> bool:
    if dtype not in _ONEDNN:
        _ONEDNN[dtype] = onednn_works(dtype)
    return _ONEDNN[dtype]


# ---- lookup tables -------------------------------------------------------------------------------


class Int8BlockTable:
    """An fp32 [rows, cols] lookup table held as int8 values times one fp32 scale per `block` columns.

    Only built by `exact`, when that form holds every value exactly: GGUF's Q8_0 embeddings
    (w = q * d, d fp16, |q| <= 127) dequantized to fp32 are such a table, so lookups return the
    same fp32 rows bit for bit at a quarter of the memory (SmolLM2: 113 -> 30 MB).
    """

    __slots__ = ("q", "scale", "block", "shape")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, block: int) -> None:
        self.q, self.scale, self.block = q, scale, block
        self.shape = q.shape

    @staticmethod
    def exact(table: torch.Tensor, block: int = 32, chunk_rows: int = 4096) -> Optional["Int8BlockTable"]:
        """The int8 form of `table` if it holds every value exactly, else None."""
        if table.dim() != 2 or table.dtype != torch.float32 or table.shape[1] % block or table.device.type != "cpu":
            return None
        rows, cols = table.shape
        q = torch.empty(rows, cols, dtype=torch.int8)
        scale = torch.empty(rows, cols // block, dtype=torch.float32)
        for start in range(0, rows, chunk_rows):  # chunks: the check's temporaries stay small
            part = table[start:start + chunk_rows].reshape(-1, cols // block, block)
            d = part.abs().amax(dim=2) / 127  # Q8_0 puts 127 at each block's largest magnitude
            d = torch.where(d > 0, d, torch.ones_like(d))
            values = torch.round(part / d[..., None])
            if values.abs().max() > 127 or not torch.equal(values * d[..., None], part):
                return None
            q[start:start + chunk_rows] = values.to(torch.int8).reshape(-1, cols)
            scale[start:start + chunk_rows] = d
        return Int8BlockTable(q, scale, block)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows `index` (dim 0 only), exactly as the table they came from."""
        if dim != 0:
            raise ValueError("Int8BlockTable looks up rows only")
        q, d = self.q.index_select(0, index), self.scale.index_select(0, index)
        n, cols = q.shape
        return (q.view(n, cols // self.block, self.block).float() * d[..., None]).view(n, cols)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.q.numel() + self.scale.numel() * 4


# ---- quantized tensors (format above) ----------------------------------------------------------


@dataclass
class QuantTensor:
    """One linear weight in quantized form: "int4" (q packed, scale, zero), "int8" (q, scale), or
    "affine" (a GGUF file's own blocks, see `gguf_blocks`: q uint8 [out, in] of `bits` bits,
    scale = d and zero = m fp16-exact [out, in / group], w = q * d + m)."""

    mode: str
    q: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor] = None
    bits: int = 0  # affine only: 4, 5 or 8
    source: str = ""  # affine only: the GGUF type it came from

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in) of the weight it stands for."""
        rows, cols = self.q.shape
        return (rows, cols * 2) if self.mode == "int4" else (rows, cols)

    @property
    def group_size(self) -> Optional[int]:
        """Input columns per scale/zero group (int4, affine), None for per-channel int8."""
        return self.shape[1] // self.scale.shape[1] if self.mode in ("int4", "affine") else None

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight it stands for."""
        if self.mode == "affine":
            out, inp = self.shape
            group = self.group_size
            q = self.q.view(out, inp // group, group).float()
            return (q * self.scale.float()[..., None] + self.zero.float()[..., None]).view(out, inp)
        if self.mode == "int4":
            return dequantize_int4(self.q, self.scale, self.zero)
        return dequantize_int8(self.q, self.scale)

    def params_in(self, dtype: torch.dtype) -> "QuantTensor":
        """The same weight with scales and zeros rounded to `dtype`, as the packed kernels hold them."""
        zero = None if self.zero is None else self.zero.to(dtype).float()
        return QuantTensor(self.mode, self.q, self.scale.to(dtype).float(), zero, self.bits, self.source)

    def scaled(self, factor: float) -> "QuantTensor":
        """The weight times `factor` (scales and zeros scale; q stays). An affine weight whose d and
        m fit fp16 keeps them in fp16 (rounded when `factor` is not a power of two: the model folds
        1/sqrt(head_dim) into q this way, as for every quantized format), so its kernel keeps fp16
        tables and the fused layer stack."""
        scale, zero = self.scale.float() * factor, None if self.zero is None else self.zero.float() * factor
        if self.mode == "affine" and all(torch.equal(t.half().float(), t) for t in (self.scale, self.zero)):
            scale, zero = scale.half().float(), zero.half().float()
        return QuantTensor(self.mode, self.q, scale, zero, self.bits, self.source)

    def format(self) -> tuple:
        """What two weights must share to be concatenated into one kernel."""
        return self.mode, self.bits, self.shape[1], self.group_size

    @staticmethod
    def cat(parts: list["QuantTensor"]) -> "QuantTensor":
        """Concatenate along out-features (fused QKV, gate/up); formats must agree (`format`)."""
        formats = {p.format() for p in parts}
        if len(formats) != 1:
            raise ValueError(f"cannot fuse quantized weights of different formats: {formats}")
        zero = None if parts[0].zero is None else torch.cat([p.zero.float() for p in parts])
        return QuantTensor(parts[0].mode, torch.cat([p.q for p in parts]),
                           torch.cat([p.scale.float() for p in parts]), zero, parts[0].bits,
                           "+".join(sorted({p.source for p in parts if p.source})))

    @staticmethod
    def from_state_dict(sd: dict[str, torch.Tensor], name: str) -> Optional["QuantTensor"]:
        """The quantized form of weight `name` in `sd`, or None when it is not stored quantized."""
        if name + ".affine.q" in sd:
            return _affine_from_state_dict(sd, name)
        if name + ".int4.q" in sd:
            try:
                q, scale, zero = sd[name + ".int4.q"], sd[name + ".int4.scale"], sd[name + ".int4.zero"]
            except KeyError as exc:
                raise ValueError(f"{name}: int4 weights need .int4.q, .int4.scale and .int4.zero; {exc} missing")
            if q.dtype != torch.uint8 or q.dim() != 2 or scale.shape != zero.shape or scale.dim() != 2:
                raise ValueError(f"{name}: expected int4.q uint8 [out, in/2] and scale/zero [out, in/group], got "
                                 f"{q.dtype} {tuple(q.shape)}, {tuple(scale.shape)}, {tuple(zero.shape)}")
            if scale.shape[0] != q.shape[0] or (2 * q.shape[1]) % scale.shape[1]:
                raise ValueError(f"{name}: int4 scale {tuple(scale.shape)} does not fit q {tuple(q.shape)}")
            return QuantTensor("int4", q, scale, zero)
        if name + ".int8.q" in sd:
            q, scale = sd[name + ".int8.q"], sd.get(name + ".int8.scale")
            if scale is None or q.dtype != torch.int8 or q.dim() != 2 or tuple(scale.shape) != (q.shape[0],):
                raise ValueError(f"{name}: expected int8.q int8 [out, in] and int8.scale [out], got "
                                 f"{q.dtype} {tuple(q.shape)}, {None if scale is None else tuple(scale.shape)}")
            return QuantTensor("int8", q, scale)
        return None


AFFINE_KEYS = ("q", "d", "m", "bits")  # N.affine.*: see `affine_state_dict`


def affine_state_dict(name: str, groups: "object") -> dict[str, torch.Tensor]:
    """State-dict entries of weight `name` held as a GGUF file's own groups (`gguf_blocks.AffineGroups`):
    N.affine.q uint8 [out, in] (4-bit values packed two to a byte, as `pack_int4`), N.affine.d and
    N.affine.m fp16 [out, in / group], N.affine.bits uint8 [1] (4, 5 or 8; 5 and 8 held a byte each)."""
    import numpy as np

    q = torch.from_numpy(np.ascontiguousarray(groups.q))
    return {
        f"{name}.affine.q": pack_int4(q) if groups.bits == 4 else q,
        f"{name}.affine.d": torch.from_numpy(np.ascontiguousarray(groups.d)),
        f"{name}.affine.m": torch.from_numpy(np.ascontiguousarray(groups.m)),
        f"{name}.affine.bits": torch.tensor([groups.bits], dtype=torch.uint8),
    }


def _affine_from_state_dict(sd: dict[str, torch.Tensor], name: str) -> QuantTensor:
    try:
        q, d, m, bits = (sd[f"{name}.affine.{k}"] for k in AFFINE_KEYS)
    except KeyError as exc:
        raise ValueError(f"{name}: affine weights need .affine.q, .d, .m and .bits; {exc} missing") from None
    bits = int(bits.reshape(-1)[0])
    if bits not in (4, 5, 8) or q.dtype != torch.uint8 or q.dim() != 2 or d.shape != m.shape or d.dim() != 2:
        raise ValueError(f"{name}: expected affine.q uint8 2-D, d/m of one 2-D shape and 4, 5 or 8 bits, got "
                         f"{q.dtype} {tuple(q.shape)}, {tuple(d.shape)}, {tuple(m.shape)}, {bits} bits")
    values = unpack_int4(q) if bits == 4 else q
    if d.shape[0] != values.shape[0] or values.shape[1] % d.shape[1]:
        raise ValueError(f"{name}: affine d {tuple(d.shape)} does not fit q {tuple(values.shape)}")
    return QuantTensor("affine", values, d.float(), m.float(), bits)


class AffineTable:
    """An embedding table held as a GGUF file's own groups: lookups dequantize just the rows asked
    for (w = q * d + m in fp32), bit for bit what the tied head's kernel multiplies with."""

    __slots__ = ("q", "d", "m", "group", "shape")

    def __init__(self, weight: QuantTensor) -> None:
        # Our own copy: q may point into the artifact's safetensors mmap, whose touched pages all
        # stay resident while any tensor holds the mapping (+110 MB RSS for SmolLM2).
        self.q = weight.q.clone(memory_format=torch.contiguous_format)
        from .native import table_dtype

        # fp16 where the file's d and m fit it, else fp32 (a K type's sub-block scales): exact either way.
        dtype = table_dtype(weight.scale, weight.zero)
        self.d, self.m = weight.scale.to(dtype), weight.zero.to(dtype)
        self.group = weight.group_size
        self.shape = weight.q.shape

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows `index` (dim 0 only)."""
        if dim != 0:
            raise ValueError("AffineTable looks up rows only")
        q = self.q.index_select(0, index).float()
        n, cols = q.shape
        q = q.view(n, cols // self.group, self.group)
        d = self.d.index_select(0, index).float()[..., None]
        m = self.m.index_select(0, index).float()[..., None]
        return (q * d + m).view(n, cols)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.q.numel() + self.d.nbytes + self.m.nbytes


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
_OFFSETS = (128, 32, 16, 8)  # Q8_0, Q6_K, Q5_0, Q4_0: w = (q - offset) d


def _scale_tables(scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(d, m, offset) per-tile tables for an 8- or 5-bit kernel: m is empty and `offset` its power of
    two where every minimum is -offset * d (a symmetric type: that table would be half the bytes of
    scale, for nothing), else the table and 0. Tables in fp16 where their values fit, else fp32."""
    from .native import per_tile, table_dtype

    dtype = table_dtype(scale, minimum)
    for offset in _OFFSETS:
        if torch.equal(minimum.float(), scale.float() * -offset):
            return per_tile(scale, dtype=dtype)[0], _NO_TABLE, offset
    return (*per_tile(scale, minimum, dtype=dtype), 0)


class Int8Linear(_PackedLinear):
    """Per-channel int8 weight, bf16 activations: `aten._weight_int8pack_mm`. Output bf16.

    With `dense` (a bf16 `QuantizedLinear` of the same weight), calls of `dense_from` rows or more go there.
    """

    __slots__ = ("q", "scale")

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
        kernels = {getattr(p, "kernel", "dense") for p in parts}
        self.kernel = "native" if kernels <= NATIVE_KERNELS else "mixed"
        self.dtype = torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x).float() for part in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        """Bytes of weight its parts hold."""
        return sum(getattr(p, "nbytes", 0) for p in self.parts)


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


# ---- choosing a kernel ----------------------------------------------------------------------


@dataclass(frozen=True)
class KernelPlan:
    """How quantized weights of one mode run in this process (see `choose_kernel`)."""

    mode: str  # "int4" | "int8"
    kernel: str  # "int4pack" | "int8pack" | "dense" (dequantized at load into `dtype`)
    dtype: torch.dtype  # matmul input and output dtype
    dense_copy: bool = False  # also keep a dense bf16 copy for calls of many rows
    dense_from_rows: int = DEFAULT_DENSE_FROM_ROWS
    timings_us: dict = field(default_factory=dict, compare=False)
    reason: str = ""

    def build(self, weight: QuantTensor, device: "torch.device | str" = "cpu") -> Callable[[torch.Tensor], torch.Tensor]:
        """The kernel for one weight under this plan (dense when the packed kernel cannot take its shape)."""
        device = torch.device(device)
        if self.kernel == "dense" or device.type != "cpu":
            return dense_linear(weight.dequantize(), self.dtype, device)
        # The dense copy starts from the weights the packed kernel sees (bf16 scales and zeros),
        # so the many-row and the one-row paths compute the same model, up to rounding.
        dense = dense_linear(weight.params_in(torch.bfloat16).dequantize(), torch.bfloat16) if self.dense_copy else None
        try:
            if weight.mode == "int4":
                kernel = self.kernel if self.kernel in ("int4native", "w4a8") else "int4pack"
                return Int4Linear(weight, dense, self.dense_from_rows, kernel=kernel)
            return Int8Linear(weight, dense, self.dense_from_rows)
        except RuntimeError as exc:  # a shape the packed kernel refuses (e.g. tiny test models)
            log.debug("packed %s kernel refused shape %s (%s); dense instead", weight.mode, weight.shape, exc)
            return dense_linear(weight.dequantize(), self.dtype)


_PLANS: dict[tuple, KernelPlan] = {}


def choose_kernel(mode: str, kernel: str = "auto", group_size: int = 32) -> KernelPlan:
    """The kernel for `mode` ("int4" | "int8") weights here; "auto" measures (a few ms, once per process).

    Named kernels: "int4pack" / "int8pack" (torch's packed weight-only kernels, bf16 activations),
    "dense" (dequantize at load; bf16 where the CPU has native bf16, else fp32), and
    "int4pack+bf16" / "int8pack+bf16" (packed, plus a dense bf16 copy for calls of many rows).
    "auto" checks that the packed kernel works and agrees with a dequantized reference, times it
    against dense bf16 and fp32 at one row (a decode step) and picks the fastest; it also measures
    from how many rows dense bf16 wins (recorded, used when a "+bf16" copy is asked for).
    "auto+bf16" is "auto" plus a dense bf16 copy where native bf16 beats the packed kernel from
    `MULTIROW_COPY_MAX_ROWS` rows or fewer (many-row calls: large draft trees, long prefills).
    """
    if mode not in ("int4", "int8"):
        raise ValueError(f"choose_kernel: mode must be 'int4' or 'int8', got {mode!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    key = (mode, kernel, group_size)
    if key not in _PLANS:
        _PLANS[key] = _choose(mode, kernel, group_size)
        plan = _PLANS[key]
        log.info("%s weights: kernel %s (%s, dense bf16 copy %s) %s", mode, plan.kernel,
                 str(plan.dtype).removeprefix("torch."), "on" if plan.dense_copy else "off", plan.reason)
    return _PLANS[key]


def _choose(mode: str, kernel: str, group_size: int) -> KernelPlan:
    packed_name = "int4pack" if mode == "int4" else "int8pack"
    native_bf16 = cpu_has_native_bf16()
    dense_dtype = torch.bfloat16 if native_bf16 else torch.float32
    if kernel == "dense":
        return KernelPlan(mode, "dense", dense_dtype, reason="asked for")
    if kernel in ("int4native", "w4a8"):
        # Outrider's own int4 kernels (native.py). int4native: on AMX about flat in rows (prefill,
        # big draft trees), but slower than torch's at one row. w4a8: int8 activations on VNNI, as
        # llama.cpp (docs/ACCELERATORS.md). Where one cannot run, and for other formats (an int8
        # head next to int4 layers), the measured choice serves.
        from .native import int4_kernel, w4a8_kernel

        check = int4_kernel if kernel == "int4native" else w4a8_kernel
        usable, why = check() if mode == "int4" else (False, f"{mode} weights")
        if usable and _packed_works(mode, group_size, kernel):
            dtype = torch.float32 if kernel == "w4a8" else torch.bfloat16
            return KernelPlan(mode, kernel, dtype, reason=f"asked for (native kernel {why})")
        plan = _choose(mode, "auto", group_size)
        return KernelPlan(plan.mode, plan.kernel, plan.dtype, plan.dense_copy, plan.dense_from_rows, plan.timings_us,
                          reason=f"{kernel} asked for, not usable ({why}); {plan.reason}; with torch's kernels "
                                 "a draft tree's rows may differ from one-token steps in their last bits, so "
                                 "speculative greedy output can part from plain output at a near-tie")
    multirow = kernel == "auto+bf16"
    if kernel not in ("auto", "auto+bf16"):
        name, _, extra = kernel.partition("+")
        if name != packed_name:
            raise ValueError(f"kernel {kernel!r} does not run {mode} weights (use {packed_name!r} or 'dense')")
        if not _packed_works(mode, group_size):
            raise ValueError(f"kernel {kernel!r} does not work on this CPU/torch ({torch.__version__})")
        dense_from = _dense_crossover(mode, group_size) if extra else DEFAULT_DENSE_FROM_ROWS
        return KernelPlan(mode, name, torch.bfloat16, dense_copy=bool(extra), dense_from_rows=dense_from,
                          reason="asked for")
    # auto: measure at decode shape (one row, 576 -> 1536: SmolLM2's MLP; a few ms in all)
    candidates = {"dense-fp32": _bench_dense(torch.float32)}
    if native_bf16 and _onednn_cached(torch.bfloat16):
        candidates["dense-bf16"] = _bench_dense(torch.bfloat16)
    if _packed_works(mode, group_size):
        candidates[packed_name] = _bench_packed(mode, group_size, rows=1)
    timings = _race(candidates)
    best = min(timings, key=timings.get)
    # A near tie goes to the packed kernel: the benchmark's weight sits in cache, while a real
    # decode step streams every weight from memory, where reading 1/4-1/8 of the bytes pays more
    # (see PACKED_TIE_MARGIN).
    if packed_name in timings and timings[packed_name] <= PACKED_TIE_MARGIN * timings[best]:
        best = packed_name
    caps = f"capability {torch.backends.cpu.get_cpu_capability()}, native bf16 {'yes' if native_bf16 else 'no'}"
    reason = "measured at 1 row, us: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()) + f" ({caps})"
    if best == packed_name:
        crossover = _dense_crossover(mode, group_size) if native_bf16 else DEFAULT_DENSE_FROM_ROWS
        # Packed weight-only kernels cost about linearly in rows, dense bf16 on AMX/AVX512-BF16
        # about flat: for speculative verification, a dense copy is worth its memory where it wins early.
        copy = multirow and native_bf16 and crossover <= MULTIROW_COPY_MAX_ROWS
        if multirow:
            reason += f"; dense bf16 wins from {crossover} rows: copy {'kept' if copy else 'not kept'}"
        return KernelPlan(mode, packed_name, torch.bfloat16, dense_copy=copy, timings_us=timings, reason=reason,
                          dense_from_rows=crossover)
    dtype = torch.bfloat16 if best == "dense-bf16" else torch.float32
    return KernelPlan(mode, "dense", dtype, timings_us=timings, reason=reason)


_BENCH_IN, _BENCH_OUT = 576, 1536
# No kernel needs 2 ms for one row of 576 -> 1536 (0.9 M multiply-adds): slower means stalled.
BUSY_SECONDS = 2e-3


def _random_quant(mode: str, group_size: int, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    gen = torch.Generator().manual_seed(seed)
    if mode == "int4":
        q = pack_int4(torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8))
        scale = torch.rand(rows, cols // group_size, generator=gen) * 0.02 + 0.001
        zero = torch.randn(rows, cols // group_size, generator=gen) * 0.01
        return QuantTensor("int4", q, scale, zero)
    q = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8)
    return QuantTensor("int8", q, torch.rand(rows, generator=gen) * 0.002 + 1e-4)


def _packed_works(mode: str, group_size: int, kernel: str = "int4pack") -> bool:
    """The packed kernel (for int4: `kernel`) runs here and agrees with the dequantized fp32 reference."""
    try:
        weight = _random_quant(mode, group_size, 64, 4 * group_size if mode == "int4" else 128)
        lin = Int4Linear(weight, kernel=kernel) if mode == "int4" else Int8Linear(weight)
        if mode == "int4" and lin.kernel != kernel:
            return False
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        ref = x.float() @ weight.dequantize().t()
        err = (lin(x).float() - ref).abs().max().item()
        return err <= 0.02 * ref.abs().max().item() + 1e-3
    except Exception as exc:  # missing op, unsupported CPU: simply not a candidate
        log.debug("packed %s kernel unusable: %s", mode, exc)
        return False


def _bench_dense(dtype: torch.dtype, rows: int = 1) -> Callable[[], object]:
    weight = torch.randn(_BENCH_OUT, _BENCH_IN) * 0.05
    lin = dense_linear(weight, dtype)
    x = torch.randn(rows, _BENCH_IN).to(dtype)
    return lambda: lin(x)


def _bench_packed(mode: str, group_size: int, rows: int = 1) -> Callable[[], object]:
    weight = _random_quant(mode, group_size, _BENCH_OUT, _BENCH_IN)
    lin = Int4Linear(weight) if mode == "int4" else Int8Linear(weight)
    x = torch.randn(rows, _BENCH_IN).to(torch.bfloat16)
    return lambda: lin(x)


def _race(candidates: dict[str, Callable[[], object]], repeat: int = 15) -> dict[str, float]:
    """Best-of-`repeat` microseconds per candidate, calls interleaved round-robin.

    The minimum, not the median, and interleaved: on a 2-core machine shared with other work, a
    busy neighbour stalls whole bursts of calls (16 ms medians were seen for a 50 us matmul);
    the fastest call is the kernel's own cost, and interleaving spreads any stall over everyone.
    """
    for fn in candidates.values():
        for _ in range(3):
            fn()
    best = {name: math.inf for name in candidates}
    for _ in range(3):  # more rounds only while the machine is so busy that no call ran undisturbed
        for _ in range(repeat):
            for name, fn in candidates.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
        if min(best.values()) < BUSY_SECONDS:
            break
    return {name: seconds * 1e6 for name, seconds in best.items()}


def _dense_crossover(mode: str, group_size: int) -> int:
    """Fewest rows (of 2, 4, 8, 16) from which dense bf16 beats the packed kernel."""
    if not (cpu_has_native_bf16() and _onednn_cached(torch.bfloat16)):
        return DEFAULT_DENSE_FROM_ROWS
    for rows in (2, 4, 8, 16):
        timings = _race({"dense": _bench_dense(torch.bfloat16, rows), "packed": _bench_packed(mode, group_size, rows)}, 7)
        if timings["dense"] < timings["packed"]:
            return rows
    return 32


def kernel_key(mode: str, kernel: str, device: "torch.device | str" = "cpu") -> str:
    """What computes `mode` weights asked to run on `kernel` here, as far as it changes the result:
    part of a quantized artifact's cache key, since its quality gate measures the model as this
    kernel computes it (a cache copied to another machine must not reuse another kernel's figures).
    The native w4a8 kernels give the same bits on every instruction set; int4native's two paths
    round differently; torch's kernels depend on its CPU capability."""
    if torch.device(device).type != "cpu":
        return f"{torch.device(device).type}:dense"
    if mode not in ("int4", "int8"):
        return f"{mode}:dense"
    plan = choose_kernel(mode, kernel)
    if plan.kernel == "w4a8":
        return "w4a8:native"
    if plan.kernel == "int4native":
        from .native import int4_kernel

        return f"int4native:{int4_kernel()[1]}"
    return f"{plan.kernel}:{str(plan.dtype).removeprefix('torch.')}:{torch.backends.cpu.get_cpu_capability()}"

