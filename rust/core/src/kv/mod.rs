//! The paged KV cache.
//!
//! - [`pool`]: a lock-free pool of fixed-size blocks (free / cached / referenced, refcounts).
//! - [`table`]: per-sequence block tables with llama.cpp's sequence operations; it plans the
//!   writes, copy-on-write copies and K-shifts that the storage performs.
//! - [`storage`]: the K/V data of every block (f16, q8_0 or f32), never moved.
//! - [`attention`]: attention of a query head group over a sequence's own blocks.
//!
//! - [`prefix`]: content keys of full blocks and the key -> block index for prefix reuse.
//!
//! - [`memory`]: the `Memory` trait (sequence operations) each memory kind implements.
//! - [`cache`]: `PagedCache`, the five above glued together for a decoding context.
//!
//! Semantics are written down in docs/KV_SEMANTICS.md.

pub mod attention;
pub mod cache;
pub mod memory;
pub mod pool;
pub mod prefix;
pub mod storage;
pub mod table;

#[cfg(test)]
mod tests;

pub use cache::{PagedCache, PrefixStats, SeqView, DEFAULT_BLOCK_SIZE};
pub use memory::Memory;
pub use pool::{BlockId, BlockPool, PoolStats, NO_KEY};
pub use prefix::{block_key, PrefixIndex, ROOT_KEY};
pub use table::{CellShift, CowCopy, KvTable, Pos, SeqId, TableStats, Updates, WritePlan};
