"""The sampling definitions every path shares (plain sampling, verification, drafters' q):
`target_distribution`'s cuts and `draw`'s inverse CDF, against flat reference definitions, on the
shapes that take each of their paths."""

from __future__ import annotations

import numpy as np
import pytest

from outrider.generation.sampling import DRAW_BLOCK, draw, target_distribution


def _reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """softmax(logits / T); keep the top_k largest (ties at the boundary all kept); then the smallest
    set of largest entries whose mass reaches top_p (ties kept); renormalize. A full sort, in the
    runtime's fp32, so that a flat distribution's boundary rounds alike."""
    scaled = logits / np.float32(temperature)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_k and top_k < len(probs):
        kth = np.sort(probs)[::-1][top_k - 1]
        probs = np.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        values = np.sort(probs)[::-1]
        before = np.cumsum(values) - values
        threshold = values[before < top_p * probs.sum()].min()
        probs = np.where(probs >= threshold, probs, 0.0)
    return probs / probs.sum()


def _shapes() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    peaked = rng.standard_normal(50_000).astype(np.float32) * 2  # a few hundred near the top
    peaked[:20] += 12
    flat = rng.standard_normal(50_000).astype(np.float32) * 0.1  # every entry near the top: too many to sort
    few = np.full(50_000, -30.0, np.float32)  # three entries near the top, fewer than top_k
    few[[7, 4000, 49_999]] = [0.0, -1.0, -2.0]
    ties = np.full(1000, -5.0, np.float32)  # ties straddle every cut
    ties[:6] = 0.0
    ties[6:30] = -1.0
    tail = np.full(50_000, -9.5, np.float32)  # the near entries hold 0.6 of the mass, the far tail the rest
    tail[0] = 0.0
    tail[1:11] = -1.0
    return {"peaked": peaked, "flat": flat, "few": few, "ties": ties, "tail": tail}


@pytest.mark.parametrize("shape", ["peaked", "flat", "few", "ties", "tail"])
@pytest.mark.parametrize("knobs", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 0, 0.9), (0.8, 40, 0.95), (1.3, 10, 1.0), (1.0, 0, 0.3),
                                   (0.5, 3, 0.5)])
def test_target_distribution_keeps_what_a_full_sort_keeps(shape, knobs):
    logits = _shapes()[shape]
    got = target_distribution(logits, *knobs)
    want = _reference(logits, *knobs)
    assert got.dtype == np.float32 and got.shape == logits.shape
    assert np.array_equal(got > 0, want > 0), f"{shape} {knobs}: {np.flatnonzero(got > 0)[:8]} vs " \
                                              f"{np.flatnonzero(want > 0)[:8]}"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
    assert abs(float(got.sum(dtype=np.float64)) - 1.0) < 1e-5


def test_target_distribution_refuses_non_finite_logits():
    logits = np.zeros(600, np.float32)
    logits[5] = np.nan
    with pytest.raises(ValueError, match="not finite"):
        target_distribution(logits, 1.0, 40, 0.9)


def _flat_draw(probs: np.ndarray, u: float) -> int:
    cumulative = np.cumsum(probs, dtype=np.float64)
    return min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), int(np.flatnonzero(probs)[-1]))


class _Uniform:
    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize("size", [1, 7, DRAW_BLOCK, DRAW_BLOCK + 1, 5 * DRAW_BLOCK - 3, 49_152])
def test_draw_is_the_inverse_cdf_and_never_draws_an_entry_without_mass(size):
    rng = np.random.default_rng(size)
    probs = rng.random(size).astype(np.float32) ** 8  # uneven, as a distribution's tail is
    probs[rng.random(size) < 0.5] = 0  # holes, whole blocks of them at the larger sizes
    probs[-1] = 0
    if not probs.any():
        probs[0] = 1
    # the largest uniform, and 1.0 itself: a product that rounds up to the total draws the last entry with mass
    uniforms = np.concatenate([rng.random(2000), [0.0, 1.0 - 2 ** -53, 1.0]])
    for u in uniforms:
        index = draw(probs, _Uniform(float(u)))
        assert probs[index] > 0, (size, u, index)
        assert index == _flat_draw(probs, float(u)), (size, u)


def test_draw_takes_float64_and_unnormalized_weights_and_refuses_no_mass():
    weights = np.zeros(3 * DRAW_BLOCK, np.float64)
    weights[DRAW_BLOCK + 5] = 3.0  # one block with mass, between empty ones
    weights[2 * DRAW_BLOCK - 1] = 1.0
    assert draw(weights, _Uniform(0.0)) == DRAW_BLOCK + 5
    assert draw(weights, _Uniform(0.74)) == DRAW_BLOCK + 5
    assert draw(weights, _Uniform(0.76)) == 2 * DRAW_BLOCK - 1
    with pytest.raises(ValueError, match="no mass"):
        draw(np.zeros(600, np.float32), _Uniform(0.5))


def test_draws_follow_the_distribution():
    probs = np.array([0.5, 0.0, 0.25, 0.125, 0.125] + [0.0] * 700, np.float32)
    generator = np.random.default_rng(0)
    counts = np.bincount([draw(probs, generator) for _ in range(8000)], minlength=len(probs))
    assert counts[1] == 0 and counts[5:].sum() == 0
    np.testing.assert_allclose(counts[:5] / 8000, probs[:5], atol=0.02)
