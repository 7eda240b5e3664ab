"""EAGLE-3 heads as published (drafter "eagle3", issue 39): the target's low/middle/high features
captured from the native layer stack, the head's decoder layer over them checked against a torch
implementation of the published module, greedy output the target's, and files that do not fit
refused naming what does not.

No real head can be downloaded here: a tiny random head is written in the published layout
(SafeAILab/EAGLE's `midlayer.*` names, or SpecForge's `layers.0.*`), BF16 safetensors and a
config.json, for a tiny random 7-layer Llama GGUF (tests/gguf_models.py)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "gguf", "safetensors")),
    reason="needs torch, transformers, gguf and safetensors (to write the tiny GGUF and head)",
)

from outrider.errors import ManifestError  # noqa: E402
from outrider.generation.contract import Chunk  # noqa: E402
from outrider.generation.sampling import SamplingParams, new_generator  # noqa: E402

from conftest import write_manifest  # noqa: E402
from gguf_models import write_tiny_gguf  # noqa: E402
from test_draft_model import _native_c, served_greedy_equals_plain  # noqa: E402
from test_eagle import _run, _strategy  # noqa: E402

LAYERS = 7  # the default features: entering layers 2, 3 and 4
PROMPTS = ["the cat sat on the mat", "hello there", "abcabcabc", "one two three four"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(NativeLlama, tokenizer, the transformers model the GGUF was written from, the GGUF's path)."""
    _native_c()
    from outrider_llm.gguf_tiles import load_gguf_tiles
    from outrider_llm.native_model import load_tiles

    path, hf = write_tiny_gguf(tmp_path_factory.mktemp("target"), "llama", seed=4, matrix_type="Q8_0",
                               num_hidden_layers=LAYERS)
    model, tokenizer = load_tiles(load_gguf_tiles(path, in_child=False))
    return model, tokenizer, hf, path


def write_head(folder: Path, hidden: int, vocab: int, *, draft_vocab: int = 96, captured: int = 3,
               target_hidden: int = None, prefix: str = "midlayer.", seed: int = 0, dtype: str = "bfloat16",
               rope_scaling: dict = None) -> Path:
    """A random EAGLE-3 head in the published layout: config.json + model.safetensors."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    target_hidden = target_hidden or hidden
    heads, kv_heads, head_dim, inter = 4, 2, hidden // 4, 2 * hidden

    def rand(*shape, scale=None):
        return torch.randn(*shape) * (scale if scale is not None else 1.0 / math.sqrt(shape[-1]))

    tensors = {
        "fc.weight": rand(hidden, captured * target_hidden),
        prefix + "input_layernorm.weight": 1 + 0.1 * torch.randn(hidden),
        prefix + "hidden_norm.weight": 1 + 0.1 * torch.randn(hidden),
        prefix + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden),
        prefix + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        prefix + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        prefix + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        prefix + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        prefix + "mlp.gate_proj.weight": rand(inter, hidden),
        prefix + "mlp.up_proj.weight": rand(inter, hidden),
        prefix + "mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": 1 + 0.1 * torch.randn(hidden),
        "lm_head.weight": rand(draft_vocab, hidden, scale=3.0 / math.sqrt(hidden)),
        # draft id i -> target id i + d2t[i]: every other id from 10 on (a reduced vocabulary)
        "d2t": torch.tensor([10 + i for i in range(draft_vocab)], dtype=torch.int64),
        "t2d": torch.zeros(vocab, dtype=torch.bool),
    }
    tensors = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "intermediate_size": inter, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "rope_scaling": rope_scaling, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
              "num_hidden_layers": 1}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _reference(folder: Path, features, next_tokens, embed, draft_token: int):
    """The published head's arithmetic in torch (SafeAILab/EAGLE cnets.py, EAGLE-3): logits of the
    last committed row and of one tree row for `draft_token` after it, in target ids."""
    import torch
    from safetensors.torch import load_file

    w = {k.replace("layers.0.", "midlayer."): v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    cfg = json.loads((folder / "config.json").read_text())
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, eps = hidden // heads, cfg["rms_norm_eps"]
    m = "midlayer."

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x, positions):  # x [heads, T, D]; transformers' rotate_half
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = positions.float()[:, None] * inv[None]
        emb = torch.cat([freqs, freqs], -1)
        half = torch.cat([-x[..., head_dim // 2:], x[..., :head_dim // 2]], -1)
        return x * emb.cos() + half * emb.sin()

    def layer(g, e, positions, past=None):
        residual = g
        x = torch.cat([norm(e, w[m + "input_layernorm.weight"]), norm(g, w[m + "hidden_norm.weight"])], -1)
        t = x.shape[0]
        q = (x @ w[m + "self_attn.q_proj.weight"].T).view(t, heads, head_dim).transpose(0, 1)
        k = (x @ w[m + "self_attn.k_proj.weight"].T).view(t, kv_heads, head_dim).transpose(0, 1)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).view(t, kv_heads, head_dim).transpose(0, 1)
        q, k = rope(q, positions), rope(k, positions)
        causal = past is None
        if past is not None:
            k, v = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
        kk, vv = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
        a = torch.nn.functional.scaled_dot_product_attention(q[None], kk[None], vv[None], is_causal=causal)[0]
        h = residual + a.transpose(0, 1).reshape(t, hidden) @ w[m + "self_attn.o_proj.weight"].T
        n = norm(h, w[m + "post_attention_layernorm.weight"])
        mlp = (torch.nn.functional.silu(n @ w[m + "mlp.gate_proj.weight"].T) * (n @ w[m + "mlp.up_proj.weight"].T))
        return h + mlp @ w[m + "mlp.down_proj.weight"].T, (k, v)

    def logits(out):
        return norm(out, w["norm.weight"]) @ w["lm_head.weight"].T

    t = features.shape[0]
    out, past = layer(torch.as_tensor(features) @ w["fc.weight"].T, torch.as_tensor(embed(next_tokens)),
                      torch.arange(t))
    root = logits(out[-1:])[0]
    deeper, _ = layer(out[-1:], torch.as_tensor(embed(np.array([draft_token]))), torch.tensor([t]), past)
    return root.numpy(), logits(deeper)[0].numpy()


def _features(model, tokens: list[int]) -> np.ndarray:
    cache = model.new_cache(1, 64)
    ids = np.array(tokens, dtype=np.int64)
    return model.forward(cache, [Chunk(0, ids, np.arange(len(ids)))]).aux_hidden


def test_captured_layers_are_the_residual_stream_entering_them(target):
    import torch

    model, tokenizer, hf, _ = target
    tokens = tokenizer.encode("the cat sat on the mat")
    ids = np.array(tokens, dtype=np.int64)
    plain = model.forward(model.new_cache(1, 64), [Chunk(0, ids, np.arange(len(ids)))])
    assert plain.aux_hidden is None
    model.capture_hidden((0, 2, 5))
    try:
        out = model.forward(model.new_cache(1, 64), [Chunk(0, ids, np.arange(len(ids)))])
    finally:
        model.capture_hidden(())
    np.testing.assert_array_equal(out.logits, plain.logits)  # the stack in pieces is the same arithmetic
    with torch.no_grad():
        reference = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # [l]: entering layer l
    width = model.hidden_size

    def distance(ours, layer):  # relative; the file's Q8_0 blocks against transformers' fp32 weights
        theirs = reference[layer][0].numpy()
        return np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)

    for i, layer in enumerate((0, 2, 5)):
        ours = out.aux_hidden[:, i * width:(i + 1) * width]
        assert distance(ours, layer) < 0.1, (layer, distance(ours, layer))
        assert distance(ours, layer + 1) > 5 * distance(ours, layer)  # not the layer's output
    with pytest.raises(ValueError, match="ascending"):
        model.capture_hidden((3, 1))
    with pytest.raises(ValueError, match="ascending"):
        model.capture_hidden((LAYERS,))


@pytest.mark.parametrize("prefix", ["midlayer.", "layers.0."])
def test_the_heads_layer_computes_what_the_published_module_computes(target, tmp_path, prefix):
    model, tokenizer, _, _ = target
    head = write_head(tmp_path / "head", model.hidden_size, model.vocab_size, prefix=prefix, seed=1)
    strategy = _strategy(["eagle3"], eagle3={"path": str(head), "prob_threshold": 0.0}, prob_threshold=0.0)
    strategy.attach(model, tokenizer)
    drafter = strategy.drafters[0]
    assert model.captured_layers == (2, 3, 4)  # (2, n/2, n-3), as EAGLE-3 and vLLM pick them
    tokens = tokenizer.encode("hello there, general")
    features = _features(model, tokens[:-1])  # committed: all but the pending token
    committed = len(tokens) - 1

    class View:
        seq_id = "v"
        token_ids = tokens
        prompt_length = len(tokens)
        params = SamplingParams()  # greedy
        generator = new_generator(0)
        last_hidden = None
        new_features = features

    drafter.observe(View())
    tree = drafter.propose(View(), 8)
    cache = drafter._caches["v"]
    assert cache.rows == committed and cache.root[0] == committed - 1
    draft_ids = drafter._draft_ids
    first = int(np.argmax(cache.root[2]))
    root, deeper = _reference(head, features, np.array(tokens[1:]), lambda ids: model.embed(ids), draft_ids[first])
    np.testing.assert_allclose(cache.root[2], root, rtol=2e-3, atol=2e-3)
    drafter._current, drafter._tentative = cache, []
    states, logits = drafter._run([(cache.root[1], (), committed)], [int(draft_ids[first])])
    np.testing.assert_allclose(logits[0], deeper, rtol=2e-3, atol=2e-3)
    # The tree's first child is the head's best token, in the target's ids (d2t applied).
    assert tree.tokens[0] == int(draft_ids[first]) and tree.parents[0] == -1
    assert all(10 <= t < model.vocab_size for t in tree.tokens)
    drafter.finish(View())
    assert not drafter._caches


def test_greedy_output_with_an_eagle3_head_is_the_targets(target, tmp_path):
    model, tokenizer, _, _ = target
    head = write_head(tmp_path / "head", model.hidden_size, model.vocab_size, seed=2)
    params = [{"prompt": p, "max_tokens": 24} for p in PROMPTS]
    plain = _run(model, tokenizer, None, params)
    strategy = _strategy(["eagle3"], eagle3={"path": str(head), "prob_threshold": 0.0, "max_children": 2},
                         prob_threshold=0.0, cost_gate=False)
    try:
        spec = _run(model, tokenizer, strategy, params)
    finally:
        model.capture_hidden(())
    for i, prompt in enumerate(PROMPTS):
        assert spec[i]["token_ids"] == plain[i]["token_ids"], prompt
    drafter = strategy.drafters[0]
    assert drafter.calls > 0 and sum(spec[i]["stats"]["draft_tokens"] for i in range(len(PROMPTS))) > 0
    assert strategy.stats["drafter_errors"] == 0
    assert not drafter._caches, "finished sequences keep no head cache"


def test_sampling_with_an_eagle3_head_draws_from_its_q_and_respects_seeds(target, tmp_path):
    model, tokenizer, _, _ = target
    head = write_head(tmp_path / "head", model.hidden_size, model.vocab_size, seed=3, dtype="float16")
    params = [{"prompt": p, "max_tokens": 16, "temperature": 1.0, "seed": 11} for p in PROMPTS[:2]]
    strategy = _strategy(["eagle3"], eagle3={"path": str(head), "prob_threshold": 0.0}, prob_threshold=0.0,
                         cost_gate=False)
    try:
        first = _run(model, tokenizer, strategy, params)
        strategy.drafters[0].sample = True
        second = _run(model, tokenizer, strategy, params)
        plain = _run(model, tokenizer, None, params)
    finally:
        model.capture_hidden(())
    for i in range(len(params)):
        assert first[i]["token_ids"] == second[i]["token_ids"]
        assert first[i]["stats"]["draft_tokens"] > 0
        assert len(plain[i]["token_ids"]) == len(first[i]["token_ids"])


def test_heads_that_do_not_fit_are_refused_naming_what(target, tmp_path):
    model, tokenizer, _, _ = target
    wide = write_head(tmp_path / "wide", model.hidden_size, model.vocab_size, target_hidden=2 * model.hidden_size)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    (pickled / "config.json").write_text("{}")
    good = write_head(tmp_path / "good", model.hidden_size, model.vocab_size)
    scaled = write_head(tmp_path / "scaled", model.hidden_size, model.vocab_size,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0})
    cases = [({"path": str(wide)}, r"speculative\.eagle3\.path.*fc\.weight is \[128, 768\]"),
             ({"path": str(pickled)}, r"speculative\.eagle3\.path.*pickle"),
             ({"path": str(tmp_path / "missing")}, r"speculative\.eagle3\.path.*does not exist"),
             ({"path": str(good), "layers": [5, 1, 2]}, r"speculative\.eagle3\.layers.*ascending"),
             ({"path": str(good), "layers": [1, 2, 9]}, r"speculative\.eagle3\.layers.*has 7 layers"),
             ({"path": str(good), "quantize": "int2"}, r"speculative\.eagle3\.quantize"),
             ({"path": str(scaled)}, r"speculative\.eagle3\.path.*yarn"),
             ({"path": str(good), "depth": 2}, r"speculative\.eagle3\.depth.*unknown")]
    try:
        for options, pattern in cases:
            with pytest.raises(ManifestError, match=pattern):
                _strategy(["eagle3"], eagle3=options).attach(model, tokenizer)
    finally:
        model.capture_hidden(())

    class TorchTarget:
        hidden_size, vocab_size, array_api = model.hidden_size, model.vocab_size, "torch"

    with pytest.raises(ManifestError, match=r"speculative\.eagle3\.path.*native CPU runtime"):
        _strategy(["eagle3"], eagle3={"path": str(good)}).attach(TorchTarget(), tokenizer)


def test_llama3_rope_scaling_matches_transformers():
    import torch
    import transformers
    from outrider_speculative.eagle3 import inverse_frequencies

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, rope_theta=500000.0,
                                      rope_scaling=scaling, max_position_embeddings=131072)
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    ours = inverse_frequencies({"rope_theta": 500000.0, "rope_scaling": scaling}, 128)
    np.testing.assert_allclose(ours, rope.inv_freq.to(torch.float32).numpy(), rtol=1e-6)


def test_a_manifest_serves_with_an_eagle3_head_relative_to_it(target, tmp_path, server_factory):
    model, _, _, path = target
    write_head(tmp_path / "head", model.hidden_size, model.vocab_size, seed=5)
    manifest = write_manifest(tmp_path, f"""name: tiny
backend: llm
model:
  path: {path}
options:
  max_sequences: 2
  max_length: 128
  threads: 1
speculative:
  drafters: [eagle3]
  cost_gate: false   # the drafts are counted below
  prob_threshold: 0.0
  eagle3: {{path: head}}
""")
    assert served_greedy_equals_plain(manifest, server_factory).stats["draft_tokens"] > 0


def test_the_eagle3_drafter_passes_the_conformance_kit(target, tmp_path):
    from outrider.plugins import create_registry
    from outrider.testing import check_drafter

    model, tokenizer, _, _ = target
    head = write_head(tmp_path / "head", model.hidden_size, model.vocab_size, seed=6)
    registry = create_registry(["outrider_llm", "outrider_speculative"], load_entry_points=False)
    try:
        counts = check_drafter(registry, "eagle3", model, tokenizer, tokenizer.encode("the cat sat on the mat"),
                               {"path": str(head), "prob_threshold": 0.0})
    finally:
        model.capture_hidden(())
    # The kit's own sequences carry no hidden states, so a head proposes nothing there (an empty tree
    # is a valid proposal); through the engine it drafts, and the output is the target's.
    assert counts["proposals"] == 24 and counts["engine_draft_tokens"] > 0
