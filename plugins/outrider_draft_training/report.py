"""What a trained head is worth: its cost per drafting call and the summary stored with its weights."""

from __future__ import annotations

import time
from typing import Any

import torch

from outrider_speculative.eagle import CompiledHead

from .trainer import Trainer


def head_ms(model: Any, trainer: Trainer, rows: int = 8, repeat: int = 50) -> float:
    """Milliseconds per drafting call (`rows` frontier nodes) of the trained head, as the drafter runs it."""
    compiled = CompiledHead(trainer.head, trainer.lm_rows, model, getattr(model, "dtype", torch.float32))
    h = torch.randn(rows, model.hidden_size)
    e = model.embed(torch.arange(rows))
    for _ in range(5):
        compiled(h, e)
    start = time.perf_counter()
    for _ in range(repeat):
        compiled(h, e)
    return (time.perf_counter() - start) / repeat * 1e3


def summary_of(trainer: Trainer, data: dict[str, Any], collect_seconds: float) -> dict[str, Any]:
    f = trainer.features
    return {
        "positions": len(f),
        "positions_by_source": f.counts(),
        "train_starts": int(trainer.train_starts.numel()),
        "collection": data,
        "collect_minutes": round(collect_seconds / 60, 2),
        "train_minutes": round(trainer.seconds / 60, 2),
        "steps": trainer.steps,
        "kept_step": trainer.best_step,
        "epochs": round(trainer.seen / max(1, trainer.train_starts.numel()), 2),
        "draft_vocab": int(trainer.draft_vocab.numel()),
        "draft_vocab_coverage": round(trainer.coverage(), 4),
        "config": {k: v for k, v in vars(trainer.cfg).items()},
        "history": trainer.history,
        "torch": torch.__version__,
    }
