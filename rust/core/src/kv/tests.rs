//! Tests of the block tables: unit cases and random operation sequences checked against a
//! reference model (per sequence an ordered list of (position, content id)) through a fake
//! storage that executes the plans (copies, K-shifts, writes) on (content id, rope position).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::*;
use crate::error::Error;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn range(&mut self, lo: i32, hi: i32) -> i32 {
        lo + self.below((hi - lo + 1) as usize) as i32
    }
}

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

fn table(n_blocks: u32, bs: usize) -> KvTable {
    KvTable::new(Arc::new(BlockPool::new(n_blocks)), bs).unwrap()
}

/// Everything observable about a table and its pool, to check "nothing changed".
fn snapshot(t: &KvTable) -> (Vec<Vec<(Pos, BlockId, u16)>>, Vec<(u32, u64)>, PoolStats) {
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
                    match t.prepare_batch(&seqs, &pos) {
                        Ok(plan) => {
                            assert_eq!(plan.slots.len(), n);
                            let ids: Vec<u64> = (0..n as u64).map(|k| next_id + k).collect();
                            next_id += n as u64;
                            st.write(&plan, &ids, &pos);
                            synced = true;
                            for k in 0..n {
                                m.seqs.entry(seqs[k]).or_default().push((pos[k], ids[k]));
                            }
                        }
                        Err(Error::KvCacheFull(_)) => {
                            full_hits += 1;
                            assert_eq!(snapshot(&t), before, "failed batch changed state");
                        }
                        Err(e) => panic!("unexpected error {e}"),
                    }
                }
                35..=46 => {
                    t.seq_rm(s, p0, p1);
                    m.rm(s, p0, p1);
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
    assert!(ops_done >= 90_000);
}
