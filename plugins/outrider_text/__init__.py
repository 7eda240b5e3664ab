"""Text tasks: turn strings into model feeds and model results into the manifest's outputs.

`sentence-embedding` tokenizes a BYTES tensor of sentences with the model's own `tokenizers`
file. Pooling and L2 normalization live inside the model (the torch module and its ONNX
export), so every backend returns the final embedding and the server does no numpy pass.
Importing this plugin is cheap: `tokenizers` is loaded when a manifest asks for the task.

Manifest options: `max_seq_length` (default: sentence_bert_config.json's, else the model's limit).

`row_costs` gives each sentence's token count, so a scheduler can put rows of similar length in
one call (the batcher does, for requests larger than a batch): every row of a call is padded to
the longest in it.

Text is cut to `max_seq_length x 32` characters before it is tokenized: the model sees only the
first `max_seq_length` tokens, and a BERT token covers about 4 characters of ordinary text, so
the cut never changes what the model sees for text, while a megabyte of text is not tokenized
(with its overflow kept by the tokenizer) only to be truncated. Input that spends more than 32
characters per token (long runs of whitespace between words) can lose tokens to the cut.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from outrider import hookimpl
from outrider.backend import Task
from outrider.errors import BadRequestError, ManifestError
from outrider.manifest import Manifest

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__version__ = "0.1.0"

#: characters kept per token of max_seq_length, before tokenizing (see the module docstring)
CHARS_PER_TOKEN = 32


@hookimpl
def outrider_register_tasks(register: Callable[[type], None]) -> None:
    """Register the text tasks."""
    register(SentenceEmbeddingTask)


class SentenceEmbeddingTask(Task):
    """BYTES sentences [N] -> BERT feeds [N, L]; the model returns `embedding` [N, D]."""

    name = "sentence-embedding"
    input_name = "text"
    output_name = "embedding"

    def __init__(self, manifest: Manifest) -> None:
        super().__init__(manifest)
        model_dir = manifest.model_path()
        self.max_length = self._max_length(model_dir)
        self.max_chars = self.max_length * CHARS_PER_TOKEN
        self.hidden_size = self._read_json(model_dir / "config.json").get("hidden_size", 384)
        self.tokenizer = self._load_tokenizer(model_dir)

    def _where(self) -> str:
        return self.manifest.source_file or self.manifest.name

    def _read_json(self, path: Path) -> dict[str, Any]:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ManifestError(f"{self._where()}: model file {path} is unreadable: {exc}") from None

    def _max_length(self, model_dir: Path) -> int:
        # sentence-transformers trained this model at 256 tokens; tokenizer.json says 128, which
        # would silently cut long inputs short of what the model was trained to see.
        configured = self.manifest.options.get("max_seq_length")
        if configured is None:
            configured = self._read_json(model_dir / "sentence_bert_config.json").get("max_seq_length")
        limit = self._read_json(model_dir / "config.json").get("max_position_embeddings", 512)
        length = int(configured or limit)
        if not 2 <= length <= limit:
            raise ManifestError(
                f"{self._where()}: field 'options.max_seq_length': expected 2..{limit} (got {length})"
            )
        return length

    def _load_tokenizer(self, model_dir: Path) -> "Tokenizer":
        from tokenizers import Tokenizer

        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ManifestError(f"{self._where()}: task {self.name!r} needs {path}, which does not exist")
        tokenizer = Tokenizer.from_file(str(path))
        # The shipped file pads every input to a fixed 128; padding to the longest in the batch
        # is what keeps short requests cheap.
        pad = tokenizer.padding or {}
        tokenizer.enable_padding(
            direction="right",
            pad_id=pad.get("pad_id", 0),
            pad_type_id=pad.get("pad_type_id", 0),
            pad_token=pad.get("pad_token", "[PAD]"),
        )
        tokenizer.enable_truncation(max_length=self.max_length)
        # A second copy counts tokens for `row_costs`: no padding, so each encoding's length is its own.
        self._counter = Tokenizer.from_str(tokenizer.to_str())
        self._counter.no_padding()
        return tokenizer

    def row_costs(self, inputs: dict[str, np.ndarray]) -> Optional[np.ndarray]:
        """Tokens per sentence (after truncation): what a row costs once padded into a call.

        The batcher orders the rows of a request larger than a batch by this before cutting it
        into pieces, so each piece pads to a length its rows share. Costs one more tokenization
        of the request: about 30 ms for 1,024 sentences here, which the model takes seconds on.
        """
        text = inputs.get(self.input_name)
        if text is None or text.ndim != 1 or len(text) == 0:
            return None  # preprocess will say what is wrong, in the order the rows run
        sentences = [self._decode(i, item) for i, item in enumerate(text)]
        encode = getattr(self._counter, "encode_batch_fast", self._counter.encode_batch)
        return np.fromiter((len(e) for e in encode(sentences)), dtype=np.int64, count=len(sentences))

    def preprocess(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """{'text': BYTES [N]} -> int64 input_ids, attention_mask, token_type_ids [N, L]."""
        text = inputs.get(self.input_name)
        if text is None:
            raise BadRequestError(f"task {self.name!r}: input {self.input_name!r} is missing")
        if text.ndim != 1:
            raise BadRequestError(
                f"task {self.name!r}: input {self.input_name!r} must have shape [N], got {list(text.shape)}"
            )
        sentences = [self._decode(i, item) for i, item in enumerate(text)]
        if not sentences:
            empty = np.zeros((0, 0), dtype=np.int64)
            return {"input_ids": empty, "attention_mask": empty, "token_type_ids": empty}
        encodings = self.tokenizer.encode_batch(sentences)
        return {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }

    def _decode(self, index: int, item: object) -> str:
        """One element as text, cut to `max_chars` characters before anyone tokenizes it."""
        limit = self.max_chars
        if isinstance(item, str):
            return item[:limit]
        if isinstance(item, (bytes, bytearray, memoryview)):
            raw = bytes(item[: 4 * limit])  # UTF-8 spends at most 4 bytes a character
            try:
                return _utf8_prefix(raw, cut=len(raw) < len(item))[:limit]
            except UnicodeDecodeError as exc:
                raise BadRequestError(
                    f"input {self.input_name!r} element {index} is not valid UTF-8 "
                    f"({exc.reason} at byte {exc.start})"
                ) from None
        raise BadRequestError(
            f"input {self.input_name!r} element {index} is {type(item).__name__}; expected bytes or str"
        )

    def empty_outputs(self, feeds: dict[str, np.ndarray]) -> Optional[dict[str, np.ndarray]]:
        """The outputs of an empty batch, so backends need not run the model on zero rows."""
        if len(feeds["input_ids"]) == 0:
            return {self.output_name: np.zeros((0, self.hidden_size), dtype=np.float32)}
        return None

    def postprocess(
        self, outputs: dict[str, np.ndarray], feeds: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The model already pooled and normalized: pass `embedding` through as float32."""
        embedding = outputs[self.output_name]
        if embedding.dtype != np.float32:  # an fp16 engine must not change the wire contract
            embedding = embedding.astype(np.float32)
        return {self.output_name: embedding}


def _utf8_prefix(raw: bytes, cut: bool) -> str:
    """Decode UTF-8 strictly; when `raw` was cut from longer text, drop a character the cut split."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if cut and exc.reason == "unexpected end of data" and exc.start >= len(raw) - 3:
            return raw[: exc.start].decode("utf-8")
        raise
