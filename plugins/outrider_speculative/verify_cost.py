"""What verifying drafts costs on the attached model, measured once at attach: the time of one
sequence's step over 1 + k rows against one row. The draft budget is capped where a step that
verifies a full budget would cost more than `max_verify_cost` plain steps, and a step of several
sequences verifies at most the draft rows that keep it within `max_verify_cost` of the same step
without drafts (`affordable_drafts`).

Why measured and not assumed: where a decode step is bound by reading the weights, extra rows ride
along almost free; where it is bound by arithmetic they cost nearly their share. Which one holds
depends on the model and the machine. Gemma 3 270M's 262,144-row LM head on 2 cores: 8 rows 1.11x
one row, 16 rows 1.73x (`tools/bench_matmul_rows.py --types Q8_0 --shape 640x262144`); served with
the n-gram drafter, 4 draft tokens decoded at 1.62x plain against 1.37x with the default 16
(`tools/bench_gemma.py --draft-tokens`). A budget the step cannot afford needs many accepted tokens
per step just to break even, and the cost gate then turns drafting off instead of drafting less.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from outrider.generation.contract import Chunk
from outrider.generation.sampling import host_array


def _step_seconds(model: Any, cache: Any, rows: int) -> float:
    """One forward of one sequence feeding `rows` tokens from position 0, timed."""
    cache.reset(0)
    started = time.perf_counter()
    out = model.forward(cache, [Chunk(0, np.zeros(rows, dtype=np.int64), np.arange(rows, dtype=np.int64))])
    host_array(out.logits)  # a device model finishes here
    return time.perf_counter() - started


def verify_cap(model: Any, max_tokens: int, limit: float, seconds: float = 0.5,
               rounds: tuple[int, int] = (3, 15)) -> tuple[int, dict[int, float]]:
    """(the largest draft budget, halving from `max_tokens`, whose step costs at most `limit` one-row
    steps, or 1 where none does; {budget: measured cost ratio}).

    Each size's time is its fastest of several rounds, the sizes interleaved within a round, so a slow
    spell of a shared machine falls on every size alike; as many rounds as fit in about `seconds`
    (within `rounds`: a 270M model's 5 ms steps get the most, an 8B model's the fewest)."""
    budgets = [max_tokens >> i for i in range(max_tokens.bit_length())]  # max_tokens, its halves, ... 1
    cache = model.new_cache(1, max_tokens + 1)
    sizes = [1, *(b + 1 for b in budgets)]
    started = time.perf_counter()
    best = {n: _step_seconds(model, cache, n) for n in sizes}  # the first calls allocate: a round of their own
    one_round = time.perf_counter() - started
    for _ in range(max(rounds[0], min(rounds[1], int(seconds / max(one_round, 1e-6))))):
        for n in sizes:
            best[n] = min(best[n], _step_seconds(model, cache, n))
    cache.reset(0)
    ratios = {b: best[b + 1] / best[1] for b in budgets}
    return next((b for b in budgets if ratios[b] <= limit), 1), ratios


def row_costs(ratios: dict[int, float]) -> list[tuple[int, float]]:
    """[(rows, cost in one-row steps)] from `verify_cap`'s {drafts: ratio}, by rows, made
    non-decreasing (a shared machine's noise can time 3 rows under 2; more rows never cost less)."""
    points, top = [], 0.0
    for rows, cost in sorted({1: 1.0, **{k + 1: r for k, r in ratios.items()}}.items()):
        top = max(top, cost)
        points.append((rows, top))
    return points


def cost_at(points: list[tuple[int, float]], rows: int) -> float:
    """A step over `rows` rows in one-row steps: linear between measured sizes, and past the largest
    along its last segment (once a step is bound by arithmetic, each row costs its share)."""
    for (r0, c0), (r1, c1) in zip(points, points[1:]):
        if rows <= r1:
            return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
    if len(points) < 2:
        return points[-1][1]
    (r0, c0), (r1, c1) = points[-2], points[-1]
    return c1 + (c1 - c0) * (rows - r1) / (r1 - r0)


def affordable_drafts(points: list[tuple[int, float]], sequences: int, limit: float, most: int) -> int:
    """The most draft rows (up to `most`) a step of `sequences` one-row sequences may add and cost at
    most `limit` times itself without them.

    The rows of several sequences are priced as one sequence's rows of the same count: the weights'
    matmuls, which decide whether extra rows ride along or cost their share, see only the count
    (each sequence's attention over its own context is not in it). One sequence's answer is the
    single-stream cap's; at 8 streams on 2 cores a step is already near the arithmetic bound, and
    few draft rows fit (tools/bench_gate.py --streams)."""
    bound = limit * cost_at(points, sequences) * (1 + 1e-9)  # a ratio exactly at the limit is within it
    drafts = 0
    while drafts < most and cost_at(points, sequences + drafts + 1) <= bound:
        drafts += 1
    return drafts
