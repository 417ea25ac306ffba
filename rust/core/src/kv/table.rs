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
//! Complexity: `prepare_batch` is O(tokens + pool scan for the availability check); `seq_rm`,
//! `seq_cp`, `seq_add`, `seq_div`, `seq_pos_min/max` are O(cells of the sequences involved);
//! `seq_keep` and `clear` are O(all cells).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use super::pool::{BlockId, BlockPool, NO_KEY};
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

#[derive(Debug, Default, Clone)]
struct Seq {
    cells: Vec<(BlockId, u16)>,
    /// Block -> number of this sequence's cells in it (each entry = one pool reference).
    holds: HashMap<BlockId, u32>,
    /// Some cell of the sequence was moved (`seq_add`/`seq_div`) or it received cells of another
    /// sequence (`seq_cp` into a non-empty or from a tainted sequence): its blocks get no
    /// content keys. Reset when the sequence becomes empty.
    tainted: bool,
}

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
    bs: usize,
    seqs: BTreeMap<SeqId, Seq>,
    users: Vec<u16>,
    /// Cells with at least one user (kept in step with `users`, so the hot path need not scan).
    live: usize,
    pos: Vec<Pos>,
    rope: Vec<Pos>,
    /// Per cell: id of the write that produced its content (kept by copy-on-write).
    origin: Vec<u64>,
    next_origin: u64,
    pending: Vec<CowCopy>,
    pins: Vec<BlockId>,
    dirty: Vec<(BlockId, u16)>,
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
        if block_size == 0 || block_size > 32768 {
            return Err(Error::InvalidInput(format!(
                "kv block size must be in 1..=32768, got {block_size}"
            )));
        }
        let n = pool.total() * block_size;
        Ok(KvTable {
            pool,
            bs: block_size,
            seqs: BTreeMap::new(),
            users: vec![0; n],
            live: 0,
            pos: vec![-1; n],
            rope: vec![-1; n],
            origin: vec![0; n],
            next_origin: 1,
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
    fn drop_cells(&mut self, s: SeqId, mut drop: impl FnMut(Pos) -> bool) {
        let Some(mut q) = self.seqs.remove(&s) else {
            return;
        };
        let mut released = Vec::new();
        let bs = self.bs;
        q.cells.retain(|&(b, sl)| {
            let i = b as usize * bs + sl as usize;
            if !drop(self.pos[i]) {
                return true;
            }
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
            // A held block has refcount >= 1, so this cannot fail.
            let _ = self.pool.release(b);
        }
        if !q.cells.is_empty() {
            self.seqs.insert(s, q);
        }
    }

    /// Adds cell `(b, sl)` to the end of `s`; takes a pool reference if `s` did not hold `b`.
    fn add_cell(&mut self, s: SeqId, b: BlockId, sl: u16, fresh: bool) -> Result<()> {
        let q = self.seqs.entry(s).or_default();
        let h = q.holds.entry(b).or_insert(0);
        if *h == 0 && !fresh {
            self.pool.retain(b).map_err(internal)?;
        }
        *h += 1;
        q.cells.push((b, sl));
        let i = b as usize * self.bs + sl as usize;
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
            self.drop_cells(t, |p| p >= p0 && p < p1);
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
        for (b, sl) in add {
            self.add_cell(dst, b, sl, false)?;
        }
        if let Some(q) = self.seqs.get_mut(&dst) {
            q.tainted |= !clean;
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
                self.drop_cells(t, |_| true);
            }
        }
        Ok(())
    }

    /// Removes every sequence. Blocks with a content key stay cached in the pool; pending copies
    /// are dropped (their destinations belonged to the removed sequences).
    pub fn clear(&mut self) {
        for t in self.targets(-1) {
            self.drop_cells(t, |_| true);
        }
        self.pending.clear();
        self.dirty.clear();
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
        // With one sequence, cells it shares with others must become private first. With all
        // sequences, every user of a cell moves it the same way, so in place is fine.
        let mut cow: Vec<(SeqId, BlockId)> = Vec::new();
        if s >= 0 {
            for &t in &targets {
                let q = &self.seqs[&t];
                let mut seen = HashSet::new();
                for &(b, sl) in &q.cells {
                    let i = self.idx(b, sl);
                    let p = self.pos[i];
                    if in_range(p) && f(p) >= 0 && self.users[i] >= 2 && seen.insert(b) {
                        cow.push((t, b));
                    }
                }
            }
        }
        let mut fresh = self.reserve(cow.len())?;
        for (t, b) in cow {
            let nb = fresh.pop().expect("reserved");
            let top = self.top_of(t, b);
            self.copy_block(t, b, nb, top)?;
        }
        // Removals first, decided on the old positions.
        let mut removed_any = false;
        for &t in &targets {
            self.drop_cells(t, |p| {
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
        if !touched.is_empty() || removed_any {
            for t in self.targets(s) {
                if let Some(q) = self.seqs.get_mut(&t) {
                    q.tainted = true;
                }
            }
        }
        for (b, sl, np) in touched {
            let i = self.idx(b, sl);
            self.pos[i] = np;
            self.dirty.push((b, sl));
            if self.pool.key(b) != NO_KEY {
                // Content changed: it no longer matches its index key.
                self.pool.set_key(b, NO_KEY).map_err(internal)?;
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
        let bs = self.bs;
        let q = self.seqs.get_mut(&s).expect("sequence exists");
        let n = q.holds.remove(&b).unwrap_or(0);
        q.holds.insert(nb, n);
        for c in q.cells.iter_mut().filter(|c| c.0 == b) {
            let (from, to) = (
                b as usize * bs + c.1 as usize,
                nb as usize * bs + c.1 as usize,
            );
            self.users[from] -= 1;
            if self.users[from] == 0 {
                self.live -= 1;
            }
            self.users[to] += 1;
            if self.users[to] == 1 {
                self.live += 1;
            }
            c.0 = nb;
        }
        // `s` no longer holds `b` (the pin keeps it alive).
        self.pool.release(b).map_err(internal)?;
        Ok(())
    }

    /// Allocates `n` blocks or none: `KvCacheFull` (nothing changed) if the pool cannot supply
    /// them.
    fn reserve(&mut self, n: usize) -> Result<Vec<BlockId>> {
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
            match self.pool.allocate() {
                Some(b) => got.push(b),
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
        let (copy, avail) = match self.seqs.get(&s).and_then(|q| q.cells.last()) {
            Some(&(t, _)) => {
                let top = self.top_of(s, t);
                if top < self.bs {
                    (usize::from(!self.writable(t)), self.bs - top)
                } else {
                    (0, 0)
                }
            }
            None => (0, 0),
        };
        copy + (k.saturating_sub(avail)).div_ceil(self.bs)
    }

    /// Plans the writes of one token per `(seq_ids[i], positions[i])`: allocates blocks on
    /// demand, copies shared partly filled tail blocks first. All or nothing: on
    /// `KvCacheFull` nothing changed. The returned plan also carries all pending [`Updates`].
    pub fn prepare_batch(&mut self, seq_ids: &[SeqId], positions: &[Pos]) -> Result<WritePlan> {
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
        let mut count: BTreeMap<SeqId, usize> = BTreeMap::new();
        for &s in seq_ids {
            *count.entry(s).or_default() += 1;
        }
        let need: usize = count.iter().map(|(&s, &k)| self.blocks_needed(s, k)).sum();
        let mut fresh = self.reserve(need)?;
        let mut slots = Vec::with_capacity(seq_ids.len());
        // Per sequence: the block and top of the last write in this batch (avoids rescans).
        let mut tail: HashMap<SeqId, (BlockId, usize)> = HashMap::new();
        for (&s, &p) in seq_ids.iter().zip(positions) {
            let cur = match tail.get(&s) {
                Some(&(b, top)) => Some((b, top, true)),
                None => self
                    .seqs
                    .get(&s)
                    .and_then(|q| q.cells.last())
                    .map(|&(b, _)| {
                        let top = self.top_of(s, b);
                        (b, top, self.writable(b))
                    }),
            };
            let (b, sl, is_fresh) = match cur {
                Some((b, top, true)) if top < self.bs => (b, top, false),
                Some((b, top, false)) if top < self.bs => {
                    let nb = fresh.pop().expect("reserved");
                    self.copy_block(s, b, nb, top)?;
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
            tail.insert(s, (b, sl + 1));
            slots.push((b, sl as u16));
        }
        debug_assert!(fresh.is_empty(), "block reservation mismatch");
        for b in fresh {
            let _ = self.pool.release(b);
        }
        Ok(WritePlan {
            updates: self.take_updates(),
            slots,
        })
    }

    /// If `s` is untainted and block `b` holds exactly its cells number `i*bs .. (i+1)*bs` in
    /// slot order with positions `i*bs + slot` (no pending shift), and so do all blocks before
    /// it: `Some((i, parent))` where `parent` is the block of cells `(i-1)*bs..` (`None` for
    /// `i == 0`). Such a block may get a content key (docs/KV_SEMANTICS.md, "Prefix index").
    pub fn full_prefix_block(&self, s: SeqId, b: BlockId) -> Option<(usize, Option<BlockId>)> {
        let q = self.seqs.get(&s)?;
        if q.tainted {
            return None;
        }
        let bs = self.bs;
        let k = q.cells.iter().position(|c| *c == (b, 0))?;
        if k % bs != 0 || k + bs > q.cells.len() {
            return None;
        }
        for (j, &(cb, sl)) in q.cells[..k + bs].iter().enumerate() {
            let i = self.idx(cb, sl);
            if sl as usize != j % bs
                || cb != q.cells[j - j % bs].0
                || self.pos[i] != j as Pos
                || self.rope[i] != j as Pos
            {
                return None;
            }
        }
        Some((k / bs, (k > 0).then(|| q.cells[k - bs].0)))
    }

    /// Attaches whole blocks to the empty sequence `s`: block `blocks[i]` provides positions
    /// `[i*bs, (i+1)*bs)` in slot order. The caller must already hold one pool reference per
    /// block (e.g. from `BlockPool::revive`), which passes to the sequence. Fails with
    /// `InvalidInput` (nothing changed, references still the caller's) if `s < 0`, `s` has cells
    /// or a block repeats.
    pub fn attach_blocks(&mut self, s: SeqId, blocks: &[BlockId]) -> Result<()> {
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
        if distinct.len() != blocks.len() || blocks.iter().any(|&b| b as usize >= self.pool.total())
        {
            return Err(Error::InvalidInput(
                "attach: blocks must be distinct pool blocks".into(),
            ));
        }
        // The cells keep their position and rotation from when they were written; they must be
        // exactly the positions the block provides here.
        for (i, &b) in blocks.iter().enumerate() {
            for sl in 0..self.bs {
                let c = self.idx(b, sl as u16);
                let p = (i * self.bs + sl) as Pos;
                if self.pos[c] != p || self.rope[c] != p {
                    return Err(Error::InvalidInput(format!(
                        "attach: block {b} slot {sl} holds position {} (rotated for {}), not {p}",
                        self.pos[c], self.rope[c]
                    )));
                }
            }
        }
        for &b in blocks {
            for sl in 0..self.bs {
                // The first cell takes over the caller's reference (`fresh`).
                self.add_cell(s, b, sl as u16, true)?;
            }
        }
        Ok(())
    }

    /// Plans the writes of `positions.len()` tokens of sequence `s`.
    pub fn prepare_write(&mut self, s: SeqId, positions: &[Pos]) -> Result<WritePlan> {
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
        for t in self.targets(s) {
            for &(b, sl) in &self.seqs[&t].cells {
                let p = self.pos[self.idx(b, sl)];
                r = Some(r.map_or((p, p), |(lo, hi)| (lo.min(p), hi.max(p))));
            }
        }
        r
    }

    /// Counts over the table (O(cells)).
    pub fn stats(&self) -> TableStats {
        let mut held = HashSet::new();
        for q in self.seqs.values() {
            held.extend(q.holds.keys().copied());
        }
        TableStats {
            sequences: self.seqs.len(),
            live_cells: self.live,
            held_blocks: held.len(),
            unused_slots: held.len() * self.bs - self.live,
        }
    }

    /// Distinct cells referenced by at least one sequence, in O(1) (the decode hot path asks).
    pub fn live_cells(&self) -> usize {
        self.live
    }

    /// Full consistency check (tests, debugging): recomputes holds and cell users from the
    /// sequence lists, checks pool refcounts (= holding sequences + pins) and runs the pool audit.
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
        for b in 0..self.pool.total() as BlockId {
            let want = refs.get(&b).copied().unwrap_or(0);
            if self.pool.refcount(b) != want {
                return Err(format!(
                    "block {b}: pool refcount {} but table holds {want}",
                    self.pool.refcount(b)
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
