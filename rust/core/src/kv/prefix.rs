//! The prefix index: content keys of full KV blocks and a map from key to the block holding that
//! content, so that a new sequence whose prompt starts like an earlier one reuses its blocks
//! instead of recomputing them. Semantics (which blocks get keys, how a match works):
//! docs/KV_SEMANTICS.md, "Prefix index".
//!
//! Guarantees:
//! - [`block_key`] is a pure function of `(model id, parent key, token ids)`: the same on every
//!   run and platform (fixed-width integer arithmetic on the token values, no byte order, no
//!   `DefaultHasher`, no random seed), so keys can be stored outside the process. It never returns `NO_KEY`.
//! - The index is only a hint: [`PrefixIndex::lookup`] returns a block only after
//!   `BlockPool::revive(b, key)` succeeded, i.e. the block still holds that key and the caller
//!   now holds a reference to it. Evicted, freed or rewritten blocks are never returned; their
//!   stale entries are dropped on lookup and when the map grows past twice the pool size.
//!
//! Hash: 64 bits, because the pool stores keys in one `AtomicU64` per block. A collision needs two
//! different (parent, tokens) pairs with equal keys; with `n` distinct blocks ever indexed the
//! probability is about `n^2 / 2^65` (1e6 blocks: 3e-8). The cache additionally compares the
//! stored token ids and parent key of every matched block, so inside one process a match is
//! wrong only if two *parent* keys collide. A store shared by many processes with billions of
//! blocks should widen the key (the mixing below extends to a second lane).
//!
//! Concurrency: the map is a `HashMap` behind a `Mutex` (held for O(1) per block); the issue
//! asks for atomics only on the allocation path (alloc/free/refcount), which stays lock-free.

use std::collections::HashMap;
use std::sync::Mutex;

use super::pool::{BlockId, BlockPool, NO_KEY};

/// Parent key of a sequence's first block.
pub const ROOT_KEY: u64 = 0;

// Fractional parts of sqrt(2), sqrt(3), sqrt(5), sqrt(7) (nothing-up-my-sleeve constants).
const C0: u64 = 0x6a09_e667_f3bc_c908;
const C1: u64 = 0xbb67_ae85_84ca_a73b;
const C2: u64 = 0x3c6e_f372_fe94_f82b;
const C3: u64 = 0xa54f_f53a_5f1d_36f1;

/// Folded 64x64 -> 128 bit multiply: every input bit affects the middle output bits.
fn fold_mul(a: u64, b: u64) -> u64 {
    let r = (a as u128) * (b as u128);
    (r as u64) ^ ((r >> 64) as u64)
}

/// Content key of a full block: `tokens` are its token ids in slot order, `parent` the key of the
/// previous block of the sequence ([`ROOT_KEY`] for the first), `model_id` identifies the model
/// (and KV layout) that computed the K/V. Never `NO_KEY`.
pub fn block_key(model_id: u64, parent: u64, tokens: &[u32]) -> u64 {
    let mut h = fold_mul(model_id ^ C0, parent ^ C1);
    let mut it = tokens.chunks_exact(2);
    for pair in &mut it {
        let w = pair[0] as u64 | ((pair[1] as u64) << 32);
        h = fold_mul(h ^ w ^ C2, h.rotate_left(23) ^ C3);
    }
    if let [t] = it.remainder() {
        h = fold_mul(h ^ *t as u64 ^ C3, h.rotate_left(23) ^ C2);
    }
    // The length separates e.g. [t] from [t, 0] and blocks of different sizes.
    h = fold_mul(h ^ tokens.len() as u64 ^ C1, C0);
    // Final avalanche (xor-shift-multiply).
    h ^= h >> 31;
    h = h.wrapping_mul(C3 | 1);
    h ^= h >> 29;
    if h == NO_KEY {
        NO_KEY - 1
    } else {
        h
    }
}

/// Key -> block map (a hint; see the module docs).
#[derive(Debug, Default)]
pub struct PrefixIndex {
    map: Mutex<HashMap<u64, BlockId>>,
}

impl PrefixIndex {
    pub fn new() -> PrefixIndex {
        PrefixIndex::default()
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<u64, BlockId>> {
        // A panic while holding the lock cannot leave the map inconsistent (single inserts and
        // removes), so a poisoned lock is still usable.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that block `b` holds content `key` (replacing an older block with that key).
    /// Keeps the map below twice the pool size by dropping entries whose block lost its key.
    pub fn insert(&self, pool: &BlockPool, key: u64, b: BlockId) {
        let mut m = self.map();
        m.insert(key, b);
        if m.len() > 2 * pool.total() + 16 {
            m.retain(|&k, &mut blk| pool.key(blk) == k);
        }
    }

    /// The block holding `key`, with a reference taken on it (`revive`), or `None`.
    pub fn lookup(&self, pool: &BlockPool, key: u64) -> Option<BlockId> {
        let mut m = self.map();
        let b = *m.get(&key)?;
        if pool.revive(b, key) {
            Some(b)
        } else {
            m.remove(&key);
            None
        }
    }

    /// Number of entries (including stale ones not yet dropped).
    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&self) {
        self.map().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable() {
        // Fixed values, computed independently by a Python transcription of the algorithm
        // (big-integer arithmetic masked to 64 bits). A change here breaks stored keys.
        let t: Vec<u32> = (0..16).map(|i| i * 1000 + 7).collect();
        assert_eq!(block_key(0, ROOT_KEY, &t), 5873233197797317132);
        assert_eq!(
            block_key(0xdead_beef, 12345678901234567, &t[..15]),
            14180692175261765151
        );
    }

    #[test]
    fn keys_depend_on_every_input() {
        let t: Vec<u32> = (0..16).map(|i| i * 31 + 5).collect();
        let k = block_key(1, ROOT_KEY, &t);
        let mut seen = std::collections::HashSet::new();
        seen.insert(k);
        for i in 0..t.len() {
            for bit in [0, 7, 31] {
                let mut u = t.clone();
                u[i] ^= 1 << bit;
                assert!(
                    seen.insert(block_key(1, ROOT_KEY, &u)),
                    "token {i} bit {bit}"
                );
            }
        }
        for p in [1u64, 2, 1 << 63, k] {
            assert!(seen.insert(block_key(1, p, &t)), "parent {p}");
        }
        assert!(seen.insert(block_key(2, ROOT_KEY, &t)), "model id");
        assert!(seen.insert(block_key(1, ROOT_KEY, &t[..15])), "length");
        let mut z = t[..15].to_vec();
        z.push(0);
        assert!(seen.insert(block_key(1, ROOT_KEY, &z)), "trailing zero");
        // Swapping two tokens changes the key.
        let mut s = t.clone();
        s.swap(3, 4);
        assert!(seen.insert(block_key(1, ROOT_KEY, &s)), "order");
    }

    #[test]
    fn keys_are_well_mixed() {
        // Flipping one input bit flips about half of the output bits (avalanche).
        let t: Vec<u32> = (0..16).map(|i| i * 7 + 1).collect();
        let k = block_key(3, 99, &t);
        let mut total = 0u32;
        let mut n = 0u32;
        for i in 0..t.len() {
            for bit in 0..32 {
                let mut u = t.clone();
                u[i] ^= 1 << bit;
                let d = (block_key(3, 99, &u) ^ k).count_ones();
                assert!(
                    (10..=54).contains(&d),
                    "token {i} bit {bit}: {d} bits flipped"
                );
                total += d;
                n += 1;
            }
        }
        let mean = total as f64 / n as f64;
        assert!((30.0..34.0).contains(&mean), "mean flipped bits {mean}");
    }

    #[test]
    fn lookup_verifies_with_revive() {
        let pool = BlockPool::new(2);
        let idx = PrefixIndex::new();
        let b = pool.allocate().unwrap();
        pool.set_key(b, 42).unwrap();
        idx.insert(&pool, 42, b);
        pool.release(b).unwrap(); // cached
        assert_eq!(idx.lookup(&pool, 42), Some(b));
        assert_eq!(pool.refcount(b), 1);
        pool.release(b).unwrap();
        // Evict it: both blocks allocated, the cached one is reused and loses its key.
        let x = pool.allocate().unwrap();
        let y = pool.allocate().unwrap();
        assert!(x == b || y == b);
        assert_eq!(idx.lookup(&pool, 42), None);
        assert!(idx.is_empty(), "stale entry dropped");
        pool.release(x).unwrap();
        pool.release(y).unwrap();
        pool.audit().unwrap();
    }
}
