"""Tenants as the engine sees them: a policy per tenant name, and the salt of a request's
K/V content keys (docs/KV_SEMANTICS.md, "Prefix index": a salted sequence's key chain starts
from a root derived from its salt, so its blocks match only requests with the same salt).

A request names its tenant (``RequestOptions.tenant``; None is the engine's own namespace)
and may add a ``cache_salt``. A tenant whose policy does not share its prefix cache (the
default for a named tenant) salts every request with its name, so a prompt another tenant
cached is a miss for it and a timing probe learns nothing; tenants that share (and requests
without a tenant) meet in the unsalted namespace, split further only by ``cache_salt``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_POLICY", "SHARED_POLICY", "TenantPolicy", "check_policies", "salt_for"]


@dataclass(frozen=True)
class TenantPolicy:
    """What the engine gives one tenant.

    ``weight``: its share of compute relative to other tenants with work (> 0; default 1).
    ``kv_share``: the fraction of the K/V pool it may hold before reclaim and preemption take
    from it first (in (0, 1]; None: no share of its own, i.e. an equal split).
    ``share_prefix_cache``: its cached prefixes are visible to (and it sees those of) other
    sharing tenants and requests without a tenant; default False (isolated).
    """

    weight: float = 1.0
    kv_share: float | None = None
    share_prefix_cache: bool = False

    def __post_init__(self) -> None:
        w = self.weight
        if (
            isinstance(w, bool)
            or not isinstance(w, (int, float))
            or not (w > 0 and math.isfinite(w))
        ):
            raise ValueError(f"weight must be a finite number > 0, got {w!r}")
        k = self.kv_share
        if k is not None and (
            isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= 1
        ):
            raise ValueError(f"kv_share must be a number in (0, 1] or None, got {k!r}")
        if not isinstance(self.share_prefix_cache, bool):
            raise ValueError(
                f"share_prefix_cache must be True or False, got {self.share_prefix_cache!r}"
            )


DEFAULT_POLICY = TenantPolicy()  # a named tenant without a policy of its own
SHARED_POLICY = TenantPolicy(share_prefix_cache=True)  # requests without a tenant


def check_policies(policies: Mapping[str, TenantPolicy] | None) -> dict[str, TenantPolicy]:
    """``policies`` as a fresh dict (``TypeError`` for a value that is not a TenantPolicy)."""
    out: dict[str, TenantPolicy] = {}
    for name, p in (policies or {}).items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tenant names must be non-empty strings, got {name!r}")
        if not isinstance(p, TenantPolicy):
            raise TypeError(f"tenant {name!r}: expected a TenantPolicy, got {type(p).__name__}")
        out[name] = p
    return out


def salt_for(tenant: str | None, cache_salt: str | None, shared: bool) -> bytes:
    """The salt of a request's K/V content keys: empty (unsalted) for a request without
    ``cache_salt`` whose tenant shares its cache (or that has none); else an unambiguous
    encoding of the isolated tenant's name and the salt."""
    name = "" if tenant is None or shared else tenant
    if not name and cache_salt is None:
        return b""
    t = name.encode()
    s = b"" if cache_salt is None else b"\x01" + cache_salt.encode()
    return len(t).to_bytes(4, "little") + t + s
