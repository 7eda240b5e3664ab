"""What an app asks of its sidecar's LLM: logit_bias, penalties, a grammar constraint and
log-probabilities, each part of the target distribution, and each the same with speculation on
and off.

- The tiny random Llama (no server): engine output under logit_bias and penalties equals an
  independent reference (full-prefix forwards, the rules applied by hand), plain and
  speculative; logprobs equal that reference's log-softmax (greedy) or log target distribution
  (T=1, whatever tokens were drawn).
- A tiny random GGUF with a real byte-level tokenizer: a JSON schema constrains even a random
  model to valid output, identical with speculation on and off.
- SmolLM2 (smollm2-int8, the native int4 path) served for real: 20 prompts under a JSON schema
  all parse and validate, identical with speculation on and off; choice, regex; a schema the
  engine cannot compile is a BadRequestError naming the part; logprobs equal (1e-5) both ways.
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")

from outrider.errors import BadRequestError  # noqa: E402

from conftest import MANIFESTS  # noqa: E402
from test_generate import CharTokenizer, _engine, _run  # noqa: E402

VOCAB = 16


@pytest.fixture(scope="module")
def tiny():
    from outrider_llm.loading import tiny_random_llama

    torch.set_num_threads(1)
    return tiny_random_llama(vocab_size=VOCAB, hidden_size=32, num_layers=2, seed=3), CharTokenizer(VOCAB)


def _last_logits(model, ids: list[int]) -> torch.Tensor:
    from outrider.generation.contract import Chunk

    cache = model.new_cache(1, 256)
    return model.forward(cache, [Chunk(0, torch.tensor(ids), torch.arange(len(ids)))]).logits[-1].float()


def _by_hand(logits: torch.Tensor, generated: list[int], bias: dict, presence: float, frequency: float) -> torch.Tensor:
    out = logits.clone()
    for token, value in bias.items():
        out[int(token)] += value
    for token in set(generated):
        out[token] -= frequency * generated.count(token) + presence
    return out


def _reference_greedy(model, prompt_ids: list[int], n: int, **rules) -> tuple[list[int], list[float]]:
    ids, out, logprobs = list(prompt_ids), [], []
    for _ in range(n):
        row = _by_hand(_last_logits(model, ids), out, **rules)
        token = int(torch.argmax(row))
        logprobs.append(float(torch.log_softmax(row, -1)[token]))
        out.append(token)
        ids.append(token)
    return out, logprobs


RULES = {"bias": {"3": 4.0, "7": -100.0}, "presence": 0.6, "frequency": 0.9}


def _params(prompt: str, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": 24, "logit_bias": RULES["bias"], "presence_penalty": RULES["presence"],
            "frequency_penalty": RULES["frequency"], "logprobs": True, **extra}


def test_rules_match_a_reference_plain_and_speculative(tiny):
    model, tokenizer = tiny
    prompts = ["abcabcabcabc", "hellohellohello", "ababcdcdababcd"]
    plain = _run(_engine(model, tokenizer, speculative=False), [_params(p) for p in prompts])
    spec = _run(_engine(model, tokenizer, speculative=True, cost_gate=False),  # drafts counted below
                [_params(p) for p in prompts])
    bare = _run(_engine(model, tokenizer, speculative=False), [{"prompt": p, "max_tokens": 24} for p in prompts])
    for i, prompt in enumerate(prompts):
        want, want_logprobs = _reference_greedy(model, tokenizer.encode(prompt), 24, **RULES)
        assert plain.final[i]["token_ids"] == want, prompt
        assert spec.final[i]["token_ids"] == want, prompt
        assert 7 not in want  # a -100 bias
        assert plain.final[i]["token_ids"] != bare.final[i]["token_ids"], "the rules changed nothing: vacuous"
        for got in (plain.final[i]["logprobs"], spec.final[i]["logprobs"]):
            assert [e["token_id"] for e in got] == want
            assert max(abs(e["logprob"] - w) for e, w in zip(got, want_logprobs)) < 1e-5
    assert sum(spec.final[i]["stats"]["accepted_tokens"] for i in range(3)) > 0, "no draft accepted: vacuous"


def test_sampled_logprobs_are_the_target_distribution_of_what_was_drawn(tiny):
    """At T=1 with top_k and the rules, plain and speculative: each token's logprob is the log of
    target_distribution over the reference row for exactly the tokens drawn before it."""
    from outrider.generation.sampling import target_distribution

    model, tokenizer = tiny
    prompt = "abcabcabcabc"
    params = [_params(prompt, temperature=1.0, top_k=6, seed=seed, top_logprobs=3) for seed in range(4)]
    for speculative in (False, True):
        capture = _run(_engine(model, tokenizer, speculative=speculative), params)
        for i in range(len(params)):
            ids, generated = tokenizer.encode(prompt), []
            for entry in capture.final[i]["logprobs"]:
                row = _by_hand(_last_logits(model, ids), generated, **RULES)
                probs = target_distribution(row, 1.0, 6, 1.0)
                token = entry["token_id"]
                assert probs[token] > 0, "a token outside the target's support was drawn"
                assert abs(entry["logprob"] - math.log(float(probs[token]))) < 1e-5
                assert len(entry["top"]) == 3 and entry["top"][0]["logprob"] >= entry["top"][-1]["logprob"]
                assert entry["token"] == tokenizer.decode([token])
                generated.append(token)
                ids.append(token)


def test_bad_rules_fail_only_their_request(tiny):
    model, tokenizer = tiny
    capture = _run(_engine(model, tokenizer, speculative=True), [
        {"prompt": "abc", "max_tokens": 4, "logit_bias": {"99": 1.0}},
        {"prompt": "abc", "max_tokens": 4, "logit_bias": {"1": 500}},
        {"prompt": "abc", "max_tokens": 4, "frequency_penalty": 3.0},
        {"prompt": "abc", "max_tokens": 4, "top_logprobs": 21},
        {"prompt": "abc", "max_tokens": 4, "constraint": {"regex": "a+", "choice": ["a"]}},
        {"prompt": "abc", "max_tokens": 4, "constraint": {"regex": "a+"}},  # CharTokenizer gives no vocabulary
        {"prompt": "abc", "max_tokens": 4},
    ])
    messages = [capture.final[i]["error"]["message"] for i in range(6)]
    assert "outside the vocabulary" in messages[0] and "between -100 and 100" in messages[1]
    assert "frequency_penalty" in messages[2] and "top_logprobs" in messages[3]
    assert "constraint" in messages[4] and "grammar engine" in messages[5]
    assert capture.final[6]["ok"] and len(capture.final[6]["token_ids"]) == 4


# -- a grammar on a real tokenizer ------------------------------------------------------------

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    from gguf_models import write_tiny_gguf
    from outrider.artifacts import ArtifactCache
    from outrider_llm.loading import model_from_artifact
    from outrider_llm.conversion import load_weights_artifact

    directory = tmp_path_factory.mktemp("tiny-gguf")
    path, _ = write_tiny_gguf(directory, "llama", seed=5)
    return model_from_artifact(load_weights_artifact(path, ArtifactCache(directory / "cache")))


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def test_a_schema_constrains_even_a_random_model_identically_with_speculation(tiny_gguf):
    jsonschema = pytest.importorskip("jsonschema")
    model, tokenizer = tiny_gguf
    params = [{"prompt": p, "max_tokens": 120, "constraint": {"json_schema": SCHEMA}, "logprobs": True}
              for p in ("hello there", "the cat sat", "on the mat, the")]
    plain = _run(_engine(model, tokenizer, speculative=False, max_length=512), params)
    spec = _run(_engine(model, tokenizer, speculative=True, max_length=512), params)
    # Without logprobs, greedy masks a row only when its argmax is refused: the same tokens
    quick = [{k: v for k, v in p.items() if k != "logprobs"} for p in params]
    quick_plain = _run(_engine(model, tokenizer, speculative=False, max_length=512), quick)
    quick_spec = _run(_engine(model, tokenizer, speculative=True, max_length=512), quick)
    for i in range(len(params)):
        assert plain.final[i]["ok"], plain.final[i]
        assert spec.final[i]["token_ids"] == plain.final[i]["token_ids"]
        assert quick_plain.final[i]["token_ids"] == quick_spec.final[i]["token_ids"] == plain.final[i]["token_ids"]
        assert spec.final[i]["finish_reason"] == plain.final[i]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(plain.final[i]["text"]), SCHEMA)
        a, b = plain.final[i]["logprobs"], spec.final[i]["logprobs"]
        assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a, b)) < 1e-5
    choice = _run(_engine(model, tokenizer, speculative=True, max_length=512),
                  [{"prompt": "pick", "max_tokens": 10, "constraint": {"choice": ["red", "green", "blue"]}},
                   {"prompt": "num", "max_tokens": 10, "constraint": {"regex": r"[0-9]{2}-[a-c]"}}])
    assert choice.final[0]["text"] in ("red", "green", "blue")
    assert len(choice.final[1]["text"]) == 4 and choice.final[1]["text"][2] == "-"


# -- SmolLM2 served for real ---------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "languages"],
    "additionalProperties": False,
}
QUESTIONS = [
    "Describe a software engineer from Berlin.", "Describe a teacher who lives in Lagos.",
    "Invent a retired pilot.", "Describe a student in Tokyo who speaks three languages.",
    "Describe a chef from Lyon.", "Make up a character for a novel set in Lima.",
    "Describe your favourite scientist.", "Describe a farmer from Iowa.",
    "Invent a musician from Havana.", "Describe a nurse in Manila.",
    "Describe a child who loves chess.", "Make up a sailor from Lisbon.",
    "Describe an architect in Dubai.", "Describe a painter from Oslo.",
    "Invent a detective in Cairo.", "Describe a baker in Vienna.",
    "Describe a doctor who works in Nairobi.", "Make up an astronaut from Houston.",
    "Describe a librarian in Dublin.", "Describe a mountain guide from Kathmandu.",
]


@pytest.fixture(scope="module")
def smol_int8(tmp_path_factory):
    pytest.importorskip("gguf")
    from conftest import start_server

    server = start_server(tmp_path_factory.mktemp("smol-int8"), [MANIFESTS / "smollm2-int8.yaml"],
                          ["outrider_llm", "outrider_speculative", "outrider_quantize"],
                          args=["--set", "options.max_sequences=4", "--set", "options.max_length=1024",
                                "--set", "speculative.cost_gate=false"])  # drafts are counted: no timing gate
    try:
        server.wait_ready(timeout=600)
        yield server
    finally:
        server.stop()


def test_smollm2_json_schema_outputs_all_validate_and_speculation_changes_nothing(smol_int8):
    jsonschema = pytest.importorskip("jsonschema")
    constraint = {"json_schema": PERSON}
    # The schema bounds an answer: 160 characters of strings, each at most 4 byte-level tokens, and
    # ~40 tokens of keys and punctuation. A model that repeats itself inside a string (SmolLM2 does
    # on one question where the kernels' rounding tips a near-tie, e.g. torch's AVX2 norms) is still
    # forced to close it, so every answer ends by the schema, never by max_tokens.
    max_tokens = 160 * 4 + 64
    accepted, steps = 0, [0, 0]
    with smol_int8.client(timeout=300) as client:
        for question in QUESTIONS:
            messages = [{"role": "user", "content": question + " Answer in JSON."}]
            plain = client.generate("smollm2-int8", messages=messages, max_tokens=max_tokens, constraint=constraint,
                                    speculative=False, logprobs=True)
            spec = client.generate("smollm2-int8", messages=messages, max_tokens=max_tokens, constraint=constraint,
                                   logprobs=True)
            assert spec.token_ids == plain.token_ids, question
            assert plain.finish_reason == "stop", (question, plain.text)
            jsonschema.validate(json.loads(plain.text), PERSON)
            assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(plain.logprobs, spec.logprobs)) < 1e-5
            accepted += spec.stats["accepted_tokens"]
            steps[0] += plain.stats["steps"]
            steps[1] += spec.stats["steps"]
    assert accepted > 0, "no draft was accepted under the schema: speculation was not exercised"
    # the grammar's forced tokens (keys, punctuation) are drafted and accepted: fewer steps
    assert steps[1] < 0.8 * steps[0], steps


def test_smollm2_choice_regex_streams_and_clear_refusals(smol_int8):
    with smol_int8.client(timeout=300) as client:
        answer = client.generate("smollm2-int8", messages=[{"role": "user", "content": "Is the sky blue?"}],
                                 max_tokens=8, constraint={"choice": ["yes", "no"]})
        assert answer.text in ("yes", "no") and answer.finish_reason == "stop"
        phone = client.generate("smollm2-int8", prompt="Call me at ", max_tokens=20,
                                constraint={"regex": r"[0-9]{3}-[0-9]{4}"})
        assert len(phone.text) == 8 and phone.text[3] == "-" and phone.text.replace("-", "").isdigit()
        chunks = list(client.generate("smollm2-int8", prompt="def add(a, b):", max_tokens=12, stream=True,
                                      logprobs=True, top_logprobs=2))
        streamed = [e for c in chunks[:-1] for e in (c.logprobs or [])]
        assert [e["token_id"] for e in streamed] == chunks[-1].token_ids == [e["token_id"] for e in chunks[-1].logprobs]
        assert all(len(e["top"]) == 2 and e["logprob"] <= 0 for e in streamed)
        with pytest.raises(BadRequestError, match=r"constraint.json_schema.*does not compile.*nope"):
            client.generate("smollm2-int8", prompt="x", constraint={"json_schema": {"$ref": "#/nope"}})
        with pytest.raises(BadRequestError, match=r"constraint.regex.*does not compile"):
            client.generate("smollm2-int8", prompt="x", constraint={"regex": "(("})
        assert client.generate("smollm2-int8", prompt="x", max_tokens=2).token_ids  # the model still serves
