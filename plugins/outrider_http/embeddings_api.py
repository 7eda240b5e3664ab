"""OpenAI's /v1/embeddings route, apart from the generation routes of openai_api.py.

It shares their schema base, error shape and request parsing (imported from openai_api), so an
embedding error reads like any other OpenAI error: a 400 in OpenAI's shape naming the param.
"""

from __future__ import annotations

import base64
import logging
from typing import Any, Literal, Optional, Union

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from outrider.errors import OutriderError
from outrider.protocol import encode_bytes_tensor

from .dispatch import ClientGone, Dispatcher
from .openai_api import ApiError, _bad, _failure, _parse, _Schema

log = logging.getLogger("outrider.http")


class EmbeddingRequest(_Schema):
    model: str
    input: Union[str, list[str]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None


def routes(dispatch: Dispatcher) -> list[Route]:
    """/v1/embeddings over `dispatch`."""
    server = dispatch.server
    limit = server.limits.max_message_bytes

    def model_named(name: str) -> Any:
        model = server.models.get(name)
        if model is None:
            raise ApiError(404, f"The model '{name[:128]}' does not exist; served here: {sorted(server.models)}",
                           "model_not_found", "model")
        if model.generates:
            raise _bad(f"model '{name}' generates text; use /v1/completions or /v1/chat/completions", "model")
        return model

    async def embeddings(request: Request) -> Response:
        try:
            body = await _parse(request, EmbeddingRequest, limit)
            model = model_named(body.model)
            text_input, vector_output = _embedding_contract(model)
            texts = [body.input] if isinstance(body.input, str) else body.input
            if not texts:
                raise _bad("'input' must not be empty", "input")
            buffer = encode_bytes_tensor(np.array(texts, dtype=object))
            spec = {"name": text_input, "datatype": "BYTES", "shape": [len(texts)]}
            call = dispatch.submit(request.scope, "infer", model.name, {}, [spec], [buffer])
            header, outputs = await dispatch.final(call, request.receive)
            if not header.get("ok"):
                raise _failure(header)
            vectors = np.asarray(outputs[vector_output], dtype="<f4")
            if body.dimensions is not None and body.dimensions != vectors.shape[1]:
                raise _bad(f"model '{model.name}' returns {vectors.shape[1]} dimensions; 'dimensions' "
                           f"cannot change that", "dimensions")
            if body.encoding_format == "base64":
                data = [base64.b64encode(np.ascontiguousarray(v).tobytes()).decode("ascii") for v in vectors]
            else:
                data = vectors.tolist()
            return JSONResponse({
                "object": "list",
                "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                "model": model.name,
                # The embedding task does not report token counts.
                "usage": {"prompt_tokens": 0, "total_tokens": 0},
            })
        except ClientGone:
            return Response(status_code=499)
        except Exception as exc:
            if not isinstance(exc, (ApiError, OutriderError)):
                log.exception("HTTP %s failed", request.url.path)
            return ApiError.of(exc).response()

    return [Route("/v1/embeddings", embeddings, methods=["POST"])]


def _embedding_contract(model: Any) -> tuple[str, str]:
    """(text input, vector output) of a model that embeds text: one BYTES input, one 2-D FP32 output."""
    m = model.manifest
    if (len(m.inputs) == 1 and m.inputs[0].datatype == "BYTES" and len(m.outputs) == 1
            and m.outputs[0].datatype == "FP32" and len(m.outputs[0].shape) == 2):
        return m.inputs[0].name, m.outputs[0].name
    raise _bad(f"model '{model.name}' does not embed text (it needs one BYTES input and one [N, D] FP32 output)",
               "model")
