//! `Memory`: the sequence interface every memory kind implements, after llama.cpp's memory
//! interface. Today the full-attention [`PagedCache`] implements it; the sliding-window group
//! (Gemma 3) and the recurrent-state group (hybrid models) of later issues implement it too, on
//! the same block pool, and a hybrid memory forwards each call to its groups.
//!
//! Conventions (docs/KV_SEMANTICS.md): negative `p0`/`p1` are open ends; `s < 0` means every
//! sequence where the operation allows it. An operation a memory kind cannot honour (e.g. a
//! partial `seq_rm` of a recurrent state) fails with a clear error and changes nothing.

use super::cache::PagedCache;
use super::table::{Pos, SeqId};
use crate::error::Result;

pub trait Memory {
    /// Drops positions `[p0, p1)` of `s`.
    fn seq_rm(&mut self, s: SeqId, p0: Pos, p1: Pos) -> Result<()>;
    /// `dst` also holds `src`'s positions in `[p0, p1)` (shared, copy-on-write).
    fn seq_cp(&mut self, src: SeqId, dst: SeqId, p0: Pos, p1: Pos) -> Result<()>;
    /// Drops every sequence but `s`.
    fn seq_keep(&mut self, s: SeqId) -> Result<()>;
    /// Adds `delta` to positions in `[p0, p1)` of `s`.
    fn seq_add(&mut self, s: SeqId, p0: Pos, p1: Pos, delta: Pos) -> Result<()>;
    /// Divides positions in `[p0, p1)` of `s` by `d`.
    fn seq_div(&mut self, s: SeqId, p0: Pos, p1: Pos, d: i32) -> Result<()>;
    /// Lowest stored position of `s`, or -1.
    fn seq_pos_min(&self, s: SeqId) -> Pos;
    /// Highest stored position of `s`, or -1.
    fn seq_pos_max(&self, s: SeqId) -> Pos;
    /// Drops everything.
    fn clear(&mut self);
}

impl Memory for PagedCache {
    fn seq_rm(&mut self, s: SeqId, p0: Pos, p1: Pos) -> Result<()> {
        self.table_mut().seq_rm(s, p0, p1);
        Ok(())
    }

    fn seq_cp(&mut self, src: SeqId, dst: SeqId, p0: Pos, p1: Pos) -> Result<()> {
        self.table_mut().seq_cp(src, dst, p0, p1)
    }

    fn seq_keep(&mut self, s: SeqId) -> Result<()> {
        self.table_mut().seq_keep(s)
    }

    fn seq_add(&mut self, s: SeqId, p0: Pos, p1: Pos, delta: Pos) -> Result<()> {
        self.table_mut().seq_add(s, p0, p1, delta)
    }

    fn seq_div(&mut self, s: SeqId, p0: Pos, p1: Pos, d: i32) -> Result<()> {
        self.table_mut().seq_div(s, p0, p1, d)
    }

    fn seq_pos_min(&self, s: SeqId) -> Pos {
        self.table().seq_pos_min(s)
    }

    fn seq_pos_max(&self, s: SeqId) -> Pos {
        self.table().seq_pos_max(s)
    }

    fn clear(&mut self) {
        PagedCache::clear(self)
    }
}
