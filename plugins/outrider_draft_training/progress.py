"""Timestamped progress lines: collection and training run for many minutes."""

from __future__ import annotations

import time


def log(message: str) -> None:
    """Print `message` after the time of day, flushed (runs are watched live)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
