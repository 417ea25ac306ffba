"""Tenants of the server (python/kvserve/server/tenants.py), without a model: the API keys
file's rules (shares of compute and memory too), key checks that take the same work whatever
the key, and the rate and concurrency limits against a simple model of them. The HTTP side
(owned sessions, 401/429, priority caps, reload, the engine's tenants) is in
tests/test_server.py."""

from __future__ import annotations

import hashlib
import hmac
import random
from pathlib import Path

import pytest

from kvserve.engine import TenantPolicy
from kvserve.server import tenants as tenants_module
from kvserve.server.tenants import Tenant, Tenants, TenantsFileError

GOOD = """
[tenants.alice]
key = "alice-secret-key"
max_priority = 5
max_concurrent = 2
requests_per_minute = 3

[tenants.bob]
key_sha256 = "{bob}"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_keys_file_gives_its_tenants_and_their_limits(tmp_path: Path) -> None:
    bob = hashlib.sha256(b"bob-secret-key").hexdigest()
    t = Tenants.load(write(tmp_path, GOOD.format(bob=bob)))
    assert sorted(t.by_name) == ["alice", "bob"]
    alice = t.by_name["alice"]
    assert (alice.max_priority, alice.max_concurrent, alice.requests_per_minute) == (5, 2, 3)
    assert t.authenticate(b"alice-secret-key") is alice
    assert t.authenticate(b"bob-secret-key") is t.by_name["bob"]
    for wrong in (b"alice-secret-kez", b"", None, b"bob-secret-key "):
        assert t.authenticate(wrong) is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[tenants.a]\nmax_priority = 1\n", "exactly one of key and key_sha256"),
        ('[tenants.a]\nkey = "12345678"\nkey_sha256 = "' + "0" * 64 + '"\n', "exactly one"),
        ('[tenants.a]\nkey = "short"\n', "at least 8 characters"),
        ('[tenants.a]\nkey_sha256 = "abc"\n', "64 hex digits"),
        ('[tenants.a]\nkey = "12345678"\ncolour = 1\n', "unknown field.*colour"),
        ('[tenants.a]\nkey = "12345678"\nmax_priority = 5000\n', r"max_priority.*\[-1000, 1000\]"),
        ('[tenants.a]\nkey = "12345678"\nmax_concurrent = 0\n', "max_concurrent.*>= 1"),
        ('[tenants.a]\nkey = "12345678"\nrequests_per_minute = true\n', "requests_per_minute"),
        ('[tenants."a b"]\nkey = "12345678"\n', "tenant name"),
        ('[tenants.a]\nkey = "12345678"\n[tenants.b]\nkey = "12345678"\n', "same key"),
        ("[other]\nx = 1\n", "unknown table"),
        ("", "no tenants"),
        ("[tenants.a\n", "not valid TOML"),
    ],
)
def test_a_bad_keys_file_names_what_is_wrong(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(TenantsFileError, match=match):
        Tenants.load(write(tmp_path, text))


SHARES = """
[tenants.alice]
key = "alice-secret-key"
weight = 2.5
kv_share = 0.25
share_prefix_cache = true

[tenants.bob]
key = "bob-secret-key"
weight = 3

[tenants.carol]
key = "carol-secret-key"
kv_share = 1
"""


def test_a_keys_file_gives_each_tenants_share_of_compute_and_memory(tmp_path: Path) -> None:
    t = Tenants.load(write(tmp_path, SHARES))
    assert t.policies() == {
        "alice": TenantPolicy(weight=2.5, kv_share=0.25, share_prefix_cache=True),
        "bob": TenantPolicy(weight=3.0),
        "carol": TenantPolicy(kv_share=1.0),
    }
    bob = t.by_name["bob"]
    assert (bob.weight, bob.kv_share, bob.share_prefix_cache) == (3.0, None, False)
    # The defaults: weight 1, an equal split of the K/V pool, an isolated prefix cache.
    assert Tenants.single("single-key").policies() == {"default": TenantPolicy()}


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("weight = 0", r"tenants\.a\.weight must be a number > 0, got 0"),
        ("weight = -1.5", r"tenants\.a\.weight must be a number > 0"),
        ("weight = inf", r"tenants\.a\.weight must be a number > 0, got inf"),
        ("weight = nan", r"tenants\.a\.weight"),
        ("weight = true", r"tenants\.a\.weight must be a number"),
        ('weight = "2"', r"tenants\.a\.weight must be a number"),
        ("kv_share = 0", r"tenants\.a\.kv_share must be a number in \(0, 1\], got 0"),
        ("kv_share = 1.5", r"tenants\.a\.kv_share must be a number in \(0, 1\]"),
        ("kv_share = -0.1", r"tenants\.a\.kv_share"),
        ("kv_share = false", r"tenants\.a\.kv_share must be a number"),
        ("share_prefix_cache = 1", r"tenants\.a\.share_prefix_cache must be true or false"),
        ('share_prefix_cache = "yes"', r"tenants\.a\.share_prefix_cache must be true or false"),
    ],
)
def test_a_bad_share_names_the_field(tmp_path: Path, line: str, match: str) -> None:
    with pytest.raises(TenantsFileError, match=match):
        Tenants.load(write(tmp_path, f'[tenants.a]\nkey = "12345678"\n{line}\n'))


def test_every_key_check_compares_every_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    """A right, a wrong and a missing key cost the same: one hash and one constant-time
    comparison per tenant, no early exit (the time says nothing about the key)."""
    t = Tenants([Tenant(f"t{i}", hashlib.sha256(f"key-{i}".encode()).digest()) for i in range(5)])
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(tenants_module.hmac, "compare_digest", counting)
    counts = []
    for token in (b"key-0", b"key-4", b"nope", None):
        calls.clear()
        t.authenticate(token)
        counts.append(len(calls))
    assert counts == [5, 5, 5, 5]


def test_rate_and_concurrency_limits_match_a_simple_model() -> None:
    """Random arrivals and releases against a model: at most ``max_concurrent`` in flight, at
    most ``requests_per_minute`` admitted in any 60 s window; a refusal counts nothing and
    says how long to wait."""
    rng = random.Random(3)
    tenant = Tenant("a", b"x" * 32, max_concurrent=3, requests_per_minute=5)
    t = Tenants([tenant])
    now = 0.0
    in_flight = 0
    admitted: list[float] = []
    for _ in range(2000):
        now += rng.choice([0.5, 2.0, 7.0, 20.0])
        if in_flight and rng.random() < 0.5:
            t.release(tenant)
            in_flight -= 1
            continue
        window = [a for a in admitted if now - a < 60.0]
        should = in_flight < 3 and len(window) < 5
        wait = t.admit(tenant, now)
        assert (wait is None) == should, (now, in_flight, len(window))
        if wait is None:
            in_flight += 1
            admitted.append(now)
        else:
            assert wait >= 1.0
            if in_flight < 3:  # the rate refused it: after the wait a slot in the window is free
                assert now + wait - window[0] >= 60.0


def test_a_reload_keeps_the_live_counts_of_tenants_that_stay() -> None:
    a = Tenant("a", b"a" * 32, max_concurrent=1)
    old = Tenants([a, Tenant("b", b"b" * 32)])
    assert old.admit(a) is None
    fresh = Tenants([Tenant("a", b"c" * 32, max_concurrent=1)])
    fresh.adopt_counts(old)
    assert fresh.admit(fresh.by_name["a"]) is not None  # the one in flight still counts
    fresh.release(fresh.by_name["a"])
    assert fresh.admit(fresh.by_name["a"]) is None
