//! Per-sequence block tables and llama.cpp's sequence operations over a [`BlockPool`]. Plans
//! where each new token's K/V goes, which blocks must be copied (copy-on-write) and which cells
//! need a K re-rotation (lazy K-shift), without touching K/V data. Semantics: docs/KV_SEMANTICS.md.
//!
//! Guarantees: every operation either succeeds completely or (when the pool is short) returns
//! `Error::KvCacheFull` and leaves the table and the pool exactly as they were; a block is held
//! by a sequence iff the sequence references at least one of its cells; the pool refcount of a
//! block equals the number of sequences holding it plus pending copy pins ([`KvTable::check`]).
//!
//! # Model
//! A *cell* is one slot `(block, slot)` of the pool, `slot < block_size`. It stores one token's K/V
//! and carries a position `pos` (shared by every sequence that references the cell) and `rope`,
//! the position its K is currently rotated for. A *sequence* is an ordered list of cells
//! (insertion order). Each sequence holds one pool reference per block it has cells in.
//!
//! Writes append to the sequence's tail block (the block of its last cell) at slot
//! `top = 1 + highest slot the sequence uses there`, if `top < block_size` and the block is
//! writable (refcount 1, i.e. only this sequence holds it, and no content key). If the tail is
//! partly filled but shared or keyed, it is copied first (copy-on-write: slots `0..top` into a
//! fresh block that the sequence then owns). Otherwise a fresh block is taken.
//!
//! Positions are per sequence: `seq_add`/`seq_div` on one sequence move only its cells. A cell
//! that another sequence also references is first given a private copy (its whole block is
//! copied, so this can return `KvCacheFull`). Moved cells get a pending shift `pos - rope` that
//! the storage applies (RoPE is additive in the angle) when it takes the [`Updates`].
//!
//! The storage must apply [`Updates`] in order: all copies (in list order), then all shifts;
//! then write the new tokens of a [`WritePlan`] (K rotated at the token's position). Copy sources
//! stay pinned (an extra pool reference) until their copy is handed out, so they cannot be
//! reused or mutated before the storage reads them.
//!
//! Blocks with a content key (full blocks of a clean prefix, see docs/KV_SEMANTICS.md) may be
//! shared with other contexts of the model through the prefix index at any moment, so they are
//! immutable: a write or a shift into one copies it first, unless the table holds every
//! reference to it, in which case it loses its key ([`BlockPool::untag`]) and is changed in place.
//! Blocks without a key are private to this table.
//!
//! A batch is a transaction: [`KvTable::prepare_batch`] plans it and returns a [`BatchTx`];
//! after the K/V are written the caller either [`KvTable::commit`]s it (full clean blocks get
//! their content keys only now, so a key never names unwritten data) or [`KvTable::rollback`]s
//! it (the cells it added are removed and copy-on-write moves undone: every sequence holds
//! exactly the positions, blocks and K rotation it held before).
//!
//! Complexity (n = tokens of the batch, c = cells of the sequences involved, S = sequences):
//! `prepare_batch` and `commit` are O(n) plus O(block size) per block filled (per-sequence tail,
//! bounds and key chain are kept in step; the pool's counters answer the availability check);
//! `rollback` is O(n + cells in copied tails); `view` is O(1) amortized per appended token (a
//! cached view, rebuilt in O(c) after a structural change); `seq_pos_min/max(s)` are O(1) (O(S)
//! for `s < 0`); `seq_rm`, `seq_cp`, `seq_add`, `seq_div` are O(c); `seq_keep`, `clear` and
//! `stats` are O(all cells).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use super::pool::{BlockId, BlockPool, NO_KEY};
use super::prefix::{block_key, key_tag, Key, PrefixIndex, ROOT_KEY};
use super::try_vec;
use crate::error::{Error, Result};

/// A sequence id (`>= 0`; negative ids mean "all sequences" where an operation allows it).
pub type SeqId = i32;
/// A token position (`>= 0` for stored cells).
pub type Pos = i32;

/// Copy slots `0..n_slots` of block `src` into block `dst` (K and V, as stored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CowCopy {
    pub src: BlockId,
    pub dst: BlockId,
    pub n_slots: u16,
}

/// Re-rotate the K of one cell by `delta` positions (K-shift).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellShift {
    pub block: BlockId,
    pub slot: u16,
    pub delta: Pos,
}

/// Storage work to apply, in order: every copy, then every shift.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Updates {
    pub copies: Vec<CowCopy>,
    pub shifts: Vec<CellShift>,
}

impl Updates {
    pub fn is_empty(&self) -> bool {
        self.copies.is_empty() && self.shifts.is_empty()
    }
}

/// Where a batch goes: apply `updates` first, then write token `i` into `slots[i]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WritePlan {
    pub updates: Updates,
    pub slots: Vec<(BlockId, u16)>,
}

/// A sequence's blocks (in order of first use) and the position held in each of their slots
/// (`-1`: a slot the sequence does not use), for attention.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SeqView {
    pub blocks: Vec<u32>,
    pub positions: Vec<i32>,
}

#[derive(Debug, Default, Clone)]
struct Seq {
    cells: Vec<(BlockId, u16)>,
    /// Block -> number of this sequence's cells in it (each entry = one pool reference).
    holds: HashMap<BlockId, u32>,
    /// Some cell of the sequence was moved (`seq_add`/`seq_div`) or it received cells of another
    /// sequence (`seq_cp` into a non-empty or from a tainted sequence): its blocks get no
    /// content keys. Reset when the sequence becomes empty.
    tainted: bool,
    // Derived from `cells`, kept in step by appends and recomputed by `refresh` after any other
    // change:
    /// One past the highest slot the sequence uses in its tail block (the block of its last cell).
    top: usize,
    pos_min: Pos,
    pos_max: Pos,
    /// Cached attention view (`None`: rebuild on demand).
    view: Option<SeqView>,
    /// Content keys of the leading full blocks known to form a clean prefix (a prefix of the
    /// truth; `chain_ok == false`: recompute from scratch at the next commit, possible only
    /// while `front == 0`). Key `k` names the sequence's cells `k*b .. (k+1)*b`, counted from
    /// its first cell ever, whether or not a window pruning dropped them since.
    chain: Vec<Key>,
    chain_ok: bool,
    /// The block after `chain` is full but not a clean prefix block: nothing further is keyed.
    chain_stuck: bool,
    /// Leading cells dropped by [`KvTable::prune_front`] (a window group's pruning): `cells[i]`
    /// is the sequence's cell number `front + i`. The chain survives such a drop.
    front: usize,
}

/// How `drop_cells` treats the key chain: a window's pruning keeps it (the dropped cells are no
/// longer seen by anything, so later blocks still continue the same clean run); any other
/// removal keeps it only when it removed a tail.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Removal {
    Remove,
    Prune,
}

/// Undo record of one planned batch (see the module docs): per sequence, its cell count before
/// the batch and the copy-on-write move of its tail (old block, new block), if any; the old
/// blocks stay pinned until `commit` or `rollback`. A transaction dropped without either (a
/// panic unwinding between the plan and its end) gives its pins back to the pool, so that a
/// context dropped after such a panic releases every block (the batch's cells are the
/// table's, released with it).
#[derive(Debug)]
#[must_use = "a planned batch must be committed or rolled back"]
pub struct BatchTx {
    seqs: Vec<TxSeq>,
    pins: Vec<BlockId>,
    pool: Arc<BlockPool>,
}

impl Drop for BatchTx {
    fn drop(&mut self) {
        for b in std::mem::take(&mut self.pins).into_iter().rev() {
            let _ = self.pool.release(b);
        }
    }
}

/// A sequence in a batch: its id, its cell count before, and its copied tail (old, new block).
type TxSeq = (SeqId, usize, Option<(BlockId, BlockId)>);

/// Table-level counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TableStats {
    pub sequences: usize,
    /// Distinct cells referenced by at least one sequence (tokens stored).
    pub live_cells: usize,
    /// Blocks held by at least one sequence.
    pub held_blocks: usize,
    /// Unused slots in held blocks (internal fragmentation).
    pub unused_slots: usize,
}

/// Block tables of all sequences over one pool. Not `Sync` by itself: one owner mutates it; the
/// pool underneath may be shared.
#[derive(Debug)]
pub struct KvTable {
    pool: Arc<BlockPool>,
    /// The model's prefix index: told when a block loses its key (eviction, untag).
    index: Option<Arc<PrefixIndex>>,
    bs: usize,
    seqs: BTreeMap<SeqId, Seq>,
    /// Per block: sequences of this table holding it.
    holders: Vec<u32>,
    /// Per cell: token id (set by the caller for written cells; keys are computed from it).
    tokens: Vec<u32>,
    users: Vec<u16>,
    /// Cells with at least one user (kept in step with `users`, so the hot path need not scan).
    live: usize,
    /// Blocks with at least one holder here (kept in step with `holders`).
    held: usize,
    pos: Vec<Pos>,
    rope: Vec<Pos>,
    /// Per cell: id of the write that produced its content (kept by copy-on-write).
    origin: Vec<u64>,
    next_origin: u64,
    /// The model id of the last keying commit (for [`KvTable::check`] to recompute chains).
    key_model: Option<Key>,
    /// Root keys of salted sequence ids (the parent key of their first block; absent:
    /// [`ROOT_KEY`]). A property of the id, kept while it is empty, until set again,
    /// copied by `seq_cp` into an empty sequence, or dropped by `clear`.
    roots: HashMap<SeqId, Key>,
    pending: Vec<CowCopy>,
    pins: Vec<BlockId>,
    dirty: Vec<(BlockId, u16)>,
}

/// A table gives its references back to the (shared) pool when it goes away: keyed blocks stay
/// cached for other contexts, the rest is freed.
impl Drop for KvTable {
    fn drop(&mut self) {
        self.clear();
    }
}

fn internal(e: String) -> Error {
    Error::InvalidInput(format!("kv bookkeeping: {e}"))
}

fn range(p0: Pos, p1: Pos) -> (Pos, Pos) {
    (p0.max(0), if p1 < 0 { Pos::MAX } else { p1 })
}

impl KvTable {
    /// A table over `pool` with `block_size` tokens per block (1..=32768).
    pub fn new(pool: Arc<BlockPool>, block_size: usize) -> Result<KvTable> {
        KvTable::with_index(pool, None, block_size)
    }

    /// A table over `pool` whose key changes are reported to `index`.
    pub fn with_index(
        pool: Arc<BlockPool>,
        index: Option<Arc<PrefixIndex>>,
        block_size: usize,
    ) -> Result<KvTable> {
        if block_size == 0 || block_size > 32768 {
            return Err(Error::InvalidInput(format!(
                "kv block size must be in 1..=32768, got {block_size}"
            )));
        }
        let n = pool
            .total()
            .checked_mul(block_size)
            .ok_or_else(|| Error::InvalidInput("KV block table too large".into()))?;
        Ok(KvTable {
            holders: try_vec(pool.total(), 0, "KV block tables")?,
            tokens: try_vec(n, 0, "KV block tables")?,
            pool,
            index,
            bs: block_size,
            seqs: BTreeMap::new(),
            users: try_vec(n, 0, "KV block tables")?,
            live: 0,
            held: 0,
            pos: try_vec(n, -1, "KV block tables")?,
            rope: try_vec(n, -1, "KV block tables")?,
            origin: try_vec(n, 0, "KV block tables")?,
            next_origin: 1,
            key_model: None,
            roots: HashMap::new(),
            pending: Vec::new(),
            pins: Vec::new(),
            dirty: Vec::new(),
        })
    }

    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    pub fn block_size(&self) -> usize {
        self.bs
    }

    fn idx(&self, b: BlockId, slot: u16) -> usize {
        b as usize * self.bs + slot as usize
    }

    /// The cells of sequence `s` in order, as `(pos, block, slot)` (empty if unknown).
    pub fn cells(&self, s: SeqId) -> Vec<(Pos, BlockId, u16)> {
        self.seqs.get(&s).map_or(Vec::new(), |q| {
            q.cells
                .iter()
                .map(|&(b, sl)| (self.pos[self.idx(b, sl)], b, sl))
                .collect()
        })
    }

    /// The token id recorded for cell `(b, slot)`.
    pub fn cell_token(&self, b: BlockId, slot: u16) -> u32 {
        self.tokens[self.idx(b, slot)]
    }

    /// The root key of `s`: the parent key of its first block's content key ([`ROOT_KEY`]
    /// unless [`KvTable::set_root`] salted it).
    pub fn root(&self, s: SeqId) -> Key {
        self.roots.get(&s).copied().unwrap_or(ROOT_KEY)
    }

    /// Salts the sequence id `s`: its key chain starts from `root` (`prefix::salt_root` of
    /// the salt; [`ROOT_KEY`] unsalts it), so its blocks get keys, and match prefixes, of
    /// sequences with the same root only. `InvalidInput` (nothing changed) if `s < 0` or `s`
    /// has cells: a chain cannot change its root midway.
    pub fn set_root(&mut self, s: SeqId, root: Key) -> Result<()> {
        if s < 0 {
            return Err(Error::InvalidInput(format!(
                "a salt needs a sequence id >= 0, got {s}"
            )));
        }
        if self.seqs.contains_key(&s) {
            return Err(Error::InvalidInput(format!(
                "sequence {s} is not empty; a salt applies to an empty sequence"
            )));
        }
        if root == ROOT_KEY {
            self.roots.remove(&s);
        } else {
            self.roots.insert(s, root);
        }
        Ok(())
    }

    /// Whether `s` is clean: none of its cells was moved by `seq_add`/`seq_div` and it received
    /// no cells by `seq_cp` except into an empty sequence from a clean one (only a clean
    /// sequence's full prefix blocks get content keys). An unknown sequence is clean.
    pub fn is_clean(&self, s: SeqId) -> bool {
        self.seqs.get(&s).is_none_or(|q| !q.tainted)
    }

    /// Marks `s` as not clean (its blocks get no content keys from now on, until it is empty).
    pub fn taint(&mut self, s: SeqId) {
        if let Some(q) = self.seqs.get_mut(&s) {
            q.tainted = true;
        }
    }

    /// Ids of the sequences that have at least one cell.
    pub fn seq_ids(&self) -> Vec<SeqId> {
        self.seqs
            .iter()
            .filter(|(_, q)| !q.cells.is_empty())
            .map(|(&s, _)| s)
            .collect()
    }

    fn targets(&self, s: SeqId) -> Vec<SeqId> {
        if s < 0 {
            self.seqs.keys().copied().collect()
        } else if self.seqs.contains_key(&s) {
            vec![s]
        } else {
            Vec::new()
        }
    }

    /// Removes the cells of `s` for which `drop(pos)` holds; releases blocks it no longer uses,
    /// tails first (so that the LRU evicts tails before heads).
    fn drop_cells(&mut self, s: SeqId, how: Removal, mut drop: impl FnMut(Pos) -> bool) {
        let Some(mut q) = self.seqs.remove(&s) else {
            return;
        };
        let mut released = Vec::new();
        let bs = self.bs;
        let before = q.cells.len();
        // Whether the removed cells are a head or a tail of the list.
        let (mut at, mut last_removed, mut first_kept, mut last_kept, mut first_removed) =
            (0usize, None, None, None, None);
        q.cells.retain(|&(b, sl)| {
            let i = b as usize * bs + sl as usize;
            let k = at;
            at += 1;
            if !drop(self.pos[i]) {
                first_kept.get_or_insert(k);
                last_kept = Some(k);
                return true;
            }
            first_removed.get_or_insert(k);
            last_removed = Some(k);
            self.users[i] -= 1;
            if self.users[i] == 0 {
                self.live -= 1;
            }
            let h = q.holds.get_mut(&b).expect("held block");
            *h -= 1;
            if *h == 0 {
                q.holds.remove(&b);
                released.push(b);
            }
            false
        });
        for b in released.into_iter().rev() {
            self.hold(b, false);
            // A held block has refcount >= 1, so this cannot fail.
            let _ = self.pool.release(b);
        }
        if !q.cells.is_empty() {
            let removed = before - q.cells.len();
            if removed > 0 {
                let head = last_removed < first_kept;
                let tail = first_removed > last_kept;
                let kept = (std::mem::take(&mut q.chain), q.chain_ok, q.chain_stuck);
                self.refresh(&mut q);
                if how == Removal::Prune && head {
                    q.front += removed;
                    (q.chain, q.chain_ok, q.chain_stuck) = kept;
                } else if tail && kept.1 {
                    // What is left is a prefix of what was there: so is its chain.
                    q.chain = kept.0;
                    q.chain.truncate((q.front + q.cells.len()) / bs);
                    q.chain_ok = true;
                }
            }
            self.seqs.insert(s, q);
        }
    }

    /// A window group's pruning: drops the cells of `s` with `pos < p1`. When they are the
    /// sequence's leading cells (a clean run pruned from its front, the usual case), its key
    /// chain is kept, so the blocks it fills later still get content keys (chained to the
    /// dropped ones, whose keys it remembers) and a window group can resume a prefix far past
    /// its window. Only valid where no later token can see the dropped cells (the caller's
    /// window rule); a plain `seq_rm` of a front range stops keying instead.
    pub fn prune_front(&mut self, s: SeqId, p1: Pos) {
        if s >= 0 {
            self.drop_cells(s, Removal::Prune, |p| p < p1);
        }
    }

    /// Number of leading blocks of `s` whose content keys are known (0 when unknown): a group
    /// that must not key past another group's clean prefix asks this.
    pub fn chain_len(&self, s: SeqId) -> usize {
        self.seqs
            .get(&s)
            .filter(|q| q.chain_ok && !q.tainted)
            .map_or(0, |q| q.chain.len())
    }

    /// Counts one more (`up`) or one fewer sequence of this table holding block `b`.
    fn hold(&mut self, b: BlockId, up: bool) {
        let h = &mut self.holders[b as usize];
        if up {
            *h += 1;
            self.held += usize::from(*h == 1);
        } else {
            *h -= 1;
            self.held -= usize::from(*h == 0);
        }
    }

    /// Recomputes the derived fields of a sequence after a change other than an append.
    fn refresh(&self, q: &mut Seq) {
        let tail = q.cells.last().map(|c| c.0);
        q.top = q
            .cells
            .iter()
            .filter(|c| Some(c.0) == tail)
            .map(|c| c.1 as usize + 1)
            .max()
            .unwrap_or(0);
        let (mut lo, mut hi) = (Pos::MAX, -1);
        for &(b, sl) in &q.cells {
            let p = self.pos[self.idx(b, sl)];
            lo = lo.min(p);
            hi = hi.max(p);
        }
        q.pos_min = if hi < 0 { -1 } else { lo };
        q.pos_max = hi;
        q.view = None;
        q.chain_ok = false;
        q.chain_stuck = false;
    }

    fn refresh_seq(&mut self, s: SeqId) {
        if let Some(mut q) = self.seqs.remove(&s) {
            self.refresh(&mut q);
            self.seqs.insert(s, q);
        }
    }

    /// Adds cell `(b, sl)` to the end of `s`; takes a pool reference if `s` did not hold `b` and
    /// the block is not `fresh` (a fresh block's reference comes from the caller). Keeps the
    /// derived fields of an append (`top`, bounds, view); other callers `refresh` after.
    fn add_cell(&mut self, s: SeqId, b: BlockId, sl: u16, fresh: bool) -> Result<()> {
        let bs = self.bs;
        let p = self.pos[b as usize * bs + sl as usize];
        if self.seqs.get(&s).is_none_or(|q| !q.holds.contains_key(&b)) {
            if !fresh {
                self.pool.retain(b).map_err(internal)?;
            }
            self.hold(b, true);
        }
        let q = self.seqs.entry(s).or_default();
        let h = q.holds.entry(b).or_insert(0);
        *h += 1;
        let new_block = q.cells.last().is_none_or(|c| c.0 != b);
        q.cells.push((b, sl));
        q.top = if new_block {
            sl as usize + 1
        } else {
            q.top.max(sl as usize + 1)
        };
        if q.cells.len() == 1 {
            q.pos_min = p;
            q.pos_max = p;
        } else {
            q.pos_min = q.pos_min.min(p);
            q.pos_max = q.pos_max.max(p);
        }
        if let Some(v) = &mut q.view {
            if v.blocks.last() == Some(&b) {
                let k = v.blocks.len() - 1;
                v.positions[k * bs + sl as usize] = p;
            } else if *h == 1 {
                v.blocks.push(b);
                v.positions.extend(std::iter::repeat_n(-1, bs));
                let k = v.blocks.len() - 1;
                v.positions[k * bs + sl as usize] = p;
            } else {
                q.view = None;
            }
        }
        let i = b as usize * bs + sl as usize;
        self.users[i] += 1;
        if self.users[i] == 1 {
            self.live += 1;
        }
        Ok(())
    }

    /// `seq_rm`: removes the cells of `s` (all sequences if `s < 0`) with `p0 <= pos < p1`.
    pub fn seq_rm(&mut self, s: SeqId, p0: Pos, p1: Pos) {
        let (p0, p1) = range(p0, p1);
        for t in self.targets(s) {
            self.drop_cells(t, Removal::Remove, |p| p >= p0 && p < p1);
        }
    }

    /// `seq_cp`: `dst` also references every cell of `src` with `p0 <= pos < p1` (no data copy);
    /// cells `dst` already references are skipped. Cannot run out of memory.
    pub fn seq_cp(&mut self, src: SeqId, dst: SeqId, p0: Pos, p1: Pos) -> Result<()> {
        if src < 0 || dst < 0 {
            return Err(Error::InvalidInput(format!(
                "seq_cp needs sequence ids >= 0, got src {src}, dst {dst}"
            )));
        }
        if src == dst {
            return Ok(());
        }
        let (p0, p1) = range(p0, p1);
        // A cell is the same cell as one `dst` has if it has the same content (origin) and the
        // same position: copy-on-write copies are not duplicated.
        let have: HashSet<(u64, Pos)> = self.seqs.get(&dst).map_or(HashSet::new(), |q| {
            q.cells
                .iter()
                .map(|&(b, sl)| {
                    let i = self.idx(b, sl);
                    (self.origin[i], self.pos[i])
                })
                .collect()
        });
        let add: Vec<(BlockId, u16)> = self.seqs.get(&src).map_or(Vec::new(), |q| {
            q.cells
                .iter()
                .copied()
                .filter(|&(b, sl)| {
                    let i = self.idx(b, sl);
                    let p = self.pos[i];
                    p >= p0 && p < p1 && !have.contains(&(self.origin[i], p))
                })
                .collect()
        });
        if add.is_empty() {
            return Ok(());
        }
        let clean =
            !self.seqs.contains_key(&dst) && self.seqs.get(&src).is_some_and(|q| !q.tainted);
        if !self.seqs.contains_key(&dst) {
            // An empty destination continues the source's chain: it takes its root (salt).
            let root = self.root(src);
            self.set_root(dst, root)?;
        }
        // The copy is the source's first cells (not a range from its middle): then it is the
        // same clean run, and the source's chain, cut to what was copied, is its chain too.
        let head = self
            .seqs
            .get(&src)
            .is_some_and(|q| q.cells[..add.len().min(q.cells.len())] == add[..]);
        let n_add = add.len();
        for (b, sl) in add {
            self.add_cell(dst, b, sl, false)?;
        }
        let chain = self
            .seqs
            .get(&src)
            .map(|q| (q.chain.clone(), q.chain_ok, q.front));
        if let Some(mut q) = self.seqs.remove(&dst) {
            q.tainted |= !clean;
            self.refresh(&mut q);
            if let (true, true, Some((mut c, true, front))) = (clean, head, chain) {
                c.truncate((front + n_add) / self.bs);
                q.chain = c;
                q.chain_ok = true;
                q.front = front;
            }
            self.seqs.insert(dst, q);
        }
        Ok(())
    }

    /// `seq_keep`: removes every sequence other than `s`.
    pub fn seq_keep(&mut self, s: SeqId) -> Result<()> {
        if s < 0 {
            return Err(Error::InvalidInput(format!(
                "seq_keep needs a sequence id >= 0, got {s}"
            )));
        }
        for t in self.targets(-1) {
            if t != s {
                self.drop_cells(t, Removal::Remove, |_| true);
            }
        }
        Ok(())
    }

    /// Removes every sequence and salt. Blocks with a content key stay cached in the pool;
    /// pending copies are dropped (their destinations belonged to the removed sequences).
    pub fn clear(&mut self) {
        for t in self.targets(-1) {
            self.drop_cells(t, Removal::Remove, |_| true);
        }
        self.pending.clear();
        self.dirty.clear();
        self.roots.clear();
        for b in std::mem::take(&mut self.pins) {
            let _ = self.pool.release(b);
        }
    }

    /// `seq_add`: adds `delta` to the positions of the cells of `s` (all sequences if `s < 0`)
    /// with `p0 <= pos < p1`; cells whose position becomes negative are removed.
    pub fn seq_add(&mut self, s: SeqId, p0: Pos, p1: Pos, delta: Pos) -> Result<()> {
        if delta == 0 {
            return Ok(());
        }
        self.shift(s, p0, p1, |p| p.saturating_add(delta))
    }

    /// `seq_div`: divides (rounding down) the positions of the cells of `s` (all sequences if
    /// `s < 0`) with `p0 <= pos < p1` by `d >= 1`.
    pub fn seq_div(&mut self, s: SeqId, p0: Pos, p1: Pos, d: i32) -> Result<()> {
        if d <= 0 {
            return Err(Error::InvalidInput(format!(
                "seq_div needs a divisor >= 1, got {d}"
            )));
        }
        if d == 1 {
            return Ok(());
        }
        self.shift(s, p0, p1, |p| p / d)
    }

    fn shift(&mut self, s: SeqId, p0: Pos, p1: Pos, f: impl Fn(Pos) -> Pos) -> Result<()> {
        let (p0, p1) = range(p0, p1);
        if p0 >= p1 {
            return Ok(());
        }
        let targets = self.targets(s);
        let in_range = |p: Pos| p >= p0 && p < p1;
        let moves = |p: Pos| in_range(p) && f(p) >= 0 && f(p) != p;
        // With one sequence, cells it shares with others must become private first. With all
        // sequences, every user of a cell moves it the same way, so in place is fine. A block
        // with a content key may be shared with other contexts: it is changed in place only if
        // this table holds every reference (it then loses its key), else each holder here that
        // moves a cell in it gets a private copy.
        let mut cow: Vec<(SeqId, BlockId)> = Vec::new();
        let mut keyed: Vec<BlockId> = Vec::new();
        let mut keyed_seen = HashSet::new();
        for &t in &targets {
            let q = &self.seqs[&t];
            let mut seen = HashSet::new();
            for &(b, sl) in &q.cells {
                let i = self.idx(b, sl);
                if !moves(self.pos[i]) {
                    continue;
                }
                if s >= 0 && self.users[i] >= 2 {
                    if seen.insert(b) {
                        cow.push((t, b));
                    }
                } else if self.pool.key(b) != NO_KEY && keyed_seen.insert(b) {
                    keyed.push(b);
                }
            }
        }
        let holders_moving = |tbl: &KvTable, b: BlockId, cow: &[(SeqId, BlockId)]| {
            let mut v = Vec::new();
            for &t in &targets {
                let holds = tbl.seqs[&t]
                    .cells
                    .iter()
                    .any(|&(cb, sl)| cb == b && moves(tbl.pos[tbl.idx(cb, sl)]));
                if holds && !cow.contains(&(t, b)) {
                    v.push((t, b));
                }
            }
            v
        };
        let mut untag = Vec::new();
        for &b in &keyed {
            if self.pool.refcount(b) == self.holders[b as usize] {
                untag.push(b);
            } else {
                let more = holders_moving(self, b, &cow);
                cow.extend(more);
            }
        }
        let mut fresh = self.take_blocks(cow.len())?;
        let mut raced = Vec::new();
        for b in untag {
            match self.pool.untag(b, self.holders[b as usize]) {
                Some(tag) => {
                    if let Some(ix) = &self.index {
                        ix.forget(b, tag);
                    }
                }
                // Revived by another context since we looked: copy it instead.
                None => raced.extend(holders_moving(self, b, &cow)),
            }
        }
        if !raced.is_empty() {
            match self.take_blocks(raced.len()) {
                Ok(more) => {
                    fresh.extend(more);
                    cow.extend(raced);
                }
                Err(e) => {
                    for b in fresh {
                        let _ = self.pool.release(b);
                    }
                    return Err(e);
                }
            }
        }
        for (t, b) in cow {
            let nb = fresh.pop().expect("reserved");
            let top = self.top_of(t, b);
            self.copy_block(t, b, nb, top)?;
        }
        // Removals first, decided on the old positions.
        let mut removed_any = false;
        for &t in &targets {
            self.drop_cells(t, Removal::Remove, |p| {
                let r = in_range(p) && f(p) < 0;
                removed_any |= r;
                r
            });
        }
        // Each distinct cell moves once, even if several sequences reference it.
        let mut moved = HashSet::new();
        let mut touched = Vec::new();
        for t in targets {
            let Some(q) = self.seqs.get(&t) else {
                continue;
            };
            for &(b, sl) in &q.cells {
                let i = b as usize * self.bs + sl as usize;
                let p = self.pos[i];
                if in_range(p) && moved.insert((b, sl)) {
                    let np = f(p);
                    if np != p {
                        touched.push((b, sl, np));
                    }
                }
            }
        }
        let changed = !touched.is_empty() || removed_any;
        for (b, sl, np) in touched {
            debug_assert_eq!(
                self.pool.key(b),
                NO_KEY,
                "moved cells are in unkeyed blocks"
            );
            let i = self.idx(b, sl);
            self.pos[i] = np;
            self.dirty.push((b, sl));
        }
        if changed {
            for t in self.targets(s) {
                if let Some(q) = self.seqs.get_mut(&t) {
                    q.tainted = true;
                }
                self.refresh_seq(t);
            }
        }
        Ok(())
    }

    /// One past the highest slot that `s` uses in block `b`.
    fn top_of(&self, s: SeqId, b: BlockId) -> usize {
        self.seqs[&s]
            .cells
            .iter()
            .filter(|c| c.0 == b)
            .map(|c| c.1 as usize + 1)
            .max()
            .unwrap_or(0)
    }

    fn writable(&self, b: BlockId) -> bool {
        self.pool.refcount(b) == 1 && self.pool.key(b) == NO_KEY
    }

    /// Copy-on-write: gives `s` a private copy `nb` (freshly allocated) of block `b`, slots
    /// `0..top`, moving all of `s`'s cells in `b` to `nb`; `b` stays pinned until the copy is
    /// handed out.
    fn copy_block(&mut self, s: SeqId, b: BlockId, nb: BlockId, top: usize) -> Result<()> {
        for sl in 0..top {
            let (i, j) = (self.idx(b, sl as u16), self.idx(nb, sl as u16));
            self.pos[j] = self.pos[i];
            self.rope[j] = self.rope[i];
            self.origin[j] = self.origin[i];
            self.tokens[j] = self.tokens[i];
            if self.pos[j] != self.rope[j] {
                self.dirty.push((nb, sl as u16));
            }
        }
        self.pool.retain(b).map_err(internal)?;
        self.pins.push(b);
        self.pending.push(CowCopy {
            src: b,
            dst: nb,
            n_slots: top as u16,
        });
        self.hold(b, false);
        self.hold(nb, true);
        let mut q = self.seqs.remove(&s).expect("sequence exists");
        let n = q.holds.remove(&b).unwrap_or(0);
        q.holds.insert(nb, n);
        q.view = None;
        self.move_cells(&mut q, b, nb);
        self.seqs.insert(s, q);
        // `s` no longer holds `b` (the pin keeps it alive).
        self.pool.release(b).map_err(internal)?;
        Ok(())
    }

    /// Moves every cell of `q` in block `from` to the same slot of block `to` (cell users
    /// follow); returns the slots moved. Holds and pool references are the caller's business.
    fn move_cells(&mut self, q: &mut Seq, from: BlockId, to: BlockId) -> Vec<u16> {
        let mut moved = Vec::new();
        for c in q.cells.iter_mut().filter(|c| c.0 == from) {
            let (i, j) = (
                from as usize * self.bs + c.1 as usize,
                to as usize * self.bs + c.1 as usize,
            );
            self.users[i] -= 1;
            if self.users[i] == 0 {
                self.live -= 1;
            }
            self.users[j] += 1;
            if self.users[j] == 1 {
                self.live += 1;
            }
            c.0 = to;
            moved.push(c.1);
        }
        moved
    }

    /// Takes `n` blocks from the pool (free ones first, then evicting the least recently used
    /// cached ones, whose keys the index forgets), or none: `KvCacheFull` (nothing changed) if
    /// the pool cannot supply them.
    fn take_blocks(&mut self, n: usize) -> Result<Vec<BlockId>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let st = self.pool.stats();
        let full = || {
            Error::KvCacheFull(format!(
                "KV cache full: need {n} more blocks, {} free and {} evictable of {}",
                st.free, st.cached, st.total
            ))
        };
        if st.free + st.cached < n {
            return Err(full());
        }
        let mut got = Vec::with_capacity(n);
        for _ in 0..n {
            match self.pool.allocate_evicting() {
                Some((b, old)) => {
                    if let (Some(ix), Some(tag)) = (&self.index, old) {
                        ix.forget(b, tag);
                    }
                    got.push(b)
                }
                None => {
                    // Only reachable when another owner of the pool raced us.
                    for b in got {
                        let _ = self.pool.release(b);
                    }
                    return Err(full());
                }
            }
        }
        // Hand out in allocation order (pop from the back).
        got.reverse();
        Ok(got)
    }

    /// Number of fresh blocks that appending `k` tokens to `s` takes.
    fn blocks_needed(&self, s: SeqId, k: usize) -> usize {
        if k == 0 {
            return 0;
        }
        let (copy, avail) = match self
            .seqs
            .get(&s)
            .and_then(|q| Some((q.cells.last()?, q.top)))
        {
            Some((&(t, _), top)) if top < self.bs => {
                (usize::from(!self.writable(t)), self.bs - top)
            }
            _ => (0, 0),
        };
        copy + (k.saturating_sub(avail)).div_ceil(self.bs)
    }

    /// Fresh blocks [`KvTable::prepare_batch`] would take from the pool for this batch now
    /// (the same count it reserves: new blocks, plus one copy of each partly filled tail that is
    /// shared or keyed), changing nothing; `InvalidInput` exactly when it would reject the
    /// batch. The batch fits the pool iff this is at most `pool().available()` (when no other
    /// owner of the pool allocates in between).
    pub fn blocks_for_batch(&self, seq_ids: &[SeqId], positions: &[Pos]) -> Result<usize> {
        if seq_ids.len() != positions.len() {
            return Err(Error::InvalidInput(format!(
                "batch has {} sequence ids but {} positions",
                seq_ids.len(),
                positions.len()
            )));
        }
        if let Some(i) = seq_ids.iter().position(|&s| s < 0) {
            return Err(Error::InvalidInput(format!(
                "token {i}: sequence id {} must be >= 0",
                seq_ids[i]
            )));
        }
        if let Some(i) = positions.iter().position(|&p| p < 0) {
            return Err(Error::InvalidInput(format!(
                "token {i}: position {} must be >= 0",
                positions[i]
            )));
        }
        // Per sequence: tokens in the batch and the last position seen so far.
        let mut count: BTreeMap<SeqId, (usize, Pos)> = BTreeMap::new();
        for (i, (&s, &p)) in seq_ids.iter().zip(positions).enumerate() {
            let e = count
                .entry(s)
                .or_insert_with(|| (0, self.seqs.get(&s).map_or(-1, |q| q.pos_max)));
            if p <= e.1 {
                let what = if e.0 == 0 {
                    format!("the last stored position of sequence {s} is {}", e.1)
                } else {
                    format!(
                        "an earlier token of sequence {s} in this batch has position {}",
                        e.1
                    )
                };
                return Err(Error::InvalidInput(format!(
                    "token {i}: position {p} of sequence {s} does not increase ({what}); \
                     positions of a sequence must increase strictly"
                )));
            }
            *e = (e.0 + 1, p);
        }
        Ok(count
            .iter()
            .map(|(&s, &(k, _))| self.blocks_needed(s, k))
            .sum())
    }

    /// Plans the writes of one token per `(seq_ids[i], positions[i])`: allocates blocks on
    /// demand, copies shared or keyed partly filled tail blocks first. All or nothing: on
    /// `KvCacheFull` or `InvalidInput` nothing changed. The returned plan also carries all
    /// pending [`Updates`]; the [`BatchTx`] must be committed or rolled back.
    ///
    /// Validation (as llama.cpp's batch check): every sequence id `>= 0`, every position
    /// `>= 0`, and the positions of each sequence strictly increase through the batch and start
    /// after the sequence's last stored position (gaps are allowed).
    pub fn prepare_batch(
        &mut self,
        seq_ids: &[SeqId],
        positions: &[Pos],
    ) -> Result<(WritePlan, BatchTx)> {
        let need = self.blocks_for_batch(seq_ids, positions)?;
        let mut fresh = self.take_blocks(need)?;
        let pins_before = self.pins.len();
        let mut tx = BatchTx {
            seqs: Vec::new(),
            pins: Vec::new(),
            pool: Arc::clone(&self.pool),
        };
        let mut tx_at: HashMap<SeqId, usize> = HashMap::new();
        let mut slots = Vec::with_capacity(seq_ids.len());
        for (&s, &p) in seq_ids.iter().zip(positions) {
            let k = *tx_at.entry(s).or_insert_with(|| {
                let n = self.seqs.get(&s).map_or(0, |q| q.cells.len());
                tx.seqs.push((s, n, None));
                tx.seqs.len() - 1
            });
            let cur = self
                .seqs
                .get(&s)
                .and_then(|q| Some((q.cells.last()?.0, q.top)));
            let (b, sl, is_fresh) = match cur {
                Some((b, top)) if top < self.bs && self.writable(b) => (b, top, false),
                Some((b, top)) if top < self.bs => {
                    let nb = fresh.pop().expect("reserved");
                    self.copy_block(s, b, nb, top)?;
                    tx.seqs[k].2 = Some((b, nb));
                    (nb, top, false)
                }
                _ => (fresh.pop().expect("reserved"), 0, true),
            };
            let i = self.idx(b, sl as u16);
            self.pos[i] = p;
            self.rope[i] = p;
            self.origin[i] = self.next_origin;
            self.next_origin += 1;
            self.add_cell(s, b, sl as u16, is_fresh)?;
            slots.push((b, sl as u16));
        }
        debug_assert!(fresh.is_empty(), "block reservation mismatch");
        for b in fresh {
            let _ = self.pool.release(b);
        }
        // The batch's copy sources stay pinned until commit or rollback.
        tx.pins = self.pins.split_off(pins_before);
        Ok((
            WritePlan {
                updates: self.take_updates(),
                slots,
            },
            tx,
        ))
    }

    /// The token ids recorded for the slots of block `b`.
    pub fn block_tokens(&self, b: BlockId) -> &[u32] {
        let i = self.idx(b, 0);
        &self.tokens[i..i + self.bs]
    }

    /// Records the token id of each written cell (content keys are computed from them).
    pub fn set_tokens(&mut self, slots: &[(BlockId, u16)], tokens: &[u32]) {
        for (&(b, sl), &t) in slots.iter().zip(tokens) {
            let i = self.idx(b, sl);
            self.tokens[i] = t;
        }
    }

    /// The batch's K/V are written: unpins its copy sources and gives every block that is now a
    /// full block of a clean prefix (docs/KV_SEMANTICS.md, "Prefix index") its content key,
    /// computed with `model_id`. Returns the blocks keyed now, as `(block, key, parent key)`;
    /// the caller indexes them.
    /// With `model_id == None` (prefix caching off) nothing is keyed.
    pub fn commit(&mut self, tx: BatchTx, model_id: Option<Key>) -> Vec<(BlockId, Key, Key)> {
        self.commit_upto(tx, model_id, |_| usize::MAX)
    }

    /// [`KvTable::commit`], keying at most the first `limit(s)` blocks of each sequence `s`
    /// (a window group keys no further than the full group's clean prefix: its K/V depend on
    /// the full layers' too).
    pub fn commit_upto(
        &mut self,
        mut tx: BatchTx,
        model_id: Option<Key>,
        limit: impl Fn(SeqId) -> usize,
    ) -> Vec<(BlockId, Key, Key)> {
        for b in std::mem::take(&mut tx.pins).into_iter().rev() {
            let _ = self.pool.release(b);
        }
        let mut keyed = Vec::new();
        if let Some(id) = model_id {
            self.key_model = Some(id);
            for (s, _, _) in std::mem::take(&mut tx.seqs) {
                self.extend_chain(s, id, limit(s), &mut keyed);
            }
        }
        keyed
    }

    /// Extends the key chain of `s` over its full clean prefix blocks (O(block size) per new
    /// block; O(cells) after a structural change).
    fn extend_chain(
        &mut self,
        s: SeqId,
        model_id: Key,
        limit: usize,
        keyed: &mut Vec<(BlockId, Key, Key)>,
    ) {
        let Some(mut q) = self.seqs.remove(&s) else {
            return;
        };
        if !q.chain_ok {
            q.chain.clear();
            q.chain_ok = true;
            // Keys of pruned cells cannot be recomputed.
            q.chain_stuck = q.front > 0;
        }
        let bs = self.bs;
        let front = q.front;
        let root = self.root(s);
        while !q.tainted
            && !q.chain_stuck
            && q.chain.len() < limit
            && (q.chain.len() + 1) * bs <= front + q.cells.len()
        {
            let k = q.chain.len();
            if k * bs < front {
                // Pruned before it was keyed.
                q.chain_stuck = true;
                break;
            }
            let cells = &q.cells[k * bs - front..(k + 1) * bs - front];
            let b = cells[0].0;
            let clean = cells.iter().enumerate().all(|(j, &(cb, sl))| {
                let i = self.idx(cb, sl);
                let p = (k * bs + j) as Pos;
                cb == b && sl as usize == j && self.pos[i] == p && self.rope[i] == p
            });
            if !clean {
                q.chain_stuck = true;
                break;
            }
            let parent = q.chain.last().copied().unwrap_or(root);
            let i0 = self.idx(b, 0);
            let key = block_key(model_id, parent, &self.tokens[i0..i0 + bs]);
            match self.pool.key(b) {
                NO_KEY => {
                    // Untagged, so private to this table, and full: nothing else writes it.
                    keyed.push((b, key, parent));
                }
                t if t == key_tag(key) => {}
                _ => {
                    // Keyed under another chain (cannot happen for a clean block); stop here.
                    q.chain_stuck = true;
                    break;
                }
            }
            q.chain.push(key);
        }
        self.seqs.insert(s, q);
    }

    /// Undoes a planned batch whose K/V could not be written: removes the cells it added and
    /// moves copied tails back to their original blocks, so that every sequence holds exactly
    /// what it held before (blocks the batch evicted from the cache stay evicted).
    pub fn rollback(&mut self, mut tx: BatchTx) {
        let mut pins = std::mem::take(&mut tx.pins);
        for (s, n_before, cow) in std::mem::take(&mut tx.seqs).into_iter().rev() {
            if let Some(mut q) = self.seqs.remove(&s) {
                let bs = self.bs;
                let mut released = Vec::new();
                for (b, sl) in q.cells.split_off(n_before.min(q.cells.len())) {
                    let i = b as usize * bs + sl as usize;
                    self.users[i] -= 1;
                    if self.users[i] == 0 {
                        self.live -= 1;
                    }
                    let h = q.holds.get_mut(&b).expect("held block");
                    *h -= 1;
                    if *h == 0 {
                        q.holds.remove(&b);
                        released.push(b);
                    }
                }
                if let Some((b, nb)) = cow {
                    // Back to the original block: the pin becomes the sequence's reference.
                    if let Some(n) = q.holds.remove(&nb) {
                        if let Some(j) = pins.iter().position(|&x| x == b) {
                            pins.swap_remove(j);
                        } else {
                            let _ = self.pool.retain(b);
                        }
                        q.holds.insert(b, n);
                        self.hold(b, true);
                        released.push(nb);
                        for sl in self.move_cells(&mut q, nb, b) {
                            let i = self.idx(b, sl);
                            if self.pos[i] != self.rope[i] {
                                self.dirty.push((b, sl));
                            }
                        }
                    }
                }
                for b in released.into_iter().rev() {
                    self.hold(b, false);
                    let _ = self.pool.release(b);
                }
                if !q.cells.is_empty() {
                    // Back to what it held before the batch, whose chain still holds.
                    let kept = (std::mem::take(&mut q.chain), q.chain_ok);
                    self.refresh(&mut q);
                    if kept.1 {
                        q.chain = kept.0;
                        q.chain.truncate((q.front + q.cells.len()) / bs);
                        q.chain_ok = true;
                    }
                    self.seqs.insert(s, q);
                }
            }
        }
        for b in pins.into_iter().rev() {
            let _ = self.pool.release(b);
        }
    }

    /// The blocks and slot positions of `s` for attention (cached; see the module docs).
    pub fn view(&mut self, s: SeqId) -> SeqView {
        let Some(mut q) = self.seqs.remove(&s) else {
            return SeqView::default();
        };
        if q.view.is_none() {
            q.view = Some(self.build_view(&q));
        }
        let v = q.view.clone().expect("built above");
        self.seqs.insert(s, q);
        v
    }

    fn build_view(&self, q: &Seq) -> SeqView {
        let bs = self.bs;
        let mut v = SeqView::default();
        let mut at: HashMap<BlockId, usize> = HashMap::with_capacity(q.holds.len());
        for &(b, sl) in &q.cells {
            let k = *at.entry(b).or_insert_with(|| {
                v.blocks.push(b);
                v.positions.extend(std::iter::repeat_n(-1, bs));
                v.blocks.len() - 1
            });
            v.positions[k * bs + sl as usize] = self.pos[self.idx(b, sl)];
        }
        v
    }

    /// Attaches whole blocks to the empty sequence `s`: block `blocks[i]` provides positions
    /// `[i*bs, (i+1)*bs)` in slot order, holding `tokens[i*bs..(i+1)*bs]` under content key
    /// `keys[i]` (the blocks come from the prefix index, possibly written by another context).
    /// The caller must already hold one pool reference per block (e.g. from
    /// `BlockPool::revive`), which passes to the sequence. Fails with `InvalidInput` (nothing
    /// changed, references still the caller's) if `s < 0`, `s` has cells, a block repeats, or a
    /// block this table already uses holds other positions.
    pub fn attach_blocks(
        &mut self,
        s: SeqId,
        blocks: &[BlockId],
        keys: &[Key],
        tokens: &[u32],
    ) -> Result<()> {
        self.attach_blocks_at(s, 0, blocks, keys, tokens)
    }

    /// [`KvTable::attach_blocks`] for a window group that resumes past its window: `blocks`
    /// are the sequence's blocks number `first ..` (positions from `first * bs` on; the ones
    /// before lie outside the window and are not needed), `keys` the content keys of all its
    /// blocks `0 .. first + blocks.len()`, `tokens` those of `blocks` only. The sequence is
    /// then a clean run pruned at its front (`front = first * bs`), so the blocks it fills
    /// next are keyed in turn.
    pub fn attach_blocks_at(
        &mut self,
        s: SeqId,
        first: usize,
        blocks: &[BlockId],
        keys: &[Key],
        tokens: &[u32],
    ) -> Result<()> {
        if s < 0 {
            return Err(Error::InvalidInput(format!(
                "attach needs a sequence id >= 0, got {s}"
            )));
        }
        if self.seqs.contains_key(&s) {
            return Err(Error::InvalidInput(format!(
                "sequence {s} is not empty; prefix blocks attach only to a new sequence"
            )));
        }
        let distinct: HashSet<BlockId> = blocks.iter().copied().collect();
        if distinct.len() != blocks.len()
            || blocks.iter().any(|&b| b as usize >= self.pool.total())
            || keys.len() != first + blocks.len()
            || tokens.len() != blocks.len() * self.bs
        {
            return Err(Error::InvalidInput(
                "attach: blocks must be distinct pool blocks, one key and block_size tokens each"
                    .into(),
            ));
        }
        // A block some sequence of this table already uses must hold exactly these positions
        // (a cached block is never shifted in place, so this holds unless the caller errs).
        for (i, &b) in blocks.iter().enumerate() {
            for sl in 0..self.bs {
                let c = self.idx(b, sl as u16);
                let p = ((first + i) * self.bs + sl) as Pos;
                if self.users[c] > 0 && (self.pos[c] != p || self.rope[c] != p) {
                    return Err(Error::InvalidInput(format!(
                        "attach: block {b} slot {sl} holds position {} (rotated for {}), not {p}",
                        self.pos[c], self.rope[c]
                    )));
                }
            }
        }
        for (i, &b) in blocks.iter().enumerate() {
            for sl in 0..self.bs {
                let c = self.idx(b, sl as u16);
                if self.users[c] == 0 {
                    let p = ((first + i) * self.bs + sl) as Pos;
                    self.pos[c] = p;
                    self.rope[c] = p;
                    self.tokens[c] = tokens[i * self.bs + sl];
                    self.origin[c] = self.next_origin;
                    self.next_origin += 1;
                }
            }
        }
        for &b in blocks {
            for sl in 0..self.bs {
                // The first cell takes over the caller's reference (`fresh`).
                self.add_cell(s, b, sl as u16, true)?;
            }
        }
        if let Some(q) = self.seqs.get_mut(&s) {
            q.chain = keys.to_vec();
            q.chain_ok = true;
            q.chain_stuck = false;
            q.front = first * self.bs;
        }
        Ok(())
    }

    /// Plans the writes of `positions.len()` tokens of sequence `s`.
    pub fn prepare_write(&mut self, s: SeqId, positions: &[Pos]) -> Result<(WritePlan, BatchTx)> {
        self.prepare_batch(&vec![s; positions.len()], positions)
    }

    /// Hands out pending copies and K-shifts (to apply in that order) and unpins copy sources.
    pub fn take_updates(&mut self) -> Updates {
        let copies = std::mem::take(&mut self.pending);
        let mut shifts = Vec::new();
        for (b, sl) in std::mem::take(&mut self.dirty) {
            let i = self.idx(b, sl);
            if self.users[i] > 0 && self.pos[i] != self.rope[i] {
                shifts.push(CellShift {
                    block: b,
                    slot: sl,
                    delta: self.pos[i] - self.rope[i],
                });
                self.rope[i] = self.pos[i];
            }
        }
        for b in std::mem::take(&mut self.pins).into_iter().rev() {
            let _ = self.pool.release(b);
        }
        Updates { copies, shifts }
    }

    /// Whether any copy or K-shift is waiting to be taken.
    pub fn has_updates(&self) -> bool {
        !self.pending.is_empty() || !self.dirty.is_empty()
    }

    /// Smallest position of `s` (over all sequences if `s < 0`), -1 if none.
    pub fn seq_pos_min(&self, s: SeqId) -> Pos {
        self.pos_fold(s).map_or(-1, |(lo, _)| lo)
    }

    /// Largest position of `s` (over all sequences if `s < 0`), -1 if none.
    pub fn seq_pos_max(&self, s: SeqId) -> Pos {
        self.pos_fold(s).map_or(-1, |(_, hi)| hi)
    }

    fn pos_fold(&self, s: SeqId) -> Option<(Pos, Pos)> {
        let mut r: Option<(Pos, Pos)> = None;
        let mut fold = |q: &Seq| {
            if !q.cells.is_empty() {
                r = Some(r.map_or((q.pos_min, q.pos_max), |(lo, hi)| {
                    (lo.min(q.pos_min), hi.max(q.pos_max))
                }));
            }
        };
        if s >= 0 {
            if let Some(q) = self.seqs.get(&s) {
                fold(q);
            }
        } else {
            self.seqs.values().for_each(fold);
        }
        r
    }

    /// Counts over the table, O(1).
    pub fn stats(&self) -> TableStats {
        TableStats {
            sequences: self.seqs.len(),
            live_cells: self.live,
            held_blocks: self.held,
            unused_slots: self.held * self.bs - self.live,
        }
    }

    /// Distinct cells referenced by at least one sequence, in O(1) (the decode hot path asks).
    pub fn live_cells(&self) -> usize {
        self.live
    }

    /// Full consistency check (tests, debugging): recomputes holds and cell users from the
    /// sequence lists, checks pool refcounts (= holding sequences + pins for unkeyed blocks, at
    /// least that for keyed ones, which other contexts may hold) and runs the pool audit (so
    /// call it while no other context of the pool is working).
    pub fn check(&self) -> Result<(), String> {
        let mut users = vec![0u16; self.users.len()];
        let mut refs: HashMap<BlockId, u32> = HashMap::new();
        for (&s, q) in &self.seqs {
            if q.cells.is_empty() {
                return Err(format!("sequence {s} is empty but present"));
            }
            let mut holds: HashMap<BlockId, u32> = HashMap::new();
            let mut seen = HashSet::new();
            for &(b, sl) in &q.cells {
                if sl as usize >= self.bs {
                    return Err(format!("seq {s}: slot {sl} out of range"));
                }
                if !seen.insert((b, sl)) {
                    return Err(format!("seq {s} references cell ({b},{sl}) twice"));
                }
                let i = self.idx(b, sl);
                users[i] += 1;
                if self.pos[i] < 0 {
                    return Err(format!(
                        "seq {s}: cell ({b},{sl}) has position {}",
                        self.pos[i]
                    ));
                }
                *holds.entry(b).or_default() += 1;
            }
            if holds != q.holds {
                return Err(format!("seq {s}: hold counts out of sync"));
            }
            for &b in holds.keys() {
                *refs.entry(b).or_default() += 1;
            }
        }
        if users != self.users {
            return Err("cell user counts out of sync".into());
        }
        let mut holders = vec![0u32; self.holders.len()];
        for q in self.seqs.values() {
            for &b in q.holds.keys() {
                holders[b as usize] += 1;
            }
        }
        if holders != self.holders || self.held != holders.iter().filter(|&&h| h > 0).count() {
            return Err("block holder counts out of sync".into());
        }
        for (&s, q) in &self.seqs {
            let mut r = q.clone();
            self.refresh(&mut r);
            if (r.top, r.pos_min, r.pos_max) != (q.top, q.pos_min, q.pos_max) {
                return Err(format!(
                    "seq {s}: derived (top, pos_min, pos_max) = {:?}, cells say {:?}",
                    (q.top, q.pos_min, q.pos_max),
                    (r.top, r.pos_min, r.pos_max)
                ));
            }
            if let Some(v) = &q.view {
                if *v != self.build_view(q) {
                    return Err(format!("seq {s}: cached view is stale"));
                }
            }
            if q.chain_ok && q.chain.len() * self.bs > q.front + q.cells.len() {
                return Err(format!(
                    "seq {s}: {} chain keys for {} cells (front {})",
                    q.chain.len(),
                    q.cells.len(),
                    q.front
                ));
            }
            // Every chain key of a block the sequence still holds whole names exactly that
            // block's tokens after the previous key (a clean run from position 0).
            if let (true, false, Some(id)) = (q.chain_ok, q.tainted, self.key_model) {
                let bs = self.bs;
                for (k, &key) in q.chain.iter().enumerate() {
                    if k * bs < q.front {
                        continue;
                    }
                    let cells = &q.cells[k * bs - q.front..(k + 1) * bs - q.front];
                    let b = cells[0].0;
                    let plain = cells.iter().enumerate().all(|(j, &(cb, sl))| {
                        cb == b
                            && sl as usize == j
                            && self.pos[self.idx(cb, sl)] == (k * bs + j) as Pos
                    });
                    let parent = if k == 0 { self.root(s) } else { q.chain[k - 1] };
                    let i0 = self.idx(b, 0);
                    let want = block_key(id, parent, &self.tokens[i0..i0 + bs]);
                    if !plain || key != want {
                        return Err(format!(
                            "seq {s}: chain key {k} does not name its cells (plain run: {plain})"
                        ));
                    }
                }
            }
        }
        let live = users.iter().filter(|&&u| u > 0).count();
        if live != self.live {
            return Err(format!(
                "live cell count {} but {live} cells have users",
                self.live
            ));
        }
        for &b in &self.pins {
            *refs.entry(b).or_default() += 1;
        }
        // Blocks without a key are private to this table: their refcount is exactly what it
        // holds. Keyed blocks may also be held by other contexts of the shared pool.
        for b in 0..self.pool.total() as BlockId {
            let want = refs.get(&b).copied().unwrap_or(0);
            let have = self.pool.refcount(b);
            let keyed = self.pool.key(b) != NO_KEY;
            if have < want || (!keyed && want > 0 && have != want) {
                return Err(format!(
                    "block {b}: pool refcount {have} but table holds {want} (keyed: {keyed})"
                ));
            }
        }
        // Cells shared by several sequences agree on position by construction (one pos per
        // cell); a cell needing a shift must be recorded as dirty.
        for q in self.seqs.values() {
            for &(b, sl) in &q.cells {
                let i = self.idx(b, sl);
                if self.pos[i] != self.rope[i] && !self.dirty.contains(&(b, sl)) {
                    return Err(format!(
                        "cell ({b},{sl}) needs a shift that is not recorded"
                    ));
                }
            }
        }
        self.pool.audit()
    }
}
