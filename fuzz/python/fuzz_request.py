"""``request``: the HTTP server's request parsing under atheris (coverage-guided, libFuzzer).

Input: one selector byte and the rest. The selector's low bits pick the route (completions,
chat, tokenize, detokenize, apply-template, sessions/restore: ``byte % 6``); with its top bit
clear the rest is the request body's bytes as they are, with it set the rest drives a
generator of JSON objects made of the route's field names (and unknown ones) with values of
every JSON type, nested, extreme numbers (``NaN``, ``1e400``, 2**64) and odd strings included,
so that the fuzzer reaches past JSON syntax (pydantic's parser is not instrumented). The body
goes through what the server does
before it reaches the engine: the pydantic model of the route (``model_validate_json``, strict),
the 400 built from a validation error, the engine options of the fields (``_options``,
``_logprobs_option``, the chat's ``top_logprobs`` rule, ``_prompts``), and
``kvserve.options.resolve`` as the engine runs it (its ``ValueError``/``TypeError`` answered as a
400 by ``_bad_value``).

Property: every body is either a valid request with resolved options or a 400 ``ApiError``
with a message; any other exception (or a non-400) is a finding.

Run through ``scripts/fuzz.sh request [SECONDS]`` (libFuzzer flags and corpus directories as
arguments: ``python fuzz/python/fuzz_request.py -max_total_time=60 DIR...``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import atheris

with atheris.instrument_imports(include=["kvserve"]):
    from pydantic import BaseModel, ValidationError

    from kvserve.options import resolve
    from kvserve.server import app
    from kvserve.server.http import ApiError
    from kvserve.server.schemas import (
        ChatRequest,
        CompletionRequest,
        DetokenizeRequest,
        RestoreRequest,
        TemplateRequest,
        TokenizeRequest,
    )

ROUTES: list[type[BaseModel]] = [
    CompletionRequest,
    ChatRequest,
    TokenizeRequest,
    DetokenizeRequest,
    TemplateRequest,
    RestoreRequest,
]
# SmolLM2's vocabulary: logit_bias ids are checked against it.
N_VOCAB = 49152


_EXTRA_FIELDS = ["unknown", "messages", "prompt", "role", "content", "type", "text"]
_STRINGS = ["", "user", "text", "a" * 300, "../x", "s\n", "\u2581", "-1", "1e5", "NaN"]


def _value(fdp: atheris.FuzzedDataProvider, depth: int) -> Any:
    kind = fdp.ConsumeIntInRange(0, 9 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-(2**65), 2**65)
    if kind == 3:
        return fdp.ConsumeIntInRange(-3, 70)
    if kind == 4:
        return fdp.ConsumeFloat()
    if kind == 5:
        if fdp.ConsumeBool():
            return fdp.PickValueInList(_STRINGS)
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
    if kind in (6, 7):
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    if kind == 8:
        return {"role": _value(fdp, depth + 1), "content": _value(fdp, depth + 1)}
    return _object(fdp, _EXTRA_FIELDS, depth + 1)


def _object(fdp: atheris.FuzzedDataProvider, fields: list[str], depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for _ in range(fdp.ConsumeIntInRange(0, 8)):
        name = fdp.PickValueInList(fields) if fdp.ConsumeIntInRange(0, 7) else str(_value(fdp, 3))
        out[name] = _value(fdp, depth)
    return out


def _generated(model: type[BaseModel], rest: bytes) -> bytes:
    fdp = atheris.FuzzedDataProvider(rest)
    body = _object(fdp, [*model.model_fields, *_EXTRA_FIELDS], 0)
    return json.dumps(body).encode()  # NaN and Infinity as JavaScript writes them


def _check_400(error: ApiError) -> None:
    if error.status != 400 or not error.message:
        got = f"{error.status}: {error.message!r}"
        raise AssertionError(f"expected a 400 with a message, got {got}")


def _generation(body: CompletionRequest | ChatRequest) -> None:
    try:
        if isinstance(body, CompletionRequest):
            options = app._logprobs_option(app._options(body), body.logprobs)
            app._prompts(body.prompt)
        else:
            options = app._options(body)
            if body.top_logprobs is not None and not body.logprobs:
                return  # the route's 400 ("top_logprobs needs logprobs: true")
            if body.logprobs:
                options = app._logprobs_option(options, body.top_logprobs or 0)
    except ApiError as error:
        _check_400(error)
        return
    try:
        resolve(options, n_vocab=N_VOCAB, engine=True)
    except (ValueError, TypeError) as error:
        _check_400(app._bad_value(error, "prompt"))


def test_one(data: bytes) -> None:
    if not data:
        return
    model = ROUTES[(data[0] & 0x7F) % len(ROUTES)]
    raw = _generated(model, data[1:]) if data[0] & 0x80 else data[1:]
    try:
        body = model.model_validate_json(raw)
    except ValidationError as error:
        _check_400(app._validation_error(error))
        return
    if isinstance(body, (CompletionRequest, ChatRequest)):
        _generation(body)


def main() -> None:
    atheris.Setup(sys.argv, test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
