"""A GGUF's metadata read as the llm backend's model shape, without torch: the config of a file's
architecture, the names its tensors map to, and the row orders llama.cpp writes. Shared by the
conversion into an artifact (loading.py, with torch) and the torch-free packing of a file's blocks
straight into the native model's tiles (gguf_tiles.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .artifact import GGUFError
from .config import LlamaConfig


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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Architectures served, and what the others would need (the error names it).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")
# llama.cpp writes Q/K rows of these interleaved for its RoPE (qwen2/qwen3 use NEOX order: as is).
_PERMUTED_QK = ("llama",)
_MISSING = {
    "gemma": "GeGLU, embeddings scaled by sqrt(hidden_size) and norms of (1 + w)",
    "gemma2": "GeGLU, (1 + w) norms around each block, logit soft-capping and sliding-window layers",
    "gemma3": "GeGLU, (1 + w) norms around each block, q/k norms, sliding-window layers with their own RoPE base",
    "qwen2moe": "mixture-of-experts layers", "qwen3moe": "mixture-of-experts layers",
    "mistral3": "its vision tower and Mistral 3's RoPE scaling",
}


def _config_from_gguf(reader: Any, path: Path) -> LlamaConfig:
    """The decoder's shape, from the metadata keys of the file's architecture."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        need = _MISSING.get(arch, "a layer body the llm backend does not have")
        raise GGUFError(f"{path}: architecture {arch!r} is not supported: the llm backend runs "
                        f"{', '.join(ARCHITECTURES)} (llama: Llama, Mistral and SmolLM2, which llama.cpp writes as "
                        f"llama); {arch} needs {need}")

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    experts = key("expert_count")
    if experts:
        raise GGUFError(f"{path}: a mixture of experts ({arch}.expert_count = {experts}, e.g. Mixtral) is not "
                        f"supported: the llm backend runs dense layers")
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens.data) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    scaling = key("rope.scaling.type", "none")
    factor = float(key("rope.scaling.factor", 1.0) or 1.0)
    if scaling not in ("none", "linear") and not (scaling == "yarn" and factor == 1.0):
        raise GGUFError(f"{path}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported: the llm "
                         f"backend runs none, linear, and Llama 3's rope_freqs")
    window = key("attention.sliding_window")
    window = int(window) if window and int(window) < int(key("context_length", 2048)) else None
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        architecture=arch,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling_factor=factor if scaling == "linear" else 1.0,
        sliding_window=window,
    )


_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

_FUSED = ("attn_qkv", "ffn_up")


def _fused_parts(config: LlamaConfig, layer: str, kind: str, suffix: str) -> list[tuple[str, slice]]:
    """(Hugging Face name, rows) of each projection in a fused phi3 tensor."""
    p = f"model.layers.{layer}."
    if kind == "attn_qkv":
        nq, nk = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [(f"{p}self_attn.q_proj.{suffix}", slice(0, nq)), (f"{p}self_attn.k_proj.{suffix}", slice(nq, nq + nk)),
                (f"{p}self_attn.v_proj.{suffix}", slice(nq + nk, nq + 2 * nk))]
    inter = config.intermediate_size
    return [(f"{p}mlp.gate_proj.{suffix}", slice(0, inter)), (f"{p}mlp.up_proj.{suffix}", slice(inter, 2 * inter))]


def _unpermute_rows(rows: Any, heads: int) -> Any:
    """Rows of a Q/K weight (or its per-row blocks) from llama.cpp's interleaved RoPE order to HF's."""
    rows = rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:])
    return rows.swapaxes(2, 1).reshape(-1, *rows.shape[3:])


def gguf_tokenizer(path: Path) -> Any:
    """The GGUF's tokenizer as a `tokenizers.Tokenizer`, via transformers' converter (first load only)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return hf.backend_tokenizer
