"""Conformance checks for what generates: a generating backend, its model (CausalLM), a decode
strategy and a drafter."""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from ..backend import Backend
from ..manifest import Manifest, validate_manifest
from ..plugins import PluginRegistry, create_registry


def _run_generations(engine: Any, parameter_sets: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(final reply, stream chunks) of each request, run together through `engine` to the end."""
    from ..serving.request import PendingRequest

    finals: dict[int, dict] = {}
    chunks: dict[int, list[dict]] = {i: [] for i in range(len(parameter_sets))}

    def send(request: Any, kind: str, header: dict, outputs: Any) -> None:
        if kind == "chunk":
            chunks[request.id].append(header)
        else:
            assert request.id not in finals, f"request {request.id} was answered twice"
            finals[request.id] = header

    engine.admit([PendingRequest(b"c", i, "generate", "conformance", {}, dict(params), send)
                  for i, params in enumerate(parameter_sets)])
    for _ in range(100_000):
        if not engine.busy():
            break
        engine.step()
    assert not engine.busy(), "the engine did not finish its requests"
    assert sorted(finals) == list(range(len(parameter_sets))), "a request got no final reply"
    return [finals[i] for i in range(len(parameter_sets))], [chunks[i] for i in range(len(parameter_sets))]


def check_generating_backend(backend_class: type[Backend], manifest: Manifest | dict, prompt: str = "Hello, world",
                             registry: Optional[PluginRegistry] = None) -> dict[str, Any]:
    """Run a generating backend (outrider.backend.GeneratingBackend) through its life and the
    generate contract: load and warm up; `tokenizer` follows the Tokenizer protocol; its engine
    answers each request once, with `text`, `token_ids`, `finish_reason` and `stats`; greedy output
    is deterministic and the same alone or batched with others; a seed reproduces a sampled
    output; streamed chunks add up to the final reply; `max_tokens` holds; and a bad parameter
    fails its own request alone. Returns timings and counts."""
    from ..backend import GeneratingBackend
    from ..generation.contract import check_tokenizer

    assert issubclass(backend_class, GeneratingBackend), "a generating backend subclasses GeneratingBackend"
    if isinstance(manifest, dict):
        manifest = validate_manifest(manifest, "<conformance manifest>")
    avail = backend_class.availability(manifest, manifest.device)
    if not avail.available:
        assert avail.reason, "an unavailable backend must say why"
        return {"available": False, "reason": avail.reason}
    registry = registry or create_registry(load_entry_points=False)
    backend = backend_class(manifest, backend_class.resolve_device(manifest.device), registry.make_task(manifest))
    scheduler = backend_class.make_scheduler(manifest)
    for member in ("next_batch", "execute"):
        assert callable(getattr(scheduler, member, None)), f"make_scheduler's object has no {member}()"
    t0 = time.perf_counter()
    backend.prepare_artifact()
    backend.load()
    backend.warmup()
    timings: dict[str, Any] = {"available": True, "load_and_warmup_seconds": time.perf_counter() - t0}
    engine, tokenizer = backend.engine, backend.tokenizer
    assert engine is not None and tokenizer is not None, "after load(), `engine` and `tokenizer` are set"
    check_tokenizer(tokenizer, f"backend {backend_class.name!r}'s tokenizer")

    greedy = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0}
    sampled = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    sets = [greedy, {**greedy, "temperature": -1.0}, {**greedy, "stream": True}, sampled, sampled,
            {**greedy, "max_tokens": 2}]
    finals, chunks = _run_generations(engine, sets)
    alone, _ = _run_generations(engine, [greedy])
    for index, final in enumerate(finals):
        if index == 1:
            continue
        assert final.get("ok", True), f"request {index} failed: {final}"
        assert isinstance(final.get("text"), str) and all(isinstance(t, int) for t in final.get("token_ids", [None]))
        assert final.get("finish_reason") in ("stop", "length"), f"finish_reason {final.get('finish_reason')!r}"
        assert {"prompt_tokens", "new_tokens"} <= set(final.get("stats", {})), "stats lack prompt_tokens/new_tokens"
        assert len(final["token_ids"]) <= sets[index]["max_tokens"], f"request {index} ran past max_tokens"
    failed = finals[1]
    assert not failed.get("ok", True) and failed["error"]["code"] == "bad_request" and \
        "temperature" in failed["error"]["message"], f"a bad temperature was not refused by name: {failed}"
    assert finals[0]["token_ids"] == alone[0]["token_ids"] == finals[2]["token_ids"], \
        "greedy output changed with its batch neighbours or with streaming"
    assert finals[3]["token_ids"] == finals[4]["token_ids"], "the same seed sampled different tokens"
    streamed = chunks[2]
    assert "".join(c.get("text", "") for c in streamed) == finals[2]["text"], "streamed texts do not add up"
    assert [t for c in streamed for t in c.get("token_ids", [])] == finals[2]["token_ids"], \
        "streamed token ids do not add up"
    health = backend.health()
    assert isinstance(health, dict) and health.get("healthy") is True, f"a loaded backend reports {health!r}"
    backend.unload()
    timings["generated_tokens"] = sum(len(f.get("token_ids", [])) for f in finals)
    return timings


def check_causal_lm(model: Any, prompt_ids: list[int], atol: float = 1e-3) -> dict[str, Any]:
    """Check a model against the CausalLM contract the engine and drafters rely on: a prompt's
    logits and hidden rows have the declared shapes; a draft tree fed after the pending token gives
    each node the logits a one-token step on its path alone would (tree attention sees ancestors
    only); committing a subset of the fed rows (`cache.commit(slot, keep)`) leaves the cache as if
    only those tokens had been fed; and `fingerprint()` is a stable string. Inputs are numpy, as
    the engine passes them; outputs may be numpy or torch. Returns the largest difference seen."""
    from ..generation.contract import Chunk, DraftTree
    from ..generation.sampling import host_array

    vocab, hidden_size = int(model.vocab_size), int(model.hidden_size)
    assert model.array_api in ("torch", "numpy"), f"array_api must be 'torch' or 'numpy', got {model.array_api!r}"
    prompt = np.array(prompt_ids, dtype=np.int64)
    n = len(prompt)
    assert n >= 2 and all(0 <= t < vocab for t in prompt_ids), "give a prompt of 2+ ids inside the vocabulary"

    def fresh(ids: list[int]) -> np.ndarray:
        """The last row's logits of `ids` fed at once to a new cache."""
        cache = model.new_cache(1, n + 16)
        out = model.forward(cache, [Chunk(0, np.array(ids, dtype=np.int64), np.arange(len(ids), dtype=np.int64))])
        return host_array(out.logits)[-1]

    cache = model.new_cache(2, n + 16)
    assert cache.num_slots == 2 and cache.max_length >= n + 16 and cache.length(0) == 0
    out = model.forward(cache, [Chunk(0, prompt[:-1], np.arange(n - 1, dtype=np.int64))])
    logits, hidden = host_array(out.logits), host_array(out.hidden)
    assert logits.shape == (n - 1, vocab), f"logits are {logits.shape}, expected {(n - 1, vocab)}"
    assert hidden.shape == (n - 1, hidden_size), f"hidden rows are {hidden.shape}, expected {(n - 1, hidden_size)}"
    cache.commit(0, list(range(n - 1)))
    assert cache.length(0) == n - 1, f"after committing {n - 1} rows the slot holds {cache.length(0)}"
    a = int(np.argmax(fresh(prompt_ids)))  # the likely next token, and another
    b = (a + 1) % vocab
    tree = DraftTree(tokens=[a, b, a], parents=[-1, -1, 1], probs=[1.0] * 3)  # two branches, one deeper
    fed = np.array([prompt_ids[-1], *tree.tokens], dtype=np.int64)
    positions = n - 1 + np.array([0, *tree.depths()], dtype=np.int64)
    rows = host_array(model.forward(cache, [Chunk(0, fed, positions, tree.mask())]).logits)
    worst = 0.0
    for row, path in ((0, []), (1, [a]), (2, [b]), (3, [b, a])):
        reference = fresh([*prompt_ids, *path])
        scale = max(1.0, float(np.abs(reference).max()))
        worst = max(worst, float(np.abs(rows[row] - reference).max()) / scale)
        assert worst <= atol, f"tree row {row} (path {path}) differs from its path fed alone by {worst:.2e} (relative)"
    cache.commit(0, [0, 2])  # keep the pending token and the branch b only
    assert cache.length(0) == n + 1, f"after keeping 2 of 4 fed rows the slot holds {cache.length(0)}, not {n + 1}"
    after = host_array(model.forward(cache, [Chunk(0, np.array([a], dtype=np.int64),
                                                   np.array([n + 1], dtype=np.int64))]).logits)[-1]
    reference = fresh([*prompt_ids, b, a])
    drift = float(np.abs(after - reference).max()) / max(1.0, float(np.abs(reference).max()))
    assert drift <= atol, f"after a partial commit the next step differs from a fresh feed by {drift:.2e} (relative)"
    cache.reset(0)
    assert cache.length(0) == 0, "reset(slot) must empty the slot"
    assert isinstance(model.fingerprint(), str) and model.fingerprint() == model.fingerprint(), \
        "fingerprint() must be a stable string"
    return {"max_relative_difference": max(worst, drift)}


def check_decode_strategy(registry: PluginRegistry, manifest: Manifest | dict, model: Any, tokenizer: Any,
                          prompts: list[str], max_tokens: int = 24) -> dict[str, Any]:
    """Run the decode strategy `manifest` turns on through the engine: greedy output with it is the
    model's own, token for token, for prompts served together, and it leaves nothing behind (every
    slot free, a second run the same). Returns the draft and accepted token counts."""
    from ..generation.engine import GenerationEngine

    if isinstance(manifest, dict):
        manifest = validate_manifest(manifest, "<conformance manifest>")
    strategy = registry.accelerators_for(manifest, registry.choose_backend(manifest).backend).decode_strategy
    assert strategy is not None, f"manifest {manifest.name!r} turns on no decode strategy"
    strategy = strategy.for_instance()
    strategy.attach(model, tokenizer)
    sets = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0.0} for p in prompts]
    length = max(len(tokenizer.encode(p)) for p in prompts) + max_tokens + 16
    runs = []
    for strat in (None, strategy, strategy):
        engine = GenerationEngine(model, tokenizer, strat, max_sequences=len(prompts), max_length=length)
        finals, _ = _run_generations(engine, sets)
        assert len(engine.free_slots) == len(prompts), "a finished sequence kept its slot"
        runs.append(finals)
    for index, prompt in enumerate(prompts):
        plain, drafted, again = (run[index] for run in runs)
        assert drafted["token_ids"] == plain["token_ids"] == again["token_ids"], \
            f"greedy output with the strategy differs from the model's own for prompt {prompt!r}"
    return {"draft_tokens": sum(f["stats"]["draft_tokens"] for f in runs[1]),
            "accepted_tokens": sum(f["stats"]["accepted_tokens"] for f in runs[1])}


class _View:
    """A SequenceView for `check_drafter` (what the engine's Sequence offers a drafter)."""

    def __init__(self, seq_id: str, token_ids: list[int], params: Any, generator: Any) -> None:
        self.seq_id, self.token_ids, self.prompt_length = seq_id, list(token_ids), len(token_ids)
        self.params, self.generator, self.last_hidden, self.new_features = params, generator, None, None


def check_drafter(registry: PluginRegistry, name: str, model: Any, tokenizer: Any, prompt_ids: list[int],
                  options: Optional[dict] = None, steps: int = 12) -> dict[str, Any]:
    """Run a registered drafter against the drafter contract (outrider.generation.contract.Drafter) on a
    real target `model` and `tokenizer`, and check what it proposes; returns counts.

    Its factory is called as `factory(model, options, DrafterContext(tokenizer))`; each proposal must
    be a well-formed tree (parents before children, lengths agreeing, sampled groups on existing
    nodes with a q over the vocabulary) of at most `budget` nodes, for greedy and for sampling
    parameters; `start`, `observe` and `finish` (where defined) must take a sequence's life; and the
    engine's greedy output with the drafter must be the target's own, token for token (two sequences
    a step; a drafter with `propose_batch` also gets two sequences at once directly). The kit's own
    sequences carry no hidden states (`last_hidden`, `new_features` are None): a drafter that reads
    them proposes empty trees there, which is valid, and drafts in the engine part."""
    from ..generation.contract import DrafterContext, StepOutcome
    from ..generation.engine import GenerationEngine
    from ..generation.sampling import SamplingParams, new_generator

    assert name in registry.drafters, f"no plugin registers drafter {name!r} (known: {sorted(registry.drafters)})"
    drafter = registry.drafters[name](model, dict(options or {}), DrafterContext(tokenizer=tokenizer))
    assert callable(getattr(drafter, "propose", None)), f"drafter {name!r} has no propose(seq, budget)"
    counts = {"proposals": 0, "nodes": 0, "sampled_groups": 0}
    vocab = int(model.vocab_size)
    for label, params in (("greedy", SamplingParams(temperature=0.0)),
                          ("sampling", SamplingParams(temperature=1.0, seed=3))):
        view = _View(f"conformance-{label}", prompt_ids, params, new_generator(params.seed))
        if hasattr(drafter, "start"):
            drafter.start(view)
        for step in range(steps):
            budget = 1 + step % 8
            tree = drafter.propose(view, budget)
            n = len(tree.tokens)
            _check_tree(name, tree, budget, vocab, counts)
            new = [int(tree.tokens[0])] if n else [int(prompt_ids[-1])]  # as if the first node were accepted
            view.token_ids += new
            if hasattr(drafter, "observe"):
                drafter.observe(view, StepOutcome("decode", n, min(1, n), new))
        if hasattr(drafter, "finish"):
            drafter.finish(view)
    if callable(getattr(drafter, "propose_batch", None)):  # several sequences of one step at once
        views = [_View(f"conformance-batch-{i}", prompt_ids[:len(prompt_ids) - i], params, new_generator(i))
                 for i, params in enumerate((SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)))]
        trees = drafter.propose_batch([(view, 2 + 2 * i) for i, view in enumerate(views)])
        assert len(trees) == len(views), f"{name}: propose_batch gave {len(trees)} trees for {len(views)} sequences"
        for i, (view, tree) in enumerate(zip(views, trees)):
            _check_tree(name, tree, 2 + 2 * i, vocab, counts)
            if hasattr(drafter, "finish"):
                drafter.finish(view)

    # Through the engine: greedy output with the drafter is the target's, two sequences a step.
    generating = [b for b in registry.backends.values() if b.generates]
    assert generating, "no plugin registers a generating backend to run the drafter under"
    manifest = validate_manifest({"name": "conformance", "backend": generating[0].name,
                                  "speculative": {"drafters": [name], "cost_gate": False, name: dict(options or {})}})
    strategy = registry.accelerators_for(manifest, generating[0]).decode_strategy
    assert strategy is not None, "no plugin registers a decode strategy (the speculative plugin) to run the drafter in"
    strategy = strategy.for_instance()
    strategy.attach(model, tokenizer)
    outputs = []
    requests = [{"prompt": tokenizer.decode(prompt_ids[:len(prompt_ids) - i]), "max_tokens": 24, "temperature": 0.0}
                for i in range(2)]
    for strat in (None, strategy):
        engine = GenerationEngine(model, tokenizer, strat, max_sequences=2, max_length=len(prompt_ids) + 64)
        finals, _ = _run_generations(engine, requests)
        assert all(finals[i].get("ok", True) for i in range(2)), f"{name}: a generation failed: {finals}"
        outputs.append(finals)
    for i in range(2):
        assert outputs[1][i]["token_ids"] == outputs[0][i]["token_ids"], \
            f"{name}: greedy output with the drafter differs from the target's: {outputs[1][i]['token_ids']} vs " \
            f"{outputs[0][i]['token_ids']}"
    counts["engine_draft_tokens"] = sum(outputs[1][i]["stats"]["draft_tokens"] for i in range(2))
    return counts


def _check_tree(name: str, tree: Any, budget: int, vocab: int, counts: dict[str, Any]) -> None:
    """Assert `tree` is a well-formed proposal of at most `budget` nodes; count it."""
    from ..generation.contract import sampled_groups

    n = len(tree.tokens)
    assert len(tree.parents) == n and (not tree.probs or len(tree.probs) == n), \
        f"{name}: {n} tokens, {len(tree.parents)} parents, {len(tree.probs)} probs"
    assert n <= budget, f"{name}: proposed {n} nodes for a budget of {budget}"
    assert all(-1 <= p < i for i, p in enumerate(tree.parents)), f"{name}: a parent comes after its child"
    assert all(0 <= t < vocab for t in tree.tokens), f"{name}: a drafted token is outside the vocabulary"
    for parent, groups in sampled_groups(tree).items():
        assert -1 <= parent < n, f"{name}: a sampled group under missing node {parent}"
        for group in groups:
            q = np.asarray(group.q)
            assert q.shape == (vocab,) and np.all(q >= 0) and q.sum() > 0, \
                f"{name}: a sampled q is not a distribution over the vocabulary"
            assert all(q[t] > 0 for t in group.draws), f"{name}: a draw has q = 0"
        counts["sampled_groups"] += len(groups)
    counts["proposals"] += 1
    counts["nodes"] += n
