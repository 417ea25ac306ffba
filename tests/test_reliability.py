"""Reliability under damage and kills (issue 20): session files damaged at random load nothing
and leave the engine as it was; a save killed (SIGKILL) at a random point mid-write leaves the
old file intact and loadable, and its temporary file is removed at the next server start.

Oracles: the engine's state before each attempt (sessions, K/V in use) and a greedy request's
tokens before and after, and the file as last completely written."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvserve import Engine, Model, SessionFileError
from kvserve.server import ServerConfig, create_app
from kvserve.sessions import read_session_file

P1 = "The capital of France is"


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Engine:
    with Engine(Model.load(model_path, threads=2), parallel=2, ctx_size=512) as e:
        yield e


def _state(e: Engine) -> tuple[object, ...]:
    st = e.stats()
    return (tuple(e.sessions()), st["kv_blocks_used"])


def test_damaged_session_files_load_nothing(engine: Engine, tmp_path: Path) -> None:
    """300 random truncations and bit flips of a saved session (caught by the length and
    checksum), and 150 bit flips of the header and state re-signed with a valid checksum
    (caught by the field and state checks, or, in K/V rows the format cannot check, loaded
    as the rows they are): each raises SessionFileError or loads, nothing else; a refused
    file changes nothing; the engine answers as before."""
    rng = random.Random(20)
    good = tmp_path / "good.kvs"
    engine.generate(P1, max_tokens=8, session_id="keep")
    engine.save_session("keep", good)
    data = good.read_bytes()
    probe = engine.generate("Once upon a time", max_tokens=8).tokens
    n_head = int.from_bytes(data[20:24], "little")
    header, _ = read_session_file(good)
    assert data[32 : 32 + n_head] == json.dumps(header, separators=(",", ":")).encode()
    before = _state(engine)
    bad = tmp_path / "bad.kvs"
    refused = loaded = 0
    for i in range(450):
        if i < 150:
            damaged = data[: rng.randrange(len(data))]
        elif i < 300:
            flipped = bytearray(data)
            flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            damaged = bytes(flipped)
        else:
            # Re-signed: a flip in the header or the state's first 4 KiB, a valid checksum.
            body = bytearray(data[:-32])
            at = rng.randrange(32, min(len(body), 32 + n_head + 4096))
            body[at] ^= 1 << rng.randrange(8)
            damaged = bytes(body) + hashlib.sha256(body).digest()
        bad.write_bytes(damaged)
        try:
            engine.load_session(bad, session_id="new")
        except SessionFileError:
            refused += 1
            assert _state(engine) == before, i
            continue
        loaded += 1
        assert i >= 300, "an unsigned damaged file must never load"
        engine.drop_session("new")
    assert refused >= 300
    assert engine.generate("Once upon a time", max_tokens=8).tokens == probe
    engine.drop_session("keep")


_SAVER = textwrap.dedent(
    """
    import sys, time
    import kvserve.sessions as ks
    from kvserve import Engine

    real = ks._write_all

    def slow_disk(f, data):  # ~0.3 s a file: a kill lands mid-write most of the time
        for i in range(0, len(data), 1 << 18):
            real(f, data[i : i + (1 << 18)])
            f.flush()
            time.sleep(0.01)

    with Engine(sys.argv[1], threads=1, parallel=1, ctx_size=1024) as e:
        e.generate("The capital of France is", max_tokens=4, session_id="short")
        e.generate(" ".join(f"w{i}" for i in range(200)), max_tokens=4, session_id="long")
        e.save_session("short", sys.argv[2])
        ks._write_all = slow_disk
        print("ready", flush=True)
        i = 0
        while True:
            e.save_session("long" if i % 2 == 0 else "short", sys.argv[2])
            print("saved", i, flush=True)
            i += 1
    """
)


def test_a_save_killed_mid_write_leaves_the_old_file(
    engine: Engine, model_path: Path, tmp_path: Path
) -> None:
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    path = tmp_path / "s.kvs"
    rng = random.Random(7)
    mid_write = 0
    kills = 6
    for k in range(kills):
        with subprocess.Popen(
            [sys.executable, str(script), str(model_path), str(path)],
            stdout=subprocess.PIPE,
            text=True,
        ) as child:
            try:
                assert child.stdout is not None
                assert child.stdout.readline().strip() == "ready"
                time.sleep(rng.uniform(0.05, 0.9))
                child.send_signal(signal.SIGKILL)
                child.wait(timeout=30)
            finally:
                child.kill()
        assert child.returncode == -signal.SIGKILL
        temps = [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
        mid_write += bool(temps)
        # The file is the last one written whole: it reads, checks and loads.
        header, _ = read_session_file(path)
        assert header["session_id"] in ("short", "long"), k
        sid = engine.load_session(path, session_id=f"k{k}")
        assert engine.sessions()[-1].tokens == len(header["tokens"])
        engine.drop_session(sid)
        # The next server start removes the killed save's temporary file, nothing else.
        with Engine(model_path, threads=1, parallel=1, ctx_size=64) as e2:
            create_app(ServerConfig(session_dir=str(tmp_path)), engine=e2)
        assert sorted(os.listdir(tmp_path)) == ["s.kvs", "saver.py"]
    assert mid_write >= kills // 2, f"only {mid_write} of {kills} kills landed mid-write"


def test_only_dead_writers_temporary_files_are_removed(tmp_path: Path) -> None:
    """A temporary file names its writer's pid: one of a process that is gone is removed, one
    of a live process (another server saving into the same directory, or this one) is kept,
    and files that are not a save's temporary files are never touched."""
    from kvserve.sessions import remove_stale_temps

    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as live:
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        dead_pid = int(dead.stdout)
        names = {
            f".s.kvs.{dead_pid}.{'a' * 32}.tmp": False,
            f".s.kvs.{live.pid}.{'b' * 32}.tmp": True,
            f".s.kvs.{os.getpid()}.{'c' * 32}.tmp": True,
            "s.kvs": True,
            ".s.kvs.tmp": True,
            f".s.kvs.{'d' * 32}.tmp": True,  # no pid: not this writer's name
        }
        (tmp_path / "t").mkdir()
        for name in names:
            (tmp_path / "t" / name).write_bytes(b"x")
        removed = remove_stale_temps(tmp_path)
        live.kill()
    assert [p.name for p in removed] == [f".s.kvs.{dead_pid}.{'a' * 32}.tmp"]
    assert {n: (tmp_path / "t" / n).exists() for n in names} == names
