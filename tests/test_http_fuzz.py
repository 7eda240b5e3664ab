"""The HTTP front fuzzed from its own description: request bodies drawn by hypothesis from the
schemas /openapi.json publishes (`from_schema` below: hypothesis-jsonschema 0.23.1, the library
for this, fails against hypothesis 6.170's internals), and arbitrary JSON beside them, sent to a
real server; every answer is below 500 and matches the schema of its status, and the log holds
no traceback."""

from __future__ import annotations

import copy
import json

import pytest

httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("starlette")
pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from conftest import MANIFESTS, free_port, start_server, write_manifest  # noqa: E402

pytestmark = pytest.mark.slow

PLUGINS = ["outrider_echo", "outrider_text", "outrider_onnxruntime", "outrider_batching",
           "outrider_test_hf_llama", "outrider_http"]
EXAMPLES = 60
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import yaml

    tmp = tmp_path_factory.mktemp("fuzz")
    tiny = write_manifest(tmp, yaml.safe_dump({"name": "tiny", "backend": "hf-llama", "options": {"seed": 3}}),
                          "tiny.yaml")
    port = free_port()
    server = start_server(tmp, [MANIFESTS / "echo.yaml", MANIFESTS / "minilm.yaml", tiny], PLUGINS,
                          args=["--http", f"127.0.0.1:{port}"])
    try:
        server.wait_ready(timeout=300)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=60) as client:
            spec = client.get("/openapi.json").json()
            yield client, spec
        assert "Traceback" not in server.log(), server.log()[-3000:]
    finally:
        server.stop()


def _inline(schema, components):
    """`schema` with every local $ref replaced by what it points at."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inline(copy.deepcopy(components[schema["$ref"].rsplit("/", 1)[1]]), components)
        return {k: _inline(v, components) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_inline(v, components) for v in schema]
    return schema


def from_schema(schema) -> st.SearchStrategy:
    """Values that a JSON schema (the subset pydantic and openapi.py write) accepts, plus extra
    keys where it allows them."""
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(s) for s in schema.get("anyOf", schema.get("oneOf"))])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(schema.get("minimum", -(2**40)), schema.get("maximum", 2**40))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False)
    if kind == "string":
        return st.text(max_size=schema.get("maxLength", 40))
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {})), max_size=min(schema.get("maxItems", 4), 4))
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        fixed = {k: from_schema(v) for k, v in properties.items() if k in required}
        optional = {k: from_schema(v) for k, v in properties.items() if k not in required}
        base = st.fixed_dictionaries(fixed, optional=optional)
        if schema.get("additionalProperties", True) is False:
            return base
        return st.tuples(base, st.dictionaries(st.text(max_size=8), JSON, max_size=2)).map(
            lambda pair: {**pair[1], **pair[0]})
    return JSON


def _schemas(spec, path):
    components = spec["components"]["schemas"]
    post = spec["paths"][path]["post"]
    body = _inline(post["requestBody"]["content"]["application/json"]["schema"], components)
    answers = {int(status): _inline(r["content"]["application/json"]["schema"], components)
               for status, r in post["responses"].items() if "content" in r}
    return body, answers


def _check(answer, answers):
    assert answer.status_code < 500, (answer.status_code, answer.text[:500])
    schema = answers.get(answer.status_code) or answers.get(400)
    jsonschema.validate(answer.json(), schema)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=20),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children,
                                                                                       max_size=4), max_leaves=12)


def test_openapi_document_describes_the_routes(served):
    _, spec = served
    assert spec["openapi"].startswith("3.1")
    for path in ("/v2/models/{name}/infer", "/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                 "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"):
        body, answers = _schemas(spec, path)
        assert body["type"] == "object" and 200 in answers and 400 in answers


@pytest.mark.parametrize("path,models", [("/v1/chat/completions", ["tiny"]), ("/v1/completions", ["tiny"]),
                                         ("/v1/embeddings", ["minilm", "echo"]), ("/v1/messages", ["tiny", "echo"]),
                                         ("/v1/messages/count_tokens", ["tiny"]), ("/v1/responses", ["tiny"])])
def test_openai_routes_fuzzed_from_their_schemas(served, path, models):
    client, spec = served
    body_schema, answers = _schemas(spec, path)
    body_schema["properties"]["model"] = {"enum": models}
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if name in body_schema["properties"]:  # a long generation costs time, not coverage
            body_schema["properties"][name] = {"anyOf": [{"type": "integer", "maximum": 8}, {"type": "null"}]}
    body_schema["properties"].pop("stream", None)  # an SSE answer is not a JSON document

    @FUZZ
    @given(from_schema(body_schema))
    def run(body):
        _check(client.post(path, json=body), answers)

    run()


def test_oip_infer_fuzzed_from_its_schema_and_with_any_json(served):
    client, spec = served
    body_schema, answers = _schemas(spec, "/v2/models/{name}/infer")

    @FUZZ
    @given(st.sampled_from(["echo", "minilm", "tiny", "nope"]), from_schema(body_schema) | JSON)
    def run(model, body):
        _check(client.post(f"/v2/models/{model}/infer", content=json.dumps(body)), answers)

    run()
