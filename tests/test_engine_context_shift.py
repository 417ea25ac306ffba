"""Context shift in kvserve.Engine (python/kvserve/engine/, llama.cpp's ``--context-shift``).

Model of the semantics (llama.cpp's server, tools/server): when a generating sequence's K/V
fills the limit, keep its first ``keep = min(limit - 4, n_keep + add_bos)`` tokens, drop the
next ``n_discard = min(n_left // 2, n_left - 1)`` (``n_left`` = tokens after ``keep``) and move
the rest down by ``n_discard``. ``simulate`` replays that rule over a finished request's tokens
and gives, for every sampled row, the context the row was computed from.

Oracles:
- a tiny one-layer random model against the float64 numpy reference forward pass
  (tests/reference.py) fed the shifted context at positions 0, 1, ...: with one layer a
  shifted cache is exactly a fresh computation of the kept tokens at their new positions (keys
  re-rotated; values do not depend on position). With more layers it is not — the kept tokens'
  deeper K/V were computed with the dropped tokens in view — so for SmolLM2 the oracle is a core
  ``Context`` driven by the test itself with ``seq_rm``/``seq_add`` and the same arithmetic;
- a fresh context without prefix reuse, for the prefix cache after shifts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reference as ref

from kvserve import Engine, Model

LIMIT = 64
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def simulate(prompt: list[int], generated: list[int], limit: int, keep: int) -> list[list[int]]:
    """The context (tokens at positions 0, 1, ...) behind each sampled row: row 0 after the
    prompt, row i after feeding generated[i - 1] (shifting first when the K/V is full)."""
    ctx = list(prompt)
    views = [list(ctx)]
    for tok in generated[:-1]:
        if len(ctx) >= limit:
            n_left = len(ctx) - keep
            n_discard = min(n_left // 2, max(0, n_left - 1))
            ctx = ctx[:keep] + ctx[keep + n_discard :]
        ctx.append(tok)
        views.append(list(ctx))
    return views


def spy_rows(engine: Engine) -> list[np.ndarray]:
    """Records the logits row of every sampled token (engines here run one request at a
    time)."""
    rows: list[np.ndarray] = []
    pick = engine._loop.pick

    def spy(model: Any, req: Any, row: np.ndarray, greedy: int | None, *masked: Any) -> int:
        rows.append(np.asarray(row, dtype=np.float64))
        return pick(model, req, row, greedy, *masked)

    engine._loop.pick = spy  # type: ignore[method-assign]
    return rows


def last_row(logits: Any) -> np.ndarray:
    view = np.frombuffer(memoryview(logits), dtype=np.float32)
    return view.reshape(logits.n_rows, logits.n_vocab)[-1].astype(np.float64)


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, ref.Spec, Any]:
    spec = ref.Spec(n_layer=1, seed=21)
    path = tmp_path_factory.mktemp("one-layer") / "l1.gguf"
    weights = ref.write_model(path, spec)
    return Model(path, threads=2), spec, weights


@pytest.fixture(scope="module")
def one_layer_bos(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> tuple[Model, ref.Spec, Any]:
    """A one-layer model with SmolLM2's vocabulary whose tokenizer adds a BOS."""
    tok = [
        (k, True, t, s) if k == "tokenizer.ggml.add_bos_token" else (k, v, t, s)
        for k, v, t, s in ref.tokenizer_fields(model_path)
    ]
    spec = ref.Spec(n_layer=1, seed=22)
    path = tmp_path_factory.mktemp("one-layer-bos") / "l1bos.gguf"
    weights = ref.write_model(path, spec, tokenizer=tok)
    model = Model(path, threads=2)
    assert model.add_bos
    return model, spec, weights


@pytest.fixture(scope="module")
def served(model_path: Path) -> Model:
    return Model.load(model_path, threads=2)


@pytest.fixture(scope="module")
def oracle(model_path: Path) -> Model:
    """A separate Model: its own K/V memory and prefix index."""
    return Model.load(model_path, threads=2)


@pytest.mark.parametrize(
    ("engine_default", "request_option", "n_keep", "bos"),
    [(True, None, 0, False), (False, True, 3, False), (True, None, 3, True)],
    ids=["engine-wide", "per-request-n_keep-3", "bos-n_keep-3"],
)
def test_generation_goes_past_the_limit_and_matches_the_reference(
    request: pytest.FixtureRequest,
    engine_default: bool,
    request_option: bool | None,
    n_keep: int,
    bos: bool,
) -> None:
    """llama.cpp's rule, simulated independently: a shift keeps the first ``n_keep`` tokens,
    plus the BOS when the model adds one, and drops half of the rest."""
    fixture = "one_layer_bos" if bos else "one_layer"
    model, spec, weights = request.getfixturevalue(fixture)
    limit, text = 48, "the cat in the hat ran on and on, then"
    kw: dict[str, Any] = {"n_keep": n_keep}
    if request_option is not None:
        kw["context_shift"] = request_option
    with Engine(model, parallel=1, ctx_size=limit, context_shift=engine_default) as engine:
        rows = spy_rows(engine)
        r = engine.generate(text, max_tokens=120, ignore_eos=True, **kw)
    assert (r.finish_reason, len(r.tokens)) == ("length", 120)
    prompt = model.tokenize(text, add_special=True, parse_special=True)
    assert r.prompt_tokens == len(prompt) and model.add_bos == bos
    assert (prompt[0] == model.bos) == bos
    views = simulate(prompt, r.tokens, limit, keep=n_keep + int(bos))
    assert len(rows) == len(views) == 120
    shifts = [i for i in range(1, len(views)) if len(views[i]) <= len(views[i - 1])]
    assert len(shifts) >= 3  # several shifts, so rows after the 2nd and 3rd are checked too
    worst = 0.0
    for i, (view, row) in enumerate(zip(views, rows, strict=True)):
        want = ref.forward(weights, spec, view, kv_f16=True)[-1]
        d = float(np.abs(row - want).max() / np.abs(want).max())
        worst = max(worst, d)
        assert d < 1e-3, f"row {i} (context of {len(view)} tokens): max rel diff {d:.3g}"
        assert int(row.argmax()) == r.tokens[i]
    if n_keep == 0:
        return  # a uniform shift keeps every relative position: nothing more to tell apart
    # The check is sharp: keys left at their old positions give a visibly different row.
    first = shifts[0]
    dropped = len(views[first - 1]) + 1 - len(views[first])
    kept = n_keep + int(bos)
    old = list(range(kept)) + list(range(kept + dropped, kept + dropped + 200))
    unshifted = ref.forward(weights, spec, views[first], old[: len(views[first])], kv_f16=True)
    want = ref.forward(weights, spec, views[first], kv_f16=True)
    assert np.abs(unshifted[-1] - want[-1]).max() / np.abs(want[-1]).max() > 100 * max(worst, 1e-6)


def test_smollm2_shift_matches_a_context_shifted_by_hand(served: Model, oracle: Model) -> None:
    n_keep = 5
    with Engine(served, parallel=2, ctx_size=LIMIT, context_shift=True) as engine:
        rows = spy_rows(engine)
        r = engine.generate(PROMPT, max_tokens=150, ignore_eos=True, n_keep=n_keep)
        assert (r.finish_reason, len(r.tokens)) == ("length", 150)
        assert engine.stats()["kv_blocks_used"] == 0
    prompt = oracle.tokenize(PROMPT, add_special=True, parse_special=True)
    ctx = oracle.new_context(LIMIT)
    n = len(prompt)
    want = [last_row(ctx.decode(prompt, list(range(n)), [0] * n, [False] * (n - 1) + [True]))]
    for tok in r.tokens[:-1]:
        if n >= LIMIT:  # full: llama.cpp's arithmetic, by hand
            n_left = n - n_keep
            n_discard = min(n_left // 2, n_left - 1)
            ctx.seq_rm(0, n_keep, n_keep + n_discard)
            ctx.seq_add(0, n_keep + n_discard, -1, -n_discard)
            n -= n_discard
        want.append(last_row(ctx.decode([tok], [n], [0], [True])))
        n += 1
    assert len(rows) == len(want)
    for i, (got, w) in enumerate(zip(rows, want, strict=True)):
        d = float(np.abs(got - w).max() / np.abs(w).max())
        assert d < 1e-3, f"row {i}: max rel diff {d:.3g}"
        assert int(got.argmax()) == r.tokens[i]


def test_without_context_shift_the_limit_still_ends_generation(served: Model) -> None:
    with Engine(served, parallel=2, ctx_size=LIMIT) as engine:
        r = engine.generate(PROMPT, max_tokens=150, ignore_eos=True)
        assert r.finish_reason == "context"
        assert r.prompt_tokens + len(r.tokens) == LIMIT + 1
        off = engine.generate(PROMPT, max_tokens=150, ignore_eos=True, context_shift=False)
        assert (off.tokens, off.finish_reason) == (r.tokens, "context")
    with Engine(served, parallel=2, ctx_size=LIMIT, context_shift=True) as engine:
        # The per-request value overrides the engine's.
        off = engine.generate(PROMPT, max_tokens=150, ignore_eos=True, context_shift=False)
        assert (off.tokens, off.finish_reason) == (r.tokens, "context")


def test_shifted_blocks_are_never_matched_for_unshifted_content(
    served: Model, oracle: Model
) -> None:
    """Blocks keyed before a shift and then moved must not serve the original tokens: after
    shifted generations (keep not on a block boundary, so blocks are cut and moved), a new
    context that maps the cached prefix of the original token run computes what a context
    without prefix reuse computes."""
    with Engine(served, parallel=2, ctx_size=LIMIT, context_shift=True) as engine:
        r = engine.generate(PROMPT, max_tokens=100, ignore_eos=True, n_keep=5)
        assert (r.finish_reason, len(r.tokens)) == ("length", 100)
    run = served.tokenize(PROMPT, add_special=True, parse_special=True) + r.tokens
    for n in (LIMIT + 1, LIMIT + 17, 110):
        toks = run[:n]
        ctx = served.new_context(256)
        matched = ctx.match_prefix(0, toks)
        assert matched > 0  # the blocks cut or dropped whole by the shift stay valid and cached
        k = n - matched
        got = last_row(ctx.decode(toks[matched:], list(range(matched, n)), [0] * k, [True] * k))
        fresh = oracle.core.new_context(256, prefix_cache=False)
        want = last_row(fresh.decode(toks, list(range(n)), [0] * n, [False] * (n - 1) + [True]))
        assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-3, (n, matched)
        ctx.audit()


class _Recorder:
    """The engine's context with every decode call recorded as (seq -> (tokens, positions),
    the requests' ids at that moment)."""

    def __init__(self, ctx: Any, engine: Engine) -> None:
        self._ctx = ctx
        self._engine = engine
        self.calls: list[dict[int, tuple[list[int], list[int], int, int]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int], flags: Any) -> Any:
        out = self._ctx.decode(tokens, positions, seqs, flags)
        per: dict[int, tuple[list[int], list[int], int, int]] = {}
        for s in set(seqs):
            req = self._engine._loop.sched.running[s]
            idx = [i for i, x in enumerate(seqs) if x == s]
            per[s] = ([tokens[i] for i in idx], [positions[i] for i in idx], id(req), len(req.ids))
        self.calls.append(per)
        return out


def wait_until(cond: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_preempted_shifted_request_resumes_from_its_shifted_context(
    model_path: Path, oracle: Model
) -> None:
    """A shifts, is then preempted by a higher-priority request that needs its blocks, and
    resumes by recomputing its shifted context (never the original tokens, whose positions
    would pass the limit), then runs to max_tokens."""
    per_block = int(oracle.new_context(16).stats()["bytes_per_block"])
    served = Model.load(model_path, threads=2)  # a fresh model: its pool is made this small
    eng = Engine(served, parallel=2, ctx_size=LIMIT, kv_memory=6 * per_block, context_shift=True)
    rec = _Recorder(eng._loop.kv.ctx, eng)
    eng._loop.kv.ctx = rec  # type: ignore[assignment]
    results: dict[str, Any] = {}
    try:

        def run_a() -> None:
            results["a"] = eng.generate(PROMPT, max_tokens=160, ignore_eos=True)

        ta = threading.Thread(target=run_a)
        ta.start()
        wait_until(lambda: any(r.shift > 0 for r in list(eng._loop.sched.running.values())))
        b_prompt = "A list of the planets, one per line, with a short fact about each:"
        results["b"] = eng.generate(b_prompt, max_tokens=40, ignore_eos=True, priority=1)
        ta.join()
        st = eng.stats()
    finally:
        eng.close()
    a, b = results["a"], results["b"]
    assert (a.finish_reason, len(a.tokens)) == ("length", 160)
    assert (b.finish_reason, len(b.tokens)) == ("length", 40)
    assert st["preemptions"] >= 1
    # A's decode calls, in order: (tokens, positions, len(ids) after the call's feed).
    a_prompt = served.tokenize(PROMPT, add_special=True, parse_special=True)
    a_run = a_prompt + a.tokens
    a_id = next(
        rid for call in rec.calls for toks, _p, rid, _n in call.values() if toks[:4] == a_prompt[:4]
    )
    feeds = [(t, p, n) for call in rec.calls for t, p, rid, n in call.values() if rid == a_id]
    views = simulate(a_prompt, a.tokens, LIMIT, keep=0)
    resumed = 0
    for toks, pos, n_ids in feeds:
        assert max(pos) < LIMIT
        view = views[n_ids - len(a_prompt)]  # the context once ids[:n_ids] are fed
        assert toks == view[pos[0] : pos[-1] + 1] and pos == list(range(pos[0], pos[-1] + 1))
        if len(toks) > 1 and n_ids > len(a_prompt):
            resumed += 1
            assert pos[-1] == len(view) - 1  # the whole shifted context, nothing beyond
            assert a_run[: len(view)] != view  # ... which is not the original token run
    assert resumed >= 1


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"n_keep": -1}, r"n_keep must be an integer >= 0, got -1"),
        ({"n_keep": 1.5}, r"n_keep must be an integer >= 0, got 1\.5"),
        ({"n_keep": True}, r"n_keep must be an integer >= 0, got True"),
        ({"n_keep": LIMIT}, rf"n_keep must be < ctx_size={LIMIT}, got {LIMIT}"),
        ({"n_keep": 1000, "context_shift": False}, rf"n_keep must be < ctx_size={LIMIT}"),
        ({"context_shift": "yes"}, r"context_shift must be True or False, got 'yes'"),
    ],
)
def test_bad_context_shift_options_raise_before_anything_is_queued(
    served: Model, kw: dict[str, Any], match: str
) -> None:
    with Engine(served, parallel=2, ctx_size=LIMIT, context_shift=True) as engine:
        before = engine.stats()
        with pytest.raises(ValueError, match=match):
            engine.generate("Hello", max_tokens=4, **kw)
        with pytest.raises(ValueError, match=match):
            engine.stream("Hello", max_tokens=4, **kw)
        with pytest.raises(ValueError, match=match):
            engine.chat([{"role": "user", "content": "Hello"}], max_tokens=4, **kw)

        async def main() -> None:
            with pytest.raises(ValueError, match=match):
                await engine.agenerate("Hello", max_tokens=4, **kw)

        asyncio.run(main())
        after = engine.stats()
        assert (after["prompt_tokens"], after["waiting"]) == (before["prompt_tokens"], 0)


def test_the_largest_n_keep_still_shifts(served: Model) -> None:
    """n_keep = limit - 1 is valid: a shift keeps at most limit - 4 tokens (llama.cpp's cap),
    so each one frees two."""
    with Engine(served, parallel=2, ctx_size=LIMIT, context_shift=True) as engine:
        r = engine.generate(PROMPT, max_tokens=80, ignore_eos=True, n_keep=LIMIT - 1)
    assert (r.finish_reason, len(r.tokens)) == ("length", 80)
