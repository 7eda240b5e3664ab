"""The draft-model drafter ("model", issue 39): a small GGUF of the target's vocabulary drafts on the
same native runtime, with its own KV cache; greedy output stays the target's, token for token; at T > 0
its sampled trees keep the target's distribution; a draft of another vocabulary is refused.

Tiny random Llama GGUFs (tests/gguf_models.py): the draft is the target's weights in Q4_0 where it should
agree often, a model of other weights where it should not (the accept rule then has real work)."""

from __future__ import annotations

import collections
import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "gguf")),
    reason="needs torch, transformers and gguf (to write the tiny GGUFs)",
)

from outrider.errors import ManifestError  # noqa: E402
from outrider.generation.contract import Chunk  # noqa: E402
from outrider.generation.sampling import SamplingParams, new_generator, target_distribution  # noqa: E402
from outrider.generation.verify import verify  # noqa: E402

from conftest import write_manifest  # noqa: E402
from gguf_models import write_tiny_gemma3_gguf, write_tiny_gguf  # noqa: E402
from test_eagle import _run, _strategy  # noqa: E402  (the engine and strategy set-up the head's tests use)

PROMPTS = ["the cat sat on the mat", "hello there", "abcabcabc", "in the beginning", "one two three four"]


def _native_c():
    from outrider_llm import native_c

    if not native_c.library()[0]:
        pytest.skip(f"native C library not loaded: {native_c.library()[1]}")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """target (Q8_0), its own weights in Q4_0 (a good draft), other weights in Q8_0 (a poor draft)."""
    _native_c()
    out = {}
    for name, seed, kind in (("target", 5, "Q8_0"), ("same", 5, "Q4_0"), ("other", 9, "Q8_0")):
        out[name], _ = write_tiny_gguf(tmp_path_factory.mktemp(name), "llama", seed=seed, matrix_type=kind)
    return out


@pytest.fixture(scope="module")
def target(files):
    from outrider_llm.gguf_tiles import load_gguf_tiles
    from outrider_llm.native_model import load_tiles

    model, tokenizer = load_tiles(load_gguf_tiles(files["target"], in_child=False))
    model.kv_dtype = np.float16
    return model, tokenizer


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_output_with_a_draft_model_is_the_targets(target, files, shape):
    model, tokenizer = target
    params = [{"prompt": p, "max_tokens": 40} for p in PROMPTS]  # 5 sequences over 4 slots: one waits
    plain = _run(model, tokenizer, None, params)
    # A tiny random model is unsure of everything: no probability threshold, or nothing is drafted.
    strategy = _strategy(["model"], model={"path": str(files["same"]), "max_sequences": 2, "prob_threshold": 0.0,
                                                "shape": shape},
                         prob_threshold=0.0, cost_gate=False)  # 2 draft slots for 4 sequences: slots evicted
    spec = _run(model, tokenizer, strategy, params)
    for i, prompt in enumerate(PROMPTS):
        assert spec[i]["token_ids"] == plain[i]["token_ids"], prompt
    drafter = strategy.drafters[0]
    assert drafter.calls > 0
    accepted = sum(spec[i]["stats"]["accepted_tokens"] for i in range(len(PROMPTS)))
    steps = sum(spec[i]["stats"]["new_tokens"] for i in range(len(PROMPTS))) - accepted
    assert accepted > steps, f"the target's own weights in Q4_0 should be accepted most of the time ({accepted} " \
                             f"accepted in {steps} steps)"
    assert strategy.stats["drafter_errors"] == 0
    assert not drafter._slots, "finished sequences keep no draft slot"
    assert drafter.shape == shape


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sequences_of_a_step_draft_together_one_forward_a_depth(target, files, temperature, monkeypatch):
    """Four sequences decoding side by side: the draft model syncs them in one forward and grows
    their chains side by side (propose_batch), so a step costs about one draft forward per depth,
    not one per sequence and depth; the output is the target's either way (greedy: plain's tokens;
    seeded T=1: the same draws as when each sequence drafts alone, as each draws from its own stream)."""
    model, tokenizer = target
    params = [{"prompt": p, "max_tokens": 24, "temperature": temperature, "seed": 7 + i, "ignore_eos": True}
              for i, p in enumerate(PROMPTS[:4])]
    options = {"path": str(files["same"]), "max_sequences": 4, "prob_threshold": 0.0}

    def run():
        strategy = _strategy(["model"], model=options, prob_threshold=0.0, cost_gate=False, adaptive=False,
                             max_draft_tokens=4, batch_draft_tokens=64)
        out = _run(model, tokenizer, strategy, params)
        assert strategy.stats["drafter_errors"] == 0
        return out, strategy.drafters[0].calls

    from outrider_speculative.draft_model import DraftModelDrafter

    together, calls_together = run()
    monkeypatch.setattr(DraftModelDrafter, "propose_batch", None)  # the strategy then asks it one sequence at a time
    alone, calls_alone = run()
    for i in range(4):
        assert together[i]["token_ids"] == alone[i]["token_ids"], PROMPTS[i]
    assert sum(together[i]["stats"]["accepted_tokens"] for i in range(4)) > 0
    if temperature == 0.0:
        plain = _run(model, tokenizer, None, params)
        assert [together[i]["token_ids"] for i in range(4)] == [plain[i]["token_ids"] for i in range(4)]
    # 4 sequences a step: about a quarter of the forwards.
    assert calls_together * 2 < calls_alone, (calls_together, calls_alone)


def test_the_draft_model_passes_the_drafter_conformance_kit(target, files):
    """outrider.testing.check_drafter: well-formed trees alone and two sequences at once
    (propose_batch), greedy and sampled, and two sequences a step through the engine equal to plain."""
    from outrider.plugins import create_registry
    from outrider.testing import check_drafter

    model, tokenizer = target
    registry = create_registry(["outrider_llm", "outrider_speculative"], load_entry_points=False)
    counts = check_drafter(registry, "model", model, tokenizer, tokenizer.encode("the cat sat on the mat"),
                           {"path": str(files["same"]), "prob_threshold": 0.0})
    assert counts["proposals"] == 26 and counts["nodes"] > 0 and counts["sampled_groups"] > 0
    assert counts["engine_draft_tokens"] > 0


def test_a_poor_draft_model_is_still_exact(target, files):
    model, tokenizer = target
    params = [{"prompt": p, "max_tokens": 24} for p in PROMPTS[:3]]
    plain = _run(model, tokenizer, None, params)
    spec = _run(model, tokenizer, _strategy(["ngram", "model"], model={"path": str(files["other"]), "prob_threshold": 0.0},
                                        prob_threshold=0.0), params)
    assert [spec[i]["token_ids"] for i in range(3)] == [plain[i]["token_ids"] for i in range(3)]


@pytest.mark.parametrize("draft, shape", [("same", "chain"), ("other", "chain"), ("other", "tree")])
def test_sampled_draft_trees_keep_the_targets_distribution(target, files, draft, shape):
    """The first token after a fixed context, over many (propose -> one target forward -> verify)
    rounds, is distributed as the target's p (chi-square), with the draft's trees drawn from its q;
    the same trees under an upside-down accept rule fail the same test."""
    from test_speculative import _chi_square, _chi_square_limit, _wrong_verify

    model, tokenizer = target
    strategy = _strategy(["model"], model={"path": str(files[draft]), "shape": shape}, adaptive=False,
                         max_draft_tokens=6, cost_gate=False)
    strategy.attach(model, tokenizer)
    drafter = strategy.drafters[0]
    ids = tokenizer.encode("the cat sat on")
    cache = model.new_cache(1, 64)
    model.forward(cache, [Chunk(0, np.array(ids[:-1]), np.arange(len(ids) - 1))])
    cache.commit(0, list(range(len(ids) - 1)))
    params = SamplingParams(temperature=1.0, top_k=8)

    class View:
        seq_id = "fixed"
        token_ids = ids
        prompt_length = len(ids)
        last_hidden = None
        new_features = None

        def __init__(self, generator):
            self.params, self.generator = params, generator

    def first_tokens(check, samples: int, seed: int) -> collections.Counter:
        counts: collections.Counter = collections.Counter()
        gen = new_generator(seed)
        for _ in range(samples):
            tree = drafter.propose(View(gen), 6)
            fed = np.array([ids[-1], *tree.tokens])
            depths = tree.depths()
            logits = model.forward(cache, [Chunk(0, fed, len(ids) - 1 + np.array([0, *depths]), tree.mask())]).logits
            counts[(check(tree, logits, params, gen).emitted[0],)] += 1
        return counts

    p = target_distribution(model.forward(cache, [Chunk(0, np.array(ids[-1:]), np.array([len(ids) - 1]))]).logits[0],
                            params.temperature, params.top_k, params.top_p)
    exact = {(t,): float(p[t]) for t in range(len(p))}
    counts = first_tokens(verify, 3000, seed=1)
    stat, df = _chi_square(counts, exact, 3000)
    assert stat < _chi_square_limit(df), (stat, df)
    assert any(len(drafter.propose(View(new_generator(s)), 6)) for s in range(5)), "the draft never drafted"
    if draft == "other":  # q far from p: taking q/p instead of p/q shows
        stat, df = _chi_square(first_tokens(_wrong_verify("q_over_p"), 3000, seed=2), exact, 3000)
        assert stat > _chi_square_limit(df), (stat, df)


def test_a_draft_of_another_vocabulary_is_refused(target, tmp_path):
    model, tokenizer = target
    other, _ = write_tiny_gemma3_gguf(tmp_path, seed=1)
    with pytest.raises(ManifestError, match=r"speculative\.model\.path.*(token ids|vocabulary)"):
        _strategy(["model"], model={"path": str(other)}).attach(model, tokenizer)


def test_bad_model_drafter_options_name_the_field(target, files, tmp_path):
    model, tokenizer = target
    cases = [({}, r"speculative\.model\.path.*expected the path"),
             ({"path": str(tmp_path / "missing.gguf")}, r"speculative\.model\.path.*does not exist"),
             ({"path": str(files["same"]), "depth": 3}, r"speculative\.model\.depth.*unknown"),
             ({"path": str(files["same"]), "max_sequences": 0}, r"speculative\.model\.max_sequences"),
             ({"path": str(files["same"]), "shape": "star"}, r"speculative\.model\.shape.*chain")]
    for options, pattern in cases:
        with pytest.raises(ManifestError, match=pattern):
            _strategy(["model"], model=options).attach(model, tokenizer)


def test_a_manifest_serves_with_a_draft_model_relative_to_it(files, tmp_path, server_factory):
    import shutil

    shutil.copy(files["same"], tmp_path / "draft.gguf")
    manifest = write_manifest(tmp_path, f"""name: tiny
backend: llm
model:
  path: {files["target"]}
options:
  max_sequences: 2
  max_length: 128
  threads: 1
speculative:
  drafters: [model]
  cost_gate: false   # the drafts are counted below
  model: {{path: draft.gguf}}
""")
    spec = served_greedy_equals_plain(manifest, server_factory)
    assert spec.stats["accepted_tokens"] > 0


def served_greedy_equals_plain(manifest, server_factory):
    """Serve `manifest` (model "tiny") for real; greedy with its speculation must equal plain. The
    speculative result."""
    server = server_factory([manifest], ["outrider_llm", "outrider_speculative"])
    with server.client(timeout=120) as client:
        plain = client.generate("tiny", prompt="the cat sat", max_tokens=24, temperature=0.0, speculative=False)
        spec = client.generate("tiny", prompt="the cat sat", max_tokens=24, temperature=0.0)
    assert spec.token_ids == plain.token_ids
    return spec
