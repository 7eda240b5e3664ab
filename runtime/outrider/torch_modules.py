"""The torch modules behind each task: one place both the torch backend and the ONNX export use.

Everything the server would otherwise do in numpy after the model (mean pooling, L2
normalization) is part of the module, so the exported graph returns the final output too.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

# Eager attention exports to ONNX as plain MatMul/Softmax and ran ~5% faster in ORT than the
# SDPA export on the MiniLM graph; both match torch to 3e-7.
ATTENTION = "eager"


class SentenceEmbedder(torch.nn.Module):
    """BERT encoder + mean pooling over the attention mask + L2 normalization."""

    input_names = ("input_ids", "attention_mask", "token_type_ids")
    output_name = "embedding"

    def __init__(self, model_dir: str | Path) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a server's log is not a terminal
        self.encoder = AutoModel.from_pretrained(
            str(model_dir),
            local_files_only=True,  # weights come from disk, never from a hub
            attn_implementation=ATTENTION,
        )

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        """int64 [N, L] feeds -> float [N, D] unit-length sentence embeddings."""
        hidden = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2.0, dim=1, eps=1e-12)


MODELS: dict[str, type[torch.nn.Module]] = {"sentence-embedding": SentenceEmbedder}


def build_model(task: str, model_dir: str | Path) -> torch.nn.Module:
    """The module for `task`, loaded from `model_dir`, in eval mode."""
    cls = MODELS.get(task)
    if cls is None:
        raise ValueError(f"the torch plugin has no model for task {task!r}; known: {sorted(MODELS)}")
    return cls(model_dir).eval()
