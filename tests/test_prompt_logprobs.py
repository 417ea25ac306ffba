"""Prompt log-probabilities: the Engine's ``prompt_logprobs`` option (python/kvserve/engine/
loop.py ``_batch``/``_consume``).

Oracle: our own core decoding the prompt one token per call (a fresh context, no batching, no
chunks, no prefix cache) with a float64 log-softmax in numpy: the prompt logprobs computed in
chunked, batched prefill must equal those.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvserve import Engine, Model
from kvserve.sampling import TokenLogprob

TEXT = (
    "The lighthouse keeper climbed the stairs every evening at dusk, trimmed the wick, polished"
    " the lens and wrote the weather into the log. "
) * 2
# Prompt logprobs of a chunked, batched prefill against a one-token-per-call decode of the same
# core: equal but for summation order (measured: bit for bit on this machine).
EXACT = 1e-4


def _log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    m = x.max()
    out: np.ndarray = x - (m + np.log(np.exp(x - m).sum()))
    return out


class Reference:
    """Our core's logprobs of each prompt token, one token per decode call (cached by ids)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.cache: dict[tuple[int, ...], list[np.ndarray]] = {}

    def rows(self, ids: list[int]) -> list[np.ndarray]:
        """The float64 log-softmax after each prompt token (row i: the distribution of token
        i + 1)."""
        key = tuple(ids)
        if key not in self.cache:
            ctx = self.model.new_context(len(ids) + 1)
            out = []
            for i, t in enumerate(ids[:-1]):
                lg = ctx.decode([t], [i], [0], [True])
                row = np.frombuffer(memoryview(lg), dtype=np.float32)[: lg.n_vocab]
                out.append(_log_softmax(row))
            self.cache[key] = out
        return self.cache[key]

    def check(self, ids: list[int], entries: list[TokenLogprob | None], n: int) -> None:
        """``entries`` are the prompt logprobs of ``ids`` with ``n`` alternatives each."""
        assert len(entries) == len(ids) and entries[0] is None
        for i, (row, e) in enumerate(zip(self.rows(ids), entries[1:]), start=1):
            assert e is not None and e.token == ids[i]
            assert abs(e.logprob - row[ids[i]]) < EXACT, (i, e.logprob, row[ids[i]])
            best = np.lexsort((np.arange(row.size), -row))[:n]  # ties: lower id first
            assert [t for t, _ in e.top] == best.tolist(), i
            assert all(abs(lp - row[t]) < EXACT for t, lp in e.top)


@pytest.fixture(scope="module")
def model(model_path: Path) -> Model:
    return Model(model_path, threads=2)


@pytest.fixture(scope="module")
def ref(model_path: Path) -> Reference:
    return Reference(Model(model_path, threads=2))


@pytest.fixture(scope="module")
def engine(model: Model) -> Iterator[Engine]:
    # Small prompt chunks: a prompt spans several steps, and shares them with other requests.
    with Engine(model, parallel=4, ctx_size=1024, batch_tokens=24) as e:
        yield e


def _ids(model: Model, text: str) -> list[int]:
    return model.tokenize(text, add_special=True, parse_special=True)


# -- the engine -------------------------------------------------------------------------------


def test_prompt_logprobs_equal_a_token_by_token_decode(
    engine: Engine, model: Model, ref: Reference
) -> None:
    """Chunked over several steps, batched with another request, and after that request
    cached the same prompt's blocks: the entries are those of a one-token-per-call decode,
    the other request's tokens are its own, and nothing is generated with max_tokens=0."""
    prompt = TEXT
    ids = _ids(model, prompt)
    assert len(ids) > 2 * engine.batch_tokens  # several steps
    solo = engine.generate("Once upon a time", max_tokens=24, ignore_eos=True)

    async def both() -> tuple[Any, Any]:
        return await asyncio.gather(
            engine.agenerate(prompt, max_tokens=0, prompt_logprobs=3),
            engine.agenerate("Once upon a time", max_tokens=24, ignore_eos=True),
        )

    scored, other = asyncio.run(both())
    assert other.tokens == solo.tokens
    assert (scored.tokens, scored.text, scored.finish_reason) == ([], "", "length")
    assert scored.prompt_tokens == len(ids) and scored.logprobs is None
    ref.check(ids, scored.prompt_logprobs, 3)
    # Its blocks are cached now; a second request computes its rows anyway, and generates.
    again = engine.generate(prompt, max_tokens=3, prompt_logprobs=0, logprobs=1)
    assert again.cached_tokens == 0
    ref.check(ids, again.prompt_logprobs, 0)
    assert len(again.tokens) == len(again.logprobs) == 3
    # A plain request reuses what the scoring requests left in the prefix cache.
    assert engine.generate(prompt, max_tokens=1).cached_tokens > 0


def test_choices_share_the_prompt_logprobs(engine: Engine, model: Model, ref: Reference) -> None:
    ids = _ids(model, "The old keeper said")

    async def collect(max_tokens: int) -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {}
        async for d in engine.choices(ids, max_tokens, 3, prompt_logprobs=2, temperature=1.0):
            out.setdefault(d.index, []).append(d)
        return out

    for max_tokens in (0, 4):
        got = asyncio.run(collect(max_tokens))
        assert sorted(got) == [0, 1, 2]
        for deltas in got.values():
            # The first delta carries the prompt logprobs, the last the result with them.
            assert all(d.prompt_logprobs is None for d in deltas[1:])
            result = deltas[-1].result
            assert result is not None and len(result.tokens) == max_tokens
            assert deltas[0].prompt_logprobs == result.prompt_logprobs
            ref.check(ids, result.prompt_logprobs, 2)


def test_a_preempted_prefill_resumes_without_gaps_or_repeats(model: Model, ref: Reference) -> None:
    """Preempted mid-prefill by a higher-priority request, a scoring request resumes (mapping
    back at most the rows it had reduced) and its entries are whole, each once."""
    prompt = TEXT
    ids = _ids(model, prompt)
    with Engine(model, parallel=1, ctx_size=1024, batch_tokens=4) as eng:

        async def main() -> Any:
            scoring = asyncio.ensure_future(eng.agenerate(prompt, max_tokens=0, prompt_logprobs=1))
            deadline = time.monotonic() + 60
            while eng.stats()["computed_tokens"] < 12:
                assert time.monotonic() < deadline and not scoring.done()
                await asyncio.sleep(0.001)
            await eng.agenerate("Urgent:", max_tokens=2, priority=10)
            return await scoring

        scored = asyncio.run(main())
        st = eng.stats()
    assert st["preemptions"] >= 1
    assert scored.finish_reason == "length"
    ref.check(ids, scored.prompt_logprobs, 1)


def test_prompt_logprobs_arguments(engine: Engine) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs cannot be combined with session_id"):
        engine.generate("Hi", prompt_logprobs=1, session_id="s")
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        engine.generate("Hi", prompt_logprobs=21)
    # One token: nothing precedes it, nothing to compute.
    r = engine.generate([engine.model.bos or 1], max_tokens=0, prompt_logprobs=1)  # type: ignore[arg-type]
    assert r.prompt_logprobs == [None]


def test_the_end_token_entry(engine: Engine, model: Model) -> None:
    """A generation ended by an end-of-generation token reports that token's entry apart
    (it is in neither tokens nor text), the same as Model.generate's."""
    eos = model.eos
    assert eos is not None
    kw: dict[str, Any] = {"logprobs": 2, "logit_bias": {eos: 100.0}}
    r = engine.generate("Hello", max_tokens=4, **kw)
    assert (r.tokens, r.text, r.finish_reason, r.logprobs) == ([], "", "stop", [])
    assert r.end_logprob is not None and r.end_logprob.token == eos
    assert r.end_logprob == model.generate("Hello", max_tokens=4, **kw).end_logprob
    assert engine.generate("Hello", max_tokens=2, ignore_eos=True, logprobs=1).end_logprob is None
