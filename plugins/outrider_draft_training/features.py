"""What the target said at each position: Features (saved as safetensors) and FeatureStore, which
accumulates them while the target runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TOP_K = 8  # target probabilities kept per position (the soft label)
SOURCES = ("chat", "code", "text")


@dataclass
class Features:
    """Per-position target outputs, segments concatenated (a segment = one sequence)."""

    tokens: torch.Tensor  # int64 [N]  token fed at each position
    hidden: torch.Tensor  # fp16 [N, H]  target's last hidden (after the final norm) there
    top_ids: torch.Tensor  # int32 [N, TOP_K]  the target's most likely next tokens
    top_probs: torch.Tensor  # fp16 [N, TOP_K]  and their probabilities (T = 1)
    segments: torch.Tensor  # int64 [S, 4]: start, end, source index (SOURCES), held out (1: never trained on)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def save(self, path: "str | Path") -> None:
        """safetensors (no pickle)."""
        from safetensors.torch import save_file

        save_file({k: getattr(self, k).contiguous() for k in ("tokens", "hidden", "top_ids", "top_probs", "segments")}, str(path))

    @classmethod
    def load(cls, path: "str | Path") -> "Features":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        if tensors["segments"].shape[1] == 3:  # written before the held-out column existed
            tensors["segments"] = torch.cat([tensors["segments"], torch.zeros_like(tensors["segments"][:, :1])], 1)
        return cls(**tensors)

    @classmethod
    def concat(cls, parts: list["Features"]) -> "Features":
        offset, segments = 0, []
        for part in parts:
            seg = part.segments.clone()
            seg[:, :2] += offset
            segments.append(seg)
            offset += len(part)
        return cls(torch.cat([p.tokens for p in parts]), torch.cat([p.hidden for p in parts]),
                   torch.cat([p.top_ids for p in parts]), torch.cat([p.top_probs for p in parts]), torch.cat(segments))

    def counts(self) -> dict[str, int]:
        """Positions per source."""
        out = {}
        for i, name in enumerate(SOURCES):
            seg = self.segments[self.segments[:, 2] == i]
            out[name] = int((seg[:, 1] - seg[:, 0]).sum())
        return out


class FeatureStore:
    """Accumulates segments while the target runs."""

    def __init__(self) -> None:
        self.tokens: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.top_ids: list[torch.Tensor] = []
        self.top_probs: list[torch.Tensor] = []
        self.segments: list[tuple[int, int, int, int]] = []
        self.size = 0

    def add(self, tokens: list[int], hidden: torch.Tensor, logits: Any, source: str, keep_from: int = 0,
            held_out: bool = False) -> None:
        """One sequence: tokens fed, their hidden states [n, H] and next-token logits [n, V] (or top-k pairs)."""
        n = len(tokens) - keep_from
        if n < 3:
            return
        if isinstance(logits, tuple):
            ids, probs = logits
        else:
            ids, probs = top_k(logits)
        self.tokens.append(torch.tensor(tokens[keep_from:], dtype=torch.long))
        self.hidden.append(hidden[keep_from:].to(torch.float16))
        self.top_ids.append(ids[keep_from:])
        self.top_probs.append(probs[keep_from:])
        self.segments.append((self.size, self.size + n, SOURCES.index(source), int(held_out)))
        self.size += n

    def features(self) -> Features:
        hidden_size = self.hidden[0].shape[1] if self.hidden else 1
        if not self.tokens:
            return Features(torch.zeros(0, dtype=torch.long), torch.zeros(0, hidden_size, dtype=torch.float16),
                            torch.zeros(0, TOP_K, dtype=torch.int32), torch.zeros(0, TOP_K, dtype=torch.float16),
                            torch.zeros(0, 4, dtype=torch.long))
        return Features(torch.cat(self.tokens), torch.cat(self.hidden), torch.cat(self.top_ids),
                        torch.cat(self.top_probs), torch.tensor(self.segments, dtype=torch.long))


def top_k(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's TOP_K most likely tokens and their probabilities at T = 1, per row."""
    top = torch.topk(torch.softmax(logits.float(), dim=-1), TOP_K, dim=-1)
    return top.indices.to(torch.int32), top.values.to(torch.float16)
