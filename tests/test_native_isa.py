"""The native kernel sets (plugins/outrider_llm/csrc/kernels.h) on every CPU class.

The scalar code defines every result; each SIMD path (AVX2, AVX-VNNI, AVX-512 VNNI, NEON, NEON
dotprod) must equal it bit for bit. check_kernels.cpp drives the torch-free core: natively for the
x86 paths this CPU has, under qemu-x86_64 with a Haswell CPUID (AVX2 only: what the dispatcher
picks there), and cross-compiled for ARM under qemu-aarch64 (`cross`: needs g++-aarch64-linux-gnu
and qemu-user-static, which `make test` installs where it can). Then the same through torch: one
model, bit-identical logits on every kernel set this CPU runs, and tree rows equal to one-token
steps on each.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "plugins" / "outrider_llm" / "csrc"
CORE = ["check_kernels.cpp", "ops.cpp", "layers.cpp", "dispatch.cpp"] + sorted(p.name for p in CSRC.glob("isa_*.cpp"))
FLAGS = ["-O2", "-std=c++17", "-ffp-contract=off", "-Wno-maybe-uninitialized"]
IS_X86 = platform.machine() in ("x86_64", "AMD64")


def _build(compiler: str, out: Path, static: bool = False) -> Path:
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not installed")
    cmd = [compiler, *FLAGS, *(["-static"] if static else []), "-o", str(out), *(str(CSRC / f) for f in CORE)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=240)
    return out


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return done.stdout


def _checked(output: str) -> set[str]:
    """The kernel sets a check_kernels run compared with the scalar reference (all of them equal)."""
    assert output.rstrip().splitlines()[-1].endswith(" 0 failed"), output[-3000:]
    return {line.split()[1] for line in output.splitlines() if line.startswith("check ")}


@pytest.fixture(scope="module")
def x86_check(tmp_path_factory) -> Path:
    if not IS_X86:
        pytest.skip("not an x86-64 machine")
    return _build(os.environ.get("CXX", "g++"), tmp_path_factory.mktemp("native") / "check_kernels")


def test_every_x86_kernel_set_this_cpu_runs_equals_the_scalar_reference(x86_check: Path) -> None:
    output = _run([str(x86_check)])
    checked = _checked(output)
    assert "avx2" in checked or "skip avx2" in output
    active = _run([str(x86_check), "--active"]).splitlines()[0]
    assert active in checked | {"scalar"}


def test_an_avx2_only_cpu_gets_the_avx2_kernels_and_they_equal_the_reference(x86_check: Path) -> None:
    """qemu-user reports a Haswell's CPUID (AVX2, FMA, F16C; no AVX-512, no VNNI): the dispatcher
    reads it with cpuid and xgetbv and picks "avx2"; a CPU without AVX gets the scalar set."""
    if shutil.which("qemu-x86_64-static") is None:
        pytest.skip("qemu-user-static is not installed")
    haswell = ["qemu-x86_64-static", "-cpu", "Haswell"]
    assert _run(haswell + [str(x86_check), "--active"]).splitlines()[0] == "avx2"
    assert _checked(_run(haswell + [str(x86_check)])) == {"avx2"}
    assert _run(["qemu-x86_64-static", "-cpu", "Nehalem", str(x86_check), "--active"]).splitlines()[0] == "scalar"


@pytest.mark.cross
def test_neon_kernels_equal_the_scalar_reference_under_qemu(tmp_path: Path) -> None:
    """Cross-compiled for AArch64 and run under qemu-user: "-cpu max" has the dot product and int8
    matrix multiply extensions (all three NEON sets are checked), a Cortex-A76 (the Raspberry Pi 5)
    the dot product only, a Cortex-A72 (the Raspberry Pi 4) neither (plain NEON serves)."""
    if shutil.which("qemu-aarch64-static") is None:
        pytest.skip("qemu-user-static is not installed")
    binary = _build("aarch64-linux-gnu-g++", tmp_path / "check_kernels_arm", static=True)
    assert _checked(_run(["qemu-aarch64-static", "-cpu", "max", str(binary)])) == {"neon", "neon_dotprod", "neon_i8mm"}
    assert _run(["qemu-aarch64-static", "-cpu", "max", str(binary), "--active"]).splitlines()[0] == "neon_i8mm"
    assert _checked(_run(["qemu-aarch64-static", "-cpu", "cortex-a76", str(binary)])) == {"neon", "neon_dotprod"}
    assert _run(["qemu-aarch64-static", "-cpu", "cortex-a76", str(binary), "--active"]).splitlines()[0] == "neon_dotprod"
    assert _checked(_run(["qemu-aarch64-static", "-cpu", "cortex-a72", str(binary)])) == {"neon"}
    assert _run(["qemu-aarch64-static", "-cpu", "cortex-a72", str(binary), "--active"]).splitlines()[0] == "neon"


# ---- through torch ---------------------------------------------------------------------------

KERNEL_SETS = ["scalar", "avx2", "avx_vnni", "avx512_vnni", "neon", "neon_dotprod", "neon_i8mm"]


@pytest.fixture
def native():
    pytest.importorskip("torch")  # (imported here: the checks above need no torch)
    from outrider_llm import native

    loaded, why = native.library()
    if not loaded:
        pytest.skip(f"native kernels unavailable: {why}")
    best = native.kernel_sets()[0]
    yield native
    native.select(best)


def _tiny_w4a8():
    import torch
    from outrider_llm.loading import random_llama_weights, tiny_llama_config
    from outrider_llm.model import LlamaModel
    from outrider_quantize.llm import quantize_state_dict

    config = tiny_llama_config(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)  # head_dim 16
    weights = random_llama_weights(config, seed=3)
    model = LlamaModel(config, quantize_state_dict(weights, "int4", head_mode="float"), kernel="w4a8")
    assert model.kernel_plans["int4"].kernel == "w4a8" and model.native_attention
    return torch, model


def test_every_kernel_set_gives_a_model_the_same_logits(native) -> None:
    """Prefill, decode and a draft tree through the fused layer stack and the int8 head: the logits,
    hidden states and KV cache are the same bits whichever kernel set computes them."""
    from outrider.generation.contract import Chunk

    torch, model = _tiny_w4a8()
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    steps = [
        [Chunk(0, torch.tensor([5, 17, 3, 60, 22, 9, 41, 8, 12, 33]), torch.arange(10)),
         Chunk(1, torch.tensor([4, 4, 7]), torch.arange(3))],
        [Chunk(0, torch.tensor([7, 8, 9, 10]), torch.tensor([10, 11, 11, 12]), tree),
         Chunk(1, torch.tensor([2]), torch.tensor([3]))],
    ]
    results = {}
    for name in native.kernel_sets():
        native.select(name)
        cache = model.new_cache(2, 32)
        outs = []
        for chunks in steps:
            out = model.forward(cache, chunks)
            outs.append((out.logits.clone(), out.hidden.clone()))
            cache.commit(0, [0])
            cache.commit(1, [0])
        results[name] = (outs, cache.kv.clone())
    reference_outs, reference_kv = results.pop("scalar")
    for name, (outs, kv) in results.items():
        for (logits, hidden), (ref_logits, ref_hidden) in zip(outs, reference_outs):
            assert torch.equal(logits, ref_logits), name
            assert torch.equal(hidden, ref_hidden), name
        assert torch.equal(kv, reference_kv), name


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
def test_tree_rows_get_the_one_token_logits_on_every_kernel_set(native, kernel_set: str) -> None:
    """On each path, verifying a draft tree computes for each node exactly the logits of a
    one-token step after the same prefix, alone or beside another sequence: speculative greedy
    output is the plain greedy output there, near-ties included."""
    from outrider.generation.contract import Chunk

    if kernel_set not in native.kernel_sets():
        pytest.skip(f"this CPU does not run {kernel_set} (it runs {', '.join(native.kernel_sets())})")
    native.select(kernel_set)
    torch, model = _tiny_w4a8()
    prompt = torch.tensor([5, 17, 3, 60, 22, 9, 41, 8, 12, 33])
    cache = model.new_cache(3, 64)
    for slot in (0, 1, 2):
        model.forward(cache, [Chunk(slot, prompt, torch.arange(10))])
        cache.commit(slot, list(range(10)))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    verified = model.forward(cache, [Chunk(0, torch.tensor([7, 8, 9, 10]), torch.tensor([10, 11, 11, 12]), tree)])
    for slot, path in ((1, [(7, 0), (8, 1), (10, 3)]), (2, [(7, 0), (9, 2)])):
        for step, (token, row) in enumerate(path):
            chunks = [Chunk(slot, torch.tensor([token]), torch.tensor([10 + step]))]
            if slot == 2:
                chunks.insert(0, Chunk(1, torch.tensor([4]), torch.tensor([13 + step])))
            out = model.forward(cache, chunks)
            assert torch.equal(out.logits[-1], verified.logits[row]), (kernel_set, path, step)
            for chunk in chunks:
                cache.commit(chunk.slot, [0])


def test_selecting_a_kernel_set_this_cpu_lacks_is_refused(native) -> None:
    with pytest.raises(ValueError, match="does not run on this CPU"):
        native.select("no_such_isa")
    assert native.kernel_sets()[-1] == "scalar"
    assert native.kernels() in native.kernel_sets()


def test_the_quantized_cache_key_names_what_computes_the_model(native, monkeypatch) -> None:
    """The quantizer's cache key carries the kernel that computes the model here: the same for
    every native kernel set (same bits), another one where torch's kernels stand in."""
    import torch
    from outrider_llm import kernel_choice

    assert kernel_choice.kernel_key("int4", "w4a8") == "w4a8:native"
    monkeypatch.setattr(native, "w4a8_kernel", lambda: (False, "not built at install"))
    monkeypatch.setattr(kernel_choice, "_PLANS", {})
    fallback = kernel_choice.kernel_key("int4", "w4a8")
    assert fallback != "w4a8:native" and fallback.endswith(torch.backends.cpu.get_cpu_capability())
