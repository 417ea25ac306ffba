"""The KV manager: the only code of the engine that calls the decoding context
(``kvserve._core.Context``). It owns sequence ids, prefix matching, forks, releases, truncation,
context shifts, sequence states and the forward pass, and it replaces the context when an
internal error has closed it (a Rust panic outside the forward pass closes a context for good;
see rust/py/src/model.rs, ``Context::with``)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._model import EngineError, KvCacheFull, StrPath
from ..sessions import SessionFileError

if TYPE_CHECKING:
    from .._core import Context, Logits
    from .._model import Model

__all__ = ["KvManager"]


class KvManager:
    """One context over the model's shared K/V pool and the ids of its sequences: ids below
    ``parallel`` first (running requests), then new ones beyond (parked sessions hold ids too).
    """

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int,
        kv_type: str,
        kv_memory: int | None,
        prefix_cache: bool,
        memory_tokens: int | None,
        parallel: int,
        n_batch: int,
    ) -> None:
        self.model = model
        self.prefix_cache = prefix_cache
        self.parallel = parallel
        self._args: dict[str, Any] = {
            "kv_type": kv_type,
            "kv_memory": kv_memory,
            "prefix_cache": prefix_cache,
            "memory_tokens": memory_tokens,
            # Sliding-window memory is sized for the running sequences and one step's batch.
            "n_seq_max": parallel,
            "n_batch": n_batch,
        }
        self._n_ctx = n_ctx
        self.ctx: Context = model.core.new_context(n_ctx, **self._args)
        self.reopened = 0  # times the context was replaced after an internal error
        self._free = list(range(parallel - 1, -1, -1))
        self._next = parallel
        st = self.ctx.stats()
        self.kv_type = str(st["kv_type"])
        self.block = int(st["block_size"])
        self.pool_tokens = int(st["blocks_total"]) * self.block
        self.n_ctx = int(self.ctx.n_ctx)

    # -- sequence ids ----------------------------------------------------------------------------
    def alloc(self) -> int:
        if self._free:
            return self._free.pop()
        self._next += 1
        return self._next - 1

    def free(self, seq: int) -> None:
        """Gives back the id of an empty sequence."""
        self._free.append(seq)

    def remove(self, seq: int) -> None:
        """Removes sequence ``seq`` (its full blocks stay cached) and gives its id back. The id
        is given back even when the removal fails (the context is then replaced)."""
        try:
            self.ctx.seq_rm(seq)
        finally:
            self._free.append(seq)

    # -- contents ---------------------------------------------------------------------------------
    def match(self, seq: int, ids: Sequence[int]) -> int:
        """Maps the longest cached prefix of ``ids`` onto the new sequence ``seq``."""
        return self.ctx.match_prefix(seq, list(ids)) if self.prefix_cache else 0

    def peek(self, ids: Sequence[int]) -> int:
        """What :meth:`match` would map now, changing nothing."""
        return self.ctx.peek_prefix(list(ids)) if self.prefix_cache else 0

    def fork(self, src: int, dst: int) -> None:
        """``dst`` (new) shares every block of ``src`` (copy on write)."""
        self.ctx.seq_cp(src, dst)

    def truncate(self, seq: int, n: int) -> int:
        """Keeps the first ``n`` positions of ``seq``; returns what it holds then. Where the
        memory cannot continue at ``n`` (``seq_rm`` refuses, changing nothing: a hybrid model's
        recurrent state cannot be cut back, a sliding-window group already dropped what a token
        at ``n`` sees), the whole sequence goes instead (0) and the caller recomputes it."""
        try:
            self.ctx.seq_rm(seq, n, -1)
            return n
        except ValueError:
            self.ctx.seq_rm(seq)
            return 0

    def shift(self, seq: int, keep: int, start: int) -> bool:
        """Context shift: drops positions ``[keep, start)`` of ``seq`` and moves the rest down.
        False when the move needs blocks the pool lacks (the caller preempts ``seq``)."""
        self.ctx.seq_rm(seq, keep, start)
        try:
            self.ctx.seq_add(seq, start, -1, keep - start)
        except KvCacheFull:
            return False
        return True

    def decode(
        self, tokens: list[int], positions: list[int], seqs: list[int], flags: list[bool]
    ) -> Logits:
        return self.ctx.decode(tokens, positions, seqs, flags)

    # -- states ----------------------------------------------------------------------------------
    def state_read(self, seq: int) -> bytes:
        return self.ctx.seq_state_read(seq)

    def state_write(self, seq: int, data: bytes) -> int:
        return self.ctx.seq_state_write(seq, data)

    def state_check(self, kv: bytes, tokens: list[int], path: StrPath) -> None:
        """A session's K/V state must hold exactly ``tokens`` at positions ``0..n-1``."""
        _check_state(kv, tokens, path)

    # -- memory ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self.ctx.stats()

    def available(self) -> int:
        """Blocks free or held only by the prefix cache."""
        st = self.ctx.stats()
        return int(st["blocks_free"]) + int(st["blocks_cached"])

    def usage(self) -> tuple[int, int]:
        """(referenced blocks, total blocks) of the pool."""
        st = self.ctx.stats()
        return int(st["blocks_referenced"]), int(st["blocks_total"])

    # -- failures --------------------------------------------------------------------------------
    def closed(self) -> bool:
        """Whether an internal error closed the context (every call then fails)."""
        try:
            self.ctx.seq_pos_max(-1)
        except EngineError:
            return True
        return False

    def reopen(self) -> None:
        """A new context on the same pool in place of a closed one: it holds no sequence (the
        closed one's blocks went back to the pool; its cached blocks stay reusable), and every
        id is free again."""
        self.ctx = self.model.core.new_context(self._n_ctx, **self._args)
        self._free = list(range(self.parallel - 1, -1, -1))
        self._next = self.parallel
        self.reopened += 1

    def clear(self) -> None:
        try:
            self.ctx.clear()
        except EngineError:
            pass  # a closed context holds nothing


def _primary_section(kv: bytes) -> int:
    """Offset of the cells of the primary (first full-attention, else first) K/V group in a
    sequence state (rust/core/src/kv/state.rs): 0 for a one-group state (version 1); in a
    layer-group state (version 2: the group count at byte 24, then 20 bytes per group — kind,
    window and layers as u32, section length as u64 — then the sections in that order) the
    offset of that group's section. -1 if the bytes are too short to say."""
    if len(kv) < 28 or int.from_bytes(kv[4:8], "little") != 2:
        return 0
    n = int.from_bytes(kv[24:28], "little")
    table = 28 + 20 * n
    if n == 0 or len(kv) < table:
        return -1
    entries = [struct.unpack_from("<IIIQ", kv, 28 + 20 * i) for i in range(n)]
    primary = next((i for i, e in enumerate(entries) if e[0] == 0), 0)
    return table + sum(e[3] for e in entries[:primary])


def _check_state(kv: bytes, tokens: list[int], path: StrPath) -> None:
    """A session's K/V state must hold exactly ``tokens`` at positions ``0..n-1`` in its primary
    group (the core's sequence state layout, rust/core/src/kv/state.rs: from the section's
    start, the cell count at byte 44, then the positions and the token ids as little-endian
    32-bit integers). The core checks the rest (every other group's cells are the primary's)."""
    n = len(tokens)
    at = _primary_section(kv)
    ok = at >= 0 and len(kv) >= at + 48 + 8 * n
    ok = ok and int.from_bytes(kv[at + 44 : at + 48], "little") == n
    if ok and n:
        cells = np.frombuffer(kv, dtype="<i4", count=2 * n, offset=at + 48)
        ok = bool(np.array_equal(cells[:n], np.arange(n))) and cells[n:].tolist() == tokens
    if not ok:
        raise SessionFileError(
            f"session file {path}: its K/V state does not hold the session's {n} tokens"
        )
