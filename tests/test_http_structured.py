"""The OpenAI routes' structured output, tools, log-probabilities and sampling surface, with the
openai client against a real server (smollm2-int8 on the native int4 path, speculation on)."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("llguidance")
pytest.importorskip("gguf")
jsonschema = pytest.importorskip("jsonschema")


MODEL = "smollm2-int8"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(smollm2_http):
    api = openai.OpenAI(base_url=smollm2_http.base + "/v1", api_key="unused", max_retries=0, timeout=300)
    api.zmq = smollm2_http.client  # the same engine over ZeroMQ, for token ids
    return api


def _ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_response_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answer = client.chat.completions.create(model=MODEL, messages=_ask("Invent a person."), max_tokens=64,
                                            response_format=fmt, temperature=0)
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    plain = client.chat.completions.create(model=MODEL, messages=_ask("Invent a person."), max_tokens=64,
                                           response_format=fmt, temperature=0, extra_body={"speculative": False})
    assert plain.choices[0].message.content == answer.choices[0].message.content
    anything = client.chat.completions.create(model=MODEL, messages=_ask("A JSON object about cats."),
                                              max_tokens=96, response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON object's start
        assert anything.choices[0].message.content.startswith("{")
    choice = client.completions.create(model=MODEL, prompt="The colour of grass is", max_tokens=5,
                                       extra_body={"structured_outputs": {"choice": ["green", "blue"]}})
    assert choice.choices[0].text in ("green", "blue")
    regex = client.completions.create(model=MODEL, prompt="Year: ", max_tokens=8, extra_body={"guided_regex": "[0-9]{4}"})
    assert len(regex.choices[0].text) == 4 and regex.choices[0].text.isdigit()


def test_tools_named_required_and_auto(client):
    question = _ask("What is the weather in Paris, in celsius?")
    named = client.chat.completions.create(model=MODEL, messages=question, tools=[WEATHER, TIME], max_tokens=64,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and named.choices[0].message.content is None
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = client.chat.completions.create(model=MODEL, messages=question, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=64)
    [call] = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    auto = client.chat.completions.create(model=MODEL, messages=question, tools=[WEATHER, TIME], max_tokens=64)
    message = auto.choices[0].message
    if message.tool_calls:  # either a valid call or plain text: both are allowed by "auto"
        assert auto.choices[0].finish_reason == "tool_calls"
        json.loads(message.tool_calls[0].function.arguments)
    else:
        assert message.content and not message.content.lstrip().startswith("{")
    history = [*question, {"role": "assistant", "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    follow = client.chat.completions.create(model=MODEL, messages=history, max_tokens=24)
    assert follow.choices[0].message.content
    for bad, param in (({"tool_choice": "required"}, "tool_choice"),
                       ({"tools": [{"type": "function"}]}, "tools"),
                       ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=question, max_tokens=4, **bad)
        assert refused.value.body["param"] == param, refused.value.body


def test_logprobs_chat_and_completions_equal_with_speculation_on_and_off(client):
    prompt = "def fibonacci(n):\n"
    runs = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, logprobs=3,
                                      extra_body={"speculative": s}) for s in (False, True)]
    a, b = (r.choices[0].logprobs for r in runs)
    assert a.tokens == b.tokens and "".join(a.tokens) == runs[0].choices[0].text
    assert max(abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs)) < 1e-5
    assert all(len(top) == 3 and max(top.values()) <= 0 for top in a.top_logprobs)
    assert a.text_offset[0] == 0 and a.text_offset[1] == len(a.tokens[0])
    chat = client.chat.completions.create(model=MODEL, messages=_ask("Say hi."), max_tokens=8, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    stream = list(client.chat.completions.create(model=MODEL, messages=_ask("Say hi."), max_tokens=8,
                                                 logprobs=True, stream=True))
    streamed = [t.token for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]


def test_n_several_prompts_seed_bias_and_penalties(client):
    prompts = ["Once upon a time", "The best way to"]
    many = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=12, temperature=1.0, seed=7,
                                     logprobs=0)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    again = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=12, temperature=1.0, seed=7)
    assert [c.text for c in many.choices] == [c.text for c in again.choices]  # seed + j per choice: reproducible
    assert many.choices[0].text != many.choices[1].text or many.choices[2].text != many.choices[3].text
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=1) for p in prompts]
    assert many.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)  # each prompt counted once
    assert many.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in many.choices)
    with client.zmq() as zmq:
        first = zmq.generate(MODEL, prompt=prompts[0], max_tokens=1).token_ids[0]
    banned = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=1, logit_bias={str(first): -100})
    with client.zmq() as zmq:
        again_first = zmq.generate(MODEL, prompt=prompts[0], max_tokens=1, logit_bias={str(first): -100}).token_ids
    assert again_first[0] != first and banned.choices[0].text
    penalized = client.completions.create(model=MODEL, prompt="1, 1, 1, 1, 1,", max_tokens=16, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0)
    free = client.completions.create(model=MODEL, prompt="1, 1, 1, 1, 1,", max_tokens=16, temperature=0)
    assert penalized.choices[0].text != free.choices[0].text
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", logit_bias={"100000000": 5})
    assert bad.value.body["param"] == "logit_bias"
