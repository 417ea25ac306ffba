"""Sessions of the serving engine: named conversations whose K/V outlives their requests.

This module holds what :class:`kvserve.Engine` keeps per session and the session file format;
the engine (python/kvserve/engine/) applies the policy (see its docs: reuse, reclaim,
eviction, TTL, ``max_sessions``).

- :class:`Session`: the session's tokens (every prompt and output so far), the sequence that
  holds its K/V while it is *resident* (``seq >= 0``, ``n_kv`` leading tokens computed), its last
  use, priority and random generator state, and the FIFO of work waiting for it (a session runs
  one request at a time).
- :class:`SessionTable`: every session by id, plus the idle ones in last-use order (TTL and
  ``max_sessions`` take the oldest) and the idle *resident* ones per tenant and priority in
  last-use order, with the blocks they hold per tenant (reclaim evicts the lowest priority,
  least recently used first, from the tenants above their K/V share first). Every operation is
  O(1) except :meth:`SessionTable.victim`, O(distinct priorities) for a preferred tenant and
  O(tenants x distinct priorities) over all.
- Session files (:func:`write_session_file`, :func:`read_session_file`), format version 1::

      offset  bytes  field
      0       16     magic b"KVSERVE-SESSION\\n"
      16      4      format version (u32 little-endian, 1)
      20      4      H: header length (u32)
      24      8      K: K/V state length (u64)
      32      H      header: UTF-8 JSON (session id, model identity and name, K/V type,
                     tokens, n_kv, random generator state, priority, saved_at)
      32+H    K      the K/V state: ``Context.seq_state_read`` bytes (positions, tokens and
                     K/V rows of every layer as stored: f16/q8_0/f32; for a model with
                     several layer groups, each group's cells: rust/core/src/kv/state.rs)
      32+H+K  32     SHA-256 of every byte before it

  A file is written to a temporary file in the target's directory, flushed, fsynced and
  renamed over the target (atomic: a reader sees the old file or the new one, never a mix; an
  interrupted write leaves the old file as it was). Reading checks, in order, the size, magic,
  version, lengths (a truncated file), checksum (a corrupt file), header fields, and then the
  model identity, K/V type and vocabulary against the engine's; any failure is a
  :class:`SessionFileError` (a ``ValueError``) and loads nothing.

  The header fields, each checked for type and range by :func:`read_session_file` (a field
  not listed here is refused): ``session_id`` a non-empty string; ``model_identity`` a string;
  ``model_name`` a string, null or absent; ``kv_type`` one of :data:`KV_TYPES`; ``tokens`` a
  list of integers >= 0 (below the model's vocabulary size: :func:`check_header`); ``n_kv``
  an integer in ``[0, len(tokens)]``; ``priority`` an integer in
  ``[PRIORITY_MIN, PRIORITY_MAX]`` (:mod:`kvserve.options`); ``saved_at`` a finite number or
  absent; ``rng_state`` null, absent, or the state of numpy's default generator
  (``np.random.default_rng(seed).bit_generator.state``: ``{"bit_generator": "PCG64",
  "state": {"state": s, "inc": i}, "has_uint32": h, "uinteger": u}`` with ``0 <= s, i < 2**128``,
  ``i`` odd, ``h`` 0 or 1, ``0 <= u < 2**32``, and accepted as such by ``np.random.PCG64``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import struct
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from .options import PRIORITY_MAX, PRIORITY_MIN

__all__ = [
    "FILE_MAGIC",
    "FILE_VERSION",
    "KV_TYPES",
    "Session",
    "SessionFileError",
    "SessionInfo",
    "SessionTable",
    "Turn",
    "check_header",
    "read_session_file",
    "write_session_file",
]

StrPath = Union[str, "os.PathLike[str]"]

FILE_MAGIC = b"KVSERVE-SESSION\n"
FILE_VERSION = 1
_PREFIX = struct.Struct("<16sIIQ")  # magic, version, header length, K/V length
_DIGEST = 32
# A header bigger than this is not a session header (tokens of a 4M-token session fit).
_MAX_HEADER = 64 << 20
# The K/V element types an engine stores (``Engine(kv_type=...)``).
KV_TYPES = ("f16", "q8_0", "f32")
_REQUIRED = ("session_id", "model_identity", "kv_type", "tokens", "n_kv", "priority")
_OPTIONAL = ("model_name", "rng_state", "saved_at")
_RNG_KEYS = frozenset({"bit_generator", "state", "has_uint32", "uinteger"})


class SessionFileError(ValueError):
    """A session file cannot be loaded: truncated, corrupt (checksum), of another format
    version, of another model or K/V type, or not a session file at all. Nothing was loaded."""


@dataclass(frozen=True)
class SessionInfo:
    """One session as :meth:`kvserve.Engine.sessions` reports it.

    ``tokens``: tokens of the conversation so far (prompts and outputs); ``last_use``: wall
    time (``time.time()``) of the end of its last request (or of its creation or load);
    ``resident``: its K/V is held in the pool (else it was evicted and its next turn recomputes
    it, with prefix reuse where cached blocks remain); ``busy``: a request is running or queued
    on it."""

    id: str
    tokens: int
    last_use: float
    resident: bool
    busy: bool


class Session:
    """A named conversation (see the module docs). Owned by the engine thread."""

    def __init__(self, sid: str, now: float) -> None:
        self.id = sid
        self.ids: list[int] = []  # every prompt and output token so far
        self.seq = -1  # the sequence holding its K/V while resident
        self.n_kv = 0  # ids[:n_kv] have their K/V in ``seq``
        self.last_use = now  # time.monotonic()
        self.last_use_wall = time.time()
        self.priority = 0
        self.tenant: str | None = None  # whose it is (its last turn's tenant; K/V shares)
        self.rng_state: dict[str, Any] | None = None  # the last sampled turn's generator
        self.busy: object | None = None  # the request (or command) running on it now
        self.pending: deque[object] = deque()  # work waiting for it, FIFO
        self.evicted = False  # its K/V was reclaimed since its last turn
        # The salt of its sequence's content keys (its last attaching turn's, or its
        # tenant's when loaded from a file): an evicted session is recovered under it.
        self.salt = b""

    @property
    def resident(self) -> bool:
        return self.seq >= 0

    def info(self) -> SessionInfo:
        return SessionInfo(
            id=self.id,
            tokens=len(self.ids),
            last_use=self.last_use_wall,
            resident=self.resident,
            busy=self.busy is not None or bool(self.pending),
        )


class Turn:
    """The session part of one request: which session, its tokens as a first turn
    (``first``: with BOS) and as a continuation (``cont``: ``None`` for a request that gives the
    whole conversation, e.g. a chat, which then reuses the longest prefix the session holds)."""

    def __init__(self, session_id: str, first: list[int], cont: list[int] | None) -> None:
        self.session_id = session_id
        self.first = first
        self.cont = cont
        self.session: Session | None = None  # set by the engine thread
        self.base = 0  # tokens of the session's own history this turn starts with
        self.closing = False  # finished; its last token's K/V is computed before it parks


class SessionTable:
    """Sessions by id; idle ones by last use, and idle resident ones per tenant and priority by
    last use, with the blocks they hold per tenant (``ceil(n_kv / block_size)`` each)."""

    def __init__(self, block_size: int = 1) -> None:
        self.by_id: dict[str, Session] = {}
        self.block_size = block_size
        self._idle: OrderedDict[str, Session] = OrderedDict()
        self._parked: dict[str | None, dict[int, OrderedDict[str, Session]]] = {}
        # The tenant, priority, blocks and filing order each parked session is filed under.
        self._parked_at: dict[str, tuple[str | None, int, int, int]] = {}
        self._filed = itertools.count()
        self.parked_blocks: dict[str | None, int] = {}  # tenant -> blocks of its parked ones

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, sid: str) -> Session | None:
        return self.by_id.get(sid)

    def add(self, s: Session) -> None:
        self.by_id[s.id] = s
        self.idle(s)

    def idle(self, s: Session) -> None:
        """``s`` has nothing running: it joins the idle orders as the most recently used (the
        resident ones under its tenant and current priority)."""
        self._idle[s.id] = s
        self._idle.move_to_end(s.id)
        self._unpark(s)
        if s.resident:
            blocks = -(-s.n_kv // self.block_size)
            by_prio = self._parked.setdefault(s.tenant, {})
            by_prio.setdefault(s.priority, OrderedDict())[s.id] = s
            self._parked_at[s.id] = (s.tenant, s.priority, blocks, next(self._filed))
            if blocks:
                self.parked_blocks[s.tenant] = self.parked_blocks.get(s.tenant, 0) + blocks

    def busy(self, s: Session) -> None:
        """``s`` runs something: it leaves the idle orders (it is neither expired nor evicted)."""
        self._idle.pop(s.id, None)
        self._unpark(s)

    def _unpark(self, s: Session) -> None:
        at = self._parked_at.pop(s.id, None)
        if at is not None:
            tenant, prio, blocks, _ = at
            by_prio = self._parked[tenant]
            q = by_prio[prio]
            del q[s.id]
            if not q:
                del by_prio[prio]
                if not by_prio:
                    del self._parked[tenant]
            if blocks:
                left = self.parked_blocks[tenant] - blocks
                if left:
                    self.parked_blocks[tenant] = left
                else:
                    del self.parked_blocks[tenant]

    def evicted(self, s: Session) -> None:
        """``s`` is no longer resident (it stays idle)."""
        self._unpark(s)

    def remove(self, s: Session) -> None:
        """Forgets ``s``."""
        self.by_id.pop(s.id, None)
        self._idle.pop(s.id, None)
        self._unpark(s)

    def oldest_idle(self) -> Session | None:
        """The idle session used least recently (resident or not)."""
        return next(iter(self._idle.values()), None)

    def victim(self, prefer: Sequence[str | None] = ()) -> Session | None:
        """The idle resident session to evict first: of the first tenant in ``prefer`` that
        has one, else of any; lowest priority, least recently used (O(D) for a preferred
        tenant of D priorities, O(T x D) over the T tenants with idle resident sessions)."""
        for tenant in prefer:
            by_prio = self._parked.get(tenant)
            if by_prio:
                return next(iter(by_prio[min(by_prio)].values()))
        best: tuple[int, int, Session] | None = None
        for by_prio in self._parked.values():
            prio = min(by_prio)
            s = next(iter(by_prio[prio].values()))
            key = (prio, self._parked_at[s.id][3])
            if best is None or key < best[:2]:
                best = (*key, s)
        return None if best is None else best[2]

    def values(self) -> list[Session]:
        return list(self.by_id.values())


# -- session files -----------------------------------------------------------------------------


def _write_all(f: Any, data: bytes) -> None:
    """Writes ``data`` to the open file ``f`` (the one place a session file's bytes are
    written; tests interrupt it)."""
    f.write(data)


def write_session_file(path: StrPath, header: dict[str, Any], kv: bytes) -> None:
    """Writes a session file atomically (see the module docs): a temporary file in the same
    directory, fsynced, then renamed over ``path``. On any error the temporary file is removed
    and ``path`` is left as it was."""
    target = Path(os.fspath(path))
    head = json.dumps(header, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(FILE_MAGIC, FILE_VERSION, len(head), len(kv))
    digest = hashlib.sha256()
    for part in (prefix, head, kv):
        digest.update(part)
    # The writer's pid in the name: remove_stale_temps leaves a live process's writes alone.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        # Owner-only (0600) from the start: a session file holds a conversation.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            _write_all(f, prefix + head)
            _write_all(f, kv)
            _write_all(f, digest.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # make the rename durable too (best effort: not every platform opens directories)
        fd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_TEMP = re.compile(r"\..+\.(\d+)\.[0-9a-f]{32}\.tmp")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, owned by someone else
        return True
    return True


def remove_stale_temps(folder: StrPath) -> list[Path]:
    """Removes the temporary files that :func:`write_session_file` left in ``folder`` and its
    subdirectories when its process was killed mid-write (SIGKILL, power loss: the session
    file itself is then the old one, intact): those whose writer (the pid in the name) is no
    longer running, so another live server's save in the same directory is left alone (e.g.
    at server start); returns what it removed."""
    removed = []
    for path in Path(os.fspath(folder)).rglob(".*.tmp"):
        m = _TEMP.fullmatch(path.name)
        if m and not _alive(int(m.group(1))) and path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(where: str, name: str, why: str) -> SessionFileError:
    return SessionFileError(f"{where}: header field {name!r} {why}")


def _check_rng_state(state: object, where: str) -> None:
    """``state`` must be a PCG64 state as numpy's default generator reports it (see the module
    docs), which a fresh ``np.random.PCG64`` takes and reports back unchanged."""

    def bad(why: str) -> SessionFileError:
        return _bad(where, "rng_state", f"is not a PCG64 generator state ({why})")

    if not isinstance(state, dict) or set(state) != _RNG_KEYS:
        raise bad(f"keys {sorted(_RNG_KEYS)} expected")
    if state["bit_generator"] != "PCG64":
        raise bad(f"bit_generator {state['bit_generator']!r}")
    inner = state["state"]
    if not isinstance(inner, dict) or set(inner) != {"state", "inc"}:
        raise bad("its 'state' must hold exactly 'state' and 'inc'")
    for name, value, limit in (
        ("state.state", inner["state"], 1 << 128),
        ("state.inc", inner["inc"], 1 << 128),
        ("has_uint32", state["has_uint32"], 2),
        ("uinteger", state["uinteger"], 1 << 32),
    ):
        if not _is_int(value) or not 0 <= value < limit:
            raise bad(f"{name} must be an integer in [0, {limit})")
    if not inner["inc"] & 1:
        raise bad("state.inc must be odd")
    try:
        generator = np.random.PCG64()
        generator.state = state
        ok = generator.state == state
    except Exception as e:  # whatever numpy raises: the state is not one it takes
        raise bad(f"numpy refuses it: {e}") from e
    if not ok:
        raise bad("numpy reads it back differently")


def _check_fields(header: object, where: str) -> None:
    """Checks every header field's type and range (see the module docs); refuses a header with
    a missing, malformed or unknown field. ``where`` starts the error messages."""
    if not isinstance(header, dict):
        raise SessionFileError(f"{where}: the header is not an object")
    unknown = set(header) - set(_REQUIRED) - set(_OPTIONAL)
    if unknown:
        names = ", ".join(repr(k) for k in sorted(unknown))
        raise SessionFileError(f"{where}: unknown header field(s) {names}")
    missing = [name for name in _REQUIRED if name not in header]
    if missing:
        raise SessionFileError(f"{where}: header field(s) {', '.join(map(repr, missing))} missing")
    sid = header["session_id"]
    if not isinstance(sid, str) or not sid:
        raise _bad(where, "session_id", "must be a non-empty string")
    if not isinstance(header["model_identity"], str):
        raise _bad(where, "model_identity", "must be a string")
    name = header.get("model_name")
    if name is not None and not isinstance(name, str):
        raise _bad(where, "model_name", "must be a string or null")
    if not isinstance(header["kv_type"], str) or header["kv_type"] not in KV_TYPES:
        raise _bad(where, "kv_type", f"must be one of {', '.join(KV_TYPES)}")
    tokens = header["tokens"]
    if not isinstance(tokens, list):
        raise _bad(where, "tokens", "must be a list of token ids")
    if not all(type(t) is int for t in tokens) or (tokens and min(tokens) < 0):
        raise _bad(where, "tokens", "holds a non-token (token ids are integers >= 0)")
    n_kv = header["n_kv"]
    if not _is_int(n_kv) or not 0 <= n_kv <= len(tokens):
        raise _bad(where, "n_kv", f"must be an integer in [0, {len(tokens)}] (the tokens)")
    priority = header["priority"]
    if not _is_int(priority) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise _bad(where, "priority", f"must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}]")
    if "saved_at" in header:
        t = header["saved_at"]
        if not (_is_int(t) or isinstance(t, float) and math.isfinite(t)):
            raise _bad(where, "saved_at", "must be a finite number")
    rng = header.get("rng_state")
    if rng is not None:
        _check_rng_state(rng, where)


def read_session_file(path: StrPath) -> tuple[dict[str, Any], bytes]:
    """Reads and checks a session file (see the module docs); returns its header and K/V state.
    The caller still checks the model identity and K/V type (:func:`check_header`)."""
    where = f"session file {os.fspath(path)}"
    data = Path(os.fspath(path)).read_bytes()  # OSError (missing, unreadable) as it comes
    if len(data) < _PREFIX.size + _DIGEST:
        raise SessionFileError(f"{where}: {len(data)} bytes is too short (truncated?)")
    magic, version, n_head, n_kv = _PREFIX.unpack_from(data)
    if magic != FILE_MAGIC:
        raise SessionFileError(f"{where}: not a kvserve session file")
    if version != FILE_VERSION:
        raise SessionFileError(
            f"{where}: format version {version}, this kvserve reads version {FILE_VERSION}"
        )
    want = _PREFIX.size + n_head + n_kv + _DIGEST
    if n_head > _MAX_HEADER or len(data) != want:
        raise SessionFileError(
            f"{where}: {len(data)} bytes, its lengths say {want} (truncated or corrupt)"
        )
    body = memoryview(data)[: want - _DIGEST]
    if hashlib.sha256(body).digest() != data[want - _DIGEST :]:
        raise SessionFileError(f"{where}: checksum mismatch (the file is corrupt)")
    try:
        header = json.loads(bytes(body[_PREFIX.size : _PREFIX.size + n_head]))
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise SessionFileError(f"{where}: unreadable header ({e})") from e
    _check_fields(header, where)
    return header, bytes(body[_PREFIX.size + n_head :])


def check_header(
    header: dict[str, Any],
    path: StrPath,
    identity: str,
    kv_type: str,
    *,
    n_vocab: int | None = None,
) -> None:
    """Rejects a file made by another model or for another K/V type, or (given the model's
    vocabulary size ``n_vocab``; None skips this) holding a token id ``>= n_vocab``.
    ``header``: as :func:`read_session_file` returned it (its fields are checked again)."""
    where = f"session file {os.fspath(path)}"
    _check_fields(header, where)
    if header["model_identity"] != identity:
        name = header.get("model_name") or "?"
        raise SessionFileError(
            f"{where}: saved by another model ({name!r}, identity {header['model_identity']}); "
            f"this engine's model has identity {identity}"
        )
    if header["kv_type"] != kv_type:
        raise SessionFileError(
            f"{where}: saved with kv_type={header['kv_type']!r}, this engine uses {kv_type!r}"
        )
    tokens = header["tokens"]
    if n_vocab is not None and tokens and max(tokens) >= n_vocab:
        raise SessionFileError(
            f"{where}: header field 'tokens' holds token id {max(tokens)}, outside this "
            f"model's vocabulary of {n_vocab}"
        )
