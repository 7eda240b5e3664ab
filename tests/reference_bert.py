"""An independent numpy BERT sentence embedder: the reference the backends are checked against.

It reads model.safetensors with `safetensors.numpy` and tokenizes with `tokenizers`, and
shares no code with the plugins: no torch, no transformers, no ONNX. One sentence at a time
and unpadded, so it also checks that the backends mask padding correctly. float64 throughout,
so its own rounding is far below the tolerances tested.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz & Stegun 7.1.26: |error| < 1.5e-7, enough for an exact-GELU reference.
    sign = np.sign(x)
    x = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return sign * (1.0 - poly * np.exp(-x * x))


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


class ReferenceBert:
    """BERT encoder + mean pooling + L2 normalization, in float64 numpy."""

    def __init__(self, model_dir: Path) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.layers = config["num_hidden_layers"]
        self.heads = config["num_attention_heads"]
        self.eps = config["layer_norm_eps"]
        self.w = {k: v.astype(np.float64) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
        max_length = json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"]
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=max_length)

    def tokens(self, text: str) -> list[int]:
        """Token ids of one sentence, [CLS] ... [SEP], truncated to max_seq_length."""
        return self.tokenizer.encode(text).ids

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def embed(self, text: str) -> np.ndarray:
        """The unit-length sentence embedding of one string."""
        ids = np.array(self.tokens(text))
        w, n = self.w, len(ids)
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], self.eps)
        head_dim = x.shape[-1] // self.heads
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            q, k, v = (self._linear(x, p + f"attention.self.{m}").reshape(n, self.heads, head_dim).transpose(1, 0, 2)
                       for m in ("query", "key", "value"))
            scores = q @ k.transpose(0, 2, 1) / np.sqrt(head_dim)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            context = (scores / scores.sum(-1, keepdims=True)) @ v
            context = context.transpose(1, 0, 2).reshape(n, -1)
            x = _layer_norm(x + self._linear(context, p + "attention.output.dense"),
                            w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"],
                            self.eps)
            hidden = _gelu(self._linear(x, p + "intermediate.dense"))
            x = _layer_norm(x + self._linear(hidden, p + "output.dense"),
                            w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], self.eps)
        pooled = x.mean(0)  # one unpadded sentence: every token counts
        return pooled / max(np.linalg.norm(pooled), 1e-12)
