"""Faults driven through the HTTP server under load (issue 20): every fault point of the
engine's fault hook (kvserve.testing) fired for one client's requests while others run; a
client that leaves at every stage of its request. Oracles: the same requests on the same
server without the fault (greedy outputs), the engine's K/V baseline, and the counters of
computed tokens."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve import Engine, Model
from kvserve.server import ServerConfig, create_app
from kvserve.testing import inject, live_server, prompt_is

OTHERS = [
    f"Story {i}: the old lighthouse keeper and the {w}"
    for i, w in enumerate("fox owl cat dog".split())
]
VICTIM = "The victim's request: tell me about the weather in the mountains"


class Live:
    def __init__(self, url: str, engine: Engine) -> None:
        self.url = url
        self.engine = engine


@pytest.fixture(scope="module")
def live(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    sessions = tmp_path_factory.mktemp("sessions")
    with Engine(
        Model.load(model_path, threads=2), parallel=4, ctx_size=512, batch_tokens=64
    ) as engine:
        config = ServerConfig(max_queue=64, session_dir=str(sessions))
        with live_server(create_app(config, engine=engine)) as url:
            yield Live(url, engine)


def _complete(url: str, prompt: str, stream: bool, n: int = 1) -> Any:
    """(status, texts by choice, error or None) of one completion request."""
    body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stream": stream, "n": n}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        if r.status_code != 200:
            return r.status_code, None, r.json()["error"]
        return 200, [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])], None
    texts = [""] * n
    error = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, None, r.json()["error"]
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    for x in lines[:-1]:
        event = json.loads(x)
        if "error" in event:
            error = event["error"]
            continue
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
    return 200, texts, error


def _load(url: str, victim: str, n_victim: int = 1) -> dict[str, Any]:
    """Every OTHERS prompt streamed and not, beside the victim's two requests, at once."""
    jobs = [(p, s, 1) for p in OTHERS for s in (False, True)]
    jobs += [(victim, False, n_victim), (victim, True, n_victim)]
    out: dict[str, Any] = {}

    def run(job: tuple[str, bool, int]) -> None:
        out[f"{job[0]}|{job[1]}"] = _complete(url, *job)

    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def _baseline(e: Engine) -> int:
    deadline = time.monotonic() + 30
    while (st := e.stats())["running"] or st["waiting"]:
        assert time.monotonic() < deadline, st
        time.sleep(0.02)
    return int(st["kv_blocks_used"])


@pytest.mark.parametrize(
    "point", ["accept", "admit", "prefix_match", "fork", "decode", "panic", "sample", "deliver"]
)
def test_a_fault_fails_only_its_requests(live: Live, point: str) -> None:
    e = live.engine
    n = 2 if point == "fork" else 1
    clean = _load(live.url, VICTIM, n)
    assert all(v[0] == 200 and v[2] is None for v in clean.values()), clean
    base = _baseline(e)
    ids = e.model.tokenize(VICTIM, add_special=True, parse_special=True)
    with inject(e, point, times=None, request=prompt_is(ids)) as fault:
        got = _load(live.url, VICTIM, n)
    assert fault.fired > 0
    for key, (status, texts, error) in got.items():
        if key.startswith(VICTIM):
            # A 500 with a message; a stream that started: an error event, then [DONE].
            assert (status == 500 and error is not None) or (status == 200 and error), key
            if point == "panic":  # a real panic in the core: the context was replaced
                assert error["code"] == "engine_error" and "closed" in error["message"], error
            else:
                assert error["code"] == "internal_error" and point in error["message"], error
        else:
            assert (status, texts, error) == clean[key], key
    assert _baseline(e) == base
    assert httpx.get(f"{live.url}/health").status_code == 200
    assert _complete(live.url, VICTIM, False, n) == clean[f"{VICTIM}|False"]


def test_session_faults_over_http(live: Live) -> None:
    url, e = live.url, live.engine
    chat = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "session_id": "f"})
    assert r.status_code == 200, r.text
    with inject(e, "session_save", times=None):
        r = httpx.post(f"{url}/v1/sessions/f/save")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
    assert httpx.post(f"{url}/v1/sessions/f/save").status_code == 200
    assert httpx.delete(f"{url}/v1/sessions/f").status_code == 200
    base = _baseline(e)
    with inject(e, "session_load", times=None):
        r = httpx.post(f"{url}/v1/sessions/restore", json={"id": "f"})
    assert r.status_code == 500 and "session_load" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{url}/v1/sessions/f").status_code == 404, "nothing was loaded"
    assert _baseline(e) == base
    r = httpx.post(f"{url}/v1/sessions/restore", json={"id": "f"})
    assert r.status_code == 200, r.text
    httpx.delete(f"{url}/v1/sessions/f")


def test_a_client_that_leaves_at_any_stage_costs_at_most_a_step(live: Live) -> None:
    """Queued (every slot taken), mid-prefill (a long prompt computed in chunks), mid-decode
    and between SSE events: the request is dropped at the next step, so at most one more
    chunk of its prompt is computed after the client left, and the K/V returns to its
    baseline."""
    url, e = live.url, live.engine
    base = _baseline(e)
    long_prompt = " ".join(f"w{i}" for i in range(110))  # ~220 tokens: several chunks

    def leave(prompt: str, when: str, max_tokens: int = 200) -> int:
        """Streams ``prompt`` and leaves at ``when``; the tokens computed after leaving."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        start = int(e.stats()["computed_tokens"])
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            if when == "prefill":  # a chunk of its prompt is computed, not all of it
                while int(e.stats()["computed_tokens"]) < start + 64:
                    time.sleep(0.002)
                assert e.stats()["computed_tokens"] < start + 256
            elif when == "decode":
                next(x for x in lines if x.startswith("data: "))
            elif when == "between events":
                for _ in range(3):
                    next(x for x in lines if x.startswith("data: "))
            left = int(e.stats()["computed_tokens"])
        _baseline(e)
        return int(e.stats()["computed_tokens"]) - left

    # Queued: four streams hold every slot; a fifth request waits, and its client gives up.
    holders = [f"Holder {i}" for i in range(4)]
    n_holders = sum(len(e.model.tokenize(h, add_special=True, parse_special=True)) for h in holders)

    def hold(prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": 60, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200

    threads = [threading.Thread(target=hold, args=(h,)) for h in holders]
    before = e.stats()
    for t in threads:
        t.start()
    while e.stats()["running"] < 4:
        time.sleep(0.005)
    body = {"prompt": "A queued request", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200  # the stream's headers: it is queued, then leaves
    assert e.stats()["running"] == 4, "the holders still run: it was queued when it left"
    for t in threads:
        t.join(60)
    _baseline(e)
    after = e.stats()
    assert after["prompt_tokens"] - before["prompt_tokens"] == n_holders, "never admitted"
    assert after["cancelled_requests"] - before["cancelled_requests"] == 1
    # Mid-prefill: leave right after sending (the answer's headers came: it is admitted).
    after = leave(long_prompt, "prefill")
    assert after <= 64 + 4, after  # at most the chunk that was running (batch_tokens)
    for when in ("decode", "between events"):
        after = leave(long_prompt, when)
        assert after <= 2, (when, after)  # at most the decode step that was running
    assert _baseline(e) == base


def test_a_fault_while_dropping_a_cancelled_request(live: Live) -> None:
    """The ``drop`` point: removing the request of a client that left fails; the engine
    contains it (the request's K/V is released all the same) and the others' outputs are
    unchanged."""
    e = live.engine
    clean = {p: _complete(live.url, p, False) for p in OTHERS}
    base = _baseline(e)
    ids = e.model.tokenize(VICTIM, add_special=True, parse_special=True)
    out: dict[str, Any] = {}

    def other(p: str) -> None:
        out[p] = _complete(live.url, p, False)

    with inject(e, "drop", times=None, request=prompt_is(ids)) as fault:
        threads = [threading.Thread(target=other, args=(p,)) for p in OTHERS]
        for t in threads:
            t.start()
        body = {"prompt": VICTIM, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
            next(x for x in r.iter_lines() if x.startswith("data: "))  # then leaves
        for t in threads:
            t.join(120)
        assert _baseline(e) == base
    assert fault.fired > 0
    assert out == clean
    assert httpx.get(f"{live.url}/health").status_code == 200
