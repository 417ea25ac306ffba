"""What real OpenAI clients send (issue 22, first step): the official client's own replies
handed back in a history (``model_dump()``), ``null`` for every nullable field, the standard
fields that change nothing here, llama-server's unprefixed routes, and ``system_fingerprint``.

Oracle: the same request without the extra fields (or with the fields absent instead of null)
gives the same greedy answer; fields that would change the output stay refused, naming the
field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvserve import Engine
from kvserve.server.app import create_app
from kvserve.server.config import ServerConfig
from kvserve.testing import live_server


@pytest.fixture(scope="module")
def base(model_path: Path) -> Iterator[str]:
    engine = Engine(model_path, parallel=4, ctx_size=1024)
    cfg = ServerConfig(model=str(model_path), ctx_size=1024)
    with engine, live_server(create_app(cfg, engine=engine)) as url:
        yield url


def _post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=120)


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return str(c["message"]["content"] if "message" in c else c["text"])


def test_the_clients_own_reply_goes_back_in_the_history(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    messages: list[Any] = [{"role": "user", "content": "Name a fruit."}]
    first = client.chat.completions.create(
        model="m", messages=messages, max_tokens=8, temperature=0
    )
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(dumped)
    messages.append(dumped)
    messages.append({"role": "user", "content": "And another?"})
    second = client.chat.completions.create(
        model="m", messages=messages, max_tokens=8, temperature=0
    )
    # The same history with the reply as plain role + content: the same answer.
    plain = [
        messages[0],
        {"role": "assistant", "content": dumped["content"]},
        messages[2],
    ]
    body = {"messages": plain, "max_tokens": 8, "temperature": 0}
    assert second.choices[0].message.content == _text(_post(base, "/v1/chat/completions", body))
    # An empty tool_calls list is accepted, and so is a real tool call (tests/test_tools.py
    # renders and answers them).
    extra = {"refusal": None, "annotations": [], "tool_calls": []}
    body = {"messages": [messages[0], {**plain[1], **extra}, messages[2]], "max_tokens": 8}
    body["temperature"] = 0
    assert _text(_post(base, "/v1/chat/completions", body)) == second.choices[0].message.content
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body["messages"][1]["tool_calls"] = [call]
    r = _post(base, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text


def test_nulls_are_defaults(base: str) -> None:
    msgs = [{"role": "user", "content": "Say hello."}]
    want = _text(_post(base, "/v1/chat/completions", {"messages": msgs, "temperature": 0}))
    nullable = (
        "stream", "n", "logprobs", "top_logprobs", "max_tokens", "max_completion_tokens",
        "top_p", "stop", "seed", "user", "stream_options", "presence_penalty",
        "frequency_penalty", "logit_bias", "session_id", "cache_salt", "priority", "model",
    )  # fmt: skip
    body: dict[str, Any] = {"messages": msgs, "temperature": 0, **dict.fromkeys(nullable)}
    assert _text(_post(base, "/v1/chat/completions", body)) == want
    prompt = "The capital of France is"
    want = _text(_post(base, "/v1/completions", {"prompt": prompt, "temperature": 0}))
    nulls = dict.fromkeys(("echo", "stream", "n", "logprobs", "suffix", "best_of", "max_tokens"))
    body = {"prompt": prompt, "temperature": 0, **nulls}
    assert _text(_post(base, "/v1/completions", body)) == want
    # A required field sent as null is missing.
    r = _post(base, "/v1/chat/completions", {"messages": None})
    assert r.status_code == 400 and "messages" in r.text


def test_fields_that_change_nothing_are_accepted_and_ones_that_would_are_refused(
    base: str,
) -> None:
    msgs = [{"role": "user", "content": "Count to three."}]
    want = _text(_post(base, "/v1/chat/completions", {"messages": msgs, "temperature": 0}))
    ignored = {
        "store": True,
        "metadata": {"team": "a"},
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "reasoning_effort": "low",
        "user": "u-1",
    }
    body = {"messages": msgs, "temperature": 0, **ignored}
    assert _text(_post(base, "/v1/chat/completions", body)) == want
    for field, value in (
        ("prediction", {"type": "content", "content": "x"}),
        ("modalities", ["text", "audio"]),
        ("response_formatx", {"type": "text"}),
    ):
        r = _post(base, "/v1/chat/completions", {"messages": msgs, field: value})
        assert r.status_code == 400 and field in r.text, (field, r.text)
    r = _post(base, "/v1/completions", {"prompt": "Hi", "suffix": "there"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_unprefixed_routes_and_the_fingerprint(base: str) -> None:
    msgs = [{"role": "user", "content": "Hi!"}]
    body = {"messages": msgs, "max_tokens": 6, "temperature": 0}
    a = _post(base, "/v1/chat/completions", body)
    b = _post(base, "/chat/completions", body)
    assert _text(a) == _text(b)
    fp = a.json()["system_fingerprint"]
    assert fp.startswith("kvserve-") and fp == b.json()["system_fingerprint"]
    c = _post(base, "/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0})
    assert _text(c) == _text(_post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 4,
                                                              "temperature": 0}))  # fmt: skip
    assert c.json()["system_fingerprint"] == fp
    models = httpx.get(f"{base}/models", timeout=30).json()
    assert models == httpx.get(f"{base}/v1/models", timeout=30).json()
    # Streamed chunks carry it too (the official client reads it from each chunk).
    client = openai.OpenAI(base_url=base, api_key="unused")  # the unprefixed base URL
    chunks = list(
        client.chat.completions.create(
            model="m", messages=msgs, max_tokens=4, temperature=0, stream=True
        )
    )
    assert chunks and all(ch.system_fingerprint == fp for ch in chunks)
