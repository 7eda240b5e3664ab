"""The torch-free C library of the native kernels (plugins/outrider_llm/csrc/c_api.cpp, loaded with
ctypes by plugins/outrider_llm/native_c.py): the same bits as the torch ops on the same core, its
numpy packers the same bytes as native.py's torch ones, the generalized layer stack equal to
w4a8_layers in the plain case and to its own pieces in the mixed (Qwen-shaped) one, errors for what
does not fit, and no torch in a process that only uses it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from outrider_llm import native_c as nc
from outrider_llm import native_c_layers as ncl
from outrider_llm import native_c_weights as ncw

ROOT = Path(__file__).resolve().parent.parent
EPS = 1e-5


@pytest.fixture(scope="module")
def lib():
    loaded, why = nc.library()
    if not loaded:
        pytest.skip(f"native C kernels unavailable: {why}")
    best = nc.kernel_sets()[0]
    yield nc
    nc.select(best)
    nc.set_threads(0)


@pytest.fixture(scope="module")
def torch_native(lib):
    torch = pytest.importorskip("torch")
    from outrider_llm import native

    loaded, why = native.library()
    if not loaded:
        pytest.skip(f"native torch kernels unavailable: {why}")
    return torch, native


# ---- random weights in the kernels' layouts ------------------------------------------------------

def _tables(rng, out: int, groups: int, bits: int, f32: bool, offset: int):
    """(d, m) float32 [out, groups]: exact in fp16 unless `f32`; m = -offset d for a symmetric type."""
    d = rng.uniform(2e-3, 3e-2, (out, groups)).astype(np.float32)
    m = -d * rng.uniform(0, 1 << bits, (out, groups)).astype(np.float32)
    if not f32:
        d, m = d.astype(np.float16).astype(np.float32), m.astype(np.float16).astype(np.float32)
    if offset:
        m = d * np.float32(-offset)
    return d, m


def _weight(rng, out: int, inp: int, group: int, bits: int, f32: bool = False, offset: int = 0):
    """(Part, q, d, m, dequantized float32 [out, inp])."""
    q = rng.integers(0, 1 << bits, (out, inp)).astype(np.uint8)
    d, m = _tables(rng, out, inp // group, bits, f32, offset)
    dtype = np.float32 if f32 else np.float16
    w = {4: ncw.nibble_tiles, 5: ncw.pack_w5, 8: ncw.byte_tiles}[bits](q)
    dt, mt = ncw.per_tile(d, m, dtype=dtype)
    part = ncw.Part(w, dt, None if offset else mt, nc.bits_flags(bits, dtype, offset), group)
    dense = (q.reshape(out, -1, group) * d[..., None] + m[..., None]).reshape(out, inp)
    return part, q, d, m, dense


def _torch_mm(torch, part: ncw.Part, x: np.ndarray):
    """The torch op's result for the same weight (w4a8_mm / w5a8_mm / w8a8_mm)."""
    bits, offset = part.bits & 15, 1 << (part.bits >> 8) if part.bits >> 8 else 0
    t = [torch.from_numpy(a) for a in (x, part.w, part.d)]
    m = torch.empty(0) if part.m is None else torch.from_numpy(part.m)
    if bits == 4:
        assert offset == 0  # the torch w4a8 op takes tables only
        return torch.ops.outrider.w4a8_mm(t[0], t[1], t[2], m, part.group).numpy()
    op = torch.ops.outrider.w5a8_mm if bits == 5 else torch.ops.outrider.w8a8_mm
    return op(t[0], t[1], t[2], m, part.group, offset).numpy()


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# ---- matmul ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,f32,offset", [(4, False, 0), (4, True, 0), (5, False, 0), (5, True, 0),
                                             (5, False, 16), (8, False, 0), (8, True, 0), (8, False, 128),
                                             (8, True, 128)])
def test_a8_matmul_equals_the_torch_op_on_every_kernel_set(lib, torch_native, bits, f32, offset) -> None:
    torch, native = torch_native
    rng = np.random.default_rng(bits * 100 + f32 * 10 + offset)
    part, *_ = _weight(rng, 48, 128, 32, bits, f32, offset)
    for rows in (1, 3, 9):
        x = rng.standard_normal((rows, 128)).astype(np.float32)
        want = _torch_mm(torch, part, x)
        for name in lib.kernel_sets():
            lib.select(name)
            assert _same(ncw.a8_matmul(x, part.w, part.d, part.m, part.bits, part.group), want), (name, rows)
    lib.select(lib.kernel_sets()[0])


def test_a8_matmul_writes_a_column_slice_of_a_wider_output(lib) -> None:
    rng = np.random.default_rng(1)
    part, *_ = _weight(rng, 32, 64, 32, 4)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    wide = np.full((5, 96), 7.0, np.float32)
    got = ncw.a8_matmul(x, part.w, part.d, part.m, part.bits, part.group, out=32, y=wide[:, 48:80])
    assert got.base is wide or got.base is wide.base
    assert _same(wide[:, 48:80].copy(), ncw.a8_matmul(x, part.w, part.d, part.m, part.bits, part.group))
    assert (wide[:, :48] == 7).all() and (wide[:, 80:] == 7).all()


def test_a_parts_matmul_is_a8_matmul_and_a_bad_part_is_refused_at_construction(lib) -> None:
    rng = np.random.default_rng(17)
    part, *_ = _weight(rng, 32, 64, 32, 5, True, 16)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    assert _same(part.matmul(x), ncw.a8_matmul(x, part.w, part.d, part.m, part.bits, part.group))
    with pytest.raises(ValueError, match=r"Part: d \(bits 0x415: \| F32_TABLES\) must be float32"):
        ncw.Part(part.w, part.d.astype(np.float16), None, part.bits, part.group)
    with pytest.raises(ValueError, match="Part: w .* must be uint8"):
        ncw.Part(part.w.astype(np.int8), part.d, None, part.bits, part.group)


def test_a4_with_an_offset_equals_its_table_and_the_float_weights_within_the_int8_error(lib) -> None:
    """Q4_0's symmetric form (offset 8, no m table; the torch op takes tables only) gives the bits of
    the table -8 d, and the float product within the bound int8 activations allow: per row and group
    each activation is off by at most half its scale (amax / 127)."""
    rng = np.random.default_rng(2)
    part, q, d, m, dense = _weight(rng, 64, 256, 64, 4, offset=8)
    table = ncw.per_tile(m, dtype=np.float16)[0]
    x = rng.standard_normal((4, 256)).astype(np.float32)
    got = ncw.a8_matmul(x, part.w, part.d, None, part.bits, part.group)
    assert _same(got, ncw.a8_matmul(x, part.w, part.d, table, nc.bits_flags(4), part.group))
    want = x.astype(np.float64) @ dense.T.astype(np.float64)
    amax = np.abs(x.reshape(4, -1, 64)).max(axis=2)  # [rows, groups]
    half_step = np.repeat(amax / 127 / 2, 64, axis=1)  # [rows, in]
    bound = half_step @ np.abs(dense.T.astype(np.float64)) * 1.01 + 1e-4
    assert (np.abs(got - want) <= bound).all()


def test_threads_change_nothing_in_the_result(lib) -> None:
    rng = np.random.default_rng(3)
    part, *_ = _weight(rng, 128, 64, 32, 8, offset=128)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    results = []
    for count in (1, 2, 3, 7):
        lib.set_threads(count)
        assert lib.threads() == count
        results.append(ncw.a8_matmul(x, part.w, part.d, None, part.bits, part.group))
    lib.set_threads(0)
    assert lib.threads() >= 1
    assert all(_same(r, results[0]) for r in results)


def test_the_c_library_keeps_its_own_kernel_set_beside_torchs(lib, torch_native) -> None:
    """Both libraries hold the same core; the C one's symbols are hidden, so each keeps its own state."""
    _, native = torch_native
    lib.select("scalar")
    try:
        assert lib.kernels() == "scalar"
        assert native.kernels() == native.kernel_sets()[0]
    finally:
        lib.select(lib.kernel_sets()[0])
    with pytest.raises(ValueError, match="does not run on this CPU"):
        lib.select("no_such_isa")


def test_rms_norm_and_swiglu_against_float_references(lib) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + EPS) * w
    np.testing.assert_allclose(ncl.rms_norm(x, w, EPS), want, rtol=2e-6, atol=1e-6)
    inplace = x.copy()
    assert _same(ncl.rms_norm(inplace, w, EPS, y=inplace), ncl.rms_norm(x, w, EPS))
    gate_up = rng.standard_normal((2, 64)).astype(np.float32)
    g, u = gate_up[:, :32].astype(np.float64), gate_up[:, 32:].astype(np.float64)
    np.testing.assert_allclose(ncl.swiglu(gate_up), g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)
    a, b = x.copy(), rng.standard_normal((3, 64)).astype(np.float32)
    assert _same(ncl.add(a, b), x + b)


# ---- attention --------------------------------------------------------------------------------------

TREE = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1], [1, 0, 0, 0]], dtype=bool)


def test_attend_equals_the_torch_op(lib, torch_native) -> None:
    torch, _ = torch_native
    rng = np.random.default_rng(5)
    heads, kv_heads, dim = 4, 2, 16
    kv = rng.standard_normal((2, 3, kv_heads, 24, dim)).astype(np.float32)
    qkv = rng.standard_normal((5, (heads + 2 * kv_heads) * dim)).astype(np.float32)
    for chunks, visible in ((np.array([[0, 0, 4, 6], [2, 4, 1, 9]]), TREE), (np.array([[1, 0, 5, 3]]), None)):
        mine, theirs = kv.copy(), torch.from_numpy(kv.copy())
        got = ncl.attend(qkv, mine, chunks, visible, heads, kv_heads)
        want = torch.ops.outrider.attend(torch.from_numpy(qkv), theirs, torch.from_numpy(chunks),
                                         torch.empty(0, dtype=torch.bool) if visible is None
                                         else torch.from_numpy(visible), heads, kv_heads)
        assert _same(got, want.numpy())
        assert _same(mine, theirs.numpy())


# ---- the layer stack --------------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, DIM, INTER, LAYERS = 64, 4, 2, 16, 96, 2
WIDTH = (HEADS + 2 * KV_HEADS) * DIM


def _rope(rng, rows: int):
    angle = rng.uniform(0, 6.3, (rows, DIM // 2)).astype(np.float32)
    cos = np.concatenate([np.cos(angle), np.cos(angle)], axis=1).astype(np.float32)
    sin = np.concatenate([-np.sin(angle), np.sin(angle)], axis=1).astype(np.float32)
    return cos, sin


def _steps():
    """(chunks, visible, rows) of a prefill of two sequences, then a draft tree beside a decode."""
    return [(np.array([[0, 0, 10, 0], [1, 10, 3, 0]]), None, 13), (np.array([[0, 0, 4, 10], [1, 4, 1, 3]]), TREE, 5)]


def _norm(rng, n: int) -> np.ndarray:
    return rng.uniform(0.6, 1.4, n).astype(np.float32)


def test_llama_layers_equal_w4a8_layers_in_the_plain_case(lib, torch_native) -> None:
    """One 4-bit fp16 part a matrix, no bias, no q/k norms: w4a8_layers' result, hidden states and
    KV cache, bit for bit, on every kernel set."""
    torch, _ = torch_native
    rng = np.random.default_rng(6)
    shapes = {"qkv": (WIDTH, HIDDEN), "o": (HIDDEN, HEADS * DIM), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER)}
    layers, norms, packed, scales, minimums = [], [], [], [], []
    for _ in range(LAYERS):
        parts = {name: _weight(rng, out, inp, 32, 4)[0] for name, (out, inp) in shapes.items()}
        layer = ncl.Layer(_norm(rng, HIDDEN), _norm(rng, HIDDEN), **parts)
        layers.append(layer)
        norms += [torch.from_numpy(layer.attn_norm), torch.from_numpy(layer.mlp_norm)]
        for name in shapes:
            packed.append(torch.from_numpy(parts[name].w))
            scales.append(torch.from_numpy(parts[name].d))
            minimums.append(torch.from_numpy(parts[name].m))
    stack = ncl.LayerStack(layers, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, eps=EPS)
    for name in lib.kernel_sets():
        lib.select(name)
        kv_mine = np.zeros((LAYERS, 2, 2, KV_HEADS, 32, DIM), np.float32)
        caches = ncl.KvCaches(kv_mine, KV_HEADS)
        kv_theirs = torch.zeros(kv_mine.shape)
        step_rng = np.random.default_rng(7)
        for chunks, visible, rows in _steps():
            x = step_rng.standard_normal((rows, HIDDEN)).astype(np.float32)
            cos, sin = _rope(step_rng, rows)
            mine, theirs = x.copy(), torch.from_numpy(x.copy())
            stack(mine, cos, sin, caches, chunks, visible)
            torch.ops.outrider.w4a8_layers(
                theirs, torch.from_numpy(cos), torch.from_numpy(sin), kv_theirs, torch.from_numpy(chunks),
                torch.empty(0, dtype=torch.bool) if visible is None else torch.from_numpy(visible),
                norms, packed, scales, minimums, 32, HEADS, KV_HEADS, INTER, EPS)
            assert _same(mine, theirs.numpy()), name
            assert not _same(mine, x)
        assert _same(kv_mine, kv_theirs.numpy()), name
    lib.select(lib.kernel_sets()[0])


def _mixed_layer(rng) -> ncl.Layer:
    """Qwen-shaped: q | k | v in three block types (4-bit fp16, 8-bit Q8_0-like offset with fp32
    tables, 5-bit tables in groups of 16), a 5-bit offset o, gate | up in 8 and 4 bits (the latter
    symmetric, fp32, groups of 64), an 8-bit down; the qkv bias and q/k norms."""
    def part(out, inp, group, bits, f32=False, offset=0):
        return _weight(rng, out, inp, group, bits, f32, offset)[0]

    return ncl.Layer(
        _norm(rng, HIDDEN), _norm(rng, HIDDEN),
        qkv=[part(HEADS * DIM, HIDDEN, 32, 4), part(KV_HEADS * DIM, HIDDEN, 64, 8, True, 128),
             part(KV_HEADS * DIM, HIDDEN, 16, 5)],
        o=part(HIDDEN, HEADS * DIM, 32, 5, True, 16),
        gate_up=[part(INTER, HIDDEN, 32, 8), part(INTER, HIDDEN, 64, 4, True, 8)],
        down=[part(HIDDEN, INTER, 32, 8, False, 128)],
        qkv_bias=rng.standard_normal(WIDTH).astype(np.float32) * 0.1,
        q_norm=_norm(rng, DIM) * np.float32(0.25), k_norm=_norm(rng, DIM))


def _reference_step(layers, x, cos, sin, kv, chunks, visible) -> np.ndarray:
    """The layer stack from native_c's pieces (each a kernel of the same core) and numpy's float32
    arithmetic where the C stack does plain float math (bias, RoPE, residuals)."""
    x = x.copy()
    rows, half, q_width = x.shape[0], DIM // 2, HEADS * DIM
    for li, layer in enumerate(layers):
        h = ncl.rms_norm(x, layer.attn_norm, EPS)
        qkv = np.empty((rows, WIDTH), np.float32)
        column = 0
        for p in layer.qkv:
            ncw.a8_matmul(h, p.w, p.d, p.m, p.bits, p.group, y=qkv[:, column:column + p.out])
            column += p.out
        qkv += layer.qkv_bias
        for start, heads, weight in ((0, HEADS, layer.q_norm), (q_width, KV_HEADS, layer.k_norm)):
            block = np.ascontiguousarray(qkv[:, start:start + heads * DIM]).reshape(rows * heads, DIM)
            qkv[:, start:start + heads * DIM] = ncl.rms_norm(block, weight, EPS).reshape(rows, heads * DIM)
        roped = qkv[:, :(HEADS + KV_HEADS) * DIM].reshape(rows, HEADS + KV_HEADS, DIM)
        a, b = roped[..., :half].copy(), roped[..., half:].copy()
        c, s = cos[:, None, :], sin[:, None, :]
        roped[..., :half] = a * c[..., :half] + b * s[..., :half]
        roped[..., half:] = b * c[..., half:] + a * s[..., half:]
        attn = ncl.attend(qkv, kv[li], chunks, visible, HEADS, KV_HEADS)
        x += ncw.a8_matmul(attn, layer.o.w, layer.o.d, layer.o.m, layer.o.bits, layer.o.group)
        h = ncl.rms_norm(x, layer.mlp_norm, EPS)
        gate_up = np.concatenate([ncw.a8_matmul(h, p.w, p.d, p.m, p.bits, p.group) for p in layer.gate_up], axis=1)
        act = ncl.swiglu(gate_up)
        down = layer.down[0]
        x += ncw.a8_matmul(act, down.w, down.d, down.m, down.bits, down.group)
    return x


def test_llama_layers_with_mixed_parts_bias_and_qk_norms_equal_their_pieces(lib) -> None:
    rng = np.random.default_rng(8)
    layers = [_mixed_layer(rng) for _ in range(LAYERS)]
    stack = ncl.LayerStack(layers, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, eps=EPS)
    for name in lib.kernel_sets():
        lib.select(name)
        kv_mine = np.zeros((LAYERS, 2, 2, KV_HEADS, 32, DIM), np.float32)
        kv_ref = kv_mine.copy()
        caches = ncl.KvCaches(kv_mine, KV_HEADS)
        step_rng = np.random.default_rng(9)
        for chunks, visible, rows in _steps():
            x = step_rng.standard_normal((rows, HIDDEN)).astype(np.float32)
            cos, sin = _rope(step_rng, rows)
            want = _reference_step(layers, x, cos, sin, kv_ref, chunks, visible)
            ncl.llama_layers(x, cos, sin, caches, stack, chunks, visible)
            assert _same(x, want), name
        assert _same(kv_mine, kv_ref), name
    lib.select(lib.kernel_sets()[0])
    # The one-off form (a stack built for the call, the cache from its array) computes the same.
    x = np.random.default_rng(10).standard_normal((3, HIDDEN)).astype(np.float32)
    cos, sin = _rope(np.random.default_rng(11), 3)
    chunks = np.array([[0, 0, 3, 0]])
    a, b = x.copy(), x.copy()
    stack(a, cos, sin, np.zeros((LAYERS, 2, 1, KV_HEADS, 8, DIM), np.float32), chunks)
    ncl.llama_layers(b, cos, sin, np.zeros((LAYERS, 2, 1, KV_HEADS, 8, DIM), np.float32), layers, chunks,
                    num_heads=HEADS, num_kv_heads=KV_HEADS, eps=EPS)
    assert _same(a, b)


# ---- errors -----------------------------------------------------------------------------------------

def test_bad_matmul_arguments_raise_with_what_was_expected(lib) -> None:
    rng = np.random.default_rng(12)
    part, q, d, m, _ = _weight(rng, 32, 96, 32, 4)
    x = rng.standard_normal((2, 96)).astype(np.float32)
    with pytest.raises(ValueError, match=r"group must be a multiple of 16 dividing the 96 inputs, got 24"):
        d24, m24 = ncw.per_tile(*_tables(rng, 32, 4, 4, False, 0))
        ncw.a8_matmul(x, part.w, d24, m24, part.bits, 24)
    with pytest.raises(ValueError, match="not a code of bits_flags"):
        ncw.a8_matmul(x, part.w, part.d, part.m, 6, 32)
    with pytest.raises(ValueError, match="m must be None"):
        ncw.a8_matmul(x, part.w, part.d, part.m, nc.bits_flags(4, offset=8), 32)
    with pytest.raises(ValueError, match=r"d \(bits 0x4: without F32_TABLES\) must be float16"):
        ncw.a8_matmul(x, part.w, part.d.astype(np.float32), part.m.astype(np.float32), part.bits, 32)
    with pytest.raises(ValueError, match=r"x must be float32 \[\*, 96\], got float64"):
        ncw.a8_matmul(x.astype(np.float64), part.w, part.d, part.m, part.bits, 32)
    with pytest.raises(ValueError, match="C-contiguous"):
        ncw.a8_matmul(np.asfortranarray(x), part.w, part.d, part.m, part.bits, 32)
    with pytest.raises(ValueError, match="w holds 32 outputs, out says 48"):
        ncw.a8_matmul(x, part.w, part.d, part.m, part.bits, 32, out=48)
    with pytest.raises(ValueError, match="contiguous rows"):
        ncw.a8_matmul(x, part.w, part.d, part.m, part.bits, 32, y=np.empty((2, 64), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="power of two"):
        nc.bits_flags(8, offset=12)
    with pytest.raises(ValueError, match="multiple of 16"):
        ncl.rms_norm(x[:, :40].copy(), np.ones(40, np.float32), EPS)


def test_bad_layer_stacks_and_steps_raise_naming_the_layer_and_matrix(lib) -> None:
    rng = np.random.default_rng(13)
    config = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, eps=EPS)
    good = [_mixed_layer(rng) for _ in range(2)]

    def with_layer1(**changes) -> list:
        layer = _mixed_layer(np.random.default_rng(14))
        for name, value in changes.items():
            setattr(layer, name, value)
        return [good[0], layer]

    short_v = _weight(rng, 16, HIDDEN, 16, 5)[0]
    with pytest.raises(ValueError, match=r"layer 1 qkv: the parts' outputs sum to 112, expected \(heads \+ 2 kv "
                                         r"heads\) x head_dim = 128"):
        ncl.LayerStack(with_layer1(qkv=good[1].qkv[:2] + [short_v]), **config)
    with pytest.raises(ValueError, match=r"layer 1 gate_up part 0: group must be a multiple of 16 dividing the 64 "
                                         r"inputs, got 8"):
        bad = _weight(rng, INTER, HIDDEN, 16, 8)[0]
        d8, m8 = ncw.per_tile(*_tables(rng, INTER, HIDDEN // 8, 8, False, 0))
        ncl.LayerStack(with_layer1(gate_up=[ncw.Part(bad.w, d8, m8, bad.bits, 8), good[1].gate_up[1]]), **config)
    with pytest.raises(ValueError, match="layer 1 down part 0: w holds 64 inputs, expected 96"):
        ncl.LayerStack(with_layer1(down=_weight(rng, HIDDEN, 64, 32, 8)[0]), **config)
    with pytest.raises(ValueError, match="layer 1 o: 1 to 3 parts, got 4"):
        ncl.LayerStack(with_layer1(o=[good[1].o] * 4), **config)
    with pytest.raises(ValueError, match=r"layer 1 k_norm must be float32 \[16\]"):
        ncl.LayerStack(with_layer1(k_norm=np.ones(8, np.float32)), **config)
    with pytest.raises(ValueError, match="attend: head_dim must be 16, 32, 64, 128 or 256 and heads a positive multiple "
                                         "of kv heads, got 16, 3, 2"):
        ncl.attend(np.zeros((1, 7 * DIM), np.float32), np.zeros((2, 1, 2, 4, DIM), np.float32),
                   np.array([[0, 0, 1, 0]]), None, 3, 2)
    stack = ncl.LayerStack(good, **config)
    kv = np.zeros((2, 2, 2, KV_HEADS, 16, DIM), np.float32)
    x = np.zeros((4, HIDDEN), np.float32)
    cos, sin = _rope(rng, 4)
    with pytest.raises(ValueError, match="row 2 is in two chunks"):
        stack(x, cos, sin, kv, np.array([[0, 0, 3, 0], [1, 2, 2, 0]]))
    with pytest.raises(ValueError, match=r"chunk 0 \(slot 5, rows 0\+4, length 0\) does not fit"):
        stack(x, cos, sin, kv, np.array([[5, 0, 4, 0]]))
    with pytest.raises(ValueError, match="2 layers of 2 KV heads of 16 need as many KV caches"):
        stack(x, cos, sin, kv[:1], np.array([[0, 0, 4, 0]]))
    with pytest.raises(ValueError, match=r"cos must be float32 \[4, 16\]"):
        stack(x, cos[:3], sin, kv, np.array([[0, 0, 4, 0]]))
    with pytest.raises(ValueError, match="visible must be bool"):
        stack(x, cos, sin, kv, np.array([[0, 0, 4, 0]]), np.ones((4, 4), np.uint8))
    assert not x.any() and not kv.any()  # nothing computed


# ---- numpy packers against native.py's torch packers -------------------------------------------------

def test_numpy_packers_equal_the_torch_packers_byte_for_byte(lib, torch_native) -> None:
    torch, native = torch_native
    from outrider_llm.gguf_blocks import AffineGroups
    from outrider_llm.linear import W8A8Linear

    rng = np.random.default_rng(15)
    q8 = rng.integers(0, 256, (48, 64)).astype(np.uint8)
    assert _same(ncw.nibble_tiles(q8 & 15), native.nibble_tiles(torch.from_numpy(q8 & 15)).numpy())
    assert _same(ncw.byte_tiles(q8), native.byte_tiles(torch.from_numpy(q8)).numpy())
    assert _same(ncw.pack_w5(q8 & 31), native.pack_w5(torch.from_numpy(q8 & 31)).numpy())
    d = rng.uniform(1e-3, 1e-1, (48, 4)).astype(np.float32)
    exact = d.astype(np.float16).astype(np.float32)
    for dtype, tdtype in ((np.float16, torch.float16), (np.float32, torch.float32)):
        for mine, theirs in zip(ncw.per_tile(d, -d, dtype=dtype), native.per_tile(torch.from_numpy(d),
                                                                                 torch.from_numpy(-d), dtype=tdtype)):
            assert _same(mine, theirs.numpy())
    assert ncw.table_dtype(exact, -exact) == np.float16 and native.table_dtype(torch.from_numpy(exact)) == torch.float16
    assert ncw.table_dtype(exact, d) == np.float32 and native.table_dtype(torch.from_numpy(d)) == torch.float32
    for bits in (4, 5, 8):
        for scale in (exact, d):
            for minimum in (-scale * np.float32(16), -scale * rng.uniform(0, 3, scale.shape).astype(np.float32)):
                groups = AffineGroups(bits, rng.integers(0, 1 << bits, (48, 128)).astype(np.uint8),
                                      scale.copy(), minimum.astype(np.float32), 32, True, "test")
                for mine, theirs in zip(ncw.pack_affine(groups), native.pack_affine(groups)):
                    assert _same(mine, theirs.numpy()), bits
                dt, mt, offset = ncw.scale_tables(scale, minimum)
                if bits == 8:  # the torch model's 8-bit kernel holds the same tables
                    held = W8A8Linear(torch.from_numpy(groups.q), torch.from_numpy(scale), torch.from_numpy(minimum))
                    assert held.offset == offset and _same(dt, held.scales.numpy())
                    assert (mt is None) == (held.minimums.numel() == 0)
                    assert mt is None or _same(mt, held.minimums.numpy())
                part = ncw.Part.from_affine(groups)
                assert part.bits == nc.bits_flags(bits, dt.dtype, offset) and _same(part.d, dt)


def test_a_part_from_affine_groups_computes_what_the_torch_linear_does(lib, torch_native) -> None:
    torch, _ = torch_native
    from outrider_llm.gguf_blocks import AffineGroups
    from outrider_llm.linear import W5A8Linear, W8A8Linear

    rng = np.random.default_rng(16)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    for bits, cls, offset in ((8, W8A8Linear, 128), (8, W8A8Linear, 0), (5, W5A8Linear, 16), (5, W5A8Linear, 0)):
        d, m = _tables(rng, 32, 2, bits, True, offset)
        q = rng.integers(0, 1 << bits, (32, 64)).astype(np.uint8)
        part = ncw.Part.from_affine(AffineGroups(bits, q, d, m, 32, True, "test"))
        assert (part.m is None) == bool(offset)
        linear = cls(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))
        assert _same(ncw.a8_matmul(x, part.w, part.d, part.m, part.bits, part.group),
                     linear(torch.from_numpy(x)).numpy()), (bits, offset)


# ---- no torch ------------------------------------------------------------------------------------------

def test_a_process_using_only_the_c_library_never_imports_torch(lib) -> None:
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import outrider_llm.native_c as n
        import outrider_llm.native_c_weights as w
        ok, why = n.library()
        assert ok, why
        q = np.random.default_rng(0).integers(0, 16, (32, 64)).astype(np.uint8)
        d, m = w.per_tile(np.full((32, 2), 0.01, np.float32), np.full((32, 2), -0.08, np.float32))
        y = w.a8_matmul(np.ones((2, 64), np.float32), w.nibble_tiles(q), d, m, n.bits_flags(4), 32)
        assert y.shape == (2, 32) and np.isfinite(y).all()
        assert "torch" not in sys.modules, sorted(k for k in sys.modules if k.startswith("torch"))
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def _library_in_a_child(**env: str) -> str:
    script = "import outrider_llm.native_c as n; ok, why = n.library(); print(ok, why, n.kernels() if ok else '')"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_environment_turns_the_library_off_or_forces_a_kernel_set(lib) -> None:
    assert _library_in_a_child(OUTRIDER_NATIVE="0") == "False OUTRIDER_NATIVE=0"
    assert _library_in_a_child(OUTRIDER_NATIVE_ISA="scalar").endswith(" scalar")
    assert _library_in_a_child(OUTRIDER_NATIVE_ISA="no_such_isa").endswith(" " + lib.kernel_sets()[0])
