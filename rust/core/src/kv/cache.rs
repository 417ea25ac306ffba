//! `PagedCache`: the paged KV cache a [`crate::model::Context`] decodes into. It glues the
//! block pool and tables ([`super::table`]) to the K/V data ([`super::storage`]):
//!
//! - `reserve(batch)` plans where every token goes (blocks on demand, copy-on-write of shared
//!   partly filled tails), applies pending storage work in order (copies, then K-shifts: keys
//!   re-rotated by the position delta of `seq_add`/`seq_div`, lazily like llama.cpp's K-shift),
//!   and returns one `(block, slot)` per token. A batch that does not fit fails with
//!   `KvCacheFull` and changes nothing.
//! - `write(layer, slots, k, v)` stores the batch's keys and values of one layer.
//! - `view(seq)` gives the sequence's block list and per-slot positions for attention, whose
//!   cost then grows with the sequence's own length only.

use std::collections::HashMap;
use std::sync::Arc;

use super::pool::{BlockId, BlockPool};
use super::storage::{KvLayout, KvStorage, KvType};
use super::table::{KvTable, Pos, SeqId, TableStats, Updates};
use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::ops::Rope;

/// Default tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// A sequence's blocks (any order) and the position held in each slot (`-1`: empty slot).
#[derive(Debug, Default, Clone)]
pub struct SeqView {
    pub blocks: Vec<u32>,
    pub positions: Vec<i32>,
}

pub struct PagedCache {
    table: KvTable,
    storage: KvStorage,
    rope: Rope,
    head_dim: usize,
    n_ctx: usize,
}

impl PagedCache {
    /// A cache for at most `n_ctx` stored tokens across all sequences (plus one spare block per
    /// 16 tokens' worth for partly filled tails and copy-on-write).
    pub fn new(
        n_layers: usize,
        kv_dim: usize,
        head_dim: usize,
        rope: Rope,
        n_ctx: usize,
        ty: KvType,
        block_size: usize,
    ) -> Result<PagedCache> {
        let layout = KvLayout {
            ty,
            n_layers,
            kv_dim,
            block_size,
        };
        layout.validate()?;
        let n_blocks = n_ctx.div_ceil(block_size) + n_ctx.div_ceil(16).min(64) + 1;
        let n_blocks_u32 = u32::try_from(n_blocks)
            .map_err(|_| Error::InvalidInput(format!("KV cache of {n_ctx} tokens is too large")))?;
        let pool = Arc::new(BlockPool::new(n_blocks_u32));
        Ok(PagedCache {
            table: KvTable::new(pool, block_size)?,
            storage: KvStorage::new(layout, n_blocks)?,
            rope,
            head_dim,
            n_ctx,
        })
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn table(&self) -> &KvTable {
        &self.table
    }

    pub fn table_mut(&mut self) -> &mut KvTable {
        &mut self.table
    }

    pub fn storage(&self) -> &KvStorage {
        &self.storage
    }

    pub fn stats(&self) -> TableStats {
        self.table.stats()
    }

    /// Tokens stored across all sequences (a cell shared by several sequences counts once).
    pub fn n_cells(&self) -> usize {
        self.table.stats().live_cells
    }

    pub fn pos_max(&self, seq: SeqId) -> Pos {
        self.table.seq_pos_max(seq)
    }

    pub fn clear(&mut self) {
        self.table.clear();
        // Nothing to apply: cleared cells are gone; drop pending work with them.
        let _ = self.table.take_updates();
    }

    /// Plans and prepares the batch's cells; see the module docs.
    pub fn reserve(&mut self, batch: &Batch) -> Result<Vec<(BlockId, u16)>> {
        let used = self.n_cells();
        if used + batch.len() > self.n_ctx {
            return Err(Error::KvCacheFull(format!(
                "KV cache full: {used} of {} tokens stored, batch needs {}",
                self.n_ctx,
                batch.len()
            )));
        }
        let plan = self.table.prepare_batch(&batch.seq_ids, &batch.positions)?;
        self.apply(&plan.updates)?;
        Ok(plan.slots)
    }

    /// Applies pending storage work (after sequence operations) now instead of at the next
    /// batch.
    pub fn apply_pending(&mut self) -> Result<()> {
        let u = self.table.take_updates();
        self.apply(&u)
    }

    fn apply(&mut self, u: &Updates) -> Result<()> {
        for c in &u.copies {
            self.storage.copy_block(c.src, c.dst, c.n_slots as usize)?;
        }
        for s in &u.shifts {
            for layer in 0..self.storage.n_layers() {
                self.storage.rotate_k(
                    layer,
                    s.block,
                    s.slot as usize,
                    &self.rope,
                    self.head_dim,
                    s.delta,
                )?;
            }
        }
        Ok(())
    }

    /// Stores one layer's keys and values (`kv_dim` per batch token) at the reserved slots.
    pub fn write(&mut self, layer: usize, slots: &[(BlockId, u16)], k: &[f32], v: &[f32]) {
        let d = self.storage.kv_dim();
        for (t, &(b, sl)) in slots.iter().enumerate() {
            self.storage
                .write(
                    layer,
                    b,
                    sl as usize,
                    &k[t * d..(t + 1) * d],
                    &v[t * d..(t + 1) * d],
                )
                .expect("slots come from this cache's own plan");
        }
    }

    /// Blocks and slot positions of `seq`, for attention.
    pub fn view(&self, seq: SeqId) -> SeqView {
        let bs = self.storage.block_size();
        let mut index: HashMap<BlockId, usize> = HashMap::new();
        let mut v = SeqView::default();
        for (pos, b, slot) in self.table.cells(seq) {
            let i = *index.entry(b).or_insert_with(|| {
                v.blocks.push(b);
                v.positions.extend(std::iter::repeat_n(-1, bs));
                v.blocks.len() - 1
            });
            v.positions[i * bs + slot as usize] = pos;
        }
        v
    }
}
