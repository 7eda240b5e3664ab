"""The APIs local agents speak, driven by their real SDKs against a real server (smollm2-int8 on
the native int4 path, speculation on): Anthropic's Messages (`anthropic`) and OpenAI's Responses
(`openai`), whole and streamed, with a tool call round trip each; the generate knobs on the
OpenAI routes; greedy output identical with speculation on and off through each route."""

from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("llguidance")
pytest.importorskip("gguf")
jsonschema = pytest.importorskip("jsonschema")


MODEL = "smollm2-int8"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The current weather in a city.", "input_schema": WEATHER_SCHEMA}
TIME = {"name": "get_time", "description": "The local time in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                         "required": ["city"], "additionalProperties": False}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def server(smollm2_http):
    return smollm2_http


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=300)


def test_messages_answer_as_the_engine_does_whole_and_streamed(server, claude):
    system = "You are a terse assistant."
    ask = [{"role": "user", "content": "Name three colours."}]
    answer = claude.messages.create(model=MODEL, system=system, messages=ask, max_tokens=24)
    assert answer.type == "message" and answer.role == "assistant" and answer.id.startswith("msg_")
    [block] = answer.content
    assert block.type == "text" and block.text
    assert answer.stop_reason in ("end_turn", "max_tokens")
    with server.client() as zmq:  # the same request over ZeroMQ: the same tokens
        direct = zmq.generate(MODEL, messages=[{"role": "system", "content": system}, *ask], max_tokens=24)
    assert block.text == direct.text
    assert answer.usage.output_tokens == len(direct.token_ids)
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == direct.stats["prompt_tokens"]
    plain = claude.messages.create(model=MODEL, system=system, messages=ask, max_tokens=24,
                                   extra_body={"speculative": False})
    assert plain.content[0].text == block.text  # speculation keeps greedy output exact
    with claude.messages.stream(model=MODEL, system=[{"type": "text", "text": system}], messages=ask,
                                max_tokens=24) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == block.text == final.content[0].text
    assert final.stop_reason == answer.stop_reason and final.usage.output_tokens == answer.usage.output_tokens
    counted = claude.messages.count_tokens(model=MODEL, system=system, messages=ask)
    assert counted.input_tokens == direct.stats["prompt_tokens"]


def test_messages_stop_sequences_and_knobs(claude):
    ask = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    whole = claude.messages.create(model=MODEL, messages=ask, max_tokens=40)
    text = whole.content[0].text
    stop = next(piece for piece in ("5", "4", "3", ",") if piece in text)
    cut = claude.messages.create(model=MODEL, messages=ask, max_tokens=40, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    long = claude.messages.create(model=MODEL, messages=ask, max_tokens=12,
                                  extra_body={"ignore_eos": True})
    assert long.usage.output_tokens == 12 and long.stop_reason == "max_tokens"


def test_messages_tool_use_round_trip_whole_and_streamed(claude):
    call = claude.messages.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME],
                                  tool_choice={"type": "any"}, max_tokens=64)
    assert call.stop_reason == "tool_use"
    [use] = call.content
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name in ("get_weather", "get_time")
    jsonschema.validate(use.input, {"get_weather": WEATHER, "get_time": TIME}[use.name]["input_schema"])
    with claude.messages.stream(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=64,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[0].name == "get_weather"
    jsonschema.validate(streamed.content[0].input, WEATHER_SCHEMA)
    assert events.count("input_json") >= 2  # the arguments streamed in pieces, not at the end
    history = [*QUESTION, {"role": "assistant", "content": [use.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "18 degrees, sunny"}]}]}]
    follow = claude.messages.create(model=MODEL, messages=history, tools=[WEATHER, TIME], max_tokens=32)
    assert follow.content and follow.content[0].type in ("text", "tool_use")
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
              "required": ["name"], "additionalProperties": False}
    shaped = claude.messages.create(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                    max_tokens=48, output_config={"format": {"type": "json_schema", "schema": person}})
    jsonschema.validate(json.loads(shaped.content[0].text), person)
    auto = claude.messages.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=64)
    if auto.stop_reason == "tool_use":
        assert auto.content[0].type == "tool_use"
    else:  # "auto" allows a text answer, which never starts a JSON object
        assert not auto.content[0].text.lstrip().startswith("{")


def test_messages_errors_in_anthropics_shape(server, claude):
    cases = [
        (dict(messages=QUESTION, max_tokens=8, extra_body={"temprature": 0.5}), 400, "temprature"),
        (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}], max_tokens=8), 400, "image"),
        (dict(messages=QUESTION, max_tokens=8, tool_choice={"type": "tool", "name": "nope"}, tools=[WEATHER]),
         400, "tool_choice"),
        (dict(messages=QUESTION, max_tokens=8, extra_body={"temperature": -1}), 400, "temperature"),
        (dict(messages=QUESTION, max_tokens=8, model="no-such-model"), 404, "no-such-model"),
    ]
    for kwargs, status, fragment in cases:
        with pytest.raises(anthropic.APIStatusError) as refused:
            claude.messages.create(**{"model": MODEL, **kwargs})
        assert refused.value.status_code == status, (kwargs, refused.value.body)
        body = refused.value.body
        assert body["type"] == "error" and fragment in body["error"]["message"], body
    for raw in (b"{", b"[]", b'{"model": "smollm2-int8"}', b'{"model": 1, "messages": [], "max_tokens": 1}'):
        answer = httpx.post(server.base + "/v1/messages", content=raw, headers={"content-type": "application/json"})
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error", raw


@pytest.fixture(scope="module")
def gpt(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)


FUNCTION = {"type": "function", "name": "get_weather", "description": WEATHER["description"],
            "parameters": WEATHER_SCHEMA}


def test_responses_whole_streamed_and_continued(server, gpt):
    first = gpt.responses.create(model=MODEL, instructions="You are a terse assistant.",
                                 input="Name three colours.", max_output_tokens=24, temperature=0)
    assert first.object == "response" and first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.output_text and first.output[0].type == "message"
    with server.client() as zmq:
        direct = zmq.generate(MODEL, messages=[{"role": "system", "content": "You are a terse assistant."},
                                        {"role": "user", "content": "Name three colours."}],
                              max_tokens=24, temperature=0)
    assert first.output_text == direct.text and first.usage.output_tokens == len(direct.token_ids)
    plain = gpt.responses.create(model=MODEL, instructions="You are a terse assistant.", input="Name three colours.",
                                 max_output_tokens=24, temperature=0, extra_body={"speculative": False})
    assert plain.output_text == first.output_text
    events = list(gpt.responses.create(model=MODEL, instructions="You are a terse assistant.",
                                       input=[{"role": "user", "content": [{"type": "input_text",
                                                                            "text": "Name three colours."}]}],
                                       max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                        "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == first.output_text == events[-1].response.output_text
    follow = gpt.responses.create(model=MODEL, previous_response_id=first.id, input="And one more?",
                                  max_output_tokens=8, temperature=0)
    with server.client() as zmq:
        again = zmq.generate(MODEL, messages=[{"role": "user", "content": "Name three colours."},
                                       {"role": "assistant", "content": first.output_text},
                                       {"role": "user", "content": "And one more?"}], max_tokens=8, temperature=0)
    assert follow.output_text == again.text  # instructions are not carried over, the turns are
    assert gpt.responses.retrieve(first.id).output_text == first.output_text
    gpt.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as refused:
        gpt.responses.create(model=MODEL, previous_response_id=first.id, input="?", max_output_tokens=4)
    assert refused.value.body["param"] == "previous_response_id"
    unstored = gpt.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        gpt.responses.retrieve(unstored.id)


def test_responses_function_call_round_trip_and_json_schema(gpt):
    called = gpt.responses.create(model=MODEL, input=QUESTION[0]["content"], tools=[FUNCTION],
                                  tool_choice="required", max_output_tokens=64)
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    events = list(gpt.responses.create(model=MODEL, input=QUESTION[0]["content"], tools=[FUNCTION],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=64, stream=True))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(pieces) >= 2 and "".join(pieces) == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER_SCHEMA)
    answered = gpt.responses.create(
        model=MODEL, tools=[FUNCTION], max_output_tokens=32,
        input=[{"role": "user", "content": QUESTION[0]["content"]},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}])
    assert answered.output and answered.output[0].type in ("message", "function_call")
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
              "required": ["name"], "additionalProperties": False}
    shaped = gpt.responses.create(model=MODEL, input="Invent a person.", max_output_tokens=48, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": person}})
    jsonschema.validate(json.loads(shaped.output_text), person)
    for fields, extra, param in (({"tools": [{"type": "web_search"}]}, None, "tools"),
                                 ({}, {"temprature": 1}, "temprature"),
                                 ({"input": [{"type": "input_image"}]}, None, "input")):
        with pytest.raises(openai.BadRequestError) as refused:
            gpt.responses.create(**{"model": MODEL, "input": "x", "max_output_tokens": 4, **fields}, extra_body=extra)
        assert param in json.dumps(refused.value.body), refused.value.body


def test_chat_completions_take_the_knobs(gpt):
    ask = [{"role": "user", "content": "Say hello."}]
    long = gpt.chat.completions.create(model=MODEL, messages=ask, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 10 and long.choices[0].finish_reason == "length"
    short = gpt.chat.completions.create(model=MODEL, messages=ask, max_tokens=10, temperature=0)
    first = short.choices[0].message.content
    held = gpt.chat.completions.create(model=MODEL, messages=ask, max_tokens=10, temperature=0, stop=[first[:1]],
                                       extra_body={"min_tokens": 3})
    assert held.usage.completion_tokens >= 3
    with pytest.raises(openai.BadRequestError) as refused:
        gpt.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, extra_body={"min_tokens": 5})
    assert refused.value.body["param"] == "min_tokens"
