"""Header validation of session files (python/kvserve/sessions.py): every field is checked for
type and range when a file is read, so a checksum-valid file with a bogus header is refused
with a SessionFileError naming the field instead of loading and failing later in the engine.

The files are written by ``write_session_file`` itself (valid magic, lengths and checksum)
around a crafted header and arbitrary K/V bytes; no model is needed. The oracle for the random
generator state is numpy: a state the reader accepts must restore a generator that continues
the saved one's stream.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvserve.options import PRIORITY_MAX, PRIORITY_MIN
from kvserve.sessions import (
    KV_TYPES,
    SessionFileError,
    check_header,
    read_session_file,
    write_session_file,
)

KV = b"\x00\x01 any K/V bytes \xff" * 7
MISSING = object()  # as a case's value: the field is left out


def rng_state(seed: int = 1234, draws: int = 3, uint32: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    rng.random(draws)
    if uint32:  # leaves half of a 64-bit draw buffered: has_uint32 = 1
        rng.integers(0, 10, dtype=np.uint32)
    return copy.deepcopy(dict(rng.bit_generator.state))


def valid_header() -> dict[str, Any]:
    return {
        "session_id": "chat-1",
        "model_identity": "0123abcd",
        "model_name": "SmolLM2",
        "kv_type": "f16",
        "tokens": [1, 2, 3, 49151],
        "n_kv": 3,
        "rng_state": rng_state(),
        "priority": 0,
        "saved_at": 1712345678.25,
    }


def roundtrip(tmp_path: Path, header: Any) -> dict[str, Any]:
    path = tmp_path / "s.kvs"
    write_session_file(path, header, KV)
    got, kv = read_session_file(path)
    assert kv == KV
    return got


def with_field(name: str, value: object) -> dict[str, Any]:
    header = valid_header()
    if value is MISSING:
        del header[name]
    else:
        header[name] = value
    return header


def test_a_valid_header_passes_both_checks(tmp_path: Path) -> None:
    header = valid_header()
    got = roundtrip(tmp_path, header)
    assert got == header
    check_header(got, tmp_path / "s.kvs", "0123abcd", "f16", n_vocab=49152)
    check_header(got, tmp_path / "s.kvs", "0123abcd", "f16")  # no vocabulary check


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("model_name", None),
        ("model_name", MISSING),
        ("model_name", ""),
        ("rng_state", None),
        ("rng_state", MISSING),
        ("rng_state", rng_state(7, 0)),
        ("rng_state", rng_state(7, 5, uint32=True)),
        ("saved_at", MISSING),
        ("saved_at", 0),
        ("saved_at", -3.5),
        ("tokens", []),
        ("n_kv", 0),
        ("n_kv", 4),
        ("priority", PRIORITY_MIN),
        ("priority", PRIORITY_MAX),
        ("session_id", "x"),
        ("model_identity", ""),
        *[("kv_type", t) for t in KV_TYPES],
    ],
)
def test_optional_and_boundary_values_are_accepted(
    tmp_path: Path, name: str, value: object
) -> None:
    header = with_field(name, value)
    if name == "tokens":
        header["n_kv"] = 0
    assert roundtrip(tmp_path, header) == header


def rng_with(path: tuple[str, ...], value: object) -> dict[str, Any]:
    state = rng_state()
    target: dict[str, Any] = state
    for key in path[:-1]:
        target = target[key]
    if value is MISSING:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return state


BAD_RNG: list[object] = [
    1,
    "PCG64",
    [],
    {},
    True,
    rng_with(("bit_generator",), "MT19937"),
    rng_with(("bit_generator",), None),
    rng_with(("bit_generator",), MISSING),
    rng_with(("extra",), 0),
    rng_with(("state",), 5),
    rng_with(("state",), MISSING),
    rng_with(("state", "extra"), 1),
    rng_with(("state", "inc"), MISSING),
    rng_with(("state", "state"), -1),
    rng_with(("state", "state"), 1 << 128),
    rng_with(("state", "state"), 1.0),
    rng_with(("state", "state"), True),
    rng_with(("state", "state"), "12"),
    rng_with(("state", "inc"), 2),  # PCG64 increments are odd
    rng_with(("state", "inc"), (1 << 128) + 1),
    rng_with(("state", "inc"), None),
    rng_with(("has_uint32",), 2),
    rng_with(("has_uint32",), -1),
    rng_with(("has_uint32",), True),
    rng_with(("has_uint32",), 0.5),
    rng_with(("uinteger",), 1 << 32),
    rng_with(("uinteger",), -1),
    rng_with(("uinteger",), MISSING),
    rng_with(("uinteger",), [1]),
]

BAD_FIELDS: list[tuple[str, object]] = [
    *[("session_id", v) for v in ["", 1, None, ["chat-1"], True, MISSING]],
    *[("model_identity", v) for v in [1, None, {"a": 1}, False, MISSING]],
    *[("model_name", v) for v in [1, ["m"], True]],
    *[("kv_type", v) for v in ["q4_0", "F16", "", 16, None, ["f16"], MISSING]],
    *[
        ("tokens", v)
        for v in [
            "1234",
            {"0": 1},
            None,
            5,
            [1, -1, 2, 3],
            [1, True, 2, 3],
            [1, 2.0, 3, 4],
            [1, "2", 3, 4],
            [1, None, 3, 4],
            [[1], 2, 3, 4],
            MISSING,
        ]
    ],
    *[("n_kv", v) for v in [-1, 5, True, 1.0, "3", None, MISSING]],
    *[
        ("priority", v)
        for v in [PRIORITY_MIN - 1, PRIORITY_MAX + 1, 10**40, True, 1.5, "0", None, MISSING]
    ],
    *[("saved_at", v) for v in ["now", None, True, math.nan, math.inf, -math.inf, [1.0]]],
    *[("rng_state", v) for v in BAD_RNG],
]


@pytest.mark.parametrize(("name", "value"), BAD_FIELDS)
def test_each_malformed_field_is_refused_naming_it(
    tmp_path: Path, name: str, value: object
) -> None:
    header = with_field(name, value)
    path = tmp_path / "bad.kvs"
    write_session_file(path, header, KV)
    with pytest.raises(SessionFileError, match=repr(name)):
        read_session_file(path)
    # check_header refuses the same header handed to it directly.
    with pytest.raises(SessionFileError, match=repr(name)):
        check_header(header, path, "0123abcd", "f16", n_vocab=49152)


def test_unknown_fields_are_refused_naming_them(tmp_path: Path) -> None:
    header = {**valid_header(), "zz_extra": 1, "aa_other": None}
    path = tmp_path / "bad.kvs"
    write_session_file(path, header, KV)
    with pytest.raises(SessionFileError, match="unknown header field.*'aa_other', 'zz_extra'"):
        read_session_file(path)


def raw_file(path: Path, head: bytes, kv: bytes) -> None:
    """A session file written from the format in the module docs (not by kvserve): magic,
    version 1, lengths, header bytes, K/V bytes, SHA-256 of all that."""
    body = b"KVSERVE-SESSION\n" + struct.pack("<IIQ", 1, len(head), len(kv)) + head + kv
    path.write_bytes(body + hashlib.sha256(body).digest())


def test_the_reference_writer_agrees_with_the_reader(tmp_path: Path) -> None:
    path = tmp_path / "raw.kvs"
    raw_file(path, json.dumps(valid_header()).encode(), KV)
    assert read_session_file(path) == (valid_header(), KV)


@pytest.mark.parametrize("head", [b"[1, 2]", b'"header"', b"3", b"null"])
def test_a_header_that_is_not_an_object_is_refused(tmp_path: Path, head: bytes) -> None:
    path = tmp_path / "bad.kvs"
    raw_file(path, head, KV)
    with pytest.raises(SessionFileError, match="not an object"):
        read_session_file(path)


@pytest.mark.parametrize(
    "head",
    [
        b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nested past the parser's depth
        b'{"session_id": "s", ',  # cut short
        b"\xff\xfe not UTF-8",
    ],
)
def test_an_unreadable_header_is_refused(tmp_path: Path, head: bytes) -> None:
    path = tmp_path / "bad.kvs"
    raw_file(path, head, KV)
    with pytest.raises(SessionFileError, match="unreadable header"):
        read_session_file(path)


def test_token_ids_must_lie_in_the_vocabulary(tmp_path: Path) -> None:
    header = roundtrip(tmp_path, valid_header())
    top = max(header["tokens"])
    check_header(header, tmp_path / "s.kvs", "0123abcd", "f16", n_vocab=top + 1)
    with pytest.raises(SessionFileError, match=f"'tokens'.*{top}.*vocabulary of {top}"):
        check_header(header, tmp_path / "s.kvs", "0123abcd", "f16", n_vocab=top)
    check_header(header, tmp_path / "s.kvs", "0123abcd", "f16", n_vocab=None)


def test_model_and_kv_type_mismatches_are_still_refused(tmp_path: Path) -> None:
    header = roundtrip(tmp_path, valid_header())
    with pytest.raises(SessionFileError, match="saved by another model"):
        check_header(header, tmp_path / "s.kvs", "other", "f16", n_vocab=49152)
    with pytest.raises(SessionFileError, match="kv_type='f16'"):
        check_header(header, tmp_path / "s.kvs", "0123abcd", "q8_0", n_vocab=49152)


@pytest.mark.parametrize("seed", range(8))
def test_an_accepted_rng_state_continues_the_saved_stream(tmp_path: Path, seed: int) -> None:
    """What the engine does with a loaded state (``rng.bit_generator.state = state`` on
    ``np.random.default_rng``) continues exactly the stream of the generator that was saved."""
    saved = np.random.default_rng(seed)
    saved.random(seed)
    if seed % 2:
        saved.integers(0, 100, dtype=np.uint32)  # a buffered half draw
    header = valid_header()
    header["rng_state"] = dict(saved.bit_generator.state)
    got = roundtrip(tmp_path, header)
    restored = np.random.default_rng(999)
    restored.bit_generator.state = got["rng_state"]
    assert (
        restored.integers(0, 1 << 30, size=6, dtype=np.uint32).tolist()
        == saved.integers(0, 1 << 30, size=6, dtype=np.uint32).tolist()
    )
    assert restored.random(4).tolist() == saved.random(4).tolist()
