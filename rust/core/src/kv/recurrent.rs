//! The recurrent-state group of a hybrid model (LFM2's short convolutions): one fixed-size
//! state per sequence, kept in blocks of the model's one block pool, so that states and K/V
//! share one memory budget and one accounting (a state takes `blocks_per_state` pool blocks;
//! its `f32` values are stored, little-endian, in those blocks' bytes of the K/V storage).
//!
//! A state is the memory of a sequence's recurrent layers after its last token (position
//! `pos`): for a short conv of kernel `l_cache`, the last `l_cache - 1` inputs of every conv
//! layer. Unlike K/V cells it cannot be cut at an arbitrary position. The rules follow
//! llama.cpp's `llama_memory_recurrent` (docs/KV_SEMANTICS.md, "Recurrent state"):
//!
//! - `seq_rm(s, p0, p1)`: a range that holds `pos` and starts at 0 drops the state; a range
//!   that holds `pos` but starts later would need the state at `p0 - 1`, which is gone: it
//!   fails ([`RecurrentGroup::check_rm`] says so before anything changes, so a hybrid memory
//!   changes neither group); a range without `pos` leaves the state as it is. With `s < 0` the
//!   range must be everything or nothing.
//! - `seq_cp(src, dst, ..)`: `dst` shares `src`'s state (its blocks gain a reference; the range
//!   is not looked at, as in llama.cpp); the first decode of either copies it first
//!   (copy-on-write), so the two go on independently.
//! - `seq_add` / `seq_div` move the recorded `pos` when it is in the range (the values do not
//!   depend on positions); `seq_keep`, `clear` as for K/V.
//!
//! A decode is a transaction, as for K/V: [`RecurrentGroup::begin`] takes fresh blocks for new
//! sequences and for shared states (all or nothing: `KvCacheFull` changes nothing) and loads
//! every batch sequence's state into one `f32` buffer; the forward pass updates that buffer;
//! [`RecurrentGroup::commit`] writes it back and moves each sequence to its new blocks, or
//! [`RecurrentGroup::rollback`] gives the fresh blocks back and leaves every state as it was.
//!
//! **Checkpoints** (prefix reuse): when a decode fills a clean K/V block that the prefix index
//! keys, the state after that block's last token is stored in a pool block of its own, keyed
//! by [`checkpoint_key`] (a hash of the K/V block's key and tokens) in the same prefix index,
//! and released at once: it is a *cached* block, evicted by the pool's LRU like any other. A
//! new sequence that maps a cached prefix resumes from the checkpoint at the end of the longest
//! mapped prefix that has one ([`RecurrentGroup::find_checkpoint`]), instead of recomputing it.
//! Checkpoints are kept only for states that fit one block. With a disk or shared tier they
//! are written through beside the K/V blocks (`LayerGroups::store_checkpoint`), and a match
//! loads the one it resumes from out of a tier ([`RecurrentGroup::load_checkpoint`]) when
//! the pool evicted it (docs/KV_SEMANTICS.md, "Recurrent state").
//!
//! Complexity: every operation is O(sequences touched × blocks_per_state); a decode moves each
//! batch sequence's state twice (load and store), O(state size).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::pool::{BlockId, BlockPool};
use super::prefix::{block_key, Key, PrefixIndex};
use super::storage::KvStorage;
use super::table::{Pos, SeqId};
use crate::error::{Error, Result};

/// What one sequence's state holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateLayout {
    /// Recurrent (short-conv) layers.
    pub n_layers: usize,
    /// `f32` values per layer (`(l_cache - 1) * n_embd` for a short conv).
    pub per_layer: usize,
}

impl StateLayout {
    /// `f32` values of one state.
    pub fn floats(&self) -> usize {
        self.n_layers * self.per_layer
    }

    pub fn bytes(&self) -> usize {
        self.floats() * 4
    }
}

/// Domain of checkpoint keys, so that they never equal a K/V block key.
const CHECKPOINT_DOMAIN: u128 = 0x6b76_7365_7276_6543_6b70_7453_7461_7465; // "kvserveCkptState"

/// The prefix-index key of the state checkpoint after the K/V block keyed `kv_key` (holding
/// `tokens`) of model `model_id`.
pub fn checkpoint_key(model_id: Key, kv_key: Key, tokens: &[u32]) -> Key {
    block_key(model_id ^ CHECKPOINT_DOMAIN, kv_key, tokens)
}

#[derive(Debug, Clone)]
struct Slot {
    /// The pool blocks holding the state (one reference each for this sequence).
    blocks: Vec<BlockId>,
    /// The last position folded into the state.
    pos: Pos,
}

/// One batch's states: see [`RecurrentGroup::begin`]. Dropped without `commit` or `rollback`
/// (a panic unwinding through the batch), it gives the fresh blocks it still holds back to the
/// pool.
#[derive(Debug)]
#[must_use = "a begun batch must be committed or rolled back"]
pub struct StateTx {
    /// Batch sequences in order of first appearance.
    pub seqs: Vec<SeqId>,
    /// Per sequence of `seqs`: fresh blocks to move to at commit (new or copied-on-write).
    fresh: Vec<Option<Vec<BlockId>>>,
    /// Per sequence of `seqs`: its last position in the batch.
    last_pos: Vec<Pos>,
    pool: Arc<BlockPool>,
}

impl Drop for StateTx {
    fn drop(&mut self) {
        for bl in std::mem::take(&mut self.fresh).into_iter().flatten() {
            for &b in bl.iter().rev() {
                let _ = self.pool.release(b);
            }
        }
    }
}

/// The recurrent states of one context's sequences, over the model's shared block pool.
pub struct RecurrentGroup {
    pool: Arc<BlockPool>,
    index: Option<Arc<PrefixIndex>>,
    layout: StateLayout,
    block_bytes: usize,
    blocks_per_state: usize,
    seqs: BTreeMap<SeqId, Slot>,
}

impl std::fmt::Debug for RecurrentGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecurrentGroup")
            .field("layout", &self.layout)
            .field("blocks_per_state", &self.blocks_per_state)
            .field("seqs", &self.seqs.len())
            .finish()
    }
}

/// Open ends as llama.cpp reads them: `p0 < 0` is 0, `p1 < 0` is +infinity.
fn range(p0: Pos, p1: Pos) -> (Pos, Pos) {
    (p0.max(0), if p1 < 0 { Pos::MAX } else { p1 })
}

impl RecurrentGroup {
    /// A group whose states take blocks of `pool` (blocks of `block_bytes` bytes each);
    /// `index`: the prefix index to tell when an allocation evicts a cached block.
    pub fn new(
        pool: Arc<BlockPool>,
        index: Option<Arc<PrefixIndex>>,
        layout: StateLayout,
        block_bytes: usize,
    ) -> Result<RecurrentGroup> {
        if layout.floats() == 0 || block_bytes == 0 {
            return Err(Error::InvalidInput(
                "a recurrent state needs a positive size".into(),
            ));
        }
        Ok(RecurrentGroup {
            pool,
            index,
            layout,
            block_bytes,
            blocks_per_state: layout.bytes().div_ceil(block_bytes),
            seqs: BTreeMap::new(),
        })
    }

    pub fn layout(&self) -> StateLayout {
        self.layout
    }

    /// Pool blocks one state takes.
    pub fn blocks_per_state(&self) -> usize {
        self.blocks_per_state
    }

    /// Sequences holding a state.
    pub fn n_states(&self) -> usize {
        self.seqs.len()
    }

    /// The last position folded into `s`'s state, or -1 (no state; `s < 0`: the highest).
    pub fn seq_pos(&self, s: SeqId) -> Pos {
        if s < 0 {
            return self.seqs.values().map(|x| x.pos).max().unwrap_or(-1);
        }
        self.seqs.get(&s).map_or(-1, |x| x.pos)
    }

    /// Whether `seq_rm(s, p0, p1)` can be honoured (see the module docs); changes nothing.
    pub fn check_rm(&self, s: SeqId, p0: Pos, p1: Pos) -> Result<()> {
        let (p0, p1) = range(p0, p1);
        if s < 0 {
            if p0 < p1 && (p0 != 0 || p1 != Pos::MAX) && !self.seqs.is_empty() {
                return Err(Error::InvalidInput(format!(
                    "seq_rm over every sequence of a recurrent model must remove all positions \
                     or none, not [{p0}, {p1})"
                )));
            }
            return Ok(());
        }
        if let Some(x) = self.seqs.get(&s) {
            if p0 > 0 && p0 <= x.pos && x.pos < p1 {
                return Err(Error::InvalidInput(format!(
                    "seq_rm({s}, {p0}, {}): sequence {s} has a recurrent state at position {}, \
                     which cannot be rolled back to position {}; remove the whole sequence \
                     (p0 = 0) or only positions before {}",
                    if p1 == Pos::MAX { -1 } else { p1 },
                    x.pos,
                    p0 - 1,
                    x.pos
                )));
            }
        }
        Ok(())
    }

    /// Applies `seq_rm` after [`RecurrentGroup::check_rm`] passed: drops the states whose
    /// position is in the range.
    pub fn seq_rm(&mut self, s: SeqId, p0: Pos, p1: Pos) {
        let (p0, p1) = range(p0, p1);
        let drop: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(&id, x)| (s < 0 || id == s) && p0 <= x.pos && x.pos < p1)
            .map(|(&id, _)| id)
            .collect();
        for id in drop {
            self.drop_state(id);
        }
    }

    /// `dst` shares `src`'s state (copy-on-write); `dst`'s own state is dropped first.
    pub fn seq_cp(&mut self, src: SeqId, dst: SeqId) -> Result<()> {
        if src < 0 || dst < 0 {
            return Err(Error::InvalidInput(format!(
                "seq_cp needs sequence ids >= 0, got {src} -> {dst}"
            )));
        }
        if src == dst {
            return Ok(());
        }
        self.drop_state(dst);
        if let Some(x) = self.seqs.get(&src).cloned() {
            for &b in &x.blocks {
                self.pool
                    .retain(b)
                    .map_err(|e| Error::Internal(format!("recurrent state: {e}")))?;
            }
            self.seqs.insert(dst, x);
        }
        Ok(())
    }

    /// Drops every state but `s`'s.
    pub fn seq_keep(&mut self, s: SeqId) {
        let drop: Vec<SeqId> = self.seqs.keys().copied().filter(|&id| id != s).collect();
        for id in drop {
            self.drop_state(id);
        }
    }

    /// Adds `delta` to the recorded position of the states in range (none moves data). A
    /// state moved below position 0 is dropped, as a K/V cell would be.
    pub fn seq_add(&mut self, s: SeqId, p0: Pos, p1: Pos, delta: Pos) {
        let (p0, p1) = range(p0, p1);
        let mut gone = Vec::new();
        for (&id, x) in self.seqs.iter_mut() {
            if (s < 0 || id == s) && p0 <= x.pos && x.pos < p1 {
                x.pos += delta;
                if x.pos < 0 {
                    gone.push(id);
                }
            }
        }
        for id in gone {
            self.drop_state(id);
        }
    }

    /// Divides the recorded position of the states in range by `d` (> 0).
    pub fn seq_div(&mut self, s: SeqId, p0: Pos, p1: Pos, d: i32) {
        let (p0, p1) = range(p0, p1);
        for (&id, x) in self.seqs.iter_mut() {
            if (s < 0 || id == s) && p0 <= x.pos && x.pos < p1 {
                x.pos /= d;
            }
        }
    }

    pub fn clear(&mut self) {
        let all: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in all {
            self.drop_state(id);
        }
    }

    fn drop_state(&mut self, s: SeqId) {
        if let Some(x) = self.seqs.remove(&s) {
            for &b in x.blocks.iter().rev() {
                let _ = self.pool.release(b);
            }
        }
    }

    /// `n` fresh blocks, or `KvCacheFull` with none taken.
    fn take_blocks(&self, n: usize, out: &mut Vec<BlockId>) -> bool {
        for _ in 0..n {
            match self.pool.allocate_evicting() {
                Some((b, evicted)) => {
                    if let (Some(tag), Some(ix)) = (evicted, &self.index) {
                        ix.forget(b, tag);
                    }
                    out.push(b);
                }
                None => return false,
            }
        }
        true
    }

    /// The pool the states take their blocks from.
    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    /// Fresh blocks [`RecurrentGroup::begin`] would take for a batch of these sequence ids now
    /// (`blocks_per_state` for each distinct sequence without a state or with a shared one),
    /// changing nothing.
    pub fn blocks_for_batch(&self, seq_ids: &[SeqId]) -> usize {
        let mut seen = std::collections::BTreeSet::new();
        let needy = seq_ids
            .iter()
            .filter(|&&s| seen.insert(s))
            .filter(|&&s| self.needs_blocks(s))
            .count();
        needy * self.blocks_per_state
    }

    /// Whether a batch of `s` takes fresh blocks: `s` has no state, or shares it.
    fn needs_blocks(&self, s: SeqId) -> bool {
        match self.seqs.get(&s) {
            None => true,
            Some(x) => x.blocks.iter().any(|&b| self.pool.refcount(b) > 1),
        }
    }

    /// Starts a batch: `seq_ids`/`positions` are the batch's tokens. Takes fresh blocks for
    /// each batch sequence without a state or with a shared one (all or nothing:
    /// `KvCacheFull`, nothing changed) and returns the transaction and every batch sequence's
    /// state, `layout.floats()` values each in the order of `StateTx::seqs` (zeros for a new
    /// sequence).
    pub fn begin(
        &mut self,
        seq_ids: &[SeqId],
        positions: &[Pos],
        storage: &KvStorage,
    ) -> Result<(StateTx, Vec<f32>)> {
        let mut seqs: Vec<SeqId> = Vec::new();
        let mut last_pos: Vec<Pos> = Vec::new();
        for (&s, &p) in seq_ids.iter().zip(positions) {
            match seqs.iter().position(|&x| x == s) {
                Some(i) => last_pos[i] = p,
                None => {
                    seqs.push(s);
                    last_pos.push(p);
                }
            }
        }
        let mut fresh: Vec<Option<Vec<BlockId>>> = Vec::with_capacity(seqs.len());
        let mut taken: Vec<BlockId> = Vec::new();
        let mut ok = true;
        for &s in &seqs {
            if self.needs_blocks(s) {
                let mut bl = Vec::with_capacity(self.blocks_per_state);
                ok = self.take_blocks(self.blocks_per_state, &mut bl);
                taken.extend_from_slice(&bl);
                if !ok {
                    break;
                }
                fresh.push(Some(bl));
            } else {
                fresh.push(None);
            }
        }
        if !ok {
            for &b in taken.iter().rev() {
                let _ = self.pool.release(b);
            }
            return Err(Error::KvCacheFull(format!(
                "KV cache full: no room for the recurrent states of {} sequences ({} blocks each)",
                seqs.len(),
                self.blocks_per_state
            )));
        }
        let n = self.layout.floats();
        let mut states = vec![0.0f32; seqs.len() * n];
        for (i, &s) in seqs.iter().enumerate() {
            if let Some(x) = self.seqs.get(&s) {
                self.load(storage, &x.blocks, &mut states[i * n..(i + 1) * n])?;
            }
        }
        Ok((
            StateTx {
                seqs,
                fresh,
                last_pos,
                pool: Arc::clone(&self.pool),
            },
            states,
        ))
    }

    /// The batch ran: stores `states` and moves each sequence to its (new) blocks.
    /// The batch ran: stores `states` and moves each sequence to its (new) blocks. (A store
    /// that fails leaves the sequences before it committed; the fresh blocks of the rest go
    /// back to the pool with the transaction.)
    pub fn commit(
        &mut self,
        mut tx: StateTx,
        states: &[f32],
        storage: &mut KvStorage,
    ) -> Result<()> {
        let n = self.layout.floats();
        for i in 0..tx.seqs.len() {
            let s = tx.seqs[i];
            let blocks = match &tx.fresh[i] {
                Some(bl) => bl.clone(),
                None => self.seqs[&s].blocks.clone(),
            };
            self.store(storage, &blocks, &states[i * n..(i + 1) * n])?;
            if tx.fresh[i].take().is_some() {
                self.drop_state(s);
                self.seqs.insert(
                    s,
                    Slot {
                        blocks,
                        pos: tx.last_pos[i],
                    },
                );
            } else if let Some(x) = self.seqs.get_mut(&s) {
                x.pos = tx.last_pos[i];
            }
        }
        Ok(())
    }

    /// The batch failed: gives its fresh blocks back (dropping the transaction does);
    /// every state is as before.
    pub fn rollback(&mut self, tx: StateTx) {
        drop(tx);
    }

    fn load(&self, storage: &KvStorage, blocks: &[BlockId], out: &mut [f32]) -> Result<()> {
        let per = self.block_bytes / 4;
        for (chunk, &b) in out.chunks_mut(per).zip(blocks) {
            let raw = storage.block_raw(b)?;
            for (v, bytes) in chunk.iter_mut().zip(raw.chunks_exact(4)) {
                *v = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            }
        }
        Ok(())
    }

    fn store(&self, storage: &mut KvStorage, blocks: &[BlockId], vals: &[f32]) -> Result<()> {
        let per = self.block_bytes / 4;
        for (chunk, &b) in vals.chunks(per).zip(blocks) {
            let raw = storage.block_raw_mut(b)?;
            for (v, bytes) in chunk.iter().zip(raw.chunks_exact_mut(4)) {
                bytes.copy_from_slice(&v.to_le_bytes());
            }
        }
        Ok(())
    }

    /// `s`'s state values (zeros if none), e.g. to save it.
    pub fn read(&self, s: SeqId, storage: &KvStorage) -> Result<Option<(Pos, Vec<f32>)>> {
        let Some(x) = self.seqs.get(&s) else {
            return Ok(None);
        };
        let mut out = vec![0.0f32; self.layout.floats()];
        self.load(storage, &x.blocks, &mut out)?;
        Ok(Some((x.pos, out)))
    }

    /// Gives the empty sequence `s` the state `vals` at position `pos` (fresh blocks;
    /// `KvCacheFull` with nothing changed when the pool has none).
    pub fn write(
        &mut self,
        s: SeqId,
        pos: Pos,
        vals: &[f32],
        storage: &mut KvStorage,
    ) -> Result<()> {
        if vals.len() != self.layout.floats() || s < 0 || self.seqs.contains_key(&s) {
            return Err(Error::InvalidInput(format!(
                "recurrent state write: sequence {s} must be new and the state {} values",
                self.layout.floats()
            )));
        }
        let mut bl = Vec::new();
        if !self.take_blocks(self.blocks_per_state, &mut bl) {
            for &b in bl.iter().rev() {
                let _ = self.pool.release(b);
            }
            return Err(Error::KvCacheFull(
                "KV cache full: no room for a recurrent state".into(),
            ));
        }
        self.store(storage, &bl, vals)?;
        self.seqs.insert(s, Slot { blocks: bl, pos });
        Ok(())
    }

    /// Whether states are checkpointed for prefix reuse (they fit one block).
    pub fn can_checkpoint(&self) -> bool {
        self.blocks_per_state == 1 && self.index.is_some()
    }

    /// Stores `vals` as the checkpoint after the K/V block keyed `kv_key` holding `tokens`:
    /// a fresh block, keyed and released into the pool's cache at once. Skipped (false) when
    /// the pool has no block to spare: a checkpoint never fails a batch.
    pub fn store_checkpoint(
        &self,
        storage: &mut KvStorage,
        model_id: Key,
        kv_key: Key,
        tokens: &[u32],
        vals: &[f32],
    ) -> bool {
        self.store_checkpoint_block(storage, model_id, kv_key, tokens, vals)
            .is_some()
    }

    /// [`RecurrentGroup::store_checkpoint`] that returns the cached block and the checkpoint's
    /// key: its bytes (`storage.block_raw`) stay the checkpoint's as long as the caller holds
    /// the storage lock (for the tiers' write-through).
    pub fn store_checkpoint_block(
        &self,
        storage: &mut KvStorage,
        model_id: Key,
        kv_key: Key,
        tokens: &[u32],
        vals: &[f32],
    ) -> Option<(BlockId, Key)> {
        let ix = self.index.as_ref().filter(|_| self.can_checkpoint())?;
        let mut bl = Vec::new();
        if !self.take_blocks(1, &mut bl) {
            return None;
        }
        let b = bl[0];
        let key = checkpoint_key(model_id, kv_key, tokens);
        let ok = self.store(storage, &bl, vals).is_ok()
            && ix.insert(&self.pool, b, key, kv_key, tokens).is_ok();
        let _ = self.pool.release(b);
        ok.then_some((b, key))
    }

    /// Loads the checkpoint after the K/V block keyed `kv_key` holding `tokens` from a tier
    /// below the pool: `fill` writes the block's bytes as the pool stores them (false: no
    /// valid entry) into a fresh pool block, which is keyed as [`RecurrentGroup::store_checkpoint`]
    /// keys it and released into the cache (the next match finds it in RAM); returns the
    /// state's values. `None` (nothing kept) when the pool has no block to give or `fill`
    /// failed.
    pub fn load_checkpoint(
        &self,
        storage: &mut KvStorage,
        model_id: Key,
        kv_key: Key,
        tokens: &[u32],
        fill: impl FnOnce(&mut [u8]) -> bool,
    ) -> Option<Vec<f32>> {
        let ix = self.index.as_ref().filter(|_| self.can_checkpoint())?;
        let mut bl = Vec::new();
        if !self.take_blocks(1, &mut bl) {
            return None;
        }
        let b = bl[0];
        let key = checkpoint_key(model_id, kv_key, tokens);
        let mut out = vec![0.0f32; self.layout.floats()];
        let ok = storage.block_raw_mut(b).is_ok_and(fill)
            && self.load(storage, &bl, &mut out).is_ok()
            && ix.insert(&self.pool, b, key, kv_key, tokens).is_ok();
        // Released: cached when keyed, else free (a failed read leaves nothing behind).
        let _ = self.pool.release(b);
        ok.then_some(out)
    }

    /// Whether the checkpoint after the K/V block keyed `kv_key` holding `tokens` is cached
    /// in the pool now (changes nothing).
    pub fn has_checkpoint(&self, model_id: Key, kv_key: Key, tokens: &[u32]) -> bool {
        self.index
            .as_ref()
            .filter(|_| self.can_checkpoint())
            .is_some_and(|ix| {
                ix.contains(
                    &self.pool,
                    checkpoint_key(model_id, kv_key, tokens),
                    kv_key,
                    tokens,
                )
            })
    }

    /// The checkpoint after the K/V block keyed `kv_key` holding `tokens`, if still cached.
    pub fn find_checkpoint(
        &self,
        storage: &KvStorage,
        model_id: Key,
        kv_key: Key,
        tokens: &[u32],
    ) -> Option<Vec<f32>> {
        let ix = self.index.as_ref().filter(|_| self.can_checkpoint())?;
        let key = checkpoint_key(model_id, kv_key, tokens);
        let b = ix.lookup(&self.pool, key, kv_key, tokens)?;
        let mut out = vec![0.0f32; self.layout.floats()];
        let ok = self.load(storage, &[b], &mut out).is_ok();
        let _ = self.pool.release(b);
        ok.then_some(out)
    }

    /// Checks the bookkeeping: every state holds `blocks_per_state` distinct referenced
    /// blocks.
    pub fn check(&self) -> std::result::Result<(), String> {
        for (s, x) in &self.seqs {
            if x.blocks.len() != self.blocks_per_state {
                return Err(format!("state of {s} has {} blocks", x.blocks.len()));
            }
            for &b in &x.blocks {
                if self.pool.refcount(b) == 0 {
                    return Err(format!("state of {s} holds unreferenced block {b}"));
                }
            }
        }
        Ok(())
    }
}

impl Drop for RecurrentGroup {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::kv::storage::{KvLayout, KvType};

    fn setup(n_blocks: usize) -> (RecurrentGroup, KvStorage) {
        let layout = KvLayout {
            ty: KvType::F32,
            n_layers: 1,
            kv_dim: 4,
            block_size: 2,
        };
        let storage = KvStorage::new(layout, n_blocks).unwrap();
        let pool = Arc::new(BlockPool::new(n_blocks as u32));
        // 2 layers x 5 values = 40 bytes; a block holds 64: one block per state.
        let st = StateLayout {
            n_layers: 2,
            per_layer: 5,
        };
        let g = RecurrentGroup::new(pool, None, st, storage.block_bytes()).unwrap();
        (g, storage)
    }

    fn step(g: &mut RecurrentGroup, st: &mut KvStorage, seqs: &[SeqId], pos: &[Pos], add: f32) {
        let (tx, mut v) = g.begin(seqs, pos, st).unwrap();
        for x in v.iter_mut() {
            *x += add;
        }
        g.commit(tx, &v, st).unwrap();
        g.check().unwrap();
    }

    #[test]
    fn states_live_in_pool_blocks_and_copy_on_write() {
        let (mut g, mut st) = setup(4);
        assert_eq!(g.blocks_per_state(), 1);
        step(&mut g, &mut st, &[0, 0], &[0, 1], 1.0);
        assert_eq!(g.pool.stats().free, 3);
        assert_eq!(g.read(0, &st).unwrap().unwrap(), (1, vec![1.0; 10]));
        g.seq_cp(0, 1).unwrap();
        assert_eq!(g.pool.stats().free, 3, "shared, not copied");
        step(&mut g, &mut st, &[1], &[2], 5.0);
        assert_eq!(g.pool.stats().free, 2, "copied on write");
        assert_eq!(g.read(0, &st).unwrap().unwrap(), (1, vec![1.0; 10]));
        assert_eq!(g.read(1, &st).unwrap().unwrap(), (2, vec![6.0; 10]));
        g.seq_rm(0, -1, -1);
        g.seq_rm(1, 0, -1);
        assert_eq!(g.pool.stats().free, 4);
        g.pool.audit().unwrap();
    }

    #[test]
    fn partial_removal_fails_and_whole_removal_works() {
        let (mut g, mut st) = setup(4);
        step(&mut g, &mut st, &[3, 3, 3], &[0, 1, 2], 1.0);
        assert!(g.check_rm(3, 1, -1).is_err(), "end of the state");
        assert!(g.check_rm(3, 2, 3).is_err());
        assert!(g.check_rm(-1, 1, -1).is_err());
        g.check_rm(3, 0, 1).unwrap();
        g.seq_rm(3, 0, 1);
        assert_eq!(g.seq_pos(3), 2, "a range before the state leaves it");
        g.check_rm(3, 5, -1).unwrap();
        g.check_rm(3, 0, -1).unwrap();
        g.seq_rm(3, 0, -1);
        assert_eq!(g.seq_pos(3), -1);
        g.check_rm(-1, -1, -1).unwrap();
    }

    #[test]
    fn a_full_pool_fails_the_batch_without_changes() {
        let (mut g, mut st) = setup(2);
        step(&mut g, &mut st, &[0], &[0], 1.0);
        g.seq_cp(0, 1).unwrap();
        // Seq 1 needs a copy, seq 2 a new block: one is free.
        let free = g.pool.stats().free;
        let err = g.begin(&[1, 2], &[1, 0], &st).unwrap_err();
        assert!(matches!(err, Error::KvCacheFull(_)));
        assert_eq!(g.pool.stats().free, free);
        assert_eq!(g.read(1, &st).unwrap().unwrap(), (0, vec![1.0; 10]));
        // A rolled-back batch gives its blocks back.
        let (tx, _) = g.begin(&[1], &[1], &st).unwrap();
        g.rollback(tx);
        assert_eq!(g.pool.stats().free, free);
        g.check().unwrap();
    }

    #[test]
    fn shifts_move_only_the_position() {
        let (mut g, mut st) = setup(4);
        step(&mut g, &mut st, &[0], &[9], 2.0);
        g.seq_add(0, 4, -1, -3);
        assert_eq!(g.seq_pos(0), 6);
        g.seq_div(0, -1, -1, 2);
        assert_eq!(g.seq_pos(0), 3);
        assert_eq!(g.read(0, &st).unwrap().unwrap().1, vec![2.0; 10]);
        g.seq_add(0, -1, -1, -10);
        assert_eq!(g.seq_pos(0), -1, "moved below 0: dropped");
        assert_eq!(g.pool.stats().free, 4);
    }
}
