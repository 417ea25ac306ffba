"""Structured output (kvserve.grammar, engine.constrain; issue 22).

Oracle: the ``jsonschema`` package validates every output against the schema it was asked for
(on both models, greedy and seeded sampling); a GBNF grammar's outputs are checked against the
language it defines by hand; llguidance's own numpy helper is the reference for how a bitmask
becomes a logits mask; a free request batched with constrained ones gives exactly the text it
gives alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from pydantic import BaseModel, Field

from kvserve import Engine
from kvserve.engine.constrain import allowed_ids
from kvserve.grammar import MAX_SOURCE_CHARS, GrammarError, constraint_from
from kvserve.sampling import Sampler, SamplingParams
from kvserve.server.app import create_app
from kvserve.server.config import ServerConfig
from kvserve.testing import live_server

# Schemas whose every value is bounded (a 135M model left an unbounded string can fill its
# token budget with it): nested objects, enums, bounded arrays, number ranges, anyOf, patterns.
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                },
                "required": ["name", "id"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    "ranges": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 1, "maximum": 5},
            "score": {"type": "integer", "minimum": -20, "maximum": 20},
        },
        "required": ["count", "score"],
        "additionalProperties": False,
    },
    "anyof": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 100},
                    {"type": "string", "maxLength": 8},
                    {"type": "null"},
                ]
            }
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
        "required": ["code", "zip"],
        "additionalProperties": False,
    },
}

ASK = [{"role": "user", "content": "Answer with a JSON value describing a product."}]


def _rf(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


# -- without a model ---------------------------------------------------------------------------


def test_constraint_forms_and_errors_name_the_field() -> None:
    assert constraint_from() is None
    assert constraint_from(response_format={"type": "text"}) is None
    for rf in (
        {"type": "json_object"},
        {"type": "json_object", "schema": {"type": "object"}},  # llama-server's form
        {"type": "json_schema", "schema": {"type": "object"}},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "n"}},  # no schema: any object
    ):
        c = constraint_from(response_format=rf)
        assert c is not None and c.kind in ("json_object", "json_schema"), rf
    bad: list[tuple[dict[str, Any], str]] = [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": 3}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "schema": {}}, "grammar": "x"},
            "at most one",
        ),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"json_schema": "[1, 2]"}, "must be a JSON object"),
        ({"grammar": ""}, "grammar must be a non-empty string"),
        ({"grammar": "x" * (MAX_SOURCE_CHARS + 1)}, "more than the limit"),
        ({"json_schema": {"enum": ["x" * MAX_SOURCE_CHARS]}}, "more than the limit"),
    ]
    for kwargs, needle in bad:
        with pytest.raises(GrammarError, match=needle):
            constraint_from(**kwargs)


def test_allowed_ids_match_llguidance_reference() -> None:
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(1)
    for n_vocab in (49152, 1000, 33):
        words = rng.integers(-(2**31), 2**31, size=(n_vocab + 31) // 32, dtype=np.int64)
        words = words.astype(np.int32)
        ref = np.zeros((1, n_vocab), dtype=np.float32)
        apply_token_bitmask_inplace(ref, words[None, :])
        want = np.flatnonzero(np.isfinite(ref[0]))
        np.testing.assert_array_equal(allowed_ids(words, n_vocab), want)
        assert 0 < len(want) < n_vocab


def test_sampling_among_allowed_tokens_is_sampling_the_masked_row() -> None:
    """The sampler's ``allowed`` path (the chain run on the allowed tokens alone) draws exactly
    what the plain chain draws from the row with every other logit at -inf, with the same
    seed, for every kind of sampling setting."""
    rng = np.random.default_rng(7)
    n = 5000
    settings: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 0.0, "repeat_penalty": 1.3, "logit_bias": {3: 5.0, 4: -np.inf}},
        {"temperature": 0.8},
        {"temperature": 1.1, "top_k": 7},
        {"temperature": 1.0, "top_k": 4000},  # more than the allowed tokens
        {"temperature": 0.7, "top_p": 0.8},
        {"temperature": 0.9, "typical_p": 0.6, "min_p": 0.05},
        {"temperature": 1.0, "presence_penalty": 1.0, "frequency_penalty": 0.5},
    ]
    for k, params in enumerate(settings):
        for trial in range(6):
            row = (rng.standard_normal(n) * 2).astype(np.float32)
            keep = rng.random(n) < (0.002 if trial % 2 else 0.3)
            keep[[3, 10]] = True
            allowed = np.flatnonzero(keep)
            masked = np.where(keep, row, np.float32(-np.inf))
            history = rng.integers(0, n, size=40).tolist() + [3, 10]
            p = SamplingParams(**params)
            for seed in range(4):
                want = Sampler(p, seed=seed)(masked, history)
                got = Sampler(p, seed=seed)(row, history, allowed)
                assert got == want, (k, trial, seed, params)
                assert keep[got]


# -- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def engine(request: pytest.FixtureRequest, model_path: Path) -> Iterator[Engine]:
    path = model_path if request.param == "smollm2" else request.getfixturevalue("gemma_path")
    with Engine(path, parallel=16, ctx_size=1024) as e:
        yield e


async def _gather(engine: Engine, calls: list[dict[str, Any]]) -> list[Any]:
    return list(await asyncio.gather(*(engine.achat(**c) for c in calls)))


def test_outputs_validate_against_their_schemas(engine: Engine) -> None:
    """Every schema, greedy and seeded sampling, all in one batch with a free request: each
    output parses and validates; the free request's text is what it is alone."""
    calls: list[dict[str, Any]] = []
    for schema in SCHEMAS.values():
        calls.append({"response_format": _rf(schema), "temperature": 0})
        calls.append({"response_format": _rf(schema), "temperature": 0.9, "seed": 7})
    free = {"temperature": 0}
    alone = engine.chat(ASK, max_tokens=48, **free)
    before = engine.stats()
    results = asyncio.run(
        _gather(
            engine,
            [{"messages": ASK, "max_tokens": 160, **c} for c in calls]
            + [{"messages": ASK, "max_tokens": 48, **free}],
        )
    )
    *constrained, mixed = results
    assert mixed.text == alone.text  # sharing the batch changed nothing for it
    for call, r in zip(calls, constrained, strict=True):
        assert r.finish_reason == "stop", (call, r.text)
        value = json.loads(r.text)
        rf = call["response_format"]
        schema = rf["json_schema"]["schema"] if rf["type"] == "json_schema" else {"type": "object"}
        jsonschema.validate(value, schema)
    st = engine.stats()
    # One compile per distinct schema (the greedy and sampled requests share it), one mask per
    # constrained token.
    assert st["grammar_compiles"] - before["grammar_compiles"] <= len(SCHEMAS)
    assert st["grammar_cache_hits"] - before["grammar_cache_hits"] >= len(SCHEMAS)
    n_tokens = sum(len(r.tokens) for r in constrained)
    assert st["grammar_masks"] - before["grammar_masks"] >= n_tokens


def test_a_gbnf_grammar_and_choices(engine: Engine) -> None:
    """llama.cpp's GBNF: the output is a word of the grammar's language, generation stops
    when the grammar is complete (no end-of-generation token needed); n choices each follow
    it."""
    grammar = 'root ::= ("yes" | "no") ", because " [a-z]{1,12} "."'

    async def run() -> list[Any]:
        out = []
        async for d in engine.choices(
            "Is the sky blue? Answer:",
            max_tokens=40,
            n=3,
            grammar=grammar,
            temperature=1.0,
            seed=5,
        ):
            if d.result is not None:
                out.append(d.result)
        return out

    results = asyncio.run(run())
    assert len(results) == 3
    import re

    for r in results:
        assert re.fullmatch(r"(yes|no), because [a-z]{1,12}\.", r.text), r.text
        assert r.finish_reason == "stop"


def test_bad_constraints_fail_before_queueing(engine: Engine) -> None:
    before = engine.stats()["failed_requests"]
    for kwargs in (
        {"json_schema": {"type": "bogus"}},
        {"response_format": _rf({"type": "string", "format": "no-such-format"})},
        {"grammar": "root ::= missing_rule"},
    ):
        with pytest.raises(ValueError):
            engine.chat(ASK, max_tokens=4, **kwargs)  # type: ignore[arg-type]
    # strict false ignores what it cannot enforce
    r = engine.chat(
        ASK,
        max_tokens=24,
        response_format={
            "type": "json_schema",
            "json_schema": {
                "schema": {"type": "string", "format": "no-such-format", "maxLength": 8},
                "strict": False,
            },
        },
    )
    assert isinstance(json.loads(r.text), str)
    assert engine.stats()["failed_requests"] == before


# -- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(model_path: Path) -> Iterator[str]:
    engine = Engine(model_path, parallel=4, ctx_size=1024)
    cfg = ServerConfig(model=str(model_path), ctx_size=1024)
    with engine, live_server(create_app(cfg, engine=engine)) as url:
        yield url


class Product(BaseModel):
    name: str = Field(max_length=20)
    price: int = Field(ge=0, le=1000)
    tags: list[Annotated[str, Field(max_length=10)]] = Field(max_length=3)


def test_the_sdk_parses_into_a_pydantic_model(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    r = client.beta.chat.completions.parse(
        model="m", messages=ASK, response_format=Product, max_tokens=120, temperature=0
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Product) and r.choices[0].finish_reason == "stop"
    # Streamed json_object on the chat route, json_schema on the completions route.
    ask: dict[str, Any] = {
        "model": "m",
        "messages": ASK,
        "response_format": {"type": "json_object"},
        "max_tokens": 120,
        "temperature": 0,
    }
    stream = client.chat.completions.create(**ask, stream=True)
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    whole = client.chat.completions.create(**ask).choices[0]
    # The stream is the whole (constrained) answer; whether the model closes its object
    # within the limit or repeats an array's item up to it turns on the last digits of its
    # logits (greedy), which differ between builds and hosts.
    assert text == whole.message.content and finish == [whole.finish_reason]
    if whole.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert whole.finish_reason == "length" and text.startswith("{")
    body = {
        "prompt": "A product as JSON:",
        "max_tokens": 60,
        "temperature": 0,
        "response_format": _rf(SCHEMAS["enums"]),
    }
    res = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert res.status_code == 200, res.text
    jsonschema.validate(json.loads(res.json()["choices"][0]["text"]), SCHEMAS["enums"])


def test_an_invalid_schema_is_a_400_naming_it(base: str) -> None:
    url = f"{base}/v1/chat/completions"
    for body, param in (
        ({"response_format": _rf({"type": "bogus"})}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"grammar": "root ::= nope"}, "grammar"),
        ({"json_schema": {"type": 3}}, "json_schema"),
    ):
        r = httpx.post(url, json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param, err


def test_a_failed_mask_fails_only_the_constrained_requests(engine: Engine) -> None:
    """Masks that cannot be computed fail their requests alone (a GrammarError), not the
    batch: a free request decoding beside them finishes with its usual text."""
    loop = engine._loop
    fill = loop.masks._fill

    def broken(*args: Any) -> None:
        raise RuntimeError("mask computation broke")

    want = engine.chat(ASK, max_tokens=12, temperature=0).text
    loop.masks._fill = broken  # type: ignore[method-assign]
    try:
        calls = [{"messages": ASK, "max_tokens": 12, "json_schema": SCHEMAS["enums"]}] * 2
        calls.append({"messages": ASK, "max_tokens": 12, "temperature": 0})

        async def run() -> list[Any]:
            coros = (engine.achat(**c) for c in calls)
            return list(await asyncio.gather(*coros, return_exceptions=True))

        *bad, free = asyncio.run(run())
    finally:
        loop.masks._fill = fill  # type: ignore[method-assign]
    assert all(isinstance(b, GrammarError) for b in bad), bad
    assert free.text == want
    assert engine.chat(ASK, max_tokens=40, json_schema=SCHEMAS["enums"]).finish_reason == "stop"
