"""Generation: the engine on a tiny random Llama (exact checks, distributions) and SmolLM2 served end to end."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from outrider.errors import BadRequestError, CancelledError  # noqa: E402
from outrider.manifest import validate_manifest  # noqa: E402
from outrider.model import PendingRequest  # noqa: E402
from outrider.plugins import create_registry  # noqa: E402

from conftest import MANIFESTS  # noqa: E402


class CharTokenizer:
    """Token i <-> the i-th character of a small alphabet; no end-of-sequence token."""

    def __init__(self, vocab_size: int) -> None:
        self.alphabet = "abcdefghijklmnopqrstuvwxyz .,!?-0123456789"[:vocab_size]
        self.eos_token_ids: set[int] = set()
        self.bos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [self.alphabet.index(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i] for i in ids)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(m["content"] for m in messages)


class Capture:
    """Stands in for the server's reply path: records chunks and the final reply of each request."""

    def __init__(self) -> None:
        self.chunks: dict = {}
        self.final: dict = {}

    def send(self, request, kind, header, outputs) -> None:
        if kind == "chunk":
            self.chunks.setdefault(request.id, []).append(header)
        else:
            assert request.id not in self.final, "two final replies"
            self.final[request.id] = header


def _strategy(manifest_extra: dict | None = None):
    manifest = validate_manifest({"name": "t", "backend": "llm", "speculative": {"drafters": ["ngram"], **(manifest_extra or {})}})
    registry = create_registry(["outrider_llm", "outrider_speculative"], load_entry_points=False)
    return registry.accelerators_for(manifest, registry.backends["llm"])["speculative"].for_instance()


def _engine(model, tokenizer, speculative: bool, max_sequences: int = 4, **spec):
    from outrider.generation.engine import GenerationEngine

    strategy = _strategy(spec) if speculative else None
    if strategy is not None:
        strategy.attach(model, tokenizer)
    return GenerationEngine(model, tokenizer, strategy, max_sequences=max_sequences, max_length=256)


def _run(engine, parameter_sets: list[dict]) -> Capture:
    capture = Capture()
    requests = [PendingRequest(b"r", i, "generate", "t", {}, params, capture.send) for i, params in enumerate(parameter_sets)]
    engine.admit(requests)
    for _ in range(10_000):
        if not engine.busy():
            break
        engine.step()
    assert not engine.busy()
    assert len(engine.free_slots) == engine.max_sequences, "a finished sequence kept its cache slot"
    return capture


@pytest.fixture(scope="module")
def tiny():
    from outrider_llm.loading import tiny_random_llama

    torch.set_num_threads(1)
    return tiny_random_llama(vocab_size=16, hidden_size=32, num_layers=2, seed=3), CharTokenizer(16)


PROMPTS = ["abcabcabcabc", "hellohellohello", "aaaaaaa", "ponmlkjihgfedcba", "ababcdcdababcd"]


def test_greedy_speculative_tokens_equal_plain(tiny):
    model, tokenizer = tiny
    params = [{"prompt": p, "max_tokens": 40} for p in PROMPTS]
    plain = _run(_engine(model, tokenizer, speculative=False), params)
    spec = _run(_engine(model, tokenizer, speculative=True), params)
    accepted = 0
    for i in range(len(PROMPTS)):
        assert spec.final[i]["token_ids"] == plain.final[i]["token_ids"], PROMPTS[i]
        assert spec.final[i]["finish_reason"] == "length"
        accepted += spec.final[i]["stats"]["accepted_tokens"]
    assert accepted > 0, "the drafts were never accepted: this test would not see a wrong accept rule"
    # speculative=False on a request turns it off even on a speculative engine
    off = _run(_engine(model, tokenizer, speculative=True), [{**params[0], "speculative": False}])
    assert off.final[0]["token_ids"] == plain.final[0]["token_ids"]
    assert off.final[0]["stats"]["draft_tokens"] == 0


def _exact_first_tokens(model, prompt_ids: list[int], n: int, vocab: int) -> dict:
    """P(first n generated tokens) at T=1, by enumeration with plain forwards."""
    from outrider.generation.contract import Chunk

    def next_probs(prefix: list[int]) -> torch.Tensor:
        cache = model.new_cache(1, 64)
        out = model.forward(cache, [Chunk(0, torch.tensor(prefix), torch.arange(len(prefix)))])
        return torch.softmax(out.logits[-1].double(), -1)

    table = {}
    for seq in itertools.product(range(vocab), repeat=n):
        p, prefix = 1.0, list(prompt_ids)
        for t in seq:
            p *= float(next_probs(prefix)[t]) if p > 0 else 0.0
            prefix.append(t)
        table[seq] = p
    return table


def _chi_square(counts: Counter, exact: dict, total: int) -> tuple[float, int]:
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for outcome, p in exact.items():
        expected = p * total
        if expected < 5:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(outcome, 0) - expected) ** 2 / expected
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    return stat, df


def _limit(df: int) -> float:
    # Wilson-Hilferty: chi-square quantile at p = 1e-5 (z = 4.27), loose enough never to flake.
    z = 4.27
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _sample_first_tokens(model, tokenizer, prompt: str, n_tokens: int, samples: int, wrong_rule: bool = False) -> Counter:
    # 16 at a time: the speculation budget shrinks as the batch grows, and deep trees are the point here.
    engine = _engine(model, tokenizer, speculative=True, max_sequences=16, adaptive=False)
    if wrong_rule:
        from outrider.generation.verify import Verdict

        def always_accept(tree, logits, params, generator):
            path, node = [], -1
            while True:
                children = [i for i, parent in enumerate(tree.parents) if parent == node]
                if not children:
                    break
                node = children[0]
                path.append(node)
            bonus = int(torch.multinomial(torch.softmax(logits[len(path) and path[-1] + 1], -1), 1, generator=generator))
            return Verdict(accepted=path, tokens=[tree.tokens[i] for i in path], bonus=bonus)

        engine.strategy.verify = always_accept
    counts: Counter = Counter()
    drafted = 0
    for start in range(0, samples, 256):
        # Two tokens more than counted, so drafts reach past the counted ones too.
        batch = [{"prompt": prompt, "max_tokens": n_tokens + 2, "temperature": 1.0, "seed": seed}
                 for seed in range(start, min(samples, start + 256))]
        capture = _run(engine, batch)
        for reply in capture.final.values():
            counts[tuple(reply["token_ids"][:n_tokens])] += 1
            drafted += reply["stats"]["draft_tokens"]
    assert drafted > 2 * samples, "drafts were rarely proposed: the test would not exercise the accept rule"
    return counts


def test_sampling_distribution_is_the_targets(tiny):
    """T=1 with speculation draws the first 3 tokens from exactly the target's distribution,
    and the same check rejects an accept rule that always keeps the draft."""
    from outrider_llm.loading import random_llama_weights, tiny_llama_config
    from outrider_llm.model import LlamaModel

    vocab = 6
    config = tiny_llama_config(vocab, 32, 2, 4, 2)
    weights = random_llama_weights(config, 11)
    # Random init gives near one-hot next-token distributions; a smaller final norm flattens them
    # (top outcome ~0.2), so dozens of outcomes are frequent enough to test.
    weights["model.norm.weight"] = weights["model.norm.weight"] * 0.15
    model = LlamaModel(config, weights)
    tokenizer = CharTokenizer(vocab)
    prompt = "abcabcabcab"  # repetition: the n-gram drafter proposes at almost every step
    exact = _exact_first_tokens(model, tokenizer.encode(prompt), 3, vocab)
    samples = 4096
    counts = _sample_first_tokens(model, tokenizer, prompt, 3, samples)
    stat, df = _chi_square(counts, exact, samples)
    print(f"chi-square {stat:.1f} (df {df}, limit {_limit(df):.1f})")
    assert stat < _limit(df), (stat, df)
    wrong = _sample_first_tokens(model, tokenizer, prompt, 3, samples, wrong_rule=True)
    wrong_stat, _ = _chi_square(wrong, exact, samples)
    print(f"always-accept rule: chi-square {wrong_stat:.1f}")
    assert wrong_stat > _limit(df), (wrong_stat, df)


def test_stream_stop_strings_max_tokens(tiny):
    model, tokenizer = tiny
    engine = _engine(model, tokenizer, speculative=True)
    base = _run(engine, [{"prompt": "hellohello", "max_tokens": 30}]).final[0]
    assert base["finish_reason"] == "length" and len(base["token_ids"]) == 30
    stop = base["text"][10:13]
    first = base["text"].find(stop)
    capture = _run(engine, [{"prompt": "hellohello", "max_tokens": 30, "stop": [stop], "stream": True}])
    final = capture.final[0]
    assert final["finish_reason"] == "stop" and final["text"] == base["text"][:first]
    streamed = "".join(c["text"] for c in capture.chunks[0])
    assert streamed == final["text"]
    assert stop not in streamed


def test_many_requests_share_few_slots_and_cancel_frees_its_slot(tiny):
    model, tokenizer = tiny
    engine = _engine(model, tokenizer, speculative=True, max_sequences=2)
    capture = Capture()
    requests = [PendingRequest(b"r", i, "generate", "t", {}, {"prompt": PROMPTS[i % 5], "max_tokens": 20}, capture.send)
                for i in range(6)]
    engine.admit(requests)
    engine.step()
    assert len(engine.active) == 2 and not engine.free_slots
    requests[0].fail(CancelledError("cancelled by the test"))
    engine.step()
    assert requests[0] not in [s.request for s in engine.active]
    while engine.busy():
        engine.step()
    assert len(engine.free_slots) == 2
    assert set(capture.final) == set(range(6))
    assert capture.final[0]["error"]["code"] == "cancelled"
    assert all(capture.final[i]["ok"] for i in range(1, 6))


def test_bad_parameters_fail_only_their_request(tiny):
    model, tokenizer = tiny
    capture = _run(_engine(model, tokenizer, speculative=True), [
        {"prompt": "abc", "max_tokens": 0},
        {"prompt": "abc", "temperature": -1},
        {"prompt": "abc", "messages": [{"role": "user", "content": "x"}]},
        {"prompt": "abc", "stop": ["x" * 100]},
        {"prompt": "abc", "max_tokens": 3},
    ])
    for i, fragment in enumerate(["max_tokens", "temperature", "exactly one of", "stop"]):
        assert capture.final[i]["ok"] is False and fragment in capture.final[i]["error"]["message"], capture.final[i]
    assert capture.final[4]["ok"] and len(capture.final[4]["token_ids"]) == 3


# -- SmolLM2 served for real -----------------------------------------------------------------

SMOL_PLUGINS = ["outrider_llm", "outrider_speculative"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    pytest.importorskip("gguf")
    from conftest import start_server

    server = start_server(tmp_path_factory.mktemp("smol"), [MANIFESTS / "smollm2.yaml"], SMOL_PLUGINS,
                          args=["--set", "options.max_sequences=4", "--set", "options.max_length=1024"])
    try:
        server.wait_ready(timeout=600)
        yield server
    finally:
        server.stop()


CODE_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def test_smollm2_greedy_speculative_equals_plain_and_streams(smollm2):
    with smollm2.client(timeout=300) as client:
        spec = client.generate("smollm2", prompt=CODE_PROMPT, max_tokens=48)
        plain = client.generate("smollm2", prompt=CODE_PROMPT, max_tokens=48, speculative=False)
        chunks = list(client.generate("smollm2", prompt=CODE_PROMPT, max_tokens=48, stream=True))
        chat = client.generate("smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=16)
        with pytest.raises(BadRequestError, match="top_p"):
            client.generate("smollm2", prompt="x", top_p=2.0)
        health = client.health()["models"]["smollm2"]
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.text.strip() and spec.finish_reason in ("length", "stop")
    assert plain.stats["draft_tokens"] == 0
    for key in ("new_tokens", "steps", "draft_tokens", "accepted_tokens", "seconds", "mean_accepted_length"):
        assert key in spec.stats
    final = chunks[-1]
    assert "".join(c.text for c in chunks[:-1]) == final.text == spec.text
    assert chat.text.strip()
    assert health["stats"]["extra"]["generated_tokens"] >= 48 * 3


def test_smollm2_concurrent_generations_all_finish(smollm2):
    import asyncio

    from outrider import AsyncClient

    async def run():
        async with AsyncClient(smollm2.address, timeout=300) as client:
            return await asyncio.gather(*[
                client.generate("smollm2", prompt=f"List {n} colors:", max_tokens=12, temperature=0.8, seed=n)
                for n in range(6)
            ])

    results = asyncio.run(run())
    assert len(results) == 6 and all(r.token_ids for r in results)


def test_cli_generate_streams(smollm2):
    result = subprocess.run([sys.executable, "-m", "outrider.cli", "generate", "smollm2", "The capital of France is",
                             "--connect", smollm2.address, "--max-tokens", "8", "--stats"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert '"new_tokens"' in result.stderr
