//! The paged KV cache.
//!
//! - [`pool`]: a pool of fixed-size blocks (free / cached / referenced, refcounts, LRU of cached
//!   blocks), lock-free but for O(1) critical sections on the cached list.
//! - [`table`]: per-sequence block tables with llama.cpp's sequence operations; it plans the
//!   writes, copy-on-write copies and K-shifts that the storage performs.
//! - [`storage`]: the K/V data of every block (f16, q8_0 or f32), never moved.
//! - [`attention`]: attention of a query head group over a sequence's own blocks.
//!
//! - [`prefix`]: content keys of full blocks and the key -> block index for prefix reuse.
//! - [`events`]: KV events (a block's key stored in / removed from the index), opt-in and
//!   bounded, in vLLM's KV-events shape, for routers outside the process.
//!
//! - [`disk`]: the local disk tier (L2): full keyed blocks the RAM pool evicted, found again
//!   by their content keys (and after a restart).
//!
//! - [`remote`]: the shared tier (L3): full keyed blocks in Redis / Valkey, shared by every
//!   process serving the model.
//!
//! - [`state`]: a sequence's cells (positions, tokens, K/V as stored) as bytes and back
//!   (saving and restoring sessions).
//!
//! - [`recurrent`]: the recurrent-state group of hybrid models (one state per sequence in pool
//!   blocks, copy-on-write, llama.cpp's rules for what it cannot honour, state checkpoints at
//!   block boundaries for prefix reuse).
//!
//! - [`memory`]: the `Memory` trait (sequence operations) each memory kind implements, the
//!   kinds of memory a layer needs ([`LayerKind`]) and a context's memory as layer groups.
//! - [`cache`]: `SharedKv` (pool + storage + index of one model, shared by its contexts) and
//!   `PagedCache` (one context's tables over it, batches as transactions).
//!
//! Semantics are written down in docs/KV_SEMANTICS.md.

pub mod attention;
pub mod cache;
pub mod disk;
pub mod events;
pub mod memory;
pub mod pool;
pub mod prefix;
pub mod recurrent;
pub mod remote;
pub mod state;
pub mod storage;
pub mod table;

#[cfg(all(test, not(loom)))]
mod tests;

/// `n` copies of `v`, or `OutOfMemory` naming `what` instead of aborting the process (a KV
/// cache sized by a mistyped `--ctx-size` must not take a server down).
pub(crate) fn try_vec<T: Clone>(n: usize, v: T, what: &str) -> crate::Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n)
        .map_err(|_| crate::Error::OutOfMemory(format!("cannot allocate {what} ({n} entries)")))?;
    out.resize(n, v);
    Ok(out)
}

pub use cache::{
    blocks_for_tokens, BatchNeed, PagedCache, PrefixStats, SharedKv, DEFAULT_BLOCK_SIZE,
};
pub use disk::{DiskOptions, DiskStats, DiskTier};
pub use events::{Drained, KvEvent, Medium};
pub use memory::{Group, GroupKind, LayerGroups, LayerKind, Memory, PlannedBatch, RecurrentLayers};
pub use pool::{BlockId, BlockPool, PoolStats, NO_KEY};
pub use prefix::{block_key, chain_keys, salt_root, Key, KeyHasher, PrefixIndex, ROOT_KEY};
pub use remote::{RemoteOptions, RemoteStats, RemoteTier, Staged};
pub use table::{
    BatchTx, CellShift, CowCopy, KvTable, Pos, SeqId, SeqView, TableStats, Updates, WritePlan,
};
