//! `Memory`: the sequence interface every memory kind implements, after llama.cpp's memory
//! interface, and [`LayerGroups`], a context's memory as one group per layer kind
//! ([`LayerKind`]: full attention, sliding window, recurrent state), which forwards each
//! call to its groups. A full-attention group and a window group are both a [`PagedCache`] over
//! their own `SharedKv`; a window group is pruned after every batch. The recurrent group
//! ([`RecurrentGroup`], LFM2's short convolutions) keeps one state per sequence in blocks of the
//! primary (full-attention) group's pool, and checkpoints for prefix reuse in its index.
//! Each K/V group's memory has its own disk and shared tiers; `commit_kv` returns every
//! group's newly keyed blocks for their write-through, and [`LayerGroups::fetch_remote`] /
//! `match_prefix_staged` fetch and map one staged set per group. The recurrent group's
//! checkpoints go to the primary group's tiers ([`LayerGroups::store_checkpoint`]); a hybrid
//! match resumes at the highest boundary whose checkpoint RAM, disk or the staged set holds,
//! and the fetch brings that checkpoint ([`LayerGroups::fetch_checkpoint`]).
//!
//! Conventions (docs/KV_SEMANTICS.md): negative `p0`/`p1` are open ends; `s < 0` means every
//! sequence where the operation allows it. An operation a memory kind cannot honour (e.g. a
//! partial `seq_rm` of a recurrent state) fails with a clear error and changes nothing.

use std::collections::HashMap;
use std::ops::DerefMut;
use std::sync::Arc;

use super::cache::{PagedCache, SharedKv};
use super::pool::{BlockId, BlockPool};
use super::prefix::{chain_keys, salt_root, Key};
use super::recurrent::{checkpoint_key, RecurrentGroup, StateTx};
use super::remote::Staged;
use super::storage::KvStorage;
use super::table::{BatchTx, Pos, SeqId};
use crate::batch::Batch;
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

/// How one layer keeps what it needs of earlier positions: the memory it needs. Layers of one
/// kind form a memory group ([`Group`]; docs/ARCHITECTURE.md, "Layer groups"). A model's config
/// says which kind each of its layers is (`model::config` re-exports this type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Attention over every earlier position of the sequence.
    Full,
    /// Attention over the last `n` positions only: a query at `p` sees keys at
    /// `p - n + 1 ..= p` (llama.cpp's `LLAMA_SWA_TYPE_STANDARD`).
    Window(usize),
    /// No K/V: a fixed-size recurrent state per sequence (LFM2's short convolutions), kept by
    /// the recurrent group (`kv/recurrent.rs`) in blocks of the full-attention group's pool.
    Recurrent,
}

/// Which memory a layer group is: the kind its layers share (another name of [`LayerKind`]).
pub use self::LayerKind as GroupKind;

/// Block boundaries below the highest one whose state checkpoint a fetch also asks the
/// shared tier for ([`LayerGroups::fetch_checkpoint`]), in the same existence check.
pub const CHECKPOINT_FALLBACKS: usize = 3;

/// A batch planned in every group of a [`LayerGroups`] ([`LayerGroups::begin_batch`]), to
/// commit or roll back in every group.
#[must_use = "a planned batch must be committed or rolled back"]
pub struct PlannedBatch {
    /// Per K/V group, in group order: the batch's cells (one per token) and its transaction.
    pub kv: Vec<(Vec<(BlockId, u16)>, BatchTx)>,
    /// The recurrent group's transaction and the batch sequences' states, `layout.floats()`
    /// values each in the order of `StateTx::seqs`.
    pub rec: Option<(StateTx, Vec<f32>)>,
}

/// One memory group of a context: the layers sharing a memory kind and this context's cache
/// over the group's own K/V memory (`SharedKv`, whose layers are exactly these, in order).
pub struct Group {
    pub kind: GroupKind,
    /// Model layer indices, ascending; the group's storage layer `i` is model layer `layers[i]`.
    pub layers: Vec<usize>,
    pub cache: PagedCache,
}

/// The recurrent group of a hybrid model ([`GroupKind::Recurrent`] layers): one state per
/// sequence, in blocks of the primary group's pool (see `kv/recurrent.rs`).
pub struct RecurrentLayers {
    /// Model layer indices, ascending; the state's layer `i` is model layer `layers[i]`.
    pub layers: Vec<usize>,
    pub state: RecurrentGroup,
}

/// A context's memory as layer groups (llama.cpp's `llama_kv_cache_iswa`, `llama_memory_hybrid`
/// and, with all three kinds, `llama_memory_hybrid_iswa`): each sequence operation is applied to
/// every group; a batch is planned, committed or rolled back in every group together. A model
/// with one kind of layer has one group, and everything reduces to its `PagedCache`.
///
/// Window groups keep a sequence's cells in `[pos_max - window + 1, pos_max]` after each batch
/// ([`LayerGroups::prune_windows`]); the rules are in docs/KV_SEMANTICS.md ("Layer groups").
/// The recurrent group (if any) is checked first by every operation that it could refuse, so a
/// refused operation changes no group (docs/KV_SEMANTICS.md, "Recurrent state").
pub struct LayerGroups {
    groups: Vec<Group>,
    recurrent: Option<RecurrentLayers>,
    /// Model layer -> (group, storage layer within the group); `(usize::MAX, i)` for the
    /// recurrent group's layer `i`.
    slot: Vec<(usize, usize)>,
}

impl LayerGroups {
    /// K/V groups in the order given and the recurrent group; `slot` is derived from their
    /// layer lists (every layer of `0..n_layers` exactly once, else `InvalidInput`).
    pub fn new(groups: Vec<Group>, recurrent: Option<RecurrentLayers>) -> Result<LayerGroups> {
        let n_rec = recurrent.as_ref().map_or(0, |r| r.layers.len());
        let n: usize = groups.iter().map(|g| g.layers.len()).sum::<usize>() + n_rec;
        let mut slot = vec![(usize::MAX, 0); n];
        let mut seen = vec![false; n];
        if let Some(r) = &recurrent {
            for (i, &l) in r.layers.iter().enumerate() {
                if l >= n || seen[l] {
                    return Err(crate::Error::InvalidInput(format!(
                        "layer group: layer {l} is missing or repeated"
                    )));
                }
                seen[l] = true;
                slot[l] = (usize::MAX, i);
            }
        }
        for (gi, g) in groups.iter().enumerate() {
            if g.layers.len() != g.cache.shared().layout().n_layers {
                return Err(crate::Error::InvalidInput(
                    "layer group: storage layers differ from the group's layers".into(),
                ));
            }
            if g.kind == GroupKind::Recurrent {
                return Err(crate::Error::InvalidInput(
                    "layer group: a recurrent group has no K/V cache".into(),
                ));
            }
            for (i, &l) in g.layers.iter().enumerate() {
                if l >= n || seen[l] {
                    return Err(crate::Error::InvalidInput(format!(
                        "layer group: layer {l} is missing or repeated"
                    )));
                }
                seen[l] = true;
                slot[l] = (gi, i);
            }
        }
        if groups.is_empty() {
            return Err(crate::Error::InvalidInput(
                "a memory needs a K/V group".into(),
            ));
        }
        Ok(LayerGroups {
            groups,
            recurrent,
            slot,
        })
    }

    /// The recurrent group of a hybrid model, if any.
    pub fn recurrent(&self) -> Option<&RecurrentGroup> {
        self.recurrent.as_ref().map(|r| &r.state)
    }

    /// Whether the recurrent group (if any) keeps state checkpoints for prefix reuse (then the
    /// tiers store and fetch them too: [`LayerGroups::fetch_remote`]).
    pub fn keeps_checkpoints(&self) -> bool {
        self.recurrent().is_some_and(RecurrentGroup::can_checkpoint)
    }

    /// Stores `vals` as the state checkpoint after the primary group's block `b`, which a
    /// commit just keyed `key` (`Context::decode` after every commit), and writes it through
    /// to the primary group's tiers (a copy taken under `storage`, the primary group's
    /// storage, locked by the caller). Whether it was stored (skipped without a recurrent
    /// group that keeps checkpoints, or with no block to spare).
    pub fn store_checkpoint(
        &self,
        storage: &mut KvStorage,
        b: BlockId,
        key: Key,
        vals: &[f32],
    ) -> bool {
        let Some(r) = self.recurrent() else {
            return false;
        };
        let primary = self.primary();
        let tokens = primary.table().block_tokens(b);
        let model_id = primary.model_id();
        let Some((c, ck)) = r.store_checkpoint_block(storage, model_id, key, tokens, vals) else {
            return false;
        };
        if let Ok(bytes) = storage.block_raw(c) {
            primary.shared().write_through_entry(ck, key, tokens, bytes);
        }
        true
    }

    /// Layers whose memory is the recurrent group (0 without one).
    pub fn n_recurrent_layers(&self) -> usize {
        self.recurrent.as_ref().map_or(0, |r| r.layers.len())
    }

    pub fn recurrent_mut(&mut self) -> Option<&mut RecurrentGroup> {
        self.recurrent.as_mut().map(|r| &mut r.state)
    }

    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    pub fn groups_mut(&mut self) -> &mut [Group] {
        &mut self.groups
    }

    /// (group, storage layer) of model layer `layer`.
    pub fn slot(&self, layer: usize) -> (usize, usize) {
        self.slot[layer]
    }

    /// The group that answers position queries and whose table is the context's primary view:
    /// the first full-attention group, else the first group.
    pub fn primary(&self) -> &PagedCache {
        &self.groups[self.primary_index()].cache
    }

    pub fn primary_mut(&mut self) -> &mut PagedCache {
        let i = self.primary_index();
        &mut self.groups[i].cache
    }

    /// Index of the primary group in [`LayerGroups::groups`] (the recurrent group's pool).
    pub fn primary_index(&self) -> usize {
        self.groups
            .iter()
            .position(|g| g.kind == GroupKind::Full)
            .unwrap_or(0)
    }

    /// Whether any group is a sliding window.
    pub fn has_window(&self) -> bool {
        self.groups
            .iter()
            .any(|g| matches!(g.kind, GroupKind::Window(_)))
    }

    /// Drops from every window group the cells of `seqs` that no later token can see: those
    /// with `pos <= pos_max - window` (positions only grow, `prepare_batch` checks it). Their
    /// blocks go back to the group's pool (cached when keyed, else free) once no sequence
    /// holds them. The sequence keeps its key chain ([`KvTable::prune_front`]), so its later
    /// window blocks are keyed too and a prefix resumes far past the window.
    ///
    /// [`KvTable::prune_front`]: super::table::KvTable::prune_front
    pub fn prune_windows(&mut self, seqs: &[SeqId]) {
        for g in &mut self.groups {
            let GroupKind::Window(w) = g.kind else {
                continue;
            };
            let w = w.min(Pos::MAX as usize) as Pos;
            for &s in seqs {
                let hi = g.cache.table().seq_pos_max(s);
                if hi >= w && g.cache.table().seq_pos_min(s) <= hi - w {
                    g.cache.table_mut().prune_front(s, hi - w + 1);
                }
            }
        }
    }

    /// For a new sequence: maps the longest prefix of `tokens` every group can resume from
    /// (see [`PagedCache::match_prefix`]): full groups match first, window groups then look
    /// for the longest of those prefixes whose window blocks they still have
    /// ([`PagedCache::match_window_prefix`]: at most `⌈window / b⌉ + 1` blocks per resume
    /// point), and groups that matched more than the shortest drop the excess (their blocks
    /// stay cached); docs/KV_SEMANTICS.md, "Layer groups".
    ///
    /// With a recurrent group the sequence must be empty, and the match ends at the longest
    /// prefix that also has a state checkpoint (`kv/recurrent.rs`; in RAM, or in the primary
    /// group's disk tier or staged set, then read, only that one: a failed read moves the
    /// resume down) at which every window group can resume; the sequence gets that state, so
    /// nothing of the prefix is recomputed. Without one it maps nothing (0).
    pub fn match_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        self.match_prefix_staged(seq, tokens, &[])
    }

    /// [`LayerGroups::match_prefix`] that also maps blocks staged from the shared tier:
    /// `staged[i]` for K/V group `i` (group order; missing ones: none), as
    /// [`LayerGroups::fetch_remote`] returns them. With a recurrent group the primary
    /// group's set may also hold the state checkpoint(s) fetched for the prompt.
    pub fn match_prefix_staged(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        staged: &[Staged],
    ) -> Result<usize> {
        if self.recurrent.is_none() {
            return self.match_kv_prefix(seq, tokens, staged);
        }
        if seq < 0 || self.seq_pos_max(seq) >= 0 {
            return Err(crate::Error::InvalidInput(format!(
                "match_prefix: sequence {seq} must be >= 0 and empty"
            )));
        }
        if !self.recurrent().is_some_and(RecurrentGroup::can_checkpoint) {
            return Ok(0);
        }
        let n = self.match_kv_prefix(seq, tokens, staged)?;
        let pi = self.primary_index();
        let primary = self.primary();
        let bs = primary.table().block_size();
        let model_id = primary.model_id();
        let shared = Arc::clone(primary.shared());
        // Checkpoints below the pool: in the primary group's tiers (keys of their own domain).
        let disk = shared.disk().filter(|d| tokens.len() >= d.min_tokens());
        let st = staged.get(pi);
        let mut storage = shared.lock_storage();
        let root = primary.table().root(seq);
        let keys = chain_keys(model_id, root, &tokens[..n], bs);
        let mut found = None;
        let mut from_remote = 0;
        // The highest block boundary with a checkpoint in RAM, on disk or staged at which the
        // window groups can resume; only that checkpoint is read (a failed read: one lower).
        for i in (0..keys.len()).rev() {
            let m = (i + 1) * bs;
            let (kv_key, chunk) = (keys[i], &tokens[i * bs..m]);
            let r = self.recurrent().expect("checked above");
            let ck = checkpoint_key(model_id, kv_key, chunk);
            let in_ram = r.has_checkpoint(model_id, kv_key, chunk);
            let on_disk = disk.as_ref().is_some_and(|d| d.contains(ck));
            let from_st = st.and_then(|s| s.get(ck, kv_key, chunk));
            if !in_ram && !on_disk && from_st.is_none() {
                continue;
            }
            if !self.resume_windows_at(seq, &tokens[..=m], m, staged)? {
                continue;
            }
            let r = self.recurrent().expect("checked above");
            let mut v = None;
            if in_ram {
                v = r.find_checkpoint(&storage, model_id, kv_key, chunk);
                if let (Some(d), true) = (&disk, v.is_some()) {
                    d.touch(&[ck]);
                }
            }
            if let (None, Some(d), true) = (&v, &disk, on_disk) {
                v = r.load_checkpoint(&mut storage, model_id, kv_key, chunk, |out| {
                    d.read(ck, kv_key, chunk, out)
                });
            }
            if let (None, Some(p)) = (&v, from_st) {
                v = r.load_checkpoint(&mut storage, model_id, kv_key, chunk, |out| {
                    out.copy_from_slice(p);
                    true
                });
                from_remote += usize::from(v.is_some());
            }
            if let Some(v) = v {
                found = Some((m, v));
                break;
            }
        }
        if let (Some(r), true) = (shared.remote(), from_remote > 0) {
            r.count_hits(from_remote);
        }
        let Some((m, vals)) = found else {
            self.remove_kv(seq, -1);
            return Ok(0);
        };
        self.remove_kv(seq, m as Pos);
        let r = self.recurrent_mut().expect("checked above");
        if r.write(seq, m as Pos - 1, &vals, &mut storage).is_err() {
            // No block for the state: recompute instead.
            self.remove_kv(seq, -1);
            return Ok(0);
        }
        Ok(m)
    }

    /// Salts the empty sequence `seq` in every group: its blocks' content keys chain from
    /// [`salt_root`]`(salt)` (the empty salt: unsalted), so it shares cached prefixes only
    /// with sequences of the same salt (docs/KV_SEMANTICS.md, "Prefix index"). Kept for the
    /// id until set again (`seq_cp` into an empty sequence copies it; `clear` drops all).
    /// `InvalidInput`, nothing changed, if `seq < 0` or `seq` holds anything.
    pub fn seq_set_salt(&mut self, seq: SeqId, salt: &[u8]) -> Result<()> {
        if seq < 0 || self.seq_pos_max(seq) >= 0 || self.primary().seq_pos_min(seq) >= 0 {
            return Err(crate::Error::InvalidInput(format!(
                "seq_set_salt: sequence {seq} must be >= 0 and empty"
            )));
        }
        let root = salt_root(salt);
        for g in &mut self.groups {
            g.cache.table_mut().set_root(seq, root)?;
        }
        Ok(())
    }

    /// The root key of `seq` (see [`LayerGroups::seq_set_salt`]).
    pub fn seq_root(&self, seq: SeqId) -> Key {
        self.primary().table().root(seq)
    }

    /// Makes every window group of the new sequence `seq` hold the window before position
    /// `m` (a block boundary at most what the full groups matched): as it is when it already
    /// does, else by matching `tokens` (`m + 1` of them) again in that group (RAM, disk, its
    /// set of `staged`), which then holds
    /// the window before the largest point it can resume at. Whether all groups can resume
    /// at `m`.
    fn resume_windows_at(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        m: usize,
        staged: &[Staged],
    ) -> Result<bool> {
        if self.can_resume_at(seq, m as Pos) {
            return Ok(true);
        }
        for (gi, g) in self.groups.iter_mut().enumerate() {
            let GroupKind::Window(w) = g.kind else {
                continue;
            };
            let t = g.cache.table();
            let need = (m as Pos + 1 - w.min(Pos::MAX as usize) as Pos).max(0);
            let lo = t.seq_pos_min(seq);
            if lo >= 0 && lo <= need && t.seq_pos_max(seq) + 1 >= m as Pos {
                continue;
            }
            g.cache.table_mut().seq_rm(seq, -1, -1);
            let st = staged.get(gi);
            if g.cache.match_window_prefix_staged(seq, tokens, w, st)? != m {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// How many tokens of `tokens` [`LayerGroups::match_prefix`] would map now (an estimate
    /// for scheduling, changing nothing): full groups first, then window groups up to that.
    /// A model with a recurrent group also needs a state checkpoint, which this does not
    /// look for: 0.
    pub fn peek_prefix(&self, tokens: &[u32], root: Key) -> usize {
        if self.recurrent.is_some() {
            return 0;
        }
        let mut n = usize::MAX;
        let mut order: Vec<&Group> = self.groups.iter().collect();
        order.sort_by_key(|g| matches!(g.kind, GroupKind::Window(_)));
        for g in order {
            let window = match g.kind {
                GroupKind::Window(w) => Some(w),
                GroupKind::Full | GroupKind::Recurrent => None,
            };
            n = n.min(g.cache.peek_prefix(tokens, root, window, n));
        }
        if n == usize::MAX {
            0
        } else {
            n
        }
    }

    /// Drops `seq`'s K/V cells from position `p0` on (`-1`: all) in every K/V group.
    fn remove_kv(&mut self, seq: SeqId, p0: Pos) {
        for g in &mut self.groups {
            if g.cache.table().seq_pos_max(seq) >= p0.max(0) {
                g.cache.table_mut().seq_rm(seq, p0, -1);
            }
        }
    }

    /// [`LayerGroups::match_prefix`] over the K/V groups only.
    fn match_kv_prefix(&mut self, seq: SeqId, tokens: &[u32], staged: &[Staged]) -> Result<usize> {
        let mut n = usize::MAX;
        // Full groups first: a window group only needs the window before their match.
        let mut order: Vec<usize> = (0..self.groups.len()).collect();
        order.sort_by_key(|&i| matches!(self.groups[i].kind, GroupKind::Window(_)));
        for gi in order {
            if n == 0 {
                break;
            }
            let g = &mut self.groups[gi];
            let part = &tokens[..tokens.len().min(n.saturating_add(1))];
            let st = staged.get(gi);
            let m = match g.kind {
                GroupKind::Window(w) => g.cache.match_window_prefix_staged(seq, part, w, st)?,
                GroupKind::Full | GroupKind::Recurrent => {
                    g.cache.match_prefix_staged(seq, part, st)?
                }
            };
            n = n.min(m);
        }
        let n = if n == usize::MAX { 0 } else { n };
        for g in &mut self.groups {
            if g.cache.table().seq_pos_max(seq) >= n as Pos {
                g.cache.table_mut().seq_rm(seq, n as Pos, -1);
            }
        }
        Ok(n)
    }

    /// Commits a batch planned in every K/V group (`txs` in group order) after its K/V were
    /// written; returns the blocks each group keyed (in group order). The primary group
    /// commits first: the others key no further than its clean prefix of each sequence (their
    /// K/V depend on its layers too, e.g. after a `seq_rm` of positions a window group had
    /// already dropped).
    pub fn commit_kv(&mut self, txs: Vec<BatchTx>, seqs: &[SeqId]) -> Vec<Vec<(BlockId, Key)>> {
        let pi = self.primary_index();
        let mut txs: Vec<Option<BatchTx>> = txs.into_iter().map(Some).collect();
        let p = &mut self.groups[pi].cache;
        let primary = p.commit(txs[pi].take().expect("one batch per group"));
        let t = p.table();
        let limits: HashMap<SeqId, usize> = seqs.iter().map(|&s| (s, t.chain_len(s))).collect();
        let mut keyed: Vec<Vec<(BlockId, Key)>> = Vec::with_capacity(self.groups.len());
        for (g, tx) in self.groups.iter_mut().zip(txs) {
            keyed.push(match tx {
                Some(tx) => g
                    .cache
                    .commit_upto(tx, |s| limits.get(&s).copied().unwrap_or(0)),
                None => Vec::new(),
            });
        }
        keyed[pi] = primary;
        keyed
    }

    /// Fetches from the shared tiers of `groups` (a model's K/V groups in group order: kind
    /// and memory, as [`LayerGroups::groups`] has them) the blocks a match of `tokens` under
    /// the salt root `root` would need beyond what RAM and disk hold, one [`Staged`] per
    /// group for [`LayerGroups::match_prefix_staged`]: a full group its leading run
    /// ([`SharedKv::fetch_remote`]); a window group the window before the point every full
    /// group then reaches ([`SharedKv::fetch_window`]). With `checkpoints` (a hybrid model
    /// whose recurrent group keeps state checkpoints, [`LayerGroups::keeps_checkpoints`]) the
    /// primary group's set also gets the checkpoint at the highest block boundary the K/V
    /// reach (RAM, disk, fetched), else the first of the next [`CHECKPOINT_FALLBACKS`] below
    /// it the store has ([`LayerGroups::fetch_checkpoint`]). Reads only indexes: safe on any
    /// thread while decodes run (the fetch workers call it, never the engine thread).
    pub fn fetch_remote(
        groups: &[(GroupKind, &SharedKv)],
        tokens: &[u32],
        root: Key,
        checkpoints: bool,
    ) -> Vec<Staged> {
        let mut out: Vec<Staged> = groups.iter().map(|_| Staged::default()).collect();
        let mut reach = usize::MAX;
        for (i, (kind, sh)) in groups.iter().enumerate() {
            if matches!(kind, GroupKind::Full) {
                out[i] = sh.fetch_remote(tokens, root);
                reach = reach.min(sh.reachable_blocks(tokens, root, &out[i]));
            }
        }
        let pi = groups
            .iter()
            .position(|(k, _)| matches!(k, GroupKind::Full))
            .unwrap_or(0);
        if let (true, Some((_, sh)), true) = (checkpoints, groups.get(pi), reach != usize::MAX) {
            // A hybrid model resumes at the checkpoint: the windows before it are needed.
            let (ck, at) = Self::fetch_checkpoint(sh, tokens, root, reach);
            out[pi].merge(ck);
            reach = at;
        }
        for (i, (kind, sh)) in groups.iter().enumerate() {
            if let GroupKind::Window(w) = *kind {
                out[i] = sh.fetch_window(tokens, root, w, reach);
            }
        }
        out
    }

    /// The state checkpoint a hybrid model's match of `tokens` (root `root`) would resume from
    /// once the K/V reach `reach` blocks, from the primary memory `sh`'s shared tier: nothing
    /// when RAM or disk has the one at the highest boundary; else the first, from boundary
    /// `reach` down, of the at most [`CHECKPOINT_FALLBACKS`] `+ 1` boundaries above the
    /// highest local checkpoint that the store holds ([`RemoteTier::fetch_first`]: one
    /// existence check, one read). Also returns the block boundary the resume will then be
    /// at (the fetched or local checkpoint's; `reach` when there is none), for the windows.
    ///
    /// [`RemoteTier::fetch_first`]: super::remote::RemoteTier::fetch_first
    pub fn fetch_checkpoint(
        sh: &SharedKv,
        tokens: &[u32],
        root: Key,
        reach: usize,
    ) -> (Staged, usize) {
        let Some(r) = sh.remote() else {
            return (Staged::default(), reach);
        };
        let bs = sh.layout().block_size;
        let reach = reach.min(tokens.len().saturating_sub(1) / bs);
        let model_id = sh.model_id();
        let keys = chain_keys(model_id, root, &tokens[..reach * bs], bs);
        let disk = sh.disk().filter(|d| tokens.len() >= d.min_tokens());
        let mut cands = Vec::new();
        let mut at = reach;
        for i in (0..reach).rev().take(CHECKPOINT_FALLBACKS + 1) {
            let (kv_key, chunk) = (keys[i], &tokens[i * bs..(i + 1) * bs]);
            let ck = checkpoint_key(model_id, kv_key, chunk);
            if sh.index().contains(sh.pool(), ck, kv_key, chunk)
                || disk.as_ref().is_some_and(|d| d.contains(ck))
            {
                at = i + 1;
                break;
            }
            cands.push((ck, kv_key, chunk));
        }
        let staged = r.fetch_first(&cands, tokens.len());
        let got = cands
            .iter()
            .position(|&(ck, kv_key, chunk)| staged.get(ck, kv_key, chunk).is_some());
        if let Some(j) = got {
            at = reach - j;
        }
        (staged, at)
    }

    /// Rolls back a batch planned in every K/V group (`txs` in group order).
    pub fn rollback_kv(&mut self, txs: Vec<BatchTx>) {
        for (g, tx) in self.groups.iter_mut().zip(txs) {
            g.cache.rollback(tx);
        }
    }

    /// Plans `batch` in every K/V group (`storages[i]`: group `i`'s storage, locked by the
    /// caller) and begins the recurrent group's transaction (its states live in the primary
    /// group's storage), as `Context::decode` does before its forward pass. All or nothing:
    /// `KvCacheFull` or `InvalidInput` with every group as before; else the plan, which the
    /// caller commits ([`LayerGroups::commit_kv`] and `RecurrentGroup::commit`) or rolls back
    /// ([`LayerGroups::rollback_kv`] and `RecurrentGroup::rollback`).
    /// [`LayerGroups::blocks_short`] says beforehand whether it fails for want of blocks.
    pub fn begin_batch<S: DerefMut<Target = KvStorage>>(
        &mut self,
        batch: &Batch,
        storages: &mut [S],
    ) -> Result<PlannedBatch> {
        let mut kv = Vec::with_capacity(self.groups.len());
        for (g, storage) in self.groups.iter_mut().zip(storages.iter_mut()) {
            match g.cache.begin_batch(batch, storage) {
                Ok(p) => kv.push(p),
                Err(e) => {
                    self.rollback_kv(kv.into_iter().map(|(_, tx)| tx).collect());
                    return Err(e);
                }
            }
        }
        let pi = self.primary_index();
        let begun = self.recurrent.as_mut().map(|r| {
            r.state
                .begin(&batch.seq_ids, &batch.positions, &storages[pi])
        });
        let rec = match begun {
            None => None,
            Some(Ok(x)) => Some(x),
            Some(Err(e)) => {
                self.rollback_kv(kv.into_iter().map(|(_, tx)| tx).collect());
                return Err(e);
            }
        };
        Ok(PlannedBatch { kv, rec })
    }

    /// Asks before decoding: how many blocks a batch of these sequence ids and positions would
    /// be short of if it were planned now ([`LayerGroups::begin_batch`]), changing nothing.
    /// `0`: the plan takes no more blocks than any pool has free or cached (evictable), so it
    /// does not fail with `KvCacheFull`; else the largest number of blocks missing in any
    /// group's pool. Every group counts: each K/V group's new blocks and its copies of partly
    /// filled tails that are shared or keyed (copy-on-write), and the recurrent group's fresh
    /// state blocks for new or shared states, which come from the primary group's pool (with
    /// that group's blocks). A group whose context token limit (`n_ctx`) the batch would
    /// exceed counts the excess as `⌈tokens over / block size⌉` blocks short. The answer is
    /// exact (the same counts the plan reserves), for the state it is asked in: another
    /// context of the model that allocates in between can make a batch that fitted fail.
    /// `InvalidInput` when the plan would reject the batch as malformed.
    pub fn blocks_short(&self, seq_ids: &[SeqId], positions: &[Pos]) -> Result<usize> {
        // The blocks the batch takes from each pool, then summed per distinct pool.
        let mut takes: Vec<(&Arc<BlockPool>, usize)> = Vec::new();
        let mut short = 0;
        for g in &self.groups {
            let need = g.cache.batch_need(seq_ids, positions)?;
            let t = g.cache.table();
            short = short.max(need.tokens_over.div_ceil(t.block_size()));
            takes.push((t.pool(), need.blocks));
        }
        if let Some(r) = &self.recurrent {
            takes.push((r.state.pool(), r.state.blocks_for_batch(seq_ids)));
        }
        let mut pools: Vec<(&Arc<BlockPool>, usize)> = Vec::new();
        for (pool, n) in takes {
            match pools.iter_mut().find(|(p, _)| Arc::ptr_eq(p, pool)) {
                Some((_, m)) => *m += n,
                None => pools.push((pool, n)),
            }
        }
        for (pool, n) in pools {
            short = short.max(n.saturating_sub(pool.available()));
        }
        Ok(short)
    }

    /// Tokens stored, summed over groups' primary view (the primary group's count).
    pub fn n_cells(&self) -> usize {
        self.primary().n_cells()
    }
}

impl LayerGroups {
    /// Whether `s` can continue at position `p` after `seq_rm(s, p, -1)`: every window group
    /// still holds the cells of `s` that a token at `p` sees, `[p - window + 1, p)`, wherever
    /// the primary group holds them (a window group cannot bring back cells it dropped).
    pub fn can_resume_at(&self, s: SeqId, p: Pos) -> bool {
        let full = self.primary().table();
        let full_lo = full.seq_pos_min(s);
        if s < 0 || p <= 0 || full_lo < 0 || full_lo >= p {
            return true;
        }
        self.groups.iter().all(|g| match g.kind {
            GroupKind::Full | GroupKind::Recurrent => true,
            GroupKind::Window(w) => {
                let need = (p - (w.min(Pos::MAX as usize) as Pos) + 1).max(full_lo);
                let lo = g.cache.table().seq_pos_min(s);
                need >= p || (lo >= 0 && lo <= need)
            }
        })
    }
}

impl Memory for LayerGroups {
    /// Removes the range in every group. Removing a tail `[p0, +inf)` of one sequence whose
    /// window group already dropped cells a token at `p0` would see fails with `InvalidInput`
    /// and changes nothing ([`LayerGroups::can_resume_at`]; the caller removes the whole
    /// sequence and recomputes, as llama.cpp's server re-processes the prompt).
    ///
    /// A recurrent group refuses (`InvalidInput`, nothing changed) a range that would cut a
    /// state short: one that holds its position but starts after 0 (llama.cpp's rule).
    fn seq_rm(&mut self, s: SeqId, p0: Pos, p1: Pos) -> Result<()> {
        if let Some(r) = &self.recurrent {
            r.state.check_rm(s, p0, p1)?;
        }
        if s >= 0 && p1 < 0 && p0 > 0 && p0 <= self.seq_pos_max(s) && !self.can_resume_at(s, p0) {
            return Err(crate::Error::InvalidInput(format!(
                "seq_rm: sequence {s} cannot continue at position {p0}: its sliding-window \
                 layers no longer hold the positions before it (remove the whole sequence and \
                 recompute)"
            )));
        }
        if let Some(r) = &mut self.recurrent {
            r.state.seq_rm(s, p0, p1);
        }
        for g in &mut self.groups {
            g.cache.seq_rm(s, p0, p1)?;
        }
        Ok(())
    }

    /// Copies in every group. A window group copies what it holds of the range (a pruned
    /// source has no cells before its window). `dst` shares `src`'s recurrent state whatever
    /// the range (copy-on-write), as in llama.cpp.
    fn seq_cp(&mut self, src: SeqId, dst: SeqId, p0: Pos, p1: Pos) -> Result<()> {
        for g in &mut self.groups {
            g.cache.seq_cp(src, dst, p0, p1)?;
        }
        if let Some(r) = &mut self.recurrent {
            r.state.seq_cp(src, dst)?;
        }
        Ok(())
    }

    fn seq_keep(&mut self, s: SeqId) -> Result<()> {
        for g in &mut self.groups {
            g.cache.seq_keep(s)?;
        }
        if let Some(r) = &mut self.recurrent {
            r.state.seq_keep(s);
        }
        Ok(())
    }

    /// Shifts every group. Only a one-sequence shift can fail (`KvCacheFull`: a shared cell
    /// needs a private copy); the groups already shifted are then shifted back by `-delta`,
    /// which restores them exactly when the target range held no other cells of `s` and no
    /// cell fell below position 0 (a context shift's `seq_add` after its `seq_rm`).
    fn seq_add(&mut self, s: SeqId, p0: Pos, p1: Pos, delta: Pos) -> Result<()> {
        for i in 0..self.groups.len() {
            if let Err(e) = self.groups[i].cache.seq_add(s, p0, p1, delta) {
                // Undo the groups already shifted: the inverse shift of the moved range.
                for g in &mut self.groups[..i] {
                    let (q0, q1) = (
                        if p0 < 0 { p0 } else { p0 + delta },
                        if p1 < 0 { p1 } else { p1 + delta },
                    );
                    let _ = g.cache.seq_add(s, q0, q1, -delta);
                }
                return Err(e);
            }
        }
        // A state's values do not depend on positions: only its recorded position moves.
        if let Some(r) = &mut self.recurrent {
            r.state.seq_add(s, p0, p1, delta);
        }
        Ok(())
    }

    fn seq_div(&mut self, s: SeqId, p0: Pos, p1: Pos, d: i32) -> Result<()> {
        for g in &mut self.groups {
            g.cache.seq_div(s, p0, p1, d)?;
        }
        if let Some(r) = &mut self.recurrent {
            r.state.seq_div(s, p0, p1, d);
        }
        Ok(())
    }

    /// As llama.cpp's hybrid memory: the larger of the primary group's and the state's.
    fn seq_pos_min(&self, s: SeqId) -> Pos {
        let a = self.primary().seq_pos_min(s);
        self.recurrent().map_or(a, |r| a.max(r.seq_pos(s)))
    }

    fn seq_pos_max(&self, s: SeqId) -> Pos {
        let a = self.primary().seq_pos_max(s);
        self.recurrent().map_or(a, |r| a.max(r.seq_pos(s)))
    }

    fn clear(&mut self) {
        for g in &mut self.groups {
            g.cache.clear();
        }
        if let Some(r) = &mut self.recurrent {
            r.state.clear();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::batch::Batch;
    use crate::kv::recurrent::StateLayout;
    use crate::kv::storage::{KvLayout, KvType};
    use crate::kv::{SharedKv, ROOT_KEY};
    use crate::ops::{Rope, RopeScaling};

    const BS: usize = 16;

    fn shared(id: u128) -> Arc<SharedKv> {
        shared_n(id, 64)
    }

    /// A one-layer K/V memory of `n` blocks.
    fn shared_n(id: u128, n: usize) -> Arc<SharedKv> {
        let layout = KvLayout {
            ty: KvType::F32,
            n_layers: 1,
            kv_dim: 8,
            block_size: BS,
        };
        let rope = Rope {
            n_rot: 8,
            neox: true,
            freq_base: 10000.0,
            scaling: RopeScaling::None,
            freq_factors: None,
        };
        Arc::new(SharedKv::new(layout, 8, rope, n, id).unwrap())
    }

    /// Layers 0 full, 1 window of 20, 2 recurrent (llama.cpp's hybrid + ISWA composition).
    fn memory() -> LayerGroups {
        memory_over(&shared(1), &shared(2), true)
    }

    /// One context's memory over the full and window memories `full` and `win`: layer 0 full,
    /// 1 a window of 20, and (`rec`) 2 recurrent, its states in `full`'s pool.
    fn memory_over(full: &Arc<SharedKv>, win: &Arc<SharedKv>, rec: bool) -> LayerGroups {
        let recurrent = rec.then(|| {
            let state = RecurrentGroup::new(
                Arc::clone(full.pool()),
                Some(Arc::clone(full.index())),
                StateLayout {
                    n_layers: 1,
                    per_layer: 16,
                },
                full.layout().bytes_per_block(),
            )
            .unwrap();
            RecurrentLayers {
                layers: vec![2],
                state,
            }
        });
        let group = |kind, layer, sh: &Arc<SharedKv>| Group {
            kind,
            layers: vec![layer],
            cache: PagedCache::new(Arc::clone(sh), 4096).unwrap(),
        };
        LayerGroups::new(
            vec![
                group(LayerKind::Full, 0, full),
                group(LayerKind::Window(20), 1, win),
            ],
            recurrent,
        )
        .unwrap()
    }

    /// Plans `batch` in every group as `Context::decode` does ([`LayerGroups::begin_batch`])
    /// and, if that worked, commits it without a forward pass (the states keep their values),
    /// then prunes the windows.
    fn try_run(m: &mut LayerGroups, batch: &Batch) -> Result<()> {
        let shared: Vec<_> = m
            .groups()
            .iter()
            .map(|g| Arc::clone(g.cache.shared()))
            .collect();
        let mut storages: Vec<_> = shared.iter().map(|s| s.lock_storage()).collect();
        let PlannedBatch { kv, rec } = m.begin_batch(batch, &mut storages)?;
        let pi = m.primary_index();
        if let Some((tx, states)) = rec {
            let r = m.recurrent_mut().unwrap();
            r.commit(tx, &states, &mut storages[pi]).unwrap();
        }
        let mut seqs = batch.seq_ids.clone();
        seqs.sort_unstable();
        seqs.dedup();
        let keyed = m.commit_kv(kv.into_iter().map(|(_, tx)| tx).collect(), &seqs);
        // Write-through to each group's tiers, as `Context::decode` does.
        for ((g, st), k) in m.groups().iter().zip(&storages).zip(&keyed) {
            g.cache.write_through(st, k);
        }
        drop(storages);
        m.prune_windows(&seqs);
        Ok(())
    }

    /// Commits a batch of `n` tokens from `pos0` of `seq` in every group (see [`try_run`]).
    fn run(m: &mut LayerGroups, seq: SeqId, pos0: Pos, n: usize) {
        let toks: Vec<u32> = (0..n as u32).collect();
        try_run(m, &Batch::prompt(&toks, pos0, seq)).unwrap();
    }

    fn snapshot(m: &LayerGroups) -> Vec<(Pos, Pos, usize, usize)> {
        let mut out: Vec<_> = m
            .groups()
            .iter()
            .map(|g| {
                let t = g.cache.table();
                (
                    t.seq_pos_min(0),
                    t.seq_pos_max(0),
                    t.stats().live_cells,
                    t.stats().sequences,
                )
            })
            .collect();
        let r = m.recurrent().unwrap();
        out.push((
            r.seq_pos(0),
            r.seq_pos(1),
            r.n_states(),
            r.blocks_per_state(),
        ));
        out
    }

    #[test]
    fn hybrid_rules_hold_across_full_window_and_recurrent_groups() {
        let mut m = memory();
        assert_eq!(m.slot(2), (usize::MAX, 0));
        run(&mut m, 0, 0, 40);
        // As llama.cpp's hybrid memory: the minimum is the larger of the groups' (the state
        // holds only its last position).
        assert_eq!((m.seq_pos_min(0), m.seq_pos_max(0)), (39, 39));
        let before = snapshot(&m);
        // A partial removal that would cut the state: refused, no group changes (the window
        // group would refuse [25, +inf) too; [39, 40) only the state refuses).
        for (p0, p1) in [(25, -1), (39, 40), (1, -1)] {
            let err = m.seq_rm(0, p0, p1).unwrap_err();
            assert!(err.to_string().contains("recurrent state"), "{err}");
            assert_eq!(snapshot(&m), before, "seq_rm({p0}, {p1}) changed something");
        }
        assert!(m.seq_rm(-1, 5, -1).is_err());
        assert_eq!(snapshot(&m), before);
        // Older positions go (a context shift's removal); the state stays.
        m.seq_rm(0, 0, 8).unwrap();
        assert_eq!(m.groups()[0].cache.table().seq_pos_min(0), 8);
        assert_eq!(m.recurrent().unwrap().seq_pos(0), 39);
        // Shifts move the K/V and the state's recorded position only.
        m.seq_add(0, 8, -1, -8).unwrap();
        assert_eq!(m.seq_pos_max(0), 31);
        assert_eq!(m.recurrent().unwrap().seq_pos(0), 31);
        // seq_cp shares the state; whole removal frees every group.
        m.seq_cp(0, 1, -1, -1).unwrap();
        assert_eq!(m.recurrent().unwrap().seq_pos(1), 31);
        let full = Arc::clone(m.groups()[0].cache.shared());
        m.seq_rm(0, 0, -1).unwrap();
        m.seq_rm(1, -1, -1).unwrap();
        assert_eq!(m.recurrent().unwrap().n_states(), 0);
        for g in m.groups() {
            assert_eq!(g.cache.table().stats().live_cells, 0);
            g.cache.table().check().unwrap();
        }
        assert_eq!(full.pool_stats().referenced, 0);
        m.recurrent().unwrap().check().unwrap();
    }

    fn keyed_blocks(g: &Group) -> usize {
        let pool = g.cache.shared().pool();
        (0..pool.total() as BlockId)
            .filter(|&b| pool.key(b) != crate::kv::NO_KEY)
            .count()
    }

    /// A window group keys past its pruned front only as far as the full group's clean
    /// prefix: once a `seq_rm` of old positions (which the window group had already dropped)
    /// changes what later tokens see, neither group keys anything more.
    #[test]
    fn window_keys_stop_where_the_full_group_s_stop() {
        let mut m = memory();
        run(&mut m, 0, 0, 64);
        let win = &m.groups()[1];
        assert_eq!(
            win.cache.table().seq_pos_min(0),
            44,
            "window 20 pruned the front"
        );
        assert_eq!(keyed_blocks(win), 4, "and kept keying");
        run(&mut m, 0, 64, 16);
        assert_eq!(
            (keyed_blocks(&m.groups()[0]), keyed_blocks(&m.groups()[1])),
            (5, 5)
        );
        m.seq_rm(0, 0, 16).unwrap();
        run(&mut m, 0, 80, 32);
        assert_eq!(
            (keyed_blocks(&m.groups()[0]), keyed_blocks(&m.groups()[1])),
            (5, 5)
        );
        for g in m.groups() {
            g.cache.table().check().unwrap();
        }
    }

    /// Full and window groups each with their own disk tier and shared tier (under their own
    /// model ids): after RAM evicted a prompt, the full group reads its whole prefix back and
    /// the window group only the window before the resume point, from disk; another memory
    /// (another replica) fetches the same from the store, one staged set per group.
    #[test]
    fn window_groups_resume_from_their_tiers() {
        let dir = std::env::temp_dir().join(format!("kvserve-memory-{}-tiers", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let redis = crate::kv::remote::test_server::RedisServer::start();
        let attach = |sh: &Arc<SharedKv>| {
            let l = *sh.layout();
            let o = crate::kv::DiskOptions::with_size(1 << 30);
            let d = crate::kv::DiskTier::open(&dir, sh.model_id(), BS, l.bytes_per_block(), o);
            sh.set_disk(Some(d.unwrap())).unwrap();
            let r = crate::kv::RemoteTier::open(
                &redis.url(),
                sh.model_id(),
                BS,
                l.bytes_per_block(),
                Default::default(),
            );
            sh.set_remote(Some(r.unwrap())).unwrap();
        };
        let (full, win) = (shared_n(1, 40), shared_n(2, 24));
        attach(&full);
        attach(&win);
        let mut m = memory_over(&full, &win, false);
        run(&mut m, 0, 0, 80);
        m.seq_rm(0, -1, -1).unwrap();
        for sh in [&full, &win] {
            sh.disk().unwrap().flush();
            sh.remote().unwrap().flush();
            assert_eq!(
                sh.disk().unwrap().stats().entries,
                5,
                "every keyed block, each group"
            );
        }
        // Another prompt of 40 blocks evicts the first from both pools.
        let junk: Vec<u32> = (1000..1000 + 40 * BS as u32).collect();
        for (i, part) in junk.chunks(BS).enumerate() {
            try_run(&mut m, &Batch::prompt(part, (i * BS) as Pos, 1)).unwrap();
        }
        m.seq_rm(1, -1, -1).unwrap();
        assert!(full.pool_stats().evicted >= 5 && win.pool_stats().evicted >= 5);
        let mut q: Vec<u32> = (0..80).collect();
        q.push(7);
        assert_eq!(m.peek_prefix(&q, ROOT_KEY), 80);
        assert_eq!(m.match_prefix(2, &q).unwrap(), 80);
        let w = m.groups()[1].cache.table();
        // A token at 80 sees 61..79: blocks 3 and 4 of the window group.
        assert_eq!((w.seq_pos_min(2), w.seq_pos_max(2)), (48, 79));
        assert_eq!(m.groups()[0].cache.table().seq_pos_max(2), 79);
        let hits = |sh: &Arc<SharedKv>| sh.disk().unwrap().stats().hit_blocks;
        assert_eq!(
            (hits(&full), hits(&win)),
            (5, 2),
            "the window group reads its window only"
        );
        run(&mut m, 2, 80, 1);
        audit(&m);
        m.seq_rm(2, -1, -1).unwrap();
        // Another replica: its own memories, the same model ids, no disk.
        let (full2, win2) = (shared_n(1, 40), shared_n(2, 24));
        for sh in [&full2, &win2] {
            let r = crate::kv::RemoteTier::open(
                &redis.url(),
                sh.model_id(),
                BS,
                sh.layout().bytes_per_block(),
                Default::default(),
            );
            sh.set_remote(Some(r.unwrap())).unwrap();
        }
        let mut m2 = memory_over(&full2, &win2, false);
        let groups = [
            (LayerKind::Full, full2.as_ref()),
            (LayerKind::Window(20), win2.as_ref()),
        ];
        let staged = LayerGroups::fetch_remote(&groups, &q, ROOT_KEY, false);
        assert_eq!((staged[0].len(), staged[1].len()), (5, 2));
        // Under another salt there is nothing to fetch.
        let other = LayerGroups::fetch_remote(&groups, &q, salt_root(b"tenant b"), false);
        assert!(other.iter().all(Staged::is_empty));
        assert_eq!(m2.match_prefix_staged(0, &q, &staged).unwrap(), 80);
        let w = m2.groups()[1].cache.table();
        assert_eq!((w.seq_pos_min(0), w.seq_pos_max(0)), (48, 79));
        let rhits = |sh: &Arc<SharedKv>| sh.remote().unwrap().stats().hit_blocks;
        assert_eq!((rhits(&full2), rhits(&win2)), (5, 2));
        audit(&m2);
        drop((m, m2, full, win));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A hybrid + window sequence resumes from a state checkpoint below the longest K/V match:
    /// the window group, which mapped only the window before that match, maps the window
    /// before the checkpoint instead.
    #[test]
    fn hybrid_resumes_at_an_earlier_checkpoint_with_its_window() {
        let mut m = memory();
        run(&mut m, 0, 0, 80);
        let toks: Vec<u32> = (0..80).collect();
        let pi = m.primary_index();
        let full = Arc::clone(m.groups()[pi].cache.shared());
        let id = m.groups()[pi].cache.model_id();
        let keys = chain_keys(id, crate::kv::ROOT_KEY, &toks, BS);
        // A checkpoint after block 2 only (positions 0..48).
        let vals: Vec<f32> = (0..16).map(|i| i as f32 * 0.5).collect();
        let r = m.recurrent().unwrap();
        assert!(r.store_checkpoint(&mut full.lock_storage(), id, keys[2], &toks[32..48], &vals));
        m.seq_rm(0, -1, -1).unwrap();
        let mut q = toks.clone();
        q.push(7);
        assert_eq!(m.match_prefix(1, &q).unwrap(), 48);
        let win = m.groups()[1].cache.table();
        assert_eq!((win.seq_pos_min(1), win.seq_pos_max(1)), (16, 47));
        assert_eq!(m.groups()[0].cache.table().seq_pos_max(1), 47);
        let (pos, got) = m
            .recurrent()
            .unwrap()
            .read(1, &full.lock_storage())
            .unwrap()
            .unwrap();
        assert_eq!((pos, got), (47, vals));
        for g in m.groups() {
            g.cache.table().check().unwrap();
        }
    }

    /// Attaches a disk tier under `dir` (if any) and a shared tier at `url` (if any) to `sh`.
    fn attach_tiers(sh: &Arc<SharedKv>, dir: Option<&std::path::Path>, url: Option<&str>) {
        let bpb = sh.layout().bytes_per_block();
        if let Some(dir) = dir {
            let o = crate::kv::DiskOptions::with_size(1 << 30);
            let d = crate::kv::DiskTier::open(dir, sh.model_id(), BS, bpb, o).unwrap();
            sh.set_disk(Some(d)).unwrap();
        }
        if let Some(url) = url {
            let r = crate::kv::RemoteTier::open(url, sh.model_id(), BS, bpb, Default::default());
            sh.set_remote(Some(r.unwrap())).unwrap();
        }
    }

    /// The state checkpoint values this test stores after block `i` (distinct per block, and
    /// not round numbers, so a bit-for-bit comparison means something).
    fn ckpt_vals(i: usize) -> Vec<f32> {
        (0..16).map(|j| (i * 16 + j) as f32 * 0.37 - 1.1).collect()
    }

    /// Decodes `n` tokens `0..n` into `seq` of the hybrid memory `m` and stores a checkpoint
    /// ([`ckpt_vals`]) after every block the commit keyed, as `Context::decode` does (and so
    /// writes each through to the primary group's tiers); then removes the sequence.
    fn run_with_checkpoints(m: &mut LayerGroups, seq: SeqId, n: usize) {
        run(m, seq, 0, n);
        let pi = m.primary_index();
        let full = Arc::clone(m.groups()[pi].cache.shared());
        let t = m.groups()[pi].cache.table();
        let toks: Vec<u32> = (0..n as u32).collect();
        let keys = chain_keys(full.model_id(), ROOT_KEY, &toks, BS);
        let blocks: Vec<BlockId> = (0..keys.len()).map(|i| t.cells(seq)[i * BS].1).collect();
        let mut st = full.lock_storage();
        for (i, (&b, &key)) in blocks.iter().zip(&keys).enumerate() {
            assert!(m.store_checkpoint(&mut st, b, key, &ckpt_vals(i)));
        }
        drop(st);
        m.seq_rm(seq, -1, -1).unwrap();
    }

    /// Fills both pools of `m` with another prompt (sequence `seq`), so every
    /// earlier block and checkpoint is evicted from RAM.
    fn evict_all(m: &mut LayerGroups, seq: SeqId) {
        // 39 blocks and the sequence's state: the whole pool of 40.
        let junk: Vec<u32> = (1000..1000 + 39 * BS as u32).collect();
        for (i, part) in junk.chunks(BS).enumerate() {
            try_run(m, &Batch::prompt(part, (i * BS) as Pos, seq)).unwrap();
        }
        m.seq_rm(seq, -1, -1).unwrap();
    }

    /// The state `seq` resumed with, compared bit for bit.
    fn state_bits(m: &LayerGroups, seq: SeqId) -> (Pos, Vec<u32>) {
        let full = Arc::clone(m.primary().shared());
        let (pos, v) = m
            .recurrent()
            .unwrap()
            .read(seq, &full.lock_storage())
            .unwrap()
            .unwrap();
        (pos, v.iter().map(|x| x.to_bits()).collect())
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Hybrid (full + window + recurrent) with disk tiers: the checkpoints written through
    /// come back from disk bit for bit once RAM evicted them, and the resume lands at the
    /// highest boundary; a damaged or missing checkpoint entry moves it down, never giving a
    /// wrong state.
    #[test]
    fn hybrid_checkpoints_come_back_from_disk() {
        let dir = std::env::temp_dir().join(format!("kvserve-memory-{}-ckpt", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (full, win) = (shared_n(1, 40), shared_n(2, 24));
        attach_tiers(&full, Some(&dir), None);
        attach_tiers(&win, Some(&dir), None);
        let mut m = memory_over(&full, &win, true);
        run_with_checkpoints(&mut m, 0, 80);
        full.disk().unwrap().flush();
        win.disk().unwrap().flush();
        // 5 K/V blocks and 5 checkpoints in the full group's tier.
        assert_eq!(full.disk().unwrap().stats().entries, 10);
        assert_eq!(win.disk().unwrap().stats().entries, 5);
        let toks: Vec<u32> = (0..80).collect();
        let id = full.model_id();
        let keys = chain_keys(id, ROOT_KEY, &toks, BS);
        let ck = |i: usize| checkpoint_key(id, keys[i], &toks[i * BS..(i + 1) * BS]);
        evict_all(&mut m, 1);
        let r = m.recurrent().unwrap();
        assert!((0..5).all(|i| !r.has_checkpoint(id, keys[i], &toks[i * BS..(i + 1) * BS])));
        let mut q = toks.clone();
        q.push(7);
        assert_eq!(m.match_prefix(2, &q).unwrap(), 80);
        assert_eq!(state_bits(&m, 2), (79, bits(&ckpt_vals(4))));
        // 5 K/V blocks and only the one checkpoint chosen.
        assert_eq!(full.disk().unwrap().stats().hit_blocks, 6);
        audit(&m);
        m.seq_rm(2, -1, -1).unwrap();
        // Now in RAM again: no further disk read.
        assert_eq!(m.match_prefix(3, &q).unwrap(), 80);
        assert_eq!(state_bits(&m, 3), (79, bits(&ckpt_vals(4))));
        assert_eq!(full.disk().unwrap().stats().hit_blocks, 6);
        m.seq_rm(3, -1, -1).unwrap();

        // Damage checkpoint 4's entry (a payload byte) and delete checkpoint 3's file: the
        // resume moves down to block 2's boundary, with its state.
        evict_all(&mut m, 1);
        let sub = dir.join(format!("{id:032x}"));
        let p4 = sub.join(format!("{:032x}.kvb", ck(4)));
        let mut bytes = std::fs::read(&p4).unwrap();
        let at = bytes.len() - 40;
        bytes[at] ^= 0x10;
        std::fs::write(&p4, &bytes).unwrap();
        std::fs::remove_file(sub.join(format!("{:032x}.kvb", ck(3)))).unwrap();
        let removed = full.disk().unwrap().stats().removed;
        assert_eq!(m.match_prefix(4, &q).unwrap(), 48);
        assert_eq!(state_bits(&m, 4), (47, bits(&ckpt_vals(2))));
        for g in m.groups() {
            assert_eq!(g.cache.table().seq_pos_max(4), 47);
        }
        assert_eq!(full.disk().unwrap().stats().removed, removed + 2);
        audit(&m);
        m.seq_rm(4, -1, -1).unwrap();
        drop((m, full, win));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A replica with only the shared tier fetches the K/V run and the checkpoint at its end
    /// (one existence check for it and a few below), and resumes there bit for bit; without
    /// that checkpoint in the store it fetches the next one down and resumes there.
    #[test]
    fn hybrid_checkpoints_are_fetched_from_the_shared_tier() {
        let redis = crate::kv::remote::test_server::RedisServer::start();
        let url = redis.url();
        let (full, win) = (shared_n(1, 40), shared_n(2, 24));
        attach_tiers(&full, None, Some(&url));
        attach_tiers(&win, None, Some(&url));
        let mut m = memory_over(&full, &win, true);
        run_with_checkpoints(&mut m, 0, 80);
        full.remote().unwrap().flush();
        win.remote().unwrap().flush();
        assert_eq!(full.remote().unwrap().stats().writes, 10);
        let toks: Vec<u32> = (0..80).collect();
        let mut q = toks.clone();
        q.push(7);
        // Another replica: its own memories, the same model ids.
        let replica = || {
            let (f, w) = (shared_n(1, 40), shared_n(2, 24));
            attach_tiers(&f, None, Some(&url));
            attach_tiers(&w, None, Some(&url));
            (f, w)
        };
        let (full2, win2) = replica();
        let mut m2 = memory_over(&full2, &win2, true);
        assert!(m2.keeps_checkpoints());
        let groups = [
            (LayerKind::Full, full2.as_ref()),
            (LayerKind::Window(20), win2.as_ref()),
        ];
        // Without checkpoints asked for, only K/V (a match of it resumes nowhere).
        let kv_only = LayerGroups::fetch_remote(&groups, &q, ROOT_KEY, false);
        assert_eq!((kv_only[0].len(), kv_only[1].len()), (5, 2));
        drop(kv_only);
        let staged = LayerGroups::fetch_remote(&groups, &q, ROOT_KEY, true);
        assert_eq!((staged[0].len(), staged[1].len()), (6, 2));
        assert_eq!(m2.match_prefix_staged(0, &q, &staged).unwrap(), 80);
        assert_eq!(state_bits(&m2, 0), (79, bits(&ckpt_vals(4))));
        assert_eq!(full2.remote().unwrap().stats().hit_blocks, 6);
        audit(&m2);
        drop(staged);
        assert_eq!(full2.remote().unwrap().stats().staged_bytes, 0);
        // The checkpoint at the end of the run is gone from the store: the fetch brings the
        // one below it, and a third replica resumes there.
        let id = full.model_id();
        let keys = chain_keys(id, ROOT_KEY, &toks, BS);
        let ck4 = checkpoint_key(id, keys[4], &toks[64..80]);
        assert!(full.remote().unwrap().delete(ck4).unwrap());
        let (full3, win3) = replica();
        let mut m3 = memory_over(&full3, &win3, true);
        let groups = [
            (LayerKind::Full, full3.as_ref()),
            (LayerKind::Window(20), win3.as_ref()),
        ];
        let staged = LayerGroups::fetch_remote(&groups, &q, ROOT_KEY, true);
        assert_eq!(staged[0].len(), 6);
        assert_eq!(m3.match_prefix_staged(0, &q, &staged).unwrap(), 64);
        assert_eq!(state_bits(&m3, 0), (63, bits(&ckpt_vals(3))));
        for g in m3.groups() {
            assert_eq!(g.cache.table().seq_pos_max(0), 63);
        }
        audit(&m3);
        // A replica that holds the top checkpoint in RAM asks the store for none.
        let fetches = full2.remote().unwrap().stats().fetches;
        m2.seq_rm(0, -1, -1).unwrap();
        let groups = [
            (LayerKind::Full, full2.as_ref()),
            (LayerKind::Window(20), win2.as_ref()),
        ];
        let staged = LayerGroups::fetch_remote(&groups, &q, ROOT_KEY, true);
        assert!(staged.iter().all(Staged::is_empty));
        assert_eq!(full2.remote().unwrap().stats().fetches, fetches);
    }

    /// Every group's tables and the recurrent states are consistent, and so is every pool.
    fn audit(m: &LayerGroups) {
        for g in m.groups() {
            g.cache.table().check().unwrap();
        }
        if let Some(r) = m.recurrent() {
            r.check().unwrap();
            r.pool().audit().unwrap();
        }
    }

    /// What a failed batch must leave as it was: every group's cells of every sequence, its
    /// table's counts (blocks held) and the recurrent states. (Cached blocks a failed plan
    /// evicted stay evicted, and copies pending from a shift were made and their sources
    /// unpinned, so the pools' counts may move.)
    fn state_of(m: &LayerGroups) -> Vec<String> {
        let mut out: Vec<String> = m
            .groups()
            .iter()
            .map(|g| {
                let t = g.cache.table();
                let cells: Vec<_> = (0..8).map(|s| t.cells(s)).collect();
                format!("{cells:?} {:?}", t.stats())
            })
            .collect();
        if let Some(r) = m.recurrent() {
            out.push(format!(
                "{:?}",
                (0..8).map(|s| r.seq_pos(s)).collect::<Vec<_>>()
            ));
        }
        out
    }

    /// `blocks_short` against what planning the batch does, over random cache states of small
    /// pools (full, window and recurrent groups; shared prefixes by `seq_cp` and by prefix
    /// matches; shifts; tail removals; another context on the same memories): it says 0
    /// exactly when the plan succeeds, and more exactly when the plan fails with `KvCacheFull`
    /// (which then changed nothing); a malformed batch is `InvalidInput` for both.
    #[test]
    fn blocks_short_says_what_planning_the_batch_does() {
        let mut rng = crate::test_rng::Rng(0xb10c_5407);
        let (mut fits, mut short) = (0, 0);
        for trial in 0..40 {
            let rec = trial % 2 == 0;
            let full = shared_n(1, 6 + rng.below(14));
            let win = shared_n(2, 4 + rng.below(12));
            let mut m = memory_over(&full, &win, rec);
            let mut other = memory_over(&full, &win, rec);
            // Per sequence: its tokens at positions 0.. as far as they are known (prompts for
            // prefix matches of other sequences).
            let mut text: Vec<Vec<u32>> = vec![Vec::new(); 6];
            for step in 0..80 {
                let s = rng.below(6) as SeqId;
                match rng.below(14) {
                    0..=6 => {
                        // A batch of 1-3 sequences, their tokens interleaved.
                        let mut queues: Vec<Vec<(SeqId, Pos, u32)>> = Vec::new();
                        for _ in 0..1 + rng.below(3) {
                            let q = rng.below(6) as SeqId;
                            if queues.iter().any(|x| x[0].0 == q) {
                                continue;
                            }
                            let mut p = m.seq_pos_max(q) + 1 + rng.below(2) as Pos;
                            if rng.below(20) == 0 {
                                p = (p - 2).max(0); // not past its last position: malformed
                            }
                            let k = 1 + rng.below(BS + 8);
                            queues.push(
                                (0..k)
                                    .map(|i| (q, p + i as Pos, rng.below(6) as u32))
                                    .collect(),
                            );
                        }
                        let mut b = Batch::default();
                        while queues.iter().any(|x| !x.is_empty()) {
                            let i = rng.below(queues.len());
                            if queues[i].is_empty() {
                                continue;
                            }
                            let (q, p, t) = queues[i].remove(0);
                            b.seq_ids.push(q);
                            b.positions.push(p);
                            b.tokens.push(t);
                            b.logits.push(false);
                        }
                        let want = m.blocks_short(&b.seq_ids, &b.positions);
                        let before = state_of(&m);
                        let got = try_run(&mut m, &b);
                        match (&want, &got) {
                            (Ok(0), Ok(())) => fits += 1,
                            (Ok(n), Err(crate::Error::KvCacheFull(_))) if *n > 0 => {
                                short += 1;
                                assert_eq!(state_of(&m), before, "a failed batch changed nothing");
                                // As an engine would: preempt one of the batch's sequences.
                                let q = b.seq_ids[rng.below(b.len())];
                                m.seq_rm(q, -1, -1).unwrap();
                                text[q as usize].clear();
                            }
                            (
                                Err(crate::Error::InvalidInput(_)),
                                Err(crate::Error::InvalidInput(_)),
                            ) => {
                                assert_eq!(state_of(&m), before);
                            }
                            _ => panic!(
                                "trial {trial} step {step}: blocks_short {want:?}, plan {got:?}"
                            ),
                        }
                        if got.is_ok() {
                            for (&q, (&p, &t)) in
                                b.seq_ids.iter().zip(b.positions.iter().zip(&b.tokens))
                            {
                                let tx = &mut text[q as usize];
                                // Known only while the sequence is a gapless run from 0.
                                if tx.len() == p as usize {
                                    tx.push(t);
                                } else {
                                    tx.clear();
                                }
                            }
                        }
                    }
                    7 => {
                        let d = rng.below(6) as SeqId;
                        if m.seq_cp(s, d, -1, -1).is_ok() && d != s {
                            text[d as usize] = if m.seq_pos_min(d) == 0 {
                                text[s as usize].clone()
                            } else {
                                Vec::new()
                            };
                        }
                    }
                    8 => {
                        m.seq_rm(s, -1, -1).unwrap();
                        text[s as usize].clear();
                    }
                    9 => {
                        let n = m.seq_pos_max(s) + 1;
                        if n > 1 {
                            let p0 = rng.range(1, n - 1);
                            if m.seq_rm(s, p0, -1).is_ok() {
                                text[s as usize].truncate(p0 as usize);
                            }
                        }
                    }
                    10 => {
                        // A context shift: drop the first positions, move the rest down.
                        let n = m.seq_pos_max(s) + 1;
                        if n > 2 {
                            let p0 = rng.range(1, n - 1);
                            if m.seq_rm(s, 0, p0).is_ok() {
                                let _ = m.seq_add(s, p0, -1, -p0);
                            }
                            text[s as usize].clear();
                        }
                    }
                    11 => {
                        // A new sequence from a prompt another one had: maps a cached prefix.
                        let src = rng.below(6);
                        if m.seq_pos_max(s) < 0 && text[src].len() > 1 {
                            let prompt = text[src].clone();
                            let n = m.match_prefix(s, &prompt).unwrap();
                            text[s as usize] = prompt[..n].to_vec();
                        }
                    }
                    12 => {
                        // Another context of the model takes or gives back blocks.
                        let toks: Vec<u32> = (0..1 + rng.below(3 * BS)).map(|i| i as u32).collect();
                        let p = other.seq_pos_max(s) + 1;
                        let _ = try_run(&mut other, &Batch::prompt(&toks, p, s));
                    }
                    _ => {
                        other.seq_rm(s, -1, -1).unwrap();
                    }
                }
                audit(&m);
                audit(&other);
            }
        }
        assert!(
            fits > 300 && short > 100,
            "{fits} batches fit, {short} did not"
        );
    }

    /// The count itself: new blocks, copies of shared partly filled tails, states of new and
    /// shared sequences (in the full group's pool) and the window group's own pool, each pool
    /// against its free and cached blocks.
    #[test]
    fn blocks_short_counts_each_pool_s_missing_blocks() {
        let (full, win) = (shared_n(1, 6), shared_n(2, 5));
        let mut m = memory_over(&full, &win, true);
        run(&mut m, 0, 0, 20); // 2 blocks in each group + 1 state block
        m.seq_cp(0, 1, -1, -1).unwrap(); // shares both blocks and the state
        assert_eq!(full.pool_stats().free, 3);
        assert_eq!(win.pool_stats().free, 3);
        let one = |s: SeqId, p: Pos| (vec![s], vec![p]);
        // Seq 1 at 20: a copy of the shared tail and of the shared state: 2 of 3.
        let (s, p) = one(1, 20);
        assert_eq!(m.blocks_short(&s, &p).unwrap(), 0);
        // Seqs 0 and 1, 13 tokens each: per K/V group 2 copies + 2 new blocks (4 of 3 free in
        // either pool), and 2 state copies from the full pool: 6 of 3.
        let mut b = Batch::prompt(&[1; 13], 20, 0);
        let b1 = Batch::prompt(&[2; 13], 20, 1);
        b.tokens.extend(&b1.tokens);
        b.positions.extend(&b1.positions);
        b.seq_ids.extend(&b1.seq_ids);
        b.logits.extend(&b1.logits);
        assert_eq!(m.blocks_short(&b.seq_ids, &b.positions).unwrap(), 3);
        assert!(matches!(
            try_run(&mut m, &b),
            Err(crate::Error::KvCacheFull(_))
        ));
        // A new sequence of 3 tokens: one block per K/V group and one state block.
        let (s, p) = (vec![2; 3], vec![0, 1, 2]);
        assert_eq!(m.blocks_short(&s, &p).unwrap(), 0);
        // Another owner takes all but one free block of the full pool: 1 short there.
        let held: Vec<_> = (0..2).map(|_| full.pool().allocate().unwrap()).collect();
        assert_eq!(m.blocks_short(&s, &p).unwrap(), 1);
        assert!(try_run(&mut m, &Batch::prompt(&[3; 3], 0, 2)).is_err());
        for b in held {
            full.pool().release(b).unwrap();
        }
        try_run(&mut m, &Batch::prompt(&[3; 3], 0, 2)).unwrap();
        // The context's token limit counts too: a window group of n_ctx 4096 is never the one.
        assert_eq!(m.blocks_short(&[2], &[3]).unwrap(), 0);
        audit(&m);
    }

    /// A context's memory that goes away (its context dropped; also after a panic closed the
    /// context, which drops it) gives every block back to the model's pools, in every group:
    /// nothing stays referenced, the keyed blocks stay cached and indexed, and a new context
    /// maps them, with the recurrent state's checkpoint. Pending copy-on-write copies (from a
    /// shift) and a batch planned but never committed or rolled back (a panic between the two)
    /// are released too.
    #[test]
    fn dropping_a_memory_gives_every_block_back() {
        let (full, win) = (shared_n(1, 24), shared_n(2, 16));
        let mut m = memory_over(&full, &win, true);
        run(&mut m, 0, 0, 48); // tokens 0..48; the window group pruned (cached blocks)
        let toks: Vec<u32> = (0..48).collect();
        let id = full.model_id();
        let keys = chain_keys(id, crate::kv::ROOT_KEY, &toks, BS);
        let vals: Vec<f32> = (0..16).map(|i| i as f32 - 3.5).collect();
        let r = m.recurrent().unwrap();
        assert!(r.store_checkpoint(&mut full.lock_storage(), id, keys[2], &toks[32..], &vals));
        // Shared prefixes, a copy-on-write of a partial tail and of a shared state.
        m.seq_cp(0, 1, -1, -1).unwrap();
        run(&mut m, 1, 48, 5);
        run(&mut m, 2, 0, 20);
        m.seq_cp(2, 3, -1, -1).unwrap();
        run(&mut m, 3, 20, 3);
        // A shift of cells seq 1 shares with seq 0: private copies, pending (pinned sources).
        m.seq_add(1, 40, -1, 2).unwrap();
        assert!(m.groups()[0].cache.table().has_updates());
        // A batch planned and then abandoned, as a panic before its commit would.
        m.seq_cp(2, 4, -1, -1).unwrap();
        {
            let shared = [Arc::clone(&full), Arc::clone(&win)];
            let mut storages: Vec<_> = shared.iter().map(|s| s.lock_storage()).collect();
            let planned = m.begin_batch(&Batch::prompt(&[9, 9], 20, 4), &mut storages);
            assert!(planned.unwrap().rec.is_some());
        }
        audit(&m);
        assert!(full.pool_stats().referenced > 8 && win.pool_stats().referenced > 4);
        drop(m);
        for (what, sh) in [("full", &full), ("window", &win)] {
            let st = sh.pool_stats();
            assert_eq!(st.referenced, 0, "{what}: {st:?}");
            assert_eq!(st.free + st.cached, st.total, "{what}");
            assert!(st.cached > 0, "{what}: keyed blocks stay cached");
            sh.pool().audit().unwrap();
        }
        // 3 K/V blocks of the prompt and the checkpoint stay indexed in the full memory.
        assert!(full.pool_stats().cached >= 4);
        let mut m2 = memory_over(&full, &win, true);
        let mut q = toks.clone();
        q.push(99);
        assert_eq!(m2.match_prefix(5, &q).unwrap(), 48);
        let (pos, got) = m2
            .recurrent()
            .unwrap()
            .read(5, &full.lock_storage())
            .unwrap()
            .unwrap();
        assert_eq!((pos, got), (47, vals));
        assert!(full.pool_stats().referenced >= 4 && win.pool_stats().referenced >= 2);
        audit(&m2);
        drop(m2);
        assert_eq!(
            full.pool_stats().referenced + win.pool_stats().referenced,
            0
        );
    }

    /// A salted sequence of a hybrid + window memory resumes (K/V of both groups and the state
    /// checkpoint, keyed under the salted chain) only under the same salt; `seq_set_salt`
    /// salts every group, refuses a sequence that holds anything, and `seq_cp` into an empty
    /// sequence passes the salt on in every group.
    #[test]
    fn salted_sequences_resume_only_under_their_salt() {
        let (full, win) = (shared_n(1, 24), shared_n(2, 16));
        let mut m = memory_over(&full, &win, true);
        m.seq_set_salt(0, b"tenant a").unwrap();
        run(&mut m, 0, 0, 48);
        let toks: Vec<u32> = (0..48).collect();
        let id = full.model_id();
        let ra = salt_root(b"tenant a");
        assert_eq!(m.seq_root(0), ra);
        let keys = chain_keys(id, ra, &toks, BS);
        let vals: Vec<f32> = (0..16).map(|i| i as f32 + 0.25).collect();
        let r = m.recurrent().unwrap();
        assert!(r.store_checkpoint(&mut full.lock_storage(), id, keys[2], &toks[32..], &vals));
        let err = m.seq_set_salt(0, b"other").unwrap_err();
        assert!(matches!(err, crate::Error::InvalidInput(_)), "{err}");
        assert!(m.seq_set_salt(-1, b"x").is_err());
        assert_eq!(m.seq_root(0), ra, "nothing changed");
        m.seq_cp(0, 1, -1, -1).unwrap();
        for g in m.groups() {
            assert_eq!(g.cache.table().root(1), ra, "{:?}", g.kind);
        }
        m.seq_rm(0, -1, -1).unwrap();
        m.seq_rm(1, -1, -1).unwrap();
        let mut q = toks.clone();
        q.push(99);
        for (seq, salt, want) in [
            (5, &b""[..], 0),
            (6, &b"tenant b"[..], 0),
            (7, &b"tenant a"[..], 48),
        ] {
            m.seq_set_salt(seq, salt).unwrap();
            assert_eq!(m.match_prefix(seq, &q).unwrap(), want, "seq {seq}");
            audit(&m);
        }
        let (pos, got) = m
            .recurrent()
            .unwrap()
            .read(7, &full.lock_storage())
            .unwrap()
            .unwrap();
        assert_eq!((pos, got), (47, vals));
        // Without a recurrent group the peek follows the salt the same way.
        let (full2, win2) = (shared_n(1, 24), shared_n(2, 16));
        let mut m2 = memory_over(&full2, &win2, false);
        m2.seq_set_salt(0, b"tenant a").unwrap();
        run(&mut m2, 0, 0, 48);
        assert_eq!(m2.peek_prefix(&q, ra), 48);
        assert_eq!(m2.peek_prefix(&q, ROOT_KEY), 0);
        assert_eq!(m2.peek_prefix(&q, salt_root(b"tenant b")), 0);
        audit(&m2);
    }
}
