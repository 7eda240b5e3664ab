"""The shape of a Llama-family decoder, as a GGUF's metadata gives it (no torch: both the torch
model and the torch-free CPU model read it)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Iterable, Optional

import numpy as np


@dataclass
class LlamaConfig:
    """Shape of a Llama-family decoder (SmolLM2-135M by default)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: Optional[int] = 1
    eos_token_id: Optional[int] = 2
    architecture: str = "llama"  # the GGUF's: llama (also Mistral), qwen2, qwen3
    qkv_bias: bool = False  # qwen2: biases on the q, k and v projections
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and of k, before RoPE
    rope_scaling_factor: float = 1.0  # linear RoPE scaling: positions / factor
    rope_freq_factors: Optional[list] = None  # Llama 3: each RoPE frequency divided by its factor
    #: phi3 (and Mistral v0.1): each token attends to the last N only. The forward attends over the
    #: whole context, so the llm backend caps a sequence at N tokens, where the two are the same.
    sliding_window: Optional[int] = None
    # Gemma 2 and 3 (the native model alone computes these):
    post_norms: bool = False  # RMSNorm of the attention's and the MLP's outputs before each residual add
    activation: str = "silu"  # "gelu_tanh": GeGLU, GELU's tanh approximation
    embed_scale: float = 1.0  # the input embeddings times this (Gemma: sqrt(hidden)), in fp32
    query_scale: Optional[float] = None  # q's scale before attention; None: head_dim ** -0.5
    #: interleaved local attention: layer i attends within the last `swa_window` positions where
    #: swa_layers[i], with RoPE of base `swa_rope_theta` (unscaled); the other layers see everything
    swa_layers: Optional[list] = None
    swa_window: Optional[int] = None
    swa_rope_theta: Optional[float] = None  # None: the sliding layers rotate as the others (Gemma 2)
    attn_softcap: Optional[float] = None  # Gemma 2: attention scores soft-capped to cap * tanh(score / cap)
    final_softcap: Optional[float] = None  # Gemma 2: the logits the same

    def to_dict(self) -> dict:
        """Plain JSON-able fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LlamaConfig":
        """Inverse of `to_dict`; ignores unknown keys."""
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})



def local_rope_config(config: LlamaConfig) -> LlamaConfig:
    """The config whose RoPE the sliding layers of a Gemma 3 rotate by (their own base, no scaling)."""
    from dataclasses import replace

    return replace(config, rope_theta=config.swa_rope_theta, rope_freq_factors=None, rope_scaling_factor=1.0)


def rope_tables(config: LlamaConfig, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin_signed) fp32 [size, head_dim] for positions 0 .. size-1, the one definition both
    models read (so the torch model and the torch-free one agree bit for bit).

    transformers' LlamaRotaryEmbedding (inv_freq, the outer product with positions, cat, cos and sin)
    computed in fp64 and rounded once to fp32: libraries' fp32 pow, sin and cos differ in their last
    bits (torch's and numpy's did), fp64 rounded to fp32 is the same value from either.
    sin_signed = [-sin_lo, sin_hi]: rotate_half(x) * sin == swap_halves(x) * sin_signed."""
    d = config.head_dim
    inv_freq = 1.0 / (float(config.rope_theta) ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if config.rope_freq_factors:  # Llama 3's rope scaling, as the GGUF's rope_freqs tensor gives it
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, dtype=np.float64)
    if config.rope_scaling_factor != 1.0:  # linear scaling: every position divided by the factor
        inv_freq = inv_freq / float(config.rope_scaling_factor)
    freqs = np.arange(size, dtype=np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    half = d // 2
    sin = np.sin(emb)
    sin_signed = np.concatenate([-sin[:, :half], sin[:, half:]], axis=-1)
    return np.cos(emb).astype(np.float32), sin_signed.astype(np.float32)


# Every 16th embedding row goes into the weights fingerprint: 7 MB of SmolLM2's 113 MB, ~10 ms to
# hash, and no two different weight files agree on all of them.
FINGERPRINT_ROW_STRIDE = 16


def weights_fingerprint(config: LlamaConfig, vocab_size: int, hidden_size: int, rows: np.ndarray,
                        final_norm: np.ndarray, layer_norms: Iterable[np.ndarray]) -> str:
    """sha256 (hex) of the shape, the embedding rows 0, 16, 32, ... (`rows`, fp32), the final norm and
    each layer's two norms, in order: what both models' `fingerprint()` return for the same weights
    (independent of the compute dtype and of weight quantization: a draft head trained on the fp32
    target serves the others)."""
    digest = hashlib.sha256()
    shape = {"vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": config.num_layers}
    digest.update(json.dumps(shape, sort_keys=True).encode())
    for array in (rows, final_norm, *layer_norms):
        # + 0: -0.0 as 0.0, so that (q - 32) d and q d - 32 d (two exact dequantizations of one weight) agree
        digest.update((np.ascontiguousarray(array, dtype=np.float32) + np.float32(0)).tobytes())
    return digest.hexdigest()
