"""The eagle draft head: its weights are tied to the target, its trees are valid, drafting with it stays exact.

A tiny head is trained here (outrider_draft_training's own collection and training code, a few
seconds) for the tiny random Llama; the last test runs the shipped head on SmolLM2 (greedy acceptance).
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from outrider.errors import ManifestError  # noqa: E402
from outrider.manifest import validate_manifest  # noqa: E402
from outrider.serving.request import PendingRequest  # noqa: E402
from outrider.plugins import create_registry  # noqa: E402
from outrider.generation.contract import Chunk  # noqa: E402
from outrider.generation.sampling import SamplingParams, new_generator, target_distribution  # noqa: E402
from outrider_speculative.eagle import EagleDrafter, load_head, make_eagle_drafter, save_head  # noqa: E402
from outrider_speculative.draft_head import DEFAULT_WEIGHTS, target_fingerprint  # noqa: E402
from outrider_speculative.tree import check_tree  # noqa: E402
from outrider_speculative.config import OptionError  # noqa: E402
from outrider_draft_training.collection import generate  # noqa: E402
from outrider_draft_training.corpus import Prompt  # noqa: E402
from outrider_draft_training.features import FeatureStore  # noqa: E402
from outrider_draft_training.trainer import TrainConfig, Trainer  # noqa: E402

from test_generate import CharTokenizer  # noqa: E402

VOCAB = 16


_view_ids = itertools.count()


class View:
    """A SequenceView: what a drafter reads (a greedy request unless `params` says otherwise)."""

    def __init__(self, token_ids: list[int], last_hidden, params=None, generator=None) -> None:
        self.seq_id = next(_view_ids)
        self.token_ids = token_ids
        self.prompt_length = len(token_ids)
        self.last_hidden = last_hidden
        self.params = SamplingParams() if params is None else params
        self.generator = new_generator(0) if generator is None else generator
        self.new_features = None


@pytest.fixture(scope="module")
def tiny():
    from outrider_llm.loading import tiny_random_llama

    torch.set_num_threads(1)
    return tiny_random_llama(vocab_size=VOCAB, hidden_size=32, num_layers=2, seed=3), CharTokenizer(16)


@pytest.fixture(scope="module")
def tiny_head(tiny, tmp_path_factory) -> Path:
    """A head trained for a few seconds on the tiny model's own greedy continuations."""
    model, _ = tiny
    gen = torch.Generator().manual_seed(0)
    prompts = [Prompt(torch.randint(0, VOCAB, (6,), generator=gen).tolist(), "chat", 0.0, 0, max_new=48)
               for _ in range(40)]
    store = FeatureStore()
    generate(model, prompts, store, time.monotonic() + 60, eos=set(), batch=8, max_length=128)
    cfg = TrainConfig(intermediate_size=64, draft_vocab=VOCAB, batch=64, warmup_steps=5, lr=3e-3,
                      precision="fp32", noise=0.0)
    trainer = Trainer(model, store.features(), cfg)
    trainer.train(minutes=0.06)
    evaluation = trainer.evaluate()
    path = tmp_path_factory.mktemp("eagle") / "tiny-eagle.safetensors"
    save_head(path, trainer.head, trainer.draft_vocab, target_fingerprint(model), {"held_out": evaluation}, "tiny llama seed 3")
    return path


def _strategy(drafters: list[str], **section):
    # max_verify_cost 0 unless given: budgets set by timing at attach would make acceptance counts vary
    # with the machine's load; the measured cap and step rows are tested on a simulated clock.
    section = {"drafters": drafters, "max_verify_cost": 0, **section}
    manifest = validate_manifest({"name": "t", "backend": "llm", "speculative": section})
    registry = create_registry(["outrider_llm", "outrider_speculative"], load_entry_points=False)
    return registry.accelerators_for(manifest, registry.backends["llm"])["speculative"].for_instance()


def _view(model, tokens: list[int]) -> View:
    """The view after prefilling tokens[:-1]: the last one is the pending token."""
    cache = model.new_cache(1, 256)
    out = model.forward(cache, [Chunk(0, torch.tensor(tokens[:-1]), torch.arange(len(tokens) - 1))])
    return View(list(tokens), out.hidden[-1])


# ---- the weights file is tied to the target -------------------------------------------------------


def test_head_for_other_weights_is_refused_with_a_clear_error(tiny, tiny_head):
    from outrider_llm.loading import tiny_random_llama

    model, tokenizer = tiny
    make_eagle_drafter(model, {"weights": str(tiny_head)})  # its own target: fine
    other = tiny_random_llama(vocab_size=VOCAB, hidden_size=32, num_layers=2, seed=4)  # same shape, other weights
    with pytest.raises(ManifestError) as info:
        make_eagle_drafter(other, {"weights": str(tiny_head)})
    message = str(info.value)
    assert str(tiny_head) in message
    assert load_head(tiny_head).fingerprint[:16] in message and target_fingerprint(other)[:16] in message
    assert "tools/train_draft.py" in message and "tiny llama seed 3" in message
    # The same refusal through the manifest path, when the engine attaches the strategy.
    strategy = _strategy(["ngram", "eagle"], eagle={"weights": str(tiny_head)})
    with pytest.raises(ManifestError, match="trained for other target weights"):
        strategy.attach(other, tokenizer)


def test_tampered_fingerprint_is_refused(tiny, tiny_head, tmp_path):
    model, _ = tiny
    loaded = load_head(tiny_head)
    forged = tmp_path / "forged.safetensors"
    save_head(forged, loaded.head, loaded.draft_vocab, "0" * 64, {}, "tiny llama seed 3")
    with pytest.raises(ManifestError, match="fingerprint 0000000000000000"):
        make_eagle_drafter(model, {"weights": str(forged)})


def test_shipped_head_is_for_smollm2_only(tiny):
    model, _ = tiny
    assert DEFAULT_WEIGHTS.is_file(), "the trained head ships with the plugin"
    assert DEFAULT_WEIGHTS.stat().st_size < 10e6
    shipped = load_head(DEFAULT_WEIGHTS)
    assert shipped.summary().get("held_out"), "the training summary travels with the weights"
    with pytest.raises(ManifestError, match="SmolLM2"):
        make_eagle_drafter(model, {})  # default weights, wrong target


def test_bad_options_and_missing_file_name_the_field(tiny, tmp_path):
    model, tokenizer = tiny
    with pytest.raises(ManifestError, match="does not exist"):
        make_eagle_drafter(model, {"weights": str(tmp_path / "nope.safetensors")})
    with pytest.raises(ManifestError, match=r"speculative\.eagle\.frontier'"):
        _strategy(["eagle"], eagle={"frontier": 0}).attach(model, tokenizer)
    with pytest.raises(ManifestError, match=r"speculative\.eagle\.weigths'"):
        _strategy(["eagle"], eagle={"weigths": "x"}).attach(model, tokenizer)


# ---- trees ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget,max_depth,max_children,frontier", [(16, 8, 4, 8), (5, 3, 2, 1), (40, 6, 3, 4), (1, 8, 4, 8)])
def test_drafted_trees_are_valid_and_capped(tiny, tiny_head, budget, max_depth, max_children, frontier):
    model, _ = tiny
    drafter = make_eagle_drafter(model, {"weights": str(tiny_head), "max_depth": max_depth, "max_children": max_children,
                                         "frontier": frontier, "prob_threshold": 0.0})
    gen = torch.Generator().manual_seed(1)
    for trial in range(6):
        tokens = torch.randint(0, VOCAB, (5 + trial,), generator=gen).tolist()
        tree = drafter.propose(_view(model, tokens), budget)
        check_tree(tree)  # lengths agree, parents before children
        assert 0 < len(tree) <= budget
        assert max(tree.depths()) <= max_depth
        children: dict[int, int] = {}
        for i, parent in enumerate(tree.parents):
            children[parent] = children.get(parent, 0) + 1
            assert 0 < tree.probs[i] <= 1.0 + 1e-6
            if parent >= 0:
                assert tree.probs[i] <= tree.probs[parent] + 1e-6, "cumulative probability grew down a path"
        assert max(children.values()) <= max_children
        assert len({(p, t) for p, t in zip(tree.parents, tree.tokens)}) == len(tree), "duplicate sibling"
        assert all(0 <= t < VOCAB for t in tree.tokens)


def test_int4_draft_head_drafts_what_the_float_head_drafts_mostly(tiny, tiny_head):
    model, _ = tiny
    float_drafter = make_eagle_drafter(model, {"weights": str(tiny_head), "prob_threshold": 0.0})
    int4_drafter = make_eagle_drafter(model, {"weights": str(tiny_head), "prob_threshold": 0.0, "quantize": "int4"})
    gen = torch.Generator().manual_seed(2)
    same = 0
    for trial in range(8):
        tokens = torch.randint(0, VOCAB, (6 + trial,), generator=gen).tolist()
        a, b = float_drafter.propose(_view(model, tokens), 8), int4_drafter.propose(_view(model, tokens), 8)
        check_tree(b)
        same += a.tokens[0] == b.tokens[0]
    assert same >= 6  # rounding moves near-ties only; what is drafted is verified anyway
    with pytest.raises(OptionError, match="quantize"):
        make_eagle_drafter(model, {"weights": str(tiny_head), "quantize": "int8"})


def test_root_children_are_the_heads_top_tokens(tiny, tiny_head):
    model, _ = tiny
    drafter: EagleDrafter = make_eagle_drafter(model, {"weights": str(tiny_head), "prob_threshold": 0.0, "max_children": 3})
    view = _view(model, [1, 2, 3, 4, 5])
    _, probs, ids = drafter.expand(view.last_hidden[None], torch.tensor([5]), 3)
    tree = drafter.propose(view, 3)
    assert tree.tokens == ids[0].tolist() and tree.parents == [-1, -1, -1]
    assert tree.probs == pytest.approx(probs[0].tolist(), rel=1e-5)
    assert len(drafter.propose(View([1, 2], None), 8)) == 0, "no hidden state yet: no draft"
    assert len(drafter.propose(view, 0)) == 0


def test_sampling_requests_draw_children_from_the_heads_tempered_q(tiny, tiny_head):

    model, _ = tiny
    drafter: EagleDrafter = make_eagle_drafter(model, {"weights": str(tiny_head), "prob_threshold": 0.0, "max_children": 3})
    base = _view(model, [1, 2, 3, 4, 5])
    # The tiny head is confident: a high temperature leaves several tokens for top-k to cut to 5.
    params = SamplingParams(temperature=4.0, top_k=5, top_p=0.99)

    def view(seed: int) -> View:
        return View(base.token_ids, base.last_hidden, params, new_generator(seed))

    tree = drafter.propose(view(0), 8)
    check_tree(tree)
    (root,) = tree.sampled[-1]
    _, logits = drafter.compiled(base.last_hidden[None], model.embed(torch.tensor([5])))
    expected = np.zeros(VOCAB, dtype=np.float32)
    expected[drafter.draft_vocab.numpy()] = target_distribution(logits[0], 4.0, 5, 0.99)
    assert np.array_equal(root.q, expected), "q is the head's distribution through the request's T, top-k, top-p"
    assert int((expected > 0).sum()) >= 3, "q too peaked for this test to draw several children"
    assert not root.replacement and len(set(root.draws)) == len(root.draws) == 3
    assert all(root.q[t] > 0 for t in root.draws)
    assert {tree.tokens[i] for i, p in enumerate(tree.parents) if p == -1} <= set(root.draws)
    for parent, groups in tree.sampled.items():  # deeper nodes sample too, each under its own node
        assert -1 <= parent < len(tree) and all(len(g.draws) > 0 for g in groups)
    assert len(tree.sampled) > 1
    # The request's generator decides the draws: a seed reproduces them, other seeds vary them.
    assert drafter.propose(view(0), 8).sampled[-1][0].draws == root.draws
    assert len({tuple(drafter.propose(view(seed), 8).sampled[-1][0].draws) for seed in range(12)}) > 1
    # Greedy requests, and `sample: false`, keep the deterministic top-k tree.
    greedy = drafter.propose(View(base.token_ids, base.last_hidden, SamplingParams(), new_generator()), 8)
    assert not greedy.sampled and greedy.tokens == drafter.propose(base, 8).tokens
    fixed = make_eagle_drafter(model, {"weights": str(tiny_head), "prob_threshold": 0.0, "max_children": 3, "sample": False})
    assert not fixed.propose(view(0), 8).sampled
    with pytest.raises(ManifestError, match=r"speculative\.eagle\.sample'"):
        _strategy(["eagle"], eagle={"weights": str(tiny_head), "sample": "yes"}).attach(model, None)


# ---- lossless with the engine ---------------------------------------------------------------------


def _run(model, tokenizer, strategy, parameter_sets: list[dict]) -> dict:
    from outrider.generation.engine import GenerationEngine

    if strategy is not None:
        strategy.attach(model, tokenizer)
    engine = GenerationEngine(model, tokenizer, strategy, max_sequences=4, max_length=256)
    finals: dict = {}

    def send(request, kind, header, outputs):
        if kind != "chunk":
            finals[request.id] = header

    engine.admit([PendingRequest(b"r", i, "generate", "t", {}, p, send) for i, p in enumerate(parameter_sets)])
    while engine.busy():
        engine.step()
    return finals


PROMPTS = ["abcabcabcabc", "hellohello", "aaaaaaa", "ponmlkjihgfedcba", "ababcdcdababcd"]


@pytest.mark.parametrize("drafters", [["eagle"], ["ngram", "eagle"]])
def test_greedy_speculative_tokens_equal_plain(tiny, tiny_head, drafters):
    model, tokenizer = tiny
    params = [{"prompt": p, "max_tokens": 40} for p in PROMPTS]
    plain = _run(model, tokenizer, None, params)
    strategy = _strategy(drafters, eagle={"weights": str(tiny_head)})
    spec = _run(model, tokenizer, strategy, params)
    for i, prompt in enumerate(PROMPTS):
        assert spec[i]["token_ids"] == plain[i]["token_ids"], prompt
    eagle = next(d for d in strategy.drafters if d.name == "eagle")
    assert eagle.calls > 0, "the head never drafted"
    accepted = sum(spec[i]["stats"]["accepted_tokens"] for i in range(len(PROMPTS)))
    assert accepted > 0, "no draft was ever accepted: this test would not see a wrong accept rule"
    assert strategy.stats["drafter_errors"] == 0


def test_sampling_with_eagle_runs_and_respects_seeds(tiny, tiny_head):
    model, tokenizer = tiny
    params = [{"prompt": p, "max_tokens": 30, "temperature": 1.0, "seed": 7} for p in PROMPTS[:3]]
    first = _run(model, tokenizer, _strategy(["ngram", "eagle"], eagle={"weights": str(tiny_head)}), params)
    second = _run(model, tokenizer, _strategy(["ngram", "eagle"], eagle={"weights": str(tiny_head)}), params)
    for i in range(3):
        assert len(first[i]["token_ids"]) == 30
        assert first[i]["token_ids"] == second[i]["token_ids"]


# ---- the shipped head on SmolLM2 ------------------------------------------------------------------


@pytest.mark.slow  # 10-20 s here: a fresh cache converts the GGUF first
def test_shipped_head_drafts_well_on_smollm2():
    from outrider_llm.loading import load_smollm2

    try:
        model, tokenizer = load_smollm2()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    torch.set_num_threads(2)
    prompts = [
        {"messages": [{"role": "user", "content": "Explain how a refrigerator keeps food cold."}], "max_tokens": 64},
        {"prompt": 'def count_words(text):\n    """Return a dict mapping each word in text to how often it occurs."""\n',
         "max_tokens": 64},
    ]
    plain = _run(model, tokenizer, None, prompts)
    strategy = _strategy(["eagle"], cost_gate=False)  # the head's acceptance, not the timing gate's choices
    spec = _run(model, tokenizer, strategy, prompts)
    lengths = []
    for i in range(len(prompts)):
        assert spec[i]["token_ids"] == plain[i]["token_ids"]
        lengths.append(spec[i]["stats"]["mean_accepted_length"])
    assert sum(lengths) / len(lengths) > 1.3, lengths
