"""The documented limits of kvserve.options: each limit is accepted, one past it is a
ValueError naming the field and the limit."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from kvserve import options
from kvserve.options import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    PRIORITY_MAX,
    PRIORITY_MIN,
    resolve,
    stop_list,
)


def refused(opts: dict[str, Any], field: str, limit: int | None) -> None:
    with pytest.raises(ValueError) as info:
        resolve(opts, engine=True)  # type: ignore[arg-type]
    message = str(info.value)
    assert re.search(rf"\b{field}\b", message), message
    if limit is not None:
        assert str(limit) in message, message


def test_documented_values_are_exported() -> None:
    assert (MAX_STOPS, MAX_STOP_CHARS, MAX_LOGIT_BIAS) == (256, 512, 1024)
    assert (PRIORITY_MIN, PRIORITY_MAX) == (-1000, 1000)
    for name in ("MAX_STOPS", "MAX_STOP_CHARS", "MAX_LOGIT_BIAS", "PRIORITY_MIN", "PRIORITY_MAX"):
        assert name in options.__all__
        doc = (options.SamplingOptions.__doc__ or "") + (options.RequestOptions.__doc__ or "")
        assert name in doc


def test_stop_count_limit() -> None:
    stops = [f"s{i}" for i in range(MAX_STOPS)]
    assert resolve({"stop": stops}).stops == stops
    refused({"stop": [*stops, "one more"]}, "stop", MAX_STOPS)
    # Empty strings count as entries of the list too (they are then ignored).
    refused({"stop": [*stops, ""]}, "stop", MAX_STOPS)
    assert resolve({"stop": ("a", "", "b")}).stops == ["a", "b"]


def test_stop_length_limit() -> None:
    longest = "x" * MAX_STOP_CHARS
    assert resolve({"stop": longest}).stops == [longest]
    assert resolve({"stop": ["a", longest]}).stops == ["a", longest]
    refused({"stop": longest + "y"}, "stop", MAX_STOP_CHARS)
    refused({"stop": ["a", longest + "y"]}, "stop", MAX_STOP_CHARS)
    # Characters, not bytes: 512 four-byte characters are accepted.
    assert resolve({"stop": "🙂" * MAX_STOP_CHARS}).stops == ["🙂" * MAX_STOP_CHARS]


@pytest.mark.parametrize("bad", [[1], ["a", None], 3, b"stop", {"a"}])
def test_stop_must_hold_strings(bad: object) -> None:
    refused({"stop": bad}, "stop", None)


def test_stop_list_applies_the_limits_alone() -> None:
    assert stop_list(None) == [] and stop_list("") == [] and stop_list(["", "a"]) == ["a"]
    with pytest.raises(ValueError, match="stop"):
        stop_list(["a"] * (MAX_STOPS + 1))


def test_logit_bias_limit() -> None:
    bias = {i: 1.0 for i in range(MAX_LOGIT_BIAS)}
    assert (
        dict(resolve({"logit_bias": bias}, n_vocab=MAX_LOGIT_BIAS + 1).sampler.params.logit_bias)
        == bias
    )
    refused({"logit_bias": {**bias, MAX_LOGIT_BIAS: 1.0}}, "logit_bias", MAX_LOGIT_BIAS)


@pytest.mark.parametrize("priority", [PRIORITY_MIN, -1, 0, 1, PRIORITY_MAX, np.int64(7)])
def test_priority_in_range_is_accepted(priority: int) -> None:
    got = resolve({"priority": priority}, engine=True).priority
    assert got == priority and type(got) is int  # a plain int (it goes into session files)


def test_priority_default_is_zero() -> None:
    assert resolve({}, engine=True).priority == 0


@pytest.mark.parametrize(
    "priority", [PRIORITY_MIN - 1, PRIORITY_MAX + 1, 10**30, True, False, 1.0, "1", None]
)
def test_priority_out_of_range_or_not_an_int_is_refused(priority: object) -> None:
    refused({"priority": priority}, "priority", PRIORITY_MAX)


def test_priority_is_an_engine_option_only() -> None:
    with pytest.raises(TypeError, match="priority"):
        resolve({"priority": 1})  # type: ignore[typeddict-unknown-key]
