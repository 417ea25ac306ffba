"""Tenants' prefix caches (issue 19): a request's K/V blocks are keyed under its salt (its
tenant unless the tenant shares, plus its ``cache_salt``), so it reuses cached prefixes of
requests with the same salt only, and none of that changes an output.

Oracle: a simple model of the semantics, the namespace of each request (``NS`` below): a
request's prompt is a hit (cached tokens > 0) exactly when an earlier request of the same
namespace computed the same leading blocks; outputs equal the unloaded, unsalted engine's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvserve import Engine, Model
from kvserve.engine import TenantPolicy
from kvserve.engine.tenancy import salt_for

PROMPT = " ".join(f"w{i}" for i in range(60))  # ~120 tokens: several whole blocks


@pytest.fixture(scope="module")
def model(model_path: Path) -> Model:
    return Model.load(model_path, threads=2)


@pytest.fixture(scope="module")
def oracle(model_path: Path) -> Model:
    """The same model with a cache of its own (a model's prefix cache is shared by its
    engines and outlives them), for the expected outputs."""
    return Model.load(model_path, threads=2)


def test_salts_are_unambiguous() -> None:
    assert salt_for(None, None, True) == b"" == salt_for("a", None, True)
    salts = {
        salt_for("a", None, False),
        salt_for("b", None, False),
        salt_for("a", "x", False),
        salt_for("a", "x", True),
        salt_for(None, "x", True),
        salt_for("ax", None, False),
        salt_for("a", "", False),
    }
    assert len(salts) == 6  # a shared tenant's salted request meets the unnamed one's
    assert salt_for("a", "x", True) == salt_for(None, "x", True)
    assert b"" not in salts


def test_each_namespace_sees_only_its_own_prefixes(model: Model, oracle: Model) -> None:
    policies = {
        "pub1": TenantPolicy(share_prefix_cache=True),
        "pub2": TenantPolicy(share_prefix_cache=True),
    }
    # (options, namespace): isolated tenants, sharing tenants with requests without a
    # tenant, and cache_salt inside each.
    cases = [
        ({}, "shared"),
        ({"tenant": "alice"}, "alice"),
        ({"tenant": "bob"}, "bob"),
        ({"tenant": "pub1"}, "shared"),
        ({"tenant": "pub2"}, "shared"),
        ({"tenant": "alice", "cache_salt": "s"}, "alice+s"),
        ({"tenant": "pub1", "cache_salt": "s"}, "shared+s"),
        ({"cache_salt": "s"}, "shared+s"),
    ]
    for k, order in enumerate((cases, cases[::-1])):
        prompt = f"Round {k}: {PROMPT}"  # the model's cache outlives an engine
        with Engine(oracle, parallel=2, ctx_size=512) as e:
            want = e.generate(prompt, max_tokens=6)
        with Engine(model, parallel=2, ctx_size=512, tenants=policies) as e:
            seen: set[str] = set()
            for options, ns in order:
                r = e.generate(prompt, max_tokens=6, **options)
                assert r.tokens == want.tokens, options
                hit = ns in seen
                assert (r.cached_tokens > 0) == hit, (options, ns, r.cached_tokens)
                if hit:
                    assert r.cached_tokens >= r.prompt_tokens - 32
                seen.add(ns)


def test_policies_change_for_new_requests(model: Model) -> None:
    prompt = f"Policies: {PROMPT}"
    with Engine(model, parallel=2, ctx_size=512) as e:
        e.generate(prompt, max_tokens=1)
        assert e.generate(prompt, max_tokens=1, tenant="t").cached_tokens == 0
        e.set_tenants({"t": TenantPolicy(share_prefix_cache=True)})
        assert e.generate(prompt, max_tokens=1, tenant="t").cached_tokens > 0
        with pytest.raises(TypeError, match="TenantPolicy"):
            e.set_tenants({"t": {"weight": 2}})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="tenant must be"):
            e.generate(PROMPT, max_tokens=1, tenant="x" * 65)
        with pytest.raises(ValueError, match="cache_salt must be"):
            e.generate(PROMPT, max_tokens=1, cache_salt=b"bytes")  # type: ignore[arg-type]


def test_choices_fork_under_their_salt(model: Model, oracle: Model) -> None:
    """n > 1: the forked choices continue the tenant's salted chain, so what they compute
    (prompt and output blocks) is the tenant's and no one else's."""
    prompt = f"Choices: {PROMPT}"
    with Engine(oracle, parallel=4, ctx_size=512) as e:
        want = [e.generate(prompt, max_tokens=40, ignore_eos=True).tokens] * 3
    with Engine(model, parallel=4, ctx_size=512) as e:

        async def run() -> list[list[int]]:
            deltas = [d async for d in e.choices(prompt, 40, 3, tenant="alice", ignore_eos=True)]
            return [d.result.tokens for d in sorted(deltas, key=lambda d: d.index) if d.result]

        assert asyncio.run(run()) == want
        whole = e.model.detokenize(want[0])
        for tenant, hit in (("bob", False), ("alice", True), (None, False)):
            r = e.generate(prompt + whole, max_tokens=1, tenant=tenant)
            # Alice's reuse covers blocks her choices computed past the prompt.
            assert (r.cached_tokens > r.prompt_tokens - 40) == hit, (tenant, r.cached_tokens)


def test_sessions_keep_their_tenants_salt(model_path: Path, oracle: Model, tmp_path: Path) -> None:
    """An evicted session is recovered from its tenant's cache; a session loaded from a file
    for a tenant enters that tenant's cache only."""
    per_block = int(oracle.new_context(16).stats()["bytes_per_block"])
    # A model of its own: its pool is sized by its first context (24 blocks).
    with Engine(
        Model.load(model_path, threads=2),
        parallel=2,
        ctx_size=256,
        kv_memory=24 * per_block,
        kv_high_watermark=0.3,
        kv_low_watermark=0.2,
    ) as e:
        prompt = f"Sessions: {PROMPT}"
        r1 = e.generate(prompt, max_tokens=4, session_id="s", tenant="alice")
        e.generate("Once upon a time there was a village by the sea" * 3, max_tokens=4)
        assert not e.sessions()[0].resident
        r2 = e.generate(" More.", max_tokens=4, session_id="s", tenant="alice")
        assert r2.cached_tokens >= r1.prompt_tokens - 32, "recovered from Alice's cache"
        path = tmp_path / "s.kvs"
        e.save_session("s", path)
        e.drop_session("s")
        e.generate("Another long story about the hills and the sea" * 4, max_tokens=4)
        e.load_session(path, "t", tenant="carol")
        for tenant, hit in (("alice", True), ("bob", False), (None, False), ("carol", True)):
            r = e.generate(prompt, max_tokens=1, tenant=tenant)
            assert (r.cached_tokens > 0) == hit, (tenant, r.cached_tokens)
