"""GGUF block types as the native kernels' affine groups (outrider_llm.gguf_blocks), checked
against gguf-py's own dequantization of the same blocks: bit for bit where the mapping is exact,
within the fp16 rounding of a sub-block scale for the K types otherwise; and the w4a8 / w8a8
kernels on those groups against a matmul of gguf-py's weights."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

from outrider_llm import gguf_blocks  # noqa: E402

SIMPLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf-py quantizes these itself
K_TYPES = {"Q4_K": (144, [(0, 2)]), "Q5_K": (176, [(0, 2)]), "Q6_K": (210, [(208, 2)])}


def _quantized(type_name: str, out: int = 48, inp: int = 256, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((out, inp)) * rng.uniform(0.01, 2.0, (out, 1))).astype(np.float32)
    weights[3, :32] = 0.0  # a constant group
    return quants.quantize(weights, GGMLQuantizationType[type_name])


def _k_blocks(type_name: str, out: int, inp: int, seed: int, simple_scales: bool) -> np.ndarray:
    """Random K-type blocks (any bytes are valid values) with sane fp16 super-block scales; with
    `simple_scales` powers of two, so that every sub-block scale is exact in fp16."""
    size, halves = K_TYPES[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (out, inp // 256, size), dtype=np.uint8)
    for start, _ in halves + ([(2, 2)] if type_name != "Q6_K" else []):
        if simple_scales:
            values = (2.0 ** rng.integers(-12, -4, (out, inp // 256))).astype(np.float16)
        else:
            values = rng.uniform(1e-4, 2e-2, (out, inp // 256)).astype(np.float16)
        raw[..., start:start + 2] = values.view(np.uint8).reshape(out, inp // 256, 2)
    return raw.reshape(out, -1)


def _reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    return quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)


@pytest.mark.parametrize("type_name", SIMPLE)
def test_simple_types_map_exactly(type_name):
    raw = _quantized(type_name)
    groups = gguf_blocks.to_affine(raw, type_name, (48, 256))
    assert groups.exact and groups.source == type_name
    assert groups.bits == (4 if type_name.startswith("Q4") else 8)
    assert groups.q.dtype == np.uint8 and int(groups.q.max()) < 2 ** groups.bits
    assert groups.d.dtype == np.float16 and groups.d.shape == (48, 256 // groups.group)
    np.testing.assert_array_equal(groups.dequantize(), _reference(raw, type_name))


@pytest.mark.parametrize("type_name", list(K_TYPES))
def test_k_types_map_exactly_when_their_scales_fit_fp16(type_name):
    raw = _k_blocks(type_name, 32, 512, seed=1, simple_scales=True)
    groups = gguf_blocks.to_affine(raw, type_name, (32, 512))
    assert groups.exact
    assert groups.group == (16 if type_name == "Q6_K" else 32)
    np.testing.assert_array_equal(groups.dequantize(), _reference(raw, type_name))


@pytest.mark.parametrize("type_name", list(K_TYPES))
def test_k_types_otherwise_move_a_weight_by_at_most_the_fp16_rounding_of_its_scale(type_name):
    raw = _k_blocks(type_name, 32, 512, seed=2, simple_scales=False)
    groups = gguf_blocks.to_affine(raw, type_name, (32, 512))
    reference = _reference(raw, type_name)
    assert not groups.exact  # random scales: some sub-block scale needs more than fp16's bits
    # Rounding d (and m) to fp16 moves each by at most 2^-11 of itself; q <= 63.
    d = np.repeat(groups.d.astype(np.float32), groups.group, axis=1)
    m = np.repeat(groups.m.astype(np.float32), groups.group, axis=1)
    bound = (63 * np.abs(d) + np.abs(m)) * 2.0 ** -11 + 1e-7
    assert np.all(np.abs(groups.dequantize() - reference) <= bound)
    assert np.abs(groups.dequantize() - reference).max() > 0


def test_types_without_an_affine_form_say_so():
    assert gguf_blocks.to_affine(np.zeros((1, 84), np.uint8), "Q2_K", (1, 256)) is None
    assert not gguf_blocks.supported("IQ4_NL") and gguf_blocks.supported("Q6_K")


def test_rows_keep_their_groups():
    raw = _quantized("Q8_0", out=16, inp=64)
    groups = gguf_blocks.to_affine(raw, "Q8_0", (16, 64))
    picked = groups.rows(np.array([5, 0, 5]))
    np.testing.assert_array_equal(picked.dequantize(), _reference(raw, "Q8_0")[[5, 0, 5]])


@pytest.mark.parametrize("type_name", [*SIMPLE, *K_TYPES])
def test_the_native_kernels_multiply_by_the_files_weights(type_name):
    torch = pytest.importorskip("torch")
    from outrider_llm import native

    if not native.w4a8_kernel()[0]:
        pytest.skip(f"native kernels not loaded: {native.w4a8_kernel()[1]}")
    out, inp = 32, 512
    raw = (_k_blocks(type_name, out, inp, 3, True) if type_name in K_TYPES else _quantized(type_name, out, inp))
    groups = gguf_blocks.to_affine(raw, type_name, (out, inp))
    x = torch.randn(5, inp, generator=torch.Generator().manual_seed(4))
    y = native.affine_mm(x, *native.pack_affine(groups), groups.bits, groups.group)
    reference = x @ torch.from_numpy(_reference(raw, type_name)).T
    # The activations are quantized to int8 per row and group (llama.cpp's Q8 activations).
    err = (y - reference).abs().max() / reference.abs().max()
    assert err < 0.02, err
