//! Tests of the block tables: unit cases and random operation sequences checked against a
//! reference model (per sequence an ordered list of (position, content id)) through a fake
//! storage that executes the plans (copies, K-shifts, writes) on (content id, rope position).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::*;
use crate::error::Error;

use crate::test_rng::Rng;

/// Fake K/V storage: per cell (content id, position its K is rotated for).
struct Storage {
    bs: usize,
    cells: Vec<Option<(u64, Pos)>>,
}

impl Storage {
    fn new(n_blocks: usize, bs: usize) -> Storage {
        Storage {
            bs,
            cells: vec![None; n_blocks * bs],
        }
    }
    fn apply(&mut self, u: &Updates) {
        for c in &u.copies {
            for sl in 0..c.n_slots as usize {
                self.cells[c.dst as usize * self.bs + sl] =
                    self.cells[c.src as usize * self.bs + sl];
            }
        }
        for s in &u.shifts {
            let c = self.cells[s.block as usize * self.bs + s.slot as usize]
                .as_mut()
                .expect("shift of a never-written cell");
            c.1 += s.delta;
        }
    }
    fn write(&mut self, plan: &WritePlan, ids: &[u64], pos: &[Pos]) {
        self.apply(&plan.updates);
        for (k, &(b, sl)) in plan.slots.iter().enumerate() {
            self.cells[b as usize * self.bs + sl as usize] = Some((ids[k], pos[k]));
        }
    }
    fn get(&self, b: BlockId, sl: u16) -> (u64, Pos) {
        self.cells[b as usize * self.bs + sl as usize].expect("read of a never-written cell")
    }
}

/// The reference semantics.
#[derive(Default, Clone, PartialEq, Debug)]
struct Model {
    seqs: BTreeMap<SeqId, Vec<(Pos, u64)>>,
}

fn rng_of(p0: Pos, p1: Pos) -> impl Fn(Pos) -> bool {
    let lo = p0.max(0);
    let hi = if p1 < 0 { Pos::MAX } else { p1 };
    move |p| p >= lo && p < hi
}

impl Model {
    fn ids(&self, s: SeqId) -> Vec<SeqId> {
        if s < 0 {
            self.seqs.keys().copied().collect()
        } else {
            vec![s]
        }
    }
    fn tidy(&mut self) {
        self.seqs.retain(|_, v| !v.is_empty());
    }
    fn rm(&mut self, s: SeqId, p0: Pos, p1: Pos) {
        let r = rng_of(p0, p1);
        for t in self.ids(s) {
            if let Some(v) = self.seqs.get_mut(&t) {
                v.retain(|c| !r(c.0));
            }
        }
        self.tidy();
    }
    fn cp(&mut self, a: SeqId, b: SeqId, p0: Pos, p1: Pos) {
        if a == b {
            return;
        }
        let r = rng_of(p0, p1);
        let src = self.seqs.get(&a).cloned().unwrap_or_default();
        let dst = self.seqs.entry(b).or_default();
        for c in src {
            if r(c.0) && !dst.contains(&c) {
                dst.push(c);
            }
        }
        self.tidy();
    }
    fn keep(&mut self, s: SeqId) {
        self.seqs.retain(|&t, _| t == s);
    }
    fn shift(&mut self, s: SeqId, p0: Pos, p1: Pos, f: impl Fn(Pos) -> Pos) {
        let r = rng_of(p0, p1);
        for t in self.ids(s) {
            if let Some(v) = self.seqs.get_mut(&t) {
                v.retain_mut(|c| {
                    if r(c.0) {
                        c.0 = f(c.0);
                    }
                    c.0 >= 0
                });
            }
        }
        self.tidy();
    }
    fn pos_max(&self, s: SeqId) -> Pos {
        self.ids(s)
            .iter()
            .filter_map(|t| self.seqs.get(t))
            .flat_map(|v| v.iter().map(|c| c.0))
            .max()
            .unwrap_or(-1)
    }
    fn pos_min(&self, s: SeqId) -> Pos {
        self.ids(s)
            .iter()
            .filter_map(|t| self.seqs.get(t))
            .flat_map(|v| v.iter().map(|c| c.0))
            .min()
            .unwrap_or(-1)
    }
}

/// Plans a batch and commits it at once (the storage executes the plan), as a decode does.
trait Plan {
    fn plan_batch(&mut self, seqs: &[SeqId], pos: &[Pos]) -> crate::Result<WritePlan>;
    fn plan_write(&mut self, s: SeqId, pos: &[Pos]) -> crate::Result<WritePlan>;
}

impl Plan for KvTable {
    fn plan_batch(&mut self, seqs: &[SeqId], pos: &[Pos]) -> crate::Result<WritePlan> {
        let (plan, tx) = self.prepare_batch(seqs, pos)?;
        let _ = self.commit(tx, None);
        Ok(plan)
    }
    fn plan_write(&mut self, s: SeqId, pos: &[Pos]) -> crate::Result<WritePlan> {
        self.plan_batch(&vec![s; pos.len()], pos)
    }
}

fn table(n_blocks: u32, bs: usize) -> KvTable {
    KvTable::new(Arc::new(BlockPool::new(n_blocks)), bs).unwrap()
}

/// Everything observable about a table and its pool, to check "nothing changed".
type Snapshot = (Vec<Vec<(Pos, BlockId, u16)>>, Vec<(u32, u64)>, PoolStats);

fn snapshot(t: &KvTable) -> Snapshot {
    let seqs = t.seq_ids().into_iter().map(|s| t.cells(s)).collect();
    let p = t.pool();
    let blocks = (0..p.total() as u32)
        .map(|b| (p.refcount(b), p.key(b)))
        .collect();
    (seqs, blocks, p.stats())
}

/// Compares table + storage with the model; `synced` = all updates were applied.
fn compare(t: &KvTable, st: &Storage, m: &Model, synced: bool) {
    t.check().unwrap();
    let ids: Vec<SeqId> = m.seqs.keys().copied().collect();
    assert_eq!(t.seq_ids(), ids, "sequence sets differ");
    for (&s, want) in &m.seqs {
        let got: Vec<(Pos, u64)> = t
            .cells(s)
            .into_iter()
            .map(|(p, b, sl)| {
                if !synced {
                    // Storage is behind (copies pending): positions only.
                    let id = want.iter().find(|c| c.0 == p).map_or(0, |c| c.1);
                    return (p, id);
                }
                let (id, rope) = st.get(b, sl);
                if synced {
                    assert_eq!(
                        rope, p,
                        "seq {s}: cell ({b},{sl}) K rotated for {rope}, pos {p}"
                    );
                }
                (p, id)
            })
            .collect();
        if synced {
            assert_eq!(&got, want, "seq {s} differs from the model");
        } else {
            let gp: Vec<Pos> = got.iter().map(|c| c.0).collect();
            let wp: Vec<Pos> = want.iter().map(|c| c.0).collect();
            assert_eq!(gp, wp, "seq {s} positions differ from the model");
        }
        assert_eq!(t.seq_pos_max(s), m.pos_max(s));
        assert_eq!(t.seq_pos_min(s), m.pos_min(s));
    }
    assert_eq!(t.seq_pos_max(-1), m.pos_max(-1));
    assert_eq!(t.seq_pos_min(-1), m.pos_min(-1));
    let ts = t.stats();
    let ps = t.pool().stats();
    if synced {
        // No leaks: the pool's referenced blocks are exactly the blocks sequences hold.
        assert_eq!(ps.referenced, ts.held_blocks);
    }
    // Every held block holds at least one referenced cell.
    let entries: usize = m.seqs.values().map(Vec::len).sum();
    assert!(ts.held_blocks <= entries);
}

#[test]
fn random_operations_match_the_model() {
    let mut rng = Rng(0x5EED_0001);
    let mut full_hits = 0;
    let (mut invalid_hits, mut rollbacks) = (0, 0);
    let mut ops_done = 0;
    for case in 0..1500 {
        let bs = [1, 2, 3, 4, 8][rng.below(5)];
        let n_blocks = 4 + rng.below(24) as u32;
        let mut t = table(n_blocks, bs);
        let mut st = Storage::new(n_blocks as usize, bs);
        let mut m = Model::default();
        let mut next_id = 1u64;
        let mut synced = true;
        for _ in 0..60 {
            ops_done += 1;
            let s = rng.range(-1, 3);
            let sp = rng.range(0, 3);
            let p0 = rng.range(-1, 12);
            let p1 = if rng.below(4) == 0 {
                -1
            } else {
                p0.max(0) + rng.range(0, 8)
            };
            let before = snapshot(&t);
            match rng.below(100) {
                0..=34 => {
                    // A batch over one or two sequences; positions mostly continue each one.
                    let n = 1 + rng.below(2 * bs + 2);
                    let mut seqs = Vec::new();
                    let mut pos = Vec::new();
                    let mut next: BTreeMap<SeqId, Pos> = BTreeMap::new();
                    let pair = [sp, rng.range(0, 3)];
                    for _ in 0..n {
                        let q = pair[rng.below(2)];
                        let p = next.entry(q).or_insert_with(|| m.pos_max(q) + 1);
                        let pp = if rng.below(8) == 0 {
                            rng.range(0, 20)
                        } else {
                            *p
                        };
                        *p = pp + 1;
                        seqs.push(q);
                        pos.push(pp);
                    }
                    // llama.cpp's rule: per sequence, positions increase strictly and start
                    // after the last stored one.
                    let mut last: BTreeMap<SeqId, Pos> = BTreeMap::new();
                    let valid = seqs.iter().zip(&pos).all(|(&q, &p)| {
                        let l = last.entry(q).or_insert_with(|| m.pos_max(q));
                        let ok = p > *l;
                        *l = p;
                        ok
                    });
                    let roll_back = rng.below(4) == 0;
                    // Pending copies/shifts are applied by the batch and stay applied (their
                    // pins are released): only then may a rolled-back pool differ.
                    let had_updates = t.has_updates();
                    match t.prepare_batch(&seqs, &pos) {
                        Ok((plan, tx)) => {
                            assert!(valid, "invalid batch accepted: {seqs:?} {pos:?}");
                            assert_eq!(plan.slots.len(), n);
                            let ids: Vec<u64> = (0..n as u64).map(|k| next_id + k).collect();
                            next_id += n as u64;
                            st.write(&plan, &ids, &pos);
                            if roll_back {
                                // The K/V "failed": the table must hold what it held before.
                                let evicted = t.pool().stats().cached < before.2.cached;
                                t.rollback(tx);
                                rollbacks += 1;
                                synced &= !t.has_updates();
                                let after = snapshot(&t);
                                assert_eq!(after.0, before.0, "rollback left other cells");
                                if !evicted && !had_updates {
                                    assert_eq!(after, before, "rollback changed the pool");
                                }
                            } else {
                                // Half the batches key their full clean blocks (the chain
                                // invariants of `check` then apply).
                                let id = (rng.below(2) == 0).then_some(0x1234_5678);
                                let _ = t.commit(tx, id);
                                synced = true;
                                for k in 0..n {
                                    m.seqs.entry(seqs[k]).or_default().push((pos[k], ids[k]));
                                }
                            }
                        }
                        Err(Error::KvCacheFull(_)) => {
                            full_hits += 1;
                            assert_eq!(snapshot(&t), before, "failed batch changed state");
                        }
                        Err(Error::InvalidInput(e)) => {
                            assert!(!valid, "valid batch rejected: {e}");
                            invalid_hits += 1;
                            assert_eq!(snapshot(&t), before, "rejected batch changed state");
                        }
                        Err(e) => panic!("unexpected error {e}"),
                    }
                }
                35..=42 => {
                    t.seq_rm(s, p0, p1);
                    m.rm(s, p0, p1);
                }
                43..=46 => {
                    // A window group's pruning: the same cells go as with seq_rm(s, 0, p0).
                    t.prune_front(sp, p0);
                    if p0 > 0 {
                        m.rm(sp, 0, p0); // (p1 = p0 <= 0 would mean "to the end" there)
                    }
                }
                47..=58 => {
                    t.seq_cp(sp, s.max(0), p0, p1).unwrap();
                    m.cp(sp, s.max(0), p0, p1);
                }
                59..=61 => {
                    t.seq_keep(sp).unwrap();
                    m.keep(sp);
                }
                62..=73 => {
                    let d = rng.range(-6, 6);
                    match t.seq_add(s, p0, p1, d) {
                        Ok(()) => {
                            m.shift(s, p0, p1, |p| p + d);
                            synced &= !t.has_updates();
                        }
                        Err(Error::KvCacheFull(_)) => {
                            full_hits += 1;
                            assert_eq!(snapshot(&t), before, "failed seq_add changed state");
                        }
                        Err(e) => panic!("unexpected error {e}"),
                    }
                }
                74..=79 => {
                    let d = rng.range(1, 4);
                    match t.seq_div(s, p0, p1, d) {
                        Ok(()) => {
                            m.shift(s, p0, p1, |p| p / d);
                            synced &= !t.has_updates();
                        }
                        Err(Error::KvCacheFull(_)) => {
                            full_hits += 1;
                            assert_eq!(snapshot(&t), before, "failed seq_div changed state");
                        }
                        Err(e) => panic!("unexpected error {e}"),
                    }
                }
                80..=81 => {
                    t.clear();
                    m = Model::default();
                    synced = true;
                }
                82..=91 => {
                    // The prefix index would key full blocks; keyed blocks become cached on
                    // release, are immutable (writes copy) and are evicted LRU.
                    if let Some(q) = t.seq_ids().first() {
                        let cells = t.cells(*q);
                        let (_, b, _) = cells[rng.below(cells.len())];
                        t.pool().set_key(b, rng.next() >> 1).unwrap();
                    }
                }
                _ => {
                    let u = t.take_updates();
                    st.apply(&u);
                    synced = true;
                }
            }
            compare(&t, &st, &m, synced && !t.has_updates());
        }
        if case % 500 == 0 {
            t.clear();
            t.check().unwrap();
        }
    }
    assert!(
        full_hits > 100,
        "KvCacheFull path exercised only {full_hits} times"
    );
    assert!(
        invalid_hits > 100,
        "validation exercised only {invalid_hits} times"
    );
    assert!(
        rollbacks > 1000,
        "rollback exercised only {rollbacks} times"
    );
    assert!(ops_done >= 90_000);
}

fn positions(t: &KvTable, s: SeqId) -> Vec<Pos> {
    t.cells(s).into_iter().map(|c| c.0).collect()
}

#[test]
fn appends_fill_blocks_in_order() {
    let mut t = table(8, 4);
    let plan = t.plan_write(0, &(0..10).collect::<Vec<_>>()).unwrap();
    let want: Vec<(BlockId, u16)> = (0..10).map(|i| (i as u32 / 4, (i % 4) as u16)).collect();
    assert_eq!(plan.slots, want);
    assert!(plan.updates.is_empty());
    assert_eq!(t.stats().held_blocks, 3);
    assert_eq!(t.stats().unused_slots, 2);
    // The next token continues in the partly filled tail.
    assert_eq!(t.plan_write(0, &[10]).unwrap().slots, vec![(2, 2)]);
    t.check().unwrap();
}

#[test]
fn seq_cp_shares_and_write_copies_partial_tail_only() {
    let mut t = table(8, 4);
    t.plan_write(0, &(0..6).collect::<Vec<_>>()).unwrap();
    t.seq_cp(0, 1, -1, -1).unwrap();
    assert_eq!(t.pool().stats().shared, 2);
    assert_eq!(t.stats().held_blocks, 2, "seq_cp allocates nothing");
    let plan = t.plan_write(1, &[6]).unwrap();
    // Block 1 (slots 0..2 used) is shared and partly filled: copied; block 0 stays shared.
    assert_eq!(
        plan.updates.copies,
        vec![CowCopy {
            src: 1,
            dst: 2,
            n_slots: 2
        }]
    );
    assert_eq!(plan.slots, vec![(2, 2)]);
    assert_eq!(
        t.cells(1).iter().map(|c| c.1).collect::<Vec<_>>(),
        vec![0, 0, 0, 0, 2, 2, 2]
    );
    // The source is now exclusive again and appends in place.
    let plan = t.plan_write(0, &[6]).unwrap();
    assert!(plan.updates.copies.is_empty());
    assert_eq!(plan.slots, vec![(1, 2)]);
    t.check().unwrap();
}

#[test]
fn shared_prefix_memory_bound() {
    // The bound: N sequences sharing a P-token prefix with U unique tokens each use at
    // most ceil(P/b) + N*(ceil(U/b) + 1) blocks.
    let (b, p, n, u) = (16usize, 200usize, 8usize, 40usize);
    let mut t = table(200, b);
    t.plan_write(0, &(0..p as i32).collect::<Vec<_>>()).unwrap();
    for s in 1..n as i32 {
        t.seq_cp(0, s, -1, -1).unwrap();
    }
    for step in 0..u as i32 {
        let seqs: Vec<SeqId> = (0..n as i32).collect();
        t.plan_batch(&seqs, &vec![p as i32 + step; n]).unwrap();
    }
    let used = t.pool().stats().referenced;
    let bound = p.div_ceil(b) + n * (u.div_ceil(b) + 1);
    assert!(used <= bound, "{used} blocks > bound {bound}");
    assert_eq!(used, p / b + n * (((p % b) + u).div_ceil(b)));
    t.check().unwrap();
}

#[test]
fn full_cache_fails_without_changes() {
    let mut t = table(3, 4);
    t.plan_write(0, &(0..9).collect::<Vec<_>>()).unwrap();
    let before = snapshot(&t);
    // 3 more tokens fit in block 2, the 4th needs a block that does not exist.
    let err = t.plan_batch(&[0, 0, 1, 0], &[9, 10, 0, 11]).unwrap_err();
    assert!(matches!(err, Error::KvCacheFull(_)), "{err:?}");
    assert_eq!(snapshot(&t), before);
    t.plan_batch(&[0, 0, 0], &[9, 10, 11]).unwrap();
    t.check().unwrap();
    // Bad input is InvalidInput, not a panic.
    assert!(matches!(
        t.plan_write(-1, &[0]),
        Err(Error::InvalidInput(_))
    ));
    assert!(matches!(
        t.plan_write(0, &[-3]),
        Err(Error::InvalidInput(_))
    ));
    assert!(matches!(
        t.plan_batch(&[0], &[]),
        Err(Error::InvalidInput(_))
    ));
}

#[test]
fn rm_tail_then_rewrite_reuses_slots() {
    let mut t = table(4, 4);
    t.plan_write(0, &(0..7).collect::<Vec<_>>()).unwrap();
    t.seq_rm(0, 5, -1);
    assert_eq!(t.seq_pos_max(0), 4);
    let plan = t.plan_write(0, &[5, 6, 7]).unwrap();
    assert_eq!(plan.slots, vec![(1, 1), (1, 2), (1, 3)]);
    assert_eq!(t.stats().held_blocks, 2);
}

#[test]
fn seq_add_records_pending_shifts_and_removes_negative() {
    let mut t = table(4, 4);
    t.plan_write(0, &(0..6).collect::<Vec<_>>()).unwrap();
    t.seq_add(0, 4, -1, 10).unwrap();
    assert_eq!(positions(&t, 0), vec![0, 1, 2, 3, 14, 15]);
    let u = t.take_updates();
    assert_eq!(
        u.shifts,
        vec![
            CellShift {
                block: 1,
                slot: 0,
                delta: 10
            },
            CellShift {
                block: 1,
                slot: 1,
                delta: 10
            }
        ]
    );
    assert!(!t.has_updates());
    // Shifting below zero drops the cells (llama.cpp semantics).
    t.seq_add(0, -1, 2, -1).unwrap();
    assert_eq!(positions(&t, 0), vec![0, 2, 3, 14, 15]);
    assert_eq!(t.seq_pos_min(0), 0);
    t.seq_div(0, 10, -1, 2).unwrap();
    assert_eq!(positions(&t, 0), vec![0, 2, 3, 7, 7]);
    let u = t.take_updates();
    assert_eq!(
        u.shifts.iter().map(|s| s.delta).collect::<Vec<_>>(),
        vec![-1, -7, -8]
    );
    assert!(matches!(
        t.seq_div(0, 0, -1, 0),
        Err(Error::InvalidInput(_))
    ));
    t.check().unwrap();
}

#[test]
fn shifting_a_shared_cell_copies_it_first() {
    let mut t = table(4, 4);
    t.plan_write(0, &[0, 1, 2]).unwrap();
    t.seq_cp(0, 1, -1, -1).unwrap();
    t.seq_add(1, 1, -1, 5).unwrap();
    // Seq 0 keeps its positions; seq 1 got a private copy of the block.
    assert_eq!(positions(&t, 0), vec![0, 1, 2]);
    assert_eq!(positions(&t, 1), vec![0, 6, 7]);
    let u = t.take_updates();
    assert_eq!(
        u.copies,
        vec![CowCopy {
            src: 0,
            dst: 1,
            n_slots: 3
        }]
    );
    assert_eq!(u.shifts.len(), 2);
    assert!(u.shifts.iter().all(|s| s.block == 1 && s.delta == 5));
    // Shifting all sequences moves the shared cells once, in place.
    t.seq_cp(0, 2, -1, -1).unwrap();
    t.seq_add(-1, 0, 1, 3).unwrap();
    let u = t.take_updates();
    assert!(u.copies.is_empty());
    assert_eq!(
        u.shifts.len(),
        2,
        "cell (0,0) shared by seqs 0 and 2 moves once: {u:?}"
    );
    assert_eq!(positions(&t, 0)[0], 3);
    assert_eq!(positions(&t, 2)[0], 3);
    // A shift that needs a copy fails cleanly when the pool is full.
    t.plan_write(3, &[0, 1, 2, 3, 4, 5, 6, 7]).unwrap();
    let before = snapshot(&t);
    assert!(matches!(
        t.seq_add(2, -1, -1, 1),
        Err(Error::KvCacheFull(_))
    ));
    assert_eq!(snapshot(&t), before);
    t.check().unwrap();
}

#[test]
fn rm_all_keep_clear_and_open_ranges() {
    let mut t = table(8, 2);
    t.plan_batch(&[0, 1, 2, 0, 1, 2], &[0, 0, 0, 1, 1, 1])
        .unwrap();
    t.seq_cp(0, 3, 1, 2).unwrap();
    t.seq_rm(-1, 1, -1);
    for s in 0..3 {
        assert_eq!(positions(&t, s), vec![0]);
    }
    assert_eq!(t.seq_pos_max(3), -1, "seq 3 lost its only cell");
    t.seq_keep(1).unwrap();
    assert_eq!(t.seq_ids(), vec![1]);
    assert!(matches!(t.seq_keep(-1), Err(Error::InvalidInput(_))));
    assert!(matches!(t.seq_cp(-1, 0, 0, 1), Err(Error::InvalidInput(_))));
    t.check().unwrap();
    t.clear();
    assert_eq!(t.pool().stats().free, 8);
    assert_eq!(t.seq_pos_max(-1), -1);
    t.check().unwrap();
}

#[test]
fn released_sequences_evict_tails_first() {
    let mut t = table(4, 2);
    t.plan_write(0, &[0, 1, 2, 3, 4, 5]).unwrap();
    for (k, (_, b, _)) in t.cells(0).into_iter().enumerate() {
        t.pool().set_key(b, 1000 + k as u64 / 2).unwrap();
    }
    t.seq_rm(0, -1, -1);
    assert_eq!(t.pool().stats().cached, 3);
    // Seq 1 needs two blocks: one free block, then the cached tail (block 2) goes first.
    t.plan_write(1, &[0, 1, 2, 3]).unwrap();
    assert!(t.pool().is_cached(0) && !t.pool().is_cached(2));
    t.check().unwrap();
}
