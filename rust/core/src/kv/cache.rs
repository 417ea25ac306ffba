//! The paged KV cache a model's context (`Context` in model/mod.rs) decodes into.
//!
//! - [`SharedKv`]: the K/V memory of one model, shared by all its contexts: the block pool, the
//!   K/V data of every block ([`super::storage`]) and the prefix index ([`super::prefix`]). One
//!   memory budget covers every context, and a prefix computed by one context is found by the
//!   next. Contexts on different threads allocate, release and revive blocks concurrently; the
//!   K/V data is touched only inside a decode, under the storage lock (decodes of one model run
//!   one at a time on its worker team anyway).
//! - [`PagedCache`]: one context's sequences over a `SharedKv` (its own block tables,
//!   [`super::table`]). A batch is a transaction: `begin_batch` plans every token's cell (blocks
//!   on demand, copy-on-write of shared or keyed partly filled tails) and applies pending storage
//!   work (copies, then K-shifts with one angle computation per delta); the caller writes the
//!   K/V; `commit` then gives newly filled clean blocks their content keys and indexes them (a
//!   key never names unwritten data), or `rollback` undoes the batch if the pass failed.
//! - `match_prefix(seq, tokens)` attaches the longest indexed prefix (whole blocks) to a new
//!   sequence, whichever context computed it, and continues it from the memory's disk tier
//!   ([`super::disk`]) where one is attached ([`SharedKv::set_disk`]), and from blocks
//!   fetched beforehand from the shared tier ([`super::remote`], [`SharedKv::fetch_remote`]).
//!   A window group's `match_window_prefix` does the same for the blocks of the window before
//!   its resume point only ([`SharedKv::fetch_window`]), reading them once the point is chosen.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::disk::DiskTier;
use super::pool::{BlockId, BlockPool, PoolStats};
#[cfg(test)]
use super::prefix::salt_root;
use super::prefix::{block_key, Key, KeyHasher, PrefixIndex, ROOT_KEY};
use super::remote::{Candidate, RemoteTier, Staged};
use super::storage::{KvLayout, KvStorage};
use super::table::{BatchTx, KvTable, Pos, SeqId, SeqView, TableStats, Updates};
use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::ops::Rope;

/// Default tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Version of the key derivation; part of every model id so that a change of the scheme never
/// matches keys stored by an older one.
const KEY_SCHEME: u64 = 2;

/// Prefix reuse counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixStats {
    /// `match_prefix` calls.
    pub lookups: u64,
    /// Tokens mapped onto cached blocks by `match_prefix`, summed over calls.
    pub hit_tokens: u64,
    /// Entries in the index.
    pub indexed: usize,
}

/// The K/V memory of one model and K/V format (see the module docs).
pub struct SharedKv {
    pool: Arc<BlockPool>,
    index: Arc<PrefixIndex>,
    storage: Mutex<KvStorage>,
    layout: KvLayout,
    head_dim: usize,
    rope: Rope,
    weights_id: Key,
    model_id: Key,
    lookups: AtomicU64,
    hit_tokens: AtomicU64,
    /// The disk tier (L2) below the pool, if any.
    disk: Mutex<Option<Arc<DiskTier>>>,
    /// The shared tier (L3), if any.
    remote: Mutex<Option<Arc<RemoteTier>>>,
}

impl std::fmt::Debug for SharedKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedKv")
            .field("layout", &self.layout)
            .field("blocks", &self.pool.total())
            .finish()
    }
}

/// Blocks for `n_ctx` tokens plus spares for partly filled tails and copy-on-write.
pub fn blocks_for_tokens(n_ctx: usize, block_size: usize) -> usize {
    n_ctx.div_ceil(block_size) + n_ctx.div_ceil(16).min(64) + 1
}

impl SharedKv {
    /// K/V memory of `n_blocks` blocks. `weights_id` identifies the weights that compute the
    /// K/V (see `model::model_identity`); with the K/V format it forms the model id mixed into
    /// every content key.
    pub fn new(
        layout: KvLayout,
        head_dim: usize,
        rope: Rope,
        n_blocks: usize,
        weights_id: Key,
    ) -> Result<SharedKv> {
        layout.validate()?;
        if n_blocks == 0 {
            return Err(Error::InvalidInput(
                "a KV cache needs at least one block".into(),
            ));
        }
        let n_blocks_u32 = u32::try_from(n_blocks)
            .ok()
            .filter(|&n| n < u32::MAX - 1)
            .ok_or_else(|| {
                Error::InvalidInput(format!("KV cache of {n_blocks} blocks is too large"))
            })?;
        // The big buffer first: a size the machine cannot hold fails here, cheaply.
        let storage = KvStorage::new(layout, n_blocks)?;
        let index = PrefixIndex::new(n_blocks, layout.block_size)?;
        let mut h = KeyHasher::new(KEY_SCHEME);
        h.write_u128(weights_id);
        for w in [
            layout.ty.code() as u64,
            layout.block_size as u64,
            layout.n_layers as u64,
            layout.kv_dim as u64,
            head_dim as u64,
        ] {
            h.write_u64(w);
        }
        Ok(SharedKv {
            pool: Arc::new(BlockPool::new(n_blocks_u32)),
            index: Arc::new(index),
            storage: Mutex::new(storage),
            layout,
            head_dim,
            rope,
            weights_id,
            model_id: h.finish(),
            lookups: AtomicU64::new(0),
            hit_tokens: AtomicU64::new(0),
            disk: Mutex::new(None),
            remote: Mutex::new(None),
        })
    }

    /// K/V memory for `n_ctx` tokens (see [`blocks_for_tokens`]).
    pub fn for_tokens(
        layout: KvLayout,
        head_dim: usize,
        rope: Rope,
        n_ctx: usize,
        weights_id: Key,
    ) -> Result<SharedKv> {
        if n_ctx == 0 {
            return Err(Error::InvalidInput("n_ctx must be positive".into()));
        }
        let n = blocks_for_tokens(n_ctx, layout.block_size.max(1));
        SharedKv::new(layout, head_dim, rope, n, weights_id)
    }

    /// K/V memory of as many blocks as fit in `bytes` (`--kv-memory`).
    pub fn with_bytes(
        layout: KvLayout,
        head_dim: usize,
        rope: Rope,
        bytes: usize,
        weights_id: Key,
    ) -> Result<SharedKv> {
        layout.validate()?;
        let n_blocks = layout.n_blocks_for_bytes(bytes);
        if n_blocks == 0 {
            return Err(Error::InvalidInput(format!(
                "KV memory of {bytes} bytes holds no block (one block takes {} bytes)",
                layout.bytes_per_block()
            )));
        }
        SharedKv::new(layout, head_dim, rope, n_blocks, weights_id)
    }

    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.index
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn n_blocks(&self) -> usize {
        self.pool.total()
    }

    /// Tokens the whole pool holds.
    pub fn capacity_tokens(&self) -> usize {
        self.pool.total() * self.layout.block_size
    }

    /// The id mixed into every content key: weights + K/V format + key scheme.
    pub fn model_id(&self) -> Key {
        self.model_id
    }

    /// The identity of the weights that compute this memory's K/V (`model::model_identity`).
    pub fn weights_id(&self) -> Key {
        self.weights_id
    }

    /// Values per attention head (K/V rows hold `kv_dim / head_dim` heads).
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Locks the K/V data (held for a whole decode). A decode that panicked rolled its batch
    /// back before releasing the lock, so a poisoned lock still guards consistent data.
    pub fn lock_storage(&self) -> MutexGuard<'_, KvStorage> {
        self.storage.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The disk tier below this memory's pool, if one is attached.
    pub fn disk(&self) -> Option<Arc<DiskTier>> {
        self.disk.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Attaches a disk tier (its model id must be this memory's) or detaches it (`None`):
    /// from then on every context of the memory writes the blocks its decodes key through to
    /// the tier ([`PagedCache::write_through`]) and continues prefix matches there
    /// ([`PagedCache::match_prefix`]). `Context::set_kv_disk` attaches one to each K/V group's
    /// memory; a hybrid model's state checkpoints (blocks of this pool) go to the primary
    /// group's tier too ([`SharedKv::write_through_entry`], `LayerGroups::match_prefix`).
    pub fn set_disk(&self, tier: Option<Arc<DiskTier>>) -> Result<()> {
        if let Some(t) = &tier {
            if t.model_id() != self.model_id {
                return Err(Error::InvalidInput(format!(
                    "the kv disk tier {} belongs to another model or K/V format",
                    t.dir().display()
                )));
            }
        }
        *self.disk.lock().unwrap_or_else(|e| e.into_inner()) = tier;
        Ok(())
    }

    /// The shared tier of this memory, if one is attached.
    pub fn remote(&self) -> Option<Arc<RemoteTier>> {
        self.remote
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Attaches a shared tier (its model id must be this memory's) or detaches it (`None`):
    /// from then on every context writes the blocks its decodes key through to it
    /// ([`PagedCache::write_through`]), and [`SharedKv::fetch_remote`] stages blocks from it
    /// for [`PagedCache::match_prefix_staged`]. As for the disk tier, one per K/V group
    /// (`Context::set_kv_remote`), the primary group's also holding a hybrid model's state
    /// checkpoints (`LayerGroups::fetch_checkpoint`).
    pub fn set_remote(&self, tier: Option<Arc<RemoteTier>>) -> Result<()> {
        if let Some(t) = &tier {
            if t.model_id() != self.model_id {
                return Err(Error::InvalidInput(format!(
                    "the kv remote tier {:?} belongs to another model or K/V format",
                    t.addr()
                )));
            }
        }
        *self.remote.lock().unwrap_or_else(|e| e.into_inner()) = tier;
        Ok(())
    }

    /// Write-through of one entry that is not a K/V block of a commit (a hybrid model's state
    /// checkpoint, keyed in its own hash domain and stored in a block of this memory's pool):
    /// `payload` (the block's bytes as the pool stores them) is copied to the disk tier
    /// unless it holds `key`, and to the shared tier (`SET NX`); the caller holds the storage
    /// lock, the encoding happens on the tiers' writer threads.
    pub fn write_through_entry(&self, key: Key, parent: Key, tokens: &[u32], payload: &[u8]) {
        if let Some(d) = self.disk().filter(|d| !d.contains(key)) {
            d.offer(key, parent, tokens, payload);
        }
        if let Some(r) = self.remote() {
            r.offer(key, parent, tokens, payload);
        }
    }

    /// Fetches from the shared tier (if any) the blocks a prefix match of `tokens` under the
    /// salt root `root` would need after what RAM and disk hold: the leading full blocks (at
    /// most `len(tokens) - 1` tokens, as a match maps) that neither the index nor the disk tier
    /// has, up to the first the store lacks. Reads only the index and the disk tier's index,
    /// never the pool or the storage: safe on any thread while decodes run. The staged
    /// blocks go into the pool at the match ([`PagedCache::match_prefix_staged`]).
    pub fn fetch_remote(&self, tokens: &[u32], root: Key) -> Staged {
        let Some(r) = self.remote() else {
            return Staged::default();
        };
        let bs = self.layout.block_size;
        let n_max = tokens.len().saturating_sub(1) / bs;
        let disk = self.disk().filter(|d| d.worth_it(tokens.len()));
        let mut parent = root;
        let mut cands: Vec<Candidate<'_>> = Vec::new();
        for chunk in tokens.chunks_exact(bs).take(n_max) {
            let key = block_key(self.model_id, parent, chunk);
            let local = self.index.contains(&self.pool, key, parent, chunk)
                || disk.as_ref().is_some_and(|d| d.contains(key));
            if !local {
                cands.push((key, parent, chunk));
            }
            parent = key;
        }
        r.fetch(&cands, tokens.len())
    }

    /// How many leading whole blocks of `tokens` (at most `len(tokens) - 1` tokens) under the
    /// root `root` the index, the disk tier or `staged` hold: where a full group's match
    /// would get to now (an estimate, as [`PagedCache::peek_prefix`]).
    pub fn reachable_blocks(&self, tokens: &[u32], root: Key, staged: &Staged) -> usize {
        let bs = self.layout.block_size;
        let n_max = tokens.len().saturating_sub(1) / bs;
        let disk = self.disk().filter(|d| tokens.len() >= d.min_tokens());
        let mut parent = root;
        let mut n = 0;
        for chunk in tokens.chunks_exact(bs).take(n_max) {
            let key = block_key(self.model_id, parent, chunk);
            let held = self.index.contains(&self.pool, key, parent, chunk)
                || disk.as_ref().is_some_and(|d| d.contains(key))
                || staged.get(key, parent, chunk).is_some();
            if !held {
                break;
            }
            n += 1;
            parent = key;
        }
        n
    }

    /// [`SharedKv::fetch_remote`] for a sliding-window group of `window` positions: fetches
    /// the blocks a resume at block `k` (position `k * b`) needs, those holding positions
    /// `k * b - window + 1 .. k * b - 1` ([`PagedCache::match_window_prefix`]'s rule), that
    /// neither the index nor the disk tier has, up to the first the store lacks (a resume
    /// at that block then needs only blocks before it). Safe on any thread, as
    /// `fetch_remote`.
    pub fn fetch_window(&self, tokens: &[u32], root: Key, window: usize, k: usize) -> Staged {
        let Some(r) = self.remote() else {
            return Staged::default();
        };
        let bs = self.layout.block_size;
        let k = k.min(tokens.len().saturating_sub(1) / bs);
        let lo = (k * bs + 1).saturating_sub(window.max(1)) / bs;
        let disk = self.disk().filter(|d| tokens.len() >= d.min_tokens());
        let mut parent = root;
        let mut cands: Vec<Candidate<'_>> = Vec::new();
        for (j, chunk) in tokens.chunks_exact(bs).take(k).enumerate() {
            let key = block_key(self.model_id, parent, chunk);
            let local = j < lo
                || self.index.contains(&self.pool, key, parent, chunk)
                || disk.as_ref().is_some_and(|d| d.contains(key));
            if !local {
                cands.push((key, parent, chunk));
            }
            parent = key;
        }
        r.fetch(&cands, tokens.len())
    }

    /// Pool counts, O(1).
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Prefix reuse counters of every context of this memory.
    pub fn prefix_stats(&self) -> PrefixStats {
        PrefixStats {
            lookups: self.lookups.load(Ordering::Relaxed),
            hit_tokens: self.hit_tokens.load(Ordering::Relaxed),
            indexed: self.index.len(),
        }
    }
}

/// What a batch needs of one group's memory now ([`PagedCache::batch_need`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchNeed {
    /// Fresh blocks the batch would take from the pool: new blocks and one copy of each
    /// partly filled tail that is shared or keyed (copy-on-write).
    pub blocks: usize,
    /// Tokens by which the batch would exceed the context's token limit `n_ctx` (0: within).
    pub tokens_over: usize,
}

/// A block of a window match ([`PagedCache::match_window_prefix`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Not looked up, or not available.
    Missing,
    /// The disk tier or the staged set has it; not loaded yet.
    Pending,
    /// Referenced by the match (found in RAM or loaded).
    Held(BlockId),
}

/// One context's sequences over a model's [`SharedKv`].
pub struct PagedCache {
    shared: Arc<SharedKv>,
    table: KvTable,
    n_ctx: usize,
    prefix_cache: bool,
    lookups: u64,
    hit_tokens: u64,
}

impl PagedCache {
    /// A cache over `shared` storing at most `n_ctx` tokens across its sequences (the pool may
    /// run out first: it is shared).
    pub fn new(shared: Arc<SharedKv>, n_ctx: usize) -> Result<PagedCache> {
        if n_ctx == 0 {
            return Err(Error::InvalidInput("n_ctx must be positive".into()));
        }
        let table = KvTable::with_index(
            Arc::clone(&shared.pool),
            Some(Arc::clone(&shared.index)),
            shared.layout.block_size,
        )?;
        Ok(PagedCache {
            n_ctx: n_ctx.min(shared.capacity_tokens()),
            prefix_cache: true,
            shared,
            table,
            lookups: 0,
            hit_tokens: 0,
        })
    }

    /// A cache with K/V memory of its own for `n_ctx` tokens (tests, benchmarks).
    pub fn standalone(
        layout: KvLayout,
        head_dim: usize,
        rope: Rope,
        n_ctx: usize,
    ) -> Result<PagedCache> {
        let shared = SharedKv::for_tokens(layout, head_dim, rope, n_ctx, ROOT_KEY)?;
        PagedCache::new(Arc::new(shared), n_ctx)
    }

    pub fn shared(&self) -> &Arc<SharedKv> {
        &self.shared
    }

    /// Whether committed batches key their full clean blocks for reuse (default on). Off, this
    /// context's blocks are never indexed (it can still match what others indexed).
    pub fn set_prefix_cache(&mut self, on: bool) {
        self.prefix_cache = on;
    }

    pub fn model_id(&self) -> Key {
        self.shared.model_id
    }

    /// Whether committed batches key their blocks (see [`PagedCache::set_prefix_cache`]).
    pub fn prefix_cache(&self) -> bool {
        self.prefix_cache
    }

    /// This context's prefix reuse counters (`indexed` counts the model's whole index).
    pub fn prefix_stats(&self) -> PrefixStats {
        PrefixStats {
            lookups: self.lookups,
            hit_tokens: self.hit_tokens,
            indexed: self.shared.index.len(),
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

    pub fn stats(&self) -> TableStats {
        self.table.stats()
    }

    /// Tokens stored across all sequences (a cell shared by several sequences counts once).
    pub fn n_cells(&self) -> usize {
        self.table.live_cells()
    }

    pub fn clear(&mut self) {
        self.table.clear();
        // Nothing to apply: cleared cells are gone; drop pending work with them.
        let _ = self.table.take_updates();
    }

    /// What [`PagedCache::begin_batch`] of a batch of these sequence ids and positions would
    /// need now, changing nothing: it fails with `KvCacheFull` iff `blocks` exceeds the pool's
    /// free and cached blocks or `tokens_over > 0` (when no other context of the memory
    /// allocates in between); `InvalidInput` when it would reject the batch as malformed.
    pub fn batch_need(&self, seq_ids: &[SeqId], positions: &[Pos]) -> Result<BatchNeed> {
        let blocks = self.table.blocks_for_batch(seq_ids, positions)?;
        let tokens_over = (self.n_cells() + seq_ids.len()).saturating_sub(self.n_ctx);
        Ok(BatchNeed {
            blocks,
            tokens_over,
        })
    }

    /// Plans the batch's cells and applies pending storage work to `storage` (this cache's
    /// shared storage, locked by the caller); returns one `(block, slot)` per token and the
    /// transaction to commit or roll back. `KvCacheFull` / `InvalidInput`: nothing changed.
    pub fn begin_batch(
        &mut self,
        batch: &Batch,
        storage: &mut KvStorage,
    ) -> Result<(Vec<(BlockId, u16)>, BatchTx)> {
        if batch.tokens.len() != batch.seq_ids.len() {
            return Err(Error::InvalidInput(format!(
                "batch has {} tokens but {} sequence ids",
                batch.tokens.len(),
                batch.seq_ids.len()
            )));
        }
        let used = self.n_cells();
        if used + batch.len() > self.n_ctx {
            // A malformed batch is `InvalidInput` whatever its size (as `batch_need` says).
            self.table
                .blocks_for_batch(&batch.seq_ids, &batch.positions)?;
            return Err(Error::KvCacheFull(format!(
                "KV cache full: {used} of {} tokens stored, batch needs {}",
                self.n_ctx,
                batch.len()
            )));
        }
        let (plan, tx) = self.table.prepare_batch(&batch.seq_ids, &batch.positions)?;
        self.table.set_tokens(&plan.slots, &batch.tokens);
        if let Err(e) = self.apply(storage, &plan.updates) {
            self.table.rollback(tx);
            return Err(e);
        }
        Ok((plan.slots, tx))
    }

    /// The batch's K/V are written: indexes the blocks it filled (see the module docs) and
    /// returns them with their keys (a hybrid model checkpoints its states there).
    pub fn commit(&mut self, tx: BatchTx) -> Vec<(BlockId, Key)> {
        self.commit_upto(tx, |_| usize::MAX)
    }

    /// [`PagedCache::commit`], keying at most the first `limit(s)` blocks of each sequence
    /// ([`KvTable::commit_upto`]).
    pub fn commit_upto(
        &mut self,
        tx: BatchTx,
        limit: impl Fn(SeqId) -> usize,
    ) -> Vec<(BlockId, Key)> {
        let id = self.prefix_cache.then_some(self.shared.model_id);
        let keyed = self.table.commit_upto(tx, id, limit);
        let out = keyed.iter().map(|&(b, key, _)| (b, key)).collect();
        for (b, key, parent) in keyed {
            // Cannot fail: the block is held and its tokens are block_size long.
            let _ = self.shared.index.insert(
                &self.shared.pool,
                b,
                key,
                parent,
                self.table.block_tokens(b),
            );
        }
        out
    }

    /// Write-through to the disk tier and the shared tier (those the memory has): hands each a
    /// copy of each block in `keyed` (blocks a commit just keyed, as `commit` returns them)
    /// (the disk tier: those it does not hold yet; the shared tier sends `SET NX`). `storage` is this memory's storage, locked by the caller (the copy is taken under
    /// that lock; the writing happens on the tier's thread). A block the tier cannot queue is
    /// simply not written (`DiskStats::writes_dropped`).
    pub fn write_through(&self, storage: &KvStorage, keyed: &[(BlockId, Key)]) {
        let disk = self.shared.disk();
        let remote = self.shared.remote();
        if disk.is_none() && remote.is_none() {
            return;
        }
        let index = &self.shared.index;
        for &(b, key) in keyed {
            if index.key_of(b) != key {
                continue;
            }
            let to_disk = disk.as_ref().filter(|d| !d.contains(key));
            if to_disk.is_none() && remote.is_none() {
                continue;
            }
            if let Ok(bytes) = storage.block_raw(b) {
                let (parent, tokens) = (index.parent_of(b), self.table.block_tokens(b));
                if let Some(d) = to_disk {
                    d.offer(key, parent, tokens, bytes);
                }
                if let Some(r) = &remote {
                    r.offer(key, parent, tokens, bytes);
                }
            }
        }
    }

    /// Loads `key`'s block (of `parent` and `tokens`) into a fresh pool block, its bytes
    /// written by `fill` (false: no valid bytes), and gives it the key in the pool and the
    /// index as a commit would; the caller holds the returned block. `None` (nothing taken)
    /// when the pool has no block to give or `fill` failed.
    fn load_block(
        &self,
        storage: &mut KvStorage,
        key: Key,
        parent: Key,
        tokens: &[u32],
        fill: impl FnOnce(&mut [u8]) -> bool,
    ) -> Option<BlockId> {
        let (pool, index) = (&self.shared.pool, &self.shared.index);
        let (b, old) = pool.allocate_evicting()?;
        if let Some(tag) = old {
            index.forget(b, tag);
        }
        let read = storage.block_raw_mut(b).is_ok_and(fill);
        if read && index.insert(pool, b, key, parent, tokens).is_ok() {
            return Some(b);
        }
        // Never keyed: the block goes back free, whatever the failed read left in it.
        let _ = pool.release(b);
        None
    }

    /// The batch's K/V could not be written: undoes it (see [`KvTable::rollback`]).
    pub fn rollback(&mut self, tx: BatchTx) {
        self.table.rollback(tx);
    }

    /// For a new (empty) sequence `seq`: maps the longest indexed prefix of `tokens`, in whole
    /// blocks and at most `tokens.len() - 1` tokens (so the caller still decodes the last token
    /// for its logits), onto cached blocks of the model, which `seq` then references at
    /// positions `0..n`. Returns `n`, a multiple of the block size; the caller decodes
    /// `tokens[n..]` at positions `n..`. `InvalidInput` if `seq < 0` or `seq` has cells.
    ///
    /// With a disk tier ([`SharedKv::set_disk`]) and a prompt of at least its break-even
    /// (`DiskTier::min_tokens`), a block the index misses is read from the tier into a fresh
    /// pool block (keyed and indexed as a commit would), and the match goes on, block by
    /// block from RAM or disk, until neither holds the next one, the tier's entry is invalid
    /// or the pool has no block to give.
    pub fn match_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        self.match_prefix_in(seq, tokens, None, None)
    }

    /// [`PagedCache::match_prefix`] that also takes a block neither RAM nor disk holds from
    /// `staged` (blocks [`SharedKv::fetch_remote`] brought from the shared tier for this
    /// prompt and salt), copying it into a fresh pool block as a disk read would.
    pub fn match_prefix_staged(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        staged: Option<&Staged>,
    ) -> Result<usize> {
        self.match_prefix_in(seq, tokens, None, staged)
    }

    /// [`PagedCache::match_prefix`] for a sliding-window group of `window` positions: a token
    /// at the resume point `n` sees only positions `n - window + 1 ..`, so only the blocks
    /// holding those are needed (at most `⌈window / b⌉ + 1`), not the whole prefix. Finds the
    /// largest `n` (a multiple of `b`, at most `(len(tokens) - 1)` tokens) whose window blocks
    /// are all indexed, attaches those (the sequence then starts at the first of them, a clean
    /// run pruned at its front) and returns `n`. Blocks before the window are not looked up:
    /// a long prompt resumes even when the window group evicted its head.
    ///
    /// With a disk tier (as for [`PagedCache::match_prefix`]) a window block the index misses
    /// counts as found when the tier holds it; once the search has chosen `n`, the blocks of
    /// its window that only the tier holds are read into fresh pool blocks (keyed and indexed
    /// as a commit would), so nothing is read for a resume point a later miss rules out. A
    /// read that fails (an invalid entry, no pool block) is a miss at that block, and the
    /// search goes on below it; blocks read for a window not used in the end stay cached.
    pub fn match_window_prefix(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        window: usize,
    ) -> Result<usize> {
        self.match_prefix_in(seq, tokens, Some(window.max(1)), None)
    }

    /// [`PagedCache::match_window_prefix`] that also takes a window block neither RAM nor disk
    /// holds from `staged` ([`SharedKv::fetch_window`]), as a disk read would.
    pub fn match_window_prefix_staged(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        window: usize,
        staged: Option<&Staged>,
    ) -> Result<usize> {
        self.match_prefix_in(seq, tokens, Some(window.max(1)), staged)
    }

    /// How many tokens of `tokens` [`PagedCache::match_prefix`] (`window: None`) or
    /// [`PagedCache::match_window_prefix`] would map now for a sequence of root key `root`
    /// (its salt), at most `limit`, without mapping anything or touching the pool: an
    /// estimate for scheduling (blocks may be evicted before the match).
    pub fn peek_prefix(
        &self,
        tokens: &[u32],
        root: Key,
        window: Option<usize>,
        limit: usize,
    ) -> usize {
        let bs = self.table.block_size();
        let (pool, index) = (&self.shared.pool, &self.shared.index);
        let n_max = (tokens.len().saturating_sub(1) / bs).min(limit / bs);
        let mut keys = Vec::with_capacity(n_max);
        let mut parent = root;
        for chunk in tokens.chunks_exact(bs).take(n_max) {
            parent = block_key(self.shared.model_id, parent, chunk);
            keys.push(parent);
        }
        let has = |j: usize| {
            let parent = if j == 0 { root } else { keys[j - 1] };
            index.contains(pool, keys[j], parent, &tokens[j * bs..(j + 1) * bs])
        };
        let disk = self
            .shared
            .disk()
            .filter(|d| tokens.len() >= d.min_tokens());
        let on_disk = |j: usize| disk.as_ref().is_some_and(|d| d.contains(keys[j]));
        match window {
            None => (0..n_max).take_while(|&j| has(j) || on_disk(j)).count() * bs,
            Some(w) => {
                let lo = |k: usize| (k * bs + 1).saturating_sub(w.max(1)) / bs;
                let (mut k, mut i) = (n_max, n_max);
                while i > lo(k) {
                    let j = i - 1;
                    if !has(j) && !on_disk(j) {
                        k = j;
                    }
                    i = j;
                }
                k * bs
            }
        }
    }

    fn match_prefix_in(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        window: Option<usize>,
        staged: Option<&Staged>,
    ) -> Result<usize> {
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
        self.shared.lookups.fetch_add(1, Ordering::Relaxed);
        let bs = self.table.block_size();
        let (pool, index) = (&self.shared.pool, &self.shared.index);
        let n_max = tokens.len().saturating_sub(1) / bs;
        let mut blocks: Vec<BlockId> = Vec::new();
        let mut keys: Vec<Key> = Vec::new();
        // The sequence's salt: its chain, and so every key looked up, starts from its root.
        let root = self.table.root(seq);
        let mut parent = root;
        let mut first = 0;
        if let Some(w) = window {
            for chunk in tokens.chunks_exact(bs).take(n_max) {
                parent = block_key(self.shared.model_id, parent, chunk);
                keys.push(parent);
            }
            // First block a token at position `k * bs` sees.
            let lo = |k: usize| (k * bs + 1).saturating_sub(w) / bs;
            let disk = self.shared.disk().filter(|d| d.worth_it(tokens.len()));
            let shared = Arc::clone(&self.shared);
            // Locked at the first block loaded from disk or `staged` (storage, then index).
            let mut storage = None;
            let mut in_ram = Vec::new();
            let mut from_remote = 0;
            // Per block: `Held` once referenced (found in RAM, or loaded), `Pending` when the
            // disk tier or `staged` has it (loaded only once a resume point needs it).
            let mut found: Vec<Slot> = vec![Slot::Missing; n_max];
            let release = |found: &mut [Slot]| {
                for s in found.iter_mut().rev() {
                    if let Slot::Held(b) = std::mem::replace(s, Slot::Missing) {
                        let _ = pool.release(b);
                    }
                }
            };
            // Resume at `k` once blocks `lo(k)..k` are found, looking from the top down: a miss
            // at block `j` rules out every resume point whose window holds `j`, i.e. every
            // point above `j` still to be tried, so the next candidate is `j` itself.
            let (mut k, mut i) = (n_max, n_max);
            loop {
                while i > lo(k) {
                    let j = i - 1;
                    let parent = if j == 0 { root } else { keys[j - 1] };
                    let chunk = &tokens[j * bs..(j + 1) * bs];
                    if let Some(b) = index.lookup(pool, keys[j], parent, chunk) {
                        found[j] = Slot::Held(b);
                        in_ram.push(keys[j]);
                    } else if disk.as_ref().is_some_and(|d| d.contains(keys[j]))
                        || staged.is_some_and(|s| s.get(keys[j], parent, chunk).is_some())
                    {
                        found[j] = Slot::Pending;
                    } else {
                        if let Some(d) = &disk {
                            d.count_miss();
                        }
                        release(&mut found[j + 1..k]);
                        k = j;
                    }
                    i = j;
                }
                // Every block of the window before `k` is held or pending: load the pending
                // ones (bottom up). A load that fails (an invalid entry, no pool block) is a
                // miss at its block: the search goes on below the window tried so far.
                let mut failed = None;
                for j in lo(k)..k {
                    if found[j] != Slot::Pending {
                        continue;
                    }
                    let (key, chunk) = (keys[j], &tokens[j * bs..(j + 1) * bs]);
                    let parent = if j == 0 { root } else { keys[j - 1] };
                    let st = storage.get_or_insert_with(|| shared.lock_storage());
                    let mut b = disk.as_deref().filter(|d| d.contains(key)).and_then(|d| {
                        self.load_block(st, key, parent, chunk, |out| {
                            d.read(key, parent, chunk, out)
                        })
                    });
                    if let (None, Some(p)) = (b, staged.and_then(|s| s.get(key, parent, chunk))) {
                        b = self.load_block(st, key, parent, chunk, |out| {
                            out.copy_from_slice(p);
                            true
                        });
                        from_remote += usize::from(b.is_some());
                    }
                    match b {
                        Some(b) => found[j] = Slot::Held(b),
                        None => {
                            failed = Some(j);
                            break;
                        }
                    }
                }
                let Some(j) = failed else {
                    break;
                };
                found[j] = Slot::Missing;
                release(&mut found[j + 1..k]);
                k = j;
            }
            drop(storage);
            if let (Some(r), true) = (self.shared.remote(), from_remote > 0) {
                r.count_hits(from_remote);
            }
            if let Some(d) = &disk {
                d.touch(&in_ram);
            }
            first = lo(k);
            blocks = found[first..k]
                .iter()
                .map(|s| match s {
                    Slot::Held(b) => *b,
                    Slot::Missing | Slot::Pending => unreachable!("the window before k is held"),
                })
                .collect();
            keys.truncate(k);
        } else {
            let disk = self.shared.disk();
            let shared = Arc::clone(&self.shared);
            // Locked at the first block read from disk, in the order decodes take it (storage,
            // then the index inside it).
            let mut storage = None;
            let mut in_ram = Vec::new();
            let mut from_remote = 0;
            for chunk in tokens.chunks_exact(bs).take(n_max) {
                let key = block_key(self.shared.model_id, parent, chunk);
                let b = match index.lookup(pool, key, parent, chunk) {
                    Some(b) => {
                        in_ram.push(key);
                        b
                    }
                    None => {
                        let d = disk.as_deref().filter(|d| d.worth_it(tokens.len()));
                        let on_disk = d.is_some_and(|d| d.contains(key));
                        if let (Some(d), false) = (d, on_disk) {
                            d.count_miss();
                        }
                        let from_disk = d.filter(|_| on_disk);
                        let staged = staged.and_then(|s| s.get(key, parent, chunk));
                        if from_disk.is_none() && staged.is_none() {
                            break;
                        }
                        let st = storage.get_or_insert_with(|| shared.lock_storage());
                        let mut b = from_disk.and_then(|d| {
                            self.load_block(st, key, parent, chunk, |out| {
                                d.read(key, parent, chunk, out)
                            })
                        });
                        if let (None, Some(p)) = (b, staged) {
                            b = self.load_block(st, key, parent, chunk, |out| {
                                out.copy_from_slice(p);
                                true
                            });
                            from_remote += usize::from(b.is_some());
                        }
                        let Some(b) = b else {
                            break;
                        };
                        b
                    }
                };
                blocks.push(b);
                keys.push(key);
                parent = key;
            }
            drop(storage);
            if let (Some(r), true) = (self.shared.remote(), from_remote > 0) {
                r.count_hits(from_remote);
            }
            if let Some(d) = &disk {
                // Blocks served from RAM keep their disk copies warm in the tier's LRU.
                d.touch(&in_ram);
            }
        }
        let n = (first + blocks.len()) * bs;
        let own = &tokens[first * bs..n];
        if let Err(e) = self.table.attach_blocks_at(seq, first, &blocks, &keys, own) {
            for &b in blocks.iter().rev() {
                let _ = pool.release(b);
            }
            return Err(e);
        }
        self.hit_tokens += n as u64;
        self.shared
            .hit_tokens
            .fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    /// Applies pending storage work (after sequence operations) now instead of at the next
    /// batch.
    pub fn apply_pending(&mut self) -> Result<()> {
        let u = self.table.take_updates();
        let shared = Arc::clone(&self.shared);
        let mut storage = shared.lock_storage();
        self.apply(&mut storage, &u)
    }

    fn apply(&self, storage: &mut KvStorage, u: &Updates) -> Result<()> {
        for c in &u.copies {
            storage.copy_block(c.src, c.dst, c.n_slots as usize)?;
        }
        // One angle computation per distinct delta.
        let mut shifts: Vec<(Pos, BlockId, u16)> = u
            .shifts
            .iter()
            .map(|s| (s.delta, s.block, s.slot))
            .collect();
        shifts.sort_unstable();
        for group in shifts.chunk_by(|a, b| a.0 == b.0) {
            let cells: Vec<(BlockId, u16)> = group.iter().map(|&(_, b, sl)| (b, sl)).collect();
            storage.rotate_k_cells(&cells, &self.shared.rope, self.shared.head_dim, group[0].0)?;
        }
        Ok(())
    }

    /// Stores one layer's keys and values (`kv_dim` per batch token) at the planned slots.
    pub fn write(
        storage: &mut KvStorage,
        layer: usize,
        slots: &[(BlockId, u16)],
        k: &[f32],
        v: &[f32],
    ) {
        let d = storage.kv_dim();
        for (t, &(b, sl)) in slots.iter().enumerate() {
            storage
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

    /// Blocks and slot positions of `seq`, for attention (cached per sequence).
    pub fn view(&mut self, seq: SeqId) -> SeqView {
        self.table.view(seq)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::kv::storage::KvType;
    use crate::kv::NO_KEY;
    use crate::ops::RopeScaling;

    const BS: usize = 4;
    const D: usize = 8;

    fn rope() -> Rope {
        Rope {
            n_rot: D,
            neox: false,
            freq_base: 10000.0,
            scaling: RopeScaling::None,
            freq_factors: None,
        }
    }

    fn layout() -> KvLayout {
        KvLayout {
            ty: KvType::F32,
            n_layers: 1,
            kv_dim: D,
            block_size: BS,
        }
    }

    fn cache(n_ctx: usize) -> PagedCache {
        PagedCache::standalone(layout(), D, rope(), n_ctx).unwrap()
    }

    /// Reserves and writes `tokens` of `seq` at `pos0..`; V holds (token, position) so that the
    /// storage content can be checked later.
    fn decode(c: &mut PagedCache, seq: SeqId, tokens: &[u32], pos0: Pos) {
        let b = Batch::prompt(tokens, pos0, seq);
        let shared = Arc::clone(c.shared());
        let mut st = shared.lock_storage();
        let (slots, tx) = c.begin_batch(&b, &mut st).unwrap();
        let mut k = vec![0.0f32; tokens.len() * D];
        let mut v = vec![0.0f32; tokens.len() * D];
        for (i, &t) in tokens.iter().enumerate() {
            k[i * D] = t as f32;
            v[i * D] = t as f32;
            v[i * D + 1] = (pos0 + i as Pos) as f32;
        }
        PagedCache::write(&mut st, 0, &slots, &k, &v);
        let keyed = c.commit(tx);
        c.write_through(&st, &keyed);
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
                c.shared()
                    .lock_storage()
                    .read_v(0, b, sl as usize, &mut v)
                    .unwrap();
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
            // The peek predicts the match and changes nothing.
            let before = pool.stats();
            assert_eq!(
                c.peek_prefix(&p[..n], ROOT_KEY, None, usize::MAX),
                want,
                "peek of {n}"
            );
            assert_eq!(
                c.peek_prefix(&p[..n], ROOT_KEY, None, 4),
                want.min(4),
                "peek of {n} up to 4"
            );
            assert_eq!(pool.stats(), before);
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
        let id = c.model_id();
        let t = c.table_mut();
        // The blocks' real content keys (the attach does not check them; `check` does).
        let key0 = block_key(id, ROOT_KEY, &p[..4]);
        let (k1, k2) = ([key0], [key0, block_key(id, key0, &p[4..8])]);
        let before = t.stats();
        assert!(
            t.attach_blocks(0, &[b0], &k1, &p[..4]).is_err(),
            "sequence not empty"
        );
        assert!(
            t.attach_blocks(-1, &[b0], &k1, &p[..4]).is_err(),
            "negative id"
        );
        assert!(
            t.attach_blocks(1, &[b0, b0], &k2, &p[..8]).is_err(),
            "repeated block"
        );
        assert!(
            t.attach_blocks(1, &[b1], &k1, &p[..4]).is_err(),
            "block 1 holds positions 4..8"
        );
        assert!(
            t.attach_blocks(1, &[b0, 999], &k2, &p[..8]).is_err(),
            "out of range"
        );
        assert!(
            t.attach_blocks(1, &[b0, b1], &k1, &p[..8]).is_err(),
            "one key per block"
        );
        assert!(
            t.attach_blocks(1, &[b0, b1], &k2, &p[..7]).is_err(),
            "tokens per block"
        );
        assert!(t.cells(1).is_empty());
        assert_eq!(t.stats(), before);
        t.attach_blocks(1, &[b0, b1], &k2, &p[..8]).unwrap();
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

    /// A planned batch whose K/V never got written (the pass failed) is rolled back: the
    /// tables, the pool and the index are as before, and no key names the unwritten blocks.
    #[test]
    fn rollback_leaves_no_trace_and_no_keys() {
        let mut c = cache(64);
        let p = prompt(6, 2);
        decode(&mut c, 0, &p, 0);
        c.table_mut().seq_cp(0, 1, -1, -1).unwrap(); // shared partial tail: the batch copies it
        let snap = |c: &PagedCache| {
            let pool = c.table().pool();
            let blocks: Vec<_> = (0..pool.total() as BlockId)
                .map(|b| (pool.refcount(b), pool.key(b)))
                .collect();
            (
                c.table().cells(0),
                c.table().cells(1),
                c.table().cells(2),
                c.stats(),
                pool.stats(),
                blocks,
                c.prefix_stats().indexed,
            )
        };
        let before = snap(&c);
        let q = prompt(12, 40);
        let mut b = Batch::prompt(&q, 0, 2);
        for (t, pos) in [(91, 6), (92, 7), (93, 8)] {
            b.tokens.push(t);
            b.positions.push(pos);
            b.seq_ids.push(1);
            b.logits.push(false);
        }
        let shared = Arc::clone(c.shared());
        let mut st = shared.lock_storage();
        let (slots, tx) = c.begin_batch(&b, &mut st).unwrap();
        assert_eq!(slots.len(), 15);
        drop(st);
        c.rollback(tx);
        c.table().check().unwrap();
        assert_eq!(snap(&c), before);
        // Nothing of the failed batch is matched; committing the same batch for real indexes it.
        assert_eq!(c.match_prefix(3, &q).unwrap(), 0);
        c.table_mut().seq_rm(3, -1, -1);
        decode(&mut c, 2, &q, 0);
        assert_eq!(c.match_prefix(3, &q).unwrap(), 8);
        assert_eq!(content(&c, 3), expect(&q[..8]));
        assert_eq!(content(&c, 0), expect(&p));
        assert_eq!(content(&c, 1), expect(&p));
    }

    /// Two contexts over one shared memory: a prefix computed by one is matched by the other,
    /// and blocks evicted by the other's allocations leave the index at once.
    #[test]
    fn contexts_share_pool_and_index() {
        let mut a = cache(64);
        let mut b = PagedCache::new(Arc::clone(a.shared()), 64).unwrap();
        let p = prompt(13, 7);
        decode(&mut a, 0, &p, 0);
        assert_eq!(b.match_prefix(0, &p).unwrap(), 12);
        assert_eq!(content(&b, 0), expect(&p[..12]));
        assert_eq!(a.shared().pool_stats().shared, 3);
        b.table_mut().seq_rm(0, -1, -1);
        a.table_mut().seq_rm(0, -1, -1);
        assert_eq!(a.shared().prefix_stats().indexed, 3);
        // b fills the pool: the cached blocks are evicted and forgotten.
        let total = a.shared().n_blocks();
        let big = prompt(total * BS, 90);
        let mut c2 = PagedCache::new(Arc::clone(a.shared()), total * BS).unwrap();
        decode(&mut c2, 0, &big, 0);
        assert_eq!(
            a.shared().prefix_stats().indexed,
            total,
            "only c2's blocks are indexed"
        );
        assert_eq!(a.match_prefix(1, &p).unwrap(), 0);
        a.table().check().unwrap();
        c2.table().check().unwrap();
    }

    /// A salted sequence's blocks match only sequences of the same salt, in any context of the
    /// memory; the unsalted namespace is one more salt. The model of the semantics: a match
    /// maps the longest cached prefix computed under the same (salt, tokens).
    #[test]
    fn salted_prefixes_match_only_their_salt() {
        let mut a = cache(128);
        let mut b = PagedCache::new(Arc::clone(a.shared()), 128).unwrap();
        let (ra, rb) = (salt_root(b"tenant a"), salt_root(b"tenant b"));
        assert!(ra != ROOT_KEY && rb != ROOT_KEY && ra != rb);
        assert_eq!(salt_root(b""), ROOT_KEY);
        assert_eq!(salt_root(b"tenant a"), ra, "a pure function of the salt");
        let p = prompt(13, 7);
        a.table_mut().set_root(0, ra).unwrap();
        decode(&mut a, 0, &p, 0);
        assert_eq!(a.table().root(0), ra);
        // The keys of a salted chain are not the unsalted ones.
        let pool = Arc::clone(a.table().pool());
        let index = Arc::clone(&a.shared().index);
        let unsalted = crate::kv::prefix::chain_keys(a.model_id(), ROOT_KEY, &p, BS);
        let salted = crate::kv::prefix::chain_keys(a.model_id(), ra, &p, BS);
        for (k, (u, s)) in unsalted.iter().zip(&salted).enumerate() {
            assert_ne!(u, s, "block {k}");
            let parent = if k == 0 { ra } else { salted[k - 1] };
            let toks = &p[k * BS..(k + 1) * BS];
            assert!(
                index.contains(&pool, *s, parent, toks),
                "block {k} indexed salted"
            );
        }
        for (seq, root, want) in [(1, ROOT_KEY, 0), (2, rb, 0), (3, ra, 12)] {
            assert_eq!(b.peek_prefix(&p, root, None, usize::MAX), want);
            b.table_mut().set_root(seq, root).unwrap();
            assert_eq!(b.match_prefix(seq, &p).unwrap(), want, "seq {seq}");
            b.table().check().unwrap();
        }
        assert_eq!(content(&b, 3), expect(&p[..12]));
        // An unsalted computation of the same prompt is its own entry, found unsalted only.
        decode(&mut b, 1, &p[..1], 0);
        decode(&mut b, 1, &p[1..], 1);
        b.table().check().unwrap();
        assert_eq!(b.peek_prefix(&p, ROOT_KEY, None, usize::MAX), 12);
        assert_eq!(b.peek_prefix(&p, rb, None, usize::MAX), 0);
        // A salt is set on an empty sequence only, and stays with the id while it is empty.
        let err = b.table_mut().set_root(3, rb).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
        assert_eq!(b.table().root(3), ra, "nothing changed");
        b.table_mut().seq_rm(3, -1, -1);
        assert_eq!(b.table().root(3), ra);
        assert_eq!(b.match_prefix(3, &p).unwrap(), 12);
        // seq_cp into an empty sequence continues the source's salted chain: the copy's own
        // later blocks are keyed under the salt and found by the salt only.
        b.table_mut().seq_cp(3, 4, -1, -1).unwrap();
        assert_eq!(b.table().root(4), ra);
        let mut q = p[..12].to_vec();
        q.extend(prompt(9, 400));
        decode(&mut b, 4, &q[12..], 12);
        b.table().check().unwrap();
        assert_eq!(b.peek_prefix(&q, ra, None, usize::MAX), 20);
        assert_eq!(b.peek_prefix(&q, ROOT_KEY, None, usize::MAX), 12);
        assert_eq!(b.peek_prefix(&q, rb, None, usize::MAX), 0);
        // Unsalting is setting the root key; clear drops every salt.
        b.table_mut().seq_rm(-1, -1, -1);
        b.table_mut().set_root(4, ROOT_KEY).unwrap();
        assert_eq!(b.table().root(4), ROOT_KEY);
        b.clear();
        assert_eq!(b.table().root(3), ROOT_KEY);
        assert!(b.table_mut().set_root(-1, ra).is_err());
    }

    /// A window group resumes a salted prefix past its window only under the same salt.
    #[test]
    fn window_prefix_follows_the_salt() {
        const W: usize = 6;
        let mut c = cache(64);
        let p = prompt(40, 11);
        let ra = salt_root(b"a");
        c.table_mut().set_root(0, ra).unwrap();
        decode_windowed(&mut c, 0, &p, 3, W);
        c.table_mut().seq_rm(0, -1, -1);
        let mut q = p.clone();
        q.push(1);
        assert_eq!(c.peek_prefix(&q, ROOT_KEY, Some(W), usize::MAX), 0);
        assert_eq!(c.peek_prefix(&q, ra, Some(W), usize::MAX), 40);
        assert_eq!(c.match_window_prefix(1, &q, W).unwrap(), 0, "unsalted");
        c.table_mut().seq_rm(1, -1, -1);
        c.table_mut().set_root(2, ra).unwrap();
        assert_eq!(c.match_window_prefix(2, &q, W).unwrap(), 40);
        c.table().check().unwrap();
    }

    /// A context that goes away gives its blocks back to the shared pool: full clean blocks stay
    /// cached (and matchable), the partial tail is freed.
    #[test]
    fn dropping_a_context_releases_its_blocks() {
        let mut a = cache(64);
        let shared = Arc::clone(a.shared());
        let mut b = PagedCache::new(Arc::clone(&shared), 64).unwrap();
        let p = prompt(10, 3);
        decode(&mut b, 0, &p, 0);
        decode(&mut b, 1, &prompt(3, 50), 0);
        assert_eq!(shared.pool_stats().referenced, 4);
        drop(b);
        let st = shared.pool_stats();
        assert_eq!((st.referenced, st.cached), (0, 2));
        assert_eq!(a.match_prefix(0, &p).unwrap(), 8);
        a.table().check().unwrap();
    }

    /// A copy of a source's first cells (not all of them) continues with its own tokens: its
    /// later blocks are keyed under its own chain, never under the source's longer one (a key
    /// naming "the source's prefix, then these tokens" would hand K/V computed after other
    /// tokens to a later prompt).
    #[test]
    fn a_partial_copy_keys_its_own_chain() {
        let mut c = cache(128);
        let p = prompt(40, 5);
        decode(&mut c, 0, &p, 0);
        c.table_mut().seq_cp(0, 1, 0, 18).unwrap();
        let mut t1 = p[..18].to_vec();
        t1.extend(prompt(26, 500));
        decode(&mut c, 1, &t1[18..], 18);
        c.table().check().unwrap();
        // The source's prefix followed by the copy's tokens: only the source's 10 blocks.
        let mut q = p.clone();
        q.extend_from_slice(&t1[40..]);
        assert_eq!(c.match_prefix(2, &q).unwrap(), 40);
        assert_eq!(content(&c, 2), expect(&p));
        // The copy's own tokens: all of its 11 full blocks were keyed under its chain.
        let mut q = t1.clone();
        q.push(7);
        assert_eq!(c.match_prefix(3, &q).unwrap(), 44);
        assert_eq!(content(&c, 3), expect(&t1));
        c.table().check().unwrap();
    }

    /// Decodes `tokens` of `seq` from position 0 in chunks of `chunk`, pruning to a window of
    /// `w` positions after each (as `LayerGroups::prune_windows` does).
    fn decode_windowed(c: &mut PagedCache, seq: SeqId, tokens: &[u32], chunk: usize, w: usize) {
        for (i, part) in tokens.chunks(chunk).enumerate() {
            decode(c, seq, part, (i * chunk) as Pos);
            let hi = c.table().seq_pos_max(seq);
            c.table_mut().prune_front(seq, hi - w as Pos + 1);
            c.table().check().unwrap();
        }
    }

    /// A window group keeps keying blocks after its front was pruned, and a later prompt
    /// resumes from the blocks its window needs only: far past the window, with the head of
    /// the prompt evicted, and at the last point before a difference.
    #[test]
    fn window_prefix_resumes_past_the_window() {
        const W: usize = 6;
        let mut c = cache(48);
        let pool = Arc::clone(c.table().pool());
        let p = prompt(40, 11);
        decode_windowed(&mut c, 0, &p, 3, W);
        // Holds at most the window plus a chunk, in at most ceil((6 + 3) / 4) + 1 blocks.
        assert!(c.table().stats().held_blocks <= 4);
        assert_eq!(c.table().seq_pos_min(0), 40 - W as Pos);
        c.table_mut().seq_rm(0, -1, -1);
        assert_eq!(
            pool.stats().cached,
            10,
            "every block of the prompt was keyed"
        );
        // Another sequence takes the free blocks and evicts the 2 oldest (positions 0..8).
        let n = pool.total() - 10 + 2;
        decode(&mut c, 5, &prompt(n * BS, 900), 0);
        assert_eq!(pool.stats().cached, 8);
        c.table_mut().seq_rm(5, -1, -1);
        let mut q = p.clone();
        q.push(1);
        assert_eq!(c.match_prefix(1, &q).unwrap(), 0, "the head is gone");
        c.table_mut().seq_rm(1, -1, -1);
        // The window of position 40 (35..39) lies in blocks 8 and 9: resume at 40.
        let before = pool.stats();
        assert_eq!(c.peek_prefix(&q, ROOT_KEY, Some(W), usize::MAX), 40);
        assert_eq!(
            c.peek_prefix(&q, ROOT_KEY, Some(W), 39),
            36,
            "at most 39 tokens: resume at 36"
        );
        assert_eq!(c.peek_prefix(&q, ROOT_KEY, None, usize::MAX), 0);
        assert_eq!(pool.stats(), before);
        assert_eq!(c.match_window_prefix(1, &q, W).unwrap(), 40);
        assert_eq!(content(&c, 1), expect(&p)[32..].to_vec());
        assert_eq!(c.table().seq_pos_min(1), 32);
        c.table().check().unwrap();
        // The resumed sequence keys its next blocks under the prompt's chain.
        let more = prompt(9, 77);
        decode(&mut c, 1, &more[..8], 40);
        let hi = c.table().seq_pos_max(1);
        c.table_mut().prune_front(1, hi - W as Pos + 1);
        let mut r = p.clone();
        r.extend_from_slice(&more);
        assert_eq!(c.match_window_prefix(2, &r, W).unwrap(), 48);
        c.table_mut().seq_rm(2, -1, -1);
        c.table_mut().seq_rm(1, -1, -1);
        // A difference at position 38 (block 9): the last point whose window avoids it is 36
        // (window 31..35: blocks 7 and 8).
        let mut d = p.clone();
        d[38] += 1;
        assert_eq!(c.peek_prefix(&d, ROOT_KEY, Some(W), usize::MAX), 36);
        assert_eq!(c.match_window_prefix(3, &d, W).unwrap(), 36);
        assert_eq!(content(&c, 3), expect(&p)[28..36].to_vec());
        c.table().check().unwrap();
        // A window as long as the prompt needs every block: nothing, since the head is gone.
        c.table_mut().seq_rm(3, -1, -1);
        assert_eq!(c.match_window_prefix(4, &q, 64).unwrap(), 0);
        assert!(c.table().seq_ids().is_empty() || c.table().seq_pos_max(4) < 0);
        c.table().check().unwrap();
    }

    /// A memory of `n_blocks` blocks (weights id 7) with a disk tier under `dir`.
    fn memory_on_disk(n_blocks: usize, dir: &std::path::Path, min_tokens: usize) -> Arc<SharedKv> {
        let shared = Arc::new(SharedKv::new(layout(), D, rope(), n_blocks, 7).unwrap());
        let o = crate::kv::DiskOptions {
            max_bytes: 1 << 30,
            min_tokens,
            queue_bytes: 1 << 20,
        };
        let bb = layout().bytes_per_block();
        let tier = DiskTier::open(dir, shared.model_id(), BS, bb, o).unwrap();
        shared.set_disk(Some(tier)).unwrap();
        shared
    }

    fn disk_dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("kvserve-cache-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// The raw bytes of each block of `seq`, in position order.
    fn raw_blocks(c: &PagedCache, seq: SeqId) -> Vec<Vec<u8>> {
        let mut cells = c.table().cells(seq);
        cells.sort_by_key(|x| x.0);
        let st = c.shared().lock_storage();
        cells
            .iter()
            .filter(|&&(p, _, _)| (p as usize).is_multiple_of(BS))
            .map(|&(_, b, _)| st.block_raw(b).unwrap().to_vec())
            .collect()
    }

    /// Takes every block of the pool with another prompt and lets it go: the cached blocks
    /// of earlier prompts are all evicted from RAM.
    fn flush_ram(shared: &Arc<SharedKv>, salt: u32) {
        let total = shared.n_blocks();
        let mut c = PagedCache::new(Arc::clone(shared), total * BS).unwrap();
        decode(&mut c, 0, &prompt(total * BS, salt), 0);
        c.table_mut().seq_rm(0, -1, -1);
        c.table().check().unwrap();
    }

    /// Blocks evicted from the pool come back from the disk tier bit for bit, in another
    /// context of the memory and after a restart (a new memory and tier on the directory);
    /// the match stops at the first block the tier does not hold.
    #[test]
    fn evicted_blocks_come_back_from_disk() {
        let dir = disk_dir("evicted");
        let shared = memory_on_disk(24, &dir, 0);
        let p = prompt(41, 3); // 10 whole blocks and a token
        let mut a = PagedCache::new(Arc::clone(&shared), 64).unwrap();
        decode(&mut a, 0, &p, 0);
        let want = raw_blocks(&a, 0);
        assert_eq!(want.len(), 11);
        a.table_mut().seq_rm(0, -1, -1);
        let tier = shared.disk().unwrap();
        tier.flush();
        assert_eq!(
            tier.stats().entries,
            10,
            "every keyed block was written through"
        );
        flush_ram(&shared, 500);
        assert!(shared.pool_stats().evicted >= 10);
        let before = shared.pool_stats();
        assert_eq!(a.peek_prefix(&p, ROOT_KEY, None, usize::MAX), 40);
        assert_eq!(shared.pool_stats(), before, "peeking changes nothing");
        // Another context maps the whole prefix from disk.
        let mut b = PagedCache::new(Arc::clone(&shared), 64).unwrap();
        assert_eq!(b.match_prefix(0, &p).unwrap(), 40);
        assert_eq!(content(&b, 0), expect(&p[..40]));
        assert_eq!(raw_blocks(&b, 0), want[..10].to_vec());
        b.table().check().unwrap();
        shared.pool().audit().unwrap();
        let st = tier.stats();
        assert_eq!((st.hit_blocks, st.hit_tokens, st.misses), (10, 40, 0));
        assert_eq!(b.prefix_stats().hit_tokens, 40);
        // Loaded blocks are keyed in the pool: the next match is served from RAM.
        assert_eq!(b.match_prefix(1, &p).unwrap(), 40);
        assert_eq!(tier.stats().hit_blocks, 10);
        // The sequence continues its chain: its next blocks are keyed and written through.
        let mut q = p.clone();
        q.extend(prompt(8, 900));
        tier.flush();
        let e0 = tier.stats().entries;
        decode(&mut b, 0, &q[40..], 40);
        tier.flush();
        assert_eq!(tier.stats().entries, e0 + 2);
        b.table_mut().seq_rm(-1, -1, -1);
        let held = tier.stats().entries;
        drop((a, b, tier));
        drop(shared);
        // A restart: a new memory of the same model and format, a new tier on the directory.
        let shared = memory_on_disk(24, &dir, 0);
        let tier = shared.disk().unwrap();
        assert_eq!(tier.stats().loaded, held);
        let mut c = PagedCache::new(Arc::clone(&shared), 64).unwrap();
        let mut q1 = q.clone();
        q1.push(1);
        assert_eq!(c.match_prefix(0, &q1).unwrap(), 48);
        assert_eq!(content(&c, 0), expect(&q[..48]));
        assert_eq!(raw_blocks(&c, 0)[..10], want[..10]);
        c.table_mut().seq_rm(0, -1, -1);
        // An entry gone from disk ends the match there (block 5: 20 tokens).
        flush_ram(&shared, 700);
        let keys = crate::kv::prefix::chain_keys(shared.model_id(), ROOT_KEY, &p, BS);
        std::fs::remove_file(tier.dir().join(format!("{:032x}.kvb", keys[5]))).unwrap();
        assert_eq!(c.match_prefix(1, &p).unwrap(), 20);
        assert_eq!(content(&c, 1), expect(&p[..20]));
        let st = tier.stats();
        assert_eq!((st.misses, st.removed), (1, 1));
        c.table().check().unwrap();
        shared.pool().audit().unwrap();
        drop((c, tier, shared));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A salted sequence finds on disk only blocks computed under its salt.
    #[test]
    fn disk_blocks_follow_the_salt() {
        let dir = disk_dir("salt");
        let shared = memory_on_disk(24, &dir, 0);
        let ra = salt_root(b"tenant a");
        let p = prompt(25, 9);
        let mut a = PagedCache::new(Arc::clone(&shared), 64).unwrap();
        a.table_mut().set_root(0, ra).unwrap();
        decode(&mut a, 0, &p, 0);
        a.table_mut().seq_rm(0, -1, -1);
        shared.disk().unwrap().flush();
        flush_ram(&shared, 300);
        let mut b = PagedCache::new(Arc::clone(&shared), 64).unwrap();
        for (seq, root, want) in [
            (1, ROOT_KEY, 0),
            (2, salt_root(b"tenant b"), 0),
            (3, ra, 24),
        ] {
            assert_eq!(b.peek_prefix(&p, root, None, usize::MAX), want);
            b.table_mut().set_root(seq, root).unwrap();
            assert_eq!(b.match_prefix(seq, &p).unwrap(), want, "seq {seq}");
        }
        assert_eq!(content(&b, 3), expect(&p[..24]));
        let st = shared.disk().unwrap().stats();
        assert_eq!((st.hit_blocks, st.misses), (6, 2));
        b.table().check().unwrap();
        drop((a, b, shared));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The break-even: a prompt shorter than `min_tokens` does not look on disk; a pool with
    /// no block to give stops the match where it is.
    #[test]
    fn disk_reads_stop_at_the_break_even_and_a_full_pool() {
        let dir = disk_dir("limits");
        let shared = memory_on_disk(16, &dir, 30);
        let p = prompt(29, 4);
        let mut a = PagedCache::new(Arc::clone(&shared), 64).unwrap();
        decode(&mut a, 0, &p, 0);
        a.table_mut().seq_rm(0, -1, -1);
        let tier = shared.disk().unwrap();
        tier.flush();
        flush_ram(&shared, 100);
        assert_eq!(a.peek_prefix(&p, ROOT_KEY, None, usize::MAX), 0);
        assert_eq!(a.match_prefix(1, &p).unwrap(), 0, "29 tokens < 30");
        assert_eq!(tier.stats().skipped, 1);
        let mut q = p.clone();
        q.push(5);
        assert_eq!(a.match_prefix(2, &q).unwrap(), 28, "30 tokens");
        a.table_mut().seq_rm(-1, -1, -1);
        // Hold all but 3 blocks: the match maps 3 blocks and stops.
        flush_ram(&shared, 200);
        let mut holder = PagedCache::new(Arc::clone(&shared), 64).unwrap();
        decode(&mut holder, 0, &prompt(13 * BS, 800), 0);
        assert_eq!(shared.pool_stats().free + shared.pool_stats().cached, 3);
        assert_eq!(a.match_prefix(3, &q).unwrap(), 12);
        assert_eq!(content(&a, 3), expect(&q[..12]));
        assert_eq!(shared.pool_stats().free + shared.pool_stats().cached, 0);
        a.table().check().unwrap();
        shared.pool().audit().unwrap();
        drop((a, holder, tier, shared));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A window group (here: a cache pruned to a window of 6 after each chunk) writes its
    /// keyed blocks through to disk; once RAM evicted them, a resume reads back exactly the
    /// window it needs (not the blocks before it), bit for bit; a block the tier lacks, or an
    /// entry that fails its read, moves the resume point down to one whose window avoids it;
    /// keys follow the salt.
    #[test]
    fn window_blocks_come_back_from_disk() {
        const W: usize = 6;
        let dir = disk_dir("window");
        let shared = memory_on_disk(24, &dir, 0);
        let tier = shared.disk().unwrap();
        let p = prompt(41, 11); // 10 whole blocks and a token
        let want = {
            let mut plain = cache(64);
            decode(&mut plain, 0, &p, 0);
            raw_blocks(&plain, 0)
        };
        let mut a = PagedCache::new(Arc::clone(&shared), 64).unwrap();
        decode_windowed(&mut a, 0, &p, 3, W);
        a.table_mut().seq_rm(0, -1, -1);
        tier.flush();
        assert_eq!(tier.stats().entries, 10, "every keyed window block");
        flush_ram(&shared, 500);
        let mut q = p.clone();
        q.push(1);
        let before = shared.pool_stats();
        assert_eq!(a.peek_prefix(&q, ROOT_KEY, Some(W), usize::MAX), 40);
        assert_eq!(shared.pool_stats(), before, "peeking changes nothing");
        // The window of position 40 (35..39) lies in blocks 8 and 9: only those are read.
        let mut b = PagedCache::new(Arc::clone(&shared), 64).unwrap();
        assert_eq!(b.match_window_prefix(1, &q, W).unwrap(), 40);
        assert_eq!(content(&b, 1), expect(&p)[32..40].to_vec());
        let st = shared.lock_storage();
        let got: Vec<Vec<u8>> = b
            .table()
            .cells(1)
            .iter()
            .filter(|c| (c.0 as usize).is_multiple_of(BS))
            .map(|c| st.block_raw(c.1).unwrap().to_vec())
            .collect();
        drop(st);
        assert_eq!(got, want[8..10].to_vec(), "bit for bit");
        let s = tier.stats();
        assert_eq!((s.hit_blocks, s.misses), (2, 0));
        b.table().check().unwrap();
        // Loaded blocks are keyed in the pool: the next resume finds them in RAM.
        assert_eq!(b.match_window_prefix(2, &q, W).unwrap(), 40);
        assert_eq!(tier.stats().hit_blocks, 2);
        b.table_mut().seq_rm(-1, -1, -1);
        // A block the tier lacks (block 9 of a prompt that differs at 38): resume at 36,
        // whose window (31..35) lies in blocks 7 and 8.
        flush_ram(&shared, 600);
        let mut d = q.clone();
        d[38] += 1;
        assert_eq!(b.match_window_prefix(3, &d, W).unwrap(), 36);
        assert_eq!(content(&b, 3), expect(&p)[28..36].to_vec());
        assert_eq!(tier.stats().hit_blocks, 4);
        b.table_mut().seq_rm(-1, -1, -1);
        // An entry whose file is gone fails its read (blocks are read bottom up: block 8 is
        // read, then 9 fails): the same fallback, the entry removed, block 8 kept for the
        // lower window and block 7 read for it.
        flush_ram(&shared, 700);
        let keys = crate::kv::prefix::chain_keys(shared.model_id(), ROOT_KEY, &p, BS);
        std::fs::remove_file(tier.dir().join(format!("{:032x}.kvb", keys[9]))).unwrap();
        assert_eq!(b.match_window_prefix(4, &q, W).unwrap(), 36);
        assert_eq!(content(&b, 4), expect(&p)[28..36].to_vec());
        let s = tier.stats();
        assert_eq!((s.hit_blocks, s.removed), (6, 1));
        assert_eq!(b.table().stats().held_blocks, 2);
        b.table().check().unwrap();
        shared.pool().audit().unwrap();
        b.table_mut().seq_rm(-1, -1, -1);
        // Salts: a window decoded under one salt resumes from disk only under that salt.
        let ra = salt_root(b"tenant a");
        let r = prompt(25, 9);
        a.table_mut().set_root(5, ra).unwrap();
        decode_windowed(&mut a, 5, &r, 3, W);
        a.table_mut().seq_rm(5, -1, -1);
        tier.flush();
        flush_ram(&shared, 800);
        for (seq, root, want) in [
            (6, ROOT_KEY, 0),
            (7, salt_root(b"tenant b"), 0),
            (8, ra, 24),
        ] {
            assert_eq!(b.peek_prefix(&r, root, Some(W), usize::MAX), want);
            b.table_mut().set_root(seq, root).unwrap();
            assert_eq!(
                b.match_window_prefix(seq, &r, W).unwrap(),
                want,
                "seq {seq}"
            );
        }
        assert_eq!(content(&b, 8), expect(&r)[16..24].to_vec());
        b.table().check().unwrap();
        shared.pool().audit().unwrap();
        drop((a, b, tier, shared));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A memory of `n_blocks` blocks (weights id 7) with the shared tier on `url`.
    fn memory_on_store(n_blocks: usize, url: &str) -> Arc<SharedKv> {
        let shared = Arc::new(SharedKv::new(layout(), D, rope(), n_blocks, 7).unwrap());
        let bb = layout().bytes_per_block();
        let tier = RemoteTier::open(url, shared.model_id(), BS, bb, Default::default()).unwrap();
        shared.set_remote(Some(tier)).unwrap();
        shared
    }

    /// A prefix one memory computed (another process: its own pool, index and tier, the same
    /// model id) is fetched by another and mapped bit for bit; only the blocks RAM lacks are
    /// fetched; the staged blocks are keyed as a commit would (the next match is from RAM),
    /// and a salted sequence fetches only blocks of its own salt.
    #[test]
    fn blocks_computed_elsewhere_come_from_the_shared_tier() {
        let r = super::super::remote::test_server::RedisServer::start();
        let one = memory_on_store(32, &r.url());
        let p = prompt(41, 5); // 10 whole blocks and a token
        let mut a = PagedCache::new(Arc::clone(&one), 64).unwrap();
        decode(&mut a, 0, &p, 0);
        let want = raw_blocks(&a, 0);
        one.remote().unwrap().flush();
        assert_eq!(one.remote().unwrap().stats().writes, 10);

        let two = memory_on_store(32, &r.url());
        let mut b = PagedCache::new(Arc::clone(&two), 64).unwrap();
        // Three leading blocks are in this memory's RAM already: only the other 7 come.
        decode(&mut b, 0, &p[..12], 0);
        b.table_mut().seq_rm(0, -1, -1);
        let before = two.pool_stats();
        let staged = two.fetch_remote(&p, ROOT_KEY);
        assert_eq!(staged.len(), 7);
        assert_eq!(two.pool_stats(), before, "a fetch touches no pool block");
        assert_eq!(b.match_prefix_staged(1, &p, Some(&staged)).unwrap(), 40);
        assert_eq!(content(&b, 1), expect(&p[..40]));
        assert_eq!(raw_blocks(&b, 1)[..10], want[..10]);
        b.table().check().unwrap();
        two.pool().audit().unwrap();
        let st = two.remote().unwrap().stats();
        assert_eq!(
            (st.fetched_blocks, st.hit_blocks, st.hit_tokens),
            (7, 7, 28)
        );
        // Keyed and indexed: a new sequence maps them from RAM without a fetch.
        assert!(two.fetch_remote(&p, ROOT_KEY).is_empty());
        assert_eq!(b.match_prefix(2, &p).unwrap(), 40);
        // Another salt's keys are not in the store; the writer's salt finds its blocks.
        let three = memory_on_store(32, &r.url());
        assert!(three.fetch_remote(&p, salt_root(b"tenant b")).is_empty());
        let mut c = PagedCache::new(Arc::clone(&three), 64).unwrap();
        c.table_mut().set_root(0, salt_root(b"tenant b")).unwrap();
        decode(&mut c, 0, &p, 0);
        three.remote().unwrap().flush();
        let four = memory_on_store(32, &r.url());
        assert_eq!(four.fetch_remote(&p, salt_root(b"tenant b")).len(), 10);
        assert_eq!(four.fetch_remote(&p, salt_root(b"tenant c")).len(), 0);
    }

    /// A window group's blocks computed elsewhere: the fetch brings only the window before
    /// the resume point asked for, and the match maps it bit for bit; a window block the
    /// store lacks moves the resume point below it.
    #[test]
    fn window_blocks_come_from_the_shared_tier() {
        const W: usize = 6;
        let r = super::super::remote::test_server::RedisServer::start();
        let one = memory_on_store(24, &r.url());
        let p = prompt(41, 17);
        let want = {
            let mut plain = cache(64);
            decode(&mut plain, 0, &p, 0);
            raw_blocks(&plain, 0)
        };
        let mut a = PagedCache::new(Arc::clone(&one), 64).unwrap();
        decode_windowed(&mut a, 0, &p, 3, W);
        one.remote().unwrap().flush();
        assert_eq!(one.remote().unwrap().stats().writes, 10);
        let mut q = p.clone();
        q.push(1);
        let two = memory_on_store(24, &r.url());
        let staged = two.fetch_window(&q, ROOT_KEY, W, 10);
        assert_eq!(staged.len(), 2, "the window of position 40: blocks 8 and 9");
        assert_eq!(two.reachable_blocks(&q, ROOT_KEY, &staged), 0);
        let mut b = PagedCache::new(Arc::clone(&two), 64).unwrap();
        assert_eq!(
            b.match_window_prefix_staged(1, &q, W, Some(&staged))
                .unwrap(),
            40
        );
        assert_eq!(content(&b, 1), expect(&p)[32..40].to_vec());
        let st = two.lock_storage();
        let got: Vec<Vec<u8>> = b
            .table()
            .cells(1)
            .iter()
            .filter(|c| (c.0 as usize).is_multiple_of(BS))
            .map(|c| st.block_raw(c.1).unwrap().to_vec())
            .collect();
        drop(st);
        assert_eq!(got, want[8..10].to_vec(), "bit for bit");
        assert_eq!(two.remote().unwrap().stats().hit_blocks, 2);
        b.table().check().unwrap();
        two.pool().audit().unwrap();
        // Block 9 gone from the store: the fetch for 40 brings block 8 only (a leading run),
        // and the match resumes at 36 from blocks 7 and 8 (7 fetched for that point).
        let keys = crate::kv::prefix::chain_keys(one.model_id(), ROOT_KEY, &p, BS);
        assert!(one.remote().unwrap().delete(keys[9]).unwrap());
        let three = memory_on_store(24, &r.url());
        let s40 = three.fetch_window(&q, ROOT_KEY, W, 10);
        assert_eq!(s40.len(), 1);
        let s36 = three.fetch_window(&q, ROOT_KEY, W, 9);
        assert_eq!(s36.len(), 2);
        let mut c = PagedCache::new(Arc::clone(&three), 64).unwrap();
        assert_eq!(
            c.match_window_prefix_staged(1, &q, W, Some(&s40)).unwrap(),
            0
        );
        c.table_mut().seq_rm(-1, -1, -1);
        assert_eq!(
            c.match_window_prefix_staged(2, &q, W, Some(&s36)).unwrap(),
            36
        );
        assert_eq!(content(&c, 2), expect(&p)[28..36].to_vec());
        c.table().check().unwrap();
        three.pool().audit().unwrap();
    }
}
