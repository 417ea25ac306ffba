"""Tests for kvserve.sampling against plain numpy reference implementations."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.sampling import (
    Sampler,
    SamplingParams,
    greedy,
    probabilities,
    sample,
    softmax,
    top_k_mask,
    top_p_mask,
)


def ref_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    out: np.ndarray = e / e.sum()
    return out


def ref_top_k(x: np.ndarray, k: int) -> np.ndarray:
    keep = np.zeros(x.shape, dtype=bool)
    keep[np.argsort(x)[::-1][:k]] = True
    return keep


def ref_top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    keep = np.zeros(p.shape, dtype=bool)
    mass = 0.0
    for i in np.argsort(p)[::-1]:
        keep[i] = True
        mass += p[i]
        if mass >= top_p:
            break
    return keep


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def test_greedy_is_argmax(rng: np.random.Generator) -> None:
    for _ in range(50):
        x = rng.normal(size=1000).astype(np.float32)
        assert int(greedy(x)) == int(np.argmax(x))
        assert Sampler(SamplingParams(temperature=0.0), seed=0)(x) == int(np.argmax(x))


def test_greedy_batch_and_first_tie() -> None:
    x = np.array([[0.0, 3.0, 3.0], [5.0, 1.0, 5.0]], dtype=np.float32)
    assert greedy(x).tolist() == [1, 0]
    params = SamplingParams()
    assert sample(x, params, np.random.default_rng(0)).tolist() == [1, 0]


def test_greedy_does_not_modify_readonly_input() -> None:
    x = np.arange(10, dtype=np.float32)
    x.flags.writeable = False
    Sampler(SamplingParams(temperature=0.7, top_k=3, top_p=0.5), seed=1)(x)
    assert x.tolist() == list(range(10))


def test_softmax_matches_reference(rng: np.random.Generator) -> None:
    x = rng.normal(size=(4, 300)) * 10
    got = softmax(x)
    for row, g in zip(x, got):
        np.testing.assert_allclose(g, ref_softmax(row), rtol=1e-12)
    # -inf gets exactly zero probability.
    y = np.array([1.0, -np.inf, 0.5])
    assert softmax(y)[1] == 0.0


@pytest.mark.parametrize("k", [1, 2, 7, 99, 100, 0, 1000])
def test_top_k_mask_matches_reference(rng: np.random.Generator, k: int) -> None:
    x = rng.normal(size=(3, 100))
    got = top_k_mask(x, k)
    for row, g in zip(x, got):
        want = ref_top_k(row, k) if 0 < k < 100 else np.ones(100, dtype=bool)
        np.testing.assert_array_equal(g, want)


def test_top_k_keeps_ties_at_boundary() -> None:
    x = np.array([1.0, 3.0, 2.0, 2.0, 0.0])
    assert top_k_mask(x, 2).tolist() == [False, True, True, True, False]


@pytest.mark.parametrize("p", [0.01, 0.3, 0.5, 0.9, 0.999, 1.0])
def test_top_p_mask_matches_reference(rng: np.random.Generator, p: float) -> None:
    probs = np.stack([ref_softmax(rng.normal(size=200) * 3) for _ in range(5)])
    got = top_p_mask(probs, p)
    for row, g in zip(probs, got):
        np.testing.assert_array_equal(g, ref_top_p(row, p))


def test_top_p_always_keeps_the_most_probable_token() -> None:
    probs = np.array([0.1, 0.6, 0.3])
    assert top_p_mask(probs, 1e-9).tolist() == [False, True, False]


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1.0}, {"temperature": float("nan")}, {"top_k": -1}, {"top_p": 0.0}],
)
def test_invalid_params_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_probabilities_combines_filters_like_reference(rng: np.random.Generator) -> None:
    x = rng.normal(size=500) * 2
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.8)
    scaled = x / 0.7
    keep_k = ref_top_k(scaled, 40)
    p = ref_softmax(np.where(keep_k, scaled, -np.inf))
    keep_p = ref_top_p(p, 0.8)
    want = np.where(keep_p, p, 0.0)
    want /= want.sum()
    np.testing.assert_allclose(probabilities(x, params), want, rtol=1e-10, atol=1e-15)


def test_filtered_tokens_are_never_drawn(rng: np.random.Generator) -> None:
    x = rng.normal(size=64)
    params = SamplingParams(temperature=1.5, top_k=5, top_p=0.9)
    allowed = set(np.flatnonzero(probabilities(x, params)).tolist())
    sampler = Sampler(params, seed=7)
    draws = {sampler(x) for _ in range(2000)}
    assert draws <= allowed
    assert len(draws) > 1


def test_seed_determinism(rng: np.random.Generator) -> None:
    x = rng.normal(size=1000)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    s1, s2, s3 = Sampler(params, seed=42), Sampler(params, seed=42), Sampler(params, seed=43)
    seq1 = [s1(x) for _ in range(100)]
    seq2 = [s2(x) for _ in range(100)]
    seq3 = [s3(x) for _ in range(100)]
    assert seq1 == seq2
    assert seq1 != seq3


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(np.sum((counts - expected) ** 2 / expected))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution_matches_softmax(temperature: float) -> None:
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0])
    want = ref_softmax(logits / temperature)
    n = 20000
    rows = np.broadcast_to(logits, (n, logits.size))
    draws = sample(rows, SamplingParams(temperature=temperature), np.random.default_rng(99))
    counts = np.bincount(draws, minlength=logits.size).astype(np.float64)
    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001. The seed is fixed, so this is stable.
    assert _chi_square(counts, want) < 18.47
    # And a wrong temperature is clearly rejected by the same statistic.
    wrong = ref_softmax(logits / (temperature * 1.5))
    assert _chi_square(counts, wrong) > 18.47


def test_sample_rows_independent_per_row() -> None:
    logits = np.array([[10.0, 0.0, 0.0], [0.0, 0.0, 10.0]])
    got = Sampler(SamplingParams(temperature=1.0), seed=0).sample_rows(logits)
    assert got.shape == (2,)
    assert got.tolist() == [0, 2]
