"""``request``: the HTTP server's request parsing under atheris (coverage-guided, libFuzzer).

Input: one selector byte (the route: completions, chat, tokenize, detokenize, apply-template,
sessions/restore) and the request body's bytes. The body goes through what the server does
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

import sys

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
    model = ROUTES[data[0] % len(ROUTES)]
    try:
        body = model.model_validate_json(data[1:])
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
