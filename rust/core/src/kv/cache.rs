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
//! - Prefix reuse ([`super::prefix`]): `reserve` records each cell's token id, and when a block of
//!   a clean sequence becomes full (see docs/KV_SEMANTICS.md, "Prefix index") gives it a content
//!   key chained from the previous block's key and indexes it. `match_prefix(seq, tokens)`
//!   attaches the longest indexed prefix (whole blocks) to a new sequence. Keys are assigned when
//!   the batch is reserved: if the forward pass then fails, the batch's cells (keyed or not) hold
//!   no valid data and the caller must `seq_rm` them, as for any failed decode.

use std::collections::HashMap;
use std::sync::Arc;

use super::pool::{BlockId, BlockPool, NO_KEY};
use super::prefix::{block_key, PrefixIndex, ROOT_KEY};
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

/// Prefix reuse counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixStats {
    /// `match_prefix` calls.
    pub lookups: u64,
    /// Tokens mapped onto cached blocks by `match_prefix`, summed over calls.
    pub hit_tokens: u64,
    /// Entries in the index (some may be stale until looked up).
    pub indexed: usize,
}

pub struct PagedCache {
    table: KvTable,
    storage: KvStorage,
    rope: Rope,
    head_dim: usize,
    n_ctx: usize,
    /// Token id of every cell (valid for cells that have been written).
    tokens: Vec<u32>,
    /// Per block: the parent key used for its content key (valid while it has a key).
    parent: Vec<u64>,
    index: PrefixIndex,
    model_id: u64,
    lookups: u64,
    hit_tokens: u64,
}

impl PagedCache {
    /// A cache for at most `n_ctx` stored tokens across all sequences (plus one spare block per
    /// 16 tokens' worth for partly filled tails and copy-on-write).
    pub fn new(layout: KvLayout, head_dim: usize, rope: Rope, n_ctx: usize) -> Result<PagedCache> {
        layout.validate()?;
        let bs = layout.block_size;
        let n_blocks = n_ctx.div_ceil(bs) + n_ctx.div_ceil(16).min(64) + 1;
        Self::build(layout, head_dim, rope, n_blocks, n_ctx)
    }

    /// A cache holding as many blocks as fit in `bytes` of K/V storage (`--kv-memory`); the
    /// token limit is then what those blocks hold.
    pub fn with_bytes(
        layout: KvLayout,
        head_dim: usize,
        rope: Rope,
        bytes: usize,
    ) -> Result<PagedCache> {
        layout.validate()?;
        let n_blocks = layout.n_blocks_for_bytes(bytes);
        if n_blocks == 0 {
            return Err(Error::InvalidInput(format!(
                "KV memory of {bytes} bytes holds no block (one block takes {} bytes)",
                layout.bytes_per_block()
            )));
        }
        Self::build(
            layout,
            head_dim,
            rope,
            n_blocks,
            n_blocks * layout.block_size,
        )
    }

    fn build(
        layout: KvLayout,
        head_dim: usize,
        rope: Rope,
        n_blocks: usize,
        n_ctx: usize,
    ) -> Result<PagedCache> {
        let KvLayout {
            ty,
            n_layers,
            kv_dim,
            block_size,
        } = layout;
        let n_blocks_u32 = u32::try_from(n_blocks).map_err(|_| {
            Error::InvalidInput(format!("KV cache of {n_blocks} blocks is too large"))
        })?;
        let pool = Arc::new(BlockPool::new(n_blocks_u32));
        // Default model id: a fingerprint of the K/V layout. Callers that know the model's
        // identity (weights) should set it with `set_model_id`.
        let ty_id = match ty {
            KvType::F32 => 0u32,
            KvType::F16 => 1,
            KvType::Q8_0 => 8,
        };
        let shape = [
            n_layers as u32,
            kv_dim as u32,
            head_dim as u32,
            block_size as u32,
        ];
        let model_id = block_key(0x6b76_7365_7276_6501, ty_id as u64, &shape);
        Ok(PagedCache {
            table: KvTable::new(pool, block_size)?,
            storage: KvStorage::new(layout, n_blocks)?,
            rope,
            head_dim,
            n_ctx,
            tokens: vec![0; n_blocks * block_size],
            parent: vec![NO_KEY; n_blocks],
            index: PrefixIndex::new(),
            model_id,
            lookups: 0,
            hit_tokens: 0,
        })
    }

    /// Sets the model id mixed into every content key (identifies the weights that computed the
    /// K/V). Empties the index: blocks keyed under the old id are no longer matched.
    pub fn set_model_id(&mut self, id: u64) {
        if id != self.model_id {
            self.model_id = id;
            self.index.clear();
        }
    }

    pub fn model_id(&self) -> u64 {
        self.model_id
    }

    pub fn prefix_stats(&self) -> PrefixStats {
        PrefixStats {
            lookups: self.lookups,
            hit_tokens: self.hit_tokens,
            indexed: self.index.len(),
        }
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
        self.table.live_cells()
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
        if batch.tokens.len() != batch.seq_ids.len() {
            return Err(Error::InvalidInput(format!(
                "batch has {} tokens but {} sequence ids",
                batch.tokens.len(),
                batch.seq_ids.len()
            )));
        }
        let plan = self.table.prepare_batch(&batch.seq_ids, &batch.positions)?;
        self.apply(&plan.updates)?;
        let bs = self.table.block_size();
        for (&(b, sl), &t) in plan.slots.iter().zip(&batch.tokens) {
            self.tokens[b as usize * bs + sl as usize] = t;
        }
        for (&(b, sl), &s) in plan.slots.iter().zip(&batch.seq_ids) {
            if sl as usize + 1 == bs {
                self.key_block(s, b)?;
            }
        }
        Ok(plan.slots)
    }

    /// Gives block `b`, just filled by sequence `s`, its content key if it qualifies (see the
    /// module docs) and indexes it.
    fn key_block(&mut self, s: SeqId, b: BlockId) -> Result<()> {
        let pool = Arc::clone(self.table.pool());
        if pool.key(b) != NO_KEY {
            return Ok(());
        }
        let Some((_, parent_block)) = self.table.full_prefix_block(s, b) else {
            return Ok(());
        };
        let parent = match parent_block {
            None => ROOT_KEY,
            Some(p) => match pool.key(p) {
                NO_KEY => return Ok(()),
                k => k,
            },
        };
        let bs = self.table.block_size();
        let key = block_key(
            self.model_id,
            parent,
            &self.tokens[b as usize * bs..(b as usize + 1) * bs],
        );
        pool.set_key(b, key)
            .map_err(|e| Error::InvalidInput(format!("kv bookkeeping: {e}")))?;
        self.parent[b as usize] = parent;
        self.index.insert(&pool, key, b);
        Ok(())
    }

    /// For a new (empty) sequence `seq`: maps the longest indexed prefix of `tokens`, in whole
    /// blocks and at most `tokens.len() - 1` tokens (so the caller still decodes the last token
    /// for its logits), onto cached blocks, which `seq` then references at positions
    /// `0..n`. Returns `n`, a multiple of the block size; the caller decodes `tokens[n..]` at
    /// positions `n..`. `InvalidInput` if `seq < 0` or `seq` has cells.
    pub fn match_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        if seq < 0 {
            return Err(Error::InvalidInput(format!(
                "match_prefix needs a sequence id >= 0, got {seq}"
            )));
        }
        if self.table.seq_pos_max(seq) >= 0 {
            return Err(Error::InvalidInput(format!(
                "match_prefix: sequence {seq} is not empty"
            )));
        }
        self.lookups += 1;
        let bs = self.table.block_size();
        let pool = Arc::clone(self.table.pool());
        let n_max = tokens.len().saturating_sub(1) / bs;
        let mut blocks: Vec<BlockId> = Vec::new();
        let mut parent = ROOT_KEY;
        for chunk in tokens.chunks_exact(bs).take(n_max) {
            let key = block_key(self.model_id, parent, chunk);
            let Some(b) = self.index.lookup(&pool, key) else {
                break;
            };
            // Guard against hash collisions: the block must hold these very tokens after the
            // same parent.
            let r = b as usize * bs..(b as usize + 1) * bs;
            if self.tokens[r] != *chunk || self.parent[b as usize] != parent {
                let _ = pool.release(b);
                break;
            }
            blocks.push(b);
            parent = key;
        }
        if let Err(e) = self.table.attach_blocks(seq, &blocks) {
            for &b in blocks.iter().rev() {
                let _ = pool.release(b);
            }
            return Err(e);
        }
        let n = blocks.len() * bs;
        self.hit_tokens += n as u64;
        Ok(n)
    }

    /// Applies pending storage work (after sequence operations) now instead of at the next
    /// batch.
    pub fn apply_pending(&mut self) -> Result<()> {
        let u = self.table.take_updates();
        self.apply(&u)
    }

    fn apply(&mut self, u: &Updates) -> Result<()> {
        let bs = self.table.block_size();
        for c in &u.copies {
            self.storage.copy_block(c.src, c.dst, c.n_slots as usize)?;
            let (src, dst) = (c.src as usize * bs, c.dst as usize * bs);
            self.tokens.copy_within(src..src + c.n_slots as usize, dst);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::RopeScaling;

    const BS: usize = 4;
    const D: usize = 8;

    fn cache(n_ctx: usize) -> PagedCache {
        let rope = Rope {
            n_rot: D,
            neox: false,
            freq_base: 10000.0,
            scaling: RopeScaling::None,
            freq_factors: None,
        };
        let layout = KvLayout {
            ty: KvType::F32,
            n_layers: 1,
            kv_dim: D,
            block_size: BS,
        };
        PagedCache::new(layout, D, rope, n_ctx).unwrap()
    }

    /// Reserves and writes `tokens` of `seq` at `pos0..`; V holds (token, position) so that the
    /// storage content can be checked later.
    fn decode(c: &mut PagedCache, seq: SeqId, tokens: &[u32], pos0: Pos) {
        let b = Batch::prompt(tokens, pos0, seq);
        let slots = c.reserve(&b).unwrap();
        let mut k = vec![0.0f32; tokens.len() * D];
        let mut v = vec![0.0f32; tokens.len() * D];
        for (i, &t) in tokens.iter().enumerate() {
            k[i * D] = t as f32;
            v[i * D] = t as f32;
            v[i * D + 1] = (pos0 + i as Pos) as f32;
        }
        c.write(0, &slots, &k, &v);
        c.table().check().unwrap();
    }

    /// (token, position) per cell of `seq`, in position order, read back from the storage.
    fn content(c: &PagedCache, seq: SeqId) -> Vec<(u32, Pos)> {
        let mut out: Vec<(u32, Pos)> = c
            .table()
            .cells(seq)
            .into_iter()
            .map(|(p, b, sl)| {
                let mut v = vec![0.0f32; D];
                c.storage().read_v(0, b, sl as usize, &mut v).unwrap();
                assert_eq!(v[1] as Pos, p, "cell position matches its data");
                (v[0] as u32, p)
            })
            .collect();
        out.sort_by_key(|x| x.1);
        out
    }

    fn expect(tokens: &[u32]) -> Vec<(u32, Pos)> {
        tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| (t, i as Pos))
            .collect()
    }

    fn prompt(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 13 + salt).collect()
    }

    #[test]
    fn match_maps_whole_cached_blocks() {
        let mut c = cache(64);
        let p = prompt(10, 1);
        decode(&mut c, 0, &p, 0);
        let pool = Arc::clone(c.table().pool());
        c.table_mut().seq_rm(0, -1, -1);
        c.table().check().unwrap();
        assert_eq!(pool.stats().cached, 2, "two full blocks stay cached");

        // At most len - 1 tokens, whole blocks only.
        for (n, want) in [(10, 8), (9, 8), (8, 4), (5, 4), (4, 0), (1, 0), (0, 0)] {
            let got = c.match_prefix(1, &p[..n]).unwrap();
            assert_eq!(got, want, "prompt of {n}");
            assert_eq!(got % BS, 0);
            assert_eq!(content(&c, 1), expect(&p[..got]));
            c.table().check().unwrap();
            c.table_mut().seq_rm(1, -1, -1);
        }
        // A difference in the second block keeps the first; in the first, nothing.
        let mut q = p.clone();
        q[5] += 1;
        assert_eq!(c.match_prefix(1, &q).unwrap(), 4);
        c.table_mut().seq_rm(1, -1, -1);
        q[0] += 1;
        assert_eq!(c.match_prefix(1, &q).unwrap(), 0);
        // Only for an empty sequence.
        decode(&mut c, 2, &p[..3], 0);
        assert!(c.match_prefix(2, &p).is_err());
        assert!(c.match_prefix(-1, &p).is_err());
        let s = c.prefix_stats();
        assert_eq!((s.lookups, s.hit_tokens), (9, 8 + 8 + 4 + 4 + 4));
        c.table().check().unwrap();
    }

    #[test]
    fn diverging_after_a_match_leaves_cached_blocks_intact() {
        let mut c = cache(64);
        let p = prompt(12, 3);
        decode(&mut c, 0, &p, 0);
        // Shared while seq 0 still holds them.
        assert_eq!(c.match_prefix(1, &p).unwrap(), 8);
        let pool = Arc::clone(c.table().pool());
        let (_, b0, _) = c.table().cells(1)[0];
        assert_eq!(pool.refcount(b0), 2);
        let mut q = p[..8].to_vec();
        q.extend([900, 901, 902, 903, 904, 905]);
        decode(&mut c, 1, &q[8..], 8);
        assert_eq!(content(&c, 1), expect(&q));
        assert_eq!(content(&c, 0), expect(&p));
        c.table_mut().seq_rm(0, -1, -1);
        c.table_mut().seq_rm(1, -1, -1);
        c.table().check().unwrap();
        // Both continuations are cached now: each matches its own third block.
        assert_eq!(c.match_prefix(2, &p).unwrap(), 8);
        c.table_mut().seq_rm(2, -1, -1);
        let mut p2 = p.clone();
        p2.push(7);
        assert_eq!(c.match_prefix(2, &p2).unwrap(), 12);
        assert_eq!(content(&c, 2), expect(&p));
        assert_eq!(c.match_prefix(3, &q).unwrap(), 12);
        assert_eq!(content(&c, 3), expect(&q[..12]));
        // Removing a matched sequence's tail and rewriting it copies, never overwrites.
        c.table_mut().seq_rm(3, 10, -1);
        decode(&mut c, 3, &[77, 78], 10);
        let mut r = q[..10].to_vec();
        r.extend([77, 78]);
        assert_eq!(content(&c, 3), expect(&r));
        assert_eq!(content(&c, 2), expect(&p));
        c.table_mut().seq_rm(-1, -1, -1);
        assert_eq!(
            c.match_prefix(4, &q).unwrap(),
            12,
            "original block still served"
        );
        assert_eq!(content(&c, 4), expect(&q[..12]));
        c.table().check().unwrap();
    }

    #[test]
    fn evicted_blocks_are_not_matched() {
        let mut c = cache(64);
        let p = prompt(13, 5);
        decode(&mut c, 0, &p, 0);
        c.table_mut().seq_rm(0, -1, -1);
        let pool = Arc::clone(c.table().pool());
        assert_eq!(pool.stats().cached, 3);
        // Another owner takes every free block, then one more: the LRU cached block (the tail,
        // released first) is evicted.
        let mut taken = Vec::new();
        for _ in 0..pool.stats().free + 1 {
            taken.push(pool.allocate().unwrap());
        }
        assert_eq!(pool.stats().cached, 2);
        assert_eq!(c.match_prefix(1, &p).unwrap(), 8);
        assert_eq!(content(&c, 1), expect(&p[..8]));
        c.table_mut().seq_rm(1, -1, -1);
        // Evict everything.
        while let Some(b) = pool.allocate() {
            taken.push(b);
        }
        assert_eq!(c.match_prefix(1, &p).unwrap(), 0);
        assert!(c.table().cells(1).is_empty());
        for b in taken {
            pool.release(b).unwrap();
        }
        c.table().check().unwrap();
        assert_eq!(pool.stats().free, pool.total());
        // Entries found stale on lookup were dropped (blocks 0 and 2); block 1's entry is stale
        // but was never looked up: it stays until pruned.
        assert_eq!(c.prefix_stats().indexed, 1);
    }

    #[test]
    fn attach_rejects_bad_requests_without_changes() {
        let mut c = cache(64);
        let p = prompt(9, 11);
        decode(&mut c, 0, &p, 0);
        let pool = Arc::clone(c.table().pool());
        let cells = c.table().cells(0);
        let (b0, b1) = (cells[0].1, cells[4].1);
        // The caller's references: one per block.
        pool.retain(b0).unwrap();
        pool.retain(b1).unwrap();
        let t = c.table_mut();
        assert!(t.attach_blocks(0, &[b0]).is_err(), "sequence not empty");
        assert!(t.attach_blocks(-1, &[b0]).is_err(), "negative id");
        assert!(t.attach_blocks(1, &[b0, b0]).is_err(), "repeated block");
        assert!(
            t.attach_blocks(1, &[b1]).is_err(),
            "block 1 holds positions 4..8"
        );
        assert!(t.attach_blocks(1, &[b0, 999]).is_err(), "out of range");
        assert!(t.cells(1).is_empty());
        t.attach_blocks(1, &[b0, b1]).unwrap();
        t.check().unwrap();
        assert_eq!(content(&c, 1), expect(&p[..8]));
    }

    #[test]
    fn only_clean_prefix_blocks_get_keys() {
        let mut c = cache(128);
        let pool = Arc::clone(c.table().pool());
        let p = prompt(8, 9);
        // Not starting at position 0.
        decode(&mut c, 0, &p, 4);
        // Shifted after writing: the existing key is dropped and later blocks get none.
        decode(&mut c, 1, &p, 0);
        c.table_mut().seq_add(1, -1, -1, 0).unwrap();
        c.table_mut().seq_add(1, 0, -1, 2).unwrap();
        c.apply_pending().unwrap();
        decode(&mut c, 1, &prompt(6, 50), 10);
        // seq_cp of a clean prefix into an empty sequence keeps it clean.
        decode(&mut c, 2, &prompt(6, 70), 0);
        c.table_mut().seq_cp(2, 3, -1, -1).unwrap();
        decode(&mut c, 3, &[1, 2], 6);
        c.table().check().unwrap();
        let keyed: usize = (0..pool.total() as BlockId)
            .filter(|&b| pool.key(b) != NO_KEY)
            .count();
        assert_eq!(keyed, 2, "seq 2's first block and seq 3's second");
        c.table_mut().seq_rm(-1, -1, -1);
        let mut q = prompt(6, 70);
        q.extend([1, 2, 3]);
        assert_eq!(c.match_prefix(4, &q).unwrap(), 8);
        assert_eq!(c.match_prefix(5, &p).unwrap(), 0);
        c.table().check().unwrap();
    }
}
