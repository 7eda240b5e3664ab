"""OpenAI's Responses API: POST /v1/responses (whole or streamed), GET and DELETE /v1/responses/{id}.

What Codex and the Agents SDK send:
- `input`: a string, or items: messages (roles user, assistant, system, developer; content a
  string or input_text/output_text parts), `function_call` and `function_call_output` (written
  into the chat as text turns, as Chat Completions' tool history is), `reasoning` items (dropped).
  Image and file parts are refused (text models).
- `instructions` (the system prompt; not carried over from a previous response, as OpenAI's),
  `tools` of type function ({type, name, description, parameters}) with `tool_choice`, and
  `text.format` (json_schema or json_object) on the grammar engine; `max_output_tokens`,
  `temperature`, `top_p`; extensions as on the other routes (`top_k`, `seed`, `speculative`,
  `ignore_eos`, `min_tokens`, `timeout_ms`).
- `previous_response_id` continues a stored conversation. Responses are stored unless `store`
  is false, in a bounded in-memory store (the last MAX_STORED responses, and at most
  MAX_STORED_CHARACTERS of conversation text in all; the oldest go first). An id that is not
  there (never stored, deleted or evicted) is a 400 naming it. The store is this process's:
  a restart forgets it, and replicas do not share it.
- A field the API does not define is refused with a 400 naming it; errors are OpenAI's shape.

A stream is the Responses event sequence: response.created, response.in_progress, per output
item response.output_item.added, then response.content_part.added /
response.output_text.delta / .done / response.content_part.done (text) or
response.function_call_arguments.delta / .done (a call), response.output_item.done, and
response.completed (response.incomplete when cut by max_output_tokens); a failure is an `error`
event. Every event carries its sequence_number.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .dispatch import Call, Dispatcher
from .json_api import (ApiError, bad_request, failed, failure_error, generate_stream, generate_whole,
                       generating_model, parse_body)
from .openai_structured import FieldError, Tools, call_as_text, parsed_arguments, result_as_text
from .tool_stream import StreamEvent, ToolCallStream

MAX_STORED = 1024
MAX_STORED_CHARACTERS = 64 << 20
MAX_ITEMS = 1024


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextFormat(BaseModel):
    # name, description, strict are kept; "schema" is read through an alias (BaseModel has a `schema`)
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_schema", "json_object"]
    schema_: Optional[dict] = Field(None, alias="schema")


class TextOptions(Strict):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


class ResponsesRequest(Strict):
    model: str
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None  # one call per answer is all the grammar makes
    text: Optional[TextOptions] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[Literal["disabled"]] = None
    reasoning: Optional[dict] = None
    include: Optional[list[str]] = None
    service_tier: Optional[str] = None
    # Extensions (the other routes' names)
    top_k: Optional[int] = None
    seed: Optional[int] = None
    speculative: Optional[bool] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    timeout_ms: Optional[float] = None


class Stored:
    """A stored response: its object, and the conversation it ends (text turns, call names)."""

    def __init__(self, response: dict, turns: list[dict], calls: dict[str, str]) -> None:
        self.response, self.turns, self.calls = response, turns, calls
        self.characters = sum(len(t["content"]) for t in turns)


class ResponseStore:
    """The last responses, bounded in count and in characters; the oldest are evicted first."""

    def __init__(self, max_count: int = MAX_STORED, max_characters: int = MAX_STORED_CHARACTERS) -> None:
        self.max_count, self.max_characters = max_count, max_characters
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._characters = 0
        self._lock = threading.Lock()

    def put(self, key: str, stored: Stored) -> None:
        with self._lock:
            self._items[key] = stored
            self._characters += stored.characters
            while self._items and (len(self._items) > self.max_count or self._characters > self.max_characters):
                _, old = self._items.popitem(last=False)
                self._characters -= old.characters

    def get(self, key: str) -> Optional[Stored]:
        with self._lock:
            return self._items.get(key)

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._characters -= old.characters
            return old is not None


def tools_of(body: ResponsesRequest) -> Tools:
    for index, tool in enumerate(body.tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise FieldError(f"tools[{index}]: only function tools are supported, got {str(kind)[:32]!r}", "tools")
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise FieldError("tool_choice must be none, auto, required or {'type': 'function', 'name': ...}", "tool_choice")
    return Tools.of_functions(body.tools, choice, lambda t: t, "{'type': 'function', 'name': ..., 'parameters': {...}}")


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(f"{where}: a string or a list of text parts is required", "input")
    texts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise FieldError(f"{where}.{number}: only text parts are supported (input_text, output_text), got "
                             f"{str(kind)[:32]!r}", "input")
        texts.append(part["text"])
    return "".join(texts)


def input_turns(body: ResponsesRequest, calls: dict[str, str]) -> list[dict[str, str]]:
    """`input` as the engine's text turns; `calls` (call_id -> name) learns the calls it holds."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if len(body.input) > MAX_ITEMS:
        raise FieldError(f"input: at most {MAX_ITEMS} items", "input")
    turns = []
    for index, item in enumerate(body.input):
        where = f"input.{index}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise FieldError(f"{where}.role must be user, assistant, system or developer", "input")
            turns.append({"role": "system" if role == "developer" else role,
                          "content": _content_text(item.get("content"), where + ".content")})
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise FieldError(f"{where}: a function_call needs 'name' and 'arguments' (a JSON string)", "input")
            calls[str(item.get("call_id"))] = name
            turns.append({"role": "assistant", "content": call_as_text(name, parsed_arguments(arguments))})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _content_text(output, where + ".output")
            name = calls.get(str(item.get("call_id")), item.get("call_id") or "the call")
            turns.append({"role": "user", "content": result_as_text(name, output)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not part of the prompt
        else:
            raise FieldError(f"{where}: items of type {str(kind)[:32]!r} are not supported (message, "
                             f"function_call, function_call_output)", "input")
    return turns


def constraint_of(body: ResponsesRequest) -> Optional[dict]:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if not isinstance(fmt.schema_, dict):
        raise FieldError("text.format.schema must be a JSON schema (an object)", "text")
    return {"json_schema": fmt.schema_}


class Reply:
    """The response object of one request, and its stream events."""

    def __init__(self, body: ResponsesRequest, tools: Tools) -> None:
        self.body, self.tools = body, tools if tools.active else None
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.sequence = 0

    def response(self, status: str, output: list[dict], usage: Optional[dict] = None,
                 incomplete: Optional[str] = None) -> dict[str, Any]:
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": body.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
                "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
                "parallel_tool_calls": False, "previous_response_id": body.previous_response_id,
                "text": {"format": {"type": "text"}} if body.text is None else body.text.model_dump(exclude_none=True, by_alias=True),
                "truncation": "disabled", "metadata": body.metadata or {}, "store": body.store is not False}

    @staticmethod
    def usage(stats: dict) -> dict[str, Any]:
        prompt, new = int(stats.get("prompt_tokens", 0)), int(stats.get("new_tokens", 0))
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": int(stats.get("cached_tokens", 0))},
                "output_tokens": new, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + new}

    @staticmethod
    def message_item(text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}

    @staticmethod
    def call_item(name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": "call_" + uuid.uuid4().hex[:24],
                "name": name, "arguments": arguments, "status": status}

    def whole(self, header: dict) -> dict[str, Any]:
        text = header.get("text", "")
        call = self.tools.call_of(text) if self.tools is not None and header.get("finish_reason") == "stop" else None
        if call is not None:
            arguments = text if self.tools.named else json.dumps(call[1], ensure_ascii=False)
            output = [self.call_item(call[0], arguments)]
        else:
            output = [self.message_item(text)]
        if header.get("reasoning"):  # a thinking model's thinking, as a reasoning item before the answer
            output.insert(0, self.reasoning_item(header["reasoning"]))
        cut = header.get("finish_reason") == "length"
        return self.response("incomplete" if cut else "completed", output, self.usage(header.get("stats") or {}),
                             "max_output_tokens" if cut else None)

    @staticmethod
    def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [], "content": content,
                "status": status}

    def event(self, kind: str, **payload: Any) -> dict[str, str]:
        self.sequence += 1
        data = {"type": kind, "sequence_number": self.sequence - 1, **payload}
        return {"event": kind, "data": json.dumps(data, separators=(",", ":"), ensure_ascii=False)}


def output_turn(response: dict) -> dict[str, str]:
    """A response's output as the assistant's text turn of the conversation it continues."""
    item = response["output"][-1]  # after a reasoning item, if the model thought
    if item["type"] == "function_call":
        return {"role": "assistant", "content": call_as_text(item["name"], parsed_arguments(item["arguments"]))}
    return {"role": "assistant", "content": "".join(part["text"] for part in item["content"])}


async def _events(dispatch: Dispatcher, call: Call, reply: Reply, first: tuple[str, dict, Optional[dict]],
                  keep: Any) -> AsyncIterator[dict[str, str]]:
    """The Responses event sequence; if the client goes away (the task is cancelled), so does the generation."""
    stream = ToolCallStream(reply.tools)
    item: Optional[dict] = None  # the answer's output item being streamed
    thought: Optional[dict] = None  # the reasoning item, while it streams
    done_items: list[dict] = []
    text = arguments = reasoning = ""

    def close_thought() -> list[dict[str, str]]:
        nonlocal thought
        if thought is None:
            return []
        done = {**thought, "status": "completed", "content": [{"type": "reasoning_text", "text": reasoning}]}
        done_items.append(done)
        thought = None
        return [reply.event("response.reasoning_text.done", item_id=done["id"], output_index=0, content_index=0,
                            text=reasoning),
                reply.event("response.output_item.done", output_index=0, item=done)]

    def on(events: list[StreamEvent]) -> list[dict[str, str]]:
        nonlocal item, thought, text, arguments, reasoning
        out = []
        for event in events:
            if event.kind == "thinking":
                if thought is None:
                    thought = reply.reasoning_item("", "in_progress")
                    out.append(reply.event("response.output_item.added", output_index=0, item=thought))
                reasoning += event.text
                out.append(reply.event("response.reasoning_text.delta", item_id=thought["id"], output_index=0,
                                       content_index=0, delta=event.text))
                continue
            out += close_thought()
            at = len(done_items)
            if event.kind == "call":
                item = reply.call_item(event.name, "", "in_progress")
                out.append(reply.event("response.output_item.added", output_index=at, item=item))
                continue
            if item is None:
                item = reply.message_item("", "in_progress")
                out.append(reply.event("response.output_item.added", output_index=at, item=item))
                out.append(reply.event("response.content_part.added", item_id=item["id"], output_index=at,
                                       content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            if event.kind == "text":
                text += event.text
                out.append(reply.event("response.output_text.delta", item_id=item["id"], output_index=at,
                                       content_index=0, delta=event.text, logprobs=[]))
            else:
                arguments += event.text
                out.append(reply.event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=at, delta=event.text))
        return out

    try:
        yield reply.event("response.created", response=reply.response("in_progress", []))
        yield reply.event("response.in_progress", response=reply.response("in_progress", []))
        current = first
        while True:
            kind, header, _ = current
            if kind == "chunk":
                thinking = [StreamEvent("thinking", header["reasoning"])] if header.get("reasoning") else []
                for event in on(thinking + stream.feed(header.get("text") or "")):
                    yield event
            elif header.get("ok"):
                for event in on(stream.finish() or ([] if item is not None else [StreamEvent("text", "")])):
                    yield event
                at = len(done_items)
                if item["type"] == "function_call":
                    done = {**item, "arguments": arguments, "status": "completed"}
                    yield reply.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                      arguments=arguments)
                else:
                    part = {"type": "output_text", "text": text, "annotations": []}
                    done = {**item, "status": "completed", "content": [part]}
                    yield reply.event("response.output_text.done", item_id=item["id"], output_index=at,
                                      content_index=0, text=text, logprobs=[])
                    yield reply.event("response.content_part.done", item_id=item["id"], output_index=at,
                                      content_index=0, part=part)
                yield reply.event("response.output_item.done", output_index=at, item=done)
                cut = header.get("finish_reason") == "length"
                final = reply.response("incomplete" if cut else "completed", [*done_items, done],
                                       reply.usage(header.get("stats") or {}), "max_output_tokens" if cut else None)
                keep(final)
                yield reply.event("response.incomplete" if cut else "response.completed", response=final)
                break
            else:
                error = failure_error(header)
                yield reply.event("error", code=error.code, message=error.message, param=error.param)
                break
            current = await call.next()
    finally:
        dispatch.cancel(call)  # a no-op once the final reply came


def routes(dispatch: Dispatcher) -> list[Route]:
    server = dispatch.server
    limit = server.limits.max_message_bytes
    store = ResponseStore()

    def conversation(body: ResponsesRequest, tools: Tools) -> tuple[list[dict], list[dict], dict[str, str]]:
        """(the engine's messages, the turns to store, call names) of a request."""
        turns: list[dict] = []
        calls: dict[str, str] = {}
        if body.previous_response_id is not None:
            before = store.get(body.previous_response_id)
            if before is None:
                raise FieldError(f"previous_response_id '{body.previous_response_id[:64]}' is not stored here (never "
                                 f"stored, deleted, or evicted: this server keeps the last {MAX_STORED})",
                                 "previous_response_id")
            turns, calls = list(before.turns), dict(before.calls)
        turns += input_turns(body, calls)
        system = tools.system_message()["content"] if tools.active else ""
        if body.instructions:
            system = system + ("\n\n" if system else "") + body.instructions
        return ([{"role": "system", "content": system}] if system else []) + turns, turns, calls

    def parameters_of(body: ResponsesRequest, tools: Tools, messages: list[dict]) -> dict[str, Any]:
        parameters: dict[str, Any] = {"messages": messages}
        for name, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                            ("top_p", body.top_p), ("top_k", body.top_k), ("seed", body.seed),
                            ("speculative", body.speculative), ("ignore_eos", body.ignore_eos),
                            ("min_tokens", body.min_tokens), ("timeout_ms", body.timeout_ms)):
            if value is not None:
                parameters[name] = value
        effort = (body.reasoning or {}).get("effort")
        if effort is not None:  # a thinking model's template takes enable_thinking (Qwen3's); others ignore it
            parameters["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
        constraint = constraint_of(body)
        if tools.active:
            if constraint is not None:
                raise FieldError("give 'tools' or 'text.format', not both", "tools")
            constraint = tools.constraint()
        if constraint is not None:
            parameters["constraint"] = constraint
        if body.stream:
            parameters["stream"] = True
        return parameters

    async def create(request: Request) -> Response:
        try:
            body = await parse_body(request, ResponsesRequest, limit)
            model = generating_model(server, body.model)
            try:
                tools = tools_of(body)
                messages, turns, calls = conversation(body, tools)
                parameters = parameters_of(body, tools, messages)
            except FieldError as exc:
                raise bad_request(str(exc), exc.param) from None
            reply = Reply(body, tools)

            def keep(response: dict) -> None:
                if body.store is not False:
                    item = response["output"][-1]
                    if item["type"] == "function_call":
                        calls[item["call_id"]] = item["name"]
                    store.put(response["id"], Stored(response, turns + [output_turn(response)], calls))

            if not body.stream:
                response = reply.whole(await generate_whole(dispatch, request, model.name, parameters))
                keep(response)
                return JSONResponse(response)
            call, first = await generate_stream(dispatch, request, model.name, parameters)
            return EventSourceResponse(_events(dispatch, call, reply, first, keep), sep="\n", ping=15)
        except Exception as exc:
            return failed(request, exc)

    def not_stored(key: str) -> Response:
        return ApiError(404, f"no response '{key[:64]}' is stored here", "not_found", "response_id").response()

    async def retrieve(request: Request) -> Response:
        key = request.path_params["key"]
        stored = store.get(key)
        return JSONResponse(stored.response) if stored is not None else not_stored(key)

    async def delete(request: Request) -> Response:
        key = request.path_params["key"]
        if not store.delete(key):
            return not_stored(key)
        return JSONResponse({"id": key, "object": "response", "deleted": True})

    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{key}", retrieve, methods=["GET"]),
            Route("/v1/responses/{key}", delete, methods=["DELETE"])]
