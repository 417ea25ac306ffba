"""Tests for kvserve.textstream: UTF-8 reassembly and stop strings."""

from __future__ import annotations

import codecs
import random
from collections import OrderedDict
from collections.abc import Iterable

import pytest

from kvserve import textstream
from kvserve.textstream import TextStream


def run(pieces: list[bytes], stop: list[str] | None = None) -> tuple[list[str], bool]:
    ts = TextStream(stop or [])
    out = [ts.push(p) for p in pieces]
    out.append(ts.finish())
    return out, ts.stopped


def split_randomly(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), k=min(len(data) - 1, len(data) // 3)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


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


# -- the stop-string automaton against the previous implementation --------------------------
#
# NaiveTextStream is kvserve.textstream.TextStream as it was before the Aho-Corasick matcher
# (re-scanning the held text against every stop string on every push): the reference whose
# outputs, push by push, the automaton must reproduce exactly.


def _held_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class NaiveTextStream:
    def __init__(self, stop: Iterable[str] = ()) -> None:
        self.stops = [s for s in stop if s]
        self.stopped = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def push(self, piece: bytes) -> str:
        if self.stopped:
            return ""
        return self._release(self._decoder.decode(piece), final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._release(self._decoder.decode(b"", final=True), final=True)

    def _release(self, text: str, final: bool) -> str:
        pending = self._pending + text
        if not self.stops:
            self._pending = ""
            return pending
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return pending[: min(hits)]
        keep = 0 if final else _held_suffix(pending, self.stops)
        ready = len(pending) - keep
        self._pending = pending[ready:]
        return pending[:ready]


# A small alphabet makes stop strings overlap, nest and recur; é, 日 and 🙂 are 2, 3 and 4
# bytes in UTF-8, U+FFFD is what invalid bytes decode to.
ALPHABET = "ab c\né日🙂\ufffd"


def random_stops(rng: random.Random, text: str) -> list[str]:
    stops: list[str] = []
    for _ in range(rng.choice([1, 2, 3, 5, 8, 20])):
        kind = rng.random()
        if kind < 0.15 and text:  # a piece of the text: it occurs
            i = rng.randrange(len(text))
            stops.append(text[i : i + rng.randint(1, 12)])
        elif kind < 0.4 and stops:  # a prefix, suffix or extension of another stop
            other = rng.choice(stops)
            cut = rng.randint(0, len(other))
            extra = "".join(rng.choices(ALPHABET, k=rng.randint(0, 3)))
            stops.append(rng.choice([other[:cut], other[cut:], other + extra, extra + other]))
        else:
            stops.append("".join(rng.choices(ALPHABET, k=rng.choice([0, 1, 3, 4, 5, 6, 8]))))
    return stops


def random_pieces(rng: random.Random, data: bytes) -> list[bytes]:
    """``data`` cut at random places, including inside characters and into empty pieces."""
    pieces = []
    i = 0
    while i < len(data):
        n = rng.choice([0, 1, 1, 2, 3, 5, 20])
        pieces.append(data[i : i + n])
        i += n
    return pieces


def random_case(seed: int) -> tuple[list[str], list[bytes], bool]:
    rng = random.Random(seed)
    text = "".join(rng.choices(ALPHABET, k=rng.randint(0, 120)))
    data = text.encode()
    if rng.random() < 0.3:  # invalid and truncated bytes
        i = rng.randint(0, len(data))
        data = (
            data[:i] + rng.choice([b"\xff", b"\xe6\x97", b"\xf0\x9f\x99", b"\x80\x80"]) + data[i:]
        )
    stops = random_stops(rng, data.decode("utf-8", errors="replace"))
    if rng.random() < 0.5:  # many stop strings, mostly absent from the text
        stops += ["".join(rng.choices(ALPHABET, k=rng.randint(5, 9))) for _ in range(50)]
    rng.shuffle(stops)
    return stops, random_pieces(rng, data), rng.random() < 0.2


def trace(ts: TextStream | NaiveTextStream, pieces: list[bytes], again: bool) -> list[object]:
    """Every output and ``stopped`` after each call; ``again``: push everything a second time
    after finish (the stream goes on after a finish that did not stop it)."""
    out: list[object] = []
    for _ in range(2 if again else 1):
        for p in pieces:
            out.append((ts.push(p), ts.stopped))
        out.append((ts.finish(), ts.stopped))
    return out


@pytest.mark.parametrize("block", range(10))
def test_automaton_matches_the_naive_stream_push_by_push(block: int) -> None:
    stopped = 0
    for seed in range(block * 300, (block + 1) * 300):
        stops, pieces, again = random_case(seed)
        want = trace(NaiveTextStream(stops), pieces, again)
        ts = TextStream(stops)
        assert trace(ts, pieces, again) == want, (seed, stops, pieces)
        assert ts.stops == [s for s in stops if s]
        stopped += bool(want[-1][1])  # type: ignore[index]
    assert 100 < stopped < 260  # the cases exercise both outcomes


@pytest.mark.parametrize(
    ("stops", "pieces", "want"),
    [
        # The longer stop starts first: it wins when it completes in the same push ...
        (["abcd", "bc"], [b"abcd"], ["", "<stop>"]),
        # ... but a shorter one that completes in an earlier push ends the stream there.
        (["abcd", "bc"], [b"ab", b"c", b"d"], ["", "a", "<stop>"]),
        # The earliest-starting occurrence may complete after a later-starting one.
        (["b", "abc"], [b"zabc"], ["z", "<stop>"]),
        (["xaaaay", "aa"], [b"xaaaay"], ["", "<stop>"]),
        (["a日b", "日"], [b"a\xe6", b"\x97\xa5b"], ["", "", "<stop>"]),
        (["a日b", "日"], [b"a\xe6", b"\x97\xa5c"], ["", "a", "<stop>"]),
    ],
)
def test_overlapping_stops_cut_at_the_earliest_start(
    stops: list[str], pieces: list[bytes], want: list[str]
) -> None:
    for ts in (TextStream(stops), NaiveTextStream(stops)):
        out = []
        for p in pieces:
            out.append(ts.push(p))
            if ts.stopped:
                out.append("<stop>")
                break
        assert out == want


def test_stop_spanning_many_tokens_and_multibyte_pieces() -> None:
    stop = "日本語🙂 stop here"
    text = "before 日本" + stop[:5] + " not yet; " + stop + " after"
    data = text.encode()
    pieces = [data[i : i + 1] for i in range(len(data))]  # one byte a token
    ts, naive = TextStream([stop, "zzz"]), NaiveTextStream([stop, "zzz"])
    assert trace(ts, pieces, False) == trace(naive, pieces, False)
    assert ts.stopped


@pytest.mark.parametrize("n_stops", [1, 100, 10_000])
def test_steps_per_push_do_not_grow_with_the_number_of_stops(n_stops: int) -> None:
    rng = random.Random(n_stops)
    text = "".join(rng.choices(ALPHABET, k=3000))
    # Stops that keep the automaton deep in the trie (long held texts, long failure chains),
    # none of which occurs.
    stops = ["".join(rng.choices(ALPHABET, k=rng.randint(1, 40))) + "#" for _ in range(n_stops)]
    longest = max(map(len, stops))
    ts = TextStream(stops)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # to count characters
    total_chars = 0
    for piece in random_pieces(rng, text.encode()):
        n_chars = len(decoder.decode(piece))
        held = len(ts._pending)
        before = ts.steps
        ts.push(piece)
        assert ts.steps - before <= 2 * n_chars + held  # whatever n_stops is
        assert held < longest
        total_chars += n_chars
    assert not ts.stopped and total_chars == len(text)
    assert ts.steps <= 2 * total_chars  # amortized: at most 2 steps a character


def test_automata_are_shared_per_stop_list_in_a_bounded_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(textstream, "_cache", OrderedDict())
    monkeypatch.setattr(textstream, "_cache_states", 0)
    monkeypatch.setattr(textstream, "CACHE_MAX_ENTRIES", 3)
    monkeypatch.setattr(textstream, "CACHE_MAX_STATES", 100)
    a = TextStream(["stop", "end"])
    assert TextStream(["stop", "end"])._ac is a._ac  # built once
    assert TextStream(["end", "stop"])._ac is not a._ac  # another list
    for i in range(3):
        TextStream([f"other{i}"])
    assert len(textstream._cache) == 3  # least recently used dropped
    assert ("stop", "end") not in textstream._cache
    assert TextStream(["stop", "end"])._ac is not a._ac
    big = TextStream(["x" * 200])  # more states than the cache holds: built, not kept
    assert big._ac is not None and ("x" * 200,) not in textstream._cache
    assert textstream._cache_states == sum(ac.n_states for ac in textstream._cache.values())
    assert textstream._cache_states <= 100
