"""tools/bench_plot.py draws the benchmark PNGs (`tools/bench.py batching --plot`, `tools/bench_spec.py --plot`)."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytest.importorskip("matplotlib")
sys.path.insert(0, str(ROOT / "tools"))
import bench_plot  # noqa: E402


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_batching_plot(tmp_path: Path) -> None:
    curve = lambda scale: [{"clients": c, "throughput": scale * min(c, 8) * 40.0, "p99": 5.0 + c} for c in (1, 2, 4, 8, 16, 32)]  # noqa: E731
    path = bench_plot.plot_batching({"batched": curve(2.0), "unbatched": curve(1.0)},
                                    [{"batch": 1, "throughput": 60.0}, {"batch": 32, "throughput": 700.0}],
                                    tmp_path / "batching.png", "synthetic figures")
    width, height = _png_size(path)
    assert 600 <= width <= 1200 and 250 <= height <= 600
    assert path.stat().st_size < 200_000


def test_speculation_plot(tmp_path: Path) -> None:
    tables = [{"title": f"HumanEval, T={t}", "rows": [("plain", 20.0), ("n-gram + head", 35.0 - 5 * t)]} for t in (0, 1)]
    path = bench_plot.plot_speculation(tables, tmp_path / "nested" / "speculation.png", "synthetic figures")
    width, height = _png_size(path)
    assert 600 <= width <= 1200 and 250 <= height <= 600
