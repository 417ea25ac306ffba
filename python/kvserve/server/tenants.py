"""Tenants of one server: who holds which API key, and the limits each one gets.

``--api-keys-file FILE`` is TOML, one table per tenant::

    [tenants.alice]
    key = "sk-alice-..."            # or key_sha256 = "<hex SHA-256 of the key>"
    max_priority = 5                # a request's priority is capped at this (default 1000)
    max_concurrent = 4              # generation requests at once (429 beyond; default none)
    requests_per_minute = 60        # generation requests a minute (429 beyond; default none)
    weight = 2                      # her share of compute against other tenants' (> 0;
                                    # default 1)
    kv_share = 0.5                  # the part of the K/V pool she may hold before memory
                                    # shortage takes from her first ((0, 1]; default: an
                                    # equal split among the tenants holding K/V)
    share_prefix_cache = true       # her cached prefixes are shared with other sharing
                                    # tenants (default false: isolated)

    [tenants.bob]
    key_sha256 = "9f86d081884c7d65..."

A tenant's name is 1 to 64 of ``A-Z a-z 0-9 _ -``. Keys are compared as SHA-256 digests in
constant time against every tenant's, so a wrong key, a missing key and a right one take the
same time to check. ``--api-key KEY`` means one tenant, ``default``. The file is read again
on SIGHUP (:meth:`Tenants.load`; a bad file keeps the tenants in force and logs why).

What a tenant owns: its sessions (ids are scoped by tenant: another tenant gets 404 for every
session route and starts a session of its own under the same id; session files go to a
directory of the tenant's, mode 0700). What it gets: its generation requests run as its
tenant in the engine (the ``tenant`` option), which shares compute and K/V memory between
tenants by ``weight`` and ``kv_share`` and keeps each tenant's prefix cache its own unless
``share_prefix_cache`` (:meth:`Tenants.policies`, given to the engine at start and on every
reload; :mod:`kvserve.engine.scheduler`, "Tenants").
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.tenancy import TenantPolicy
from ..options import PRIORITY_MAX, PRIORITY_MIN

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the backport, same API
    import tomli as tomllib

__all__ = ["Tenant", "Tenants", "TenantsFileError"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FIELDS = {
    "key",
    "key_sha256",
    "max_priority",
    "max_concurrent",
    "requests_per_minute",
    "weight",
    "kv_share",
    "share_prefix_cache",
}


class TenantsFileError(ValueError):
    """An API keys file that cannot be used (its message names the tenant and the field)."""


@dataclass(frozen=True)
class Tenant:
    name: str
    digest: bytes  # SHA-256 of the key
    max_priority: int = PRIORITY_MAX
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    weight: float = 1.0
    kv_share: float | None = None
    share_prefix_cache: bool = False

    def policy(self) -> TenantPolicy:
        """What the engine gives this tenant (its share of compute and K/V memory, and
        whether its prefix cache is shared)."""
        return TenantPolicy(
            weight=self.weight,
            kv_share=self.kv_share,
            share_prefix_cache=self.share_prefix_cache,
        )


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def _int(where: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise TenantsFileError(f"{where} must be an integer >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise TenantsFileError(f"{where} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _number(where: str, value: Any, lo: float, hi: float | None = None) -> float:
    """A finite number > ``lo`` (and <= ``hi``), as TOML gives it (an integer or a float)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or not (math.isfinite(value) and value > lo and (hi is None or value <= hi)):
        what = f"in ({lo:g}, {hi:g}]" if hi is not None else f"> {lo:g}"
        raise TenantsFileError(f"{where} must be a number {what}, got {value!r}")
    return float(value)


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TenantsFileError(f"{where} must be true or false, got {value!r}")
    return value


def _tenant(name: str, table: Any) -> Tenant:
    where = f"tenants.{name}"
    if not _NAME.fullmatch(name):
        raise TenantsFileError(f"{where}: a tenant name is 1 to 64 of A-Z a-z 0-9 _ -")
    if not isinstance(table, dict):
        raise TenantsFileError(f"{where} must be a table")
    unknown = sorted(set(table) - _FIELDS)
    if unknown:
        raise TenantsFileError(f"{where}: unknown field(s) {', '.join(unknown)}")
    if ("key" in table) == ("key_sha256" in table):
        raise TenantsFileError(f"{where}: give exactly one of key and key_sha256")
    if "key" in table:
        key = table["key"]
        if not isinstance(key, str) or len(key) < 8:
            raise TenantsFileError(f"{where}.key must be a string of at least 8 characters")
        digest = _digest(key)
    else:
        hexed = table["key_sha256"]
        if not isinstance(hexed, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", hexed):
            raise TenantsFileError(f"{where}.key_sha256 must be 64 hex digits (a SHA-256)")
        digest = bytes.fromhex(hexed)
    return Tenant(
        name=name,
        digest=digest,
        max_priority=_int(
            f"{where}.max_priority",
            table.get("max_priority", PRIORITY_MAX),
            PRIORITY_MIN,
            PRIORITY_MAX,
        ),
        max_concurrent=None
        if "max_concurrent" not in table
        else _int(f"{where}.max_concurrent", table["max_concurrent"], 1),
        requests_per_minute=None
        if "requests_per_minute" not in table
        else _int(f"{where}.requests_per_minute", table["requests_per_minute"], 1),
        weight=_number(f"{where}.weight", table.get("weight", 1.0), 0.0),
        kv_share=None
        if "kv_share" not in table
        else _number(f"{where}.kv_share", table["kv_share"], 0.0, 1.0),
        share_prefix_cache=_bool(
            f"{where}.share_prefix_cache", table.get("share_prefix_cache", False)
        ),
    )


class Tenants:
    """The tenants in force, their keys and their live counts (in-flight generation requests,
    recent request times)."""

    def __init__(self, tenants: list[Tenant]) -> None:
        if not tenants:
            raise TenantsFileError("no tenants: the file needs at least one [tenants.NAME]")
        digests = [t.digest for t in tenants]
        if len(set(digests)) != len(digests):
            raise TenantsFileError("two tenants have the same key")
        self.by_name = {t.name: t for t in tenants}
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._recent: dict[str, deque[float]] = {}

    @classmethod
    def load(cls, path: str | Path) -> Tenants:
        """The tenants of an API keys file (module docs); ``TenantsFileError`` naming what is
        wrong, ``OSError`` when it cannot be read."""
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise TenantsFileError(f"{path}: not valid TOML ({e})") from e
        unknown = sorted(set(data) - {"tenants"})
        if unknown:
            raise TenantsFileError(f"{path}: unknown table(s) {', '.join(unknown)}")
        tables = data.get("tenants", {})
        if not isinstance(tables, dict):
            raise TenantsFileError(f"{path}: 'tenants' must be a table of tables")
        return cls([_tenant(name, t) for name, t in tables.items()])

    def policies(self) -> dict[str, TenantPolicy]:
        """Each tenant's engine policy, by name (:meth:`kvserve.Engine.set_tenants`)."""
        return {name: t.policy() for name, t in self.by_name.items()}

    @classmethod
    def single(cls, key: str) -> Tenants:
        """``--api-key``: one tenant, ``default``."""
        return cls([Tenant("default", _digest(key))])

    def adopt_counts(self, old: Tenants) -> None:
        """After a reload: the live counts of tenants that stay carry over."""
        with old._lock:
            self._in_flight = {n: c for n, c in old._in_flight.items() if n in self.by_name}
            self._recent = {n: d for n, d in old._recent.items() if n in self.by_name}

    def authenticate(self, token: bytes | None) -> Tenant | None:
        """The tenant whose key ``token`` is, else None; every tenant's digest is compared
        whatever the token (no early exit), so the time says nothing about the key."""
        digest = _digest(token or b"")
        found: Tenant | None = None
        for t in self.by_name.values():
            if hmac.compare_digest(t.digest, digest):
                found = t
        return found

    def admit(self, tenant: Tenant, now: float | None = None) -> float | None:
        """Counts a generation request of ``tenant`` in; None when it may go on, else the
        seconds to wait (its rate or concurrency limit is reached: nothing was counted)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            busy = self._in_flight.get(tenant.name, 0)
            if tenant.max_concurrent is not None and busy >= tenant.max_concurrent:
                return 1.0
            rpm = tenant.requests_per_minute
            if rpm is not None:
                recent = self._recent.setdefault(tenant.name, deque())
                while recent and now - recent[0] >= 60.0:
                    recent.popleft()
                if len(recent) >= rpm:
                    return max(1.0, math.ceil(60.0 - (now - recent[0])))
                recent.append(now)
            self._in_flight[tenant.name] = busy + 1
            return None

    def release(self, tenant: Tenant) -> None:
        """A generation request of ``tenant`` is done."""
        with self._lock:
            n = self._in_flight.get(tenant.name, 0) - 1
            if n > 0:
                self._in_flight[tenant.name] = n
            else:
                self._in_flight.pop(tenant.name, None)
