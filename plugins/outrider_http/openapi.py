"""`GET /openapi.json`: an OpenAPI 3.1 description of the HTTP front, for clients and for fuzzing.

The OpenAI and Anthropic request bodies are the routes' own pydantic schemas (what the routes validate with);
the OIP v2 infer request and response follow KServe's REST spec for the parts served here. Every
route answers errors in one of three shapes, `OipError` ({"error": "..."}), `OpenAIError`, or
`AnthropicError` (/v1/messages). The
property-based fuzzer (tests/test_http_fuzz.py) draws request bodies from these schemas and
checks each answer against the schema of its status.
"""

from __future__ import annotations

from typing import Any

from outrider import __version__

TENSOR = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "datatype": {"enum": ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                              "FP16", "FP32", "FP64", "BYTES"]},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "parameters": {"type": "object"},
        "data": {},
    },
    "required": ["name", "datatype", "shape"],
}
INFER_REQUEST = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "parameters": {"type": "object"},
        "inputs": {"type": "array", "items": {"$ref": "#/components/schemas/Tensor"}},
        "outputs": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "parameters": {"type": "object"}}, "required": ["name"]}},
    },
    "required": ["inputs"],
}
INFER_RESPONSE = {
    "type": "object",
    "properties": {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string"},
        "outputs": {"type": "array", "items": {"$ref": "#/components/schemas/Tensor"}},
    },
    "required": ["model_name", "outputs"],
}
OIP_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
OPENAI_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}, "required": ["message", "type"]}},
    "required": ["error"],
}
COMPLETION_RESPONSE = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "model": {"type": "string"},
                   "choices": {"type": "array"}, "usage": {"type": "object"}},
    "required": ["id", "object", "choices"],
}
ANTHROPIC_ERROR = {
    "type": "object",
    "properties": {"type": {"const": "error"}, "error": {"type": "object", "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}, "required": ["type", "message"]}},
    "required": ["type", "error"],
}
MESSAGE_RESPONSE = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
                   "content": {"type": "array"}, "stop_reason": {"type": ["string", "null"]},
                   "usage": {"type": "object"}},
    "required": ["id", "type", "role", "content", "stop_reason", "usage"],
}
TOKEN_COUNT = {"type": "object", "properties": {"input_tokens": {"type": "integer"}}, "required": ["input_tokens"]}
RESPONSE_OBJECT = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "object": {"const": "response"}, "status": {"type": "string"},
                   "output": {"type": "array"}, "usage": {"type": ["object", "null"]}},
    "required": ["id", "object", "status", "output"],
}
EMBEDDING_RESPONSE = {
    "type": "object",
    "properties": {"object": {"const": "list"}, "data": {"type": "array"}, "model": {"type": "string"},
                   "usage": {"type": "object"}},
    "required": ["object", "data", "usage"],
}


def _json(schema_ref: str) -> dict:
    return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_ref}"}}}}


def _errors(kind: str) -> dict:
    return {str(status): {"description": "refused", **_json(kind)} for status in (400, 401, 404, 408, 413, 431, 503)}


def document() -> dict[str, Any]:
    """The OpenAPI document (computed on each call: cheap, and it never goes stale)."""
    from .anthropic_messages import CountRequest, MessagesRequest
    from .embeddings_api import EmbeddingRequest
    from .openai_api import ChatRequest, CompletionRequest
    from .openai_responses import ResponsesRequest

    schemas: dict[str, Any] = {"Tensor": TENSOR, "InferRequest": INFER_REQUEST, "InferResponse": INFER_RESPONSE,
                               "OipError": OIP_ERROR, "OpenAIError": OPENAI_ERROR,
                               "CompletionResponse": COMPLETION_RESPONSE, "EmbeddingResponse": EMBEDDING_RESPONSE,
                               "AnthropicError": ANTHROPIC_ERROR, "MessageResponse": MESSAGE_RESPONSE,
                               "TokenCount": TOKEN_COUNT, "ResponseObject": RESPONSE_OBJECT}
    for model in (ChatRequest, CompletionRequest, EmbeddingRequest, MessagesRequest, CountRequest, ResponsesRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema

    def post(body: str, ok: str, errors: str) -> dict:
        return {"post": {"requestBody": {"required": True, **_json(body)},
                         "responses": {"200": {"description": "answered", **_json(ok)}, **_errors(errors)}}}

    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    health = {"get": {"responses": {"200": {"description": "yes"}, "503": {"description": "not yet"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Outrider", "version": __version__},
        "paths": {
            "/v2/health/live": health,
            "/v2/health/ready": health,
            "/v2/models/{name}/infer": {**post("InferRequest", "InferResponse", "OipError"),
                                        "parameters": [name]},
            "/v1/chat/completions": post("ChatRequest", "CompletionResponse", "OpenAIError"),
            "/v1/completions": post("CompletionRequest", "CompletionResponse", "OpenAIError"),
            "/v1/embeddings": post("EmbeddingRequest", "EmbeddingResponse", "OpenAIError"),
            "/v1/messages": post("MessagesRequest", "MessageResponse", "AnthropicError"),
            "/v1/messages/count_tokens": post("CountRequest", "TokenCount", "AnthropicError"),
            "/v1/responses": post("ResponsesRequest", "ResponseObject", "OpenAIError"),
        },
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
    }
