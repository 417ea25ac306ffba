"""``request``: the HTTP server's request parsing under atheris (coverage-guided, libFuzzer).

Input: one selector byte and the rest. The selector's low bits pick the route (completions,
chat, tokenize, detokenize, apply-template, sessions/restore: ``byte % 6``); with its top bit
clear the rest is the request body's bytes as they are, with it set the rest drives a
generator of JSON objects of the route's fields, each present or not, with values mostly of
the field's declared type (nested models and unions included) and now and then of any JSON
type, extreme numbers (``NaN``, ``Infinity``, 2**65) and odd strings included, plus now and
then an unknown field, so that the fuzzer reaches past JSON syntax and strict validation
(pydantic's parser is not instrumented). The body goes through what the server does before
it reaches the engine: the pydantic model of the route (``model_validate_json``, strict),
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
import types
import typing
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
    return {fdp.PickValueInList(_EXTRA_FIELDS): _value(fdp, depth + 1)}


def _typed(fdp: atheris.FuzzedDataProvider, ann: Any, depth: int) -> Any:
    """A value of the type ``ann`` (a field's annotation) most of the time, else any value."""
    if depth > 4 or fdp.ConsumeIntInRange(0, 15) == 0:
        return _value(fdp, depth)
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Union or origin is types.UnionType:
        return _typed(fdp, fdp.PickValueInList(list(args)), depth)
    if origin is typing.Literal:
        return fdp.PickValueInList(list(args))
    if origin is list:
        return [_typed(fdp, args[0], depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    if origin is dict:
        n = fdp.ConsumeIntInRange(0, 4)
        return {str(_value(fdp, 3)): _typed(fdp, args[1], depth + 1) for _ in range(n)}
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return _object(fdp, ann, depth + 1)
    if ann is bool:
        return fdp.ConsumeBool()
    if ann is int:
        if fdp.ConsumeBool():
            return fdp.ConsumeIntInRange(-3, 70)
        return fdp.ConsumeIntInRange(-(2**65), 2**65)
    if ann is float:
        return fdp.ConsumeFloat() if fdp.ConsumeBool() else fdp.ConsumeIntInRange(-2, 3) / 2
    if ann is str:
        return _value(fdp, 3) if fdp.ConsumeIntInRange(0, 7) == 0 else _string(fdp)
    return None if ann is type(None) else _value(fdp, depth)


def _string(fdp: atheris.FuzzedDataProvider) -> str:
    if fdp.ConsumeBool():
        return str(fdp.PickValueInList(_STRINGS))
    return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))


def _object(fdp: atheris.FuzzedDataProvider, model: type[BaseModel], depth: int) -> dict[str, Any]:
    """An object of ``model``'s fields (each present or not) with mostly well-typed values,
    now and then an unknown field."""
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if info.is_required() or fdp.ConsumeIntInRange(0, 3) == 0:
            out[name] = _typed(fdp, info.annotation, depth)
    if fdp.ConsumeIntInRange(0, 15) == 0:
        out[fdp.PickValueInList(_EXTRA_FIELDS)] = _value(fdp, depth + 1)
    return out


def _generated(model: type[BaseModel], rest: bytes) -> bytes:
    fdp = atheris.FuzzedDataProvider(rest)
    return json.dumps(_object(fdp, model, 0)).encode()  # NaN, Infinity as JavaScript writes them


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
