"""Builds outrider's native CPU kernels (plugins/outrider_llm/csrc) at install, never at first request.

Everything else about the package is in pyproject.toml. The kernels are a torch extension (torch
ops, so they also run inside TorchScript), compiled against the torch already installed: install
torch first, then outrider with `pip install --no-build-isolation` (the Makefile and both
Dockerfiles do). Build isolation would install a torch of its own into the build environment, a
several-GB CUDA build whose ABI need not match the one installed. Every instruction-set variant
(scalar, AVX2, AVX-VNNI, AVX-512 VNNI, NEON, NEON dotprod) goes into the one library, each file
compiled for its own instruction set by a target pragma, and the best the CPU runs is chosen at
load (kernels.h). Where the build is impossible (no torch here, no C++ compiler), the install
still succeeds: the reason is printed and kept in outrider_llm/_native_build.txt, the runtime logs
it, and torch's kernels serve.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent
PACKAGE = HERE / "plugins" / "outrider_llm"
CSRC = PACKAGE / "csrc"
REPORT = PACKAGE / "_native_build.txt"
# The torch-free core (kernels.h) and its torch binding; check_kernels.cpp is the tests' driver.
SOURCES = sorted(str(p.relative_to(HERE)) for p in CSRC.glob("*.cpp") if p.name != "check_kernels.cpp")
# -ffp-contract=off: no compiler may fuse a multiply and an add that the scalar reference keeps
# apart, or the instruction-set paths would stop agreeing bit for bit.
CFLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp", "-Wno-maybe-uninitialized"]


def _report(text: str) -> None:
    print(f"outrider: {text}", file=sys.stderr)
    try:
        REPORT.write_text(text + "\n")
    except OSError:
        pass


def _native() -> dict:
    if os.environ.get("OUTRIDER_BUILD_NATIVE", "1") == "0":
        _report("native kernels not built: OUTRIDER_BUILD_NATIVE=0")
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        _report("native kernels not built: torch is not importable in the build environment "
                f"({exc}); install torch first and outrider with pip install --no-build-isolation")
        return {}

    class TolerantBuild(BuildExtension):
        """A failed compile leaves the package installable, with the reason on record."""

        def finalize_options(self) -> None:
            super().finalize_options()
            # Objects kept in the source tree's build/ (ignored): ninja recompiles only what changed
            # when the editable install runs again (make install-dev after make install).
            self.build_temp = str(HERE / "build" / "native")

        def run(self) -> None:
            try:
                super().run()
            except Exception as exc:  # no compiler, a toolchain too old for an instruction set
                _report(f"native kernels not built: {type(exc).__name__}: {str(exc)[-400:]}")
                return
            REPORT.unlink(missing_ok=True)

    extension = CppExtension(
        "outrider_llm._native",
        SOURCES,
        include_dirs=[str(CSRC)],
        extra_compile_args=CFLAGS,
        extra_link_args=["-fopenmp"],  # resolves to torch's own libgomp.so.1 once torch is loaded: one thread pool
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": TolerantBuild}}


setup(**_native())
