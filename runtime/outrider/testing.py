"""Conformance checks for backend plugins, for third-party authors and the built-ins alike.

Use from pytest:

    from outrider.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        plugins = ["my_plugin"]                     # modules to register
        manifest = {"name": "m", "backend": "mine", "inputs": [...], "outputs": [...]}
        sample_inputs = {"x": np.ones((2, 4), np.float32)}

or call `check_backend(...)` directly; every failure is an AssertionError that says what is wrong.
A generating backend has `check_generating_backend` (and its model `check_causal_lm`), a front
`check_front`, a drafter `check_drafter`, a tokenizer `outrider.generation.contract.check_tokenizer`.

Running a real server (`ServerProcess`, `free_port`, `rss_mb`, `tree_rss_mb`) is `outrider.harness`'s,
re-exported here.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from .backend import Availability, Backend, warmup_inputs
from .harness import ServerProcess, free_port, process_tree, rss_mb, tree_rss_mb  # noqa: F401  (re-exported)
from .manifest import Manifest, TensorSpec, validate_manifest
from .plugins import PluginRegistry, create_registry
from .protocol import datatype_of


def _check_outputs(manifest: Manifest, inputs: dict[str, np.ndarray], outputs: Any) -> None:
    assert isinstance(outputs, dict), f"execute must return a dict of arrays, got {type(outputs).__name__}"
    for name, value in outputs.items():
        assert isinstance(value, np.ndarray), f"output {name!r} is {type(value).__name__}, expected numpy.ndarray"
    batch = next((v.shape[0] for v in inputs.values() if v.ndim), None)
    for spec in manifest.outputs:
        assert spec.name in outputs, f"output {spec.name!r} declared in the manifest is missing; got {sorted(outputs)}"
        _check_spec(spec, outputs[spec.name], batch)


def _check_spec(spec: TensorSpec, value: np.ndarray, batch: Optional[int]) -> None:
    got = datatype_of(value)
    assert got == spec.datatype, f"output {spec.name!r} is {got}, manifest says {spec.datatype}"
    assert value.ndim == len(spec.shape), f"output {spec.name!r} has shape {value.shape}, manifest says {spec.shape}"
    for i, (dim, want) in enumerate(zip(value.shape, spec.shape)):
        assert want in (-1, dim), f"output {spec.name!r} dim {i} is {dim}, manifest says {want}"
    if batch is not None and spec.shape and spec.shape[0] == -1:
        assert value.shape[0] == batch, f"output {spec.name!r} has batch {value.shape[0]}, inputs had {batch}"


def _close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if a.dtype == object or b.dtype == object:
        assert a.tolist() == b.tolist(), f"{what}: outputs differ"
    else:
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4, err_msg=what)


def check_backend(
    backend_class: type[Backend],
    manifest: Manifest | dict,
    sample_inputs: Optional[dict[str, np.ndarray]] = None,
    registry: Optional[PluginRegistry] = None,
    device: Optional[str] = None,
) -> dict[str, Any]:
    """Run a backend through its whole lifecycle and check each step; returns timings."""
    assert isinstance(backend_class, type) and issubclass(backend_class, Backend), "backend must subclass Backend"
    assert backend_class.name, "backend class needs a non-empty `name`"
    if isinstance(manifest, dict):
        manifest = validate_manifest(manifest, "<conformance manifest>")
    t0 = time.perf_counter()
    avail = backend_class.availability(manifest, manifest.device)
    assert isinstance(avail, Availability), "availability() must return an Availability"
    assert time.perf_counter() - t0 < 5.0, "availability() must be cheap (it runs on every start)"
    if not avail.available:
        assert avail.reason, "an unavailable backend must say why"
        return {"available": False, "reason": avail.reason}
    registry = registry or create_registry(load_entry_points=False)
    task = registry.make_task(manifest)
    backend = backend_class(manifest, device or backend_class.resolve_device(manifest.device), task)
    timings: dict[str, Any] = {"available": True}
    t0 = time.perf_counter()
    backend.prepare_artifact()  # as the core does: the manifest's artifact transforms, then load
    backend.load()
    timings["load_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    backend.warmup()
    timings["warmup_seconds"] = time.perf_counter() - t0

    inputs = sample_inputs or warmup_inputs(manifest)
    first = backend.execute(inputs)
    _check_outputs(manifest, inputs, first)
    again = backend.execute(inputs)
    for name in first:
        _close(first[name], again[name], f"output {name!r} differs between two identical calls")

    # Batch consistency: the batcher concatenates requests, so rows must not depend on each other.
    batchable = manifest.inputs and all(s.shape and s.shape[0] == -1 for s in manifest.inputs)
    if batchable and all(v.shape[0] >= 2 for v in inputs.values()):
        one = backend.execute({k: v[:1] for k, v in inputs.items()})
        for name in one:
            _close(one[name], first[name][:1], f"output {name!r} of row 0 depends on the other rows of the batch")

    health = backend.health()
    assert isinstance(health, dict) and isinstance(health.get("healthy"), bool), \
        f"health() must return a dict with a boolean 'healthy', got {health!r}"
    assert health["healthy"], f"a loaded backend reports unhealthy: {health}"
    assert isinstance(backend.metadata(), dict), "metadata() must return a dict"
    backend.unload()
    return timings


class BackendConformance:
    """pytest mixin: set `plugins`, `backend` (name), `manifest` and optionally `sample_inputs`."""

    plugins: list[str] = []
    backend: str = ""
    manifest: dict = {}
    sample_inputs: Optional[dict[str, np.ndarray]] = None

    def _registry(self) -> PluginRegistry:
        return create_registry(modules=self.plugins, load_entry_points=False)

    def test_registers_backend(self) -> None:
        registry = self._registry()
        assert self.backend in registry.backends, f"no plugin in {self.plugins} registers backend {self.backend!r}"

    def test_lifecycle(self) -> None:
        import pytest

        registry = self._registry()
        result = check_backend(registry.backends[self.backend], self.manifest, self.sample_inputs, registry)
        if not result["available"]:
            pytest.skip(f"backend {self.backend!r} unavailable here: {result['reason']}")


def _run_generations(engine: Any, parameter_sets: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(final reply, stream chunks) of each request, run together through `engine` to the end."""
    from .serving.request import PendingRequest

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
    from .backend import GeneratingBackend
    from .generation.contract import check_tokenizer

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
    from .generation.contract import Chunk, DraftTree
    from .generation.sampling import host_array

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


SUBMITTER_MEMBERS = ("limits", "started", "models", "ready", "health", "submit", "cancel", "find_model", "repository")


class SubmitterView:
    """The server as a front may see it: the `Submitter` members and nothing else (any other
    attribute is an AttributeError naming it), with each submit and its replies counted."""

    def __init__(self, server: Any) -> None:
        self._server = server
        self.submitted = 0
        self.replied = 0

    def __getattr__(self, name: str) -> Any:
        if name not in SUBMITTER_MEMBERS:
            raise AttributeError(f"a front used server.{name}, which is not part of outrider.front.Submitter "
                                 f"({', '.join(SUBMITTER_MEMBERS)})")
        return getattr(self._server, name)

    def submit(self, *args: Any, on_reply: Any, **kwargs: Any) -> Any:
        assert isinstance(kwargs.get("client"), bytes), "submit(client=...) must be the connection's key (bytes)"
        self.submitted += 1

        def counted(header: dict, outputs: Any) -> None:
            self.replied += 1
            on_reply(header, outputs)

        return self._server.submit(*args, on_reply=counted, **kwargs)


def check_front(front_class: type, roundtrip: Callable[[str], Any], address: str,
                manifests: Optional[list[Manifest | dict]] = None, registry: Optional[PluginRegistry] = None,
                options: Optional[dict] = None, stop_timeout: float = 5.0) -> dict[str, Any]:
    """Run a front plugin (outrider.front.Front) beside a real server: it is built on the server
    seen only through `Submitter` (SubmitterView), listens once `start()` returns, takes the
    request `roundtrip(address)` sends in its own protocol (an echo model is served unless
    `manifests` say otherwise) through `submit` with its client key, hands each reply back, and
    `stop()` returns within `stop_timeout` with the address released. Returns counts."""
    import socket
    import tempfile

    from .front import Front
    from .server import Server, ServerConfig

    assert isinstance(front_class, type) and issubclass(front_class, Front) and front_class.name, \
        "a front subclasses outrider.front.Front and has a name"
    available, why = front_class.availability()
    if not available:
        assert why, "an unavailable front must say why"
        return {"available": False, "reason": why}
    registry = registry or create_registry(load_entry_points=False)
    models = [validate_manifest(m, "<conformance manifest>") if isinstance(m, dict) else m
              for m in (manifests or [{"name": "echo", "backend": "echo"}])]
    with tempfile.TemporaryDirectory() as directory:
        server = Server(models, registry, ServerConfig(address=f"ipc://{directory}/conformance.sock"))
        server.start()
        try:
            deadline = time.monotonic() + 120
            while not server.ready:
                assert time.monotonic() < deadline, "the conformance server's models did not get ready"
                time.sleep(0.05)
            view = SubmitterView(server)
            front = front_class(view, address, options or {})
            front.start()
            try:
                roundtrip(address)
                assert view.submitted >= 1, "the request did not reach server.submit"
                assert view.replied == view.submitted, f"{view.submitted} submitted, {view.replied} answered"
            finally:
                t0 = time.perf_counter()
                front.stop(stop_timeout)
                stopped = time.perf_counter() - t0
            assert stopped < stop_timeout + 1.0, f"stop() took {stopped:.1f} s; the limit was {stop_timeout} s"
        finally:
            server.shutdown(1.0)
    host, _, port = address.rpartition(":")
    if port.isdigit():  # a TCP address must be free again
        with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as probe:
            probe.bind((host.strip("[]"), int(port)))
    return {"available": True, "submitted": view.submitted, "stop_seconds": stopped}


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
    engine's greedy output with the drafter must be the target's own, token for token. The kit's own
    sequences carry no hidden states (`last_hidden`, `new_features` are None): a drafter that reads
    them proposes empty trees there, which is valid, and drafts in the engine part."""
    from .generation.contract import DrafterContext, StepOutcome, sampled_groups
    from .generation.engine import GenerationEngine
    from .generation.sampling import SamplingParams, new_generator
    from .serving.request import PendingRequest

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
            new = [int(tree.tokens[0])] if n else [int(prompt_ids[-1])]  # as if the first node were accepted
            view.token_ids += new
            if hasattr(drafter, "observe"):
                drafter.observe(view, StepOutcome("decode", n, min(1, n), new))
        if hasattr(drafter, "finish"):
            drafter.finish(view)

    # Through the engine: greedy output with the drafter is the target's.
    generating = [b for b in registry.backends.values() if b.generates]
    assert generating, "no plugin registers a generating backend to run the drafter under"
    manifest = validate_manifest({"name": "conformance", "backend": generating[0].name,
                                  "speculative": {"drafters": [name], "cost_gate": False, name: dict(options or {})}})
    strategy = registry.accelerators_for(manifest, generating[0]).decode_strategy
    assert strategy is not None, "no plugin registers a decode strategy (the speculative plugin) to run the drafter in"
    strategy = strategy.for_instance()
    strategy.attach(model, tokenizer)
    outputs = []
    for strat in (None, strategy):
        engine = GenerationEngine(model, tokenizer, strat, max_sequences=2, max_length=len(prompt_ids) + 64)
        finals: list[dict] = []

        def send(request: Any, kind: str, header: dict, out: Any) -> None:
            if kind != "chunk":
                finals.append(header)

        engine.admit([PendingRequest(b"c", 0, "generate", "conformance", {},
                                     {"prompt": tokenizer.decode(prompt_ids), "max_tokens": 24, "temperature": 0.0},
                                     send)])
        while engine.busy():
            engine.step()
        assert finals and finals[0].get("ok", True), f"{name}: the generation failed: {finals}"
        outputs.append(finals[0])
    assert outputs[1]["token_ids"] == outputs[0]["token_ids"], \
        f"{name}: greedy output with the drafter differs from the target's: {outputs[1]['token_ids']} vs " \
        f"{outputs[0]['token_ids']}"
    counts["engine_draft_tokens"] = outputs[1]["stats"]["draft_tokens"]
    return counts

