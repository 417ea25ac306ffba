//! `BlockPool`: the allocator of KV blocks. It hands out block ids (`u32`), counts references,
//! keeps unreferenced blocks that hold indexed content ("cached") for reuse, and evicts the least
//! recently used cached block when no free block is left. One pool serves every context of a
//! model (`Sync`: share it by `Arc`).
//!
//! Guarantee (checked by [`BlockPool::audit`], the stress tests and the loom model checks): after
//! any interleaving of operations from any number of threads, once they are quiescent, every
//! block is exactly one of *free* (on the free stack exactly once), *cached* (refcount 0, has a
//! content tag, on the LRU list exactly once) or *referenced* (refcount >= 1). No block is lost
//! and none is handed to two allocators; the published counters equal the counts.
//!
//! # Design
//! - Per block a 32-bit *state word*: `FREE`, `EVICTING` (transient: a block being taken out of
//!   the cache, or losing its tag) or the refcount `n` itself (`0` = cached, `>= 1` =
//!   referenced). Every state transition is a single CAS on this word.
//! - A Treiber stack of free block ids, lock-free. The head is one `AtomicU64` packing
//!   `(tag << 32) | id`; the tag is bumped on every successful push and pop, so a pop that read a
//!   stale `next` (ABA) fails its CAS. `next` links are per-block atomics in a fixed array that is
//!   never freed, so reading a stale link is harmless.
//! - Per block an `AtomicU64` content tag (`NO_KEY` = none): 64 bits of the block's 128-bit
//!   prefix key (the index keeps the full key and verifies it).
//! - The cached blocks form an intrusive doubly linked LRU list (oldest at the head) behind one
//!   short mutex. Every transition *into or out of* refcount 0 (a last release of a tagged block,
//!   a revive of a cached block, an eviction) happens under that mutex, so the list holds exactly
//!   the blocks in state 0. Everything else — allocation from the free stack, retain, release
//!   of a non-last reference, release of an untagged block, revive of a referenced block — is
//!   lock-free. The critical sections are O(1) (a few loads and stores).
//! - Counters `free`, `cached`, `shared` are kept in step with the transitions, so `stats`
//!   is O(1) (exact when quiescent); `evicted` counts evictions since the pool was made.
//!
//! # Linearization points
//! - `allocate` from the stack: the successful CAS of the stack head. The popped block is in state
//!   `FREE` and off the stack, so the popper alone owns it and stores refcount 1.
//! - `allocate` by eviction: under the LRU mutex, the head of the list is unlinked and its state
//!   moved `0 -> EVICTING` (it cannot fail: state 0 only changes under the mutex). The tag is
//!   cleared while `EVICTING` and only then is refcount 1 published, so a `revive` can never
//!   observe the old tag on the new owner's block.
//! - `retain`: `CAS(n -> n+1)` for `n >= 1` (only a holder may retain).
//! - `revive(b, tag)`: for `n >= 1`, `CAS(n -> n+1)` then the tag is compared (a mismatch drops
//!   the reference again); for `n == 0`, under the mutex, compare the tag, `CAS(0 -> 1)`, unlink.
//!   `FREE`/`EVICTING` blocks are never revived.
//! - `release`: `CAS(n -> n-1)` for `n >= 2`; for `n == 1`, `CAS(1 -> FREE)` (no tag; the winner
//!   pushes the block once) or, under the mutex, `CAS(1 -> 0)` and link at the LRU tail (tagged).
//! - `untag(b, n)`: `CAS(n -> EVICTING)` by a caller that holds all `n` references, clear the tag,
//!   store `n`: a concurrent `revive` sees `EVICTING` (fails) or the cleared tag (fails).
//!
//! Complexity: every operation is O(1) plus CAS retries; eviction pops the LRU head without a
//! scan. Under concurrency `allocate` returns `None` only after it saw the free stack empty and
//! the LRU list empty, and the stack head did not change meanwhile. `audit` must be run while
//! quiescent.

// Under `--cfg loom` the unit tests model-check the pool with loom's atomics and mutex.
#[cfg(all(loom, test))]
use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(all(loom, test))]
use loom::sync::{Mutex, MutexGuard};
#[cfg(not(all(loom, test)))]
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(all(loom, test)))]
use std::sync::{Mutex, MutexGuard};

/// A block id: an index into the pool (and into the K/V storage).
pub type BlockId = u32;

/// The tag value meaning "no content tag".
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
    /// Cached blocks evicted (taken for new content) since the pool was made.
    pub evicted: u64,
}

/// The LRU list of cached blocks: `prev`/`next` links per block, oldest at `head`.
#[derive(Debug)]
struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Lru {
    fn push_tail(&mut self, i: u32) {
        let iu = i as usize;
        self.prev[iu] = self.tail;
        self.next[iu] = NIL;
        if self.tail == NIL {
            self.head = i;
        } else {
            self.next[self.tail as usize] = i;
        }
        self.tail = i;
        self.len += 1;
    }

    fn unlink(&mut self, i: u32) {
        let iu = i as usize;
        let (p, n) = (self.prev[iu], self.next[iu]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[iu] = NIL;
        self.next[iu] = NIL;
        self.len -= 1;
    }
}

/// The block allocator. `Sync`: share it by reference or `Arc`.
#[derive(Debug)]
pub struct BlockPool {
    state: Box<[AtomicU32]>,
    next: Box<[AtomicU32]>,
    tag: Box<[AtomicU64]>,
    head: AtomicU64,
    lru: Mutex<Lru>,
    n_free: AtomicUsize,
    n_cached: AtomicUsize,
    n_shared: AtomicUsize,
    n_evicted: AtomicU64,
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
        let tag = (0..n).map(|_| AtomicU64::new(NO_KEY)).collect();
        BlockPool {
            state,
            next,
            tag,
            head: AtomicU64::new(pack(0, if n > 0 { 0 } else { NIL })),
            lru: Mutex::new(Lru {
                prev: vec![NIL; n],
                next: vec![NIL; n],
                head: NIL,
                tail: NIL,
                len: 0,
            }),
            n_free: AtomicUsize::new(n),
            n_cached: AtomicUsize::new(0),
            n_shared: AtomicUsize::new(0),
            n_evicted: AtomicU64::new(0),
        }
    }

    /// Number of blocks in the pool.
    pub fn total(&self) -> usize {
        self.state.len()
    }

    fn lru(&self) -> MutexGuard<'_, Lru> {
        // Every critical section is a handful of stores that cannot panic midway (indices are
        // checked before the lock is taken), so a poisoned lock still guards a consistent list.
        self.lru.lock().unwrap_or_else(|e| e.into_inner())
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
                Ok(_) => {
                    self.n_free.fetch_sub(1, Ordering::Relaxed);
                    return Some(h as usize);
                }
                Err(now) => cur = now,
            }
        }
    }

    fn push(&self, i: usize) {
        self.n_free.fetch_add(1, Ordering::Relaxed);
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

    /// Takes the least recently used cached block out of the cache (state `EVICTING`), or `None`.
    fn evict(&self) -> Option<usize> {
        let mut lru = self.lru();
        let h = lru.head;
        if h == NIL {
            return None;
        }
        let i = h as usize;
        // State 0 only changes under this mutex, so the block on the list is still cached.
        let ok = self.state[i]
            .compare_exchange(0, EVICTING, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok();
        debug_assert!(ok, "a block on the LRU list must be cached");
        lru.unlink(h);
        self.n_cached.fetch_sub(1, Ordering::Relaxed);
        self.n_evicted.fetch_add(1, Ordering::Relaxed);
        Some(i)
    }

    /// Allocates a block with refcount 1 and no tag: a free one if any, else the least recently
    /// used cached block. Returns the block and, if it was evicted, the tag it held (the caller
    /// drops it from its index). `None` when every block is referenced.
    pub fn allocate_evicting(&self) -> Option<(BlockId, Option<u64>)> {
        loop {
            let seen = self.head.load(Ordering::Acquire);
            if let Some(i) = self.pop() {
                self.tag[i].store(NO_KEY, Ordering::Relaxed);
                self.state[i].store(1, Ordering::Release);
                return Some((i as BlockId, None));
            }
            if let Some(i) = self.evict() {
                let old = self.tag[i].swap(NO_KEY, Ordering::AcqRel);
                self.state[i].store(1, Ordering::Release);
                return Some((i as BlockId, Some(old)));
            }
            if self.head.load(Ordering::Acquire) == seen {
                return None;
            }
        }
    }

    /// [`BlockPool::allocate_evicting`] without the evicted tag.
    pub fn allocate(&self) -> Option<BlockId> {
        self.allocate_evicting().map(|(b, _)| b)
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
                Ok(_) => {
                    if s == 1 {
                        self.n_shared.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(());
                }
                Err(now) => s = now,
            }
        }
    }

    /// Takes a reference to block `b` if it still holds content `tag` (cached or referenced):
    /// a cached block becomes referenced again. `false` if the block was freed, evicted or now
    /// holds other content.
    pub fn revive(&self, b: BlockId, tag: u64) -> bool {
        let Ok(i) = self.check(b) else { return false };
        if tag == NO_KEY {
            return false;
        }
        let mut s = self.state[i].load(Ordering::Acquire);
        loop {
            if s == FREE || s == EVICTING || s >= MAX_REF {
                return false;
            }
            if s == 0 {
                let mut lru = self.lru();
                // Under the mutex a cached block stays cached and keeps its tag.
                if self.state[i].load(Ordering::Acquire) != 0 {
                    drop(lru);
                    s = self.state[i].load(Ordering::Acquire);
                    continue;
                }
                if self.tag[i].load(Ordering::Acquire) != tag {
                    return false;
                }
                let ok = self.state[i]
                    .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok();
                debug_assert!(ok, "state 0 only changes under the LRU mutex");
                lru.unlink(b);
                self.n_cached.fetch_sub(1, Ordering::Relaxed);
                return true;
            }
            match self.state[i].compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(now) => s = now,
            }
        }
        if s == 1 {
            self.n_shared.fetch_add(1, Ordering::Relaxed);
        }
        if self.tag[i].load(Ordering::Acquire) == tag {
            true
        } else {
            // Not ours after all; we do hold a reference, so this release cannot fail.
            let _ = self.release(b);
            false
        }
    }

    /// Drops one reference. At zero the block becomes cached if it has a tag, else free.
    pub fn release(&self, b: BlockId) -> Result<(), String> {
        let i = self.check(b)?;
        let mut s = self.state[i].load(Ordering::Acquire);
        loop {
            if s == 0 || s == FREE || s == EVICTING {
                return Err(format!("release of unreferenced block {b}"));
            }
            if s >= 2 {
                match self.state[i].compare_exchange_weak(
                    s,
                    s - 1,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        if s == 2 {
                            self.n_shared.fetch_sub(1, Ordering::Relaxed);
                        }
                        return Ok(());
                    }
                    Err(now) => {
                        s = now;
                        continue;
                    }
                }
            }
            // s == 1: we hold the only reference, so nobody else changes the tag now.
            if self.tag[i].load(Ordering::Acquire) == NO_KEY {
                match self.state[i].compare_exchange(1, FREE, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        self.push(i);
                        return Ok(());
                    }
                    Err(now) => s = now,
                }
            } else {
                let mut lru = self.lru();
                match self.state[i].compare_exchange(1, 0, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        lru.push_tail(b);
                        self.n_cached.fetch_add(1, Ordering::Relaxed);
                        return Ok(());
                    }
                    Err(now) => s = now,
                }
            }
        }
    }

    /// Sets the content tag of a referenced block (`NO_KEY` clears it). Only a holder may do it,
    /// and only while no other party can revive the block (it has no tag yet, or the caller
    /// holds every reference).
    pub fn set_key(&self, b: BlockId, tag: u64) -> Result<(), String> {
        let i = self.check(b)?;
        let s = self.state[i].load(Ordering::Acquire);
        if s == 0 || s == FREE || s == EVICTING {
            return Err(format!("set_key on unreferenced block {b}"));
        }
        self.tag[i].store(tag, Ordering::Release);
        Ok(())
    }

    /// Removes the tag of block `b` if the caller holds all of its `n` references (so that it
    /// may change the block's content in place); returns the old tag, or `None` (nothing
    /// changed) if the refcount is not `n` (someone else holds or is reviving the block).
    pub fn untag(&self, b: BlockId, n: u32) -> Option<u64> {
        let i = self.check(b).ok()?;
        if n == 0 || n >= MAX_REF {
            return None;
        }
        self.state[i]
            .compare_exchange(n, EVICTING, Ordering::AcqRel, Ordering::Relaxed)
            .ok()?;
        let old = self.tag[i].swap(NO_KEY, Ordering::AcqRel);
        self.state[i].store(n, Ordering::Release);
        Some(old)
    }

    /// The content tag of block `b` (`NO_KEY` if none or out of range).
    pub fn key(&self, b: BlockId) -> u64 {
        match self.check(b) {
            Ok(i) => self.tag[i].load(Ordering::Acquire),
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

    /// Whether `b` is cached (refcount 0, holding a tag).
    pub fn is_cached(&self, b: BlockId) -> bool {
        self.check(b)
            .is_ok_and(|i| self.state[i].load(Ordering::Acquire) == 0)
    }

    /// Counts by state, O(1) from the published counters. Exact when quiescent; while
    /// operations run each count is at most one in-flight transition off.
    pub fn stats(&self) -> PoolStats {
        let total = self.total();
        let free = self.n_free.load(Ordering::Relaxed).min(total);
        let cached = self.n_cached.load(Ordering::Relaxed).min(total - free);
        let referenced = total - free - cached;
        let shared = self.n_shared.load(Ordering::Relaxed).min(referenced);
        PoolStats {
            total,
            free,
            cached,
            referenced,
            shared,
            evicted: self.n_evicted.load(Ordering::Relaxed),
        }
    }

    /// Blocks an allocation can still obtain (free + cached), O(1).
    pub fn available(&self) -> usize {
        let s = self.stats();
        s.free + s.cached
    }

    /// Checks the pool invariant; call only while no operation is in flight. Every block is
    /// exactly one of free (and on the free stack exactly once), cached (with a tag, on the LRU
    /// list exactly once) or referenced; the free stack and the LRU list hold nothing else and
    /// have no cycle; the counters equal the counts.
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
        let mut on_lru = vec![false; n];
        {
            let lru = self.lru();
            let (mut h, mut prev, mut len) = (lru.head, NIL, 0usize);
            while h != NIL {
                let i = h as usize;
                if i >= n || on_lru[i] {
                    return Err(format!("LRU list broken at block {h}"));
                }
                if lru.prev[i] != prev {
                    return Err(format!("LRU back link of block {h} is wrong"));
                }
                on_lru[i] = true;
                len += 1;
                prev = h;
                h = lru.next[i];
            }
            if lru.tail != prev || lru.len != len {
                return Err(format!(
                    "LRU list: tail/len out of sync ({} counted, {} recorded)",
                    len, lru.len
                ));
            }
        }
        let (mut free, mut cached, mut shared) = (0, 0, 0);
        for i in 0..n {
            let s = self.state[i].load(Ordering::Acquire);
            match s {
                FREE if !on_stack[i] => {
                    return Err(format!(
                        "block {i} is free but not on the free stack (lost)"
                    ))
                }
                FREE => free += 1,
                _ if on_stack[i] => {
                    return Err(format!(
                        "block {i} is on the free stack but in state {s} (double-owned)"
                    ))
                }
                EVICTING => return Err(format!("block {i} stuck in the evicting state")),
                0 if self.tag[i].load(Ordering::Acquire) == NO_KEY => {
                    return Err(format!("block {i} is cached without a tag (unreachable)"))
                }
                0 if !on_lru[i] => return Err(format!("cached block {i} is not on the LRU list")),
                0 => cached += 1,
                _ if on_lru[i] => return Err(format!("referenced block {i} is on the LRU list")),
                n => shared += usize::from(n >= 2),
            }
        }
        let counted = (
            self.n_free.load(Ordering::Relaxed),
            self.n_cached.load(Ordering::Relaxed),
            self.n_shared.load(Ordering::Relaxed),
        );
        if counted != (free, cached, shared) {
            return Err(format!(
                "counters (free, cached, shared) = {counted:?} but the blocks say {:?}",
                (free, cached, shared)
            ));
        }
        Ok(())
    }
}
#[cfg(all(test, not(loom)))]
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
        assert_eq!(p.stats().evicted, 3, "blocks 2, 3 and 0 were evicted");
        // A free block is preferred over a cached one.
        p.set_key(3, 7).unwrap();
        p.release(3).unwrap();
        p.release(2).unwrap(); // no key -> free
        assert_eq!(p.allocate(), Some(2));
        assert!(p.is_cached(3));
        assert_eq!(p.stats().evicted, 3, "taking a free block evicts nothing");
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
                                    } else if let Some(j) = mine.iter().position(|&x| x == b) {
                                        // Untag only succeeds if this thread holds every
                                        // reference; then nobody can revive it meanwhile.
                                        let n = mine.iter().filter(|&&x| x == b).count() as u32;
                                        if pool.untag(mine[j], n).is_some() {
                                            assert_eq!(pool.key(b), NO_KEY);
                                            // A concurrent `revive` of an old tag may hold
                                            // a reference for a moment (it takes one, sees
                                            // the tag changed, gives it back): never fewer.
                                            assert!(pool.refcount(b) >= n);
                                        }
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
    fn untag_needs_every_reference() {
        let p = BlockPool::new(2);
        let b = p.allocate().unwrap();
        p.set_key(b, 9).unwrap();
        p.retain(b).unwrap();
        assert_eq!(p.untag(b, 1), None, "two references held, one claimed");
        assert_eq!(p.key(b), 9);
        assert_eq!(p.untag(b, 2), Some(9));
        assert_eq!(p.key(b), NO_KEY);
        assert_eq!(p.refcount(b), 2);
        assert!(!p.revive(b, 9));
        p.release(b).unwrap();
        p.release(b).unwrap();
        assert_eq!(p.stats().free, 2, "an untagged block is freed, not cached");
        p.audit().unwrap();
    }

    #[test]
    fn counters_follow_transitions() {
        let p = BlockPool::new(5);
        let bs: Vec<_> = (0..4).map(|_| p.allocate().unwrap()).collect();
        p.retain(bs[0]).unwrap();
        p.set_key(bs[1], 11).unwrap();
        p.set_key(bs[2], 12).unwrap();
        p.release(bs[1]).unwrap();
        p.release(bs[2]).unwrap();
        let st = p.stats();
        assert_eq!((st.free, st.cached, st.referenced, st.shared), (1, 2, 2, 1));
        assert!(p.revive(bs[1], 11));
        assert!(p.revive(bs[1], 11));
        let st = p.stats();
        assert_eq!((st.free, st.cached, st.referenced, st.shared), (1, 1, 3, 2));
        assert_eq!(p.available(), 2);
        p.audit().unwrap();
    }

    #[test]
    fn eviction_reports_the_old_tag() {
        let p = BlockPool::new(1);
        let b = p.allocate().unwrap();
        p.set_key(b, 77).unwrap();
        p.release(b).unwrap();
        assert_eq!(p.allocate_evicting(), Some((b, Some(77))));
        assert_eq!(p.allocate_evicting(), None);
        p.release(b).unwrap();
        assert_eq!(p.allocate_evicting(), Some((b, None)));
        p.audit().unwrap();
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

    /// The long allocator stress (RELIABILITY.md): rounds of [`stress`] with fresh seeds,
    /// pool sizes from 2 to 4096 blocks and 2 to 8 threads, each ending with the audit and
    /// the refcount check, until `KVSERVE_STRESS_SECONDS` (default 60) have passed:
    /// `KVSERVE_STRESS_SECONDS=600 cargo test --release -p kvserve-core --lib long_stress --
    /// --ignored --nocapture`.
    #[test]
    #[ignore = "long: run by hand (RELIABILITY.md)"]
    fn long_stress() {
        let secs: u64 = std::env::var("KVSERVE_STRESS_SECONDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60);
        let t0 = std::time::Instant::now();
        let (mut rounds, mut ops) = (0u64, 0u64);
        let mut rng = Rng(0x5EED_0FA1_10C0);
        while t0.elapsed().as_secs() < secs {
            let n_blocks = [2, 3, 16, 64, 512, 4096][rng.below(6)];
            let threads = 2 + rng.below(7);
            let per_thread = 200_000;
            stress(n_blocks, threads, per_thread, rng.next());
            rounds += 1;
            ops += (threads * per_thread) as u64;
        }
        println!(
            "long_stress: {rounds} rounds, {ops} operations in {:.0} s, every audit clean",
            t0.elapsed().as_secs_f64()
        );
    }
}

/// Model checks of the pool's operations under every interleaving loom explores (run with
/// `RUSTFLAGS="--cfg loom" cargo test --release -p kvserve-core --lib loom`). Each case races
/// two threads on a pool of one or two blocks, then audits the result.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(f);
    }

    #[test]
    fn loom_allocate_pop_and_evict_hand_out_distinct_blocks() {
        model(|| {
            let p = Arc::new(BlockPool::new(2));
            let c = p.allocate().unwrap();
            p.set_key(c, 5).unwrap();
            p.release(c).unwrap(); // one cached, one free
            let q = Arc::clone(&p);
            let t = thread::spawn(move || q.allocate());
            let a = p.allocate();
            let b = t.join().unwrap();
            let (a, b) = (a.unwrap(), b.unwrap());
            assert_ne!(a, b);
            assert_eq!(p.allocate(), None);
            p.release(a).unwrap();
            p.release(b).unwrap();
            p.audit().unwrap();
        });
    }

    #[test]
    fn loom_revive_races_eviction() {
        model(|| {
            let p = Arc::new(BlockPool::new(1));
            let b = p.allocate().unwrap();
            p.set_key(b, 7).unwrap();
            p.release(b).unwrap();
            let q = Arc::clone(&p);
            let t = thread::spawn(move || q.revive(b, 7));
            let got = p.allocate_evicting();
            let revived = t.join().unwrap();
            match (revived, got) {
                (true, None) => assert_eq!(p.key(b), 7),
                (false, Some((x, Some(7)))) => assert_eq!((x, p.key(b)), (b, NO_KEY)),
                other => panic!("both or neither got the block: {other:?}"),
            }
            p.release(b).unwrap();
            p.audit().unwrap();
        });
    }

    #[test]
    fn loom_last_release_races_revive() {
        model(|| {
            let p = Arc::new(BlockPool::new(1));
            let b = p.allocate().unwrap();
            p.set_key(b, 3).unwrap();
            let q = Arc::clone(&p);
            let t = thread::spawn(move || q.release(b).unwrap());
            let revived = p.revive(b, 3);
            t.join().unwrap();
            assert!(
                revived,
                "a tagged block is referenced or cached, never free"
            );
            assert_eq!(p.refcount(b), 1);
            p.audit().unwrap();
            p.release(b).unwrap();
            assert!(p.is_cached(b));
            p.audit().unwrap();
        });
    }

    #[test]
    fn loom_untag_races_revive() {
        model(|| {
            let p = Arc::new(BlockPool::new(1));
            let b = p.allocate().unwrap();
            p.set_key(b, 4).unwrap();
            let q = Arc::clone(&p);
            let t = thread::spawn(move || q.revive(b, 4));
            let untagged = p.untag(b, 1);
            let revived = t.join().unwrap();
            // Never both: content changed in place must not be handed to a reviver.
            assert!(!(revived && untagged.is_some()));
            assert!(revived || untagged.is_some(), "one of them wins");
            if revived {
                p.release(b).unwrap();
            }
            p.release(b).unwrap();
            p.audit().unwrap();
        });
    }

    #[test]
    fn loom_shared_release_and_free_push() {
        model(|| {
            let p = Arc::new(BlockPool::new(2));
            let b = p.allocate().unwrap();
            p.retain(b).unwrap();
            let q = Arc::clone(&p);
            let t = thread::spawn(move || {
                q.release(b).unwrap();
                q.allocate()
            });
            p.release(b).unwrap();
            let a = p.allocate();
            let c = t.join().unwrap();
            // Two blocks, two allocations after both references are gone: both succeed.
            let (a, c) = (a.unwrap(), c.unwrap());
            assert_ne!(a, c);
            assert_eq!(p.stats().shared, 0);
            p.release(a).unwrap();
            p.release(c).unwrap();
            p.audit().unwrap();
        });
    }
}
