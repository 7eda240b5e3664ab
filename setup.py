"""Builds outrider's native CPU kernels (plugins/outrider_llm/csrc) at install, never at first request.

Everything else about the package is in pyproject.toml. Two libraries come from the one torch-free
core (kernels.h: ops.cpp, dispatch.cpp, isa_*.cpp):

- `outrider_llm._native`, a torch extension (torch ops, so they also run inside TorchScript; with
  torch_ops.cpp and int4_mm.cpp), compiled against the torch already installed: install torch
  first, then outrider with `pip install --no-build-isolation` (the Makefile and both Dockerfiles
  do). Build isolation would install a torch of its own into the build environment, a several-GB
  CUDA build whose ABI need not match the one installed.
- `outrider_llm._native_c`, a plain shared library (with c_api.cpp: a C ABI, OpenMP threads; no
  torch headers, no torch libraries) that native_c.py loads with ctypes, so that a process serving
  a GGUF model need not import torch. It builds where torch is not importable too.

Every instruction-set variant (scalar, AVX2, AVX-VNNI, AVX-512 VNNI, NEON, NEON dotprod) goes into
each library, each file compiled for its own instruction set by a target pragma, and the best the
CPU runs is chosen at load (kernels.h). Where a build is impossible (no torch here for the first, no
C++ compiler), the install still succeeds and the other library is still built: the reason is
printed and kept in outrider_llm/_native_build.txt (the torch extension) or _native_c_build.txt
(the C library), the runtime logs it, and torch's kernels serve.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
PACKAGE = HERE / "plugins" / "outrider_llm"
CSRC = PACKAGE / "csrc"
REPORT = PACKAGE / "_native_build.txt"
C_REPORT = PACKAGE / "_native_c_build.txt"
# The torch-free core (kernels.h); torch_ops.cpp and int4_mm.cpp include torch's headers;
# check_kernels.cpp is the tests' driver; c_api.cpp is the C library's binding.
TORCH_ONLY = ("torch_ops.cpp", "int4_mm.cpp")
NOT_CORE = (*TORCH_ONLY, "check_kernels.cpp", "c_api.cpp")
CORE = [str(p.relative_to(HERE)) for p in CSRC.glob("*.cpp") if p.name not in NOT_CORE]
SOURCES = sorted(CORE + [str((CSRC / name).relative_to(HERE)) for name in TORCH_ONLY])
C_SOURCES = sorted(CORE + [str((CSRC / "c_api.cpp").relative_to(HERE))])
# -ffp-contract=off: no compiler may fuse a multiply and an add that the scalar reference keeps
# apart, or the instruction-set paths would stop agreeing bit for bit.
CFLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp", "-Wno-maybe-uninitialized"]
# Per library: its report file, its name in messages, its objects' folder under build/ (kept in the
# source tree, ignored: ninja recompiles only what changed when the editable install runs again).
LIBRARIES = {
    "outrider_llm._native": (REPORT, "native kernels", "native"),
    "outrider_llm._native_c": (C_REPORT, "native C kernels (ctypes)", "native_c"),
}


def _report(path: Path, text: str) -> None:
    print(f"outrider: {text}", file=sys.stderr)
    try:
        path.write_text(text + "\n")
    except OSError:
        pass


def _native() -> dict:
    if os.environ.get("OUTRIDER_BUILD_NATIVE", "1") == "0":
        for path, label, _ in LIBRARIES.values():
            _report(path, f"{label} not built: OUTRIDER_BUILD_NATIVE=0")
        return {}
    # A plain shared library that ctypes loads: no PyInit (setuptools passes the PyInit symbol as
    # an export only to the Windows linker), linked as C++ (libstdc++) with OpenMP's libgomp.
    # Hidden symbols but c_api.h's: `_native` holds the same core's, and this library's own calls
    # must never bind to that copy (as they could were either loaded RTLD_GLOBAL).
    extensions = [Extension("outrider_llm._native_c", C_SOURCES, include_dirs=[str(CSRC)],
                            extra_compile_args=[*CFLAGS, "-fvisibility=hidden"], extra_link_args=["-fopenmp"],
                            language="c++")]
    base: type = build_ext
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        _report(REPORT, "native kernels not built: torch is not importable in the build environment "
                f"({exc}); install torch first and outrider with pip install --no-build-isolation")
    else:
        base = BuildExtension  # ninja, incremental; it adds only defines to the C library's flags
        extensions.insert(0, CppExtension(
            "outrider_llm._native",
            SOURCES,
            include_dirs=[str(CSRC)],
            extra_compile_args=CFLAGS,
            extra_link_args=["-fopenmp"],  # resolves to torch's own libgomp.so.1 once torch is loaded: one thread pool
        ))

    class TolerantBuild(base):  # type: ignore[misc, valid-type]
        """A failed library leaves the other built and the package installable, its reason on record."""

        tried: set = set()
        failed: set = set()

        def build_extension(self, ext: Extension) -> None:
            report, label, temp = LIBRARIES[ext.name]
            saved = self.build_temp
            self.build_temp = str(HERE / "build" / temp)  # each its own objects: they share sources, not flags
            self.tried.add(ext.name)
            try:
                super().build_extension(ext)
            except Exception as exc:  # no compiler, a toolchain too old for an instruction set
                self.failed.add(ext.name)
                _report(report, f"{label} not built: {type(exc).__name__}: {str(exc)[-400:]}")
                return
            finally:
                self.build_temp = saved
            report.unlink(missing_ok=True)

        def build_extensions(self) -> None:
            super().build_extensions()
            # What follows (the in-place copy, the editable wheel's file mapping) looks for every
            # extension's file: only the built ones are left.
            self.extensions = [ext for ext in self.extensions if ext.name not in self.failed]

        def run(self) -> None:
            try:
                super().run()
            except Exception as exc:  # before or around the libraries' builds: any not tried fails with it
                for ext in self.extensions:
                    if ext.name not in self.tried:
                        report, label, _ = LIBRARIES[ext.name]
                        _report(report, f"{label} not built: {type(exc).__name__}: {str(exc)[-400:]}")

    return {"ext_modules": extensions, "cmdclass": {"build_ext": TolerantBuild}}


setup(**_native())
