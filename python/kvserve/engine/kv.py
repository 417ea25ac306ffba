"""The KV manager: the only code of the engine that calls the decoding context
(``kvserve._core.Context``). It owns sequence ids, prefix matching, forks, releases, truncation,
context shifts, sequence states and the forward pass, and it replaces the context when an
internal error has closed it (a Rust panic outside the forward pass closes a context for good;
see rust/py/src/model.rs, ``Context::with``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._model import EngineError, KvCacheFull, StrPath
from ..sessions import SessionFileError

if TYPE_CHECKING:
    from .._core import Context, KvStaged, Logits
    from .._model import Model

__all__ = ["KvManager"]

log = logging.getLogger("kvserve.engine")


def _staged_budget(pool_bytes: int, parallel: int) -> int:
    """Bytes of fetched blocks that may wait for admission at once (see KvManager)."""
    return min(pool_bytes, max(1 << 30, pool_bytes // max(1, parallel)))


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
        kv_disk: StrPath | None = None,
        kv_disk_size: int = 0,
        kv_disk_min_tokens: int | None = None,
        kv_remote: str | None = None,
        kv_remote_ttl: float | None = None,
        kv_remote_min_tokens: int | None = None,
        kv_remote_timeout: float | None = None,
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
        self._events_on = False  # whether kv_events enabled the memory's event log
        self._free = list(range(parallel - 1, -1, -1))
        self._next = parallel
        st = self.ctx.stats()
        self.kv_type = str(st["kv_type"])
        self.block = int(st["block_size"])
        self.pool_tokens = int(st["blocks_total"]) * self.block
        self.n_ctx = int(self.ctx.n_ctx)
        if kv_disk is not None:
            # The tier belongs to the model's K/V memory: contexts made later (reopen) share it.
            self.ctx.set_kv_disk(os.fspath(kv_disk), kv_disk_size, kv_disk_min_tokens)
        self.remote = False
        if kv_remote is not None:
            self.ctx.set_kv_remote(
                kv_remote,
                ttl_s=kv_remote_ttl,
                min_tokens=kv_remote_min_tokens,
                timeout_s=kv_remote_timeout,
                # A fetch brings at most what the pool holds, and blocks staged for requests
                # not yet admitted take at most the pool's size, or 1 GiB, but at least a
                # sequence's share of the pool (the rest is computed).
                max_fetch_blocks=int(st["blocks_total"]),
                max_staged_bytes=_staged_budget(
                    int(st["blocks_total"]) * int(st["bytes_per_block"]), parallel
                ),
            )
            self.remote = True
            down = self.ctx.kv_remote_ping()
            if down is not None:
                log.warning(
                    "the shared K/V tier's store does not answer (%s): requests compute"
                    " what they would have fetched until it does",
                    down,
                )

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
    def match(
        self, seq: int, ids: Sequence[int], salt: bytes, staged: KvStaged | None = None
    ) -> int:
        """Salts the new (empty) sequence ``seq`` with ``salt`` (its blocks' content keys, so
        the cached prefixes it may reuse and the ones it leaves: tenancy.salt_for) and maps
        the longest cached prefix of ``ids`` under that salt onto it, taking blocks that
        neither RAM nor disk holds from ``staged`` (:meth:`fetch`)."""
        self.ctx.seq_set_salt(seq, salt)
        if not self.prefix_cache:
            return 0
        return self.ctx.match_prefix(seq, list(ids), staged)

    def fetch(self, ids: Sequence[int], salt: bytes) -> KvStaged | None:
        """The blocks of ``ids`` under ``salt`` that the shared tier has and RAM and disk
        lack (for :meth:`match`): any thread, never waits for the engine; None without a
        tier or when it brought nothing."""
        if not (self.remote and self.prefix_cache):
            return None
        staged = self.ctx.kv_remote_fetch(list(ids), salt)
        return staged if staged.blocks else None

    def peek(self, ids: Sequence[int], salt: bytes) -> int:
        """What :meth:`match` would map now, changing nothing."""
        return self.ctx.peek_prefix(list(ids), salt) if self.prefix_cache else 0

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

    def state_write(self, seq: int, data: bytes, salt: bytes) -> int:
        """Writes a state into the new (empty) sequence ``seq``, salted with ``salt`` (its
        full blocks are keyed as if decoded under that salt)."""
        self.ctx.seq_set_salt(seq, salt)
        return self.ctx.seq_state_write(seq, data)

    def state_check(self, kv: bytes, tokens: list[int], path: StrPath) -> None:
        """A session's K/V state must be this model's and K/V format's and hold exactly
        ``tokens`` at positions ``0..n-1`` in every layer group (the core checks it all,
        writing nothing): else a :class:`SessionFileError`."""
        try:
            self.ctx.seq_state_check(kv, tokens)
        except ValueError as e:
            raise SessionFileError(f"session file {path}: {e}") from e

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

    def kv_events(self, capacity: int, resync: bool = False) -> tuple[list[tuple[Any, ...]], int]:
        """The memory's KV events since the last call (recording starts at the first, with at
        most ``capacity`` waiting, and hands out a snapshot; ``resync`` starts it over);
        ``(events, dropped)``. The log is the model's memory's: it survives a replaced context
        and never waits for a step."""
        if resync or not self._events_on:
            self.ctx.kv_events_enable(capacity)
            self._events_on = True
        return self.ctx.kv_events_drain()

    def flush_disk(self) -> None:
        """Waits until the disk tier (if any) wrote every block handed to it so far."""
        self.ctx.kv_disk_flush()

    def flush_remote(self) -> None:
        """Waits until the shared tier (if any) sent every block handed to it so far."""
        self.ctx.kv_remote_flush()
