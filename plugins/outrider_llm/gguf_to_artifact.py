"""A Llama GGUF read into a torch state dict and written as a "llama-weights" artifact (the work
`conversion.convert` does, in a child process when a server converts): fp32 weights dequantized
the way transformers does (same kernels, same Q/K un-permutation), plus the raw Q4_1 blocks, or
with `native` each quantized matrix as the file's own blocks (see loading.py's docstring for the
artifact's layout)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from .artifact import CACHE_FORMAT, META_FILE, TOKENIZER_FILE, WEIGHTS_FILE, GGUFError
from .gguf_reading import (FUSED_TENSORS, LAYER_NAMES, PERMUTED_QK_ARCHS, TOP_NAMES, NATIVE_ONLY, config_from_gguf, gguf_field,
                           fused_parts, unpermute_rows)
from .model import LlamaConfig

log = logging.getLogger("outrider.llm")

def write_artifact(directory: Path, config: LlamaConfig, state_dict: dict, meta: dict, backend: Any) -> None:
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


def read_gguf(path: Path, native: bool = False) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict]:
    """(config, state dict, meta) of a Llama GGUF. The state dict holds fp32 weights (plus the raw
    Q4_1 blocks), or with `native` each quantized matrix as the file's own blocks (`N.affine.*`,
    linear.affine_state_dict) and nothing in fp32 but the dense tensors (norms, F16/F32 weights)."""
    import numpy as np
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    config = config_from_gguf(reader, path)
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
        if parts[0] == "blk" and parts[2] in FUSED_TENSORS and not (parts[2] == "ffn_up" and f"blk.{parts[1]}.ffn_gate.weight"
                                                               in names):
            # phi3's fused q|k|v and gate|up: split by rows into the names the model reads.
            _add_tensor(state_dict, tensor, fused_parts(config, parts[1], parts[2], suffix), native, converted,
                        served, config, arch, parts)
            continue
        if parts[0] == "blk":
            if parts[2] not in LAYER_NAMES:
                raise GGUFError(f"{path}: tensor {tensor.name!r} is not part of a {arch} layer the llm backend knows "
                                f"({', '.join(sorted(LAYER_NAMES))})")
            hf = f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
        elif base in TOP_NAMES:
            hf = f"{TOP_NAMES[base]}.{suffix}"
        elif tensor.name == "rope_freqs.weight":  # Llama 3's per-frequency divisors (its rope scaling)
            config.rope_freq_factors = [float(v) for v in np.asarray(dequantize(tensor.data, tensor.tensor_type))]
            continue
        else:
            continue
        _add_tensor(state_dict, tensor, [(hf, slice(None))], native, converted, served, config, arch, parts)
    meta = {
        "chat_template": gguf_field(reader, "tokenizer.chat_template"),
        "add_bos": bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
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

    from .quantized_weights import affine_state_dict

    permuted = arch in PERMUTED_QK_ARCHS and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k")
    heads = config.num_heads if parts[2:3] == ["attn_q"] else config.num_kv_heads
    if native and tensor.tensor_type.name not in _DENSE_TYPES and len(tensor.shape) == 2:
        cols, total = (int(n) for n in tensor.shape)  # GGUF lists ne0 (the row length) first
        groups = _native_groups(tensor, total, cols, converted)
        whole = groups.q, groups.d, groups.m
        for hf, rows in pieces:
            values = tuple(v[rows] for v in whole)
            if permuted and hf.endswith(".weight"):
                values = tuple(unpermute_rows(v, heads) for v in values)
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
            weights = unpermute_rows(weights, heads)
            raw = None if raw is None else {k: unpermute_rows(v, heads) for k, v in raw.items()}
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
