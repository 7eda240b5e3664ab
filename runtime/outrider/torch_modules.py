"""The torch module behind each task: the one definition the torch backend runs and the ONNX export traces.

In the core (it was `outrider_torch.models`) because two plugins need the same module: the torch
backend serves it, and `outrider.onnx.export` exports it for the ONNX Runtime and TensorRT
backends; a plugin may not import another. torch and transformers are imported when a module is
first built, never when this file is imported.

Everything the server would otherwise do in numpy after the model (mean pooling, L2
normalization) is part of the module, so the exported graph returns the final output too.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

# Eager attention exports to ONNX as plain MatMul/Softmax and ran ~5% faster in ORT than the
# SDPA export on the MiniLM graph; both match torch to 3e-7.
ATTENTION = "eager"


def sentence_embedder(model_dir: str | Path) -> "torch.nn.Module":
    """BERT encoder + mean pooling over the attention mask + L2 normalization.

    Inputs `input_ids`, `attention_mask`, `token_type_ids` (int64 [N, L]); output `embedding`
    (float [N, D], unit length). The module carries them as `input_names` and `output_name`."""
    return _sentence_embedder_class()(model_dir)


@functools.cache
def _sentence_embedder_class() -> type["torch.nn.Module"]:
    # The class subclasses torch.nn.Module, so it is defined once torch is wanted, not at import.
    import torch
    import torch.nn.functional as F

    class SentenceEmbedder(torch.nn.Module):
        input_names = ("input_ids", "attention_mask", "token_type_ids")
        output_name = "embedding"

        def __init__(self, model_dir: str | Path) -> None:
            super().__init__()
            from .torch_process import from_transformers

            (AutoModel,) = from_transformers("AutoModel")
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
            # The sum over tokens is a running sum (its last prefix), added in token order: a
            # row's padding (zeros after its last token) and the rows beside it cannot change it,
            # so a sentence gets the same bits alone or in any batch. ORT's ReduceSum here
            # vectorizes differently per batch shape and length (up to 1.2e-7 apart after the
            # normalization); the encoder before it already gave identical bits on ORT CPU.
            # In float32 even under an fp16 module: a running sum of 256 fp16 terms would drift.
            summed = torch.cumsum((hidden * mask).float(), dim=1)[:, -1]
            pooled = summed / mask.sum(dim=1).float().clamp(min=1e-9)
            return F.normalize(pooled, p=2.0, dim=1, eps=1e-12)

    return SentenceEmbedder


#: task name -> a function that builds its module from a model directory
MODELS: dict[str, Callable[[str | Path], "torch.nn.Module"]] = {"sentence-embedding": sentence_embedder}


def build_model(task: str, model_dir: str | Path) -> "torch.nn.Module":
    """The module for `task`, loaded from `model_dir`, in eval mode."""
    builder = MODELS.get(task)
    if builder is None:
        raise ValueError(f"there is no torch module for task {task!r}; known: {sorted(MODELS)}")
    return builder(model_dir).eval()
