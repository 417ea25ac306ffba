"""Tests for kvserve.textstream: UTF-8 reassembly and stop strings."""

from __future__ import annotations

import random

import pytest

from kvserve.textstream import TextStream


def run(pieces: list[bytes], stop: list[str] | None = None) -> tuple[list[str], bool]:
    ts = TextStream(stop or [])
    out = [ts.push(p) for p in pieces]
    out.append(ts.finish())
    return out, ts.stopped


def split_randomly(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), k=min(len(data) - 1, len(data) // 3)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


TEXT = "Paris — café, naïve 日本語 🙂 done"


def test_multibyte_characters_split_across_tokens_are_emitted_whole() -> None:
    data = TEXT.encode()
    emoji = "🙂".encode()
    i = data.index(emoji)
    pieces = [data[: i + 1], data[i + 1 : i + 3], data[i + 3 :]]
    out, stopped = run(pieces)
    assert out[0] == TEXT[: TEXT.index("🙂")]  # the partial emoji is held back
    assert out[1] == ""
    assert out[2].startswith("🙂")
    assert "".join(out) == TEXT
    assert not stopped


@pytest.mark.parametrize("seed", range(20))
def test_any_split_concatenates_to_bytes_decode(seed: int) -> None:
    rng = random.Random(seed)
    data = TEXT.encode() + b"\xff\xfe bad \xe6\x97"  # invalid bytes and a truncated char
    out, _ = run(split_randomly(data, rng))
    assert "".join(out) == data.decode("utf-8", errors="replace")
    for piece in out[:-1]:
        piece.encode("utf-8")  # every piece is valid text on its own (no lone surrogates)


@pytest.mark.parametrize("seed", range(20))
def test_stop_string_cuts_text_before_it(seed: int) -> None:
    rng = random.Random(seed)
    text = "Question: what?\nAnswer: yes.\nQuestion: again"
    out, stopped = run(split_randomly(text.encode(), rng), stop=["\nQuestion:"])
    assert stopped
    assert "".join(out) == "Question: what?\nAnswer: yes."


def test_partial_stop_prefix_is_held_then_released() -> None:
    ts = TextStream(["STOP"])
    assert ts.push(b"abc ST") == "abc "
    assert ts.push(b"O") == ""
    assert ts.push(b"P!") == ""  # "STOP" completed: nothing after it is shown
    assert ts.stopped
    assert ts.push(b"more") == "" and ts.finish() == ""

    ts = TextStream(["STOP"])
    assert ts.push(b"abc ST") == "abc "
    assert ts.push(b"OW") == "STOW"  # not a stop after all: released
    assert ts.finish() == ""
    assert not ts.stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    out, stopped = run([b"one two three"], stop=["three", "two"])
    assert stopped and "".join(out) == "one "


def test_held_prefix_is_flushed_at_finish() -> None:
    out, stopped = run([b"end with ST"], stop=["STOP"])
    assert not stopped
    assert out == ["end with ", "ST"]


def test_empty_stop_strings_are_ignored() -> None:
    out, stopped = run([b"abc"], stop=[""])
    assert not stopped and "".join(out) == "abc"
