"""Which kernel runs a process's quantized weights (`choose_kernel`, measured once per process), and
the key of that choice in a quantized artifact's cache (`kernel_key`). The kernels are linear.py's.

Both of torch's quantized kernels (`Int8Linear`, `Int4Linear`) read 1/4 (int8) or 1/8 (int4) of the
fp32 bytes, which is what a decode step is bound by, but they are GEMV-shaped: their cost grows
~linearly with rows, while bf16 on AMX barely grows from 1 to 32 rows. Measured on the Xeon (AMX)
machine, 2 threads, microseconds, fp32 / bf16 / int8 / int4: 576->3072 at 1 row 170 / 84 / 74 / 68,
at 16 rows 334 / 101 / 582 / 519; the LM head 576->49152 at 1 row 3227 / 1575 / 1869 / 1063, at 16
rows 5972 / 1478 / 9657 / 6944. So a quantized kernel may carry a second, dense bf16 copy that
serves calls of many rows (draft verification, prefill): 4x cheaper verification there, for +2 bytes
per weight (SmolLM2: +270 MB). "auto" leaves it out; "auto+bf16" keeps it where native bf16 wins
early; "int4pack+bf16" asks for it outright. Measured end to end (SmolLM2 int4, speculation with
n-gram + draft head, HumanEval, Xeon with AMX, 2 threads), small draft trees on the packed kernel
alone beat big trees on the copy: 3 draft tokens, int4pack: 98 tokens/s; 16 draft tokens,
int4pack+bf16: 70 tokens/s.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from outrider.generation.weights import pack_int4

from .linear import (DEFAULT_DENSE_FROM_ROWS, Int4Linear, Int8Linear, cpu_has_native_bf16, dense_linear,
                     onednn_usable)
from .quantized_weights import QuantTensor

log = logging.getLogger("outrider.llm")

# The packed kernel is chosen unless a dense one measured more than this much faster: real
# failures are large (fp32 activations: 7-20x), while a busy shared 2-core machine skews a
# few-ms benchmark by tens of percent either way.
PACKED_TIE_MARGIN = 2.0
KERNELS = ("auto", "auto+bf16", "int4pack", "int8pack", "dense", "int4pack+bf16", "int8pack+bf16", "int4native", "w4a8")
# "auto+bf16" keeps a dense bf16 copy only where it wins from this many rows or fewer: a draft
# tree's verification feeds 2-17 rows per sequence.
MULTIROW_COPY_MAX_ROWS = 8


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
    if native_bf16 and onednn_usable(torch.bfloat16):
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
    if not (cpu_has_native_bf16() and onednn_usable(torch.bfloat16)):
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


