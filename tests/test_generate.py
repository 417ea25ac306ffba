"""Tests for the Python generation API (kvserve.Model.generate / stream) on a real model."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import kvserve
import kvserve._core
from kvserve import GenerateResult, KvCacheFull, Model, ModelError

PROMPT = "The capital of France is"


def rows(logits: kvserve._core.Logits) -> np.ndarray:
    """The documented zero-copy view (numpy's stubs do not know the buffer protocol)."""
    view = np.frombuffer(logits, dtype=np.float32)  # type: ignore[call-overload]
    out: np.ndarray = view.reshape(logits.n_rows, logits.n_vocab)
    return out


@pytest.fixture(scope="module")
def model(model_path: Path) -> Model:
    return Model.load(model_path, threads=2)


def test_public_api_exports() -> None:
    assert set(kvserve.__all__) >= {
        "Model",
        "ModelError",
        "KvCacheFull",
        "generate",
        "__version__",
    }
    assert issubclass(ModelError, ValueError)
    assert issubclass(KvCacheFull, RuntimeError)
    assert isinstance(kvserve.__version__, str)


def test_greedy_generate_matches_stream_and_detokenize(model: Model) -> None:
    result = model.generate(PROMPT, max_tokens=16)
    assert isinstance(result, GenerateResult)
    assert 1 <= len(result.tokens) <= 16
    assert result.text == "".join(model.stream(PROMPT, max_tokens=16))
    assert result.text == model.detokenize(result.tokens)
    assert result.finish_reason in ("stop", "length")
    assert (result.finish_reason == "length") == (len(result.tokens) == 16)


def test_greedy_matches_token_by_token_decoding(model: Model) -> None:
    """Prefill in one call (generate) and one token per call (here) pick the same tokens."""
    result = model.generate(PROMPT, max_tokens=4)
    prompt = model.tokenize(PROMPT, add_special=True, parse_special=True)
    ctx = model.new_context(64)
    tokens = list(prompt)
    out: list[int] = []
    for pos in range(len(prompt) + len(result.tokens) - 1):
        logits = ctx.decode([tokens[pos]], [pos], [0], [True])
        if pos >= len(prompt) - 1:
            nxt = int(np.argmax(rows(logits)[0]))
            out.append(nxt)
            if pos + 1 >= len(tokens):
                tokens.append(nxt)
    assert out == result.tokens


def test_logits_rows_are_a_float32_view(model: Model) -> None:
    prompt = model.tokenize(PROMPT, add_special=True, parse_special=True)
    n = len(prompt)
    ctx = model.new_context(32)
    logits = ctx.decode(prompt, list(range(n)), [0] * n, [True] * n)
    assert (logits.n_rows, logits.n_vocab) == (n, model.n_vocab)
    view = rows(logits)
    assert np.isfinite(view).all()
    ctx.clear()
    last = ctx.decode(prompt, list(range(n)), [0] * n, [False] * (n - 1) + [True])
    assert last.n_rows == 1
    np.testing.assert_allclose(rows(last)[0], view[-1], rtol=1e-4, atol=1e-4)


def test_seeded_sampling_is_reproducible(model: Model) -> None:
    kw = {"max_tokens": 12, "temperature": 1.0, "top_k": 40, "top_p": 0.95}
    a = model.generate("Once upon a time", seed=3, **kw)  # type: ignore[arg-type]
    b = model.generate("Once upon a time", seed=3, **kw)  # type: ignore[arg-type]
    assert a == b
    assert a.text == "".join(model.stream("Once upon a time", seed=3, **kw))  # type: ignore[arg-type]


def test_stop_string_cuts_before_it(model: Model) -> None:
    full = model.generate(PROMPT, max_tokens=16)
    words = full.text.split()
    assert len(words) >= 2, full.text
    stop = words[1]
    cut = model.generate(PROMPT, max_tokens=16, stop=[stop])
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop"
    assert cut.tokens == full.tokens[: len(cut.tokens)]
    assert "".join(model.stream(PROMPT, max_tokens=16, stop=stop)) == cut.text


def test_context_full_ends_generation(model: Model) -> None:
    n_prompt = len(model.tokenize(PROMPT, add_special=True, parse_special=True))
    result = model.generate(PROMPT, max_tokens=50, n_ctx=n_prompt + 3)
    full = model.generate(PROMPT, max_tokens=4)
    assert full.finish_reason == "length"  # precondition: no end-of-generation this early
    assert result.finish_reason == "context"
    assert result.tokens == full.tokens


def test_prompt_longer_than_context_raises(model: Model) -> None:
    with pytest.raises(KvCacheFull):
        model.generate(PROMPT, max_tokens=4, n_ctx=2)


def test_max_tokens_zero(model: Model) -> None:
    r = model.generate(PROMPT, max_tokens=0)
    n = len(model.tokenize(PROMPT, add_special=True, parse_special=True))
    assert r == GenerateResult("", [], "length", prompt_tokens=n, cached_tokens=0)


def test_generate_reuses_the_prefix_of_an_earlier_request(model_path: Path) -> None:
    fresh = Model(model_path)
    long = PROMPT * 4
    n = len(fresh.tokenize(long, add_special=True, parse_special=True))
    first = fresh.generate(long, max_tokens=8)
    again = fresh.generate(long, max_tokens=8)
    assert first.cached_tokens == 0 and first.prompt_tokens == n
    assert again.cached_tokens == (n - 1) // 16 * 16 > 0
    assert again.tokens == first.tokens


def test_concurrent_generation_matches_sequential(model: Model) -> None:
    want = model.generate(PROMPT, max_tokens=8)
    results: list[GenerateResult] = []

    def work() -> None:
        results.append(model.generate(PROMPT, max_tokens=8))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [want] * 3


def test_load_errors_are_typed(tmp_path: Path) -> None:
    # As the issue asks: a missing path and a directory are model errors too (ValueError).
    with pytest.raises(ModelError, match="missing.gguf"):
        Model.load(tmp_path / "missing.gguf")
    with pytest.raises(ModelError, match="is a directory"):
        Model.load(tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ModelError):
        Model.load(bad)


def test_generate_function_with_path(model_path: Path) -> None:
    result = kvserve.generate(PROMPT, model=model_path, max_tokens=3)
    assert 1 <= len(result.tokens) <= 3
