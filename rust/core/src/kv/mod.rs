//! The paged KV cache.
//!
//! - [`pool`]: a lock-free pool of fixed-size blocks (free / cached / referenced, refcounts).
//! - [`table`]: per-sequence block tables with llama.cpp's sequence operations; it plans the
//!   writes, copy-on-write copies and K-shifts that the storage performs.
//! - [`storage`]: the K/V data of every block (f16, q8_0 or f32), never moved.
//! - [`attention`]: attention of a query head group over a sequence's own blocks.
//!
//! Semantics are written down in docs/KV_SEMANTICS.md. Not yet wired into the forward pass
//! (model/cache.rs still serves it); that is the next step of issue #3.

pub mod attention;
pub mod pool;
pub mod storage;
pub mod table;

#[cfg(test)]
mod tests;

pub use pool::{BlockId, BlockPool, PoolStats, NO_KEY};
pub use table::{CellShift, CowCopy, KvTable, Pos, SeqId, TableStats, Updates, WritePlan};
