"""Tests for kvserve.Engine (python/kvserve/engine/): continuous batching behind a sync and an
asyncio API.

The oracle is plain sequential generation: ``Model.generate`` on a separate ``Model`` of the same
file (its own K/V memory), one request at a time. Batching, chunked prefill, prefix reuse and
preemption must not change what a request generates.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from sampling_reference import ref_log_softmax

import kvserve
from kvserve import Engine, GenerateResult, KvCacheFull, Model
from kvserve.engine import Delta, parse_size

STATS_KEYS = {
    "kv_blocks_total",
    "kv_blocks_used",
    "kv_blocks_cached",
    "kv_bytes_used",
    "kv_usage",
    "prompt_tokens",
    "cached_prompt_tokens",
    "prefix_hit_rate",
    "generated_tokens",
    "computed_tokens",
    "evictions",
    "preemptions",
    "running",
    "waiting",
    "sessions",
    "session_misses",
    "kv_blocks_evicted",
    "decode_tok_s",
    "model_repacked_bytes",
    "prefix_hit_rate_recent",
    "cached_prompt_tokens_session",
    "cached_prompt_tokens_prefix",
    "prefix_lookups",
    "prefix_hit_tokens",
    "prefix_blocks_shared",
    "prefix_blocks_indexed",
    "failed_requests",
    "cancelled_requests",
    "decode_retries",
    "context_resets",
    # the K/V disk tier (zeros without one)
    "kv_disk_enabled",
    "kv_disk_hit_blocks",
    "kv_disk_hit_tokens",
    "kv_disk_misses",
    "kv_disk_bytes_read",
    "kv_disk_bytes_written",
    "kv_disk_writes",
    "kv_disk_writes_dropped",
    "kv_disk_removed",
    "kv_disk_evicted",
    "kv_disk_skipped",
    "kv_disk_entries",
    "kv_disk_loaded",
    "kv_disk_queued",
    "kv_disk_bytes",
    "kv_disk_bytes_max",
    "kv_disk_read_seconds",
    "kv_disk_read_latency_s",
    # the shared K/V tier (zeros without one)
    "kv_remote_enabled",
    "kv_remote_down",
    "kv_remote_fetches",
    "kv_remote_fetched_blocks",
    "kv_remote_hit_blocks",
    "kv_remote_hit_tokens",
    "kv_remote_misses",
    "kv_remote_invalid",
    "kv_remote_lost",
    "kv_remote_bytes_read",
    "kv_remote_bytes_written",
    "kv_remote_writes",
    "kv_remote_writes_existing",
    "kv_remote_writes_dropped",
    "kv_remote_errors",
    "kv_remote_skipped_short",
    "kv_remote_skipped_down",
    "kv_remote_skipped_full",
    "kv_remote_staged_bytes",
    "kv_remote_queued",
    "kv_remote_fetch_seconds",
    "kv_remote_fetch_latency_s",
    # structured output
    "grammar_compiles",
    "grammar_compile_seconds",
    "grammar_cache_hits",
    "grammar_masks",
    "grammar_mask_seconds",
    "grammar_mask_wait_seconds",
}

SUBJECTS = ["cats", "rivers", "bread", "winter", "trains", "music", "gardens", "the moon"]


def prompts(n: int, tag: str) -> list[str]:
    """``n`` distinct short prompts (distinct first blocks too, so each is its own work)."""
    return [f"{tag} {i}: three facts about {SUBJECTS[i % len(SUBJECTS)]} are" for i in range(n)]


@pytest.fixture(scope="module")
def oracle(model_path: Path) -> Model:
    return Model.load(model_path, threads=2)


@pytest.fixture(scope="module")
def served(model_path: Path) -> Model:
    """The engines' model: a separate Model, so its K/V memory is not the oracle's."""
    return Model.load(model_path, threads=2)


@pytest.fixture(scope="module")
def engine(served: Model) -> Iterator[Engine]:
    with Engine(served, parallel=16, ctx_size=512, batch_tokens=256) as e:
        yield e


_ORACLE: dict[tuple[Any, ...], GenerateResult] = {}


def sequential(oracle: Model, prompt: str, max_tokens: int, **kw: object) -> GenerateResult:
    key = (prompt, max_tokens, tuple(sorted(kw.items())))
    if key not in _ORACLE:
        _ORACLE[key] = oracle.generate(prompt, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return _ORACLE[key]


def wait_for(cond: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def until(cond: Any, timeout: float = 60.0) -> None:
    """Waits (on the event loop) for ``cond()``; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


def test_exported_and_stats_keys(engine: Engine) -> None:
    assert "Engine" in kvserve.__all__ and kvserve.Engine is Engine
    st = engine.stats()
    # SmolLM2 has one layer group (full attention, all 30 layers), reported as kv_full_*.
    group_keys = {
        f"kv_full_{k}"
        for k in (
            "layers",
            "blocks_total",
            "blocks_used",
            "blocks_cached",
            "bytes_used",
            "bytes_total",
            "usage",
        )
    }
    assert set(st) == STATS_KEYS | group_keys
    assert st["kv_blocks_total"] > 0 and 0.0 <= st["kv_usage"] <= 1.0
    assert st["kv_full_layers"] == 30 and st["kv_full_blocks_total"] == st["kv_blocks_total"]


def test_async_streams_and_sync_threads_share_batches_and_match_sequential_greedy(
    engine: Engine, oracle: Model
) -> None:
    n_tok = 6
    async_prompts = prompts(32, "Stream")
    sync_prompts = prompts(8, "Thread")
    want = {p: sequential(oracle, p, n_tok) for p in async_prompts + sync_prompts}
    assert any(w.finish_reason == "length" for w in want.values())

    sync_out: dict[str, GenerateResult] = {}

    def caller(p: str) -> None:
        sync_out[p] = engine.generate(p, max_tokens=n_tok)

    async def one_stream(p: str) -> str:
        return "".join([piece async for piece in engine.stream(p, max_tokens=n_tok)])

    async def main() -> tuple[list[str], float]:
        threads = [threading.Thread(target=caller, args=(p,)) for p in sync_prompts]
        for t in threads:
            t.start()
        peak = 0.0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, engine.stats()["running"])
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        texts = await asyncio.gather(*[one_stream(p) for p in async_prompts])
        for t in threads:
            await asyncio.get_running_loop().run_in_executor(None, t.join)
        watcher.cancel()
        return texts, peak

    texts, peak = asyncio.run(main())
    assert texts == [want[p].text for p in async_prompts]
    for p in sync_prompts:
        got, exp = sync_out[p], want[p]
        assert (got.tokens, got.text, got.finish_reason) == (
            exp.tokens,
            exp.text,
            exp.finish_reason,
        )
        assert got.prompt_tokens == exp.prompt_tokens
    assert peak > 1, "requests never ran together"
    st = engine.stats()
    assert (st["running"], st["waiting"], st["kv_blocks_used"]) == (0, 0, 0)


def test_agenerate_matches_generate(engine: Engine, oracle: Model) -> None:
    p = prompts(1, "Async")[0]

    async def main() -> GenerateResult:
        return await engine.agenerate(p, max_tokens=5)

    got = asyncio.run(main())
    assert got == sequential(oracle, p, 5)


def test_events_stream_pieces_then_the_result(engine: Engine, oracle: Model) -> None:
    """``events`` yields the text pieces, then the GenerateResult (what generate returns);
    a prompt of token ids is fed as it is."""
    p = prompts(1, "Events")[0]
    want = sequential(oracle, p, 6)
    ids = oracle.tokenize(p, add_special=True, parse_special=True)

    async def main(prompt: str | list[int]) -> list[str | GenerateResult]:
        return [item async for item in engine.events(prompt, max_tokens=6)]

    for prompt in (p, ids):
        *pieces, result = asyncio.run(main(prompt))
        assert all(isinstance(x, str) and x for x in pieces)
        assert "".join(pieces) == want.text  # type: ignore[arg-type]
        assert isinstance(result, GenerateResult)
        assert (result.text, result.tokens, result.finish_reason, result.prompt_tokens) == (
            want.text,
            want.tokens,
            want.finish_reason,
            want.prompt_tokens,
        )


@pytest.mark.parametrize(
    ("ids", "match"),
    [([], "no tokens"), ([1, -1], "prompt token 1 is -1"), ([10**9], "prompt token 0 is")],
)
def test_events_check_token_id_prompts(engine: Engine, ids: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        engine.events(ids, max_tokens=2)


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(
    engine: Engine, oracle: Model
) -> None:
    p = "Once upon a time, in a quiet town,"
    kw = {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "seed": 11}
    alone = engine.generate(p, max_tokens=10, **kw)  # type: ignore[arg-type]
    # The same seed in plain sequential generation draws the same tokens.
    assert alone.tokens == sequential(oracle, p, 10, **kw).tokens
    others = prompts(6, "Busy")

    async def main() -> list[GenerateResult]:
        jobs = [
            engine.agenerate(q, max_tokens=8, temperature=0.8, seed=i) for i, q in enumerate(others)
        ]
        jobs.insert(3, engine.agenerate(p, max_tokens=10, **kw))  # type: ignore[arg-type]
        return await asyncio.gather(*jobs)

    busy = asyncio.run(main())
    assert busy[3] == alone
    greedy = engine.generate(p, max_tokens=10)
    assert alone.tokens != greedy.tokens  # the precondition: sampling took effect


def test_min_p_one_keeps_only_the_best_token(engine: Engine, oracle: Model) -> None:
    # min_p = 1 keeps exactly the tokens as probable as the best one: greedy (no exact ties).
    p = prompts(1, "MinP")[0]
    got = engine.generate(p, max_tokens=6, temperature=1.5, min_p=1.0, seed=5)
    assert got.tokens == sequential(oracle, p, 6).tokens


def test_a_pool_too_small_for_everyone_preempts_and_every_request_completes(
    model_path: Path, oracle: Model
) -> None:
    n_tok = 12
    ps = [f"Story {i}: the {SUBJECTS[i % 8]} and the old lighthouse keeper" for i in range(16)]
    want = [sequential(oracle, p, n_tok) for p in ps]
    lengths = [len(oracle.tokenize(p, add_special=True, parse_special=True)) for p in ps]
    # Every request needs two 16-token blocks at its end: 16 of them need 32 blocks.
    assert all(n < 16 < n + len(w.tokens) for n, w in zip(lengths, want, strict=True))
    per_block = int(oracle.new_context(16).stats()["bytes_per_block"])
    small = Model.load(model_path, threads=2)  # a fresh model: the pool is made at our size
    with Engine(small, parallel=16, ctx_size=64, kv_memory=9 * per_block) as eng:
        assert eng.stats()["kv_blocks_total"] == 9

        async def main() -> list[GenerateResult]:
            return await asyncio.gather(*[eng.agenerate(p, max_tokens=n_tok) for p in ps])

        got = asyncio.run(main())
        st = eng.stats()
    assert [(g.tokens, g.text, g.finish_reason) for g in got] == [
        (w.tokens, w.text, w.finish_reason) for w in want
    ]
    assert st["preemptions"] > 0
    assert (st["running"], st["waiting"], st["kv_blocks_used"]) == (0, 0, 0)


def test_the_pool_bounds_one_sequence(model_path: Path, oracle: Model) -> None:
    per_block = int(oracle.new_context(16).stats()["bytes_per_block"])
    small = Model.load(model_path, threads=2)
    with Engine(small, parallel=2, ctx_size=4096, kv_memory=2 * per_block) as eng:
        # The prompt is longer than the 32 tokens the pool holds: rejected up front.
        with pytest.raises(ValueError, match="32 tokens"):
            eng.generate("word " * 40, max_tokens=4)
        # A prompt that fits but whose output would outgrow the pool ends at the pool's limit.
        r = eng.generate("Count: one two three four five six", max_tokens=40, ignore_eos=True)
        assert r.finish_reason == "context"
        assert r.prompt_tokens + len(r.tokens) == 33
    assert issubclass(KvCacheFull, RuntimeError)


def test_cancellation_frees_the_blocks(engine: Engine) -> None:
    base = engine.stats()["kv_blocks_used"]
    generated = engine.stats()["generated_tokens"]
    long_prompt = "In the beginning there was a long road across the hills. " * 6

    async def main() -> None:
        # An async stream closed early.
        it = engine.stream(long_prompt, max_tokens=200, ignore_eos=True)
        got = []
        async for piece in it:
            got.append(piece)
            if len(got) == 2:
                break
        await it.aclose()
        # A stream left by `break` without aclose(): asyncio's finalizer closes it.
        async for _piece in engine.stream(long_prompt + "?", max_tokens=200, ignore_eos=True):
            break
        await until(lambda: engine.stats()["running"] == 0)
        # A task cancelled while it runs.
        task = asyncio.ensure_future(
            engine.agenerate(long_prompt + "!", max_tokens=200, ignore_eos=True)
        )
        await until(lambda: engine.stats()["running"] and engine.stats()["kv_blocks_used"] > base)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_for(lambda: engine.stats()["running"] == 0)
    st = engine.stats()
    assert (st["kv_blocks_used"], st["waiting"]) == (base, 0)
    assert st["generated_tokens"] - generated < 200  # none of the three ran to its end


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"max_tokens": -1}, "max_tokens must be >= 0"),
        ({"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
        ({"prompt": "word " * 600}, "ctx_size=512"),
        ({"typical_p": 0.0}, r"typical_p must be in \(0, 1\]"),
        ({"typical_p": 2.0}, r"typical_p must be in \(0, 1\]"),
        ({"repeat_penalty": -1.0}, "repeat_penalty must be a finite number > 0"),
        ({"repeat_penalty": 0.0}, "repeat_penalty must be a finite number > 0"),
        ({"presence_penalty": -2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": 9.0}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"penalty_last_n": -5}, "penalty_last_n must be an integer >= -1"),
        ({"logprobs": -1}, r"logprobs must be an integer in \[0, 20\]"),
        ({"logprobs": 50}, r"logprobs must be an integer in \[0, 20\]"),
        ({"logit_bias": {7: float("nan")}}, r"logit_bias\[7\] must be a finite number or -inf"),
        ({"logit_bias": {7: float("inf")}}, r"logit_bias\[7\] must be a finite number or -inf"),
        ({"logit_bias": {-7: 1.0}}, "logit_bias keys must be token ids >= 0"),
        ({"logit_bias": {10**6: 1.0}}, "logit_bias token id 1000000 is out of range"),
    ],
)
def test_bad_arguments_raise_before_anything_is_queued(
    engine: Engine, kw: dict[str, object], match: str
) -> None:
    before = engine.stats()
    args = {"prompt": "Hello", "max_tokens": 4, **kw}
    with pytest.raises(ValueError, match=match):
        engine.generate(**args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        engine.stream(**args)  # type: ignore[arg-type]  # at the call, not at iteration

    async def main() -> None:
        with pytest.raises(ValueError, match=match):
            await engine.agenerate(**args)  # type: ignore[arg-type]

    asyncio.run(main())
    after = engine.stats()
    assert (after["prompt_tokens"], after["waiting"]) == (before["prompt_tokens"], 0)


def test_bad_engine_arguments(served: Model) -> None:
    for kw, match in (
        ({"parallel": 0}, "parallel must be >= 1"),
        ({"ctx_size": 0}, "ctx_size must be >= 1"),
        ({"batch_tokens": 0}, "batch_tokens must be >= 1"),
        ({"kv_memory": "lots"}, "kv_memory must be"),
        ({"kv_memory": -1}, "kv_memory must be > 0"),
        ({"threads": 2}, "threads applies only"),
    ):
        with pytest.raises(ValueError, match=match):
            Engine(served, **kw)  # type: ignore[arg-type]


def test_the_step_log_holds_every_computed_batch(
    served: Model, oracle: Model, tmp_path: Path
) -> None:
    """``Engine(step_log=PATH)``: one JSON line per computed batch, appended. Checked against a
    model of the steps: two requests run together with 48-token prompt steps; each request's
    rows, in log order, tile its prompt and then its fed-back tokens (every generated token
    but the last) exactly once, a step's prompt rows hold at most 48 tokens, ``decode``
    counts the generated rows, the steps do not overlap and lie within the run, and the
    lines' tokens sum to the engine's ``computed_tokens``. A path that cannot be opened is an
    error before the model loads."""
    path = tmp_path / "steps.jsonl"
    path.write_text("earlier\n")
    texts = [
        "Steps of the mill: " + "the wheel turns and the stone grinds the grain. " * 14,
        "Tides of the bay: " + "the water rises over the rocks and falls again. " * 9,
    ]
    n_prompt = [len(oracle.tokenize(t, add_special=True, parse_special=True)) for t in texts]
    assert n_prompt[0] != n_prompt[1] and min(n_prompt) > 2 * 48  # several steps each
    n_gen = 6
    t0 = time.monotonic()
    with Engine(served, parallel=4, ctx_size=512, batch_tokens=48, prefix_cache=False,
                step_log=path) as eng:  # fmt: skip

        async def main() -> list[GenerateResult]:
            return list(
                await asyncio.gather(
                    *(eng.agenerate(t, max_tokens=n_gen, ignore_eos=True) for t in texts)
                )
            )

        got = asyncio.run(main())
        computed = eng.stats()["computed_tokens"]
    t1 = time.monotonic()
    first, *lines = path.read_text().splitlines()
    assert first == "earlier"  # appended, not truncated
    steps = [json.loads(line) for line in lines]
    assert sum(st["tokens"] for st in steps) == computed == sum(n_prompt) + 2 * (n_gen - 1)
    for r in got:
        assert len(r.tokens) == n_gen
    # Each request's rows, by arrival number (the one with the longer prompt has more rows).
    rows: dict[int, list[tuple[int, int]]] = {}
    for st in steps:
        assert st["tokens"] == sum(n for _, _, n in st["rows"])
        for arrival, at, n in st["rows"]:
            rows.setdefault(arrival, []).append((at, n))
    assert len(rows) == 2
    by_length = {sum(n for _, n in rs) - (n_gen - 1): arrival for arrival, rs in rows.items()}
    assert sorted(by_length) == sorted(n_prompt)
    for np_ in n_prompt:
        ranges = rows[by_length[np_]]
        at = 0
        for start, n in ranges:  # contiguous, in order, once
            assert start == at and n >= 1
            at += n
        assert at == np_ + n_gen - 1
        assert all(n == 1 for start, n in ranges if start >= np_)  # fed back one at a time
    for st in steps:
        length = {by_length[np_]: np_ for np_ in n_prompt}
        prompt = sum(n for a, at, n in st["rows"] if at < length[a])
        assert prompt <= 48
        assert st["decode"] == sum(1 for a, at, _ in st["rows"] if at >= length[a])
    assert t0 <= steps[0]["t"] and steps[-1]["t"] + steps[-1]["s"] <= t1
    for a, b in pairwise(steps):
        assert a["s"] > 0 and b["t"] >= a["t"] + a["s"] - 1e-6  # one batch at a time
    with pytest.raises(FileNotFoundError, match="missing"):  # the log's path, not the model's
        Engine("no-such-model.gguf", step_log=tmp_path / "missing" / "steps.jsonl")


class _SlowFile:
    """A file whose writes wait for ``go`` (a stalled disk), or fail (``fail``)."""

    def __init__(self, fail: bool = False) -> None:
        self.go = threading.Event()
        self.lines: list[str] = []
        self.fail = fail
        self.closed = False

    def write(self, text: str) -> int:
        if self.fail:
            raise OSError("disk gone")
        self.go.wait()
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _plan(arrival: int, first: int, n: int, generated: int = 0) -> list[Any]:
    return [(SimpleNamespace(key=(0, arrival), n_generated=generated), first, n, True)]


def test_a_stalled_step_log_never_holds_up_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The step log's writer runs beside the engine: with its disk stalled, ``write`` still
    returns at once; past ``MAX_QUEUED`` queued steps the rest are left out and counted; once
    the disk moves, closing writes the queued steps in order. A failing disk ends the log
    (later steps ignored) without an error to the engine, and a writer stuck for good costs
    closing at most ``CLOSE_WAIT_S`` seconds per wait."""
    from kvserve.engine import steplog

    monkeypatch.setattr(steplog, "MAX_QUEUED", 2)
    monkeypatch.setattr(steplog, "CLOSE_WAIT_S", 0.3)
    sl = steplog.StepLog(tmp_path / "a.jsonl")
    slow = _SlowFile()
    sl._file.close()  # the real file, replaced by the stand-in
    sl._file = slow  # type: ignore[assignment]
    t0 = time.monotonic()
    sl.write(1.0, 0.5, _plan(3, 0, 64))  # taken by the writer, which stalls on it
    wait_for(lambda: sl._queue.empty())
    for i in range(5):  # two fit in the queue, three are left out
        # The prompt's last token alone (not a generated one), then generated tokens.
        sl.write(2.0 + i, 0.1, _plan(3, 64 + i, 1, generated=i))
    assert time.monotonic() - t0 < 5  # never waited for the disk
    assert sl.dropped == 3
    slow.go.set()
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        sl.close()
    got = [json.loads(line) for line in slow.lines]
    assert [g["t"] for g in got] == [1.0, 2.0, 3.0]
    assert got[0] == {"t": 1.0, "s": 0.5, "tokens": 64, "decode": 0, "rows": [[3, 0, 64]]}
    assert (got[1]["tokens"], got[1]["decode"], got[2]["decode"]) == (1, 0, 1)
    assert slow.closed and "left out 3 steps" in caplog.text
    sl.write(9.0, 0.1, _plan(3, 200, 1, generated=9))  # after close: ignored
    assert len(slow.lines) == 3

    failing = steplog.StepLog(tmp_path / "b.jsonl")
    bad = _SlowFile(fail=True)
    failing._file.close()  # the real file, replaced by the stand-in
    failing._file = bad  # type: ignore[assignment]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        failing.write(1.0, 0.1, _plan(1, 0, 8))
        wait_for(lambda: not failing._open)
        failing.write(2.0, 0.1, _plan(1, 8, 1))  # ignored: the log ended
        failing.close()
    assert "disk gone" in caplog.text and bad.closed and failing._queue.empty()

    stuck = steplog.StepLog(tmp_path / "c.jsonl")
    forever = _SlowFile()
    stuck._file.close()  # the real file, replaced by the stand-in
    stuck._file = forever  # type: ignore[assignment]
    stuck.write(1.0, 0.1, _plan(1, 0, 8))
    t0 = time.monotonic()
    stuck.close()
    assert time.monotonic() - t0 < 2 * 0.3 + 1  # bounded, then the writer is left behind
    forever.go.set()  # let the daemon thread finish


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("1.5G") == 3 * 1024**3 // 2
    assert parse_size("3MB") == 3_000_000
    assert parse_size("100") == 100 and parse_size(4096) == 4096


def test_a_second_request_with_the_same_prompt_reuses_its_prefix(
    engine: Engine, oracle: Model
) -> None:
    p = "A long shared system prompt: you are a careful assistant who answers briefly. " * 3
    n = len(oracle.tokenize(p, add_special=True, parse_special=True))
    first = engine.generate(p, max_tokens=4)
    second = engine.generate(p, max_tokens=4)
    assert first.cached_tokens == 0 and first.prompt_tokens == n
    assert second.cached_tokens == (n - 1) // 16 * 16 > 0
    assert second.tokens == first.tokens == sequential(oracle, p, 4).tokens
    st = engine.stats()
    assert st["cached_prompt_tokens"] >= second.cached_tokens
    assert st["prefix_hit_rate"] == st["cached_prompt_tokens"] / st["prompt_tokens"]


def test_prefix_cache_off_computes_every_prompt(served: Model, oracle: Model) -> None:
    p = "Without a cache every request computes its whole prompt from the first token. " * 2
    with Engine(served, parallel=2, ctx_size=256, prefix_cache=False) as eng:
        runs = [eng.generate(p, max_tokens=3) for _ in range(2)]
        st = eng.stats()
    assert [r.cached_tokens for r in runs] == [0, 0] and st["cached_prompt_tokens"] == 0
    assert runs[0].tokens == runs[1].tokens == sequential(oracle, p, 3).tokens


def test_a_prompt_being_prefilled_is_not_computed_twice(served: Model, oracle: Model) -> None:
    # Two users send the same long prompt at once; with 32-token prefill chunks the first needs
    # several steps. The second waits for its blocks and maps them instead of computing them.
    system = "You are the archivist of a mountain library; answer in one short sentence. " * 3
    users = [system + "Question: what is kept here?", system + "Question: who visits?"]
    with Engine(served, parallel=4, ctx_size=512, batch_tokens=32) as eng:

        async def main() -> list[GenerateResult]:
            return await asyncio.gather(*[eng.agenerate(u, max_tokens=3) for u in users])

        t0 = time.monotonic()
        got = asyncio.run(main())
        wall = time.monotonic() - t0
        st = eng.stats()
        later = eng.generate(users[1], max_tokens=3)  # the blocks were cached before it came
    shared = len(oracle.tokenize(system, add_special=True, parse_special=True)) // 16 * 16
    assert shared >= 48
    assert got[0].cached_tokens == 0
    assert got[1].cached_tokens >= shared
    assert st["cached_prompt_tokens"] == got[1].cached_tokens
    assert [g.tokens for g in got] == [sequential(oracle, u, 3).tokens for u in users]
    # The second waited for the blocks the first computed over its 32-token steps; the first
    # waited for nobody, nor did a later request that found them cached.
    assert got[0].prefix_wait_s == 0.0
    assert 0.0 < got[1].prefix_wait_s < wall
    assert later.cached_tokens >= shared and later.prefix_wait_s == 0.0


@pytest.mark.parametrize("order", ["groups", "fcfs"])
def test_a_shared_document_is_finished_before_a_longer_private_prompt(
    served: Model, oracle: Model, order: str
) -> None:
    """A long private prompt arrives first, then four users of one shorter document, with
    64-token prefill steps. With ``prompt_order="groups"`` the document (its work shared by
    four) is computed first: each of its users has an answer before the long prompt's user;
    with ``"fcfs"`` the long prompt, which came first, is answered first. Every answer is the
    sequential one, and the document is computed once."""
    private = "Describe every room of the old house on the hill, one after another. " * 24
    doc = "Harbour report: the east wall was repaired in spring and the boats came back. " * 6
    users = [doc + f"Question {q}: what was repaired?" for q in range(4)]
    done: dict[int, float] = {}
    with Engine(served, parallel=8, ctx_size=1024, batch_tokens=64, prompt_order=order) as eng:

        async def one(i: int, prompt: str) -> GenerateResult:
            r = await eng.agenerate(prompt, max_tokens=1)
            done[i] = time.monotonic()
            return r

        async def main() -> list[GenerateResult]:
            first = asyncio.ensure_future(one(0, private))
            await asyncio.sleep(0.05)  # the private prompt is admitted first
            rest = [asyncio.ensure_future(one(1 + i, u)) for i, u in enumerate(users)]
            return list(await asyncio.gather(first, *rest))

        got = asyncio.run(main())
    n_private = len(oracle.tokenize(private, add_special=True, parse_special=True))
    n_doc = len(oracle.tokenize(doc, add_special=True, parse_special=True))
    assert n_private > 3 * n_doc > 3 * 64  # several steps each, the private one the longest
    if order == "groups":
        assert max(done[i] for i in range(1, 5)) < done[0]
    else:
        assert done[0] < min(done[i] for i in range(1, 5))
    assert sum(g.cached_tokens > 0 for g in got[1:]) >= 3  # the document was computed once
    for g, prompt in zip(got, [private, *users], strict=True):
        assert g.tokens == sequential(oracle, prompt, 1).tokens


def test_priority_orders_admission_and_preempts(served: Model) -> None:
    """With one slot busy, a waiting request of higher priority preempts the running one (which
    resumes later and finishes with the text an unloaded run gives) and goes before an earlier
    waiting request of the running one's priority."""
    with Engine(served, parallel=1, ctx_size=256) as eng:
        alone = eng.generate("Tell me a story", max_tokens=48, ignore_eos=True)
        done: list[str] = []
        texts: dict[str, str] = {}

        async def run(name: str, prompt: str, n: int, priority: int) -> None:
            r = await eng.agenerate(prompt, max_tokens=n, ignore_eos=True, priority=priority)
            texts[name] = r.text
            done.append(name)

        async def main() -> None:
            first = asyncio.ensure_future(run("first", "Tell me a story", 48, 0))
            await until(lambda: eng.stats()["generated_tokens"] > alone_tokens)
            low = asyncio.ensure_future(run("low", "Low priority", 2, 0))
            high = asyncio.ensure_future(run("high", "High priority", 2, 5))
            await asyncio.gather(first, low, high)

        alone_tokens = eng.stats()["generated_tokens"]
        asyncio.run(main())
        assert eng.stats()["preemptions"] >= 1
    assert done == ["high", "first", "low"]
    assert texts["first"] == alone.text


def test_the_event_loop_keeps_ticking_during_a_long_prefill(served: Model) -> None:
    """One long prefill (a single decode of ~1,000 tokens) never holds the event loop: the
    longest gap between its ticks is a small part of the prefill's time (holding the GIL
    through the decode would make it the whole of it)."""
    prompt = "The history of the northern railway is long and full of detail. " * 80
    with Engine(served, parallel=4, ctx_size=2048, batch_tokens=1536) as eng:

        async def main() -> tuple[float, float, GenerateResult]:
            gaps: list[float] = []
            stop = False

            async def tick() -> None:
                last = time.monotonic()
                while not stop:
                    await asyncio.sleep(0.005)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            ticker = asyncio.ensure_future(tick())
            t0 = time.monotonic()
            result = await eng.agenerate(prompt, max_tokens=1)
            took = time.monotonic() - t0
            stop = True
            await ticker
            return max(gaps), took, result

        worst, took, result = asyncio.run(main())
    assert result.prompt_tokens > 900
    assert worst < took / 3, f"the event loop stalled {worst:.3f} s of a {took:.3f} s prefill"


def test_closed_engine_rejects_requests(served: Model) -> None:
    eng = Engine(served, parallel=2, ctx_size=64)
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate("Hello", max_tokens=2)


def test_an_unknown_option_is_a_type_error_everywhere(engine: Engine, served: Model) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument.*temprature"):
        engine.generate("Hello", max_tokens=2, temprature=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="temprature"):
        engine.stream("Hello", temprature=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="temprature"):
        served.generate("Hello", 2, temprature=0.5)  # type: ignore[call-arg]


# -- bias, penalties, logprobs ------------------------------------------------------------------
ALL_OPTIONS: dict = {
    "temperature": 0.9,
    "top_k": 60,
    "typical_p": 0.6,
    "top_p": 0.95,
    "min_p": 0.02,
    "repeat_penalty": 1.2,
    "presence_penalty": 0.3,
    "frequency_penalty": 0.2,
    "penalty_last_n": 32,
    "logit_bias": {13: -math.inf, 28: 1.5},
    "seed": 7,
    "logprobs": 3,
}


def close_logprobs(a: GenerateResult, b: GenerateResult) -> None:
    """Same tokens and pieces; log-probabilities equal up to the batch's float rounding."""
    assert a.logprobs is not None and b.logprobs is not None
    assert [(e.token, e.piece) for e in a.logprobs] == [(e.token, e.piece) for e in b.logprobs]
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert abs(x.logprob - y.logprob) < 1e-4
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_greedy_logit_bias_forces_a_token(engine: Engine, oracle: Model) -> None:
    target = oracle.tokenize(" banana", add_special=False)[0]
    p = prompts(1, "Bias")[0]
    got = engine.generate(p, max_tokens=5, logit_bias={target: 100.0})
    assert got.tokens == [target] * 5
    assert got.tokens == oracle.generate(p, 5, logit_bias={target: 100.0}).tokens


def test_every_option_gives_the_same_tokens_alone_and_in_a_batch(
    engine: Engine, oracle: Model
) -> None:
    """A seeded request with every option on gives Model.generate's tokens, alone and beside
    three other requests (plain greedy, greedy with penalties and bias, sampled): the rows of
    one step go through the batched argmax and through per-request samplers."""
    p = "Once upon a time, in a quiet town,"
    want = oracle.generate(p, 12, **ALL_OPTIONS)
    alone = engine.generate(p, max_tokens=12, **ALL_OPTIONS)
    assert (alone.tokens, alone.text, alone.finish_reason) == (
        want.tokens,
        want.text,
        want.finish_reason,
    )
    close_logprobs(alone, want)
    others = prompts(3, "Beside")
    other_kw: list[dict] = [
        {},
        {"repeat_penalty": 1.4, "logit_bias": {28: -math.inf}, "frequency_penalty": 0.5},
        {"temperature": 0.7, "seed": 1, "typical_p": 0.8},
    ]
    other_want = [oracle.generate(q, 10, **kw) for q, kw in zip(others, other_kw, strict=True)]

    async def main() -> list[GenerateResult]:
        jobs = [
            engine.agenerate(q, max_tokens=10, **kw) for q, kw in zip(others, other_kw, strict=True)
        ]
        jobs.insert(1, engine.agenerate(p, max_tokens=12, **ALL_OPTIONS))
        return await asyncio.gather(*jobs)

    busy = asyncio.run(main())
    assert busy[1].tokens == alone.tokens and busy[1].text == alone.text
    close_logprobs(busy[1], alone)
    assert [b.tokens for b in busy[:1] + busy[2:]] == [w.tokens for w in other_want]
    assert other_want[1].tokens != sequential(oracle, others[1], 10).tokens  # penalties acted
    assert want.tokens != oracle.generate(p, 12).tokens  # sampling acted


def test_logprobs_match_an_independent_decode(engine: Engine, oracle: Model) -> None:
    """Each token's logprob is the log-softmax of the logits an independent decode on the
    oracle model gives for the same tokens (1e-4); ``top`` holds N tokens, most probable
    first; for greedy the chosen token is top[0]."""
    p = prompts(1, "Logprobs")[0]
    assert engine.generate(p, max_tokens=2).logprobs is None
    for kw in ({"logprobs": 4}, {"logprobs": 2, "temperature": 1.5, "seed": 4}):
        res = engine.generate(p, max_tokens=8, ignore_eos=True, **kw)  # type: ignore[arg-type]
        n = int(kw["logprobs"])
        assert res.logprobs is not None and len(res.logprobs) == len(res.tokens) == 8
        ids = oracle.tokenize(p, add_special=True, parse_special=True) + res.tokens
        ctx = oracle.new_context(len(ids))
        logits = ctx.decode(ids, list(range(len(ids))), [0] * len(ids), [True] * len(ids))
        view = np.frombuffer(memoryview(logits), dtype=np.float32).reshape(len(ids), -1)
        k = len(ids) - len(res.tokens)
        for step, (entry, tok) in enumerate(zip(res.logprobs, res.tokens, strict=True)):
            lsm = ref_log_softmax(view[k - 1 + step])
            assert entry.token == tok and entry.piece == oracle.token_to_piece(tok)
            assert abs(entry.logprob - lsm[tok]) < 1e-4, step
            assert len(entry.top) == n
            assert all(a[1] >= b[1] for a, b in pairwise(entry.top))
            for t, lp in entry.top:
                assert abs(lp - lsm[t]) < 1e-4
            assert entry.top[0][0] == int(np.argmax(lsm))
            if "temperature" not in kw:
                assert entry.top[0][0] == tok


# -- n choices of one prompt (Engine.choices) -------------------------------------------------


def run_choices(eng: Engine, prompt: str | list[int], max_tokens: int, n: int, **kw: Any) -> Any:
    """Every delta of ``eng.choices(...)``, then each choice's joined text, logprob entries
    (None when not asked) and result."""

    async def main() -> list[Delta]:
        return [d async for d in eng.choices(prompt, max_tokens, n, **kw)]

    deltas = asyncio.run(main())
    texts = ["".join(d.text for d in deltas if d.index == j) for j in range(n)]
    entries = [
        None
        if any(d.logprobs is None for d in deltas if d.index == j)
        else [e for d in deltas if d.index == j for e in d.logprobs or []]
        for j in range(n)
    ]
    results = []
    for j in range(n):
        mine = [d for d in deltas if d.index == j]
        assert mine and mine[-1].result is not None  # the last delta carries the result
        assert all(d.result is None and d.text for d in mine[:-1])
        results.append(mine[-1].result)
    return deltas, texts, entries, results


def test_choices_compute_the_prompt_once_and_fork_it(served: Model, oracle: Model) -> None:
    """n greedy choices are each the one greedy completion; the prompt is computed once (the
    prefix cache is off, so only the fork can share it): the engine feeds the prompt plus each
    choice's generated tokens but its last, P + n (M - 1) tokens, not n P + n (M - 1)."""
    p = "In the harbour town the fishermen mend their nets and talk about the weather"
    n, m = 3, 7
    want = sequential(oracle, p, m, ignore_eos=True)
    n_prompt = want.prompt_tokens
    assert n_prompt % 16 != 0  # a partial last block: the choices copy it when they write
    with Engine(served, parallel=4, ctx_size=256, prefix_cache=False) as eng:
        before = eng.stats()
        _, texts, _, results = run_choices(eng, p, m, n, ignore_eos=True)
        st = eng.stats()
    assert texts == [want.text] * n
    assert [r.tokens for r in results] == [want.tokens] * n
    assert {(r.prompt_tokens, r.finish_reason) for r in results} == {(n_prompt, "length")}
    assert st["prompt_tokens"] - before["prompt_tokens"] == n_prompt  # counted once
    assert st["computed_tokens"] - before["computed_tokens"] == n_prompt + n * (m - 1)
    assert st["generated_tokens"] - before["generated_tokens"] == n * m
    assert (st["running"], st["waiting"], st["kv_blocks_used"]) == (0, 0, 0)


def test_seeded_choices_are_reproducible_and_choice_j_uses_seed_plus_j(engine: Engine) -> None:
    p = "Once upon a time, in a quiet town,"
    kw: dict[str, Any] = {"temperature": 1.2, "top_k": 40, "seed": 21}
    singles = [engine.generate(p, max_tokens=10, **{**kw, "seed": 21 + j}).tokens for j in range(4)]
    assert len({tuple(t) for t in singles}) > 1  # the seeds draw differently
    first = [r.tokens for r in run_choices(engine, p, 10, 4, **kw)[3]]
    again = [r.tokens for r in run_choices(engine, p, 10, 4, **kw)[3]]
    assert first == again == singles
    # Unseeded choices draw independently (four equal 10-token draws would be a broken fork).
    free = [tuple(r.tokens) for r in run_choices(engine, p, 10, 4, temperature=1.5)[3]]
    assert len(set(free)) > 1


def test_choices_stream_logprobs_with_their_text(engine: Engine, oracle: Model) -> None:
    """Each delta carries the entries of the tokens delivered since the previous one; a
    choice's entries join to its result's, and to Model.generate's (held-back stop text
    included: its tokens come in the last delta)."""
    p = prompts(1, "Logprob deltas")[0]
    want = sequential(oracle, p, 8, logprobs=2)
    assert want.logprobs is not None
    deltas, texts, entries, results = run_choices(engine, p, 8, 2, logprobs=2)
    for j in range(2):
        assert texts[j] == want.text
        assert entries[j] == results[j].logprobs
        assert [e.token for e in entries[j]] == [e.token for e in want.logprobs]
    assert any(len(d.logprobs or []) == 1 and d.text for d in deltas)  # per token, as they come
    stop = want.text[len(want.text) // 2 :][:3]
    cut = sequential(oracle, p, 8, logprobs=0, stop=stop)
    assert cut.finish_reason == "stop" and cut.logprobs is not None
    deltas, texts, entries, results = run_choices(engine, p, 8, 1, logprobs=0, stop=stop)
    assert texts[0] == cut.text
    assert [e.token for e in entries[0]] == [e.token for e in cut.logprobs]
    assert deltas[-1].logprobs  # the stop string's tokens, withheld as text, come last


def test_choices_survive_preemption(model_path: Path, oracle: Model) -> None:
    """A pool too small for every choice to grow: choices are preempted, recomputed (with
    the prompt's blocks from the prefix cache) and still give the greedy text."""
    p = "Story 3: the bread and the old lighthouse keeper"
    want = sequential(oracle, p, 20, ignore_eos=True)
    per_block = int(oracle.new_context(16).stats()["bytes_per_block"])
    small = Model.load(model_path, threads=2)
    with Engine(small, parallel=4, ctx_size=64, kv_memory=6 * per_block) as eng:
        _, texts, _, results = run_choices(eng, p, 20, 4, ignore_eos=True)
        st = eng.stats()
    assert texts == [want.text] * 4
    assert st["preemptions"] > 0
    assert (st["running"], st["waiting"], st["kv_blocks_used"]) == (0, 0, 0)


def test_closing_choices_early_cancels_every_choice(engine: Engine) -> None:
    async def main() -> None:
        stream = engine.choices(prompts(1, "Cancel fork")[0], 200, 3, ignore_eos=True)
        got = 0
        async for d in stream:
            got += d.index > 0  # a forked choice is running
            if got:
                break
        await stream.aclose()

    asyncio.run(main())
    at_close = engine.stats()["generated_tokens"]
    wait_for(lambda: engine.stats()["running"] == engine.stats()["waiting"] == 0)
    wait_for(lambda: engine.stats()["kv_blocks_used"] == 0)
    # Cancelled within a step or two: far from the 3 x 200 tokens left to generate.
    assert engine.stats()["generated_tokens"] - at_close <= 3 * 3


def test_choices_check_n(engine: Engine) -> None:
    for bad in (0, 17, True, 2.0):
        with pytest.raises(ValueError, match=r"n must be an integer in \[1, parallel=16\]"):
            engine.choices("Hi", 4, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be 1 with session_id"):
        engine.choices("Hi", 4, 2, session_id="s")


def test_a_cached_prompt_skips_the_queue_while_long_prompts_prefill(
    served: Model, oracle: Model
) -> None:
    """While a long uncached prompt takes the step's prompt budget (batch_tokens 64), a request
    whose prompt is cached but for its short tail is admitted and answered before it, and
    before a long prompt queued ahead of it (FCFS holds for prompts that cost the batch
    something); every answer is the sequential one."""
    doc = " ".join(f"Fact {i}: the keeper counts ship number {i}." for i in range(40))
    cached = doc + " Question: who counts? Answer:"
    long_a = " ".join(f"Entry {i}: the baker sells loaf {i} at dawn." for i in range(45))
    long_c = " ".join(f"Note {i}: the miller grinds sack {i} at noon." for i in range(45))
    for p in (long_a, long_c):
        assert len(oracle.tokenize(p)) > 400
    with Engine(served, parallel=4, ctx_size=2048, batch_tokens=64) as eng:
        eng.generate(doc + " Question: what is counted? Answer:", max_tokens=1)  # caches doc
        firsts: list[str] = []
        texts: dict[str, str] = {}

        async def run(name: str, prompt: str) -> None:
            out = []
            async for piece in eng.stream(prompt, max_tokens=4, temperature=0):
                if not out:
                    firsts.append(name)
                out.append(piece)
            texts[name] = "".join(out)

        async def main() -> None:
            a = asyncio.create_task(run("a", long_a))
            await until(lambda: eng.stats()["running"] >= 1)
            c = asyncio.create_task(run("c", long_c))
            await asyncio.sleep(0.01)  # c is queued first
            b = asyncio.create_task(run("b", cached))
            await asyncio.gather(a, b, c)

        asyncio.run(main())
        st = eng.stats()
    assert firsts[0] == "b", f"first tokens in order {firsts}"
    for name, p in (("a", long_a), ("b", cached), ("c", long_c)):
        assert texts[name] == sequential(oracle, p, 4, temperature=0).text, name
    assert st["running"] == 0 and st["kv_blocks_used"] == 0


def test_a_high_priority_request_gets_its_first_token_within_a_step_or_two(
    served: Model,
) -> None:
    """Every slot is busy with long low-priority streams: a high-priority request preempts one
    and has its first token while the oldest stream (not the victim) gets at most a few
    tokens, i.e. within about one step plus its own short prefill (without preemption it
    would wait for a stream to end: ~200 of its tokens)."""
    with Engine(served, parallel=4, ctx_size=512) as eng:
        counts = [0] * 4
        seen_at_first: list[int] = []

        async def low(i: int) -> None:
            async for _ in eng.stream(f"Low {i}: a long story", max_tokens=200, ignore_eos=True):
                counts[i] += 1

        async def main() -> None:
            tasks = [asyncio.ensure_future(low(i)) for i in range(4)]
            await until(lambda: min(counts) >= 2)
            before = counts[0]
            async for _ in eng.stream("Urgent:", max_tokens=4, priority=10):
                if not seen_at_first:
                    seen_at_first.append(counts[0] - before)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(main())
        assert eng.stats()["preemptions"] >= 1
    assert seen_at_first and seen_at_first[0] <= 3, seen_at_first
