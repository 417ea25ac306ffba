//! The KV cache's memory bookkeeping: a lock-free pool of fixed-size blocks ([`pool`]) and the
//! per-sequence block tables with llama.cpp's sequence operations ([`table`]). No K/V data lives
//! here: block ids index into the storage, which performs the writes, copy-on-write copies and
//! K-shifts that these modules plan. Semantics are written down in docs/KV_SEMANTICS.md.

pub mod pool;
pub mod table;

#[cfg(test)]
mod tests;

pub use pool::{BlockId, BlockPool, PoolStats, NO_KEY};
pub use table::{CellShift, CowCopy, KvTable, Pos, SeqId, TableStats, Updates, WritePlan};
