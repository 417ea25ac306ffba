"""Sessions of the serving engine: named conversations whose K/V outlives their requests.

This module holds what :class:`kvserve.Engine` keeps per session and the session file format;
the engine (python/kvserve/engine.py) applies the policy (see its docs: reuse, reclaim,
eviction, TTL, ``max_sessions``).

- :class:`Session`: the session's tokens (every prompt and output so far), the sequence that
  holds its K/V while it is *resident* (``seq >= 0``, ``n_kv`` leading tokens computed), its last
  use, priority and random generator state, and the FIFO of work waiting for it (a session runs
  one request at a time).
- :class:`SessionTable`: every session by id, plus the idle ones in last-use order (TTL and
  ``max_sessions`` take the oldest) and the idle *resident* ones per priority in last-use order
  (reclaim evicts the lowest priority, least recently used first). Every operation is O(1)
  except :meth:`SessionTable.victim`, O(distinct priorities).
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
  model identity and K/V type against the engine's; any failure is a
  :class:`SessionFileError` (a ``ValueError``) and loads nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

__all__ = [
    "FILE_MAGIC",
    "FILE_VERSION",
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
        self.rng_state: dict[str, Any] | None = None  # the last sampled turn's generator
        self.busy: object | None = None  # the request (or command) running on it now
        self.pending: deque[object] = deque()  # work waiting for it, FIFO
        self.evicted = False  # its K/V was reclaimed since its last turn

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
    """Sessions by id; idle ones by last use, and idle resident ones per priority by last use."""

    def __init__(self) -> None:
        self.by_id: dict[str, Session] = {}
        self._idle: OrderedDict[str, Session] = OrderedDict()
        self._parked: dict[int, OrderedDict[str, Session]] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, sid: str) -> Session | None:
        return self.by_id.get(sid)

    def add(self, s: Session) -> None:
        self.by_id[s.id] = s
        self.idle(s)

    def idle(self, s: Session) -> None:
        """``s`` has nothing running: it joins the idle orders as the most recently used."""
        self._idle[s.id] = s
        self._idle.move_to_end(s.id)
        if s.resident:
            q = self._parked.setdefault(s.priority, OrderedDict())
            q[s.id] = s
            q.move_to_end(s.id)

    def busy(self, s: Session) -> None:
        """``s`` runs something: it leaves the idle orders (it is neither expired nor evicted)."""
        self._idle.pop(s.id, None)
        self._unpark(s)

    def _unpark(self, s: Session) -> None:
        for prio, q in list(self._parked.items()):
            if q.pop(s.id, None) is not None:
                if not q:
                    del self._parked[prio]
                return

    def evicted(self, s: Session) -> None:
        """``s`` is no longer resident (it stays idle)."""
        self._unpark(s)

    def remove(self, s: Session) -> None:
        self.by_id.pop(s.id, None)
        self._idle.pop(s.id, None)
        self._unpark(s)

    def oldest_idle(self) -> Session | None:
        return next(iter(self._idle.values()), None)

    def victim(self) -> Session | None:
        """The idle resident session to evict first: lowest priority, least recently used."""
        if not self._parked:
            return None
        q = self._parked[min(self._parked)]
        return next(iter(q.values()))

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
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
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


def _field(header: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = header.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise SessionFileError(f"{where}: header field {name!r} is missing or malformed")
    return value


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
    except ValueError as e:
        raise SessionFileError(f"{where}: unreadable header ({e})") from e
    if not isinstance(header, dict):
        raise SessionFileError(f"{where}: the header is not an object")
    _field(header, "session_id", str, where)
    _field(header, "model_identity", str, where)
    _field(header, "kv_type", str, where)
    n_kv_tokens = _field(header, "n_kv", int, where)
    tokens = _field(header, "tokens", list, where)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise SessionFileError(f"{where}: header field 'tokens' holds a non-token")
    if not 0 <= n_kv_tokens <= len(tokens):
        raise SessionFileError(f"{where}: n_kv={n_kv_tokens} is outside 0..{len(tokens)}")
    _field(header, "priority", int, where)
    rng = header.get("rng_state")
    if rng is not None and not isinstance(rng, dict):
        raise SessionFileError(f"{where}: header field 'rng_state' is malformed")
    return header, bytes(body[_PREFIX.size + n_head :])


def check_header(header: dict[str, Any], path: StrPath, identity: str, kv_type: str) -> None:
    """Rejects a file made by another model or for another K/V type."""
    where = f"session file {os.fspath(path)}"
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
