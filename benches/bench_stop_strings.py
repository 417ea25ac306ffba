"""Per-token cost of stop-string matching: ``TextStream.push`` with 1, 100 and 150,000 stop
strings, the Aho-Corasick stream (kvserve.textstream) against the previous implementation
(re-scanning the held text against every stop string on every push: the tests' oracle,
``NaiveTextStream`` in tests/test_textstream.py).

    python benches/bench_stop_strings.py [--tokens N] [--stops 1,100,150000]

The text is English-like words in pieces of 1-6 characters (a token's worth); the stop
strings are random lowercase strings of 3-12 letters (plus "\\n\\nUser:"), none of which occurs
in the text, so every push is matched and nothing stops. Prints, per number of stop strings,
the median and fastest microseconds per push of each implementation over the same pieces, the
ratio old/new, and the time to build the automaton (once per distinct stop list; a cached
list costs a dictionary lookup). The old implementation is timed on fewer pushes when it is
slow (at least 20). On a shared machine compare lines of one run only.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from kvserve import textstream
from kvserve.textstream import TextStream

# The previous implementation is the tests' oracle (tests/test_textstream.py): one copy.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_textstream import NaiveTextStream as OldTextStream  # noqa: E402

WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like"
).split()


def pieces(n: int, rng: random.Random) -> list[bytes]:
    text = " ".join(rng.choice(WORDS) for _ in range(n))
    out, i = [], 0
    while len(out) < n:
        k = rng.randint(1, 6)
        out.append(text[i : i + k].encode())
        i += k
    return out


def stop_list(n: int, rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = ["\n\nUser:"]
    while len(out) < n:
        out.append("".join(rng.choices(letters, k=rng.randint(3, 12))) + "#")
    return out


def time_pushes(stream: TextStream | OldTextStream, data: list[bytes]) -> list[float]:
    times = []
    for p in data:
        t0 = time.perf_counter()
        stream.push(p)
        times.append(time.perf_counter() - t0)
    assert not stream.stopped
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2000, help="pushes per stream (new)")
    ap.add_argument("--stops", default="1,100,150000", help="numbers of stop strings")
    args = ap.parse_args()
    rng = random.Random(0)
    data = pieces(args.tokens, rng)
    print(f"{'stops':>8} {'old us/push':>18} {'new us/push':>18} {'old/new':>8} {'build ms':>9}")
    print(f"{'':>8} {'median':>9}{'min':>9} {'median':>9}{'min':>9}")
    for n in (int(x) for x in args.stops.split(",")):
        stops = stop_list(n, rng)
        textstream._cache.clear()
        textstream._cache_states = 0
        t0 = time.perf_counter()
        TextStream(stops)  # builds (and caches, if it fits) the automaton
        build = time.perf_counter() - t0
        new = time_pushes(TextStream(stops), data)
        # The old stream costs O(stops) a push: time at least 20 pushes, about 10 s at most.
        probe = time_pushes(OldTextStream(stops), data[:5])
        n_old = max(20, min(len(data), int(10 / max(statistics.median(probe), 1e-9))))
        old = time_pushes(OldTextStream(stops), data[:n_old])
        med_old, med_new = statistics.median(old), statistics.median(new)
        print(
            f"{n:>8} {med_old * 1e6:>9.1f}{min(old) * 1e6:>9.1f} "
            f"{med_new * 1e6:>9.1f}{min(new) * 1e6:>9.1f} "
            f"{med_old / med_new:>8.1f} {build * 1e3:>9.1f}"
        )


if __name__ == "__main__":
    main()
