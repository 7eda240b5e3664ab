"""Text tasks: turn strings into model feeds and model results into the manifest's outputs.

`sentence-embedding` tokenizes a BYTES tensor of sentences with the model's own `tokenizers`
file. Pooling and L2 normalization live inside the model (the torch module and its ONNX
export), so every backend returns the final embedding and the server does no numpy pass.
Importing this plugin is cheap: `tokenizers` is loaded when a manifest asks for the task.

Manifest options (in `options`, beside the backend's own):
- `max_seq_length`: the longest input in tokens (default: sentence_bert_config.json's, else the
  model's limit);
- `truncate` (default true): a longer text is cut to `max_seq_length` tokens; false refuses it
  (`bad_request` naming the element, its length and the limit). The HTTP front's `truncate`
  field chooses per request;
- `matryoshka` (default false): the model was trained so that the first k components of its
  embedding, renormalized, are an embedding too (Matryoshka representation learning), so the
  HTTP front's `dimensions` may ask for any k from 1 to the width; `matryoshka_dimensions`
  (a list) allows only those k. all-MiniLM-L6-v2 was not trained so.

An element of the `text` input is UTF-8 text, or token ids: an element whose first byte is 0xFF
(a byte UTF-8 never uses, so no text is taken for ids) holds little-endian uint32 token ids
after it, fed to the model as they are (special tokens included: what `encode` returns), at most
`max_seq_length` of them, each below the vocabulary size. The HTTP front sends every input so,
after tokenizing it itself with `encode` (it counts the tokens it sends, for `usage`).

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
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

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
#: first byte of a `text` element that holds token ids (little-endian uint32) instead of text
TOKEN_IDS_MARK = b"\xff"


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
        config = self._read_json(model_dir / "config.json")
        self.hidden_size = config.get("hidden_size", 384)
        self.tokenizer = self._load_tokenizer(model_dir)
        #: ids the model can embed: its embedding table's rows (an id past them fails the Gather)
        self.vocab_size = int(config.get("vocab_size") or self.tokenizer.get_vocab_size(with_added_tokens=True))
        self.truncate = self._flag("truncate", True)
        #: the embedding widths a caller may ask for (`dimensions`): the model's own, and the
        #: shorter ones it was trained to give (Matryoshka) when the manifest says so
        self.matryoshka, self.dimensions = self._dimensions()

    def _where(self) -> str:
        return self.manifest.where

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

    def _flag(self, name: str, default: bool) -> bool:
        value = self.manifest.options.get(name, default)
        if not isinstance(value, bool):
            raise ManifestError(f"{self._where()}: field 'options.{name}': expected true or false (got {value!r:.40})")
        return value

    def _dimensions(self) -> tuple[bool, frozenset[int]]:
        width = self.hidden_size
        listed = self.manifest.options.get("matryoshka_dimensions")
        if listed is None:
            matryoshka = self._flag("matryoshka", False)
            return matryoshka, frozenset(range(1, width + 1)) if matryoshka else frozenset({width})
        if (not isinstance(listed, list) or not listed
                or not all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= width for d in listed)):
            raise ManifestError(f"{self._where()}: field 'options.matryoshka_dimensions': expected a non-empty list "
                                f"of widths from 1 to the model's {width} (got {listed!r:.80})")
        if self.manifest.options.get("matryoshka") is False:
            raise ManifestError(f"{self._where()}: field 'options.matryoshka_dimensions': lists Matryoshka widths, "
                                f"but options.matryoshka is false")
        return True, frozenset({*listed, width})

    def _load_tokenizer(self, model_dir: Path) -> "Tokenizer":
        """The tokenizer every request uses: unpadded (`_feeds` pads to the longest row of a call),
        cut at `max_length` as the model is. One read of the file at start: a copy that does not
        cut (`_whole`) is made on first use, since only a refusal's length and token counting need it
        (each parse of MiniLM's tokenizer.json costs ~30 ms of a start)."""
        from tokenizers import Tokenizer

        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ManifestError(f"{self._where()}: task {self.name!r} needs {path}, which does not exist")
        self._tokenizer_path = path
        self._whole_lock = threading.Lock()
        self._whole_tokenizer: Optional["Tokenizer"] = None
        tokenizer = Tokenizer.from_file(str(path))
        # The shipped file pads every input to a fixed 128: padding happens in _feeds instead.
        self._pad_id = int((tokenizer.padding or {}).get("pad_id", 0))
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=self.max_length)
        return tokenizer

    @property
    def _counter(self) -> "Tokenizer":
        return self.tokenizer

    @property
    def _whole(self) -> "Tokenizer":
        """The tokenizer without truncation (made on first use)."""
        if self._whole_tokenizer is None:
            from tokenizers import Tokenizer

            with self._whole_lock:
                if self._whole_tokenizer is None:
                    whole = Tokenizer.from_str(self.tokenizer.to_str())
                    whole.no_truncation()
                    self._whole_tokenizer = whole
        return self._whole_tokenizer

    def encode(self, texts: Sequence[Union[str, bytes]], truncate: bool = True,
               add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, as the model sees them ([CLS] ... [SEP]).

        truncate: cut to `max_length` as the model does; False: the ids of the whole text (of its
        first `max_chars` characters), so that the caller can refuse a longer one with its length.
        Raises BadRequestError for an element that is not text (invalid UTF-8, token ids).
        """
        sentences = [self._text(i, item) for i, item in enumerate(texts)]
        tokenizer = self._counter if truncate else self._whole
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        return [e.ids for e in encode(sentences, add_special_tokens=add_special_tokens)]

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of the whole text, not cut to the model's limit (to count its tokens)."""
        return self._whole.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids (BadRequestError for an id outside the vocabulary)."""
        bad = self.outside_vocabulary(ids)
        if bad is not None:
            raise BadRequestError(f"token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})")
        return self._counter.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entry of each id ('##ing', '[CLS]')."""
        return [self._counter.id_to_token(i) or "" for i in ids]

    def outside_vocabulary(self, ids: Sequence[int]) -> Optional[int]:
        """The first id the model has no embedding for, or None."""
        return next((t for t in ids if not 0 <= t < self.vocab_size), None)

    def row_costs(self, inputs: dict[str, np.ndarray]) -> Optional[np.ndarray]:
        """Tokens per sentence (after truncation): what a row costs once padded into a call.

        The batcher orders the rows of a request larger than a batch by this before cutting it
        into pieces, so each piece pads to a length its rows share. Costs one more tokenization
        of the request: about 30 ms for 1,024 sentences here, which the model takes seconds on.
        """
        text = inputs.get(self.input_name)
        if text is None or text.ndim != 1 or len(text) == 0:
            return None  # preprocess will say what is wrong, in the order the rows run
        return np.fromiter((len(r) for r in self._rows(text, truncate=True)), dtype=np.int64, count=len(text))

    def preprocess(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """{'text': BYTES [N]} -> int64 input_ids, attention_mask, token_type_ids [N, L]."""
        text = inputs.get(self.input_name)
        if text is None:
            raise BadRequestError(f"task {self.name!r}: input {self.input_name!r} is missing")
        if text.ndim != 1:
            raise BadRequestError(
                f"task {self.name!r}: input {self.input_name!r} must have shape [N], got {list(text.shape)}"
            )
        rows = self._rows(text, self.truncate)
        if not self.truncate:
            for i, row in enumerate(rows):
                if len(row) > self.max_length:
                    cut = len(self._text(i, text[i])) >= self.max_chars  # only a prefix was tokenized
                    raise BadRequestError(
                        f"input {self.input_name!r} element {i} has {'at least ' if cut else ''}"
                        f"{len(row)} tokens; this model takes at most {self.max_length} (options.max_seq_length), "
                        f"and options.truncate is false"
                    )
        return self._feeds(rows)

    def _rows(self, text: np.ndarray, truncate: bool) -> list[list[int]]:
        """The token ids of each element: its own (a token-id element, checked) or its text's."""
        rows: list[Optional[list[int]]] = [None] * len(text)
        sentences, where = [], []
        for i, item in enumerate(text):
            ids = self._token_ids(i, item)
            if ids is None:
                sentences.append(self._text(i, item))
                where.append(i)
            else:
                rows[i] = ids
        if sentences:
            tokenizer = self._counter if truncate else self._whole
            encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
            for i, encoding in zip(where, encode(sentences)):
                rows[i] = encoding.ids
        return rows  # type: ignore[return-value]  # every slot filled above

    def _feeds(self, rows: list[list[int]]) -> dict[str, np.ndarray]:
        # Padded on the right, as the tokenizer pads: the same feeds whether a row came as text or ids.
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        width = int(lengths.max()) if len(rows) else 0
        input_ids = np.full((len(rows), width), self._pad_id, dtype=np.int64)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = row
        attention_mask = (np.arange(width) < lengths[:, None]).astype(np.int64)
        # One sequence per row: BERT's template gives every token (and padding) type 0.
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "token_type_ids": np.zeros_like(input_ids)}

    def _token_ids(self, index: int, item: object) -> Optional[list[int]]:
        """The ids of a token-id element (checked), or None for text."""
        if not _holds_ids(item):
            return None
        body = memoryview(item)[1:]  # type: ignore[arg-type]  # bytes-like: _holds_ids checked
        if len(body) % 4:
            raise BadRequestError(f"input {self.input_name!r} element {index} is not valid UTF-8 (byte 0 is 0xFF), "
                                  f"nor token ids: those take 4 bytes each (little-endian uint32) after the "
                                  f"0xFF mark, and {len(body)} bytes follow it")
        ids = np.frombuffer(body, dtype="<u4").tolist()
        if not 1 <= len(ids) <= self.max_length:
            raise BadRequestError(f"input {self.input_name!r} element {index} holds {len(ids)} token ids; this "
                                  f"model takes 1 to {self.max_length} (options.max_seq_length)")
        bad = self.outside_vocabulary(ids)
        if bad is not None:
            raise BadRequestError(f"input {self.input_name!r} element {index}: token id {bad} is outside the "
                                  f"vocabulary (0 to {self.vocab_size - 1})")
        return ids

    def _text(self, index: int, item: object) -> str:
        if _holds_ids(item):
            raise BadRequestError(f"input {self.input_name!r} element {index} holds token ids, not text")
        return self._decode(index, item)

    def _decode(self, index: int, item: object) -> str:
        """One element as text, cut to `max_chars` characters before anyone tokenizes it."""
        limit = self.max_chars
        if isinstance(item, str):
            text = item[:limit]
            try:
                text.encode("utf-8")  # a lone surrogate (JSON's "\ud800") is no text a tokenizer takes
            except UnicodeEncodeError as exc:
                raise BadRequestError(f"input {self.input_name!r} element {index} is not valid text "
                                      f"({exc.reason} at character {exc.start})") from None
            return text
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


def _holds_ids(item: object) -> bool:
    """Whether a `text` element is token ids (its first byte is the 0xFF mark), not UTF-8 text."""
    return isinstance(item, (bytes, bytearray, memoryview)) and bytes(item[:1]) == TOKEN_IDS_MARK


def _utf8_prefix(raw: bytes, cut: bool) -> str:
    """Decode UTF-8 strictly; when `raw` was cut from longer text, drop a character the cut split."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if cut and exc.reason == "unexpected end of data" and exc.start >= len(raw) - 3:
            return raw[: exc.start].decode("utf-8")
        raise
