"""Outrider's native CPU kernels without torch: `outrider_llm._native_c` (csrc/c_api.h, built at
install beside the torch extension) loaded with ctypes, on numpy arrays.

The same core as native.py's torch ops (csrc/kernels.h), so the same results bit for bit; what a
process gains is not importing torch (~260 MB, seconds) to serve a GGUF model. Nothing here imports
torch, and neither does `import outrider_llm`.

- `a8_matmul`: fp32 [rows, out] = x (quantized to int8 per row and group) @ W.T for W in the 4-, 5-
  or 8-bit layout (`nibble_tiles`, `pack_w5`, `byte_tiles`), fp16 or fp32 tables, or a symmetric
  type's offset; `bits` is the code of `bits_flags`.
- `rms_norm`, `swiglu`, `add`, `attend`: the pieces of a layer.
- `llama_layers` / `LayerStack`: every decoder layer of a step in one call (Llama, Qwen2's qkv bias,
  Qwen3's q/k norms), each matrix 1 to 3 `Part`s side by side in their own block types. Build the
  `LayerStack` (and the `KvCaches`) once at model load: a call then passes them as they are.

`OUTRIDER_NATIVE=0` turns it off and `OUTRIDER_NATIVE_ISA=avx2` (say) forces a kernel set, as for
native.py; `library()` says why it is not loaded where it is not. The kernels' threads are one
count per process: `set_threads(n)` (default: the CPUs this process may use).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

log = logging.getLogger("outrider.llm")

PACKAGE = Path(__file__).parent
BUILD_REPORT = PACKAGE / "_native_c_build.txt"  # written by setup.py where the build failed
TILE = 16  # outputs per tile
F32_TABLES = 16  # or-ed into bits: d and m are fp32 (kernels.h kF32Scales)
OFFSET_SHIFT = 8  # log2(offset) << OFFSET_SHIFT in bits: a symmetric type, m None (kernels.h kOffsetShift)
# Per layout (bits & 15): inputs per block of one tile, and its bytes (kernels.h).
LAYOUTS = {4: (8, 64), 5: (8, 80), 8: (4, 64)}
# A GGUF K type at the file's bytes (kernels.h kSuperBlocks): bits SUPER_BLOCKS | 4 (Q4_K), 5 (Q5_K), 6 (Q6_K),
# w uint8 [out/16, in/256, bytes] holding scales and values, no d or m, group 256.
SUPER_BLOCKS = 32
SUPER = 256
SUPER_LAYOUTS = {4: 2368, 5: 2880, 6: 3360}
# The simple types with each group's scales beside its values (kernels.h kGroupBlocks): bits GROUP_BLOCKS |
# 4, 5 or 8 (| log2(offset) << OFFSET_SHIFT), w uint8 [out/16, in/32, bytes], no d or m, group 32.
GROUP_BLOCKS = 64
GROUP_VALUES = {4: 256, 5: 320, 8: 512}  # bytes of a group's values; + 32 (d) + 32 (m, where no offset)


def group_block_bytes(bits: int) -> int:
    """Bytes of one tile's group of 32 inputs in the group-block layout `bits`."""
    return GROUP_VALUES[bits & 15] + (32 if (bits >> OFFSET_SHIFT) & 15 else 64)


def own_layout(bits: int) -> bool:
    """Whether `bits` is a layout that holds its scales among its values (w alone: a K type's super
    blocks or a simple type's group blocks)."""
    return bool(bits & (SUPER_BLOCKS | GROUP_BLOCKS))
# GGML's type ids of the block types the kernels take as the file holds them (gguf_pack.cpp).
PACKED_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}

_LOCK = threading.Lock()
_LOADED: list[tuple[bool, str]] = []
_C: Optional[ctypes.CDLL] = None
_ERR_SIZE = 512


# ---- the C structs (csrc/c_api.h), field for field -----------------------------------------------

class _Part(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("out", ctypes.c_int64),
                ("group", ctypes.c_int64), ("bits", ctypes.c_int32)]


class _Matrix(ctypes.Structure):
    _fields_ = [("parts", _Part * 3), ("count", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qkv", _Matrix), ("o", _Matrix),
                ("gate_up", _Matrix), ("down", _Matrix), ("qkv_bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("q_scale", ctypes.c_float), ("activation", ctypes.c_int32),
                ("attn_post_norm", ctypes.c_void_p), ("mlp_post_norm", ctypes.c_void_p), ("rope_table", ctypes.c_int64),
                ("window", ctypes.c_int64), ("attn_softcap", ctypes.c_float)]


class _Kv(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("slots", ctypes.c_int64), ("capacity", ctypes.c_int64),
                ("s_half", ctypes.c_int64), ("s_slot", ctypes.c_int64), ("s_head", ctypes.c_int64),
                ("f16", ctypes.c_int64), ("ring", ctypes.c_int64), ("q8", ctypes.c_int64)]


_STRUCTS = {"OutriderPart": _Part, "OutriderMatrix": _Matrix, "OutriderLayer": _Layer, "OutriderKv": _Kv}

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "outrider_kernels": (ctypes.c_char_p, []),
    "outrider_kernel_set_count": (_INT, []),
    "outrider_kernel_set_name": (ctypes.c_char_p, [_INT]),
    "outrider_cpu_runs": (_INT, [_INT]),
    "outrider_select": (_INT, [ctypes.c_char_p]),
    "outrider_cpu_features": (ctypes.c_char_p, []),
    "outrider_set_threads": (None, [_INT]),
    "outrider_threads": (_INT, []),
    "outrider_struct_size": (_I64, [ctypes.c_char_p]),
    "outrider_a8_matmul": (_INT, [_P, _I64, _I64, _I64, _P, _P, _P, _I64, _INT, _P, _I64, _P, _I64]),
    "outrider_rms_norm": (_INT, [_P, _P, ctypes.c_float, _I64, _I64, _P, _P, _I64]),
    "outrider_swiglu": (_INT, [_P, _I64, _I64, _P, _P, _I64]),
    "outrider_geglu": (_INT, [_P, _I64, _I64, _P, _P, _I64]),
    "outrider_add": (None, [_P, _P, _I64]),
    "outrider_attend": (_INT, [_P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _I64]),
    "outrider_packed_shape": (_INT, [_INT, _I64, _INT, _P, _P, _P, _P, _I64]),
    "outrider_pack_gguf": (_INT, [_INT, _P, _I64, _I64, _P, _I64, _INT, _P, _P, _I64]),
    "outrider_dequantize_super_rows": (_INT, [_P, _INT, _I64, _P, _I64, _P, _P, _I64]),
    "outrider_llama_layers": (_INT, [_P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _I64, _P, _I64, _P, _I64, _I64, _I64,
                                     _I64, _I64, ctypes.c_float, _P, _I64]),
}


# ---- loading ---------------------------------------------------------------------------------------

def library() -> tuple[bool, str]:
    """(loaded, reason): whether the install-built C library is loaded (loading it once)."""
    with _LOCK:
        if not _LOADED:
            _LOADED.append(_load())
            if _LOADED[0][0]:
                log.info("native C kernels: %s (CPU features: %s)", _LOADED[0][1], cpu_features())
            else:
                log.info("native C kernels unavailable: %s", _LOADED[0][1])
        return _LOADED[0]


def _load() -> tuple[bool, str]:
    global _C
    if os.environ.get("OUTRIDER_NATIVE", "1") == "0":
        return False, "OUTRIDER_NATIVE=0"
    path, why = built_library("_native_c", BUILD_REPORT)
    if path is None:
        return False, f"{why} (reinstall with a C++ compiler present: pip install --no-build-isolation)"
    try:
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, argtypes
    except (OSError, AttributeError) as exc:  # a missing libgomp, a library older than this file
        return False, f"{path.name} does not load: {exc}"
    for name, struct in _STRUCTS.items():
        size = lib.outrider_struct_size(name.encode())
        if size != ctypes.sizeof(struct):
            return False, f"{path.name}: {name} is {size} bytes there, {ctypes.sizeof(struct)} in native_c.py"
    _C = lib
    return True, serving_report(kernels(), kernel_sets)


def built_library(stem: str, report: Path) -> tuple[Optional[Path], str]:
    """(path, "") of the library `stem` setup.py built into this package, or (None, why not): the
    build's report where it failed. Both bindings (this one and native.py's torch ops) look so."""
    paths = [PACKAGE / f"{stem}{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    path = next((p for p in paths if p.exists()), None)
    if path is not None:
        return path, ""
    return None, report.read_text().strip() if report.exists() else "not built at install"


def serving_report(name: str, kernel_sets: Any) -> str:
    """What a loaded binding serves with (kernel set `name`), warning where OUTRIDER_NATIVE_ISA asked
    for a set this CPU does not run (`kernel_sets()` lists those it does)."""
    forced = os.environ.get("OUTRIDER_NATIVE_ISA", "")
    if forced and forced != name:
        log.warning("OUTRIDER_NATIVE_ISA=%s: not a kernel set this CPU runs (%s); %s serves", forced,
                    ", ".join(kernel_sets()), name)
    return f"kernel set {name}" + (" (no SIMD path for this CPU: slow)" if name == "scalar" else "")


def _lib() -> ctypes.CDLL:
    if _C is None:
        loaded, why = library()
        if not loaded:
            raise RuntimeError(f"outrider's native C kernels are not loaded: {why}")
    assert _C is not None
    return _C


def kernels() -> str:
    """The kernel set every call uses now ("avx2", "avx512_vnni", "neon_dotprod", ...)."""
    return _lib().outrider_kernels().decode()


def kernel_sets() -> list[str]:
    """Every kernel set this CPU runs, best first; "scalar" (the reference) is always last."""
    lib = _lib()
    return [lib.outrider_kernel_set_name(i).decode() for i in range(lib.outrider_kernel_set_count())
            if lib.outrider_cpu_runs(i)]


def select(name: str) -> None:
    """Use kernel set `name` for every call of this library in this process (tests and benchmarks)."""
    if not _lib().outrider_select(name.encode()):
        raise ValueError(f"kernel set {name!r} does not run on this CPU (it runs: {', '.join(kernel_sets())})")


def cpu_features() -> str:
    """The CPU features the dispatcher read (cpuid on x86, HWCAP on ARM)."""
    return _lib().outrider_cpu_features().decode()


def set_threads(threads: int) -> None:
    """The threads of every parallel part of every call, from any thread (one count per process);
    0 or less: the default, the CPUs this process may use."""
    _lib().outrider_set_threads(int(threads))


def threads() -> int:
    """The thread count calls use now."""
    return int(_lib().outrider_threads())


# ---- checks ----------------------------------------------------------------------------------------

def _address(a: Optional[np.ndarray]) -> Optional[int]:
    return None if a is None else a.ctypes.data


def _array(a: Any, dtype: Any, shape: Sequence[Optional[int]], what: str, writeable: bool = False) -> np.ndarray:
    """`a`, checked: a C-contiguous numpy array of `dtype` and `shape` (None: any size there)."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{what} must be a numpy array, got {type(a).__name__}")
    if a.dtype != dtype or a.ndim != len(shape) or any(s is not None and s != n for s, n in zip(shape, a.shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{what} must be {np.dtype(dtype).name} [{want}], got {a.dtype.name} {list(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (np.ascontiguousarray)")
    if writeable and not a.flags.writeable:
        raise ValueError(f"{what} must be writeable")
    return a


def _raise(code: int, err: Any) -> None:
    if code != 0:
        raise ValueError(err.value.decode(errors="replace"))


def five_bit_layout(kernel_set: str) -> bool:
    """Whether 5-bit weights take the 5-bit layout on `kernel_set` ("" where no kernels loaded: no),
    or 8-bit groups (the same results bit for bit; native.five_bit_tiles says why): x86 yes, NEON no
    until measured on a board. OUTRIDER_NATIVE_W5=1 / =0 forces either."""
    forced = os.environ.get("OUTRIDER_NATIVE_W5", "")
    if forced in ("0", "1"):
        return forced == "1"
    return bool(kernel_set) and not kernel_set.startswith("neon")


def bits_flags(bits: int, tables: Any = np.float16, offset: int = 0) -> int:
    """The `bits` code a matmul takes, as the torch ops form it (torch_ops.cpp a8_mm): the layout (4,
    5 or 8), | F32_TABLES where d (and m) are fp32 (`tables`: their dtype, or one of them), |
    log2(offset) << OFFSET_SHIFT for a symmetric type (w = (q - offset) d; offset a power of two from
    2 to 32768: Q8_0 128, Q6_K 32, Q5_0 16, Q4_0 8), whose m is then None."""
    if bits not in LAYOUTS:
        raise ValueError(f"bits must be 4, 5 or 8, got {bits}")
    dtype = tables.dtype if isinstance(tables, np.ndarray) else np.dtype(tables)
    if dtype not in (np.float16, np.float32):
        raise ValueError(f"tables must be float16 or float32, got {dtype}")
    code = bits | (F32_TABLES if dtype == np.float32 else 0)
    if offset:
        log2 = int(offset).bit_length() - 1
        if offset < 2 or offset > 32768 or 1 << log2 != offset:
            raise ValueError(f"offset must be 0 or a power of two from 2 to 32768, got {offset}")
        code |= log2 << OFFSET_SHIFT
    return code


def _split_bits(code: int, what: str) -> tuple[int, Any, int]:
    """(layout, table dtype, offset) of a bits code."""
    layout, log2 = code & 15, (code >> OFFSET_SHIFT) & 15
    if code < 0 or code & ~(15 | F32_TABLES | (15 << OFFSET_SHIFT)) or layout not in LAYOUTS:
        raise ValueError(f"{what}: bits {code:#x} is not a code of bits_flags (4, 5 or 8 | 16 for fp32 tables | "
                         "log2(offset) << 8)")
    return layout, np.float32 if code & F32_TABLES else np.float16, 1 << log2 if log2 else 0


def _check_weight(w: Any, d: Any, m: Any, bits: int, group: int, what: str) -> int:
    """The weight's arrays against its bits code; returns its inputs."""
    if isinstance(bits, (int, np.integer)) and bits & GROUP_BLOCKS:
        layout = bits & 15
        if bits & ~(GROUP_BLOCKS | 15 | (15 << OFFSET_SHIFT)) or layout not in GROUP_VALUES:
            raise ValueError(f"{what}: bits {bits:#x}: a group-block layout is GROUP_BLOCKS | 4, 5 or 8 "
                             "(| log2(offset) << 8)")
        size = group_block_bytes(bits)
        _array(w, np.uint8, (None, None, size), f"{what}: w (group-block layout [out/16, in/32, {size}])")
        if d is not None or m is not None or group != 32:
            raise ValueError(f"{what}: a group-block weight is w alone (d, m None) in groups of 32")
        return w.shape[1] * 32
    if isinstance(bits, (int, np.integer)) and bits & SUPER_BLOCKS:
        layout = bits & 15
        if bits != SUPER_BLOCKS | layout or layout not in SUPER_LAYOUTS:
            raise ValueError(f"{what}: bits {bits:#x}: a super-block layout is SUPER_BLOCKS | 4, 5 or 6")
        _array(w, np.uint8, (None, None, SUPER_LAYOUTS[layout]), f"{what}: w (super-block layout {layout} [out/16, "
               f"in/256, {SUPER_LAYOUTS[layout]}])")
        if d is not None or m is not None or group != SUPER:
            raise ValueError(f"{what}: a super-block weight is w alone (d, m None) in groups of {SUPER}")
        return w.shape[1] * SUPER
    layout, dtype, offset = _split_bits(bits, what)
    per_block, block_bytes = LAYOUTS[layout]
    _array(w, np.uint8, (None, None, block_bytes), f"{what}: w ({layout}-bit layout [out/16, in/{per_block}, "
           f"{block_bytes}])")
    tiles, inp = w.shape[0], w.shape[1] * per_block
    if not isinstance(group, (int, np.integer)) or group <= 0 or inp % group:
        raise ValueError(f"{what}: group must be a positive divisor of the {inp} inputs, got {group}")
    flag = "| F32_TABLES" if dtype == np.float32 else "without F32_TABLES"
    _array(d, dtype, (tiles, inp // group, TILE), f"{what}: d (bits {bits:#x}: {flag})")
    if offset:
        if m is not None:
            raise ValueError(f"{what}: bits {bits:#x} carries offset {offset} (a symmetric type): m must be None")
    else:
        _array(m, dtype, (tiles, inp // group, TILE), f"{what}: m (bits {bits:#x}: {flag}, no offset)")
    return inp


# ---- operations ------------------------------------------------------------------------------------

def a8_matmul(x: np.ndarray, w: np.ndarray, d: np.ndarray, m: Optional[np.ndarray], bits: int, group: int,
              out: Optional[int] = None, y: Optional[np.ndarray] = None) -> np.ndarray:
    """float32 [rows, out] = x (float32 [rows, in], C-contiguous; quantized to int8 per row and group)
    @ W.T, W = (w, d, m) in the layout and tables `bits` says (`bits_flags`). `out`: the output count,
    checked against w where given. `y`: where to write, float32 [rows, out] with rows of contiguous
    floats at any stride (a column slice of a wider array: wide[:, a:a + out]); returned. (A `Part`'s
    `matmul` checks its weight once, at construction: less to do a call.)"""
    lib = _lib()
    inp = _check_weight(w, d, m, bits, group, "a8_matmul")
    n = w.shape[0] * TILE
    if out is not None and out != n:
        raise ValueError(f"a8_matmul: w holds {n} outputs, out says {out}")
    return _matmul(lib, x, inp, n, group, w.ctypes.data, _address(d), _address(m), bits, y)


def _matmul(lib: ctypes.CDLL, x: np.ndarray, inp: int, n: int, group: int, w: int, d: Optional[int], m: Optional[int],
            bits: int, y: Optional[np.ndarray]) -> np.ndarray:
    _array(x, np.float32, (None, inp), "a8_matmul: x")
    rows = x.shape[0]
    if y is None:
        y = np.empty((rows, n), np.float32)
    elif not (isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == (rows, n) and y.flags.writeable
              and y.strides[1] == 4 and y.strides[0] % 4 == 0 and (rows <= 1 or y.strides[0] >= 4 * n)):
        raise ValueError(f"a8_matmul: y must be a writeable float32 [{rows}, {n}] with contiguous rows, got "
                         f"{getattr(y, 'dtype', type(y).__name__)} {list(getattr(y, 'shape', ()))} strides "
                         f"{getattr(y, 'strides', None)}")
    stride = y.strides[0] // 4 if rows > 1 else n
    err = ctypes.create_string_buffer(_ERR_SIZE)
    _raise(lib.outrider_a8_matmul(x.ctypes.data, rows, inp, group, w, d, m, n, bits, y.ctypes.data, stride, err,
                                  _ERR_SIZE), err)
    return y


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, y: Optional[np.ndarray] = None) -> np.ndarray:
    """float32 [rows, hidden] = x / sqrt(mean(x^2) + eps) * w per row (hidden a multiple of 16);
    y may be x (in place)."""
    lib = _lib()
    _array(x, np.float32, (None, None), "rms_norm: x")
    rows, hidden = x.shape
    _array(w, np.float32, (hidden,), "rms_norm: w")
    y = np.empty_like(x) if y is None else _array(y, np.float32, (rows, hidden), "rms_norm: y", writeable=True)
    err = ctypes.create_string_buffer(_ERR_SIZE)
    _raise(lib.outrider_rms_norm(_address(x), _address(w), eps, rows, hidden, _address(y), err, _ERR_SIZE), err)
    return y


def swiglu(gate_up: np.ndarray, y: Optional[np.ndarray] = None, activation: str = "silu") -> np.ndarray:
    """float32 [rows, inter] = act(gate) * up of gate_up [rows, 2 inter] = [gate | up]; act "silu"
    (SwiGLU) or "gelu_tanh" (GeGLU: GELU's tanh approximation)."""
    lib = _lib()
    if activation not in ACTIVATIONS:
        raise ValueError(f"swiglu: activation {activation!r}, expected one of {', '.join(ACTIVATIONS)}")
    _array(gate_up, np.float32, (None, None), "swiglu: gate_up")
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"swiglu: gate_up must be [rows, 2 x intermediate], got {list(gate_up.shape)}")
    inter = width // 2
    y = np.empty((rows, inter), np.float32) if y is None else _array(y, np.float32, (rows, inter), "swiglu: y",
                                                                    writeable=True)
    err = ctypes.create_string_buffer(_ERR_SIZE)
    fn = lib.outrider_swiglu if activation == "silu" else lib.outrider_geglu
    _raise(fn(_address(gate_up), rows, inter, _address(y), err, _ERR_SIZE), err)
    return y


def add(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x += y in place (float32, C-contiguous, the same shape); returns x."""
    _array(x, np.float32, x.shape if isinstance(x, np.ndarray) else (), "add: x", writeable=True)
    _array(y, np.float32, x.shape, "add: y")
    _lib().outrider_add(_address(x), _address(y), x.size)
    return x


def kv_head_dim(kv: np.ndarray) -> int:
    """head_dim of a layer's KV array [2, slots, KV, capacity, row]: row, or for q8_0 (int8) rows of
    head_dim + head_dim / 16 bytes, 16/17 of it."""
    return kv.shape[-1] * 16 // 17 if kv.dtype == np.int8 else kv.shape[-1]


def _kv_struct(kv: Any, num_kv_heads: Optional[int], what: str, ring: bool = False) -> _Kv:
    size = getattr(getattr(kv, "dtype", None), "itemsize", 0)
    q8 = isinstance(kv, np.ndarray) and kv.dtype == np.int8
    if q8 and (kv.ndim != 5 or kv.shape[4] % 34 or kv_head_dim(kv) + kv_head_dim(kv) // 16 != kv.shape[4]):
        raise ValueError(f"{what}: a q8_0 KV cache's rows must be head_dim + head_dim / 16 bytes (head_dim a "
                         f"multiple of 32), got {list(kv.shape)}")
    if not (isinstance(kv, np.ndarray) and kv.dtype in (np.float32, np.float16, np.int8) and kv.ndim == 5
            and kv.shape[0] == 2
            and (num_kv_heads is None or kv.shape[2] == num_kv_heads) and kv.flags.writeable
            and kv.strides[4] == size and kv.strides[3] == size * kv.shape[4] and all(s > 0 and s % size == 0
                                                                                    for s in kv.strides)):
        heads = "KV" if num_kv_heads is None else num_kv_heads
        raise ValueError(f"{what}: a layer's KV cache must be a writeable float32, float16 or q8_0 int8 [2, slots, "
                         f"{heads}, "
                         f"capacity, D] with rows of D contiguous, got {getattr(kv, 'dtype', type(kv).__name__)} "
                         f"{list(getattr(kv, 'shape', ()))} strides {getattr(kv, 'strides', None)}")
    return _Kv(kv.ctypes.data, kv.shape[1], kv.shape[3], kv.strides[0] // size, kv.strides[1] // size,
               kv.strides[2] // size, int(kv.dtype == np.float16), int(ring), int(q8))


class KvCaches:
    """The OutriderKv table of a model's KV caches, built once: `kv` float32 [layers, 2, slots, KV,
    capacity, D] (or a sequence of per-layer [2, slots, KV, capacity, D] arrays), rows of D
    contiguous; `rings`: which layers' caches are rings (a sliding layer's: index i at row i %
    capacity). Holds them (the table points into them)."""

    def __init__(self, kv: Union[np.ndarray, Sequence[np.ndarray]], num_kv_heads: Optional[int] = None,
                 rings: Optional[Sequence[bool]] = None) -> None:
        if isinstance(kv, np.ndarray) and kv.ndim != 6:
            raise ValueError(f"KvCaches: kv must be [layers, 2, slots, KV, capacity, D], got {list(kv.shape)}")
        self.layers_kv = list(kv)
        rings = list(rings) if rings is not None else [False] * len(self.layers_kv)
        structs = [_kv_struct(layer, num_kv_heads, f"KvCaches: layer {i}", rings[i])
                   for i, layer in enumerate(self.layers_kv)]
        self.table = (_Kv * max(1, len(structs)))(*structs)
        self.layers = len(structs)
        self.num_kv_heads = self.layers_kv[0].shape[2] if structs else num_kv_heads
        self.dim = kv_head_dim(self.layers_kv[0]) if structs else None
        self.keep = kv


def _chunk_args(chunks: Any, visible: Any, rows: int, what: str) -> tuple[int, int, Optional[int], int]:
    """(chunks pointer, count, visible pointer, visible width), checked for dtype and layout (the C
    side checks the table's values)."""
    _array(chunks, np.int64, (None, 4), f"{what}: chunks")
    if visible is None:
        return chunks.ctypes.data, chunks.shape[0], None, 0
    _array(visible, np.bool_, (rows, None), f"{what}: visible")
    return chunks.ctypes.data, chunks.shape[0], visible.ctypes.data, visible.shape[1]


def attend(qkv: np.ndarray, kv: np.ndarray, chunks: np.ndarray, visible: Optional[np.ndarray], num_heads: int,
           num_kv_heads: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """One layer's attention for a step's chunks (as `torch.ops.outrider.attend`): qkv float32 [T,
    (H + 2 KV) D] with RoPE applied, q pre-scaled by 1/sqrt(D); kv float32 [2, slots, KV, capacity, D]
    (the chunks' K and V are written into it); chunks int64 [C, 4] (slot, first row, rows, committed
    length); visible bool [T, W] or None (causal). Returns float32 [T, H D]."""
    lib = _lib()
    table = _kv_struct(kv, num_kv_heads, "attend")
    dim = kv_head_dim(kv)
    _array(qkv, np.float32, (None, (num_heads + 2 * num_kv_heads) * dim), "attend: qkv")
    total = qkv.shape[0]
    ch, count, vis, width = _chunk_args(chunks, visible, total, "attend")
    out = np.empty((total, num_heads * dim), np.float32) if out is None else _array(
        out, np.float32, (total, num_heads * dim), "attend: out", writeable=True)
    err = ctypes.create_string_buffer(_ERR_SIZE)
    _raise(lib.outrider_attend(_address(qkv), total, ctypes.byref(table), ch, count, vis, width, num_heads,
                               num_kv_heads, dim, _address(out), err, _ERR_SIZE), err)
    return out


# ---- layers ----------------------------------------------------------------------------------------

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
    _pointers: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        inputs = _check_weight(self.w, self.d, self.m, self.bits, self.group, "Part")
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "_pointers", (self.w.ctypes.data, _address(self.d), _address(self.m)))

    @property
    def out(self) -> int:
        return self.w.shape[0] * TILE

    def matmul(self, x: np.ndarray, y: Optional[np.ndarray] = None) -> np.ndarray:
        """`a8_matmul` of x float32 [rows, inputs] with this weight (into y where given)."""
        return _matmul(_lib(), x, self.inputs, self.out, self.group, *self._pointers, self.bits, y)

    @classmethod
    def from_affine(cls, groups: Any, symmetric: bool = True) -> "Part":
        """The kernel layout of `gguf_blocks.AffineGroups` (see `pack_affine`); with `symmetric`, a
        type whose minimums are all -offset * d (Q8_0, Q6_K, Q5_0, Q4_0) gets the offset and no m
        table, as linear.py's tables do (the same results: the minimums the kernel forms are the
        table's values)."""
        q = np.ascontiguousarray(groups.q)
        pack = _PACKERS.get(groups.bits)
        if pack is None:
            raise ValueError(f"affine groups of {groups.bits} bits: the kernels take 4, 5 or 8")
        d = np.asarray(groups.d).astype(np.float32)
        m = np.asarray(groups.m).astype(np.float32)
        if symmetric:
            dt, mt, offset = scale_tables(d, m)
        else:
            dt, mt = per_tile(d, m, dtype=table_dtype(d, m))
            offset = 0
        return cls(pack(q), dt, mt, bits_flags(groups.bits, dt.dtype, offset), int(groups.group))


PartsLike = Union[Part, Sequence[Part]]
#: a layer's MLP activation -> the C ABI's code (OUTRIDER_SILU, OUTRIDER_GELU_TANH)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


@dataclass
class Layer:
    """One decoder layer for `LayerStack`: fp32 norm weights [hidden]; each matrix a `Part` or 1 to 3
    of them side by side (q | k | v, gate | up); Qwen2's qkv_bias [(H + 2 KV) D] and Qwen3's q_norm and
    k_norm [D] where the model has them (attention takes q pre-scaled by 1/sqrt(D): with q_norm, put
    it in q_norm's weights)."""

    attn_norm: np.ndarray
    mlp_norm: np.ndarray
    qkv: PartsLike
    o: PartsLike
    gate_up: PartsLike
    down: PartsLike
    qkv_bias: Optional[np.ndarray] = None
    q_norm: Optional[np.ndarray] = None
    k_norm: Optional[np.ndarray] = None
    #: 0: q comes pre-scaled by 1/sqrt(D) (in its weights or q_norm's); else q is multiplied by it after
    #: the bias and q_norm (a matrix at the file's bytes, whose scales cannot take it exactly)
    q_scale: float = 0.0
    #: Gemma 2/3: RMSNorm [hidden] of the attention's and the MLP's output before each is added to x
    attn_post_norm: Optional[np.ndarray] = None
    mlp_post_norm: Optional[np.ndarray] = None
    activation: str = "silu"  # or "gelu_tanh" (GeGLU)
    rope_table: int = 0  # which of the step's RoPE tables rotates q and k (Gemma 3's sliding layers: their own)
    window: int = 0  # a sliding layer's window: a key this many positions or more before its query is not seen
    attn_softcap: float = 0.0  # Gemma 2: attention scores soft-capped to cap * tanh(score / cap)


def _parts(parts: PartsLike) -> list[Part]:
    return [parts] if isinstance(parts, Part) else list(parts)


class LayerStack:
    """A model's decoder layers as the C layer table, built and checked once (at model load): a step
    then costs one call with the table as it is. Holds every array the table points into."""

    def __init__(self, layers: Sequence[Layer], *, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float) -> None:
        if not layers:
            raise ValueError("LayerStack: no layers")
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, float(eps)
        self.hidden = int(np.asarray(layers[0].attn_norm).size)
        self.inter = sum(p.out for p in _parts(layers[0].gate_up)) // 2
        q_width, width = num_heads * head_dim, (num_heads + 2 * num_kv_heads) * head_dim
        self.layers = list(layers)
        self.table = (_Layer * len(layers))()
        self._keep: list[Any] = []  # every array the table points into (even were a Layer changed later)
        inputs = {"qkv": self.hidden, "o": q_width, "gate_up": self.hidden, "down": self.inter}
        for li, layer in enumerate(self.layers):
            entry = self.table[li]
            for name in ("attn_norm", "mlp_norm"):
                array = _array(getattr(layer, name), np.float32, (self.hidden,), f"layer {li} {name}")
                setattr(entry, name, array.ctypes.data)
                self._keep.append(array)
            entry.q_scale = float(layer.q_scale)
            if layer.activation not in ACTIVATIONS:
                raise ValueError(f"layer {li}: activation {layer.activation!r}, expected one of "
                                 f"{', '.join(ACTIVATIONS)}")
            entry.activation = ACTIVATIONS[layer.activation]
            entry.rope_table, entry.window = int(layer.rope_table), int(layer.window)
            entry.attn_softcap = float(layer.attn_softcap)
            for name, size in (("qkv_bias", width), ("q_norm", head_dim), ("k_norm", head_dim),
                               ("attn_post_norm", self.hidden), ("mlp_post_norm", self.hidden)):
                value = getattr(layer, name)
                if value is not None:
                    setattr(entry, name, _array(value, np.float32, (size,), f"layer {li} {name}").ctypes.data)
                    self._keep.append(value)
            for name, inp in inputs.items():
                parts = _parts(getattr(layer, name))
                if not 1 <= len(parts) <= 3:
                    raise ValueError(f"layer {li} {name}: 1 to 3 parts, got {len(parts)}")
                matrix = getattr(entry, name)
                matrix.count = len(parts)
                for p, part in enumerate(parts):
                    if not isinstance(part, Part):
                        raise ValueError(f"layer {li} {name} part {p}: a Part, got {type(part).__name__}")
                    if part.inputs != inp:
                        raise ValueError(f"layer {li} {name} part {p}: w holds {part.inputs} inputs, expected {inp}")
                    matrix.parts[p] = _Part(*part._pointers, part.out, part.group, part.bits)
                    self._keep.append(part)
        # The C checks of every part (divisibility, widths) now, at load, not at the first step: a
        # call of no rows on a stand-in cache checks the layer table and computes nothing.
        self.rope_tables = 1 + max(int(layer.rope_table) for layer in self.layers)
        self.windowed = any(int(layer.window) > 0 for layer in self.layers)
        stand_in = np.zeros((len(self.layers), 2, 1, num_kv_heads, 1, head_dim), np.float32)
        empty = np.empty((self.rope_tables, 0, head_dim), np.float32)
        self(np.empty((0, self.hidden), np.float32), empty, empty, KvCaches(stand_in, num_kv_heads),
             np.empty((0, 4), np.int64), positions=np.empty(0, np.int64))

    def __len__(self) -> int:
        return len(self.layers)

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: Union[KvCaches, np.ndarray],
                 chunks: np.ndarray, visible: Optional[np.ndarray] = None,
                 positions: Optional[np.ndarray] = None, span: Optional[tuple[int, int]] = None) -> None:
        """Every layer on x float32 [rows, hidden] in place: cos and sin float32 [rows, D], or
        [rope tables, rows, D] where layers rotate by tables of their own; kv a `KvCaches` (build it
        once) or its [layers, 2, slots, KV, capacity, D] array; chunks and visible as `attend`'s, for
        every layer; positions int64 [rows], each row's position (needed where a layer has a window).
        `span` (start, stop): only layers start..stop-1 (the residual stream between them is what an
        EAGLE-3 head reads)."""
        lib = _lib()
        if not isinstance(kv, KvCaches):
            kv = KvCaches(kv, self.num_kv_heads)
        if kv.layers != len(self.layers) or kv.dim != self.head_dim or kv.num_kv_heads != self.num_kv_heads:
            raise ValueError(f"llama_layers: {len(self.layers)} layers of {self.num_kv_heads} KV heads of "
                             f"{self.head_dim} need as many KV caches of those, got {kv.layers} of "
                             f"{kv.num_kv_heads} x {kv.dim}")
        _array(x, np.float32, (None, self.hidden), "llama_layers: x", writeable=True)
        rows = x.shape[0]
        tables = (self.rope_tables, rows, self.head_dim) if cos.ndim == 3 or self.rope_tables > 1 else \
            (rows, self.head_dim)
        _array(cos, np.float32, tables, "llama_layers: cos")
        _array(sin, np.float32, tables, "llama_layers: sin")
        pos = 0
        if positions is not None:
            pos = _array(positions, np.int64, (rows,), "llama_layers: positions").ctypes.data
        elif self.windowed and rows:
            raise ValueError("llama_layers: a layer with a sliding window needs the rows' positions")
        ch, count, vis, width = _chunk_args(chunks, visible, rows, "llama_layers")
        start, stop = (0, len(self.layers)) if span is None else (int(span[0]), int(span[1]))
        if not 0 <= start <= stop <= len(self.layers):
            raise ValueError(f"llama_layers: layers {start}..{stop - 1} of {len(self.layers)}")
        kv_table = ctypes.addressof(kv.table) + start * ctypes.sizeof(_Kv)
        layer_table = ctypes.addressof(self.table) + start * ctypes.sizeof(_Layer)
        err = ctypes.create_string_buffer(_ERR_SIZE)
        _raise(lib.outrider_llama_layers(x.ctypes.data, rows, self.hidden, cos.ctypes.data, sin.ctypes.data,
                                         self.rope_tables, pos, kv_table, layer_table, stop - start, ch, count,
                                         vis, width, self.num_heads, self.num_kv_heads, self.head_dim, self.inter, self.eps, err, _ERR_SIZE),
               err)


def llama_layers(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: Union[KvCaches, np.ndarray],
                 layers: Union[LayerStack, Sequence[Layer]], chunks: np.ndarray, visible: Optional[np.ndarray] = None,
                 *, num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 eps: Optional[float] = None, positions: Optional[np.ndarray] = None) -> None:
    """Every decoder layer of a step on x in place (`LayerStack.__call__`). `layers` a `LayerStack`
    (built once: the fast way), or `Layer`s with num_heads, num_kv_heads and eps (a stack is built
    for this call; head_dim is kv's D)."""
    if not isinstance(layers, LayerStack):
        if num_heads is None or num_kv_heads is None or eps is None:
            raise ValueError("llama_layers: Layers need num_heads, num_kv_heads and eps (or pass a LayerStack)")
        dim = kv.dim if isinstance(kv, KvCaches) else kv_head_dim(np.asarray(kv))
        layers = LayerStack(layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=dim, eps=eps)
    elif any(given is not None and given != have for given, have in
             ((num_heads, layers.num_heads), (num_kv_heads, layers.num_kv_heads), (eps, layers.eps))):
        raise ValueError("llama_layers: num_heads, num_kv_heads and eps differ from the LayerStack's")
    layers(x, cos, sin, kv, chunks, visible, positions)


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
    err = ctypes.create_string_buffer(_ERR_SIZE)
    _raise(_lib().outrider_packed_shape(PACKED_TYPES[type_name], int(cols), int(five_bit), ctypes.byref(bits),
                                        ctypes.byref(group), ctypes.byref(tile_bytes), err, _ERR_SIZE), err)
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
        row_map = _array(np.ascontiguousarray(row_map, dtype=np.int64), np.int64, (rows_out,), "pack_gguf: row_map")
    w = np.empty(shape.w_shape(max(0, rows_out // TILE), cols), np.uint8)
    err = ctypes.create_string_buffer(_ERR_SIZE)
    _raise(_lib().outrider_pack_gguf(PACKED_TYPES[type_name], src.ctypes.data, src_rows, int(cols),
                                     _address(row_map), rows_out, int(five_bit), w.ctypes.data, err, _ERR_SIZE), err)
    return Part(w, None, None, shape.bits, shape.group)


def dequantize_super_rows(part: Part, ids: np.ndarray) -> np.ndarray:
    """fp32 [n, inputs]: rows `ids` of a super-block weight, as gguf-py dequantizes the file's blocks (or
    of a group-block weight: q d + m, as the separate tables' lookups compute)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= part.out):
        raise ValueError(f"row ids must be in 0 .. {part.out - 1}, got {int(ids.min())} .. {int(ids.max())}")
    out = np.empty((ids.size, part.inputs), np.float32)
    err = ctypes.create_string_buffer(_ERR_SIZE)
    _raise(_lib().outrider_dequantize_super_rows(part.w.ctypes.data, part.bits, part.inputs, ids.ctypes.data,
                                                 ids.size, out.ctypes.data, err, _ERR_SIZE), err)
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
    pack = _PACKERS.get(groups.bits)
    if pack is None:
        raise ValueError(f"affine groups of {groups.bits} bits: the kernels take 4, 5 or 8")
    return (pack(q), *per_tile(d, m, dtype=table_dtype(d, m)))
