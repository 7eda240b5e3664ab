"""Gemma 3 and Gemma 2 from their GGUFs on the torch-free native runtime (issue 38): tiny random models
written as llama.cpp's converter writes them (tests/gguf_models.py), against transformers loading the
same file; the sliding window of the local layers, Gemma 3's local RoPE base and Gemma 2's soft caps,
each shown to matter; the SentencePiece tokenizer with one BOS; Gemma's turns when the file has none;
a plain manifest serving it with speculation; and the refusals of what is not served (a float matrix,
the torch model)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from conftest import write_manifest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "gguf")),
    reason="needs torch, transformers and gguf",
)

from gguf_models import write_tiny_gemma3_gguf  # noqa: E402

# The file's types as Gemma 3 270M's Q4_K_M holds them: Q5_0 projections, Q8_0 v and embeddings, Q4_K
# attention output (512 inputs here), Q6_K down projection (256 inputs).
REAL_MIX = {"attn_output.weight": "Q4_K", "ffn_down.weight": "Q6_K", "attn_v.weight": "Q8_0",
            "token_embd.weight": "Q8_0"}
TEXT = "hello world, the cat is in the hat and the hat is on the cat"


def _native_c():
    from outrider_llm import native_c

    if not native_c.library()[0]:
        pytest.skip(f"native C library not loaded: {native_c.library()[1]}")
    return native_c


def _ours(path, tmp_path):
    from outrider.artifacts import ArtifactCache
    from outrider_llm.gguf_tiles import load_gguf_tiles
    from outrider_llm.native_model import load_tiles

    cache = ArtifactCache(tmp_path / "cache")
    return load_tiles(load_gguf_tiles(path, cache, in_child=False), cache)


def _reference_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _from_file(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              attn_implementation="eager").eval()
    return model


def _prefill(model, ids):
    from outrider.generation.contract import Chunk

    cache = model.new_cache(1, 128)
    return model.forward(cache, [Chunk(0, np.array(ids), np.arange(len(ids)))]).logits


def _relative(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("types,matrix_type", [({}, "Q8_0"), ({}, "Q4_0"), (REAL_MIX, "Q5_0")],
                         ids=["Q8_0", "Q4_0", "real-mix"])
def test_tiny_gemma3_matches_transformers_on_the_same_file(types, matrix_type, tmp_path):
    from gguf_models import one_token_logits

    _native_c()
    path, _ = write_tiny_gemma3_gguf(tmp_path, seed=4, types=types, matrix_type=matrix_type)
    reference = _from_file(path)
    model, tokenizer = _ours(path, tmp_path)
    config = model.config
    assert (config.architecture, config.activation, config.post_norms) == ("gemma3", "gelu_tanh", True)
    assert config.swa_layers == [True] * 5 + [False, True] and config.swa_window == 8
    assert config.sliding_window is None  # not phi3's cap: the context is not limited to the window
    ids = tokenizer.encode(TEXT)
    assert ids[0] == 2 and len(ids) > 2 * config.swa_window  # BOS once, and past the window
    got, want = _prefill(model, ids), _reference_logits(reference, ids)
    assert _relative(got, want) < 0.06  # the int8 activations' error, as every other architecture's
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    assert np.array_equal(one_token_logits(model, ids), got)  # a prefill is one-token steps, bit for bit


def test_the_sliding_window_and_the_local_rope_base_are_what_make_it_match(tmp_path):
    """The same weights with the window widened past the text, or with the local layers on the global
    RoPE base, are visibly further from the reference than the model as the file describes it."""
    import torch
    import transformers

    _native_c()
    path, _ = write_tiny_gemma3_gguf(tmp_path, seed=5, matrix_type="Q8_0")
    reference = _from_file(path)
    model, tokenizer = _ours(path, tmp_path)
    ids = tokenizer.encode(TEXT + " " + TEXT)
    got = _prefill(model, ids)
    close = _relative(got, _reference_logits(reference, ids))
    global_rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e6},
                   "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    for change in ({"sliding_window": 512}, {"rope_parameters": global_rope}):
        config = transformers.Gemma3TextConfig.from_dict({**reference.config.to_dict(), **change})
        config._attn_implementation = "eager"
        other = transformers.Gemma3ForCausalLM(config).eval()
        other.load_state_dict(reference.state_dict())
        with torch.no_grad():
            far = _relative(got, other(torch.tensor([ids])).logits[0].numpy())
        assert far > 3 * close, (change, far, close)


def test_tiny_gemma2_matches_transformers_and_its_soft_caps_are_what_make_it_match(tmp_path):
    """Gemma 2 on the same body: every other layer sliding, one RoPE, attention scores and logits
    soft-capped (a cap of 2 on the scores here, so that it bites), no q/k norms."""
    import torch
    import transformers
    from gguf_models import one_token_logits

    _native_c()
    path, _ = write_tiny_gemma3_gguf(tmp_path, seed=9, types=REAL_MIX, matrix_type="Q5_0", arch="gemma2")
    loaded = _from_file(path)
    assert isinstance(loaded, transformers.Gemma2ForCausalLM)

    def with_caps(attn_cap):  # the file's weights (dequantized by transformers) under these caps
        config = transformers.Gemma2Config.from_dict({**loaded.config.to_dict(), "attn_logit_softcapping": attn_cap,
                                                      "final_logit_softcapping": 30.0})
        config._attn_implementation = "eager"
        model = transformers.Gemma2ForCausalLM(config).eval()
        model.load_state_dict(loaded.state_dict())
        return model

    # transformers' GGUF loader leaves Gemma 2's caps at its defaults (50, 30): the file's cap is 2.
    reference = with_caps(2.0)
    model, tokenizer = _ours(path, tmp_path)
    config = model.config
    assert (config.architecture, config.attn_softcap, config.final_softcap) == ("gemma2", 2.0, 30.0)
    assert config.swa_layers == [True, False] * 3 + [True] and config.swa_rope_theta is None and not config.qk_norm
    ids = tokenizer.encode(TEXT + " " + TEXT)
    got = _prefill(model, ids)
    close = _relative(got, _reference_logits(reference, ids))
    assert close < 0.06 and np.abs(got).max() <= 30.0
    assert np.array_equal(one_token_logits(model, ids), got)
    with torch.no_grad():
        far = _relative(got, with_caps(None)(torch.tensor([ids])).logits[0].numpy())
    assert far > 3 * close, (far, close)


def test_tokenizer_bos_once_stops_and_gemmas_turns_when_the_file_has_none(tmp_path):
    import transformers

    path, _ = write_tiny_gemma3_gguf(tmp_path, seed=6)
    _native_c()
    model, tokenizer = _ours(path, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tokenizer.encode(TEXT) == hf.encode(TEXT)  # SentencePiece from the file, BOS added as the file says
    assert tokenizer.encode(TEXT)[0] == 2 and tokenizer.encode(TEXT)[1] != 2
    assert {1, 5} <= tokenizer.eos_token_ids  # <eos> and <end_of_turn>
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
                    "<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n")
    ids = tokenizer.encode(text)
    assert ids[0] == 2 and ids.count(2) == 1  # the template's <bos>, not a second one
    assert ids[1] == 4  # <start_of_turn> as one token


def test_a_plain_manifest_serves_gemma3_and_speculation_is_exact(tmp_path, server_factory):
    """Served with rings and a q8_0 KV cache: greedy speculation equals plain, chat turns render."""
    _native_c()
    path, _ = write_tiny_gemma3_gguf(tmp_path, seed=7, types=REAL_MIX, matrix_type="Q5_0")
    manifest = write_manifest(tmp_path, f"""name: gemma
backend: llm
model:
  path: {path}
options:
  max_sequences: 2
  max_length: 2048   # past the window + 511: the sliding layers keep rings
  prefix_cache_mb: 16
  kv_cache: q8_0
  threads: 2
speculative: {{drafters: [ngram]}}
""", "gemma.yaml")
    server = server_factory([manifest], ["outrider_llm", "outrider_speculative"],
                            env={"OUTRIDER_CACHE_DIR": str(tmp_path / "cache")})
    with server.client(timeout=120) as client:
        instance = client.health()["models"]["gemma"]["instances"][0]
        assert instance["backend"]["runtime"] == "native", instance
        assert instance["backend"]["kv_cache"]["dtype"] == "q8_0"
        prompt = TEXT + " " + TEXT
        plain = client.generate("gemma", prompt=prompt, max_tokens=24, speculative=False)
        drafted = client.generate("gemma", prompt=prompt, max_tokens=24, speculative=True)
        assert plain.token_ids == drafted.token_ids and len(plain.token_ids) > 0
        chat = client.generate("gemma", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
        assert len(chat.token_ids) >= 1


def test_a_draft_head_trains_on_the_native_runtime_and_drafts_gemma_exactly(tmp_path, monkeypatch):
    """tools/train_draft.py --gguf on a Gemma file, which the native runtime alone serves: the target is
    read through HostTarget (its features are what the server computes), the head's LM rows are the
    tied head's (Gemma's input embeddings are those rows times sqrt(hidden)), and the head then loads
    on the served model by its fingerprint and drafts with the greedy output unchanged."""
    import sys
    import time
    from pathlib import Path

    import torch

    _native_c()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from outrider_draft_training import cli
    from outrider_draft_training.features import Features
    from outrider_draft_training.host_target import HostTarget
    from outrider_draft_training.trainer import TrainConfig, Trainer
    from test_generate import _engine, _run
    from train_draft import load_target

    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = write_tiny_gemma3_gguf(tmp_path, seed=9)
    target, target_tokenizer = load_target(path)
    assert isinstance(target, HostTarget)
    tokens = torch.tensor([0, 5, 77])
    rows, embeds = target.lm_head_rows(tokens), target.embed(tokens)
    assert torch.equal(embeds, rows * np.float32(np.sqrt(np.float32(target.hidden_size))))
    out, data = tmp_path / "head.safetensors", tmp_path / "features.safetensors"
    args = cli.build_parser().parse_args([
        "--gguf", str(path), "--minutes", "0.6", "--gen-minutes", "0.05", "--text-minutes", "0.03", "--out", str(out),
        "--data-cache", str(data), "--batch-sequences", "8", "--draft-vocab", "128", "--intermediate", "64"])
    assert cli.run(args, target, target_tokenizer, f"{path.stem} ({path.name})", time.monotonic()) == 0
    trainer = Trainer(target, Features.load(str(data)), TrainConfig(draft_vocab=128, intermediate_size=64))
    assert torch.equal(trainer.lm_rows, target.lm_head_rows(trainer.draft_vocab))

    model, tokenizer = _ours(path, tmp_path)
    params = [{"prompt": p, "max_tokens": 24} for p in (TEXT, "the cat the cat the cat")]
    plain = _run(_engine(model, tokenizer, speculative=False), params)
    spec = _run(_engine(model, tokenizer, speculative=True, drafters=["eagle"], eagle={"weights": str(out)}), params)
    assert [spec.final[i]["token_ids"] for i in range(2)] == [plain.final[i]["token_ids"] for i in range(2)]
    assert sum(spec.final[i]["stats"]["draft_tokens"] for i in range(2)) > 0  # the head did draft


def test_what_is_not_served_is_refused_saying_why(tmp_path):
    """A Gemma 3 with a float matrix (the native runtime serves it from block types alone), and the
    conversion for the torch model asked for it, each fail once with the reason."""
    from outrider.artifacts import ArtifactCache
    from outrider_llm.artifact import GGUFError
    from outrider_llm.conversion import load_native_artifact
    from outrider_llm.gguf_tiles import load_gguf_tiles

    _native_c()
    path, _ = write_tiny_gemma3_gguf(tmp_path, seed=8, types={"ffn_up.weight": "F16"})
    with pytest.raises(GGUFError, match=r"blk.0.ffn_up.weight\) is F16.*gemma3 is served from the file's blocks alone"):
        load_gguf_tiles(path, ArtifactCache(tmp_path / "a"), in_child=False)
    with pytest.raises(GGUFError, match="gemma3 is served by the torch-free native runtime alone"):
        load_native_artifact(path, ArtifactCache(tmp_path / "b"))


@pytest.fixture
def ring_model(tmp_path, monkeypatch):
    """The tiny Gemma 3 (window 8) with passes of 16 rows: its sliding layers' rings hold 32 rows, so
    a 100-token prompt goes in 7 passes and wraps each ring three times."""
    from outrider_llm import native_model

    _native_c()
    monkeypatch.setattr(native_model, "STEP_ROWS", 16)
    path, _ = write_tiny_gemma3_gguf(tmp_path, seed=10, types=REAL_MIX, matrix_type="Q5_0")
    model, tokenizer = _ours(path, tmp_path)
    model.kv_dtype = np.float16
    return model, tokenizer


@pytest.mark.parametrize("kv", ["float16", "q8_0"])
def test_the_sliding_layers_ring_computes_what_the_whole_cache_does(ring_model, kv):
    from outrider.generation.contract import Chunk
    from outrider_llm.kv_cache import NumpySlotKVCache, RingSlotKVCache

    model, tokenizer = ring_model
    model.kv_dtype = kv
    ids = tokenizer.encode(" ".join([TEXT] * 4))[:100]
    ring, whole = model.new_cache(1, 256), NumpySlotKVCache(model.config, 1, 256, dtype=kv)
    assert isinstance(ring, RingSlotKVCache) and ring.ring_capacity == 32
    outs = []
    for cache in (ring, whole):
        steps = [model.forward(cache, [Chunk(0, np.array(ids), np.arange(len(ids)))]).logits]
        cache.commit(0, list(range(len(ids))))
        pos, token = len(ids), int(steps[0][-1].argmax())
        for _ in range(6):  # one-token steps, then a tree of 4 (root, two children, a grandchild) keeping 2
            steps.append(model.forward(cache, [Chunk(0, np.array([token]), np.array([pos]))]).logits)
            cache.commit(0, [0])
            pos, token = pos + 1, int(steps[-1][-1].argmax())
        mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool)
        tree = np.array([token, 7, 9, 11])
        steps.append(model.forward(cache, [Chunk(0, tree, pos + np.array([0, 1, 1, 2]), mask)]).logits)
        cache.commit(0, [0, 2])
        steps.append(model.forward(cache, [Chunk(0, np.array([5]), np.array([pos + 2]))]).logits)
        outs.append(steps)
    for got, want in zip(*outs):
        assert np.array_equal(got, want)
    assert ring.nbytes < whole.nbytes / 2  # 6 of 7 layers hold 32 rows, not 256 (the growth step)
    assert ring.valid_from(0) > 0


def test_a_ring_grows_with_its_sequence_and_computes_what_the_whole_cache_does(ring_model, monkeypatch):
    """A short sequence's ring holds its rows, not a whole window's: it grows with the sequence (and
    with a second slot joining) until full size, then wraps, and every step's logits stay those of
    the whole cache."""
    from outrider.generation.contract import Chunk
    from outrider_llm import kv_cache
    from outrider_llm.kv_cache import NumpySlotKVCache

    model, tokenizer = ring_model
    monkeypatch.setattr(kv_cache, "GROWTH_STEP", 8)
    ids = tokenizer.encode(TEXT)[:5]
    ring, whole = model.new_cache(2, 256), NumpySlotKVCache(model.config, 2, 256, dtype=np.float16)
    outs, sizes = [], []
    for cache in (ring, whole):
        steps = []
        for slot in (0, 1):
            steps.append(model.forward(cache, [Chunk(slot, np.array(ids), np.arange(len(ids)))]).logits)
            cache.commit(slot, list(range(len(ids))))
            if cache is ring:
                sizes.append(ring.ring.shape[4])
        tokens, pos = [int(steps[0][-1].argmax())] * 2, len(ids)
        for step in range(50):  # both slots one token a step: past the ring's 32 rows
            chunks = [Chunk(slot, np.array([tokens[slot]]), np.array([pos])) for slot in (0, 1)]
            logits = model.forward(cache, chunks).logits
            steps.append(logits)
            for slot in (0, 1):
                cache.commit(slot, [0])
                tokens[slot] = int(logits[slot].argmax()) if slot == 0 else (tokens[slot] * 7 + step) % 50
            pos += 1
            if cache is ring:
                sizes.append(ring.ring.shape[4])
        outs.append(steps)
    for got, want in zip(*outs):
        assert np.array_equal(got, want)
    assert sizes[0] == 8 and sorted(set(sizes)) == [8, 16, 32], sizes  # grown in steps to full size, no further
    assert ring.valid_from(0) > 0


def test_speculation_and_the_prefix_cache_are_exact_over_the_ring(ring_model):
    from outrider.generation.prefix_cache import PrefixCache

    from test_generate import _engine, _run

    model, tokenizer = ring_model
    prompt = " ".join([TEXT] * 5)  # about 100 tokens: past the rings' 32 rows
    first = _run(_engine(model, tokenizer, speculative=False), [{"prompt": prompt, "max_tokens": 20}])
    chat = [prompt, prompt + first.final[0]["text"] + " and the cat"]  # a conversation resent with its answer
    fresh = _run(_engine(model, tokenizer, speculative=False), [{"prompt": p, "max_tokens": 20} for p in chat])
    for speculative in (False, True):
        engine = _engine(model, tokenizer, speculative=speculative)
        engine.prefix_cache = PrefixCache(1 << 24)
        got = [_run(engine, [{"prompt": p, "max_tokens": 20}]).final[0] for p in chat]
        assert [g["token_ids"] for g in got] == [fresh.final[i]["token_ids"] for i in range(2)], speculative
        assert got[0]["stats"]["cached_tokens"] == 0
        # the resent chat finds its prompt and answer: the blocks whose last 8 positions the rings held
        assert got[1]["stats"]["cached_tokens"] >= 96, got[1]["stats"]
