"""The shape of a Llama-family decoder, as a GGUF's metadata gives it (no torch: both the torch
model and the torch-free CPU model read it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional


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

    def to_dict(self) -> dict:
        """Plain JSON-able fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LlamaConfig":
        """Inverse of `to_dict`; ignores unknown keys."""
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})
