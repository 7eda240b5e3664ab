"""The native int4 kernel (csrc/int4_mm.cpp): built on first use, loaded as the torch op `outrider::int4_mm`.

torch's CPU int4 kernel costs about linearly in rows, which makes a speculative verify step of
4-8 rows 1.5-3x the cost of a 1-row decode step; this one runs the products on AMX (on
AVX512-BF16 without it) and there costs little more for 16 rows than for 1 (see the .cpp). The
llm backend uses it when a manifest asks for `quantize.kernel: int4native` (docs/ACCELERATORS.md
says when that pays). It is built with torch's own extension
builder (`torch.utils.cpp_extension.load`: a C++ compiler and ninja) into torch's extension cache,
once per machine and source (seconds; a cached load is quicker). Where it
cannot be built or run (no compiler, no AVX512-BF16, OUTRIDER_NATIVE_INT4=0), `int4_kernel()`
says why and the model uses torch's kernel.

Being a registered torch op, it runs inside the TorchScript layer stack like any aten op.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch

from outrider.hardware import cpu_flags

SOURCE = Path(__file__).with_name("csrc") / "int4_mm.cpp"
TILE = 16  # outputs per tile (one fp32 zmm)
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def int4_kernel() -> tuple[bool, str]:
    """(usable, reason): whether `outrider::int4_mm` is loaded and runs on this CPU, and why not."""
    with _LOCK:
        if "usable" not in _STATE:
            _STATE["usable"], _STATE["reason"] = _load()
        return bool(_STATE["usable"]), str(_STATE["reason"])


def _load() -> tuple[bool, str]:
    if os.environ.get("OUTRIDER_NATIVE_INT4", "1") == "0":
        return False, "OUTRIDER_NATIVE_INT4=0"
    missing = [f for f in REQUIRED_FLAGS if f not in cpu_flags()]
    if missing:
        return False, f"the CPU lacks {', '.join(missing)}"
    if hasattr(torch.ops.outrider, "int4_mm"):
        return True, "loaded; " + _path()
    try:
        from torch.utils import cpp_extension

        # Source hash in the name: a changed kernel never loads a stale build.
        digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
        cpp_extension.load(
            name=f"outrider_int4_{digest}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],  # torch's own libgomp.so.1 is already loaded: one thread pool
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a toolchain too old for AVX512-BF16 intrinsics
        return False, f"could not build the native kernel: {type(exc).__name__}: {str(exc)[-300:]}"
    return True, "built; " + _path()


def _path() -> str:
    return "AMX" if torch.ops.outrider.int4_mm_has_amx() else "AVX512-BF16"


def pack_int4_tiles(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       torch.Tensor]:
    """The kernel's layout for int4 weights in outrider's format (w = (q - 8) * scale + zero).

    q: uint8 [out, in] values 0..15 (unpacked); scale, zero: [out, in / group]. Returns
    (w uint8 [out/16, in/4, 32], d fp16 [out/16, groups, 16], m fp16 [out/16, groups, 16]) with
    w = q * d + m, so m = zero - 8 * scale. For weights from GGUF Q4_1 blocks (fp16 d and m) both
    are exact in fp16: the kernel multiplies with the file's own weights.
    """
    out, inp = q.shape
    if out % TILE or inp % 4:
        raise ValueError(f"int4 tiles need out % {TILE} == 0 and in % 4 == 0, got {tuple(q.shape)}")
    groups = scale.shape[1]
    tiles = q.to(torch.uint8).view(out // TILE, TILE, inp // 4, 2, 2)  # [t, i, quad, half, p]: k = 4j + 2h + p
    low, high = tiles[:, :, :, 0, :], tiles[:, :, :, 1, :]  # [t, i, quad, p]
    packed = (low | (high << 4)).permute(0, 2, 1, 3).contiguous()  # [t, quad, i, p]: byte 2i + p
    d = scale.float()
    m = zero.float() - 8 * d

    def per_tile(values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.float16).view(out // TILE, TILE, groups).transpose(1, 2).contiguous()

    return packed.view(out // TILE, inp // 4, 32), per_tile(d), per_tile(m)


def dequantize_tiles(w: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] weight that `pack_int4_tiles` output stands for (the tests' reference)."""
    tiles, quads, _ = w.shape
    groups = d.shape[1]
    b = w.view(tiles, quads, TILE, 2)
    q = torch.stack([b & 15, b >> 4], dim=3)  # [t, quad, i, half, p]
    q = q.permute(0, 2, 1, 3, 4).reshape(tiles * TILE, quads * 4).float()
    group = quads * 4 // groups
    scale = d.float().transpose(1, 2).reshape(tiles * TILE, groups).repeat_interleave(group, dim=1)
    minimum = m.float().transpose(1, 2).reshape(tiles * TILE, groups).repeat_interleave(group, dim=1)
    return q * scale + minimum


def int4_mm(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group_size: int,
            path: int = -1) -> torch.Tensor:
    """fp32 [rows, out] = bf16 x [rows, in] @ W.T (W as `pack_int4_tiles` gives it); `path` forces
    the AVX512-BF16 (0) or AMX (1) path, -1 lets the kernel choose."""
    return torch.ops.outrider.int4_mm(x, w, d, m, group_size, path)
