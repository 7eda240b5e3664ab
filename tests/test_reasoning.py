"""Thinking kept apart from the answer (generation/reasoning.py), on tiny random GGUFs whose
tokenizers have <think> and </think> and whose templates think as Qwen3's and DeepSeek-R1's do.

The split is checked against the tokens themselves: `reasoning` is the text of the tokens
between the tags, `text` the text after `</think>`, in the final reply and in the streamed
chunks alike, identical with speculation on and off; a grammar constrains the answer and
leaves the thinking free; a raw prompt is not split; `chat_template_kwargs` reaches the
template (enable_thinking: false closes the thinking in the prompt)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from outrider.generation.reasoning import ANSWER, MAYBE, THINKING, ReasoningText, ThinkTags, first_phase, think_tags  # noqa: E402

from test_generate import _engine, _run  # noqa: E402

ASK = [{"role": "user", "content": "the cat sat on the mat"}]


def _model(tmp_path_factory, thinking: str):
    from gguf_models import write_tiny_gguf
    from outrider.artifacts import ArtifactCache
    from outrider_llm.conversion import load_weights_artifact
    from outrider_llm.loading import model_from_artifact

    directory = tmp_path_factory.mktemp(f"think-{thinking}")
    path, _ = write_tiny_gguf(directory, "qwen3", seed=7, thinking=thinking)
    return model_from_artifact(load_weights_artifact(path, ArtifactCache(directory / "cache")))


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    return _model(tmp_path_factory, "r1")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _model(tmp_path_factory, "qwen3")


def _close_bias(model, tokenizer, tags: ThinkTags, **extra) -> dict:
    """A logit bias on </think> under which greedy decoding closes the thinking after a few tokens
    (a random model never would by itself); found by trying, so the test does not hang on a seed."""
    for half in range(0, 24):
        params = {"messages": ASK, "max_tokens": 24, "logit_bias": {str(tags.close): half / 2}, **extra}
        final = _run(_engine(model, tokenizer, speculative=False, max_length=512), [params]).final[0]
        if tags.close in final["token_ids"][3:16] and tags.close not in final["token_ids"][:3]:
            return params
    pytest.fail("no bias closes the thinking after 3 to 16 tokens")


def _parts(tokenizer, token_ids: list[int], tags: ThinkTags) -> tuple[str, str]:
    close = token_ids.index(tags.close)
    return tokenizer.decode(token_ids[:close]).lstrip(), tokenizer.decode(token_ids[close + 1:]).lstrip()


def test_the_tags_are_found_only_where_the_model_thinks(r1, qwen3, tmp_path_factory):
    for model, tokenizer in (r1, qwen3):
        tags = think_tags(tokenizer)
        assert tags is not None and tokenizer.token_text(tags.open) == "<think>"
        assert tokenizer.token_text(tags.close) == "</think>"
    _, plain = _model_without_thinking(tmp_path_factory)
    assert think_tags(plain) is None
    r1_tags, qwen3_tags = think_tags(r1[1]), think_tags(qwen3[1])
    assert first_phase(r1[1].encode(r1[1].apply_chat_template(ASK)), r1_tags) == THINKING
    assert first_phase(qwen3[1].encode(qwen3[1].apply_chat_template(ASK)), qwen3_tags) == MAYBE
    closed = qwen3[1].apply_chat_template(ASK, enable_thinking=False)
    assert closed.endswith("<think>\n\n</think>\n\n") and first_phase(qwen3[1].encode(closed), qwen3_tags) == MAYBE


def _model_without_thinking(tmp_path_factory):
    from gguf_models import write_tiny_gguf
    from outrider.artifacts import ArtifactCache
    from outrider_llm.conversion import load_weights_artifact
    from outrider_llm.loading import model_from_artifact

    directory = tmp_path_factory.mktemp("no-think")
    path, _ = write_tiny_gguf(directory, "qwen3", seed=7)
    return model_from_artifact(load_weights_artifact(path, ArtifactCache(directory / "cache")))


def test_reasoning_text_reads_each_way_a_thinking_starts():
    tags = ThinkTags(100, 101)
    alphabet = "abcdefghij \n"

    def decode(ids: list[int]) -> str:
        return "".join({100: "<think>", 101: "</think>"}.get(i, alphabet[i] if i < len(alphabet) else "?") for i in ids)

    cases = [  # start phase, tokens, reasoning, answer
        (MAYBE, [100, 11, 0, 1, 11, 101, 11, 11, 2, 3], "ab\n", "cd"),  # Qwen3: the model opens it
        (THINKING, [0, 1, 101, 11, 2], "ab", "c"),  # R1: the prompt opened it
        (MAYBE, [2, 3, 100, 4], "", "cd<think>e"),  # no thinking: a later <think> is answer text
        (THINKING, [0, 1, 2], "abc", ""),  # cut before </think>: all thinking
    ]
    for phase, tokens, reasoning, answer in cases:
        streamed = ReasoningText(decode, [], 0, tags, phase)
        pieces, thoughts = [], []
        for end in range(1, len(tokens) + 1):
            pieces.append(streamed.update(tokens[:end], final=end == len(tokens)))
            thoughts.append(streamed.reasoning_delta)
        assert (streamed.reasoning, streamed.text) == (reasoning, answer), tokens
        assert "".join(thoughts) == reasoning and "".join(pieces) == answer
    assert ANSWER == "answer"


def test_thinking_and_answer_are_split_identically_streamed_and_with_speculation(r1):
    model, tokenizer = r1
    tags = think_tags(tokenizer)
    params = _close_bias(model, tokenizer, tags, stream=True)
    finals = []
    for speculative in (False, True):
        spec = {"cost_gate": False} if speculative else {}
        capture = _run(_engine(model, tokenizer, speculative=speculative, max_length=512, **spec), [params])
        final = capture.final[0]
        reasoning, answer = _parts(tokenizer, final["token_ids"], tags)
        assert final["reasoning"] == reasoning and final["text"] == answer
        # (the bias keeps </think> likely after it too: those later ones are the answer's text)
        assert reasoning and "</think>" not in final["reasoning"]
        chunks = capture.chunks[0]
        assert "".join(c["reasoning"] for c in chunks) == reasoning
        assert "".join(c["text"] for c in chunks) == answer
        finals.append(final)
    assert finals[0]["token_ids"] == finals[1]["token_ids"]
    raw = _run(_engine(model, tokenizer, speculative=False, max_length=512),
               [{"prompt": tokenizer.apply_chat_template(ASK), "max_tokens": 24,
                 "logit_bias": params["logit_bias"]}]).final[0]
    assert "reasoning" not in raw and raw["text"] == tokenizer.decode(raw["token_ids"])  # a prompt is not split


def test_a_grammar_constrains_the_answer_not_the_thinking(r1):
    pytest.importorskip("llguidance")
    model, tokenizer = r1
    tags = think_tags(tokenizer)
    params = _close_bias(model, tokenizer, tags, constraint={"choice": ["yes", "no"]})
    finals = [_run(_engine(model, tokenizer, speculative=s, max_length=512), [params]).final[0] for s in (False, True)]
    for final in finals:
        assert final["ok"] and final["text"] in ("yes", "no"), final
        reasoning, _ = _parts(tokenizer, final["token_ids"], tags)
        assert final["reasoning"] == reasoning and len(reasoning) >= 3  # free text the choice would refuse
    assert finals[0]["token_ids"] == finals[1]["token_ids"]


def test_chat_template_kwargs_reach_the_template(qwen3):
    model, tokenizer = qwen3
    requests = [{"messages": ASK, "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}},
                {"prompt": "hello", "max_tokens": 4, "chat_template_kwargs": {"enable_thinking": False}},
                {"messages": ASK, "max_tokens": 4, "chat_template_kwargs": {"messages": []}},
                {"messages": ASK, "max_tokens": 4, "chat_template_kwargs": {"x": [1]}}]
    capture = _run(_engine(model, tokenizer, speculative=False, max_length=512), requests)
    answered = capture.final[0]
    assert answered["ok"] and answered["stats"]["prompt_tokens"] == len(
        tokenizer.encode(tokenizer.apply_chat_template(ASK, enable_thinking=False)))
    if think_tags(tokenizer).open not in answered["token_ids"][:1]:  # the model did not reopen it
        assert answered["reasoning"] == "" and answered["text"] == tokenizer.decode(answered["token_ids"]).lstrip()
    messages = [capture.final[i]["error"]["message"] for i in (1, 2, 3)]
    assert "needs 'messages'" in messages[0]
    assert "'messages' is not a name a request may set" in messages[1]
    assert "'x' must be a bool" in messages[2]


def test_every_route_returns_the_thinking_apart(tmp_path):
    """A thinking model served for real: Chat Completions' reasoning_content, Messages' thinking
    block, Responses' reasoning item, whole and streamed, each equal to the engine's split over
    ZeroMQ. (Messages and Responses take no logit_bias: there the random model thinks to the end.)"""
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from conftest import free_port, start_server, write_manifest
    from gguf_models import tokenizer_fields, write_tiny_gguf

    for family in ("r1", "qwen3"):
        (tmp_path / family).mkdir()
    path, _ = write_tiny_gguf(tmp_path / "r1", "qwen3", seed=7, thinking="r1")
    close = tokenizer_fields(thinking=True)[0].index("</think>")
    manifest = write_manifest(tmp_path, f"name: thinker\nbackend: llm\nmodel: {{path: {path}}}\n"
                                        f"speculative: {{drafters: [ngram]}}\n", "thinker.yaml")
    path, _ = write_tiny_gguf(tmp_path / "qwen3", "qwen3", seed=7, thinking="qwen3")
    qwen3 = write_manifest(tmp_path, f"name: qwen3\nbackend: llm\nmodel: {{path: {path}}}\n", "qwen3.yaml")
    port = free_port()
    server = start_server(tmp_path, [manifest, qwen3], ["outrider_llm", "outrider_speculative", "outrider_http"],
                          args=["--http", f"127.0.0.1:{port}"])
    try:
        server.wait_ready(timeout=300)
        with server.client() as zmq:
            for half in range(0, 24):  # as _close_bias, over the wire
                bias = {str(close): half / 2}
                split = zmq.generate("thinker", messages=ASK, max_tokens=24, logit_bias=bias)
                if close in split.token_ids[3:16] and close not in split.token_ids[:3]:
                    break
            else:
                pytest.fail("no bias closes the thinking after 3 to 16 tokens")
            thought = zmq.generate("thinker", messages=ASK, max_tokens=12)
        assert split.reasoning and thought.reasoning and thought.text == ""
        base = f"http://127.0.0.1:{port}"
        gpt = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        chat = gpt.chat.completions.create(model="thinker", messages=ASK, max_tokens=24, logit_bias=bias)
        assert chat.choices[0].message.reasoning_content == split.reasoning
        assert chat.choices[0].message.content == split.text
        chunks = gpt.chat.completions.create(model="thinker", messages=ASK, max_tokens=24, logit_bias=bias, stream=True)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == split.reasoning
        assert "".join(d.content or "" for d in deltas) == split.text
        claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
        message = claude.messages.create(model="thinker", messages=ASK, max_tokens=12)
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == thought.reasoning
        with claude.messages.stream(model="thinker", messages=ASK, max_tokens=12) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
        assert "thinking" in kinds and final.content[0].thinking == thought.reasoning
        response = gpt.responses.create(model="thinker", input=ASK[0]["content"], max_output_tokens=12)
        assert response.output[0].type == "reasoning" and response.output[0].content[0].text == thought.reasoning
        events = list(gpt.responses.create(model="thinker", input=ASK[0]["content"], max_output_tokens=12,
                                           stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought.reasoning
        assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        # A tool call round trip on the tiny Qwen3 with its thinking off (the grammar holds from the first token)
        tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}}
        called = claude.messages.create(model="qwen3", messages=ASK, max_tokens=128, tools=[tool],
                                        tool_choice={"type": "any"}, thinking={"type": "disabled"})
        use = called.content[-1]
        assert called.stop_reason == "tool_use" and use.type == "tool_use" and isinstance(use.input["city"], str)
        history = [*ASK, {"role": "assistant", "content": [use.model_dump()]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
        assert claude.messages.create(model="qwen3", messages=history, max_tokens=8,
                                      thinking={"type": "disabled"}).content
        function = {"type": "function", "name": "get_weather", "parameters": tool["input_schema"]}
        asked = gpt.responses.create(model="qwen3", input=ASK[0]["content"], tools=[function], tool_choice="required",
                                     max_output_tokens=128, reasoning={"effort": "none"})
        call = asked.output[-1]
        assert call.type == "function_call" and isinstance(json.loads(call.arguments)["city"], str)
        answered = gpt.responses.create(model="qwen3", previous_response_id=asked.id, max_output_tokens=8,
                                        input=[{"type": "function_call_output", "call_id": call.call_id,
                                                "output": "sunny"}], reasoning={"effort": "none"})
        assert answered.output
    finally:
        server.stop()
