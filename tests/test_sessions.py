"""Tests for sessions in kvserve.Engine (python/kvserve/engine/, python/kvserve/sessions.py)
and the core's sequence state read/write through the binding.

Oracles: plain sequential ``Model.generate`` on a separate ``Model`` of the same file (its own
K/V memory) over the concatenated conversation text; the tokenizer's own tokenization of that
text (checked to equal the session's tokens, so the comparison is meaningful); the ``gguf``
package for the patched model files; byte-level file contents for the atomic-save checks.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader

import kvserve
import kvserve.sessions
from kvserve import Engine, KvCacheFull, Model, SessionFileError
from kvserve.options import PRIORITY_MAX, PRIORITY_MIN
from kvserve.sessions import FILE_MAGIC, check_header, read_session_file, write_session_file

P1 = "The capital of France is"
P2 = " And the capital of Italy is"
P3 = " What about Spain? The capital of Spain is"


def _patched(src: Path, dst: Path, key: bytes, value_at: int, value: int) -> Path:
    """A copy of the GGUF ``src`` with one byte of metadata ``key``'s value set (``value_at``:
    bytes after the key name)."""
    shutil.copyfile(src, dst)
    data = bytearray(dst.read_bytes())
    at = data.index(key) + len(key) + value_at
    data[at] = value
    dst.write_bytes(bytes(data))
    return dst


@pytest.fixture(scope="module")
def bos_model_path(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test model with ``tokenizer.ggml.add_bos_token`` set: prompts start with BOS, so a
    session's continuation must not get a second one. Another model identity too."""
    dst = tmp_path_factory.mktemp("models") / "bos.gguf"
    # The bool value follows the key name and its u32 type.
    _patched(model_path, dst, b"tokenizer.ggml.add_bos_token", 4, 1)
    field = GGUFReader(dst).fields["tokenizer.ggml.add_bos_token"]
    assert bool(field.parts[field.data[0]][0]) is True
    return dst


@pytest.fixture(scope="module")
def oracle(model_path: Path) -> Model:
    return Model.load(model_path, threads=2)


@pytest.fixture(scope="module")
def bos_oracle(bos_model_path: Path) -> Model:
    return Model.load(bos_model_path, threads=2)


@pytest.fixture()
def engine(model_path: Path) -> Iterator[Engine]:
    with Engine(Model.load(model_path, threads=2), parallel=4, ctx_size=512) as e:
        yield e


def tok(model: Model, text: str, first: bool = True) -> list[int]:
    return model.tokenize(text, add_special=first, parse_special=True)


def wait_for(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def check_continuation(oracle: Model, r1: Any, prompt1: str, prompt2: str) -> list[int]:
    """The tokens of the conversation as one text, checked to equal the session's tokens
    (first prompt, its output, the continuation without BOS): then a fresh generate on that
    text is the oracle for the session's turn."""
    full = tok(oracle, prompt1 + r1.text + prompt2)
    session = tok(oracle, prompt1) + r1.tokens + tok(oracle, prompt2, first=False)
    assert full == session, "test texts must tokenize the same whole and in turns"
    return full


@pytest.mark.parametrize("which", ["default", "bos"])
def test_a_follow_up_turn_reuses_the_session_and_matches_a_fresh_generate(
    which: str, model_path: Path, bos_model_path: Path, oracle: Model, bos_oracle: Model
) -> None:
    path, ref = (model_path, oracle) if which == "default" else (bos_model_path, bos_oracle)
    with Engine(Model.load(path, threads=2), parallel=4, ctx_size=512) as e:
        r1 = e.generate(P1, max_tokens=8, session_id="s")
        r2 = e.generate(P2, max_tokens=8, session_id="s")
        full = check_continuation(ref, r1, P1, P2)
        assert r2.prompt_tokens == len(full)
        # Everything turn 1 had (prompt and output) was reused; only P2 was computed.
        assert r2.cached_tokens == r1.prompt_tokens + len(r1.tokens)
        want = ref.generate(P1 + r1.text + P2, max_tokens=8)
        assert (r2.tokens, r2.text, r2.finish_reason) == (
            want.tokens,
            want.text,
            want.finish_reason,
        )
        (info,) = e.sessions()
        assert (info.id, info.tokens, info.resident, info.busy) == (
            "s",
            len(full) + len(r2.tokens),
            True,
            False,
        )
        # A request without the session is not affected by it.
        plain = e.generate(P2, max_tokens=8)
        assert plain.tokens == ref.generate(P2, max_tokens=8).tokens
        assert e.stats()["sessions"] == 1


def test_a_chat_session_reuses_the_longest_prefix_it_holds(engine: Engine, oracle: Model) -> None:
    first = [{"role": "user", "content": "Name a fruit."}]
    r1 = engine.chat(first, max_tokens=8, session_id="chat")
    second = [
        *first,
        {"role": "assistant", "content": r1.text},
        {"role": "user", "content": "And a vegetable?"},
    ]
    r2 = engine.chat(second, max_tokens=8, session_id="chat")
    held = oracle.tokenize_chat(first) + r1.tokens  # what the session holds after turn 1
    rendered = oracle.tokenize_chat(second)
    common = next(
        (i for i, (a, b) in enumerate(zip(held, rendered, strict=False)) if a != b),
        min(len(held), len(rendered)),
    )
    assert common >= len(oracle.tokenize_chat(first)), "the conversation starts the same"
    assert (r2.prompt_tokens, r2.cached_tokens) == (len(rendered), min(common, len(rendered) - 1))
    want = oracle.chat(second, max_tokens=8)
    assert (r2.tokens, r2.text) == (want.tokens, want.text)
    (info,) = engine.sessions()
    assert info.tokens == len(rendered) + len(r2.tokens)


def test_two_requests_on_one_session_run_one_after_the_other(engine: Engine, oracle: Model) -> None:
    async def main() -> list[Any]:
        first = asyncio.ensure_future(engine.agenerate(P1, max_tokens=8, session_id="c"))
        await asyncio.sleep(0)  # submitted first
        second = asyncio.ensure_future(engine.agenerate(P2, max_tokens=8, session_id="c"))
        return list(await asyncio.wait_for(asyncio.gather(first, second), 120))

    r1, r2 = asyncio.run(main())
    full = check_continuation(oracle, r1, P1, P2)
    # The second continued the first: it saw the whole first turn.
    assert r2.prompt_tokens == len(full)
    assert r2.cached_tokens == r1.prompt_tokens + len(r1.tokens)
    assert r2.tokens == oracle.generate(P1 + r1.text + P2, max_tokens=8).tokens


def test_an_evicted_session_is_recomputed_and_answers_the_same(
    model_path: Path, oracle: Model
) -> None:
    per_block = int(oracle.new_context(16).stats()["bytes_per_block"])
    # 12 blocks; the session's 13 tokens hold 1 (8%, below the high mark), another request
    # holds 2 more (25%, above it): the idle session goes at that request's first step.
    with Engine(
        Model.load(model_path, threads=2),
        parallel=2,
        ctx_size=128,
        kv_memory=12 * per_block,
        kv_high_watermark=0.15,
        kv_low_watermark=0.1,
    ) as e:
        r1 = e.generate(P1, max_tokens=8, session_id="a")
        assert e.sessions()[0].resident and e.stats()["evictions"] == 0
        e.generate("Once upon a time there was a small village by the sea", max_tokens=8)
        st = e.stats()
        assert st["evictions"] == 1 and st["session_misses"] == 0
        assert not e.sessions()[0].resident
        r2 = e.generate(P2, max_tokens=8, session_id="a")
        check_continuation(oracle, r1, P1, P2)
        assert r2.tokens == oracle.generate(P1 + r1.text + P2, max_tokens=8).tokens
        # Recomputed, reusing only whole cached blocks of it (the prefix index).
        assert r2.cached_tokens < r1.prompt_tokens + len(r1.tokens)
        assert e.stats()["session_misses"] == 1


def test_idle_sessions_go_before_a_running_request_is_short(
    model_path: Path, oracle: Model
) -> None:
    per_block = int(oracle.new_context(16).stats()["bytes_per_block"])
    long_prompt = "In the beginning there was a long road across the hills. " * 5
    n_long = len(tok(oracle, long_prompt))
    # 6 blocks: the session holds 2; the long request needs 6 -> only by evicting the session.
    assert 4 * 16 < n_long + 16 <= 6 * 16
    with Engine(
        Model.load(model_path, threads=2),
        parallel=2,
        ctx_size=256,
        kv_memory=6 * per_block,
        kv_high_watermark=1.0,  # the watermark never evicts here
        kv_low_watermark=1.0,
    ) as e:
        e.generate("word " * 20, max_tokens=4, session_id="idle")
        assert e.stats()["kv_blocks_used"] == 2
        r = e.generate(long_prompt, max_tokens=16, ignore_eos=True)
        st = e.stats()
    assert r.tokens == oracle.generate(long_prompt, max_tokens=16, ignore_eos=True).tokens
    assert (st["evictions"], st["preemptions"]) == (1, 0)


def test_sessions_under_a_pool_too_small_for_all_answer_as_alone(
    model_path: Path, oracle: Model
) -> None:
    """Six conversations of two turns at once in a pool that holds about three: sessions are
    evicted and turns preempted, and every turn gives the greedy output of the whole
    conversation text generated alone."""
    subjects = ["cats", "rivers", "bread", "winter", "trains", "music"]
    firsts = [f"Story {i}: the {w} and the old lighthouse keeper" for i, w in enumerate(subjects)]
    per_block = int(oracle.new_context(16).stats()["bytes_per_block"])
    with Engine(
        Model.load(model_path, threads=2),
        parallel=4,
        ctx_size=64,
        kv_memory=8 * per_block,
    ) as e:

        async def conversation(i: int) -> tuple[Any, Any]:
            r1 = await e.agenerate(firsts[i], max_tokens=8, session_id=f"s{i}")
            r2 = await e.agenerate(P2, max_tokens=8, session_id=f"s{i}")
            return r1, r2

        async def main() -> list[tuple[Any, Any]]:
            jobs = [conversation(i) for i in range(len(firsts))]
            return list(await asyncio.wait_for(asyncio.gather(*jobs), 300))

        got = asyncio.run(main())
        wait_for(lambda: e.stats()["running"] == 0)  # the last turn's closing step
        st = e.stats()
    for first, (r1, r2) in zip(firsts, got, strict=True):
        assert r1.tokens == oracle.generate(first, max_tokens=8).tokens
        check_continuation(oracle, r1, first, P2)
        assert r2.tokens == oracle.generate(first + r1.text + P2, max_tokens=8).tokens
    assert st["evictions"] > 0 and st["preemptions"] > 0, st
    assert st["kv_blocks_evicted"] > 0  # cached blocks were taken for new content
    assert (st["waiting"], st["sessions"]) == (0, len(firsts))


def test_an_idle_session_expires_after_its_ttl(model_path: Path, oracle: Model) -> None:
    with Engine(Model.load(model_path, threads=2), parallel=2, ctx_size=256, session_ttl=1.0) as e:
        base = e.stats()["kv_blocks_used"]
        e.generate(P1, max_tokens=8, session_id="t")
        assert e.stats()["sessions"] == 1 and e.stats()["kv_blocks_used"] > base
        # The engine thread wakes for the expiry by itself (no request arrives meanwhile).
        wait_for(lambda: e.stats()["sessions"] == 0, timeout=30)
        assert e.stats()["kv_blocks_used"] == base
        assert e.sessions() == []
        # The id now starts a new session: the prompt alone, with nothing reused.
        r = e.generate(P2, max_tokens=4, session_id="t")
        assert r.prompt_tokens == len(tok(oracle, P2))


def test_a_busy_session_never_expires(model_path: Path) -> None:
    """A turn that runs many TTLs long keeps its session (listed, busy) all along; the idle
    session expires by itself afterwards."""
    ttl = 0.05
    with Engine(Model.load(model_path, threads=2), parallel=2, ctx_size=512, session_ttl=ttl) as e:

        async def main() -> list[bool]:
            seen: list[bool] = []
            t0 = time.monotonic()
            async for _ in e.stream(P1, max_tokens=200, ignore_eos=True, session_id="long"):
                if time.monotonic() - t0 > 10 * ttl and len(seen) < 3:
                    info = await asyncio.to_thread(e.sessions)
                    seen.append(any(s.id == "long" and s.busy for s in info))
            return seen

        seen = asyncio.run(main())
        assert seen and all(seen), seen
        # The expiry of the now idle session happens, by itself, after the turn.
        wait_for(lambda: e.stats()["sessions"] == 0, timeout=30)


def test_max_sessions_drops_the_least_recently_used_idle_session(model_path: Path) -> None:
    with Engine(Model.load(model_path, threads=2), parallel=2, ctx_size=256, max_sessions=2) as e:
        for sid in ("a", "b", "c"):
            e.generate(f"Session {sid} says", max_tokens=2, session_id=sid)
        assert sorted(s.id for s in e.sessions()) == ["b", "c"]
        e.generate(" again", max_tokens=2, session_id="b")  # b is now the most recent
        e.generate("Session d says", max_tokens=2, session_id="d")
        assert sorted(s.id for s in e.sessions()) == ["b", "d"]
        assert e.stats()["sessions"] == 2

        # One session only and it is busy: a new one cannot be made.
        async def main() -> None:
            busy = asyncio.ensure_future(
                e.agenerate("A long story:", max_tokens=24, ignore_eos=True, session_id="b")
            )
            while not any(s.busy for s in e.sessions()):
                await asyncio.sleep(0.005)
            e2 = asyncio.ensure_future(
                e.agenerate("x", max_tokens=12, ignore_eos=True, session_id="e")
            )
            e3 = asyncio.ensure_future(e.agenerate("y", max_tokens=2, session_id="f"))
            results = await asyncio.gather(e2, e3, return_exceptions=True)
            # d is idle: the first new one replaces it, the second finds only busy ones.
            assert not isinstance(results[0], BaseException)
            assert isinstance(results[1], RuntimeError) and "max_sessions=2" in str(results[1])
            await busy

        asyncio.run(main())
        assert sorted(s.id for s in e.sessions()) == ["b", "e"]


def test_save_load_continue_equals_continuing_in_place(model_path: Path, tmp_path: Path) -> None:
    with Engine(Model.load(model_path, threads=2), parallel=4, ctx_size=512) as a:
        r1 = a.generate(P1, max_tokens=8, session_id="g")
        s1 = a.generate(P1, max_tokens=8, temperature=0.9, seed=3, session_id="r")
        a.save_session("g", tmp_path / "g.kvs")
        a.save_session("r", tmp_path / "r.kvs")
        stored = r1.prompt_tokens + len(r1.tokens)
        in_place = a.generate(P3, max_tokens=12, session_id="g")
        # A sampled turn without a seed continues the session's random stream.
        sampled_in_place = a.generate(P3, max_tokens=12, temperature=0.9, session_id="r")
    assert in_place.cached_tokens == stored
    # Another engine on another Model instance (its own K/V memory): nothing is cached there.
    with Engine(Model.load(model_path, threads=2), parallel=4, ctx_size=512) as b:
        assert b.load_session(tmp_path / "g.kvs") == "g"
        assert b.load_session(tmp_path / "r.kvs") == "r"
        infos = {s.id: s for s in b.sessions()}
        assert (infos["g"].tokens, infos["g"].resident) == (stored, True)
        assert infos["r"].tokens == s1.prompt_tokens + len(s1.tokens)
        assert b.stats()["prompt_tokens"] == 0  # loading computed nothing
        loaded = b.generate(P3, max_tokens=12, session_id="g")
        sampled_loaded = b.generate(P3, max_tokens=12, temperature=0.9, session_id="r")
        # Also under another id.
        assert b.load_session(tmp_path / "g.kvs", session_id="g2") == "g2"
        again = b.generate(P3, max_tokens=12, session_id="g2")
    assert (loaded.tokens, loaded.text) == (in_place.tokens, in_place.text)
    assert loaded.cached_tokens == stored  # the loaded K/V, not recomputed
    assert (again.tokens, again.cached_tokens) == (in_place.tokens, stored)
    assert sampled_loaded.tokens == sampled_in_place.tokens


def test_files_the_engine_saves_pass_the_full_header_check(engine: Engine, tmp_path: Path) -> None:
    """The header checks (tests/test_session_file.py) accept every file the engine writes:
    greedy (no generator state) and sampled turns, priorities at both limits."""
    model = engine.model
    engine.generate(P1, max_tokens=6, session_id="lo", priority=PRIORITY_MIN)
    engine.generate(P1, max_tokens=6, session_id="hi", priority=PRIORITY_MAX, temperature=0.9)
    for sid, priority, sampled in (("lo", PRIORITY_MIN, False), ("hi", PRIORITY_MAX, True)):
        path = tmp_path / f"{sid}.kvs"
        engine.save_session(sid, path)
        header, _ = read_session_file(path)
        check_header(header, path, model.core.identity, engine.kv_type, n_vocab=model.n_vocab)
        assert header["priority"] == priority
        assert (header["rng_state"] is not None) == sampled
        assert header["tokens"] and max(header["tokens"]) < model.n_vocab


def test_a_shifted_session_saves_and_loads_its_shifted_context(
    model_path: Path, tmp_path: Path
) -> None:
    """After a context shift the session holds the shifted context (moved keys, not clean):
    saved and loaded, it continues exactly as in place, and its blocks are never keyed."""
    prompt = "List the months of the year, one per line:"
    kw: dict[str, Any] = {"parallel": 2, "ctx_size": 64, "context_shift": True}
    with Engine(Model.load(model_path, threads=2), **kw) as a:
        n_prompt = len(tok(a.model, prompt))
        r1 = a.generate(prompt, max_tokens=64 - n_prompt + 2, ignore_eos=True, session_id="z")
        held = a.sessions()[0].tokens
        assert held < r1.prompt_tokens + len(r1.tokens), "the turn shifted its context"
        a.save_session("z", tmp_path / "z.kvs")
        in_place = a.generate(P2, max_tokens=8, session_id="z")
    assert in_place.cached_tokens == held
    with Engine(Model.load(model_path, threads=2), **kw) as b:
        b.load_session(tmp_path / "z.kvs")
        loaded = b.generate(P2, max_tokens=8, session_id="z")
        assert (loaded.tokens, loaded.cached_tokens) == (in_place.tokens, held)
        wait_for(lambda: b.stats()["running"] == 0)
        b.drop_session("z")
        st = b.stats()
    assert (st["kv_blocks_used"], st["kv_blocks_cached"]) == (0, 0), "nothing was keyed"


def test_an_interrupted_save_leaves_the_old_file(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.kvs"
    engine.generate(P1, max_tokens=8, session_id="s")
    engine.save_session("s", path)
    old = path.read_bytes()
    n_old = engine.sessions()[0].tokens
    engine.generate(P2, max_tokens=8, session_id="s")
    real = kvserve.sessions._write_all
    calls = []

    def half_then_fail(f: Any, data: bytes) -> None:
        calls.append(len(data))
        if len(calls) == 2:  # the K/V part: half of it reaches the disk, then the disk fails
            real(f, data[: len(data) // 2])
            f.flush()
            raise OSError("disk full")
        real(f, data)

    monkeypatch.setattr(kvserve.sessions, "_write_all", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        engine.save_session("s", path)
    assert len(calls) == 2
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["s.kvs"], "no temporary file left behind"
    monkeypatch.undo()
    header, _ = read_session_file(path)
    assert len(header["tokens"]) == n_old
    engine.save_session("s", path)  # the writer works again: the new state replaces it
    assert len(read_session_file(path)[0]["tokens"]) == engine.sessions()[0].tokens > n_old


def test_bad_session_files_raise_and_load_nothing(
    engine: Engine, model_path: Path, bos_model_path: Path, tmp_path: Path
) -> None:
    good = tmp_path / "good.kvs"
    engine.generate(P1, max_tokens=8, session_id="keep")
    engine.save_session("keep", good)
    data = good.read_bytes()
    n_head = int.from_bytes(data[20:24], "little")

    def variant(name: str, content: bytes) -> Path:
        p = tmp_path / name
        p.write_bytes(content)
        return p

    flipped = bytearray(data)
    flipped[32 + n_head + 5000] ^= 0x40  # a K/V byte
    version = bytearray(data)
    version[16] = 2
    cases: list[tuple[Path, str]] = [
        (variant("truncated.kvs", data[: len(data) - 100]), "truncated"),
        (variant("tiny.kvs", data[:20]), "too short"),
        (variant("corrupt.kvs", bytes(flipped)), "checksum mismatch"),
        (variant("version.kvs", bytes(version)), "format version 2"),
        (variant("other.kvs", b"GGUF" + bytes(200)), "not a kvserve session file"),
    ]
    # A valid file made by another model (the patched GGUF has another identity).
    with Engine(Model.load(bos_model_path, threads=2), parallel=2, ctx_size=256) as other:
        other.generate(P1, max_tokens=4, session_id="x")
        other.save_session("x", tmp_path / "other_model.kvs")
    cases.append((tmp_path / "other_model.kvs", "saved by another model"))
    # ... and one with another K/V type.
    with Engine(Model.load(model_path, threads=2), parallel=2, ctx_size=256, kv_type="q8_0") as q8:
        q8.generate(P1, max_tokens=4, session_id="x")
        q8.save_session("x", tmp_path / "q8.kvs")
    cases.append((tmp_path / "q8.kvs", "kv_type='q8_0'"))
    # A file whose header is fine and whose K/V state belongs to other tokens.
    header, kv = read_session_file(good)
    header["tokens"] = [t + 1 for t in header["tokens"]]
    write_session_file(tmp_path / "mismatch.kvs", header, kv)
    cases.append((tmp_path / "mismatch.kvs", "position 0 holds token"))

    before = (engine.sessions(), engine.stats()["kv_blocks_used"])
    for path, match in cases:
        with pytest.raises(SessionFileError, match=match):
            engine.load_session(path, session_id="new")
        assert (engine.sessions(), engine.stats()["kv_blocks_used"]) == before, path.name
    assert issubclass(SessionFileError, ValueError)
    with pytest.raises(ValueError, match="exists"):
        engine.load_session(good)  # "keep" is held: drop it first
    assert (engine.sessions(), engine.stats()["kv_blocks_used"]) == before
    assert engine.load_session(good, session_id="copy") == "copy"
    assert data.startswith(FILE_MAGIC)


def test_unknown_sessions_raise_key_error_and_drop_restores_the_baseline(
    engine: Engine, tmp_path: Path
) -> None:
    base = engine.stats()
    with pytest.raises(KeyError):
        engine.save_session("nope", tmp_path / "x.kvs")
    with pytest.raises(KeyError):
        engine.drop_session("nope")
    assert not (tmp_path / "x.kvs").exists()
    engine.generate(P1, max_tokens=8, session_id="d")
    st = engine.stats()
    assert (st["sessions"], st["kv_blocks_used"]) == (1, base["kv_blocks_used"] + 1)
    engine.drop_session("d")
    st = engine.stats()
    assert (st["sessions"], st["kv_blocks_used"], st["running"]) == (
        base["sessions"],
        base["kv_blocks_used"],
        0,
    )
    assert engine.sessions() == []
    with pytest.raises(KeyError):
        engine.drop_session("d")


def test_a_cancelled_turn_leaves_the_session_as_it_was(engine: Engine, oracle: Model) -> None:
    r1 = engine.generate(P1, max_tokens=8, session_id="k")
    n1 = engine.sessions()[0].tokens

    async def main() -> None:
        it = engine.stream(
            " Tell me a long story.", max_tokens=100, ignore_eos=True, session_id="k"
        )
        async for _piece in it:
            break
        await it.aclose()

    asyncio.run(main())
    wait_for(lambda: not engine.sessions()[0].busy)
    assert engine.sessions()[0].tokens == n1
    r3 = engine.generate(P2, max_tokens=8, session_id="k")
    check_continuation(oracle, r1, P1, P2)
    assert r3.tokens == oracle.generate(P1 + r1.text + P2, max_tokens=8).tokens
    assert r3.cached_tokens == n1


def test_session_arguments_are_checked(engine: Engine, model_path: Path) -> None:
    for bad in ("", 5):
        with pytest.raises(ValueError, match="session_id must be a non-empty string"):
            engine.generate("x", max_tokens=2, session_id=bad)  # type: ignore[arg-type]
    for kw, match in (
        ({"kv_high_watermark": 0.5, "kv_low_watermark": 0.6}, "watermarks"),
        ({"kv_low_watermark": 0.0}, "watermarks"),
        ({"kv_high_watermark": 1.5}, "watermarks"),
        ({"session_ttl": 0}, "session_ttl"),
        ({"max_sessions": 0}, "max_sessions"),
    ):
        with pytest.raises(ValueError, match=match):
            Engine(engine.model, **kw)  # type: ignore[arg-type]
    # A session grown past ctx_size: the next turn is rejected at the call.
    with Engine(Model.load(model_path, threads=2), parallel=2, ctx_size=20) as small:
        small.generate(P1, max_tokens=8, session_id="s")
        with pytest.raises(ValueError, match="the session with this prompt has"):
            small.generate(P3, max_tokens=2, session_id="s")


def test_sequence_state_through_the_binding(model_path: Path, oracle: Model) -> None:
    """Context.seq_state_read/write: a prompt's state moved to another Model instance gives
    the same next-token logits; bad states raise ValueError and change nothing."""
    import numpy as np

    ids = tok(oracle, P1)
    n = len(ids)
    a = oracle.core.new_context(64)
    a.decode(ids, list(range(n)), [0] * n, [False] * n)
    state = a.seq_state_read(0)
    other = Model.load(model_path, threads=2)
    b = other.core.new_context(64)
    assert b.seq_state_write(3, state) == n
    la = a.decode([ids[0]], [n], [0], [True])
    lb = b.decode([ids[0]], [n], [3], [True])
    rows = [np.frombuffer(memoryview(x), np.float32) for x in (la, lb)]
    assert np.array_equal(rows[0], rows[1])
    cells = b.n_cells
    for bad in (state[:-1], state + b"\0", b"KVSQ" + state[4:40] + b"\x08" + state[41:], b""):
        with pytest.raises(ValueError):
            b.seq_state_write(5, bad)
        assert b.n_cells == cells
    with pytest.raises(ValueError, match="not empty"):
        b.seq_state_write(3, state)
    tiny = Model.load(model_path, threads=2).core.new_context(n - 1)
    with pytest.raises(KvCacheFull):
        tiny.seq_state_write(0, state)
    assert tiny.n_cells == 0
    assert isinstance(oracle.core.identity, str) and len(oracle.core.identity) == 32
    assert kvserve.SessionInfo is kvserve.sessions.SessionInfo


def test_a_gemma_session_past_the_window_saves_loads_and_continues_as_in_place(
    gemma_path: Path, tmp_path: Path
) -> None:
    """Gemma 3 (sliding-window layers, so the session file holds each layer group's cells):
    a session whose first turn is longer than the 512-token window (its window groups were
    pruned) is saved, loaded into a fresh engine on another Model instance, and its next turn
    equals the turn of the engine that kept it in memory, computing only the new tokens.
    Damaged files raise SessionFileError and load nothing (no session, no block held, the
    pool's audit clean)."""
    doc = " ".join(f"Line {i}: the river flows past mill number {i}." for i in range(56))
    p1 = doc + "\nQuestion: what flows past the mills?\nAnswer:"
    p2 = "\nQuestion: and how many mills are there?\nAnswer:"
    path = tmp_path / "g.kvs"
    kw: dict[str, Any] = {"parallel": 2, "ctx_size": 2048, "batch_tokens": 256}
    with Engine(Model.load(gemma_path, threads=2), **kw) as a:
        r1 = a.generate(p1, max_tokens=8, session_id="g")
        assert r1.prompt_tokens > 700
        a.save_session("g", path)
        stored = r1.prompt_tokens + len(r1.tokens)
        in_place = a.generate(p2, max_tokens=12, session_id="g")
    assert in_place.cached_tokens == stored

    header, kv = read_session_file(path)
    assert kv[:8] == b"KVSQ" + (2).to_bytes(4, "little"), "a layer-group state"
    n_groups = int.from_bytes(kv[24:28], "little")
    kinds = [kv[28 + 20 * i] for i in range(n_groups)]
    win = kinds.index(1)
    at = (
        28
        + 20 * n_groups
        + sum(int.from_bytes(kv[28 + 20 * i + 12 : 28 + 20 * i + 20], "little") for i in range(win))
    )
    assert int.from_bytes(kv[at + 44 : at + 48], "little") == 512, "only the window saved"
    changed = bytearray(kv)
    changed[at + 48 + 4 * 512] ^= 1  # the window's first token id
    write_session_file(tmp_path / "token.kvs", header, bytes(changed))
    layout = bytearray(kv)
    layout[28 + 20 * win + 4] ^= 1  # the window size
    write_session_file(tmp_path / "layout.kvs", header, bytes(layout))
    data = path.read_bytes()
    (tmp_path / "truncated.kvs").write_bytes(data[: len(data) - 1000])
    cases = [
        ("token.kvs", "holds token"),
        ("layout.kvs", "another layout"),
        ("truncated.kvs", "truncated"),
    ]

    with Engine(Model.load(gemma_path, threads=2), **kw) as b:
        base = b.stats()
        for name, match in cases:
            with pytest.raises(SessionFileError, match=match):
                b.load_session(tmp_path / name)
            st = b.stats()
            assert b.sessions() == [], name
            assert (st["kv_blocks_used"], st["kv_blocks_cached"]) == (
                base["kv_blocks_used"],
                base["kv_blocks_cached"],
            ), name
            b._on_engine(b._loop.kv.ctx.audit)
        assert b.load_session(path) == "g"
        assert b.sessions()[0].tokens == stored
        assert b.stats()["prompt_tokens"] == 0  # loading computed nothing
        loaded = b.generate(p2, max_tokens=12, session_id="g")
        b._on_engine(b._loop.kv.ctx.audit)
    assert (loaded.tokens, loaded.text) == (in_place.tokens, in_place.text)
    assert loaded.cached_tokens == stored
