"""Automatic prefix caching: blocks by prefix hash within a budget (LRU), reused exactly.

- The block store alone: keys name whole prefixes, lookups leave a token to prefill, the budget
  holds with the least recently used evicted first and no reachable child stranded.
- The engine on the tiny random Llama: a request that starts with a cached prefix generates what
  it would from scratch, plain and speculative, and says how many tokens were cached.
- SmolLM2 (smollm2-int8, native int4 kernels) served for real: a repeated document and a growing
  chat hit the cache, and the log-probabilities after a cached prefix equal those of a fresh
  prefill bit for bit; the counters reach /metrics and the OpenAI usage.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from outrider.generation.prefix_cache import BLOCK_TOKENS, PrefixCache, block_keys  # noqa: E402

from conftest import MANIFESTS  # noqa: E402
from test_generate import CharTokenizer, _engine, _run  # noqa: E402


def _kv(tokens: list[int], start: int, end: int) -> torch.Tensor:
    # A stand-in K/V whose values say which token they belong to: [layers, 2, heads, n, dim].
    return torch.tensor(tokens[start:end], dtype=torch.float32).view(1, 1, 1, -1, 1).expand(2, 2, 1, -1, 4).clone()


def test_blocks_name_whole_prefixes_and_the_budget_evicts_least_recent_first():
    a = list(range(100))
    b = a[:64] + [999] + a[65:]
    assert block_keys(a)[:2] == block_keys(b)[:2] and block_keys(a)[2] != block_keys(b)[2]
    assert block_keys([7] * 32) != block_keys([7] * 31 + [8])
    per_block = _kv(a, 0, BLOCK_TOKENS).numel() * 4
    cache = PrefixCache(budget_bytes=5 * per_block)
    assert cache.insert(a, lambda s, e: _kv(a, s, e)) == 3  # 100 tokens: 3 full blocks
    found = cache.lookup(a)
    assert len(found) == 3 and torch.equal(found[1].kv[0, 0, 0, :, 0], torch.arange(32, 64, dtype=torch.float32))
    assert len(cache.lookup(a[:96])) == 2, "a lookup must leave the last token to prefill"
    assert len(cache.lookup(b)) == 2
    c = [5000 + i for i in range(96)]
    cache.insert(c, lambda s, e: _kv(c, s, e))  # 3 more blocks: one over the budget
    assert cache.nbytes <= cache.budget_bytes and cache.evicted == 1
    # a's deepest block went (its root and middle were touched after it); a's first two remain
    assert len(cache.lookup(a)) == 2 and len(cache.lookup(c + [1])) == 3
    assert PrefixCache(0).insert(a, lambda s, e: _kv(a, s, e)) == 0


@pytest.fixture(scope="module")
def tiny():
    from outrider_llm.loading import tiny_random_llama

    torch.set_num_threads(1)
    return tiny_random_llama(vocab_size=16, hidden_size=32, num_layers=2, seed=3), CharTokenizer(16)


def test_a_cached_prefix_generates_what_a_fresh_prefill_does(tiny):
    from outrider.generation.engine import GenerationEngine

    model, tokenizer = tiny
    shared = "abcdefghijklmnop" * 5  # 80 tokens: two full blocks
    prompts = [shared + tail for tail in ("abc", "ponm", "hello")]
    answer = _run(_engine(model, tokenizer, speculative=False), [{"prompt": prompts[0], "max_tokens": 16}])
    prompts.append(prompts[0] + answer.final[0]["text"])  # a conversation that resends its last answer
    fresh = _run(_engine(model, tokenizer, speculative=False), [{"prompt": p, "max_tokens": 16} for p in prompts])
    for speculative in (False, True):
        engine = _engine(model, tokenizer, speculative=speculative)
        engine.prefix_cache = PrefixCache(1 << 20)
        first = _run(engine, [{"prompt": prompts[0], "max_tokens": 16}])
        assert first.final[0]["stats"]["cached_tokens"] == 0
        rest = _run(engine, [{"prompt": p, "max_tokens": 16} for p in prompts])
        for i in range(len(prompts)):
            # float matmuls: equal to rounding, which greedy on this model never sees
            assert rest.final[i]["token_ids"] == fresh.final[i]["token_ids"], (speculative, prompts[i])
        # the first request's 83 + 15 committed tokens are cached in 3 blocks: the shared prefix
        # gives 2 to each prompt, and the one that resends the answer reuses all 3
        assert [rest.final[i]["stats"]["cached_tokens"] for i in range(4)] == [64, 64, 64, 96]
    assert isinstance(engine, GenerationEngine)


@pytest.fixture(scope="module")
def smol_int8(tmp_path_factory):
    pytest.importorskip("gguf")
    from conftest import free_port, start_server

    port = free_port()
    plugins = ["outrider_llm", "outrider_speculative", "outrider_quantize", "outrider_http"]
    server = start_server(tmp_path_factory.mktemp("prefix"), [MANIFESTS / "smollm2-int8.yaml"], plugins,
                          args=["--http", f"127.0.0.1:{port}", "--set", "options.max_sequences=4",
                                "--set", "options.max_length=1024"])
    try:
        server.wait_ready(timeout=600)
        server.http_port = port
        yield server
    finally:
        server.stop()


DOCUMENT = ("Outrider is an inference runtime that people put beside their app: a sidecar process, a "
            "runtime on an edge GPU, or the inside of a serverless function container. ") * 12


def test_smollm2_cached_prefix_is_exact_and_counted(smol_int8):
    httpx = pytest.importorskip("httpx")
    with smol_int8.client(timeout=300) as client:
        cold = client.generate("smollm2-int8", prompt=DOCUMENT + "\nQ: what is it?\nA:", max_tokens=16,
                               speculative=False, logprobs=True, top_logprobs=5)
        hot = client.generate("smollm2-int8", prompt=DOCUMENT + "\nQ: what is it?\nA:", max_tokens=16,
                              speculative=False, logprobs=True, top_logprobs=5)
        assert cold.stats["cached_tokens"] == 0 and hot.stats["cached_tokens"] >= hot.stats["prompt_tokens"] - 32
        assert hot.token_ids == cold.token_ids
        assert hot.logprobs == cold.logprobs, "after a cached prefix the logits must equal a fresh prefill's"
        spec = client.generate("smollm2-int8", prompt=DOCUMENT + "\nQ: who uses it?\nA:", max_tokens=16)
        assert spec.stats["cached_tokens"] > 0
        # a chat that resends its history finds its last answer cached too
        messages = [{"role": "user", "content": DOCUMENT + " What is it?"}]
        turn = client.generate("smollm2-int8", messages=messages, max_tokens=24)
        messages += [{"role": "assistant", "content": turn.text}, {"role": "user", "content": "Say more."}]
        second = client.generate("smollm2-int8", messages=messages, max_tokens=8)
        assert second.stats["cached_tokens"] > turn.stats["prompt_tokens"] - 32
    metrics = httpx.get(f"http://127.0.0.1:{smol_int8.http_port}/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) > 0
    body = httpx.post(f"http://127.0.0.1:{smol_int8.http_port}/v1/completions", timeout=120,
                      json={"model": "smollm2-int8", "prompt": DOCUMENT + "\nQ: what is it?\nA:", "max_tokens": 2}).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_prompts_arriving_together_share_one_prefill(tiny):
    """n choices of one prompt (or a burst with one system prompt) admitted in the same step: the
    first prefills, the others wait one step and reuse its blocks; outputs are unchanged."""
    model, tokenizer = tiny
    prompt = "abcdefghijklmnop" * 3
    params = [{"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": s} for s in range(3)]
    alone = _run(_engine(model, tokenizer, speculative=False), params)
    engine = _engine(model, tokenizer, speculative=False)
    engine.prefix_cache = PrefixCache(1 << 20)
    together = _run(engine, params)
    assert [together.final[i]["stats"]["cached_tokens"] for i in range(3)] == [0, 32, 32]
    assert [together.final[i]["token_ids"] for i in range(3)] == [alone.final[i]["token_ids"] for i in range(3)]
