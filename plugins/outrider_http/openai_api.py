"""OpenAI-compatible routes: chat and text completions (plain and SSE), models (embeddings: embeddings_api.py).

Requests are validated by a schema; a parameter Outrider does not implement (echo, best_of,
suffix, repetition_penalty, audio...) is refused with a 400 naming it rather than silently
ignored. Structured output, tools and log-probabilities are mapped in openai_structured.py;
`n` choices and several prompts are one engine request each (choice index = prompt * n + j,
seed + j for a seeded request). Generation
parameters are passed to the model's `generate` as they are, and the engine checks their ranges
(a bad one is a 400 too: a stream waits for its first event before it answers, so a request the
engine refuses never starts a 200 stream). Speculative decoding's figures are in
`usage.speculative`, an extension field.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Optional, Union

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .dispatch import Call, Dispatcher
from .json_api import (ApiError, Schema, bad_request, failed, failure_error, generate_stream, parse_body,
                       served_model)
from .openai_structured import (FieldError, Tools, chat_logprobs, completion_logprobs, constraint_of,
                                history_as_text)
from .tool_stream import StreamEvent, ToolCallStream



class StreamOptions(Schema):
    include_usage: bool = False


class _Generation(Schema):
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    top_logprobs: Optional[int] = None
    # Extensions (as vLLM's): top_k, ignore_eos, min_tokens, stop_token_ids, speculative (false
    # turns speculative decoding off), timeout_ms.
    top_k: Optional[int] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    speculative: Optional[bool] = None
    timeout_ms: Optional[float] = None


MAX_CHOICES = 16  # n times the prompts of one request


class CompletionRequest(_Generation):
    prompt: Union[str, list[str]]
    logprobs: Optional[int] = None  # the legacy API: how many top entries per token (0..5)


class TextPart(Schema):
    type: str
    text: Optional[str] = None


class ChatMessage(Schema):
    role: str
    content: Optional[Union[str, list[TextPart]]] = None


class ChatRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's: e.g. {"enable_thinking": false}


def routes(dispatch: Dispatcher) -> list[Route]:
    server = dispatch.server
    limit = server.limits.max_message_bytes

    def model_named(name: str, generates: bool) -> Any:
        model = served_model(server, name)
        if model.generates != generates:
            what = "does not generate text" if generates else "generates text; use /v1/completions or /v1/chat/completions"
            raise bad_request(f"model '{name}' {what}", "model")
        return model

    def requestable() -> list[str]:
        # Loaded models and those a request loads (load_on_demand), as a client may name them.
        on_demand = [e.name for e in server.repository.entries.values()
                     if e.manifest is not None and e.manifest.load_on_demand]
        return sorted(set(server.models) | set(on_demand))

    async def list_models(request: Request) -> Response:
        created = int(server.started)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "outrider"} for name in requestable()]})

    async def get_model(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in requestable():
            return ApiError(404, f"The model '{name[:128]}' does not exist", "model_not_found", "model").response()
        return JSONResponse({"id": name, "object": "model", "created": int(server.started), "owned_by": "outrider"})

    async def completions(request: Request) -> Response:
        return await _generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool) -> Response:
        try:
            body = await parse_body(request, ChatRequest if chat else CompletionRequest, limit)
            model = model_named(body.model, generates=True)
            try:
                tools = Tools.of_chat(body) if chat else None
                choices = _generation_parameters(body, chat, tools)
            except FieldError as exc:
                raise bad_request(str(exc), exc.param) from None
            stream = bool(body.stream)
            reply = Reply(chat, body.model, bool(body.stream_options and body.stream_options.include_usage), tools)
            if not stream or len(choices) > 1:
                if stream:
                    raise bad_request("stream with several choices (n > 1 or several prompts) is not supported", "n")
                calls = [dispatch.submit(request.scope, "generate", model.name, p) for p in choices]
                headers = []
                try:
                    for each in calls:  # all run at once in the engine; answered in order
                        header, _ = await dispatch.final(each, request.receive)
                        if not header.get("ok"):
                            raise failure_error(header)
                        headers.append(header)
                finally:
                    for each in calls:  # a no-op for those answered
                        dispatch.cancel(each, "another choice of the same HTTP request failed")
                return JSONResponse(reply.whole(headers, body.n or 1))
            call, first = await generate_stream(dispatch, request, model.name, choices[0])
            return EventSourceResponse(_events(dispatch, call, reply, first), sep="\n", ping=15)
        except Exception as exc:
            return failed(request, exc)

    return [
        Route("/v1/models", list_models),
        Route("/v1/models/{name:path}", get_model),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]


def _generation_parameters(body: Any, chat: bool, tools: Optional[Tools] = None) -> list[dict[str, Any]]:
    """The core's generate parameters, one map per choice (ranges are the engine's to check)."""
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES:
        raise FieldError(f"'n' must be between 1 and {MAX_CHOICES}, got {n}", "n")
    parameters: dict[str, Any] = {}
    prompts: list[Any] = [None]
    if chat:
        messages = []
        if tools is not None and tools.active:
            messages.append(tools.system_message())
        for index, message in enumerate(body.messages):
            turn = history_as_text(message)
            if turn is not None:
                messages.append(turn)
                continue
            content = message.content
            if isinstance(content, list):
                if any(part.type != "text" for part in content):
                    raise FieldError(f"messages[{index}].content: only text parts are supported", "messages")
                content = "".join(part.text or "" for part in content)
            messages.append({"role": message.role, "content": content or ""})
        parameters["messages"] = messages
        if body.chat_template_kwargs is not None:
            parameters["chat_template_kwargs"] = body.chat_template_kwargs
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.logprobs or body.top_logprobs:
            parameters["logprobs"] = True
            if body.top_logprobs:
                parameters["top_logprobs"] = body.top_logprobs
    else:
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not prompts or len(prompts) * n > MAX_CHOICES:
            raise FieldError(f"'prompt' must hold 1 to {MAX_CHOICES // n} prompts with n={n}", "prompt")
        max_tokens = body.max_tokens
        if body.logprobs is not None:
            if not 0 <= body.logprobs <= 5:
                raise FieldError(f"'logprobs' must be between 0 and 5, got {body.logprobs}", "logprobs")
            parameters["logprobs"] = True
            if body.logprobs:
                parameters["top_logprobs"] = body.logprobs
    for name, value in (("max_tokens", max_tokens), ("temperature", body.temperature), ("top_p", body.top_p),
                        ("top_k", body.top_k), ("seed", body.seed), ("speculative", body.speculative),
                        ("timeout_ms", body.timeout_ms), ("logit_bias", body.logit_bias),
                        ("presence_penalty", body.presence_penalty), ("frequency_penalty", body.frequency_penalty),
                        ("ignore_eos", body.ignore_eos), ("min_tokens", body.min_tokens),
                        ("stop_token_ids", body.stop_token_ids)):
        if value is not None:
            parameters[name] = value
    if body.stop is not None:
        parameters["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.stream:
        parameters["stream"] = True
    constraint = constraint_of(body)
    if tools is not None and tools.active:
        if constraint is not None:
            raise FieldError("give 'tools' or an output constraint (response_format...), not both", "tools")
        constraint = tools.constraint()
    if constraint is not None:
        parameters["constraint"] = constraint
    out = []
    for prompt in prompts:
        for j in range(n):
            each = dict(parameters)
            if prompt is not None:
                each["prompt"] = prompt
            if j and "seed" in each:
                each["seed"] = each["seed"] + j  # several seeded choices, each its own draw
            out.append(each)
    return out


class Reply:
    """OpenAI's response objects for one generation request: whole, or as stream chunks."""

    def __init__(self, chat: bool, model: str, include_usage: bool, tools: Optional[Tools] = None) -> None:
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.tools = tools if tools is not None and tools.active else None
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.streamed_chars = 0  # text_offset of a streamed completion's next token

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, index: int, header: dict) -> dict[str, Any]:
        reason, text = _finish_reason(header), header.get("text", "")
        if not self.chat:
            return {"index": index, "text": text, "finish_reason": reason, "stop_reason": header.get("stop_reason"),
                    "logprobs": completion_logprobs(header.get("logprobs"))}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = self.tools.tool_calls(text) if self.tools is not None and reason == "stop" else None
        if calls:
            message, reason = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        if header.get("reasoning") is not None:  # a thinking model's thinking, as vLLM returns it
            message["reasoning_content"] = header["reasoning"]
        return {"index": index, "message": message, "finish_reason": reason, "stop_reason": header.get("stop_reason"),
                "logprobs": chat_logprobs(header.get("logprobs"))}

    def whole(self, headers: list[dict], n: int = 1) -> dict[str, Any]:
        """The response for every choice; usage counts each prompt once (as OpenAI does for n > 1)."""
        stats = [h.get("stats") or {} for h in headers]
        merged = dict(stats[0]) if stats else {}
        for key in ("prompt_tokens", "cached_tokens"):
            merged[key] = sum(int(s.get(key, 0)) for s in stats[::n])
        merged["new_tokens"] = sum(int(s.get("new_tokens", 0)) for s in stats)
        return {**self._base(self.object), "choices": [self._choice(i, h) for i, h in enumerate(headers)],
                "usage": usage(merged)}

    def chunk(self, text: Optional[str], reason: Optional[str] = None, role: bool = False,
              logprobs: Optional[list[dict]] = None, reasoning: Optional[str] = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            if reasoning:
                delta["reasoning_content"] = reasoning
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": chat_logprobs(logprobs)}
            out = {**self._base("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason,
                      "logprobs": completion_logprobs(logprobs, self.streamed_chars)}
            self.streamed_chars += len(text or "")
            out = {**self._base("text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def tool_chunk(self, event: StreamEvent) -> dict[str, Any]:
        """A chat chunk with a tool call's start (id, name) or a piece of its arguments."""
        if event.kind == "call":
            self.call_id = "call_" + uuid.uuid4().hex[:24]
            call = {"index": 0, "id": self.call_id, "type": "function", "function": {"name": event.name, "arguments": ""}}
        else:
            call = {"index": 0, "function": {"arguments": event.text}}
        choice = {"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None, "logprobs": None}
        out = {**self._base("chat.completion.chunk"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, header: dict) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(header.get("stats") or {})}


def usage(stats: dict) -> dict[str, Any]:
    prompt, completion = int(stats.get("prompt_tokens", 0)), int(stats.get("new_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(stats.get("cached_tokens", 0))},
        # Extension: what speculative decoding did for this request.
        "speculative": {key: stats.get(key, 0) for key in
                        ("steps", "draft_tokens", "accepted_tokens", "mean_accepted_length")},
    }


def _finish_reason(header: dict) -> str:
    return "length" if header.get("finish_reason") == "length" else "stop"


def _data(obj: Any) -> dict[str, str]:
    return {"data": json.dumps(obj, separators=(",", ":"), ensure_ascii=False)}


async def _events(dispatch: Dispatcher, call: Call, reply: Reply,
                  first: tuple[str, dict, Optional[dict]]) -> AsyncIterator[dict[str, str]]:
    """The SSE stream; if the client goes away (the task is cancelled), so does the generation."""
    calls = ToolCallStream(reply.tools)  # a call's arguments stream as tool_calls deltas

    def deltas(events: list[StreamEvent], logprobs: Optional[list[dict]] = None,
               reasoning: Optional[str] = None) -> list[dict[str, str]]:
        text = "".join(e.text for e in events if e.kind == "text")
        out = [_data(reply.chunk(text, logprobs=logprobs, reasoning=reasoning))] if text or logprobs or reasoning else []
        for event in events:
            if event.kind != "text":
                out.append(_data(reply.tool_chunk(event)))
        return out

    try:
        if reply.chat:
            yield _data(reply.chunk(None, role=True))
        item = first
        while True:
            kind, header, _ = item
            if kind == "chunk":
                for event in deltas(calls.feed(header.get("text") or ""), header.get("logprobs"),
                                    header.get("reasoning")):
                    yield event
            elif header.get("ok"):
                for event in deltas(calls.finish()):
                    yield event
                reason = _finish_reason(header)
                called = calls.kind == "call" and reason == "stop"
                yield _data(reply.chunk(None, "tool_calls" if called else reason))
                if reply.include_usage:
                    yield _data(reply.usage_chunk(header))
                break
            else:  # failed mid-stream: the openai client raises on an event carrying "error"
                yield _data(failure_error(header).body())
                break
            item = await call.next()
        yield {"data": "[DONE]"}
    finally:
        dispatch.cancel(call)  # a no-op once the final reply came
