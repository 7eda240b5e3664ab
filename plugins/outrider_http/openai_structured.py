"""OpenAI's structured-output and tool fields, mapped onto the engine's `constraint`, and its
log-probability shapes built from the engine's per-token entries.

- `response_format`: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}.
- Extensions (as vLLM's): `structured_outputs: {"json" | "regex" | "choice" | "grammar": ...}`,
  and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
- `tools` with `tool_choice`: "none" (ignored), a named function (its arguments constrained to its
  schema), "required" (one of the tools, as {"name", "arguments"}), or "auto", the default (the
  answer is either plain text or such a call: a grammar of both). The tools are described to the
  model in a system message; the call comes back as `tool_calls`, finish_reason "tool_calls".
  A conversation's earlier calls (assistant `tool_calls`) and their results (role "tool") are
  written into the messages as text, since the engine's chat template takes text turns.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

MAX_TOOLS = 64


class FieldError(ValueError):
    """A bad field: (message, the parameter's name)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def constraint_of(body: Any) -> Optional[dict]:
    """The engine's `constraint` for a request's structured-output fields (at most one may be set)."""
    extra = body.model_extra or {}
    found: list[tuple[str, dict]] = []
    fmt = extra.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise FieldError("'response_format.type' must be text, json_object or json_schema", "response_format")
        if fmt["type"] == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise FieldError("'response_format.json_schema.schema' must be a JSON schema (an object)",
                                 "response_format")
            found.append(("response_format", {"json_schema": spec["schema"]}))
    outputs = extra.get("structured_outputs")
    if outputs is not None:
        names = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}
        if not isinstance(outputs, dict) or len(outputs) != 1 or next(iter(outputs)) not in names:
            raise FieldError("'structured_outputs' must hold one of json, regex, choice or grammar",
                             "structured_outputs")
        key, value = next(iter(outputs.items()))
        found.append(("structured_outputs", {names[key]: value}))
    for field, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "lark")):
        if extra.get(field) is not None:
            value = extra[field]
            if kind == "json_schema" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise FieldError(f"'{field}' is not valid JSON", field) from None
            found.append((field, {kind: value}))
    if len(found) > 1:
        raise FieldError(f"give one output constraint, got {', '.join(f for f, _ in found)}", found[1][0])
    return found[0][1] if found else None


class Tools:
    """A request's tools and tool choice: the constraint, the system message, the parsed call.

    Built from any API's fields: `of_chat` reads Chat Completions' (and Responses') shape; the
    Messages route maps Anthropic's onto the same (functions by name, choice, named function)."""

    def __init__(self, functions: dict[str, dict], choice: str, named: Optional[str] = None) -> None:
        if len(functions) > MAX_TOOLS:
            raise FieldError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
        self.functions = functions  # name -> {"name", "description", "parameters": JSON schema}
        if choice in ("auto", "required") and not functions:
            raise FieldError(f"'tool_choice' is {choice!r} but no tools are given", "tool_choice")
        self.choice, self.named = choice, named

    @classmethod
    def of_chat(cls, body: Any) -> "Tools":
        """Chat Completions' `tools` ({"type": "function", "function": {...}}) and `tool_choice`."""
        extra = body.model_extra or {}
        return cls.of_functions(extra.get("tools"), extra.get("tool_choice"),
                                lambda tool: tool.get("function") if tool.get("type") == "function" else None,
                                "{'type': 'function', 'function': {'name': ...}}")

    @classmethod
    def of_functions(cls, tools: Any, choice: Any, function_of: Any, shape: str) -> "Tools":
        """Tools from a list whose items `function_of` maps to {"name", "description", "parameters"}
        (None for an item of the wrong shape, described by `shape` in the error)."""
        tools = tools or []
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise FieldError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
        functions: dict[str, dict] = {}
        for index, tool in enumerate(tools):
            function = function_of(tool) if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                raise FieldError(f"tools[{index}] must be {shape}", "tools")
            parameters = function.get("parameters") or {"type": "object"}
            if not isinstance(parameters, dict):
                raise FieldError(f"tools[{index}]: the parameters must be a JSON schema (an object)", "tools")
            functions[function["name"]] = {**function, "parameters": parameters}
        if choice is None:
            choice = "auto" if functions else "none"
        named = None
        if isinstance(choice, dict):
            named = choice.get("name") or (choice.get("function") or {}).get("name")
        if not (choice in ("none", "auto", "required") or (named is not None and named in functions)):
            raise FieldError("'tool_choice' must be none, auto, required or {'type': 'function', 'function': "
                             f"{{'name': one of {sorted(functions)}}}}}", "tool_choice")
        return cls(functions, "named" if named else choice, named)

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def _call_schema(self, name: str) -> dict:
        return {"type": "object", "properties": {"name": {"const": name},
                                                 "arguments": self.functions[name]["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False}

    def constraint(self) -> dict:
        """Named: the arguments alone. Required: one call. Auto: text that does not start a JSON
        object, or one call (Lark, with llguidance's inline %json)."""
        if self.named:
            return {"json_schema": self.functions[self.named]["parameters"]}
        call = {"anyOf": [self._call_schema(n) for n in self.functions]}
        if self.choice == "required":
            return {"json_schema": call}
        return {"lark": "start: call | TEXT\ncall: %json " + json.dumps(call) + "\nTEXT: /[^{\\s][\\s\\S]*/\n"}

    def system_message(self) -> dict:
        lines = ["You can call these functions. To call one, answer with only a JSON object "
                 '{"name": <function name>, "arguments": <its arguments>}.']
        for name, function in self.functions.items():
            lines.append(json.dumps({"name": name, "description": function.get("description", ""),
                                     "parameters": function["parameters"]}))
        if self.named:
            lines.append(f"Call {self.named} now: answer with its arguments as a JSON object.")
        return {"role": "system", "content": "\n".join(lines)}

    def call_of(self, text: str) -> Optional[tuple[str, Any]]:
        """(name, arguments) of the call in a constrained answer, or None (an "auto" answer in text)."""
        if self.named:
            return self.named, json.loads(text)
        if not text.lstrip().startswith("{"):
            return None
        call = json.loads(text)
        return call["name"], call["arguments"]

    def tool_calls(self, text: str) -> Optional[list[dict]]:
        """The call in a constrained answer, or None (an "auto" answer in plain text)."""
        if self.named:
            name, arguments = self.named, text
        else:
            if not text.lstrip().startswith("{"):
                return None
            call = json.loads(text)
            name, arguments = call["name"], json.dumps(call["arguments"], ensure_ascii=False)
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": name, "arguments": arguments}}]


def history_as_text(message: Any) -> Optional[dict]:
    """An assistant turn with tool_calls, or a role "tool" result, as a text turn; None otherwise."""
    extra = message.model_extra or {}
    if message.role == "tool":
        name = extra.get("name") or extra.get("tool_call_id") or "the call"
        return {"role": "user", "content": result_as_text(name, _text(message.content))}
    if message.role == "assistant" and extra.get("tool_calls"):
        calls = [{"name": c.get("function", {}).get("name"),
                  "arguments": parsed_arguments(c.get("function", {}).get("arguments") or "{}")}
                 for c in extra["tool_calls"] if isinstance(c, dict)]
        return {"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1 else calls)}
    return None


def call_as_text(name: Any, arguments: Any) -> str:
    """A past tool call written into an assistant turn as the object the tools grammar makes
    (the Messages and Responses routes' history)."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def result_as_text(name: Any, output: str, failed: bool = False) -> str:
    """A tool's result written into a user turn, naming the call it answers (every route's history)."""
    return f"Result of {name}{' (the call failed)' if failed else ''}: {output}"


def parsed_arguments(arguments: Any) -> Any:
    """A call's arguments as sent (a JSON string), parsed; as they are when they are not JSON."""
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(getattr(p, "text", None) or "" for p in content)
    return content or ""


def chat_logprobs(entries: Optional[list[dict]]) -> Optional[dict]:
    """choices[].logprobs of a chat completion: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if entries is None:
        return None

    def one(e: dict) -> dict:
        return {"token": e.get("token", ""), "logprob": e["logprob"], "bytes": list(e.get("token", "").encode())}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.get("top", [])]} for e in entries]}


def completion_logprobs(entries: Optional[list[dict]], offset: int = 0) -> Optional[dict]:
    """choices[].logprobs of a text completion: tokens, token_logprobs, top_logprobs, text_offset."""
    if entries is None:
        return None
    offsets, position = [], offset
    for e in entries:
        offsets.append(position)
        position += len(e.get("token", ""))
    return {"tokens": [e.get("token", "") for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t.get("token", ""): t["logprob"] for t in e.get("top", [])} for e in entries],
            "text_offset": offsets}
