"""OpenAI's /v1/embeddings, with the options embedding users ask for (text-embeddings-inference,
vLLM and OpenAI have them).

- `input`: a string, a list of strings, or token ids (a list of ints, or a list of lists);
- `dimensions`: for a model trained for shortened embeddings (Matryoshka; its manifest says
  `options.matryoshka` or lists `options.matryoshka_dimensions`), the first `dimensions`
  components, L2-renormalized; refused for any other model unless it is the model's own width;
- `truncate` (extension, as TEI's): a text longer than the model's limit is cut to it (true) or
  refused naming its index, length and the limit (false); default: the manifest's `options.truncate`;
- `usage.prompt_tokens`: the tokens the model was fed, special tokens included.

The front tokenizes with the model's own task (tokenize_api.py) and sends the ids (the text
task's token-id elements, plugins/outrider_text), so what it counts is what the model sees and
the instance does not tokenize twice. A sentence's vector does not depend on the batch it lands
in: ORT CPU gives the same bits alone and in any batch (docs/HTTP.md). It shares the schema base,
error shape and request parsing of openai_api.py, so an error reads like any other OpenAI error:
a 400 in OpenAI's shape naming the param.
"""

from __future__ import annotations

import base64
import logging
from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import StrictInt
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from outrider.errors import OutriderError
from outrider.protocol import encode_bytes_tensor

from .dispatch import ClientGone, Dispatcher
from .json_api import ApiError, bad_request, failure_error, parse_body, Schema, served_model
from .tokenize_api import EmbeddingTokenizer, embedding_tokenizer_async, off_loop

log = logging.getLogger("outrider.http")

#: marks a `text` element that holds token ids (plugins/outrider_text: 0xFF never occurs in UTF-8)
TOKEN_IDS_MARK = b"\xff"


class EmbeddingRequest(Schema):
    model: str
    # Strict ints: JSON true or 1.5 is not a token id.
    input: Union[str, list[str], list[list[StrictInt]], list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    truncate: Optional[bool] = None


def routes(dispatch: Dispatcher) -> list[Route]:
    """/v1/embeddings over `dispatch`."""
    server = dispatch.server
    limit = server.limits.max_message_bytes

    def model_named(name: str) -> Any:
        model = served_model(server, name)
        if model.generates:
            raise bad_request(f"model '{name}' generates text; use /v1/completions or /v1/chat/completions", "model")
        return model

    async def embeddings(request: Request) -> Response:
        try:
            body = await parse_body(request, EmbeddingRequest, limit)
            model = model_named(body.model)
            text_input, vector_output = _embedding_contract(model)
            inputs = _inputs(body.input, model.manifest.limits.max_rows)
            task = await embedding_tokenizer_async(model)
            if task is not None:
                _check_dimensions(body.dimensions, model.name, task)
                rows = await _token_rows(inputs, task, body.truncate)
                elements = [TOKEN_IDS_MARK + np.asarray(row, dtype="<u4").tobytes() for row in rows]
                tokens = sum(map(len, rows))
            else:  # a model whose task does not tokenize here: its text goes as it is, uncounted
                if body.truncate is not None:
                    raise bad_request(f"model '{model.name}' does not say how it tokenizes; 'truncate' cannot be used",
                               "truncate")
                if isinstance(inputs[0], list):
                    raise bad_request(f"model '{model.name}' does not say how it tokenizes; send 'input' as text", "input")
                elements, tokens = inputs, 0
            buffer = encode_bytes_tensor(np.array(elements, dtype=object))
            spec = {"name": text_input, "datatype": "BYTES", "shape": [len(elements)]}
            call = dispatch.submit(request.scope, "infer", model.name, {}, [spec], [buffer])
            header, outputs = await dispatch.final(call, request.receive)
            if not header.get("ok"):
                raise failure_error(header)
            vectors = np.asarray(outputs[vector_output], dtype="<f4")
            if body.dimensions is not None and body.dimensions != vectors.shape[1]:
                if task is None:
                    raise bad_request(f"model '{model.name}' returns {vectors.shape[1]} dimensions; 'dimensions' "
                               f"cannot change that", "dimensions")
                vectors = shortened(vectors, body.dimensions)
            if body.encoding_format == "base64":
                data = [base64.b64encode(np.ascontiguousarray(v).tobytes()).decode("ascii") for v in vectors]
            else:
                data = vectors.tolist()
            return JSONResponse({
                "object": "list",
                "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                "model": model.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            })
        except ClientGone:
            return Response(status_code=499)
        except Exception as exc:
            if not isinstance(exc, (ApiError, OutriderError)):
                log.exception("HTTP %s failed", request.url.path)
            return ApiError.of(exc).response()

    return [Route("/v1/embeddings", embeddings, methods=["POST"])]


def shortened(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """The first `dimensions` components of each row, L2-renormalized (a Matryoshka embedding)."""
    cut = vectors[:, :dimensions]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return (cut / np.maximum(norms, np.float32(1e-12))).astype("<f4")  # the model's own eps (F.normalize)


def _embedding_contract(model: Any) -> tuple[str, str]:
    """(text input, vector output) of a model that embeds text: one BYTES input, one 2-D FP32 output."""
    m = model.manifest
    if (len(m.inputs) == 1 and m.inputs[0].datatype == "BYTES" and len(m.outputs) == 1
            and m.outputs[0].datatype == "FP32" and len(m.outputs[0].shape) == 2):
        return m.inputs[0].name, m.outputs[0].name
    raise bad_request(f"model '{model.name}' does not embed text (it needs one BYTES input and one [N, D] FP32 output)",
               "model")


def _inputs(given: Any, max_rows: int) -> Union[list[str], list[list[int]]]:
    """`input` as a list of texts or a list of token-id lists (one list of ints is one input)."""
    if isinstance(given, str):
        rows: list = [given]
    elif given and isinstance(given[0], int):
        rows = [given]
    else:
        rows = list(given)
    if not rows:
        raise bad_request("'input' must not be empty", "input")
    if len(rows) > max_rows:
        raise bad_request(f"'input' holds {len(rows)} inputs; this model takes at most {max_rows} a request "
                   f"(limits.max_rows)", "input")
    return rows


def _check_dimensions(dimensions: Optional[int], name: str, task: EmbeddingTokenizer) -> None:
    """A 400 naming `dimensions` unless the model gives embeddings of that width."""
    width = task.hidden_size
    if dimensions is None or dimensions == width:
        return
    if not 1 <= dimensions <= width:
        raise bad_request(f"'dimensions' must be from 1 to {width}, the width of model '{name}' (got {dimensions})",
                   "dimensions")
    if not task.matryoshka:
        raise bad_request(f"model '{name}' was not trained for shortened embeddings (its manifest does not set "
                   f"options.matryoshka), so 'dimensions' can only be {width}", "dimensions")
    if dimensions not in task.dimensions:
        raise bad_request(f"model '{name}' gives embeddings of {sorted(task.dimensions)} dimensions "
                   f"(options.matryoshka_dimensions), not {dimensions}", "dimensions")


async def _token_rows(inputs: Union[list[str], list[list[int]]], task: EmbeddingTokenizer,
                      truncate: Optional[bool]) -> list[list[int]]:
    """The token ids of each input, checked: the model's limit, its vocabulary, the truncation policy."""
    if isinstance(inputs[0], list):
        if truncate is not None:  # ids are the model's input as given: nothing here cuts them
            raise bad_request("'truncate' applies to text; token ids are never cut (at most "
                       f"{task.max_length} a row)", "truncate")
        for i, row in enumerate(inputs):
            if not 1 <= len(row) <= task.max_length:
                raise bad_request(f"input[{i}] holds {len(row)} token ids; this model takes 1 to {task.max_length}", "input")
            bad = next((t for t in row if not 0 <= t < task.vocab_size), None)
            if bad is not None:
                raise bad_request(f"input[{i}]: token id {bad} is outside the vocabulary (0 to {task.vocab_size - 1})",
                           "input")
        return inputs  # type: ignore[return-value]  # lists of ints, checked above
    cut = task.truncate if truncate is None else truncate
    texts: list[str] = inputs  # type: ignore[assignment]
    rows = await off_loop(lambda: task.encode(texts, truncate=cut), sum(map(len, texts)))
    if not cut:
        for i, row in enumerate(rows):
            if len(row) > task.max_length:
                least = "at least " if len(texts[i]) > task.max_chars else ""  # only a prefix was tokenized
                raise bad_request(f"input[{i}] has {least}{len(row)} tokens, more than the {task.max_length} this model "
                           f"takes; send 'truncate': true to cut it to the limit", "input")
    return rows
