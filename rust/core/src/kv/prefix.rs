//! The prefix index: 128-bit content keys of full KV blocks and a map from key to the block
//! holding that content, shared by every context of a model, so that a new sequence whose prompt
//! starts like an earlier one (in any context) reuses its blocks instead of recomputing them.
//! Semantics (which blocks get keys, how a match works): docs/KV_SEMANTICS.md, "Prefix index".
//!
//! Guarantees:
//! - [`block_key`] is a pure function of `(model id, parent key, token ids)`: the same on every
//!   run and platform (fixed-width integer arithmetic, explicit little-endian words, no
//!   `DefaultHasher`, no random seed), so keys can be stored outside the process (sessions on
//!   disk, a shared KV tier). It never returns [`ROOT_KEY`].
//! - The index is only a hint: [`PrefixIndex::lookup`] returns a block only after it checked
//!   that the block's recorded key, parent key and tokens are the ones asked for, and
//!   `BlockPool::revive(b, tag)` succeeded, i.e. the block still holds that content and the
//!   caller now holds a reference to it. Evicted, untagged or rewritten blocks are never
//!   returned; their entries are removed when the pool reports the eviction ([`forget`]), so the
//!   map never holds more entries than the pool has blocks and nothing scans it.
//!
//! Hash: 128 bits, two 64-bit lanes, each step a folded 64x64->128 multiply of the lane with a
//! word, crossed with the other lane. With `n` distinct blocks ever keyed, an accidental
//! collision has probability about `n^2 / 2^129` (1e12 blocks: 1e-15). It is not a
//! cryptographic hash: inside one process every match also compares the stored tokens and
//! parent key, so a wrong match needs two colliding *parent* keys; a store shared with
//! untrusted writers should re-verify contents or switch to a cryptographic hash.
//!
//! Concurrency: the map and the per-block records sit behind one `Mutex`, held for O(block
//! size) per operation. Lock order: index, then the pool's LRU mutex (inside `revive`); the pool
//! never takes the index lock.
//!
//! [`forget`]: PrefixIndex::forget

use std::collections::HashMap;
use std::sync::Mutex;

use super::events::{Drained, EventLog, KvEvent, Medium};
use super::pool::{BlockId, BlockPool, NO_KEY};
use super::try_vec;
use crate::error::{Error, Result};

/// A 128-bit content key.
pub type Key = u128;

/// Parent key of a sequence's first block (never a block's key).
pub const ROOT_KEY: Key = 0;

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

fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 31;
    h = h.wrapping_mul(C3 | 1);
    h ^= h >> 29;
    h = h.wrapping_mul(C1 | 1);
    h ^ (h >> 32)
}

/// The 128-bit hash behind block keys and model identities: absorb 64-bit words, then
/// [`KeyHasher::finish`]. Stable across runs and platforms (see the module docs).
#[derive(Debug, Clone)]
pub struct KeyHasher {
    a: u64,
    b: u64,
    n: u64,
}

impl KeyHasher {
    /// A hasher for one purpose (`domain` separates block keys, model ids, ...).
    pub fn new(domain: u64) -> KeyHasher {
        KeyHasher {
            a: C0 ^ domain,
            b: C1 ^ domain.rotate_left(32),
            n: 0,
        }
    }

    pub fn write_u64(&mut self, w: u64) {
        let a = fold_mul(self.a ^ w ^ C2, self.b.rotate_left(23) ^ C3);
        let b = fold_mul(self.b ^ w.rotate_left(29) ^ C3, self.a.rotate_left(41) ^ C2);
        self.a = a;
        self.b = b;
        self.n += 1;
    }

    pub fn write_u128(&mut self, k: u128) {
        self.write_u64(k as u64);
        self.write_u64((k >> 64) as u64);
    }

    /// Absorbs bytes as little-endian 64-bit words (the last one zero-padded), then the length.
    pub fn write_bytes(&mut self, bytes: &[u8]) {
        let mut it = bytes.chunks_exact(8);
        for c in &mut it {
            self.write_u64(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let rest = it.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.write_u64(u64::from_le_bytes(w));
        }
        self.write_u64(bytes.len() as u64);
    }

    pub fn finish(&self) -> u128 {
        let a = avalanche(self.a ^ fold_mul(self.n ^ C1, C0));
        let b = avalanche(self.b ^ a.rotate_left(17) ^ C2);
        let a = avalanche(a ^ b);
        ((b as u128) << 64) | a as u128
    }
}

const DOMAIN_BLOCK: u64 = 0x6b76_7365_7276_6542; // "kvserveB"
const DOMAIN_SALT: u64 = 0x6b76_7365_7276_6553; // "kvserveS"

/// The root key of a sequence salted with `salt`: the parent key of its first block, so that
/// every key of its chain depends on the salt and its blocks match only sequences with the
/// same salt (tenants' isolated prefix caches, a request's `cache_salt`). The empty salt is
/// [`ROOT_KEY`] (unsalted); any other salt gives a key that is neither [`ROOT_KEY`] nor, but
/// with the hash's collision probability, another salt's root or any block's key (a separate
/// hash domain).
pub fn salt_root(salt: &[u8]) -> Key {
    if salt.is_empty() {
        return ROOT_KEY;
    }
    let mut h = KeyHasher::new(DOMAIN_SALT);
    h.write_bytes(salt);
    match h.finish() {
        ROOT_KEY => 1,
        k => k,
    }
}

/// The chain of content keys of the whole blocks of `tokens` (blocks of `block_size`; a
/// partial last block has none): key `i` is [`block_key`] of block `i` under key `i - 1`,
/// key 0 under `root` (the sequence's root key: [`ROOT_KEY`], or [`salt_root`] of its salt).
pub fn chain_keys(model_id: Key, root: Key, tokens: &[u32], block_size: usize) -> Vec<Key> {
    let mut parent = root;
    tokens
        .chunks_exact(block_size)
        .map(|c| {
            parent = block_key(model_id, parent, c);
            parent
        })
        .collect()
}

/// Content key of a full block: `tokens` are its token ids in slot order, `parent` the key of the
/// previous block of the sequence ([`ROOT_KEY`] for the first), `model_id` identifies the model
/// and K/V format that computed the K/V. Never [`ROOT_KEY`].
pub fn block_key(model_id: Key, parent: Key, tokens: &[u32]) -> Key {
    let mut h = KeyHasher::new(DOMAIN_BLOCK);
    h.write_u128(model_id);
    h.write_u128(parent);
    let mut it = tokens.chunks_exact(2);
    for pair in &mut it {
        h.write_u64(pair[0] as u64 | ((pair[1] as u64) << 32));
    }
    if let [t] = it.remainder() {
        h.write_u64(*t as u64 | (1 << 63));
    }
    // The length separates e.g. [t] from [t, 0] and blocks of different sizes.
    h.write_u64(tokens.len() as u64);
    match h.finish() {
        ROOT_KEY => 1,
        k => k,
    }
}

/// The 64-bit tag of a key that the pool stores per block (never `NO_KEY`).
pub fn key_tag(key: Key) -> u64 {
    match (key as u64) ^ ((key >> 64) as u64) {
        NO_KEY => NO_KEY - 1,
        t => t,
    }
}

#[derive(Debug)]
struct Inner {
    map: HashMap<Key, BlockId>,
    /// Per block: its key (`ROOT_KEY` = not indexed) and its parent's key.
    key: Vec<Key>,
    parent: Vec<Key>,
    /// Per block: the tokens its key was computed from (`block_size` each).
    tokens: Vec<u32>,
    bs: usize,
    /// KV events of the map's changes (off unless enabled; see [`super::events`]).
    events: EventLog,
}

impl Inner {
    /// Removes `key -> b` from the map (the caller checked it is there) and records it.
    fn unmap(&mut self, key: Key) {
        self.map.remove(&key);
        self.events.record(|| KvEvent::BlockRemoved {
            key,
            medium: Medium::Ram,
        });
    }

    /// The map's entries as `BlockStored` events (a snapshot for [`EventLog::drain`]).
    fn snapshot(&self) -> Vec<KvEvent> {
        let bs = self.bs;
        self.map
            .iter()
            .map(|(&key, &b)| {
                let i = b as usize;
                KvEvent::BlockStored {
                    key,
                    parent: self.parent[i],
                    tokens: self.tokens[i * bs..(i + 1) * bs].to_vec(),
                    medium: Medium::Ram,
                }
            })
            .collect()
    }
}

/// Key -> block map with the content each key stands for (a hint; see the module docs).
#[derive(Debug)]
pub struct PrefixIndex {
    inner: Mutex<Inner>,
}

impl PrefixIndex {
    /// An empty index for a pool of `n_blocks` blocks of `block_size` tokens.
    pub fn new(n_blocks: usize, block_size: usize) -> Result<PrefixIndex> {
        let n_tokens = n_blocks
            .checked_mul(block_size)
            .ok_or_else(|| Error::InvalidInput("prefix index too large".into()))?;
        Ok(PrefixIndex {
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                key: try_vec(n_blocks, ROOT_KEY, "the prefix index")?,
                parent: try_vec(n_blocks, ROOT_KEY, "the prefix index")?,
                tokens: try_vec(n_tokens, 0u32, "the prefix index")?,
                bs: block_size,
                events: EventLog::default(),
            }),
        })
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every critical section leaves the map and the records consistent before anything that
        // could panic, so a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives block `b` (held by the caller, its K/V written) the content key `key` computed from
    /// `parent` and `tokens`, in the pool (tag) and the map. A block that already has this key
    /// keeps it; another block holding the same content stays valid but the map points at `b`.
    pub fn insert(
        &self,
        pool: &BlockPool,
        b: BlockId,
        key: Key,
        parent: Key,
        tokens: &[u32],
    ) -> Result<()> {
        let mut m = self.inner();
        let i = b as usize;
        if i >= m.key.len() || tokens.len() != m.bs {
            return Err(Error::InvalidInput(format!(
                "prefix index: block {b} or {} tokens do not fit this index",
                tokens.len()
            )));
        }
        pool.set_key(b, key_tag(key))
            .map_err(|e| Error::InvalidInput(format!("kv bookkeeping: {e}")))?;
        let old = m.key[i];
        if old != ROOT_KEY && old != key && m.map.get(&old) == Some(&b) {
            m.unmap(old);
        }
        m.key[i] = key;
        m.parent[i] = parent;
        let bs = m.bs;
        m.tokens[i * bs..(i + 1) * bs].copy_from_slice(tokens);
        if m.map.insert(key, b).is_none() {
            m.events.record(|| KvEvent::BlockStored {
                key,
                parent,
                tokens: tokens.to_vec(),
                medium: Medium::Ram,
            });
        }
        Ok(())
    }

    /// The block holding `key` (computed from `parent` and `tokens`), with a reference taken on
    /// it (`revive`), or `None`.
    pub fn lookup(
        &self,
        pool: &BlockPool,
        key: Key,
        parent: Key,
        tokens: &[u32],
    ) -> Option<BlockId> {
        let mut m = self.inner();
        let b = *m.map.get(&key)?;
        let i = b as usize;
        let bs = m.bs;
        let same =
            m.key[i] == key && m.parent[i] == parent && m.tokens[i * bs..(i + 1) * bs] == *tokens;
        if same && pool.revive(b, key_tag(key)) {
            return Some(b);
        }
        // The block was evicted or re-keyed without our hearing of it yet, or the entry is a
        // hash collision: drop it.
        m.unmap(key);
        if !same {
            return None;
        }
        m.key[i] = ROOT_KEY;
        None
    }

    /// Whether `key` (computed from `parent` and `tokens`) names a block that still holds it,
    /// without taking a reference: an estimate for planning (the block may be evicted before
    /// a later [`PrefixIndex::lookup`]).
    pub fn contains(&self, pool: &BlockPool, key: Key, parent: Key, tokens: &[u32]) -> bool {
        let m = self.inner();
        let Some(&b) = m.map.get(&key) else {
            return false;
        };
        let i = b as usize;
        let bs = m.bs;
        m.key[i] == key
            && m.parent[i] == parent
            && m.tokens[i * bs..(i + 1) * bs] == *tokens
            && pool.key(b) == key_tag(key)
    }

    /// Forgets block `b`'s key after the pool evicted or untagged it (`tag`: the tag it had).
    pub fn forget(&self, b: BlockId, tag: u64) {
        if tag == NO_KEY {
            return;
        }
        let mut m = self.inner();
        let i = b as usize;
        if i >= m.key.len() {
            return;
        }
        let k = m.key[i];
        if k != ROOT_KEY && key_tag(k) == tag {
            if m.map.get(&k) == Some(&b) {
                m.unmap(k);
            }
            m.key[i] = ROOT_KEY;
        }
    }

    /// The key recorded for block `b` (`ROOT_KEY` if none).
    pub fn key_of(&self, b: BlockId) -> Key {
        self.inner()
            .key
            .get(b as usize)
            .copied()
            .unwrap_or(ROOT_KEY)
    }

    /// The parent key recorded for block `b` (`ROOT_KEY` if none).
    pub fn parent_of(&self, b: BlockId) -> Key {
        self.inner()
            .parent
            .get(b as usize)
            .copied()
            .unwrap_or(ROOT_KEY)
    }

    /// Starts recording KV events (at most `capacity` waiting; an enabled log is reset) or,
    /// with `None`, stops. See [`super::events`].
    pub fn set_events(&self, capacity: Option<usize>) {
        let mut m = self.inner();
        match capacity {
            Some(c) => m.events.enable(c),
            None => m.events.disable(),
        }
    }

    /// The KV events recorded since the last drain (a snapshot of the map after drops or a
    /// fresh start; see [`EventLog::drain`]). Nothing when disabled.
    pub fn drain_events(&self) -> Drained {
        let mut m = self.inner();
        // The snapshot reads the map while the log drains: take the log out (under the lock,
        // so no event is recorded meanwhile) and put it back.
        let mut log = std::mem::take(&mut m.events);
        let d = log.drain(|| m.snapshot());
        m.events = log;
        d
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.inner().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable() {
        // Fixed values, computed independently by a Python transcription of the algorithm
        // (scripts/key_reference.py: big-integer arithmetic masked to 64 bits). A change here
        // breaks keys stored outside the process.
        let t: Vec<u32> = (0..16).map(|i| i * 1000 + 7).collect();
        assert_eq!(block_key(0, ROOT_KEY, &t), KEY_A);
        assert_eq!(
            block_key(0xdead_beef << 70 | 12345, 12345678901234567 << 40, &t[..15]),
            KEY_B
        );
        let mut h = KeyHasher::new(3);
        h.write_bytes(b"kvserve model id!");
        assert_eq!(h.finish(), KEY_C);
    }

    const KEY_A: u128 = 159025517986797404229346580209333191416;
    const KEY_B: u128 = 319419711206145360425570493828815490470;
    const KEY_C: u128 = 10815817158762051037600455180320021256;

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
        for p in [1u128, 2, 1 << 63, 1 << 64, 1 << 127, k] {
            assert!(seen.insert(block_key(1, p, &t)), "parent {p}");
        }
        assert!(seen.insert(block_key(2, ROOT_KEY, &t)), "model id");
        assert!(
            seen.insert(block_key(1 << 100, ROOT_KEY, &t)),
            "model id high"
        );
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
        // Flipping one input bit flips about half of the 128 output bits (avalanche), in each
        // half separately.
        let t: Vec<u32> = (0..16).map(|i| i * 7 + 1).collect();
        let k = block_key(3, 99, &t);
        let (mut total, mut n) = (0u32, 0u32);
        for i in 0..t.len() {
            for bit in 0..32 {
                let mut u = t.clone();
                u[i] ^= 1 << bit;
                let x = block_key(3, 99, &u) ^ k;
                let (lo, hi) = ((x as u64).count_ones(), ((x >> 64) as u64).count_ones());
                assert!(
                    (12..=52).contains(&lo) && (12..=52).contains(&hi),
                    "token {i} bit {bit}: {lo}/{hi} bits flipped"
                );
                total += lo + hi;
                n += 1;
            }
        }
        let mean = total as f64 / n as f64;
        assert!((62.0..66.0).contains(&mean), "mean flipped bits {mean}");
    }

    #[test]
    fn lookup_verifies_content_and_revives() {
        let pool = BlockPool::new(2);
        let idx = PrefixIndex::new(2, 4).unwrap();
        let toks = [1, 2, 3, 4];
        let key = block_key(9, ROOT_KEY, &toks);
        let b = pool.allocate().unwrap();
        idx.insert(&pool, b, key, ROOT_KEY, &toks).unwrap();
        pool.release(b).unwrap(); // cached
                                  // Other tokens or another parent under the same key (a collision) never match.
        assert_eq!(idx.lookup(&pool, key, ROOT_KEY, &[1, 2, 3, 5]), None);
        assert!(idx.is_empty(), "the suspicious entry is dropped");
        assert!(pool.is_cached(b), "the block itself is untouched");
        assert!(pool.revive(b, key_tag(key)));
        idx.insert(&pool, b, key, ROOT_KEY, &toks).unwrap();
        pool.release(b).unwrap();
        assert_eq!(idx.lookup(&pool, key, 5, &toks), None);
        assert!(pool.revive(b, key_tag(key)));
        idx.insert(&pool, b, key, ROOT_KEY, &toks).unwrap();
        pool.release(b).unwrap();
        assert_eq!(idx.lookup(&pool, key, ROOT_KEY, &toks), Some(b));
        assert_eq!(pool.refcount(b), 1);
        pool.release(b).unwrap();
        // The free block goes first, then the cached one is evicted: the pool reports its tag
        // and the index forgets the entry.
        let (x, none) = pool.allocate_evicting().unwrap();
        assert_eq!((x == b, none), (false, None));
        let (y, old) = pool.allocate_evicting().unwrap();
        assert_eq!((y, old), (b, Some(key_tag(key))));
        idx.forget(b, old.unwrap());
        assert!(idx.is_empty());
        assert_eq!(idx.key_of(b), ROOT_KEY);
        assert_eq!(idx.lookup(&pool, key, ROOT_KEY, &toks), None);
        pool.release(x).unwrap();
        pool.release(y).unwrap();
        pool.audit().unwrap();
    }
}
