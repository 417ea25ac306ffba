"""CORS (python/kvserve/server/cors.py, ``kvserve serve --cors-origins``): what a browser sends
and needs, checked header by header against the Fetch standard's rules, on a server with an
API key: the preflight (which never carries the key) answered 204 before the key is checked;
``Access-Control-Allow-Origin`` (and ``Vary: Origin``) on answers, errors, 401s and streams;
nothing for an origin not on the list; and no CORS headers at all without the flag."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve import Engine
from kvserve.server.app import create_app
from kvserve.server.config import ServerConfig
from kvserve.server.cors import parse_origins
from kvserve.testing import live_server

APP = "http://app.example:3000"
OTHER = "https://other.example"
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    # What the official JS client asks for besides the key (dangerouslyAllowBrowser).
    "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,x-stainless-lang",
}


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[Engine]:
    with Engine(model_path, threads=1, parallel=2, ctx_size=256) as e:
        yield e


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    config = ServerConfig(api_key=KEY, cors_origins=[APP, "http://localhost:8000"])
    with live_server(create_app(config, engine=engine)) as u:
        yield u


def _cors(r: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.startswith("access-control-")}


def _vary(r: httpx.Response) -> set[str]:
    return {v.strip().lower() for v in r.headers.get("vary", "").split(",") if v.strip()}


def test_a_browser_preflight_is_answered_without_the_api_key(url: str) -> None:
    r = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": APP, **PREFLIGHT})
    assert r.status_code == 204, r.text
    assert r.content == b""
    assert r.headers["access-control-allow-origin"] == APP
    methods = {m.strip() for m in r.headers["access-control-allow-methods"].split(",")}
    assert {"GET", "POST", "DELETE"} <= methods
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os", "x-stainless-lang"} <= allowed
    assert int(r.headers["access-control-max-age"]) > 0
    assert "origin" in _vary(r)
    assert "access-control-allow-credentials" not in r.headers  # keys, never cookies
    # Every route the browser may preflight, the key-free /health and an unknown path alike.
    for path in ("/v1/models", "/v1/sessions/abc", "/health", "/nowhere"):
        r = httpx.options(f"{url}{path}", headers={"Origin": "http://localhost:8000", **PREFLIGHT})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == (
            "http://localhost:8000"
        ), path
    # A header name that is not an HTTP token is not echoed back.
    bad = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x y, a:b"}
    r = httpx.options(f"{url}/v1/models", headers={"Origin": APP, **bad})
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    assert allowed == {"authorization", "content-type"}


def test_answers_errors_and_streams_carry_the_origin(url: str) -> None:
    def check(r: httpx.Response) -> None:
        assert r.headers["access-control-allow-origin"] == APP
        assert "origin" in _vary(r)
        exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
        assert {"x-request-id", "retry-after", "www-authenticate"} <= exposed
        assert "x-request-id" in r.headers  # what the exposed name lets a page read

    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    h = {"Origin": APP, **AUTH}
    ok = httpx.post(f"{url}/v1/completions", json=body, headers=h, timeout=60)
    assert ok.status_code == 200, ok.text
    check(ok)
    # A 401 (the key missing: the page still reads the error), a 400, a 404.
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"Origin": APP}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    check(r)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": 5}, headers=h, timeout=60)
    assert r.status_code == 400
    check(r)
    r = httpx.get(f"{url}/v1/nothing", headers=h, timeout=60)
    assert r.status_code == 404
    check(r)
    # A stream: the headers come with the response's start; the events are the usual ones.
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=h, timeout=60
    ) as s:
        assert s.status_code == 200
        check(s)
        text = "".join(s.iter_text())
    assert text.endswith("data: [DONE]\n\n")
    streamed = "".join(
        c["text"]
        for line in text.splitlines()
        if line.startswith("data: {")
        for c in json.loads(line[6:])["choices"]
    )
    assert streamed == ok.json()["choices"][0]["text"]


def test_an_origin_not_on_the_list_gets_no_cors_headers(url: str) -> None:
    r = httpx.options(f"{url}/v1/completions", headers={"Origin": OTHER, **PREFLIGHT})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cors_origin_refused"
    assert _cors(r) == {}
    body = {"prompt": "Hi", "max_tokens": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"Origin": OTHER, **AUTH})
    assert r.status_code == 200 and _cors(r) == {}  # served: the browser withholds it
    assert "origin" in _vary(r)  # a cache keeps the origins' answers apart
    # An origin differs by scheme or port: the same host over https is another origin.
    r = httpx.get(f"{url}/v1/models", headers={"Origin": "https://app.example:3000", **AUTH})
    assert r.status_code == 200 and _cors(r) == {}
    # No Origin (curl, an SDK): an OPTIONS is no preflight and goes through the gate.
    r = httpx.options(f"{url}/v1/models", headers=AUTH)
    assert r.status_code == 405 and _cors(r) == {}


def test_any_origin_and_no_cors(engine: Engine) -> None:
    with live_server(create_app(ServerConfig(cors_origins=["*"]), engine=engine)) as u:
        r = httpx.options(f"{u}/v1/models", headers={"Origin": OTHER, **PREFLIGHT})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.get(f"{u}/v1/models", headers={"Origin": OTHER})
        assert r.headers["access-control-allow-origin"] == "*"
        assert "origin" not in _vary(r)  # the same answer for every origin
    # Without --cors-origins: no CORS headers at all; a preflight is refused as before.
    with live_server(create_app(ServerConfig(api_key=KEY), engine=engine)) as u:
        r = httpx.get(f"{u}/v1/models", headers={"Origin": APP, **AUTH})
        assert r.status_code == 200 and _cors(r) == {} and "origin" not in _vary(r)
        r = httpx.options(f"{u}/v1/models", headers={"Origin": APP, **PREFLIGHT})
        assert r.status_code == 401 and _cors(r) == {}


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("http://a.example,https://b.example:8443", ("http://a.example", "https://b.example:8443")),
        (" http://a.example , http://a.example ,", ("http://a.example",)),
        ("*", ("*",)),
        ("", None),
        ("null", ("null",)),
    ],
)
def test_parse_origins(text: str, want: tuple[str, ...] | None) -> None:
    assert parse_origins(text) == want


@pytest.mark.parametrize(
    ("text", "word"),
    [
        ("http://a.example/", "trailing slash"),
        ("a.example", "scheme://host"),
        ("http://a.example/app", "no path"),
        ("*,http://a.example", "alone"),
    ],
)
def test_parse_origins_refuses_what_no_browser_sends(text: str, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        parse_origins(text)
