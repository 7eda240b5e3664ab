"""Which int8 recipe runs here: the class of ONNX Runtime's int8 kernels on this CPU, the section's
fields with `by_cpu` applied for it, and which options go together (onnx.py's docstring says why
the recipe depends on the CPU)."""

from __future__ import annotations

import platform
from typing import Iterable, Optional

from outrider.errors import ManifestError
from outrider.hardware import cpu_flags

from .config import CpuClass, QuantizeConfig

_X86 = ("x86_64", "amd64", "i386", "i486", "i586", "i686", "x86")
_ARM = ("aarch64", "arm64", "armv8l", "armv8b")


def cpu_class(flags: Optional[Iterable[str]] = None, machine: Optional[str] = None) -> CpuClass:
    """The class of ONNX Runtime's int8 MatMul kernels on this CPU (or on the one described).

    vnni: x86 with AVX512-VNNI or AVX-VNNI, where MLAS's u8s8 kernels sum in 32 bits (vpdpbusd;
    AMX CPUs have AVX512-VNNI too); avx2: other x86 with AVX2, AVX-512 without VNNI included,
    whose u8s8 kernels add pairs of products in 16 bits and saturate (vpmaddubsw); arm: aarch64;
    other: x86 without AVX2 (SSE4.1 also uses the saturating pmaddubsw) or any other machine.
    Flags are the kernel's view of CPUID (outrider.hardware.cpu_flags), which also drops what the
    OS does not enable, as MLAS's own XGETBV check does.
    """
    arch = (machine if machine is not None else platform.machine()).lower()
    if arch in _ARM:
        return "arm"
    if arch not in _X86:
        return "other"
    have = frozenset(cpu_flags() if flags is None else flags)
    if "avx512_vnni" in have or "avx_vnni" in have:
        return "vnni"
    return "avx2" if "avx2" in have else "other"


def recipe_for(config: QuantizeConfig, cpu: CpuClass) -> QuantizeConfig:
    """The recipe that runs on `cpu`: the section's fields, then `by_cpu[cpu]`'s, `weights` resolved.

    `weights: auto` is int8 on VNNI CPUs and uint8 on the others: u8u8 sums are exact on every
    ONNX Runtime kernel (x86 widens to 16-bit products and sums in 32 bits, ARM uses udot), so it
    gives there what int8 gives on VNNI, where int8 would saturate (x86 without VNNI) or run a
    kernel this recipe was never measured on (ARM). `int7` keeps the faster u8s8 kernel on x86
    without VNNI at the cost of one bit of weight precision, so a manifest asks for it by name,
    with figures measured on that class.
    """
    data = config.model_dump()
    override = config.by_cpu.get(cpu)
    if override is not None:
        data.update(override.model_dump(exclude_unset=True))
    data["by_cpu"] = {}
    if data["weights"] == "auto":
        data["weights"] = "int8" if cpu == "vnni" else "uint8"
    return QuantizeConfig.model_validate(data)


def check_config(config: QuantizeConfig) -> None:
    """ManifestError for ONNX quantize options that cannot go together."""
    check_mode(config)
    if config.smooth_alpha is not None and config.method != "dynamic":
        raise ManifestError(f"field 'quantize.smooth_alpha': applies to method 'dynamic' only, got method "
                            f"{config.method!r}; remove it or use method: dynamic")
    if config.outlier_channels is not None:
        if config.method != "dynamic":
            raise ManifestError(f"field 'quantize.outlier_channels': applies to method 'dynamic' only, got "
                                f"method {config.method!r}; remove it or use method: dynamic")
        if not config.keep_sensitive:
            raise ManifestError("field 'quantize.outlier_channels': splits the sensitive MatMuls that "
                                "keep_sensitive holds back; it needs keep_sensitive: true")


def needs_calibration(config: QuantizeConfig) -> bool:
    """Whether the recipe reads calibration sentences (their number is then part of the cache key)."""
    return config.method == "static" or config.smooth_alpha is not None or config.outlier_channels is not None


def check_mode(config: QuantizeConfig) -> str:
    """The effective mode for ONNX ('auto' -> 'int8'); ManifestError for any other."""
    mode = "int8" if config.mode == "auto" else config.mode
    if mode != "int8":
        raise ManifestError(
            f"field 'quantize.mode': ONNX Runtime quantization supports int8 (or auto -> int8), got {config.mode!r}"
        )
    return mode
