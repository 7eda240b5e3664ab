"""Anthropic's Messages API: POST /v1/messages (whole or streamed) and /v1/messages/count_tokens.

What Claude Code and the `anthropic` SDK send when pointed at a local base URL:
- `system` (a string or text blocks), `messages` whose content is a string or blocks: `text`,
  `tool_use` and `tool_result` (written into the chat as text turns, as Chat Completions' tool
  history is), `thinking` blocks of earlier turns (dropped, as Anthropic's API drops them);
  `image` and `document` blocks are refused (text models).
- `tools` ({name, description, input_schema}) and `tool_choice` (auto, any, tool, none) on the
  structured-output engine Chat Completions' tools use: a call comes back as a `tool_use` block,
  stop_reason "tool_use".
- `output_config.format` (a JSON schema) on the same grammar engine.
- `max_tokens` (required), `stop_sequences`, `temperature`, `top_p`, `top_k` (which the 2026
  SDK no longer sends; raw requests and older clients do); `metadata`, `service_tier`,
  `cache_control`, `speed`, `inference_geo` and `output_config.effort` are kept aside. Extensions, as on the OpenAI routes: `seed`, `speculative`, `ignore_eos`,
  `min_tokens`, `timeout_ms`.
- A field the API does not define is refused with a 400 naming it (Anthropic's convention);
  errors come in Anthropic's shape: {"type": "error", "error": {"type", "message"}}.

A stream is Anthropic's event sequence: message_start, ping, per block content_block_start /
content_block_delta (text_delta, input_json_delta) / content_block_stop, then message_delta
(stop_reason, usage) and message_stop; a failure mid-stream is an `error` event.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .dispatch import Call, Dispatcher
from .json_api import (ApiError, bad_request, failed, failure_error, generate_stream, generate_whole,
                       generating_model, parse_body)
from .openai_structured import FieldError, Tools, call_as_text, result_as_text
from .tokenize_api import model_text, off_loop
from .tool_stream import StreamEvent, ToolCallStream

MAX_BLOCKS = 1024  # content blocks of one message


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Block(BaseModel):
    # Blocks are read by their type below; the SDK adds fields (cache_control, citations) to each.
    model_config = ConfigDict(extra="allow")
    type: str


class Message(Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, type...
    name: str
    description: Optional[str] = None
    input_schema: dict


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None  # one call per answer is all the grammar makes


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")  # BaseModel has a `schema`


class OutputConfig(Strict):
    format: Optional[OutputFormat] = None  # structured output on the grammar engine
    effort: Optional[str] = None  # kept aside: no reasoning budget to spend here


class CountRequest(Strict):
    model: str
    messages: list[Message]
    system: Optional[Union[str, list[Block]]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[dict] = None


class MessagesRequest(CountRequest):
    max_tokens: int
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stream: Optional[bool] = False
    output_config: Optional[OutputConfig] = None
    # Kept aside: they change where or how fast a hosted model answers, not what (the prefix
    # cache here is automatic, so cache_control has nothing to add).
    metadata: Optional[dict] = None
    service_tier: Optional[str] = None
    cache_control: Optional[dict] = None
    inference_geo: Optional[str] = None
    speed: Optional[str] = None
    diagnostics: Optional[dict] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None
    # Extensions (the OpenAI routes' names)
    seed: Optional[int] = None
    speculative: Optional[bool] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    timeout_ms: Optional[float] = None


#: Anthropic's error type for each HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 504: "timeout_error"}


def error_body(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


def error_response(exc: BaseException) -> Response:
    error = ApiError.of(exc)
    headers = {"Retry-After": "1"} if error.code in ("overloaded", "unavailable") else None
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def tools_of(body: CountRequest) -> Optional[Tools]:
    """Anthropic's tools and tool_choice on the engine's Tools (None without tools)."""
    if not body.tools and body.tool_choice is None:
        return None
    choice = body.tool_choice
    mapped: Any = None
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise FieldError("tool_choice: type 'tool' needs the tool's 'name'", "tool_choice")
            mapped = {"name": choice.name}
        else:
            mapped = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    tools = [tool.model_dump() for tool in body.tools or []]
    return Tools.of_functions(tools, mapped, lambda t: {**t, "parameters": t.get("input_schema")},
                              "{'name': ..., 'input_schema': {...}}")


def chat_messages(body: CountRequest, tools: Optional[Tools]) -> list[dict[str, str]]:
    """The request as the engine's text turns: the system prompt (tools described first), then each turn."""
    system = _text_of(body.system, "system") if body.system is not None else ""
    if tools is not None and tools.active:
        system = tools.system_message()["content"] + ("\n\n" + system if system else "")
    out = [{"role": "system", "content": system}] if system else []
    names: dict[str, str] = {}  # tool_use id -> tool name, to say whose result a tool_result is
    for index, message in enumerate(body.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        if len(message.content) > MAX_BLOCKS:
            raise FieldError(f"messages.{index}.content: at most {MAX_BLOCKS} blocks", "messages")
        parts = []
        for number, block in enumerate(message.content):
            where = f"messages.{index}.content.{number}"
            fields = block.model_extra or {}
            if block.type == "text":
                parts.append(_string(fields.get("text"), where + ".text"))
            elif block.type == "tool_use" and message.role == "assistant":
                names[str(fields.get("id"))] = str(fields.get("name"))
                parts.append(call_as_text(fields.get("name"), fields.get("input", {})))
            elif block.type == "tool_result" and message.role == "user":
                name = names.get(str(fields.get("tool_use_id")), fields.get("tool_use_id") or "the call")
                result = _text_of(fields.get("content") or "", where + ".content")
                parts.append(result_as_text(name, result, bool(fields.get("is_error"))))
            elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # earlier turns' thinking is not part of the prompt (as Anthropic's API)
            else:
                raise FieldError(f"{where}: a {message.role} block of type {block.type!r} is not supported "
                                 f"(text, tool_use in assistant turns, tool_result in user turns)", "messages")
        out.append({"role": message.role, "content": "\n\n".join(parts)})
    return out


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise FieldError(f"{where}: a string is required", "messages")
    return value


def _text_of(content: Any, where: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for number, block in enumerate(content):
            fields = block if isinstance(block, dict) else block.model_dump()
            if fields.get("type") != "text":
                raise FieldError(f"{where}.{number}: only text blocks are supported here, got "
                                 f"{str(fields.get('type'))[:32]!r}", where.split(".")[0])
            texts.append(_string(fields.get("text"), f"{where}.{number}.text"))
        return "\n".join(texts)
    raise FieldError(f"{where}: a string or a list of text blocks is required", where.split(".")[0])


def generate_parameters(body: MessagesRequest, tools: Optional[Tools]) -> dict[str, Any]:
    """The core's generate parameters (ranges are the engine's to check)."""
    parameters: dict[str, Any] = {"messages": chat_messages(body, tools), "max_tokens": body.max_tokens}
    for name, value in (("temperature", body.temperature), ("top_p", body.top_p), ("top_k", body.top_k),
                        ("stop", body.stop_sequences), ("seed", body.seed), ("speculative", body.speculative),
                        ("ignore_eos", body.ignore_eos), ("min_tokens", body.min_tokens),
                        ("timeout_ms", body.timeout_ms)):
        if value is not None:
            parameters[name] = value
    if body.thinking is not None:
        # A thinking model's template takes enable_thinking (Qwen3's); others ignore it.
        if body.thinking.get("type") not in ("disabled", "enabled", "adaptive"):
            raise FieldError("thinking.type must be enabled, adaptive or disabled", "thinking")
        parameters["chat_template_kwargs"] = {"enable_thinking": body.thinking["type"] != "disabled"}
    shaped = body.output_config is not None and body.output_config.format is not None
    if tools is not None and tools.active:
        if shaped:
            raise FieldError("give 'tools' or 'output_config.format', not both", "tools")
        parameters["constraint"] = tools.constraint()
    elif shaped:
        parameters["constraint"] = {"json_schema": body.output_config.format.schema_}
    if body.stream:
        parameters["stream"] = True
    return parameters


class Reply:
    """Anthropic's message object for one request, whole or as stream events."""

    def __init__(self, model: str, tools: Optional[Tools], stop_sequences: Optional[list[str]]) -> None:
        self.model, self.tools = model, tools if tools is not None and tools.active else None
        self.stop_sequences = stop_sequences or []
        self.id = "msg_" + uuid.uuid4().hex

    def stop_reason(self, header: dict, called: bool) -> tuple[str, Optional[str]]:
        """(stop_reason, stop_sequence) of a finished generation."""
        if called:
            return "tool_use", None
        if header.get("finish_reason") == "length":
            return "max_tokens", None
        matched = header.get("stop_reason")
        if isinstance(matched, str) and matched in self.stop_sequences:
            return "stop_sequence", matched
        return "end_turn", None

    @staticmethod
    def usage(stats: dict) -> dict[str, int]:
        # Anthropic counts cache reads apart from input_tokens.
        cached = int(stats.get("cached_tokens", 0))
        return {"input_tokens": int(stats.get("prompt_tokens", 0)) - cached, "output_tokens": int(stats.get("new_tokens", 0)),
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def message(self, content: list[dict], stop: tuple[Optional[str], Optional[str]], usage: dict) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def whole(self, header: dict) -> dict[str, Any]:
        text = header.get("text", "")
        call = self.tools.call_of(text) if self.tools is not None and header.get("finish_reason") == "stop" else None
        if call is not None:
            content = [{"type": "tool_use", "id": _tool_id(), "name": call[0], "input": call[1]}]
        else:
            content = [{"type": "text", "text": text}]
        if header.get("reasoning"):  # a thinking model's thinking, first, as Claude's extended thinking
            content.insert(0, {"type": "thinking", "thinking": header["reasoning"], "signature": ""})
        return self.message(content, self.stop_reason(header, call is not None), self.usage(header.get("stats") or {}))


def _tool_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _event(kind: str, payload: dict[str, Any]) -> dict[str, str]:
    return {"event": kind, "data": json.dumps({"type": kind, **payload}, separators=(",", ":"), ensure_ascii=False)}


async def _events(dispatch: Dispatcher, call: Call, reply: Reply,
                  first: tuple[str, dict, Optional[dict]]) -> AsyncIterator[dict[str, str]]:
    """Anthropic's event sequence; if the client goes away (the task is cancelled), so does the generation."""
    stream = ToolCallStream(reply.tools)
    index, open_kind = -1, None  # the open content block: its index and kind ("text" | "tool_use")

    def open_block(kind: str, block: dict[str, Any]) -> list[dict[str, str]]:
        nonlocal index, open_kind
        out = [_event("content_block_stop", {"index": index})] if open_kind is not None else []
        index, open_kind = index + 1, kind
        return out + [_event("content_block_start", {"index": index, "content_block": block})]

    def blocks(events: list[StreamEvent]) -> list[dict[str, str]]:
        out = []
        for event in events:
            if event.kind == "call":
                out += open_block("tool_use", {"type": "tool_use", "id": _tool_id(), "name": event.name, "input": {}})
                continue
            if event.kind == "thinking":
                if open_kind != "thinking":
                    out += open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                delta = {"type": "thinking_delta", "thinking": event.text}
            elif event.kind == "text":
                if open_kind not in ("text", "tool_use"):
                    out += open_block("text", {"type": "text", "text": ""})
                delta = {"type": "text_delta", "text": event.text}
            else:
                delta = {"type": "input_json_delta", "partial_json": event.text}
            out.append(_event("content_block_delta", {"index": index, "delta": delta}))
        return out

    try:
        # The counts come with message_delta: the engine reports them when the generation ends.
        start = reply.message([], (None, None), {"input_tokens": 0, "output_tokens": 0})
        yield _event("message_start", {"message": start})
        yield _event("ping", {})
        item = first
        while True:
            kind, header, _ = item
            if kind == "chunk":
                thinking = [StreamEvent("thinking", header["reasoning"])] if header.get("reasoning") else []
                for event in blocks(thinking + stream.feed(header.get("text") or "")):
                    yield event
            elif header.get("ok"):
                for event in blocks(stream.finish()):
                    yield event
                if open_kind in (None, "thinking"):  # an empty answer is still one (empty) text block
                    for event in blocks([StreamEvent("text", "")]):
                        yield event
                yield _event("content_block_stop", {"index": index})
                called = stream.kind == "call" and header.get("finish_reason") != "length"
                stop_reason, stop_sequence = reply.stop_reason(header, called)
                yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                               "usage": reply.usage(header.get("stats") or {})})
                yield _event("message_stop", {})
                break
            else:
                yield _event("error", {"error": error_body(failure_error(header))["error"]})
                break
            item = await call.next()
    finally:
        dispatch.cancel(call)  # a no-op once the final reply came


def routes(dispatch: Dispatcher) -> list[Route]:
    server = dispatch.server
    limit = server.limits.max_message_bytes

    async def messages(request: Request) -> Response:
        try:
            body = await parse_body(request, MessagesRequest, limit)
            model = generating_model(server, body.model)
            try:
                tools = tools_of(body)
                parameters = generate_parameters(body, tools)
            except FieldError as exc:
                raise bad_request(str(exc), exc.param) from None
            reply = Reply(body.model, tools, body.stop_sequences)
            if not body.stream:
                return JSONResponse(reply.whole(await generate_whole(dispatch, request, model.name, parameters)))
            call, first = await generate_stream(dispatch, request, model.name, parameters)
            return EventSourceResponse(_events(dispatch, call, reply, first), sep="\n", ping=15)
        except Exception as exc:
            return failed(request, exc, error_response)

    async def count_tokens(request: Request) -> Response:
        try:
            body = await parse_body(request, CountRequest, limit)
            model = generating_model(server, body.model)
            try:
                chat = chat_messages(body, tools_of(body))
            except FieldError as exc:
                raise bad_request(str(exc), exc.param) from None
            characters = sum(len(m["content"]) for m in chat)
            text = await model_text(model)
            tokens = await off_loop(lambda: text.tokenize(None, chat, None), characters)
            return JSONResponse({"input_tokens": len(tokens)})
        except Exception as exc:
            return failed(request, exc, error_response)

    return [Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
