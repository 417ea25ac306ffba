"""`kvserve serve --replicas 2`: two Engine replicas on a local Ray Serve instance behind one
OpenAI-compatible ingress (python/kvserve/cluster/), as a subprocess on a loopback port.

Oracles: one in-process `kvserve.Engine` with the same settings for every greedy answer
(streamed or not); the ingress's `x-kvserve-replica` / `x-kvserve-route` headers and its
`/metrics` (what the router believes each replica holds, from their KV events) for where
requests went; the answering replica's `cached_tokens` for whether it really held the prefix.

Ray Serve is needed (`pip install kvserve[cluster]`, in scripts/test.sh's requirements); the
test fails, never skips, without it. Ray's start dominates its time (measured on the 2-core
development machine: ~15 s to the first healthy answer, ~5 s to stop; docs/CLUSTER.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve import Engine

CTX = 2048
MAX_TOKENS = 12
# A ~600-token system prompt shared by every question (a long shared prefix, as a fleet's
# system prompt would be).
SYSTEM = " ".join(
    f"Rule {i}: the keeper of lighthouse {i} logs every ship, its flag and the hour it passed."
    for i in range(30)
)
QUESTIONS = ["Which rule is the first?", "What does the keeper log?", "Name one lighthouse."]
ORIGIN = "http://app.example"  # --cors-origins: the ingress answers for CORS


def _chat(question: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


class Cluster:
    """`kvserve serve --replicas 2` as a subprocess; its log goes to a file."""

    def __init__(self, model: Path, log: Path) -> None:
        self.log = log
        self.out = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve", "serve", "--replicas", "2", "-m", str(model),
             "--port", "0", "-t", "1", "-np", "2", "-c", str(CTX), "--cors-origins", ORIGIN],
            stdout=self.out,
            stderr=subprocess.STDOUT,
            env={**os.environ},
        )  # fmt: skip
        self.url = self._wait_for_port()
        self._wait_healthy()
        self.ready_s = time.monotonic() - self.started

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def _wait_for_port(self) -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                pytest.fail(f"kvserve serve --replicas exited ({code}):\n{self.text()}")
            m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", self.text())
            if m:
                return m.group(1)
            time.sleep(0.2)
        pytest.fail(f"kvserve serve --replicas did not start listening:\n{self.text()}")

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = httpx.get(f"{self.url}/health")
            if r.status_code == 200 and set(r.json()["replicas"].values()) == {"ok"}:
                return
            time.sleep(0.2)
        pytest.fail(f"the replicas never became healthy:\n{self.text()}")

    def stop(self) -> float:
        t0 = time.monotonic()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        return time.monotonic() - t0


@pytest.fixture(scope="module")
def cluster(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if importlib.util.find_spec("ray") is None:
        pytest.fail(
            "tests/test_cluster.py needs Ray Serve: pip install 'kvserve[cluster]' (or"
            " 'ray[serve]>=2.40'); scripts/test.sh installs it"
        )
    c = Cluster(model_path, tmp_path_factory.mktemp("cluster") / "serve.log")
    print(f"\nkvserve serve --replicas 2: healthy after {c.ready_s:.1f}s")
    yield c
    print(f"stopped in {c.stop():.1f}s")
    # SIGTERM: uvicorn drains, re-raises the signal, Ray's handler exits with its number; the
    # replicas' deployments were deleted on the way out.
    assert c.proc.returncode in (0, 15, -15), c.text()[-3000:]
    assert "Deleting app ['kvserve-replica-1']" in c.text()


@pytest.fixture(scope="module")
def oracle(model_path: Path) -> Iterator[Engine]:
    with Engine(model_path, threads=1, parallel=2, ctx_size=CTX, max_tokens_limit=CTX) as eng:
        yield eng


def _post(c: Cluster, body: dict[str, Any]) -> httpx.Response:
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, **body}
    r = httpx.post(f"{c.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _held(c: Cluster) -> dict[str, int]:
    """What the router believes each replica holds (blocks), from its /metrics."""
    text = httpx.get(f"{c.url}/metrics").text
    return {
        m.group(1): int(float(m.group(2)))
        for m in re.finditer(r'kvserve_router_replica_blocks\{replica="([^"]+)"\} (\S+)', text)
    }


def test_models_and_health_through_the_ingress(cluster: Cluster, model_path: Path) -> None:
    r = httpx.get(f"{cluster.url}/v1/models")
    assert r.status_code == 200
    assert r.headers["x-kvserve-replica"].startswith("kvserve-replica-")
    (m,) = r.json()["data"]
    assert (m["id"], m["object"]) == (model_path.stem, "model")
    assert set(httpx.get(f"{cluster.url}/health").json()["replicas"]) == {
        "kvserve-replica-0",
        "kvserve-replica-1",
    }


def test_cors_at_the_ingress(cluster: Cluster) -> None:
    """--cors-origins: the ingress answers preflights itself and puts the headers on every
    answer once (the replicas run without), exposing its routing headers too."""
    ask = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{cluster.url}/v1/chat/completions", headers=ask)
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-kvserve-replica" not in r.headers  # no replica was asked
    for r in (
        httpx.get(f"{cluster.url}/v1/models", headers={"Origin": ORIGIN}),  # a replica's
        httpx.get(f"{cluster.url}/health", headers={"Origin": ORIGIN}),  # the ingress's own
    ):
        assert r.status_code == 200
        assert r.headers.get_list("access-control-allow-origin") == [ORIGIN]
        exposed = r.headers["access-control-expose-headers"].lower()
        assert "x-kvserve-replica" in exposed and "x-request-id" in exposed
    r = httpx.get(f"{cluster.url}/v1/models", headers={"Origin": "http://other.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_a_body_over_the_limit_is_refused_at_the_ingress(cluster: Cluster) -> None:
    """The ingress refuses a body larger than the replicas accept (1 MiB at this ctx-size)
    before reading it (by its Content-Length) or once it passes the limit (chunked), as the
    single-box server does, instead of holding it in memory; a body under it goes through."""
    big = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
    r = httpx.post(f"{cluster.url}/v1/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert "x-kvserve-replica" not in r.headers, "refused before any replica"

    def chunked() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}'

    r = httpx.post(f"{cluster.url}/v1/completions", content=chunked())
    assert r.status_code == 413
    r = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200


def test_a_repeated_prefix_goes_to_the_replica_that_holds_it(
    cluster: Cluster, oracle: Engine
) -> None:
    first = _post(cluster, {"messages": _chat(QUESTIONS[0])})
    holder = first.headers["x-kvserve-replica"]
    want = oracle.chat(_chat(QUESTIONS[0]), max_tokens=MAX_TOKENS, temperature=0)
    assert first.json()["choices"][0]["message"]["content"] == want.text
    prefix_blocks = len(oracle.model.tokenize_chat(_chat(QUESTIONS[0]))) // 16
    assert prefix_blocks >= 35, "a ~600-token shared prefix"
    # The holder's KV events reach the router: it now believes the holder has the prefix.
    deadline = time.monotonic() + 10
    while _held(cluster).get(holder, 0) < prefix_blocks:
        assert time.monotonic() < deadline, _held(cluster)
        time.sleep(0.1)
    other = next(n for n in _held(cluster) if n != holder)
    assert _held(cluster)[other] == 0
    for q in QUESTIONS[1:]:
        r = _post(cluster, {"messages": _chat(q)})
        assert r.headers["x-kvserve-replica"] == holder
        assert r.headers["x-kvserve-route"] == "prefix"
        shared = len(oracle.model.tokenize_chat(_chat(q)))
        assert int(r.headers["x-kvserve-prefix-blocks"]) >= prefix_blocks - 2
        body = r.json()
        # The holder really served the shared system prompt from its cache.
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * (prefix_blocks - 2)
        assert body["usage"]["prompt_tokens"] == shared
        want = oracle.chat(_chat(q), max_tokens=MAX_TOKENS, temperature=0)
        assert body["choices"][0]["message"]["content"] == want.text
    # A stream through the ingress: the same greedy text, chunk by chunk.
    with httpx.stream(
        "POST",
        f"{cluster.url}/v1/chat/completions",
        json={"messages": _chat(QUESTIONS[0]), "max_tokens": MAX_TOKENS, "temperature": 0,
              "stream": True},
        timeout=120,
    ) as s:  # fmt: skip
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        assert s.headers["x-kvserve-replica"] == holder
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(
        json.loads(ln[6:])["choices"][0]["delta"].get("content", "") for ln in lines[:-1]
    )
    assert text == oracle.chat(_chat(QUESTIONS[0]), max_tokens=MAX_TOKENS, temperature=0).text


def test_a_session_sticks_to_its_replica(cluster: Cluster, oracle: Engine) -> None:
    system = "You answer in one short sentence about ships and lighthouses."
    turns: list[dict[str, str]] = [{"role": "system", "content": system}]
    where: set[str] = set()
    for i, q in enumerate(["Hello there.", "What is a lighthouse?", "And a ship?"]):
        turns.append({"role": "user", "content": q})
        r = _post(cluster, {"messages": turns, "session_id": "voyage"})
        where.add(r.headers["x-kvserve-replica"])
        if i > 0:
            assert r.headers["x-kvserve-route"] == "session"
            # The session's replica holds the conversation so far.
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        reply = r.json()["choices"][0]["message"]["content"]
        want = oracle.chat(turns, max_tokens=MAX_TOKENS, temperature=0)
        assert reply == want.text
        turns.append({"role": "assistant", "content": reply})
    assert len(where) == 1
    # The session lives on that replica (the replica's own session route says so).
    (name,) = where
    r = httpx.get(f"{cluster.url}/v1/sessions/voyage")
    assert (r.status_code, r.headers["x-kvserve-replica"]) == (200, name), r.text


_NO_RAY = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray' (blocked by the test)")
sys.meta_path.insert(0, _Block())
from kvserve.cli import main
"""


def test_replicas_without_ray_is_a_clear_error_and_serve_never_imports_ray(
    model_path: Path,
) -> None:
    code = _NO_RAY + f"sys.exit(main(['serve', '--replicas', '2', '-m', {str(model_path)!r}]))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "pip install kvserve[cluster]" in r.stderr
    assert r.stderr.count("\n") == 1, "one line"
    # The single-box server's whole path (CLI, config, app, engine package, the cluster
    # package's router) imports no Ray.
    code = _NO_RAY + (
        "import kvserve.server, kvserve.server.app, kvserve.cluster, kvserve.engine\n"
        "from kvserve.cli import build_parser, serve_config\n"
        "serve_config(build_parser().parse_args(['serve']))\n"
        "assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
