"""The generation knobs load tests and evaluation harnesses use (vLLM's names): ignore_eos,
min_tokens, stop_token_ids beside stop strings, and the refusal of a parameter the engine does
not take. On the tiny random Llama, each output is checked against a greedy reference computed
by hand (full-prefix forwards), plain and with speculation: the knobs are part of the target
distribution, so speculation keeps them exactly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from outrider.errors import BadRequestError  # noqa: E402
from outrider.generation.sampling import check_parameter_names, parse_sampling  # noqa: E402

from test_generate import CharTokenizer, _engine, _run  # noqa: E402
from test_structured import _last_logits  # noqa: E402

VOCAB = 16
PROMPTS = ["abcabcabcabc", "hellohellohello", "ababcdcdababcd"]


class EosTokenizer(CharTokenizer):
    """CharTokenizer whose `eos` character ends a sequence."""

    def __init__(self, vocab_size: int, eos: int) -> None:
        super().__init__(vocab_size)
        self.eos_token_ids = {eos}


@pytest.fixture(scope="module")
def model():
    from outrider_llm.loading import tiny_random_llama

    torch.set_num_threads(1)
    return tiny_random_llama(vocab_size=VOCAB, hidden_size=32, num_layers=2, seed=3)


def reference(model, prompt_ids: list[int], n: int, ending: set[int], min_tokens: int = 0) -> list[int]:
    """Greedy tokens, `ending` tokens impossible before `min_tokens` and ending the output after."""
    ids, out = list(prompt_ids), []
    for _ in range(n):
        row = _last_logits(model, ids)
        if len(out) < min_tokens:
            row[list(ending)] = float("-inf")
        token = int(torch.argmax(row))
        if token in ending:
            break
        out.append(token)
        ids.append(token)
    return out


def common_eos(model, tokenizer: CharTokenizer) -> int:
    """A token greedy decoding reaches within a few steps: as EOS, it ends that prompt early."""
    return reference(model, tokenizer.encode(PROMPTS[0]), 12, set())[2]


def both(model, tokenizer, parameter_sets: list[dict]) -> list[list[dict]]:
    """Final replies, plain and speculative (cost gate off: drafts are made)."""
    out = []
    for speculative in (False, True):
        spec = {"cost_gate": False} if speculative else {}
        capture = _run(_engine(model, tokenizer, speculative=speculative, **spec), parameter_sets)
        out.append([capture.final[i] for i in range(len(parameter_sets))])
    return out


def test_ignore_eos_runs_to_max_tokens_and_min_tokens_holds_eos_back(model):
    eos = common_eos(model, CharTokenizer(VOCAB))
    tokenizer = EosTokenizer(VOCAB, eos)
    sets = ([{"prompt": p, "max_tokens": 16} for p in PROMPTS]
            + [{"prompt": p, "max_tokens": 16, "ignore_eos": True} for p in PROMPTS]
            + [{"prompt": p, "max_tokens": 16, "min_tokens": 6} for p in PROMPTS])
    for finals in both(model, tokenizer, sets):
        assert all(f["ok"] for f in finals), finals
        stopped = finals[:3]
        assert any(f["finish_reason"] == "stop" and len(f["token_ids"]) < 16 for f in stopped), \
            "the EOS picked does not end any prompt early: the test would prove nothing"
        for prompt, plain, ignoring, held in zip(PROMPTS, stopped, finals[3:6], finals[6:]):
            ids = tokenizer.encode(prompt)
            assert plain["token_ids"] == reference(model, ids, 16, {eos})
            assert ignoring["token_ids"] == reference(model, ids, 16, set())  # EOS kept in the output
            assert ignoring["finish_reason"] == "length" and len(ignoring["token_ids"]) == 16
            assert held["token_ids"] == reference(model, ids, 16, {eos}, min_tokens=6)
            assert len(held["token_ids"]) >= 6 and eos not in held["token_ids"]


def test_stop_token_ids_end_the_output_and_are_named(model):
    tokenizer = CharTokenizer(VOCAB)
    ids = tokenizer.encode(PROMPTS[0])
    free = reference(model, ids, 12, set())
    stop = free[3]
    first = free.index(stop)
    sets = [{"prompt": PROMPTS[0], "max_tokens": 12, "stop_token_ids": [stop]},
            {"prompt": PROMPTS[0], "max_tokens": 12, "stop_token_ids": [stop], "min_tokens": first + 2},
            {"prompt": PROMPTS[0], "max_tokens": 12, "stop": [tokenizer.decode([stop])]}]
    runs = both(model, tokenizer, sets)
    for plain, drafted in zip(*runs):
        assert plain["token_ids"] == drafted["token_ids"] and plain["text"] == drafted["text"]
    for finals in runs:
        by_id, held, by_text = finals
        assert by_id["token_ids"] == free[:first] and by_id["finish_reason"] == "stop"
        assert by_id["stop_reason"] == stop
        assert held["token_ids"] == reference(model, ids, 12, {stop}, min_tokens=first + 2)
        assert len(held["token_ids"]) >= first + 2
        assert by_text["text"] == tokenizer.decode(free[:first]) and by_text["stop_reason"] == tokenizer.decode([stop])


def test_min_tokens_defers_stop_strings(model):
    # As vLLM: a stop string ends nothing before min_tokens tokens; from then on, the first new one does.
    tokenizer = CharTokenizer(VOCAB)
    free = reference(model, tokenizer.encode(PROMPTS[1]), 12, set())
    stop = tokenizer.decode([free[0]])
    sets = [{"prompt": PROMPTS[1], "max_tokens": 12, "stop": [stop]},
            {"prompt": PROMPTS[1], "max_tokens": 12, "stop": [stop], "min_tokens": 6}]
    hit = next((j for j in range(5, 12) if free[j] == free[0]), None)
    runs = both(model, tokenizer, sets)
    for plain, drafted in zip(*runs):  # a step past the stop string keeps only plain decoding's tokens
        assert plain["token_ids"] == drafted["token_ids"] and plain["text"] == drafted["text"]
    for at_once, deferred in runs:
        assert at_once["text"] == "" and at_once["finish_reason"] == "stop"
        if hit is None:
            assert deferred["token_ids"] == free and deferred["finish_reason"] == "length"
        else:
            assert deferred["text"] == tokenizer.decode(free[:hit]) and deferred["finish_reason"] == "stop"
            assert deferred["stop_reason"] == stop


def test_bad_knobs_fail_their_request_alone(model):
    tokenizer = CharTokenizer(VOCAB)
    sets = [{"prompt": "abc", "max_tokens": 4, "temprature": 0.5},
            {"prompt": "abc", "max_tokens": 4, "ignore_eos": "yes"},
            {"prompt": "abc", "max_tokens": 4, "min_tokens": 5},
            {"prompt": "abc", "max_tokens": 4, "stop_token_ids": [VOCAB + 3]},
            {"prompt": "abc", "max_tokens": 4, "stop_token_ids": "3"},
            {"prompt": "abc", "max_tokens": 4}]
    capture = _run(_engine(model, tokenizer, speculative=False), sets)
    messages = [capture.final[i].get("error", {}).get("message", "") for i in range(len(sets))]
    assert "unknown parameter 'temprature'" in messages[0] and "did you mean 'temperature'" in messages[0]
    assert "'ignore_eos' must be true or false" in messages[1]
    assert "'min_tokens' must be between 0 and 4" in messages[2]
    assert "stop_token_ids" in messages[3] and "outside the vocabulary" in messages[3]
    assert "stop_token_ids" in messages[4]
    assert capture.final[5]["ok"] and len(capture.final[5]["token_ids"]) == 4


def test_every_parameter_a_front_sends_is_known():
    # The client's own parameters and each knob pass the name check; parse_sampling takes them.
    from outrider.client import generate_parameters

    params = generate_parameters("hi", None, 8, 0.5, 0.9, 4, 1, ["x"], False, True,
                                 {"ignore_eos": True, "min_tokens": 2, "stop_token_ids": [1], "logprobs": True,
                                  "top_logprobs": 2, "logit_bias": {"1": 1.0}, "presence_penalty": 0.1,
                                  "frequency_penalty": 0.1, "timeout_ms": 1000})
    check_parameter_names(params)
    parsed = parse_sampling(params, 64)
    assert parsed.ignore_eos and parsed.min_tokens == 2 and parsed.stop_token_ids == [1]
    with pytest.raises(BadRequestError, match="unknown parameter 'foo_bar'"):
        check_parameter_names({**params, "foo_bar": 1})


def test_warm_up_sequences_end_at_eos(model):
    # A warm-up generation has no request, so no knobs: EOS ends it, as it ends a plain request.
    eos = common_eos(model, CharTokenizer(VOCAB))
    tokenizer = EosTokenizer(VOCAB, eos)
    ids = tokenizer.encode(PROMPTS[0])
    warm = _engine(model, tokenizer, speculative=False).warm_up(ids, max_tokens=12)
    assert warm == reference(model, ids, 12, {eos}) and len(warm) < 12
