"""Outrider's native CPU kernels without torch: `outrider_llm._native_c` (csrc/c_api.h, built at
install beside the torch extension) loaded with ctypes, on numpy arrays. This module is the binding:
loading the library, its C structs and signatures, the layouts' constants and `bits` codes
(`bits_flags`), and the checks of every argument before it reaches C.

The same core as native.py's torch ops (csrc/kernels.h), so the same results bit for bit; what a
process gains is not importing torch (~260 MB, seconds) to serve a GGUF model. Nothing here imports
torch, and neither does `import outrider_llm`. What computes with it:

- native_c_weights.py: a weight in the kernels' layouts (`Part`, `a8_matmul`), the numpy packers,
  and GGUF blocks packed as the file holds them.
- native_c_layers.py: `rms_norm`, `swiglu`, `add`, `attend` (the pieces of a layer), and
  `llama_layers` / `LayerStack`: every decoder layer of a step in one call.

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
from pathlib import Path
from typing import Any, Optional, Sequence

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
ERR_SIZE = 512


# ---- the C structs (csrc/c_api.h), field for field -----------------------------------------------

class OutriderPart(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("out", ctypes.c_int64),
                ("group", ctypes.c_int64), ("bits", ctypes.c_int32)]


class OutriderMatrix(ctypes.Structure):
    _fields_ = [("parts", OutriderPart * 3), ("count", ctypes.c_int32)]


class OutriderLayer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qkv", OutriderMatrix),
                ("o", OutriderMatrix), ("gate_up", OutriderMatrix), ("down", OutriderMatrix),
                ("qkv_bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("q_scale", ctypes.c_float), ("activation", ctypes.c_int32),
                ("attn_post_norm", ctypes.c_void_p), ("mlp_post_norm", ctypes.c_void_p), ("rope_table", ctypes.c_int64),
                ("window", ctypes.c_int64), ("attn_softcap", ctypes.c_float)]


class OutriderKv(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("slots", ctypes.c_int64), ("capacity", ctypes.c_int64),
                ("s_half", ctypes.c_int64), ("s_slot", ctypes.c_int64), ("s_head", ctypes.c_int64),
                ("f16", ctypes.c_int64), ("ring", ctypes.c_int64), ("q8", ctypes.c_int64)]


_STRUCTS = {"OutriderPart": OutriderPart, "OutriderMatrix": OutriderMatrix, "OutriderLayer": OutriderLayer,
            "OutriderKv": OutriderKv}

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
        lib = open_library(path)
    except (OSError, AttributeError) as exc:  # a missing libgomp, a library older than this file
        return False, f"{path.name} does not load: {exc}"
    for name, struct in _STRUCTS.items():
        size = lib.outrider_struct_size(name.encode())
        if size != ctypes.sizeof(struct):
            return False, f"{path.name}: {name} is {size} bytes there, {ctypes.sizeof(struct)} in native_c.py"
    _C = lib
    return True, serving_report(kernels(), kernel_sets)


def open_library(path: Path) -> ctypes.CDLL:
    """The C library at `path` with every signature this file declares (OSError where it does not
    load, AttributeError where it lacks a function). The runtime opens only its own build; a
    benchmark opens another build beside it to compare the two in one process."""
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


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


def loaded_library() -> ctypes.CDLL:
    """The loaded library (loading it once); RuntimeError naming why where it does not load."""
    if _C is None:
        loaded, why = library()
        if not loaded:
            raise RuntimeError(f"outrider's native C kernels are not loaded: {why}")
    assert _C is not None
    return _C


def kernels() -> str:
    """The kernel set every call uses now ("avx2", "avx512_vnni", "neon_dotprod", ...)."""
    return loaded_library().outrider_kernels().decode()


def kernel_sets() -> list[str]:
    """Every kernel set this CPU runs, best first; "scalar" (the reference) is always last."""
    lib = loaded_library()
    return [lib.outrider_kernel_set_name(i).decode() for i in range(lib.outrider_kernel_set_count())
            if lib.outrider_cpu_runs(i)]


def select(name: str) -> None:
    """Use kernel set `name` for every call of this library in this process (tests and benchmarks)."""
    if not loaded_library().outrider_select(name.encode()):
        raise ValueError(f"kernel set {name!r} does not run on this CPU (it runs: {', '.join(kernel_sets())})")


def cpu_features() -> str:
    """The CPU features the dispatcher read (cpuid on x86, HWCAP on ARM)."""
    return loaded_library().outrider_cpu_features().decode()


def set_threads(threads: int) -> None:
    """The threads of every parallel part of every call, from any thread (one count per process);
    0 or less: the default, the CPUs this process may use."""
    loaded_library().outrider_set_threads(int(threads))


def threads() -> int:
    """The thread count calls use now."""
    return int(loaded_library().outrider_threads())


# ---- checks ----------------------------------------------------------------------------------------

def address(a: Optional[np.ndarray]) -> Optional[int]:
    """The data pointer of `a` for a C call (None: NULL)."""
    return None if a is None else a.ctypes.data


def checked_array(a: Any, dtype: Any, shape: Sequence[Optional[int]], what: str,
                  writeable: bool = False) -> np.ndarray:
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


def raise_error(code: int, err: Any) -> None:
    """ValueError with the C call's message in `err` (a buffer of ERR_SIZE) where `code` is not 0."""
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


def check_weight(w: Any, d: Any, m: Any, bits: int, group: int, what: str) -> int:
    """The weight's arrays against its bits code; returns its inputs."""
    if isinstance(bits, (int, np.integer)) and bits & GROUP_BLOCKS:
        layout = bits & 15
        if bits & ~(GROUP_BLOCKS | 15 | (15 << OFFSET_SHIFT)) or layout not in GROUP_VALUES:
            raise ValueError(f"{what}: bits {bits:#x}: a group-block layout is GROUP_BLOCKS | 4, 5 or 8 "
                             "(| log2(offset) << 8)")
        size = group_block_bytes(bits)
        checked_array(w, np.uint8, (None, None, size), f"{what}: w (group-block layout [out/16, in/32, {size}])")
        if d is not None or m is not None or group != 32:
            raise ValueError(f"{what}: a group-block weight is w alone (d, m None) in groups of 32")
        return w.shape[1] * 32
    if isinstance(bits, (int, np.integer)) and bits & SUPER_BLOCKS:
        layout = bits & 15
        if bits != SUPER_BLOCKS | layout or layout not in SUPER_LAYOUTS:
            raise ValueError(f"{what}: bits {bits:#x}: a super-block layout is SUPER_BLOCKS | 4, 5 or 6")
        checked_array(w, np.uint8, (None, None, SUPER_LAYOUTS[layout]), f"{what}: w (super-block layout {layout} "
                      f"[out/16, in/256, {SUPER_LAYOUTS[layout]}])")
        if d is not None or m is not None or group != SUPER:
            raise ValueError(f"{what}: a super-block weight is w alone (d, m None) in groups of {SUPER}")
        return w.shape[1] * SUPER
    layout, dtype, offset = _split_bits(bits, what)
    per_block, block_bytes = LAYOUTS[layout]
    checked_array(w, np.uint8, (None, None, block_bytes), f"{what}: w ({layout}-bit layout [out/16, in/{per_block}, "
                  f"{block_bytes}])")
    tiles, inp = w.shape[0], w.shape[1] * per_block
    if not isinstance(group, (int, np.integer)) or group <= 0 or inp % group:
        raise ValueError(f"{what}: group must be a positive divisor of the {inp} inputs, got {group}")
    flag = "| F32_TABLES" if dtype == np.float32 else "without F32_TABLES"
    checked_array(d, dtype, (tiles, inp // group, TILE), f"{what}: d (bits {bits:#x}: {flag})")
    if offset:
        if m is not None:
            raise ValueError(f"{what}: bits {bits:#x} carries offset {offset} (a symmetric type): m must be None")
    else:
        checked_array(m, dtype, (tiles, inp // group, TILE), f"{what}: m (bits {bits:#x}: {flag}, no offset)")
    return inp
