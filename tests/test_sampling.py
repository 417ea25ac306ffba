"""Tests for kvserve.sampling against plain numpy reference implementations (the newer
filters against tests/sampling_reference.py, a loop-by-loop reference of the whole chain)."""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest
from sampling_reference import (
    ref_adjust,
    ref_distribution,
    ref_draw,
    ref_log_softmax,
    ref_typical,
)

from kvserve.sampling import (
    Sampler,
    SamplingParams,
    TokenLogprob,
    adjusted_logits,
    apply_logit_bias,
    apply_penalties,
    greedy,
    probabilities,
    sample,
    softmax,
    token_logprobs,
    top_k_mask,
    top_p_mask,
    typical_mask,
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
    for row, g in zip(x, got, strict=True):
        np.testing.assert_allclose(g, ref_softmax(row), rtol=1e-12)
    # -inf gets exactly zero probability.
    y = np.array([1.0, -np.inf, 0.5])
    assert softmax(y)[1] == 0.0


@pytest.mark.parametrize("k", [1, 2, 7, 99, 100, 0, 1000])
def test_top_k_mask_matches_reference(rng: np.random.Generator, k: int) -> None:
    x = rng.normal(size=(3, 100))
    got = top_k_mask(x, k)
    for row, g in zip(x, got, strict=True):
        want = ref_top_k(row, k) if 0 < k < 100 else np.ones(100, dtype=bool)
        np.testing.assert_array_equal(g, want)


@pytest.mark.parametrize("scale", [1.0, 10.0, 40.0])
@pytest.mark.parametrize("k", [1, 3, 40, 299])
def test_top_k_mask_of_one_row_matches_reference(
    rng: np.random.Generator, scale: float, k: int
) -> None:
    # One row looks for the k largest near the maximum first: spread rows (scale 40) make it
    # widen its window or partition the whole row.
    for row in rng.normal(size=(3, 300)) * scale:
        np.testing.assert_array_equal(top_k_mask(row, k), ref_top_k(row, k))


def test_top_k_keeps_ties_at_boundary() -> None:
    x = np.array([1.0, 3.0, 2.0, 2.0, 0.0])
    assert top_k_mask(x, 2).tolist() == [False, True, True, True, False]


@pytest.mark.parametrize("p", [0.01, 0.3, 0.5, 0.9, 0.999, 1.0])
def test_top_p_mask_matches_reference(rng: np.random.Generator, p: float) -> None:
    probs = np.stack([ref_softmax(rng.normal(size=200) * 3) for _ in range(5)])
    got = top_p_mask(probs, p)
    for row, g in zip(probs, got, strict=True):
        np.testing.assert_array_equal(g, ref_top_p(row, p))


def test_top_p_always_keeps_the_most_probable_token() -> None:
    probs = np.array([0.1, 0.6, 0.3])
    assert top_p_mask(probs, 1e-9).tolist() == [False, True, False]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_k": 2.5}, "top_k must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"typical_p": 0.0}, r"typical_p must be in \(0, 1\]"),
        ({"typical_p": 1.01}, r"typical_p must be in \(0, 1\]"),
        ({"typical_p": float("nan")}, r"typical_p must be in \(0, 1\]"),
        ({"repeat_penalty": 0.0}, "repeat_penalty must be a finite number > 0"),
        ({"repeat_penalty": -1.0}, "repeat_penalty must be a finite number > 0"),
        ({"repeat_penalty": float("inf")}, "repeat_penalty must be a finite number > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3.0}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"penalty_last_n": -2}, "penalty_last_n must be an integer >= -1"),
        ({"penalty_last_n": 1.5}, "penalty_last_n must be an integer >= -1"),
        ({"logit_bias": {3: float("nan")}}, r"logit_bias\[3\] must be a finite number or -inf"),
        ({"logit_bias": {3: float("inf")}}, r"logit_bias\[3\] must be a finite number or -inf"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids >= 0"),
        ({"logit_bias": {"7": 1.0}}, "logit_bias keys must be token ids >= 0"),
        ({"logit_bias": {7: "high"}}, r"logit_bias\[7\] must be a number"),
        ({"logit_bias": [(7, 1.0)]}, "logit_bias must be a mapping"),
    ],
)
def test_invalid_params_raise(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_logit_bias_ids_are_checked_against_the_vocabulary() -> None:
    params = SamplingParams(logit_bias={99: 1.0, 5: -math.inf})
    params.check_vocab(100)
    with pytest.raises(ValueError, match="logit_bias token id 99 is out of range.* 99 tokens"):
        params.check_vocab(99)
    with pytest.raises(ValueError, match="bans every token"):
        SamplingParams(logit_bias={0: -math.inf, 1: -math.inf}).check_vocab(2)


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


# -- logit bias, penalties, typical-p, logprobs (against tests/sampling_reference.py) ----------


def test_logit_bias_adds_and_minus_inf_bans(rng: np.random.Generator) -> None:
    x = rng.normal(size=50).astype(np.float32)
    bias = {3: 2.5, 10: -1.0, 7: -math.inf, 0: -100.0}
    got = apply_logit_bias(x, bias)
    np.testing.assert_array_equal(got, ref_adjust(x, logit_bias=bias))
    assert got.dtype == np.float64 and x[3] != got[3]  # a copy; the input is untouched
    params = SamplingParams(temperature=1.5, logit_bias=bias)
    p = probabilities(x, params)
    assert p[7] == 0.0 and p[0] < 1e-25  # exp(-100 / 1.5) relative to the rest
    sampler = Sampler(params, seed=3)
    assert not {sampler(x) for _ in range(3000)} & {7, 0}
    # Greedy picks the argmax after the bias: a strong bias wins.
    assert Sampler(SamplingParams(logit_bias={int(np.argmin(x)): 100.0}))(x) == int(np.argmin(x))


@pytest.mark.parametrize("last_n", [0, 1, 5, 64, -1, 1000])
@pytest.mark.parametrize(
    "penalties",
    [
        {"repeat_penalty": 1.3},
        {"repeat_penalty": 0.7},
        {"presence_penalty": 0.8},
        {"frequency_penalty": -0.6},
        {"repeat_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.4},
    ],
)
def test_penalties_match_a_loop_over_the_window(
    rng: np.random.Generator, last_n: int, penalties: dict
) -> None:
    # Logits of both signs; a history with repeats, so counts above one occur in the window.
    x = rng.normal(size=(3, 40)) * 4
    history = rng.integers(0, 40, size=300).tolist()
    got = apply_penalties(x, history, last_n=last_n, **penalties)
    for row, g in zip(x, got, strict=True):
        want = ref_adjust(row, history, penalty_last_n=last_n, **penalties)
        np.testing.assert_allclose(g, want, rtol=1e-14, atol=0)
        if last_n != 0:
            assert not np.array_equal(want, row)  # the penalties changed something
    params = SamplingParams(temperature=0.9, penalty_last_n=last_n, **penalties)  # type: ignore[arg-type]
    want_p = ref_distribution(x[0], history, temperature=0.9, penalty_last_n=last_n, **penalties)
    np.testing.assert_allclose(
        probabilities(x[0], params, history), want_p, rtol=1e-12, atol=1e-300
    )
    # Greedy is the argmax of the penalized logits.
    greedy_params = SamplingParams(penalty_last_n=last_n, **penalties)  # type: ignore[arg-type]
    for row in x:
        want_tok = int(np.argmax(ref_adjust(row, history, penalty_last_n=last_n, **penalties)))
        assert Sampler(greedy_params)(row, history) == want_tok


def test_penalties_change_greedy_and_are_off_without_a_window() -> None:
    x = np.array([3.0, 2.9, -1.0, 0.5])
    history = [0, 0, 2]
    assert Sampler(SamplingParams())(x, history) == 0
    assert Sampler(SamplingParams(repeat_penalty=1.1))(x, history) == 1  # 3 / 1.1 < 2.9
    assert Sampler(SamplingParams(repeat_penalty=1.1, penalty_last_n=0))(x, history) == 0
    assert Sampler(SamplingParams(repeat_penalty=1.1, penalty_last_n=1))(x, history) == 0  # [2]
    # A negative logit is multiplied: -1.0 * 2 = -2, and presence/frequency subtract.
    got = apply_penalties(x, history, repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=1)
    np.testing.assert_allclose(got, [3.0 / 2 - 0.5 - 2, 2.9, -2.0 - 0.5 - 1, 0.5])


@pytest.mark.parametrize("scale", [0.5, 2.0, 6.0])
@pytest.mark.parametrize("p", [0.05, 0.3, 0.7, 0.95, 0.999])
def test_typical_p_matches_reference(rng: np.random.Generator, scale: float, p: float) -> None:
    # Flat (scale 0.5) to peaked (scale 6) rows: different entropies, different kept sets.
    rows = rng.normal(size=(4, 3000)) * scale
    probs = softmax(rows)
    masks = typical_mask(probs, p)
    sizes = []
    for row, pr, mask in zip(rows, probs, masks, strict=True):
        want = ref_typical(pr, p)
        assert set(np.flatnonzero(mask).tolist()) == want
        sizes.append(len(want))
        # One row goes through the candidate cut-off path of probabilities().
        got = probabilities(row, SamplingParams(temperature=1.0, typical_p=p))
        want_p = ref_distribution(row, temperature=1.0, typical_p=p)
        assert set(np.flatnonzero(got).tolist()) == want
        np.testing.assert_allclose(got, want_p, rtol=1e-10, atol=1e-300)
    assert min(sizes) < rows.shape[1]  # the filter removed something


def test_typical_p_drops_the_most_probable_token_when_it_is_atypical() -> None:
    # One token much more probable than the entropy suggests (-log 0.3 = 1.2 against an
    # entropy near 5.2): the many small tokens, whose surprise is near the entropy, come first
    # and reach the mass before it.
    small = np.random.default_rng(0).uniform(0.8, 1.2, size=700)
    p = np.concatenate([[0.3], 0.7 * small / small.sum()])
    keep = typical_mask(p, 0.3)
    assert not keep[0] and 1 < keep[1:].sum() < 700
    assert set(np.flatnonzero(keep).tolist()) == ref_typical(p, 0.3)
    got = probabilities(np.log(p), SamplingParams(temperature=1.0, typical_p=0.3))
    assert got[0] == 0.0 and set(np.flatnonzero(got).tolist()) == ref_typical(p, 0.3)


ALL_OPTIONS = {
    "temperature": 0.9,
    "top_k": 300,
    "typical_p": 0.9,
    "top_p": 0.9,
    "min_p": 0.01,
    "repeat_penalty": 1.3,
    "presence_penalty": 0.4,
    "frequency_penalty": 0.3,
    "penalty_last_n": 16,
    "logit_bias": {5: 3.0, 6: -math.inf, 9: -100.0},
}


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0.8, "typical_p": 0.5},
        {"temperature": 1.2, "typical_p": 0.95, "top_p": 0.8},
        {"temperature": 1.0, "repeat_penalty": 1.5, "penalty_last_n": -1},
        {"temperature": 1.0, "presence_penalty": 1.0, "frequency_penalty": 0.5},
        {"temperature": 1.0, "logit_bias": {1: 4.0, 2: -math.inf}},
        ALL_OPTIONS,
        {**ALL_OPTIONS, "top_k": 0},
        {**ALL_OPTIONS, "temperature": 0.0},
    ],
)
def test_seeded_draws_are_the_reference_draws(options: dict[str, object]) -> None:
    """A generation loop over random rows (the history grows with each drawn token): the
    sampler's tokens are those a draw from the reference distribution makes with the same
    random stream, and the distributions agree."""
    data = np.random.default_rng(5)
    params = SamplingParams(**options)  # type: ignore[arg-type]
    sampler = Sampler(params, seed=21)
    ref_rng = np.random.default_rng(21)
    history = data.integers(0, 2000, size=40).tolist()  # a "prompt"
    drawn = []
    for _ in range(60):
        # Peaked enough that the history's tokens often matter, over a 2000-token vocabulary.
        row = (data.normal(size=2000) * 2.5).astype(np.float32)
        row[history[-3:]] += 4.0  # recent tokens are likely again: the penalties matter
        want_p = ref_distribution(row, history, **options)
        np.testing.assert_allclose(
            probabilities(row, params, history), want_p, rtol=1e-9, atol=1e-300
        )
        tok = sampler(row, history)
        want = int(np.argmax(want_p)) if params.is_greedy else ref_draw(want_p, ref_rng)
        assert tok == want
        drawn.append(tok)
        history.append(tok)
    assert len(set(drawn)) > (1 if params.is_greedy else 10)


def test_large_logits_do_not_overflow() -> None:
    x = np.array([1000.0, 999.0, 0.0, -1000.0])
    for params in (SamplingParams(temperature=0.5), SamplingParams(temperature=0.5, top_p=0.9)):
        p = probabilities(x, params)
        np.testing.assert_allclose(p, ref_distribution(x, temperature=0.5, top_p=params.top_p))
        assert Sampler(params, seed=0)(x) in (0, 1)
        np.testing.assert_allclose(probabilities(np.stack([x, x]), params), [p, p])


def test_all_options_do_not_modify_readonly_input() -> None:
    x = np.arange(100, dtype=np.float32) / 10
    x.flags.writeable = False
    opts = {k: v for k, v in ALL_OPTIONS.items() if k != "top_k"}
    Sampler(SamplingParams(**opts), seed=1)(x, [3, 4, 5, 5])  # type: ignore[arg-type]
    adjusted_logits(x, SamplingParams(**opts), [1, 2])  # type: ignore[arg-type]
    assert x.tolist() == (np.arange(100, dtype=np.float32) / 10).tolist()


@pytest.mark.parametrize("n", [0, 1, 5, 20, 25])
def test_token_logprobs_match_log_softmax(rng: np.random.Generator, n: int) -> None:
    flat = (rng.normal(size=5000) * 3).astype(np.float32)
    peaked = flat.copy()
    peaked[[7, 4000]] = [60.0, 45.0]  # only these two lie within 16 of the maximum
    for row in (flat, peaked):
        check_token_logprobs(row, n)


def check_token_logprobs(row: np.ndarray, n: int) -> None:
    lsm = ref_log_softmax(row)
    for token in (int(np.argmax(row)), 17, int(np.argmin(row))):
        logprob, top = token_logprobs(row, token, n)
        assert math.isclose(logprob, float(lsm[token]), rel_tol=0, abs_tol=1e-9)
        assert len(top) == n
        want_ids = sorted(range(len(row)), key=lambda i: -lsm[i])[:n]
        assert [t for t, _ in top] == want_ids
        np.testing.assert_allclose([lp for _, lp in top], lsm[want_ids], atol=1e-9)
        assert all(a[1] >= b[1] for a, b in pairwise(top))


def test_token_logprobs_ties_and_small_vocabularies() -> None:
    row = np.array([1.0, 3.0, 3.0, 0.0])
    logprob, top = token_logprobs(row, 2, 10)
    assert [t for t, _ in top] == [1, 2, 0, 3]  # all four, lower id first on the tie
    assert math.isclose(sum(math.exp(lp) for _, lp in top), 1.0, rel_tol=1e-12)
    assert logprob == top[1][1]
    # A tie across the n-th place far below the maximum: the lower ids win.
    tie = np.concatenate([np.zeros(60), [100.0], np.zeros(60)])
    for n in (5, 25):  # argmax passes, and a partition for more than 20
        _, top = token_logprobs(tie, 0, n)
        assert [t for t, _ in top] == [60, *range(n - 1)]
    # Entries of -inf (a banned logit) come last, lower id first, each once.
    _, top = token_logprobs(np.array([-np.inf, 0.5, -np.inf, 2.0]), 1, 4)
    assert [t for t, _ in top] == [3, 1, 0, 2] and top[2][1] == top[3][1] == -math.inf
    wide = np.concatenate([[-np.inf, 0.5, -np.inf, 2.0], np.full(26, -np.inf)])
    _, top = token_logprobs(wide, 1, 25)  # more than 20: the partition path
    assert [t for t, _ in top] == [3, 1, 0, 2, *range(4, 25)]
    entry = TokenLogprob(2, b"\xe4\xb8", logprob, top)
    assert entry.text == "\ufffd"  # a partial character reads as U+FFFD
