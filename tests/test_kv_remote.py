"""The shared K/V tier (issue 21, L3): blocks one engine computes are stored in a real Redis
(Debian's ``redis-server``, started here on a loopback port) and fetched by another engine on
a separate model instance (another replica: its own pool, index and tier), which then
computes only the tail of the prompt.

Oracles: the same request's greedy output from an engine without the tier; a simple model of
the store's contents (every whole block of every prompt computed, one key per block, named by
the model id and the block's content key: ``kv_remote_keys``, checked against the keys found
in the store and against separate processes with other hash seeds); the values read with an
independent parser of the documented format (docs/KV_SEMANTICS.md, "Shared tier")."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import lfm2_reference as lref  # noqa: E402

from kvserve import Engine, Model  # noqa: E402
from kvserve._model import prompt_ids  # noqa: E402
from kvserve.server.app import create_app
from kvserve.server.config import ServerConfig
from kvserve.testing import live_server

BLOCK = 16
FIXED = 72  # magic, version, block size, model id, key, parent, payload length


def _resp(port: int, *args: bytes | str) -> Any:
    """One command to the Redis server on ``port`` (a minimal RESP2 client, independent of
    kvserve's)."""
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    msg = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(msg)
        f = s.makefile("rb")
        return _read_reply(f)


def _read_reply(f: Any) -> Any:
    line = f.readline()
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        raise RuntimeError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else f.read(n + 2)[:-2]
    if kind == b"*":
        return [_read_reply(f) for _ in range(int(rest))]
    raise RuntimeError(f"bad reply {line!r}")


class Redis:
    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail(
                "redis-server not found: the shared K/V tier's tests need Debian's redis-server"
                " (apt-get install redis-server; .ci/run installs it)"
            )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                if _resp(self.port, "PING") == "PONG":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "redis-server did not answer within 10 s"
            time.sleep(0.02)
        self.url = f"redis://127.0.0.1:{self.port}"

    def cmd(self, *args: bytes | str) -> Any:
        return _resp(self.port, *args)

    def keys(self) -> set[str]:
        return {k.decode() for k in self.cmd("KEYS", "kvs:v1:*")}

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[Redis]:
    r = Redis()
    yield r
    r.stop()


@pytest.fixture
def redis(redis_server: Redis) -> Redis:
    redis_server.cmd("FLUSHALL")
    return redis_server


def _prompt(model: Model, n_tokens: int, k: int = 0) -> list[int]:
    """Token ids of a prompt of exactly ``n_tokens`` tokens (its first block differs per
    ``k``)."""
    words = [f"Report {k}:"] + [f"entry{(i * (k + 7) + k) % 991}" for i in range(n_tokens)]
    ids = prompt_ids(model, " ".join(words))
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


def _engine(model_path: Path, **kw: Any) -> Engine:
    """An engine on a fresh model instance: another replica, with its own pool and tiers."""
    return Engine(Model(model_path, threads=2), parallel=2, ctx_size=1400, **kw)


def _sent(engine: Engine) -> dict[str, Any]:
    """The engine's stats once its shared tier sent everything queued."""
    engine._loop.kv.flush_remote()
    st = engine.stats()
    assert st["kv_remote_queued"] == 0
    return st


def _greedy(engine: Engine, ids: list[int], n: int = 12) -> tuple[list[int], int]:
    r = asyncio.run(_collect(engine, ids, n))
    return r


async def _collect(engine: Engine, ids: list[int], n: int) -> tuple[list[int], int]:
    result = None
    async for item in engine.events(ids, n, temperature=0.0):
        if not isinstance(item, str):
            result = item
    assert result is not None
    return list(result.tokens), int(result.cached_tokens)


def test_a_replica_fetches_what_another_computed(model_path: Path, redis: Redis) -> None:
    a = _engine(model_path, kv_remote=redis.url)
    b = _engine(model_path, kv_remote=redis.url)
    plain = _engine(model_path)
    try:
        ids = _prompt(a.model, 1030)  # 64 whole blocks and 6 tokens
        want, _ = _greedy(plain, ids)
        got_a, cached_a = _greedy(a, ids)
        assert (got_a, cached_a) == (want, 0)
        st = _sent(a)
        # The store holds exactly the model's whole blocks of what A computed (the prompt and
        # the generated tokens' full blocks), under the keys every process derives.
        keys = a._loop.kv.ctx.kv_remote_keys(ids + got_a)
        assert redis.keys() == set(keys)
        assert st["kv_remote_writes"] == len(keys) and st["kv_remote_writes_dropped"] == 0
        # The first block's value, read with the documented format.
        v = redis.cmd("GET", keys[0])
        magic, version, bs = struct.unpack_from("<8sII", v)
        assert (magic, version, bs) == (b"KVSDISK\0", 1, BLOCK)
        assert list(struct.unpack_from(f"<{BLOCK}I", v, FIXED)) == ids[:BLOCK]
        (n_payload,) = struct.unpack_from("<Q", v, 64)
        assert len(v) == FIXED + 4 * BLOCK + n_payload + 16
        assert n_payload == a._loop.kv.ctx.stats()["bytes_per_block"]

        got_b, cached_b = _greedy(b, ids)
        assert got_b == want
        st = b.stats()
        assert st["kv_remote_hit_blocks"] >= 60, st
        assert st["kv_remote_hit_blocks"] == 64
        assert cached_b == 64 * BLOCK == st["kv_remote_hit_tokens"]
        assert st["cached_prompt_tokens"] == cached_b
        assert st["kv_remote_fetches"] == 1 and st["kv_remote_errors"] == 0
        # Now in B's RAM: the next request maps it without asking the store.
        assert _greedy(b, ids) == (want, 64 * BLOCK)
        assert b.stats()["kv_remote_fetches"] == 1
        assert b.stats()["kv_remote_staged_bytes"] == 0, "staged blocks went into the pool"

    finally:
        for e in (a, b, plain):
            e.close()


def test_a_gemma_replica_fetches_past_the_window(gemma_path: Path, redis: Redis) -> None:
    """Gemma 3 (a window group of 512 positions beside the full group): A's blocks of both
    groups go to the store, each under its group's model id; B, with a cold cache, fetches
    the full group's whole prefix and the window group's window before the resume point
    only, and its greedy output is that of an engine without the tier."""
    a = _engine(gemma_path, kv_remote=redis.url)
    b = _engine(gemma_path, kv_remote=redis.url)
    plain = _engine(gemma_path)
    try:
        ids = _prompt(a.model, 700, k=4)
        usable = (len(ids) - 1) // BLOCK * BLOCK
        window_blocks = usable // BLOCK - (usable + 1 - 512) // BLOCK
        want, _ = _greedy(plain, ids)
        got_a, cached_a = _greedy(a, ids)
        assert (got_a, cached_a) == (want, 0)
        _sent(a)
        stored = redis.keys()
        ids_of = {k.split(":")[2] for k in stored}
        assert len(ids_of) == 2, "a model id per group"
        n = len(ids + got_a) // BLOCK
        assert all(sum(k.split(":")[2] == m for k in stored) == n for m in ids_of)
        assert set(a._loop.kv.ctx.kv_remote_keys(ids + got_a)) <= stored

        got_b, cached_b = _greedy(b, ids)
        assert (got_b, cached_b) == (want, usable)
        groups = {g["kind"]: g for g in b._loop.kv.ctx.stats()["groups"]}
        fetched = {k: g["remote_hit_blocks"] for k, g in groups.items()}
        assert fetched == {"full": usable // BLOCK, "window": window_blocks}
        assert {k: g["remote_fetched_blocks"] for k, g in groups.items()} == fetched
        st = b.stats()
        assert st["kv_remote_hit_blocks"] == sum(fetched.values())
        assert st["kv_remote_staged_bytes"] == 0 and st["kv_remote_errors"] == 0
        # Now in B's RAM: the next request maps it without fetching anything.
        assert _greedy(b, ids) == (want, usable)
        assert b.stats()["kv_remote_fetched_blocks"] == st["kv_remote_fetched_blocks"]
    finally:
        for e in (a, b, plain):
            e.close()


def test_an_lfm2_replica_fetches_the_state_checkpoint(tmp_path: Path, redis: Redis) -> None:
    """A hybrid model (a tiny LFM2): A's K/V blocks and state checkpoints go to the store
    (the checkpoints under the attention group's model id, keys of their own domain); B,
    cold, fetches the K/V run and the checkpoint at its end and resumes there with the
    greedy output of an engine without the tier; without that checkpoint in the store, C
    fetches the one a block below and resumes there."""
    path = tmp_path / "lfm2.gguf"
    lref.write_model(path, lref.VARIANTS["cca-f32"])

    def engine(**kw: Any) -> Engine:
        return Engine(Model(path, threads=2), parallel=2, ctx_size=256, **kw)

    a, b, c = (engine(kv_remote=redis.url) for _ in range(3))
    plain = engine()
    try:
        ids = list(range(40, 40 + 70))
        usable = (len(ids) - 1) // BLOCK * BLOCK
        want, _ = _greedy(plain, ids)
        got_a, cached_a = _greedy(a, ids)
        assert (got_a, cached_a) == (want, 0)
        _sent(a)
        stored = redis.keys()
        assert len({k.split(":")[2] for k in stored}) == 1, "one model id"
        kv_keys = set(a._loop.kv.ctx.kv_remote_keys(ids + got_a))
        n = len(ids + got_a) // BLOCK
        assert kv_keys <= stored and len(stored) == 2 * n, "a checkpoint per K/V block"

        got_b, cached_b = _greedy(b, ids)
        assert (got_b, cached_b) == (want, usable)
        st = b.stats()
        assert st["kv_remote_hit_blocks"] == usable // BLOCK + 1
        assert st["kv_remote_fetched_blocks"] == usable // BLOCK + 1
        assert st["kv_remote_staged_bytes"] == 0 and st["kv_remote_errors"] == 0
        # Now in B's RAM: nothing is fetched again.
        assert _greedy(b, ids) == (want, usable)
        assert b.stats()["kv_remote_fetched_blocks"] == st["kv_remote_fetched_blocks"]

        # Delete the checkpoint at 64 (the store key A wrote that is no K/V block and whose
        # entry's parent is block 3's key): C resumes at 48 from the one below.
        block3 = a._loop.kv.ctx.kv_remote_keys(ids)[3].split(":")[3]
        ckpt = [k for k in stored - kv_keys if _parent(redis, k) == int(block3, 16)]
        assert len(ckpt) == 1
        assert redis.cmd("DEL", ckpt[0]) == 1
        got_c, cached_c = _greedy(c, ids)
        assert (got_c, cached_c) == (want, usable - BLOCK)
        assert c.stats()["kv_remote_hit_blocks"] == usable // BLOCK + 1
    finally:
        for e in (a, b, c, plain):
            e.close()


def _parent(redis: Redis, key: str) -> int:
    """The parent key in the header of the entry stored under ``key``."""
    v = redis.cmd("GET", key)
    # magic (8), version, block size (4 each), model id, key, parent (16 each)
    return int.from_bytes(v[8 + 8 + 16 + 16 : 8 + 8 + 16 + 16 + 16], "little")


def test_a_deleted_block_ends_the_hits_there(model_path: Path, redis: Redis) -> None:
    a = _engine(model_path, kv_remote=redis.url)
    b = _engine(model_path, kv_remote=redis.url)
    try:
        ids = _prompt(a.model, 500, k=1)
        want, _ = _greedy(a, ids)
        _sent(a)
        keys = a._loop.kv.ctx.kv_remote_keys(ids)
        assert redis.cmd("DEL", keys[20]) == 1
        got, cached = _greedy(b, ids)
        assert (got, cached) == (want, 20 * BLOCK)
        st = b.stats()
        assert (st["kv_remote_hit_blocks"], st["kv_remote_misses"]) == (20, 1)
        # B computed blocks 20.. and stored the missing one again (SET NX keeps the rest).
        _sent(b)
        assert keys[20] in redis.keys()
    finally:
        a.close()
        b.close()


def test_a_damaged_value_is_a_miss(model_path: Path, redis: Redis) -> None:
    a = _engine(model_path, kv_remote=redis.url)
    b = _engine(model_path, kv_remote=redis.url)
    try:
        ids = _prompt(a.model, 300, k=2)
        want, _ = _greedy(a, ids)
        _sent(a)
        key = a._loop.kv.ctx.kv_remote_keys(ids)[7]
        v = bytearray(redis.cmd("GET", key))
        v[FIXED + 4 * BLOCK + 100] ^= 0x40  # one bit of the K/V payload
        assert redis.cmd("SET", key, bytes(v)) == "OK"
        got, cached = _greedy(b, ids)
        assert (got, cached) == (want, 7 * BLOCK)
        assert b.stats()["kv_remote_invalid"] == 1
    finally:
        a.close()
        b.close()


def test_another_kv_type_or_model_finds_nothing(
    model_path: Path, redis: Redis, tmp_path: Path
) -> None:
    a = _engine(model_path, kv_remote=redis.url)
    q8 = _engine(model_path, kv_remote=redis.url, kv_type="q8_0")
    # Another model: the same file with one byte of its metadata changed (its name).
    data = bytearray(model_path.read_bytes())
    at = data.find(b"general.name")
    assert at > 0
    (n,) = struct.unpack_from("<Q", data, at + len(b"general.name") + 4)
    data[at + len(b"general.name") + 12 + n - 1] ^= 1
    other_path = tmp_path / "other.gguf"
    other_path.write_bytes(bytes(data))
    other = _engine(other_path, kv_remote=redis.url)
    try:
        ids = _prompt(a.model, 300, k=3)
        _greedy(a, ids)
        _sent(a)
        for e in (q8, other):
            _, cached = _greedy(e, ids)
            st = e.stats()
            assert (cached, st["kv_remote_hit_blocks"]) == (0, 0)
            assert st["kv_remote_fetches"] == 1 and st["kv_remote_misses"] == 1
        assert {k.split(":")[2] for k in redis.keys()} == {
            k.split(":")[2] for e in (a, q8, other) for k in e._loop.kv.ctx.kv_remote_keys(ids[:16])
        }, "each model and K/V type stores under its own model id"
    finally:
        for e in (a, q8, other):
            e.close()


def test_processes_with_different_hash_seeds_derive_the_same_keys(
    model_path: Path, redis: Redis
) -> None:
    a = _engine(model_path, kv_remote=redis.url)
    try:
        ids = _prompt(a.model, 200, k=4)
        _greedy(a, ids, n=1)
        _sent(a)
        stored = redis.keys()
        code = (
            "import sys, json; from kvserve import Model; "
            "ids = json.loads(sys.stdin.read()); "
            f"ctx = Model({str(model_path)!r}, threads=1).core.new_context(256); "
            "print(json.dumps(ctx.kv_remote_keys(ids)))"
        )
        outs = []
        for seed in ("1", "2"):
            env = {**os.environ, "PYTHONHASHSEED": seed}
            p = subprocess.run(
                [sys.executable, "-c", code],
                input=str(ids),
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
                check=True,
            )
            outs.append(p.stdout.strip())
        assert outs[0] == outs[1]
        assert set(eval(outs[0])) <= stored and len(eval(outs[0])) == len(ids) // BLOCK
    finally:
        a.close()


def test_tenants_do_not_share_through_the_store(model_path: Path, redis: Redis) -> None:
    a = _engine(model_path, kv_remote=redis.url)
    b = _engine(model_path, kv_remote=redis.url)
    try:
        ids = _prompt(a.model, 300, k=5)
        r = a.generate(a.model.detokenize(ids), 4, temperature=0.0, tenant="acme")
        assert r.cached_tokens == 0
        _sent(a)
        other = b.generate(b.model.detokenize(ids), 4, temperature=0.0, tenant="globex")
        assert other.cached_tokens == 0 and b.stats()["kv_remote_hit_blocks"] == 0
        same = b.generate(b.model.detokenize(ids), 4, temperature=0.0, tenant="acme")
        assert same.cached_tokens > 0 and same.text == r.text
        assert b.stats()["kv_remote_hit_tokens"] == same.cached_tokens
    finally:
        a.close()
        b.close()


def test_a_store_that_is_down_costs_a_recompute(model_path: Path) -> None:
    """No store at the address (refused), then a store that never answers (a timeout): the
    requests succeed with the output computed, and the errors are counted."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    plain = _engine(model_path)
    down = _engine(model_path, kv_remote=f"redis://127.0.0.1:{dead}")
    silent_srv = socket.socket()
    silent_srv.bind(("127.0.0.1", 0))
    silent_srv.listen(16)
    silent = _engine(
        model_path,
        kv_remote=f"redis://127.0.0.1:{silent_srv.getsockname()[1]}",
        kv_remote_timeout=0.3,
    )
    try:
        ids = _prompt(plain.model, 200, k=6)
        want, _ = _greedy(plain, ids)
        for e in (down, silent):
            t0 = time.monotonic()
            assert _greedy(e, ids) == (want, 0)
            assert time.monotonic() - t0 < 30
            st = _sent(e)
            assert st["kv_remote_errors"] >= 1 and st["kv_remote_hit_blocks"] == 0
            assert st["kv_remote_down"] == 1
            assert st["kv_remote_writes"] == 0
    finally:
        for e in (plain, down, silent):
            e.close()
        silent_srv.close()


def test_cancelled_while_fetching(model_path: Path) -> None:
    """A request cancelled while its blocks are fetched (a store that never answers) ends
    cancelled; the engine is left with nothing waiting and serves the next request."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    e = _engine(
        model_path, kv_remote=f"redis://127.0.0.1:{srv.getsockname()[1]}", kv_remote_timeout=1.0
    )
    try:
        ids = _prompt(e.model, 100, k=7)
        deadline = time.monotonic() + 10
        while e.stats()["kv_remote_down"]:  # the start's ping timed out: the tier rests
            assert time.monotonic() < deadline
            time.sleep(0.05)

        async def run() -> None:
            task = asyncio.ensure_future(e.agenerate(e.model.detokenize(ids), 4))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(run())
        time.sleep(1.5)  # the fetch times out; the request must not run
        st = e.stats()
        assert (st["waiting"], st["running"], st["prompt_tokens"]) == (0, 0, 0)
        assert st["cancelled_requests"] == 1
        assert e.generate("Hello", 2, temperature=0.0).text
    finally:
        e.close()
        srv.close()


def _ready(base: str) -> None:
    """Waits until the server loaded its engine (/health 200)."""
    deadline = time.monotonic() + 60
    while httpx.get(f"{base}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the server did not load its engine in 60 s"
        time.sleep(0.05)


def _counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_server_counts_remote_hits_and_survives_its_store(model_path: Path, redis: Redis) -> None:
    """Over HTTP: the prompt tokens fetched from the store count as cached in the response's
    usage, /metrics shows the tier, and once the store is gone requests still answer 200
    (computed), the errors counted."""
    a = _engine(model_path, kv_remote=redis.url)
    text = a.model.detokenize(_prompt(a.model, 400, k=8))
    a.generate(text, 2, temperature=0.0)
    _sent(a)
    a.close()
    body = {"prompt": text, "max_tokens": 2, "temperature": 0}
    cfg = ServerConfig(model=str(model_path), parallel=2, ctx_size=1024, kv_remote=redis.url)
    with live_server(create_app(cfg)) as base:
        _ready(base)
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        assert cached >= 23 * BLOCK
        assert _counter(metrics, "kvserve_kv_remote_hit_tokens_total") == cached
        assert _counter(metrics, "kvserve_kv_remote_fetches_total") == 1
    own = Redis()  # a store this test stops
    cfg = ServerConfig(model=str(model_path), parallel=2, ctx_size=1024, kv_remote=own.url)
    try:
        with live_server(create_app(cfg)) as base:
            _ready(base)
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200
            # The tier sends blocks in the background: the answer can come before the first
            # key is stored.
            deadline = time.monotonic() + 30
            while not own.keys():
                assert time.monotonic() < deadline, "no block reached the store in 30 s"
                time.sleep(0.05)
            own.stop()
            body["prompt"] = "Something else entirely: " + text
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            metrics = httpx.get(f"{base}/metrics", timeout=30).text
            assert _counter(metrics, "kvserve_kv_remote_errors_total") >= 1
    finally:
        own.stop()


def test_a_session_resumes_on_another_replica_from_the_store(
    model_path: Path, redis: Redis
) -> None:
    """A chat session's turns run on replica A; A goes away, and the next turn (the whole
    conversation, as an OpenAI client sends it) lands on replica B, which has never seen the
    session: its history comes from the store, only the new tail is computed, and the reply
    is what an engine without the tier answers."""
    a = _engine(model_path, kv_remote=redis.url)
    b = _engine(model_path, kv_remote=redis.url)
    plain = _engine(model_path)
    try:
        system = "You are a careful assistant. " + " ".join(
            f"Rule {i}: answer in plain words." for i in range(40)
        )
        messages: list[Any] = [{"role": "system", "content": system}]
        for q in ("What is a cache?", "And a block?"):
            messages.append({"role": "user", "content": q})
            r = a.chat(messages, 12, temperature=0.0, session_id="s1")
            messages.append({"role": "assistant", "content": r.text})
        _sent(a)
        a.close()
        messages.append({"role": "user", "content": "Say it shorter."})
        history = len(a.model.tokenize_chat(messages[:-1]))
        got = b.chat(messages, 12, temperature=0.0, session_id="s1")
        want = plain.chat(messages, 12, temperature=0.0)
        assert got.text == want.text
        st = b.stats()
        assert got.cached_tokens == st["kv_remote_hit_tokens"]
        # Every whole block the session's first two turns stored: the history but its last
        # partial block (and the template's reply tokens, which A's decode stored too).
        assert got.cached_tokens >= (history // BLOCK - 1) * BLOCK, (got.cached_tokens, history)
    finally:
        b.close()
        plain.close()


def test_staged_blocks_are_bounded_and_given_back(model_path: Path, redis: Redis) -> None:
    """Blocks fetched for requests not yet admitted have a budget: with the engine busy and
    many requests queued behind it, the staged bytes never pass it, the requests beyond it
    compute their prompts, every output is right, and nothing stays staged at the end."""
    a = _engine(model_path, kv_remote=redis.url)
    plain = _engine(model_path)
    b = Engine(Model(model_path, threads=2), parallel=1, ctx_size=1400, kv_remote=redis.url)
    try:
        prompts = [_prompt(a.model, 200, k=20 + i) for i in range(8)]
        for ids in prompts:
            _greedy(a, ids, n=1)
        _sent(a)
        per_block = int(b._loop.kv.ctx.stats()["bytes_per_block"])
        budget = 20 * per_block  # 1.6 prompts' worth
        b._loop.kv.ctx.set_kv_remote(redis.url, max_fetch_blocks=100, max_staged_bytes=budget)
        peak = 0

        async def run() -> list[tuple[list[int], int]]:
            nonlocal peak
            tasks = [asyncio.ensure_future(_collect(b, ids, 4)) for ids in prompts]
            while not all(t.done() for t in tasks):
                peak = max(peak, b.stats()["kv_remote_staged_bytes"])
                await asyncio.sleep(0.002)
            return [t.result() for t in tasks]

        got = asyncio.run(run())
        for ids, (tokens, _) in zip(prompts, got, strict=True):
            assert tokens == _greedy(plain, ids, n=4)[0]
        st = b.stats()
        assert peak <= budget and st["kv_remote_staged_bytes"] == 0
        assert st["kv_remote_skipped_full"] >= 1, "the queue outgrew the budget"
        assert sum(c for _, c in got) == st["kv_remote_hit_tokens"] > 0
    finally:
        for e in (a, plain, b):
            e.close()
