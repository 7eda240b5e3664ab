"""A target on the llm backend's torch-free native runtime (`NativeLlama`, numpy in and out), seen by
the trainer as it sees the torch model: tensors in, tensors out.

Gemma 2 and 3 are served by that runtime alone (the torch model has no Gemma layer body), so a head
for them is collected and trained through this view. The features then are exactly what the server's
target computes (int8 activations, the file's own blocks), which is also what the head will read
when it drafts there. The conversion is a view of the same memory each way (`torch.from_numpy`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch


class HostTarget:
    """`model` (a numpy `CausalLM`) with the members the collection, the trainer and the report use,
    in torch: forward's logits and hidden, embed, lm_head_rows, make_linear."""

    device = "cpu"
    dtype = torch.float32

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config
        self.vocab_size = model.vocab_size
        self.hidden_size = model.hidden_size

    def fingerprint(self) -> str:
        return self.model.fingerprint()

    def new_cache(self, num_slots: int, max_length: int) -> Any:
        return self.model.new_cache(num_slots, max_length)

    def forward(self, cache: Any, chunks: list) -> SimpleNamespace:
        """The model's forward over `chunks` (their tokens and positions may be tensors); logits and
        hidden as tensors sharing the arrays' memory."""
        out = self.model.forward(cache, chunks)
        return SimpleNamespace(logits=torch.from_numpy(out.logits), hidden=torch.from_numpy(out.hidden))

    def embed(self, tokens: Any) -> torch.Tensor:
        """fp32 [n, hidden] input embeddings, as the model feeds its first layer (Gemma's scaled); the
        model reads `tokens` (a tensor too) as int64 itself."""
        return torch.from_numpy(self.model.embed(tokens))

    def lm_head_rows(self, tokens: Any) -> torch.Tensor:
        """fp32 [k, hidden] rows of the LM head (not the scaled embeddings: Gemma ties them to the
        unscaled table)."""
        return torch.from_numpy(self.model.lm_head_rows(tokens))

    def make_linear(self, weight: torch.Tensor, dtype: Any = None, quantize: Any = None) -> Callable:
        """The model's own matmul for a head's weight (what the host drafter runs), tensors in and out."""
        matmul = self.model.make_linear(weight.detach().float().numpy(), quantize=quantize)
        return lambda x: torch.from_numpy(np.ascontiguousarray(matmul(np.ascontiguousarray(x.detach().float().numpy()))))
