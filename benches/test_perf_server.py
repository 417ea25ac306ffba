"""``kvserve serve`` end to end: one streamed completion over loopback HTTP, from sending the
request to reading ``data: [DONE]``.

Group ``server``. The server is a ``python -m kvserve serve`` subprocess on a free port (as
tests/test_server.py starts it); the client is httpx in this process. The request is greedy,
16 tokens (``ignore_eos``) after a short prompt: HTTP, validation, the engine's queue, prefill,
16 decode steps and 16 server-sent events. ``extra_info`` records the time to the first chunk
of the last round.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

PROMPT = "The three most useful things to pack for a week of hiking are"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server_url(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvserve",
                "serve",
                "--model",
                str(model_path),
                "--port",
                "0",
                "--parallel",
                "4",
                "--ctx-size",
                "1024",
                "--kv-memory",
                "64MiB",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )
        try:
            yield _wait_ready(proc, log)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + 120
    url = None
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if proc.poll() is not None:
            pytest.fail(f"kvserve serve exited with {proc.returncode}:\n{text}")
        m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", text)
        if m:
            url = m.group(1)
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    pytest.fail(f"kvserve serve was not ready in 120 s:\n{log.read_text(errors='replace')}")


@pytest.mark.benchmark(group="server")
def test_server_stream_16_tokens(benchmark, server_url: str, rounds: int) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    first: list[float] = []

    with httpx.Client(base_url=server_url, timeout=120) as client:

        def request() -> dict:
            t0 = time.perf_counter()
            usage: dict = {}
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                seen_first = False
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if not seen_first:
                        first.append(time.perf_counter() - t0)
                        seen_first = True
                    if line == "data: [DONE]":
                        break
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
            return usage

        usage = benchmark.pedantic(request, rounds=rounds * 2, warmup_rounds=1)
    assert usage.get("completion_tokens") == MAX_TOKENS, usage
    benchmark.extra_info["first_chunk_s"] = round(first[-1], 4)
