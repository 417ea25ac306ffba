"""Type stubs for ``kvserve._core``, the private PyO3 binding of the Rust engine.

Use the public API in :mod:`kvserve` instead; this module may change without notice.
"""

import os
from typing import Any

from typing_extensions import Buffer

class ModelError(ValueError):
    """A model file is malformed, truncated or uses an unsupported feature."""

class EngineError(RuntimeError):
    """A failure inside the engine (a worker thread panicked); the batch was rolled back."""

class KvCacheFull(RuntimeError):
    """A batch does not fit in the context's KV cache; the cache is left unchanged."""

class Model:
    """A GGUF model, memory-mapped read-only; weights are shared by all its contexts."""

    def __init__(self, path: str | os.PathLike[str], threads: int | None = None) -> None: ...
    @property
    def n_vocab(self) -> int: ...
    @property
    def n_ctx_train(self) -> int: ...
    @property
    def bos(self) -> int | None: ...
    @property
    def eos(self) -> int | None: ...
    @property
    def add_bos(self) -> bool: ...
    @property
    def arch(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def threads(self) -> int: ...
    @property
    def repacked_bytes(self) -> int: ...
    @property
    def identity(self) -> str:
        """The weights' 128-bit identity as 32 hex digits (part of prefix keys and sessions)."""
    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]: ...
    def detokenize(self, tokens: list[int]) -> str: ...
    def token_to_piece(self, token: int, special: bool = False) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def new_context(
        self,
        n_ctx: int = 4096,
        kv_type: str = "f16",
        block_size: int = 16,
        kv_memory: int | None = None,
        prefix_cache: bool = True,
        memory_tokens: int | None = None,
        n_seq_max: int = 1,
        n_batch: int = 2048,
    ) -> Context: ...
    def metadata(self) -> dict[str, object]: ...
    @property
    def redone_tasks(self) -> int:
        """Matmul tasks a waiting worker computed again and published (its partner was
        descheduled mid-task) since the model was loaded: a thread-contention diagnostic."""

    def _inject_worker_panic(self, layer: int | None) -> None:
        """Testing hook: the next decode panics in one worker at ``layer`` (once)."""

class Context:
    """One context's sequences over the model's shared K/V memory (one block pool and prefix
    index per model and K/V format). Calls from several threads are serialized on the context;
    ``n_ctx``, ``n_cells`` and ``stats()`` never wait for a running decode."""

    @property
    def n_ctx(self) -> int: ...
    @property
    def n_cells(self) -> int: ...
    def decode(
        self,
        tokens: list[int],
        positions: list[int],
        seq_ids: list[int],
        logits: list[bool],
    ) -> Logits: ...
    def blocks_short(self, positions: list[int], seq_ids: list[int]) -> int:
        """Ask before decoding: whether a batch of these ``positions`` and ``seq_ids`` (as
        :meth:`decode` would get them; the tokens do not matter) fits the K/V memory now,
        counting every layer group (full attention, sliding window, recurrent states). ``0``:
        it fits, and :meth:`decode` of it does not raise ``KvCacheFull`` unless another context
        of the model takes blocks in between. Otherwise the largest number of blocks missing
        in any group's pool, and :meth:`decode` of it raises ``KvCacheFull``: free and cached
        (evictable) blocks count as available; a copy of a shared partly filled tail block
        (copy-on-write) and a new or shared recurrent state need blocks; tokens beyond the
        context's ``n_ctx`` count as ``ceil(excess / block_size)`` blocks. Changes nothing.
        ``ValueError`` for a batch :meth:`decode` rejects as malformed (empty, lengths differ,
        negative values, positions of a sequence not increasing past its last one, more than
        ``n_batch`` tokens on a model with sliding-window layers)."""
    def clear(self) -> None: ...
    def seq_pos_min(self, seq: int) -> int: ...
    def seq_pos_max(self, seq: int) -> int: ...
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None: ...
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...
    def seq_keep(self, seq: int) -> None: ...
    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None: ...
    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None: ...
    def peek_prefix(self, tokens: list[int], salt: bytes = b"") -> int:
        """How many tokens ``match_prefix`` would map now for a sequence salted with
        ``salt``, changing nothing (an estimate)."""
    def seq_set_salt(self, seq: int, salt: bytes) -> None:
        """Salt the empty sequence ``seq``: it reuses cached prefixes only of sequences with
        the same salt (``b""``: unsalted). Kept for the id until set again; ``seq_cp`` into
        an empty sequence copies it."""
    def match_prefix(self, seq: int, tokens: list[int], staged: KvStaged | None = None) -> int:
        """Map the longest cached prefix of ``tokens`` (whole blocks, at most
        ``len(tokens) - 1`` tokens) into the empty sequence ``seq``; returns its length ``n``.
        Decode ``tokens[n:]`` at positions ``n, n+1, ...`` next. ``staged``: blocks
        :meth:`kv_remote_fetch` brought for these tokens and the sequence's salt; a block
        neither RAM nor disk holds is copied from them (taken once)."""
    def kv_remote_fetch(self, tokens: list[int], salt: bytes = b"") -> KvStaged:
        """The blocks a match of ``tokens`` under ``salt`` needs beyond RAM and disk that the
        shared tier has (the leading run, verified; with sliding-window layers one set per
        layer group: the window group's window before the point the full group reaches). Any
        thread; never waits for the context; never fails (a store that is down or slow gives
        fewer blocks, counted)."""
    def kv_remote_keys(self, tokens: list[int], salt: bytes = b"") -> list[str]:
        """The shared tier's store keys of the whole blocks of ``tokens`` under ``salt`` (the
        primary, full-attention group's; a window group's carry its own model id)."""
    def set_kv_remote(
        self,
        url: str | None,
        ttl_s: float | None = None,
        min_tokens: int | None = None,
        timeout_s: float | None = None,
        max_fetch_blocks: int = 0,
        max_staged_bytes: int = 0,
    ) -> None:
        """Attach the shared K/V tier on the Redis / Valkey store at ``url`` (``None``:
        detach it), a tier per K/V layer group (a hybrid model's state checkpoints in the
        full-attention group's); does not connect. ``ModelError`` for a TLS URL,
        ``ValueError`` for a bad URL or option."""
    def kv_remote_flush(self) -> None:
        """Wait until the shared tier (if any) sent every block handed to it so far."""
    def kv_remote_ping(self) -> str | None:
        """None when the shared tier's store answers (or there is none), else why not."""
    def seq_state_read(self, seq: int) -> bytes:
        """The state of ``seq``: positions, token ids and K/V rows as stored (f16/q8_0/f32
        bytes), with the weights identity and K/V format; with several layer groups
        (sliding-window layers), each group's cells (a window group's window only)."""
    def seq_state_write(self, seq: int, data: bytes) -> int:
        """Writes a state from :meth:`seq_state_read` into the empty sequence ``seq`` without
        recomputing it; returns its token count. All or nothing (``ValueError``,
        ``KvCacheFull``)."""
    def seq_state_check(self, data: bytes, tokens: list[int]) -> int:
        """Check, writing nothing, that ``data`` (from :meth:`seq_state_read`) is a state of
        this model, K/V format and layer groups that holds exactly ``tokens`` at positions
        ``0..n-1`` (a saved session's state); returns ``n``. Everything
        :meth:`seq_state_write` validates (every length exact, every header field in range,
        every layer group consistent with the primary one), and: the primary group's cells
        are ``tokens`` at positions ``0..n-1``, a sliding-window group holds the positions the
        next token sees, and a hybrid model's recurrent state is at position ``n - 1`` (none
        when ``n == 0``). ``ValueError`` saying what differs. A state that passes is written
        by :meth:`seq_state_write` (given room) as the sequence of ``tokens``."""
    def set_kv_disk(
        self, path: str | os.PathLike[str] | None, max_bytes: int, min_tokens: int | None = None
    ) -> None:
        """Attach the K/V disk tier under ``path`` to the model's K/V memory (``None``:
        detach it): every context of the model then writes the blocks its decodes key through
        to disk and continues prefix matches there. At most ``max_bytes`` of entries (least
        recently used ones go); prompts shorter than ``min_tokens`` (default: the measured
        break-even) skip it. With sliding-window layers (Gemma 3) each K/V layer group gets
        its own tier under ``path/<its model id>/``, ``max_bytes`` split by bytes per block;
        a hybrid model (LFM2) stores its state checkpoints in the full-attention group's tier.
        ``OSError`` for an unusable directory or one another process holds, ``ValueError``
        when ``max_bytes`` holds no block."""
    def kv_disk_flush(self) -> None:
        """Wait until the disk tier (if any) wrote every block handed to it so far."""
    def kv_events_enable(self, capacity: int | None) -> None:
        """Record the model's KV events for this K/V memory, at most ``capacity`` waiting
        between drains (None: stop). Off by default."""
    def kv_events_drain(self) -> tuple[list[tuple[Any, ...]], int]:
        """``(events, dropped)``: ``("BlockStored", key, parent, tokens, medium)``,
        ``("BlockRemoved", key, medium)``, ``("AllBlocksCleared",)``; after drops (or first
        after enabling) a snapshot: ``AllBlocksCleared`` then every key held."""
    def block_keys(self, tokens: list[int], salt: bytes = b"") -> list[int]:
        """The content keys of the whole blocks of ``tokens`` under ``salt``, in order."""
    def stats(self) -> dict[str, Any]:
        """Pool and context counters; ``groups``: one dict per layer group (kind, window,
        layers, blocks_total/free/cached/referenced, bytes_per_block/total/referenced,
        tokens_stored, blocks_held); a hybrid model's recurrent group comes last (kind
        ``recurrent``, ``states``: sequences holding a state; its blocks are the primary pool's,
        ``blocks_referenced``/``blocks_held``: those this context's states take). ``disk_*``:
        the model's disk tier (``disk_enabled``, ``disk_dir``, ``disk_hit_blocks``,
        ``disk_hit_tokens``, ``disk_misses``, ``disk_bytes_read``, ``disk_bytes_written``,
        ``disk_writes``, ``disk_writes_dropped``, ``disk_removed``, ``disk_evicted``,
        ``disk_skipped``, ``disk_entries``, ``disk_bytes_held``, ``disk_bytes_max``,
        ``disk_loaded``, ``disk_queued``, ``disk_read_seconds``,
        ``disk_min_tokens``; zeros without a tier). ``remote_*``: the shared tier
        (``remote_enabled``, ``remote_url`` without the password, ``remote_fetches``,
        ``remote_fetched_blocks``, ``remote_hit_blocks``, ``remote_hit_tokens``,
        ``remote_misses``, ``remote_invalid``, ``remote_lost``, ``remote_bytes_read``,
        ``remote_bytes_written``, ``remote_writes``, ``remote_writes_existing``,
        ``remote_writes_dropped``, ``remote_errors``, ``remote_skipped_short``,
        ``remote_skipped_down``, ``remote_skipped_full``, ``remote_staged_bytes``,
        ``remote_queued``, ``remote_fetch_seconds``,
        ``remote_min_tokens``, ``remote_down``)."""
    def audit(self) -> None:
        """Check every invariant of this context's tables and the model's pool (tests)."""
    def _inject_panic(self) -> None:
        """Testing hook: the next call that runs on this context (any method but ``n_ctx``,
        ``n_cells`` and ``stats``) panics inside the engine before doing anything, so the
        context closes as after a real internal error: that call raises ``EngineError``, the
        context's blocks go back to the model's shared pools at once (``stats()`` still reports
        the pools; its own counts read 0), and every later call raises ``EngineError``."""

class KvStaged:
    """Blocks fetched from the shared K/V tier for one prompt (a set per K/V layer group),
    until a ``match_prefix`` takes them."""

    @property
    def blocks(self) -> int: ...
    def release(self) -> None:
        """Give the staged bytes back now."""

class Logits:
    """Row-major float32 logits, ``n_rows`` x ``n_vocab``, exposed through the buffer protocol.

    ``np.frombuffer(l, dtype=np.float32).reshape(l.n_rows, l.n_vocab)`` is a zero-copy view.
    """

    @property
    def n_rows(self) -> int: ...
    @property
    def n_vocab(self) -> int: ...
    def __len__(self) -> int: ...
    def argmax(self, row: int, /) -> int:
        """The index of row ``row``'s largest value, the first on ties, the first NaN if the
        row holds any (numpy's ``argmax`` rule); ``IndexError`` for a row out of range."""
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

def bench(
    model: Model, n_prompt: int = 512, n_gen: int = 128, reps: int = 3, depth: int = 0
) -> dict[str, Any]:
    """``prefill_tok_s``, ``decode_tok_s``, ``threads`` and ``kv_groups``: per K/V layer group
    (``kind``, ``window``, ``layers``, ``blocks_total``, ``blocks_held``, ``bytes_per_block``,
    ``bytes_held``, ``bytes_total``) what the one sequence held after its prompt."""

def bench_batched(
    model: Model, batches: list[int], n_prompt: int = 128, n_gen: int = 64
) -> list[dict[str, float]]: ...
def dequantize(type_name: str, data: bytes, n: int) -> Buffer: ...
def simd_level() -> str: ...
