"""Golden tests: kvserve against outputs recorded from llama.cpp.

The reference data (tests/fixtures/llama_smollm2.json + llama_smollm2_logits.npz) was produced
by scripts/record_llama_fixtures.py with llama.cpp (commit in the JSON's ``meta``) on the
SmolLM2-135M-Instruct Q4_1 GGUF: prompt tokens, a 16-token greedy continuation (argmax over raw
logits), the top-10 log-probabilities at each generated position, and full-vocab logits of the
last prompt position for a few prompts.

Both engines quantize activations and sum in different orders, so logits are not bit-equal.
Near-ties may flip greedy picks; the tests therefore allow a divergence only where llama.cpp
itself rates our token within NEAR_TIE_NATS of its best one, and then stop comparing that prompt.

How far is "rounding-level"? The fixture's ``meta.calibration`` holds llama.cpp measured against
itself: the same build and prompts with flash attention on instead of off (the fixtures' setting,
``meta.flash_attn``), recorded by ``scripts/record_llama_fixtures.py --calibrate``. The
tolerances below are derived from it.

The model path comes from the ``model_path`` fixture (tests/conftest.py, env KVSERVE_TEST_MODEL).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = json.loads((FIXTURES / "llama_smollm2.json").read_text(encoding="utf-8"))
META = GOLDEN["meta"]
PROMPTS = GOLDEN["prompts"]
PROMPT_IDS = [p["name"] for p in PROMPTS]

# --- tolerances (nats unless noted) -----------------------------------------------------------
CALIBRATION = META["calibration"]
assert META["flash_attn"] == "off" and CALIBRATION["flash_attn"] == "on", META["flash_attn"]
# A greedy divergence is accepted only if llama.cpp's logprob of our token is within this of
# llama.cpp's own top logprob (i.e. the two engines disagree on a near-tie). llama.cpp's own
# flash-attention divergences happen at gaps up to 0.1 nats (calibration divergence_gaps_nats).
NEAR_TIE_NATS = 0.5
# |ours - llama.cpp| logprob over llama.cpp's top-5 tokens at every position reached with an
# identical context: worst case and mean. llama.cpp with flash attention on differs from the
# fixtures on these positions by up to 0.57 nats, mean 0.18: on this 135M Q4_1 model rounding
# differences (activation quantization, f16 attention operands, summation order) amplify that
# much. We have more of them (our own activation rounding and kernels), so we allow 1.75x the
# worst case and 1.4x the mean; a real bug (RoPE, norm, quantization layout) moves logprobs by
# whole nats on most positions.
TOP5_LOGPROB_TOL = 1.75 * CALIBRATION["top5_logprob_max"]
TOP5_LOGPROB_MEAN_TOL = 1.4 * CALIBRATION["top5_logprob_mean"]
# How far identical greedy continuations reach, as the mean over prompts of the identical prefix
# length (of 16): llama.cpp with flash attention on keeps 12.65 on average (14 of 20 prompts
# whole). Our rounding differs more, so half of that; a real bug leaves almost no prefix.
MIN_MEAN_PREFIX = 0.5 * CALIBRATION["greedy_prefix_mean"]
N_TOP_COMPARED = 5
# Last-prompt-position full-vocab logits (stored as float16).
MIN_LOGIT_CORR = 0.99

N_CTX = META["n_ctx"]

_MODELS: dict[str, object] = {}
_RUNS: dict[str, GreedyRun] = {}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def _rows(logits) -> np.ndarray:
    return np.frombuffer(logits, dtype=np.float32).reshape(logits.n_rows, logits.n_vocab)


@pytest.fixture
def core(model_path):
    """The low-level ``kvserve._core.Model`` for the test model (loaded once per session)."""
    key = str(model_path)
    if key not in _MODELS:
        import kvserve

        _MODELS[key] = kvserve.Model.load(key)._core
    return _MODELS[key]


@dataclass
class GreedyRun:
    """Our greedy continuation of one prompt, with log-probs at each position."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)  # float64 log_softmax per position


def _greedy(core, prompt: dict) -> GreedyRun:
    """Prefill the recorded prompt tokens in one call, then decode one token per call (argmax)."""
    if prompt["name"] in _RUNS:
        return _RUNS[prompt["name"]]
    toks = prompt["prompt_tokens"]
    n = len(toks)
    n_gen = len(prompt["greedy_tokens"])
    ctx = core.new_context(N_CTX)
    logits = ctx.decode(toks, list(range(n)), [0] * n, [False] * (n - 1) + [True])
    run = GreedyRun()
    pos = n
    for step in range(n_gen):
        row = _rows(logits)[-1]
        assert row.shape[0] == META["n_vocab"], f"n_vocab {row.shape[0]} != {META['n_vocab']}"
        run.logprobs.append(_log_softmax(row))
        tok = int(np.argmax(row))
        run.tokens.append(tok)
        if step + 1 < n_gen:
            logits = ctx.decode([tok], [pos], [0], [True])
            pos += 1
    _RUNS[prompt["name"]] = run
    return run


def _first_divergence(ours: list[int], ref: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None


def _llama_logprob(step: dict, token: int) -> float | None:
    """llama.cpp's logprob of ``token`` at a step, if it is in the recorded top-10."""
    for t, lp in zip(step["top_ids"], step["top_logprobs"]):
        if t == token:
            return lp
    return None


# --- fixture sanity (no engine needed) --------------------------------------------------------


def test_fixture_matches_model_file(model_path):
    """The golden data is only meaningful for the exact GGUF it was recorded from."""
    h = hashlib.sha256()
    with open(model_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    assert h.hexdigest() == META["model_sha256"], (
        f"{model_path} is not the model the fixtures were recorded from "
        f"({META['model_file']}, sha256 {META['model_sha256']})"
    )


# --- (a) tokenization -------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS, ids=PROMPT_IDS)
def test_tokenize_matches_llama(core, prompt):
    ours = core.tokenize(prompt["text"], True, True)
    assert list(ours) == prompt["prompt_tokens"], f"tokenization of {prompt['text']!r} differs"


# --- (b) greedy continuation ------------------------------------------------------------------


def test_greedy_matches_llama(core):
    full, problems, notes, prefixes = 0, [], [], []
    for p in PROMPTS:
        run = _greedy(core, p)
        d = _first_divergence(run.tokens, p["greedy_tokens"])
        prefixes.append(len(run.tokens) if d is None else d)
        if d is None:
            full += 1
            continue
        step = p["steps"][d]
        top = step["top_logprobs"][0]
        lp = _llama_logprob(step, run.tokens[d])
        gap = None if lp is None else top - lp
        rating = "outside its top-10" if gap is None else f"{gap:.3f} nats below its top"
        msg = (
            f"{p['name']}: diverges at step {d}: ours {run.tokens[d]} vs llama "
            f"{step['top_ids'][0]} (llama.cpp rates ours {rating})"
        )
        (problems if gap is None or gap > NEAR_TIE_NATS else notes).append(msg)
    mean_prefix = float(np.mean(prefixes))
    print(
        f"greedy: {full}/{len(PROMPTS)} prompts match fully, mean identical prefix "
        f"{mean_prefix:.2f} of {META['n_gen']} (llama.cpp vs itself: "
        f"{CALIBRATION['greedy_prefix_mean']}); near-tie divergences: {notes}"
    )
    if problems:
        problems.insert(0, "greedy divergences that are not near-ties:")
    if mean_prefix < MIN_MEAN_PREFIX:
        problems.append(
            f"identical greedy prefixes reach {mean_prefix:.2f} tokens on average "
            f"(per prompt: {prefixes}), below {MIN_MEAN_PREFIX:.2f}"
        )
    assert not problems, "\n".join(problems)


# --- (c) top-k logprobs -----------------------------------------------------------------------


def test_top_logprobs_close_to_llama(core):
    """At each position reached with the same context as llama.cpp (up to and including the
    first divergence), our logprobs of llama.cpp's top-5 tokens are within TOP5_LOGPROB_TOL."""
    worst = (0.0, "")
    failures = []
    diffs: list[float] = []
    for p in PROMPTS:
        run = _greedy(core, p)
        d = _first_divergence(run.tokens, p["greedy_tokens"])
        last = len(run.tokens) - 1 if d is None else d
        for i in range(last + 1):
            step = p["steps"][i]
            ids = step["top_ids"][:N_TOP_COMPARED]
            ref = np.array(step["top_logprobs"][:N_TOP_COMPARED])
            ours = run.logprobs[i][ids]
            diff = float(np.max(np.abs(ours - ref)))
            where = f"{p['name']} step {i}"
            if diff > worst[0]:
                worst = (diff, where)
            diffs.append(diff)
            if diff >= TOP5_LOGPROB_TOL:
                failures.append(f"{where}: max |dlogprob| {diff:.3f} (ids {ids})")
    mean = float(np.mean(diffs))
    print(
        f"top-{N_TOP_COMPARED} logprobs: worst |diff| {worst[0]:.4f} at {worst[1]}, mean {mean:.4f}"
    )
    assert not failures, "\n".join(failures)
    assert mean < TOP5_LOGPROB_MEAN_TOL, f"mean |dlogprob| {mean:.3f} >= {TOP5_LOGPROB_MEAN_TOL}"


# --- (d) full-vocab logits at the last prompt position ----------------------------------------


@pytest.mark.parametrize("name", META["full_logits_prompts"])
def test_last_position_logits(core, name):
    ref_all = np.load(FIXTURES / META["full_logits_file"])
    ref = ref_all[name].astype(np.float32)
    p = next(p for p in PROMPTS if p["name"] == name)
    toks = p["prompt_tokens"]
    n = len(toks)
    ctx = core.new_context(N_CTX)
    rows = _rows(ctx.decode(toks, list(range(n)), [0] * n, [False] * (n - 1) + [True]))
    assert rows.shape == (1, ref.shape[0])
    ours = rows[0]
    corr = float(np.corrcoef(ours.astype(np.float64), ref.astype(np.float64))[0, 1])
    print(f"{name}: corr {corr:.6f}, max |dlogit| {float(np.max(np.abs(ours - ref))):.4f}")
    assert corr > MIN_LOGIT_CORR, f"{name}: logit correlation {corr:.5f} <= {MIN_LOGIT_CORR}"
    # the reference argmax comes from llama.cpp's float32 logits (greedy_tokens[0])
    assert int(np.argmax(ours)) == p["greedy_tokens"][0]
    assert int(np.argmax(ref)) == p["greedy_tokens"][0], "float16 fixture lost the argmax"
