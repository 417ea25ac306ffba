//! `BlockPool`: the lock-free allocator of KV blocks. It hands out block ids (`u32`), counts
//! references, keeps unreferenced blocks that hold indexed content ("cached") for reuse, and
//! evicts the least recently used cached block when no free block is left.
//!
//! Guarantee (checked by [`BlockPool::audit`] and the stress tests): after any interleaving of
//! operations from any number of threads, once they are quiescent, every block is exactly one of
//! *free* (on the free stack exactly once), *cached* (refcount 0, has a content key, evictable) or
//! *referenced* (refcount >= 1). No block is lost and none is handed to two allocators.
//!
//! # Design
//! All state is atomics; there is no `Mutex` and no `unsafe`.
//! - Per block a 32-bit *state word*: `FREE`, `EVICTING` (transient: an allocator is turning a
//!   cached block into a fresh one) or the refcount `n` itself (`0` = cached, `>= 1` =
//!   referenced). Every state transition is a single CAS on this word.
//! - A Treiber stack of free block ids. The head is one `AtomicU64` packing `(tag << 32) | id`;
//!   the tag is bumped on every successful push and pop, so a pop that read a stale `next` (ABA)
//!   fails its CAS. `next` links are per-block `AtomicU32`s in a fixed array that is never freed,
//!   so reading a stale link is harmless.
//! - Per block an `AtomicU64` content key (`NO_KEY` = none) and an `AtomicU64` last-use stamp
//!   taken from a global clock when the block becomes cached.
//!
//! # Linearization points
//! - `allocate` from the stack: the successful CAS of the stack head. The popped block is in state
//!   `FREE` and off the stack, so the popper alone owns it and stores refcount 1.
//! - `allocate` by eviction: a full scan picks the cached block with the smallest stamp, then
//!   `CAS(0 -> EVICTING)`; success is the linearization point (a concurrent `revive` or another
//!   evictor makes it fail, and the scan is repeated). The key is cleared while `EVICTING` and
//!   only then is the refcount 1 published, so a `revive` can never observe the old key on the
//!   new owner's block.
//! - `retain`: `CAS(n -> n+1)` for `n >= 1` (only a holder may retain).
//! - `revive(b, key)`: `CAS(n -> n+1)` for `n >= 0`, then the key is compared; on mismatch the
//!   reference is dropped again with `release`. `FREE`/`EVICTING` blocks are never revived.
//! - `release`: `CAS(n -> n-1)`; when `n == 1` the CAS goes straight to `0` (cached, key present)
//!   or `FREE` (no key), and only the winner of `1 -> FREE` pushes the block (once).
//!
//! Eviction is exact LRU over the blocks that are cached when the scan runs (concurrent revives
//! make it approximate only in the sense that a revived block is skipped). Complexity: allocate
//! from the stack, retain, release, revive are O(1) plus CAS retries; eviction is O(total blocks)
//! per attempt (a plain scan of two atomics per block: ~10 µs for 10k blocks), which only happens
//! when the pool is full of cached blocks.
//!
//! Under concurrency `allocate` returns `None` only after it saw the free stack empty and a full
//! scan found no cached block, and the stack head did not change meanwhile.
//! `stats` is a snapshot that is exact only when no operation is in flight; `audit` must be run
//! while quiescent.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// A block id: an index into the pool (and into the K/V storage).
pub type BlockId = u32;

/// The key value meaning "no content key".
pub const NO_KEY: u64 = u64::MAX;

const FREE: u32 = u32::MAX;
const EVICTING: u32 = u32::MAX - 1;
/// Largest legal refcount; keeps clear of the two special values.
const MAX_REF: u32 = u32::MAX - 16;
const NIL: u32 = u32::MAX;

/// Counts of blocks by state (a snapshot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub total: usize,
    pub free: usize,
    pub cached: usize,
    pub referenced: usize,
    /// Blocks with refcount >= 2 (a subset of `referenced`).
    pub shared: usize,
}

/// The lock-free block allocator. `Sync`: share it by reference or `Arc`.
#[derive(Debug)]
pub struct BlockPool {
    state: Box<[AtomicU32]>,
    next: Box<[AtomicU32]>,
    key: Box<[AtomicU64]>,
    stamp: Box<[AtomicU64]>,
    head: AtomicU64,
    clock: AtomicU64,
}

fn pack(tag: u32, id: u32) -> u64 {
    ((tag as u64) << 32) | id as u64
}

fn unpack(w: u64) -> (u32, u32) {
    ((w >> 32) as u32, w as u32)
}

impl BlockPool {
    /// A pool of `n_blocks` free blocks. Block ids are `0..n_blocks`; allocation order of a fresh
    /// pool is ascending ids.
    pub fn new(n_blocks: u32) -> BlockPool {
        let n = n_blocks.min(NIL - 1) as usize;
        let state = (0..n).map(|_| AtomicU32::new(FREE)).collect();
        // Stack: 0 -> 1 -> ... -> n-1 -> NIL.
        let next = (0..n)
            .map(|i| AtomicU32::new(if i + 1 < n { i as u32 + 1 } else { NIL }))
            .collect();
        let key = (0..n).map(|_| AtomicU64::new(NO_KEY)).collect();
        let stamp = (0..n).map(|_| AtomicU64::new(0)).collect();
        BlockPool {
            state,
            next,
            key,
            stamp,
            head: AtomicU64::new(pack(0, if n > 0 { 0 } else { NIL })),
            clock: AtomicU64::new(1),
        }
    }

    /// Number of blocks in the pool.
    pub fn total(&self) -> usize {
        self.state.len()
    }

    fn check(&self, b: BlockId) -> Result<usize, String> {
        if (b as usize) < self.state.len() {
            Ok(b as usize)
        } else {
            Err(format!(
                "block id {b} out of range (pool has {} blocks)",
                self.state.len()
            ))
        }
    }

    fn pop(&self) -> Option<usize> {
        let mut cur = self.head.load(Ordering::Acquire);
        loop {
            let (tag, h) = unpack(cur);
            if h == NIL {
                return None;
            }
            let nx = self.next[h as usize].load(Ordering::Acquire);
            match self.head.compare_exchange_weak(
                cur,
                pack(tag.wrapping_add(1), nx),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(h as usize),
                Err(now) => cur = now,
            }
        }
    }

    fn push(&self, i: usize) {
        let mut cur = self.head.load(Ordering::Acquire);
        loop {
            let (tag, h) = unpack(cur);
            self.next[i].store(h, Ordering::Release);
            match self.head.compare_exchange_weak(
                cur,
                pack(tag.wrapping_add(1), i as u32),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }

    /// Takes the least recently used cached block, or `None` if there is none.
    fn evict(&self) -> Option<usize> {
        loop {
            let mut best: Option<(u64, usize)> = None;
            for (i, s) in self.state.iter().enumerate() {
                if s.load(Ordering::Relaxed) == 0 {
                    let t = self.stamp[i].load(Ordering::Relaxed);
                    if best.is_none_or(|(bt, _)| t < bt) {
                        best = Some((t, i));
                    }
                }
            }
            let (_, i) = best?;
            if self.state[i]
                .compare_exchange(0, EVICTING, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return Some(i);
            }
            // Lost a race (revived or taken by another evictor): rescan.
        }
    }

    /// Allocates a block with refcount 1 and no key: a free one if any, else the least recently
    /// used cached block (its key is dropped). `None` when every block is referenced.
    pub fn allocate(&self) -> Option<BlockId> {
        loop {
            let seen = self.head.load(Ordering::Acquire);
            if let Some(i) = self.pop() {
                self.key[i].store(NO_KEY, Ordering::Relaxed);
                self.state[i].store(1, Ordering::Release);
                return Some(i as BlockId);
            }
            if let Some(i) = self.evict() {
                self.key[i].store(NO_KEY, Ordering::Relaxed);
                self.state[i].store(1, Ordering::Release);
                return Some(i as BlockId);
            }
            if self.head.load(Ordering::Acquire) == seen {
                return None;
            }
        }
    }

    /// Adds a reference to a block the caller already holds (refcount >= 1).
    pub fn retain(&self, b: BlockId) -> Result<(), String> {
        let i = self.check(b)?;
        let mut s = self.state[i].load(Ordering::Acquire);
        loop {
            if s == 0 || s == FREE || s == EVICTING {
                return Err(format!("retain of unreferenced block {b}"));
            }
            if s >= MAX_REF {
                return Err(format!("refcount overflow on block {b}"));
            }
            match self.state[i].compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(()),
                Err(now) => s = now,
            }
        }
    }

    /// Takes a reference to block `b` if it still holds content `key` (cached or referenced):
    /// a cached block becomes referenced again. `false` if the block was freed, evicted or now
    /// holds other content.
    pub fn revive(&self, b: BlockId, key: u64) -> bool {
        let Ok(i) = self.check(b) else { return false };
        if key == NO_KEY {
            return false;
        }
        let mut s = self.state[i].load(Ordering::Acquire);
        loop {
            if s == FREE || s == EVICTING || s >= MAX_REF {
                return false;
            }
            match self.state[i].compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(now) => s = now,
            }
        }
        if self.key[i].load(Ordering::Acquire) == key {
            true
        } else {
            // Not ours after all; we did hold a reference, so this release cannot fail.
            let _ = self.release(b);
            false
        }
    }

    /// Drops one reference. At zero the block becomes cached if it has a key, else free.
    pub fn release(&self, b: BlockId) -> Result<(), String> {
        let i = self.check(b)?;
        let mut s = self.state[i].load(Ordering::Acquire);
        loop {
            if s == 0 || s == FREE || s == EVICTING {
                return Err(format!("release of unreferenced block {b}"));
            }
            let target = if s == 1 {
                if self.key[i].load(Ordering::Acquire) == NO_KEY {
                    FREE
                } else {
                    let t = self.clock.fetch_add(1, Ordering::Relaxed);
                    self.stamp[i].store(t, Ordering::Relaxed);
                    0
                }
            } else {
                s - 1
            };
            match self.state[i].compare_exchange_weak(
                s,
                target,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    if target == FREE {
                        self.push(i);
                    }
                    return Ok(());
                }
                Err(now) => s = now,
            }
        }
    }

    /// Sets the content key of a referenced block (`NO_KEY` clears it). Only a holder may do it.
    pub fn set_key(&self, b: BlockId, key: u64) -> Result<(), String> {
        let i = self.check(b)?;
        let s = self.state[i].load(Ordering::Acquire);
        if s == 0 || s == FREE || s == EVICTING {
            return Err(format!("set_key on unreferenced block {b}"));
        }
        self.key[i].store(key, Ordering::Release);
        Ok(())
    }

    /// The content key of block `b` (`NO_KEY` if none or out of range).
    pub fn key(&self, b: BlockId) -> u64 {
        match self.check(b) {
            Ok(i) => self.key[i].load(Ordering::Acquire),
            Err(_) => NO_KEY,
        }
    }

    /// Current refcount of `b` (0 for free, cached and out-of-range blocks).
    pub fn refcount(&self, b: BlockId) -> u32 {
        match self.check(b) {
            Ok(i) => match self.state[i].load(Ordering::Acquire) {
                FREE | EVICTING => 0,
                n => n,
            },
            Err(_) => 0,
        }
    }

    /// Whether `b` is cached (refcount 0, holding a key).
    pub fn is_cached(&self, b: BlockId) -> bool {
        self.check(b)
            .is_ok_and(|i| self.state[i].load(Ordering::Acquire) == 0)
    }

    /// Counts by state. Exact when quiescent.
    pub fn stats(&self) -> PoolStats {
        let mut st = PoolStats {
            total: self.total(),
            ..PoolStats::default()
        };
        for s in self.state.iter() {
            match s.load(Ordering::Acquire) {
                FREE => st.free += 1,
                EVICTING => st.referenced += 1,
                0 => st.cached += 1,
                n => {
                    st.referenced += 1;
                    if n >= 2 {
                        st.shared += 1;
                    }
                }
            }
        }
        st
    }

    /// Checks the pool invariant; call only while no operation is in flight. Every block is
    /// exactly one of free (and on the free stack exactly once), cached (with a key) or
    /// referenced, and the free stack holds nothing else and has no cycle.
    pub fn audit(&self) -> Result<(), String> {
        let n = self.total();
        let mut on_stack = vec![false; n];
        let (_, mut h) = unpack(self.head.load(Ordering::Acquire));
        let mut steps = 0usize;
        while h != NIL {
            let i = h as usize;
            if i >= n {
                return Err(format!("free stack holds out-of-range id {h}"));
            }
            if on_stack[i] {
                return Err(format!(
                    "block {h} is on the free stack twice (or the stack has a cycle)"
                ));
            }
            on_stack[i] = true;
            steps += 1;
            if steps > n {
                return Err("free stack longer than the pool".into());
            }
            h = self.next[i].load(Ordering::Acquire);
        }
        for i in 0..n {
            let s = self.state[i].load(Ordering::Acquire);
            match s {
                FREE if !on_stack[i] => {
                    return Err(format!(
                        "block {i} is free but not on the free stack (lost)"
                    ))
                }
                FREE => {}
                _ if on_stack[i] => {
                    return Err(format!(
                        "block {i} is on the free stack but in state {s} (double-owned)"
                    ))
                }
                EVICTING => return Err(format!("block {i} stuck in the evicting state")),
                0 if self.key[i].load(Ordering::Acquire) == NO_KEY => {
                    return Err(format!("block {i} is cached without a key (unreachable)"))
                }
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn exhaustion_and_reuse() {
        let p = BlockPool::new(3);
        let a: Vec<_> = (0..3).map(|_| p.allocate().unwrap()).collect();
        assert_eq!(a, vec![0, 1, 2]);
        assert_eq!(p.allocate(), None);
        assert_eq!(p.stats().referenced, 3);
        p.release(1).unwrap();
        assert_eq!(p.stats().free, 1);
        assert_eq!(p.allocate(), Some(1));
        assert_eq!(p.allocate(), None);
        assert!(p.release(5).is_err());
        for b in a {
            p.release(b).unwrap();
        }
        assert!(p.release(0).is_err(), "double release must fail");
        assert_eq!(p.stats().free, 3);
        p.audit().unwrap();
    }

    #[test]
    fn retain_release_shared_counts() {
        let p = BlockPool::new(2);
        let b = p.allocate().unwrap();
        p.retain(b).unwrap();
        p.retain(b).unwrap();
        let st = p.stats();
        assert_eq!((st.referenced, st.shared, st.free), (1, 1, 1));
        assert_eq!(p.refcount(b), 3);
        p.release(b).unwrap();
        p.release(b).unwrap();
        assert_eq!(p.stats().shared, 0);
        p.release(b).unwrap();
        assert!(p.retain(b).is_err(), "retain of a free block must fail");
        p.audit().unwrap();
    }

    #[test]
    fn cached_revive_and_key_mismatch() {
        let p = BlockPool::new(2);
        let b = p.allocate().unwrap();
        p.set_key(b, 42).unwrap();
        p.release(b).unwrap();
        assert!(p.is_cached(b));
        assert_eq!(p.stats().cached, 1);
        p.audit().unwrap();
        assert!(!p.revive(b, 43));
        assert!(p.is_cached(b), "a failed revive leaves the block cached");
        assert!(p.revive(b, 42));
        assert_eq!(p.refcount(b), 1);
        assert_eq!(p.key(b), 42);
        // Revive of a referenced block with the right key shares it.
        assert!(p.revive(b, 42));
        assert_eq!(p.refcount(b), 2);
        p.release(b).unwrap();
        p.release(b).unwrap();
        assert!(p.is_cached(b));
        // Clearing the key makes the final release free the block.
        assert!(p.revive(b, 42));
        p.set_key(b, NO_KEY).unwrap();
        p.release(b).unwrap();
        assert_eq!(p.stats().free, 2);
        assert!(!p.revive(b, 42));
        p.audit().unwrap();
    }

    #[test]
    fn eviction_is_lru_and_prefers_free() {
        let p = BlockPool::new(4);
        let bs: Vec<_> = (0..4).map(|_| p.allocate().unwrap()).collect();
        for &b in &bs {
            p.set_key(b, 100 + b as u64).unwrap();
        }
        // Release order 2, 0, 3; block 1 stays referenced.
        for b in [2, 0, 3] {
            p.release(b).unwrap();
        }
        assert_eq!(p.allocate(), Some(2));
        assert_eq!(p.key(2), NO_KEY, "evicted block loses its key");
        // Touching 0 (revive + release) makes it the most recent.
        assert!(p.revive(0, 100));
        p.release(0).unwrap();
        assert_eq!(p.allocate(), Some(3));
        assert_eq!(p.allocate(), Some(0));
        assert_eq!(p.allocate(), None);
        p.audit().unwrap();
        // A free block is preferred over a cached one.
        p.set_key(3, 7).unwrap();
        p.release(3).unwrap();
        p.release(2).unwrap(); // no key -> free
        assert_eq!(p.allocate(), Some(2));
        assert!(p.is_cached(3));
        p.audit().unwrap();
    }

    #[test]
    fn tails_before_heads_when_released_in_reverse() {
        let p = BlockPool::new(6);
        let seq: Vec<_> = (0..6).map(|_| p.allocate().unwrap()).collect();
        for (i, &b) in seq.iter().enumerate() {
            p.set_key(b, i as u64).unwrap();
        }
        for &b in seq.iter().rev() {
            p.release(b).unwrap();
        }
        let order: Vec<_> = (0..6).map(|_| p.allocate().unwrap()).collect();
        let expect: Vec<_> = seq.iter().rev().copied().collect();
        assert_eq!(order, expect);
    }

    use crate::test_rng::Rng;

    /// Each thread keeps a multiset of the references it holds; the audit and the refcounts
    /// must match the union after all threads finish.
    fn stress(n_blocks: u32, threads: usize, ops: usize, seed: u64) {
        let pool = BlockPool::new(n_blocks);
        let held: Vec<Vec<BlockId>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let pool = &pool;
                    sc.spawn(move || {
                        let mut rng =
                            Rng(seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(t as u64 + 1)));
                        let mut mine: Vec<BlockId> = Vec::new();
                        for _ in 0..ops {
                            match rng.below(10) {
                                0..=3 => {
                                    if let Some(b) = pool.allocate() {
                                        assert_eq!(pool.key(b), NO_KEY);
                                        mine.push(b);
                                    }
                                }
                                4 if !mine.is_empty() => {
                                    let b = mine[rng.below(mine.len())];
                                    pool.retain(b).unwrap();
                                    mine.push(b);
                                }
                                5..=7 if !mine.is_empty() => {
                                    let j = rng.below(mine.len());
                                    let b = mine.swap_remove(j);
                                    pool.release(b).unwrap();
                                }
                                8 if !mine.is_empty() => {
                                    let b = mine[rng.below(mine.len())];
                                    // Keys are shared across threads on purpose (content equality).
                                    let k = if rng.below(4) == 0 {
                                        NO_KEY
                                    } else {
                                        (b as u64) << 8 | rng.below(2) as u64
                                    };
                                    pool.set_key(b, k).unwrap();
                                }
                                9 => {
                                    let b = rng.below(n_blocks as usize) as BlockId;
                                    let k = (b as u64) << 8 | rng.below(2) as u64;
                                    if pool.revive(b, k) {
                                        mine.push(b);
                                    }
                                }
                                _ => {}
                            }
                        }
                        mine
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        pool.audit().unwrap();
        let mut count = vec![0u32; n_blocks as usize];
        for m in &held {
            for &b in m {
                count[b as usize] += 1;
            }
        }
        for b in 0..n_blocks {
            assert_eq!(pool.refcount(b), count[b as usize], "refcount of block {b}");
        }
        let st = pool.stats();
        let referenced = count.iter().filter(|&&c| c > 0).count();
        assert_eq!(st.referenced, referenced);
        assert_eq!(st.shared, count.iter().filter(|&&c| c > 1).count());
        assert_eq!(st.free + st.cached + st.referenced, st.total);
        // Drain: everything returns to free or cached, and every block is reachable again.
        for m in held {
            for b in m {
                pool.release(b).unwrap();
            }
        }
        pool.audit().unwrap();
        let mut got = HashSet::new();
        while let Some(b) = pool.allocate() {
            assert!(got.insert(b), "block {b} allocated twice");
        }
        assert_eq!(got.len(), n_blocks as usize);
        pool.audit().unwrap();
    }

    #[test]
    fn stress_4_threads_small_pool() {
        // Small pool: constant exhaustion, eviction and revive races.
        stress(64, 4, 750_000, 0x1234_5678);
    }

    #[test]
    fn stress_4_threads_large_pool() {
        stress(4096, 4, 750_000, 0xDEAD_BEEF);
    }
}
