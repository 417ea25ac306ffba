"""The prefix-affinity router (python/kvserve/cluster/router.py), without Ray or a model.

Oracle: a small reference of the policy written from its statement (longest held prefix
unless the holder's load exceeds the least loaded one's by more than the threshold; then the
less loaded of two drawn at random; sessions stick while their replica lives), driven through
random states and compared decision by decision; plus cases for the events, the pending keys
and the sessions."""

from __future__ import annotations

import random

import pytest

from kvserve.cluster import Router


def stored(*keys: int, parent: int | None = None) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": [f"{k:032x}" for k in keys],
        "parent_block_hash": None if parent is None else f"{parent:032x}",
        "token_ids": [],
        "block_size": 16,
        "medium": "CPU",
    }


def removed(*keys: int) -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": [f"{k:032x}" for k in keys], "medium": "CPU"}


CLEARED = {"type": "AllBlocksCleared", "dropped": 0}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_longest_prefix_wins_and_events_update_it() -> None:
    r = Router(["a", "b", "c"], rng=random.Random(1), pending_s=0)
    r.apply_events("a", [stored(1, 2)])
    r.apply_events("b", [stored(1, 2, 3)])
    r.apply_events("c", [stored(9)])  # holds a block of another chain: no match
    c = r.choose([1, 2, 3, 4])
    assert (c.replica, c.reason, c.matched_blocks) == ("b", "prefix", 3)
    # Only a leading run counts: b lost block 2, so it matches one block; a matches two.
    r.apply_events("b", [removed(2)])
    assert r.choose([1, 2, 3, 4]).replica == "a"
    # A snapshot (after b's log dropped events) replaces what b held.
    r.apply_events("b", [CLEARED, stored(1, 2, 3, 4)])
    assert (r.choose([1, 2, 3, 4]).replica, r.held("b")) == ("b", 4)
    r.forget("b")
    assert r.held("b") == 0
    assert r.choose([1, 2, 3, 4]).replica == "a"
    # Events of a replica the router does not know are ignored.
    r.apply_events("zz", [stored(1)])
    assert r.replicas == ["a", "b", "c"]


def test_imbalance_sends_the_prefix_elsewhere_by_power_of_two() -> None:
    r = Router(["a", "b"], imbalance=2, rng=random.Random(0), pending_s=0)
    r.apply_events("a", [stored(1, 2)])
    for _ in range(2):
        r.started("a")
    assert r.choose([1, 2]).reason == "prefix", "load 2 vs 0: within the threshold"
    r.started("a")
    c = r.choose([1, 2])
    assert (c.replica, c.reason, c.matched_blocks) == ("b", "load", 0)
    for _ in range(3):
        r.finished("a")
    r.finished("a")  # more finishes than starts never go below zero
    assert r.load("a") == 0
    assert r.choose([1, 2]).replica == "a"


def test_no_match_goes_to_the_less_loaded() -> None:
    r = Router(["a", "b"], rng=random.Random(3), pending_s=0)
    r.started("a")
    for _ in range(5):
        c = r.choose([7, 8])
        assert (c.replica, c.reason) == ("b", "load")


def test_pending_keys_hold_a_burst_together_until_they_expire() -> None:
    clock = Clock()
    r = Router(["a", "b"], rng=random.Random(5), pending_s=10, clock=clock)
    first = r.choose([1, 2, 3])
    assert first.reason == "load"
    # The replica's events have not come yet, but the router remembers what it sent.
    again = r.choose([1, 2, 3, 4])
    assert (again.replica, again.reason, again.matched_blocks) == (first.replica, "prefix", 3)
    clock.t = 11  # expired, and never confirmed by an event
    other = "b" if first.replica == "a" else "a"
    r.started(first.replica)
    assert r.choose([1, 2, 3]).replica == other
    # An event confirms keys for good.
    r.apply_events(other, [stored(1, 2, 3)])
    clock.t = 100
    assert r.choose([1, 2, 3]).matched_blocks == 3


def test_sessions_stick_while_their_replica_lives() -> None:
    r = Router(["a", "b"], rng=random.Random(2), pending_s=0)
    r.apply_events("a", [stored(1)])
    first = r.choose([5], session="s1")
    assert first.reason == "load"
    # Even when another replica holds the prompt's prefix, the session's replica answers.
    other = "b" if first.replica == "a" else "a"
    r.apply_events(other, [stored(5, 6)])
    for _ in range(3):
        c = r.choose([5, 6], session="s1")
        assert (c.replica, c.reason) == (first.replica, "session")
    assert r.session_replica("s1") == first.replica
    r.remove_replica(first.replica)
    assert r.session_replica("s1") is None
    c = r.choose([5, 6], session="s1")
    assert (c.replica, c.reason) == (other, "prefix")
    assert r.choose([5], session="s1").reason == "session", "sticks to the new one"
    r.remove_replica(other)
    with pytest.raises(LookupError):
        r.choose([5], session="s1")


def _reference(
    held: dict[str, set[int]],
    load: dict[str, int],
    keys: list[int],
    imbalance: int,
    ratio: float,
    slack: int,
) -> tuple[set[str], str]:
    """The replicas the policy allows for ``keys`` and the reason (load decisions are random:
    the set of replicas a power-of-two draw could pick). Replicas hold distinct numbers of
    blocks here, so "the longest run, then the least loaded, then the fewest blocks" and "the
    fewest blocks" each name one replica."""

    def run(name: str) -> int:
        n = 0
        while n < len(keys) and keys[n] in held[name]:
            n += 1
        return n

    longest = max(run(n) for n in held)
    least = min(load.values())
    holders = [n for n in held if run(n) == longest]
    lowest = min(load[n] for n in holders)
    (best,) = [
        n
        for n in holders
        if load[n] == lowest
        and len(held[n]) == min(len(held[h]) for h in holders if load[h] == lowest)
    ]
    (emptiest,) = [n for n in held if len(held[n]) == min(len(h) for h in held.values())]
    if longest > 0:
        lopsided = len(held[best]) > ratio * len(held[emptiest]) + slack
        seeds = run(emptiest) == 0 and longest < 0.75 * len(keys)
        if emptiest != best and lopsided and seeds and load[emptiest] - least <= imbalance:
            return {emptiest}, "balance"
        if lowest - least <= imbalance:
            return {best}, "prefix"
    # Power of two choices: any replica that is not more loaded than every other can win a
    # draw; the most loaded one wins only on a tie.
    names = sorted(held)
    if len(names) == 1:
        return set(names), "load"
    winners = set()
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            lx, ly = load[x], load[y]
            if lx == ly:
                rx, ry = run(x), run(y)
                winners.add(x if rx > ry else y if ry > rx else x)
                if rx == ry:
                    winners.add(y)
            else:
                winners.add(x if lx < ly else y)
    return winners, "load"


def test_random_states_match_the_reference() -> None:
    rng = random.Random(21)
    reasons: set[str] = set()
    for _ in range(600):
        names = [f"r{i}" for i in range(rng.randint(1, 4))]
        imbalance = rng.randint(0, 3)
        ratio, slack = rng.choice([1.0, 2.0]), rng.randint(0, 3)
        r = Router(
            names,
            imbalance=imbalance,
            cache_ratio=ratio,
            cache_slack=slack,
            rng=random.Random(rng.random()),
            pending_s=0,
        )
        held: dict[str, set[int]] = {}
        load: dict[str, int] = {}
        sizes = rng.sample(range(0, 12), len(names))  # distinct numbers of other blocks
        for n, extra in zip(names, sizes, strict=True):
            depth = rng.randint(0, 5)
            held[n] = set(range(1, depth + 1)) | {
                1000 * (1 + names.index(n)) + j for j in range(extra)
            }
            if held[n]:
                r.apply_events(n, [stored(*sorted(held[n]))])
            load[n] = rng.randint(0, 5)
            for _ in range(load[n]):
                r.started(n)
        if len({len(h) for h in held.values()}) < len(names):
            continue  # equal sizes: the policy's tie-breaks are by position, not compared here
        keys = list(range(1, rng.randint(1, 6) + 1))
        allowed, reason = _reference(held, load, keys, imbalance, ratio, slack)
        c = r.choose(keys)
        reasons.add(c.reason)
        assert c.reason == reason, (held, load, keys, c)
        assert c.replica in allowed, (held, load, keys, c)
    assert reasons == {"prefix", "balance", "load"}, "every rule was exercised"


def test_a_shared_system_prompt_seeds_the_other_replica() -> None:
    """New conversations on a shared system prompt, one at a time (no load imbalance ever):
    once the first replica's cache is lopsided, a new conversation seeds the other replica
    with the prompt, and from then on new conversations split between them; a conversation's
    next turn stays where its history is."""
    r = Router(["a", "b"], imbalance=4, pending_s=60)
    system = list(range(1, 21))  # 20 blocks shared by every conversation
    where: dict[int, str] = {}
    for conv in range(12):
        own = [10_000 * (conv + 1) + j for j in range(13)]
        c = r.choose(system + own)
        where[conv] = c.replica
        r.apply_events(c.replica, [stored(*(system + own))])
    assert set(where.values()) == {"a", "b"}
    counts = {n: list(where.values()).count(n) for n in "ab"}
    assert min(counts.values()) >= 4, counts
    for conv, replica in where.items():
        history = system + [10_000 * (conv + 1) + j for j in range(13)]
        c = r.choose([*history, 99_000 + conv])
        assert (c.replica, c.reason) == (replica, "prefix"), conv
