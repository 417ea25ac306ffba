//! KV events: a bounded log of the moments a block's content key becomes findable in a model's
//! prefix index and stops being findable, so that something outside the process (a router
//! choosing the replica that already holds a prompt's prefix) can mirror what the memory holds
//! without asking. The shape follows vLLM's KV events (`BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`; docs/CLUSTER.md gives the mapping).
//!
//! Guarantees:
//! - Off by default, and then free: the index checks one `Option` it already holds the lock of.
//! - The log mirrors the index's map exactly: [`KvEvent::BlockStored`] when a key enters the map
//!   (a commit keyed a block, a disk read filled one), [`KvEvent::BlockRemoved`] when it leaves
//!   it (eviction, untag, a stale entry dropped by a lookup). A key that moves from one block to
//!   another holding the same content is no event. Events are recorded under the index lock, so
//!   their order is the order of the map's changes.
//! - Bounded: at most `capacity` events wait. An event that finds the log full drops the
//!   history (a partial history is worth nothing to a mirror) and every event until the next
//!   drain; all are counted. A drain that finds drops (or the first drain after [`EventLog::enable`]) returns
//!   no partial history but a snapshot: [`KvEvent::AllBlocksCleared`], then one
//!   `BlockStored` per key the index holds, taken under the same lock, so a consumer that
//!   applies what it drains always ends up with the index's key set.
//!
//! Keys are the 128-bit content keys of [`super::prefix`] (`block_key`), the same in every
//! process, so a consumer can compute a prompt's keys itself (`chain_keys`) and compare.

use std::collections::VecDeque;

use super::cache::SharedKv;
use super::prefix::{chain_keys, salt_root, Key};

impl SharedKv {
    /// Starts recording this memory's KV events, at most `capacity` waiting between drains
    /// (`None`: stop; an enabled log is reset). Every context of the memory feeds it.
    pub fn kv_events_enable(&self, capacity: Option<usize>) {
        self.index().set_events(capacity);
    }

    /// The KV events since the last drain (see the module docs: a snapshot after drops or
    /// after enabling). Never waits for a decode: only the prefix index's lock is taken.
    pub fn kv_events_drain(&self) -> Drained {
        self.index().drain_events()
    }

    /// The content keys a sequence salted with `salt` (empty: unsalted) gives the whole blocks
    /// of `tokens` in this memory: what its events and prefix matches speak of.
    pub fn block_keys(&self, tokens: &[u32], salt: &[u8]) -> Vec<Key> {
        chain_keys(
            self.model_id(),
            salt_root(salt),
            tokens,
            self.layout().block_size,
        )
    }
}

/// Where a block's K/V lives (vLLM's `medium`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The RAM block pool.
    Ram,
}

impl Medium {
    /// The name consumers see: `"CPU"` for the RAM pool (vLLM names its primary pool `"GPU"`
    /// and its host-memory tier `"CPU"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Ram => "CPU",
        }
    }
}

/// One change of what the memory holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// `key` is findable: a full block of `tokens` whose previous block has key `parent` (the
    /// sequence's root key for a first block: `ROOT_KEY`, or its salt's root).
    BlockStored {
        key: Key,
        parent: Key,
        tokens: Vec<u32>,
        medium: Medium,
    },
    /// `key` is no longer findable.
    BlockRemoved { key: Key, medium: Medium },
    /// Forget everything known of this memory: the events that follow describe it from empty.
    AllBlocksCleared,
}

/// What [`EventLog::drain`] hands over.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Drained {
    /// The events in order (a snapshot starting with `AllBlocksCleared` after drops).
    pub events: Vec<KvEvent>,
    /// Events dropped since the last drain because the log was full.
    pub dropped: u64,
}

/// The bounded event ring. Not synchronised: the prefix index keeps it under its own lock.
#[derive(Debug, Default)]
pub struct EventLog {
    ring: Option<Ring>,
}

#[derive(Debug)]
struct Ring {
    events: VecDeque<KvEvent>,
    capacity: usize,
    dropped: u64,
    /// The next drain must hand over a snapshot (first drain, or events were dropped).
    resync: bool,
    /// The log overflowed since the last drain: every event recorded is counted as dropped.
    overflowed: bool,
}

impl EventLog {
    /// Whether events are recorded.
    pub fn enabled(&self) -> bool {
        self.ring.is_some()
    }

    /// Starts recording, at most `capacity` (>= 1) waiting events; an enabled log is reset.
    /// The next drain hands over a snapshot of the index.
    pub fn enable(&mut self, capacity: usize) {
        self.ring = Some(Ring {
            events: VecDeque::with_capacity(capacity.clamp(1, 4096)),
            capacity: capacity.max(1),
            dropped: 0,
            resync: true,
            overflowed: false,
        });
    }

    /// Stops recording and drops what waits.
    pub fn disable(&mut self) {
        self.ring = None;
    }

    /// Records `e` if enabled (`make` is called only then).
    pub fn record(&mut self, make: impl FnOnce() -> KvEvent) {
        let Some(r) = &mut self.ring else {
            return;
        };
        if r.overflowed {
            r.dropped += 1;
        } else if r.resync {
            // Just enabled: the next drain's snapshot covers this change.
        } else if r.events.len() == r.capacity {
            // Full: what waits is no longer the whole history, so none of it is worth keeping
            // (the next drain hands over a snapshot); it all counts as dropped.
            r.dropped += r.events.len() as u64 + 1;
            r.events.clear();
            r.resync = true;
            r.overflowed = true;
        } else {
            r.events.push_back(make());
        }
    }

    /// Hands over what waits. When the log was just enabled or dropped events, the history is
    /// replaced by `AllBlocksCleared` and `snapshot()` (the index's entries as `BlockStored`),
    /// and `dropped` says how many were lost. Disabled: nothing.
    pub fn drain(&mut self, snapshot: impl FnOnce() -> Vec<KvEvent>) -> Drained {
        let Some(r) = &mut self.ring else {
            return Drained::default();
        };
        let dropped = std::mem::take(&mut r.dropped);
        r.overflowed = false;
        if std::mem::take(&mut r.resync) {
            r.events.clear();
            let mut events = vec![KvEvent::AllBlocksCleared];
            events.extend(snapshot());
            return Drained { events, dropped };
        }
        Drained {
            events: r.events.drain(..).collect(),
            dropped,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn removed(key: Key) -> KvEvent {
        KvEvent::BlockRemoved {
            key,
            medium: Medium::Ram,
        }
    }

    #[test]
    fn disabled_records_nothing_and_never_builds_events() {
        let mut log = EventLog::default();
        log.record(|| unreachable!("built while disabled"));
        assert_eq!(log.drain(|| unreachable!()), Drained::default());
        assert!(!log.enabled());
    }

    #[test]
    fn first_drain_is_a_snapshot_then_events_in_order() {
        let mut log = EventLog::default();
        log.enable(4);
        log.record(|| removed(9)); // covered by the snapshot
        let d = log.drain(|| vec![removed(1)]);
        assert_eq!(d.events, vec![KvEvent::AllBlocksCleared, removed(1)]);
        assert_eq!(d.dropped, 0);
        for k in 2..5 {
            log.record(|| removed(k));
        }
        let d = log.drain(|| unreachable!("no drops"));
        assert_eq!(d.events, vec![removed(2), removed(3), removed(4)]);
        assert_eq!(log.drain(|| unreachable!()), Drained::default());
    }

    #[test]
    fn overflow_counts_drops_and_resyncs() {
        let mut log = EventLog::default();
        log.enable(2);
        log.drain(Vec::new);
        for k in 0..5 {
            log.record(|| removed(k));
        }
        // Two fit; the third finds the log full: none of the five is delivered as such, all
        // count as dropped, and the drain hands over a snapshot.
        let d = log.drain(|| vec![removed(42)]);
        assert_eq!(d.dropped, 5);
        assert_eq!(d.events, vec![KvEvent::AllBlocksCleared, removed(42)]);
        log.record(|| removed(7));
        assert_eq!(log.drain(Vec::new).events, vec![removed(7)]);
    }
}

/// The events of a real memory (a [`super::PagedCache`] over a small pool) against a simple
/// model of what they promise: a mirror that applies every drain holds exactly the index's
/// keys, each with the parent and tokens the index recorded.
#[cfg(all(test, not(loom)))]
mod memory_tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use super::*;
    use crate::batch::Batch;
    use crate::kv::storage::{KvLayout, KvType};
    use crate::kv::{Memory, PagedCache, SeqId};
    use crate::ops::{Rope, RopeScaling};
    use crate::test_rng::Rng;

    const BS: usize = 4;
    const D: usize = 8;

    fn cache(n_ctx: usize) -> PagedCache {
        let layout = KvLayout {
            ty: KvType::F32,
            n_layers: 1,
            kv_dim: D,
            block_size: BS,
        };
        let rope = Rope {
            n_rot: D,
            neox: false,
            freq_base: 10000.0,
            scaling: RopeScaling::None,
            freq_factors: None,
        };
        PagedCache::standalone(layout, D, rope, n_ctx).unwrap()
    }

    /// Decodes `tokens` into the empty sequence `seq` after mapping its cached prefix.
    fn decode(c: &mut PagedCache, seq: SeqId, tokens: &[u32]) {
        let n = c.match_prefix(seq, tokens).unwrap();
        let b = Batch::prompt(&tokens[n..], n as i32, seq);
        let shared = Arc::clone(c.shared());
        let mut st = shared.lock_storage();
        let (slots, tx) = c.begin_batch(&b, &mut st).unwrap();
        let zeros = vec![0.0f32; b.len() * D];
        PagedCache::write(&mut st, 0, &slots, &zeros, &zeros);
        c.commit(tx);
    }

    /// key -> (parent, tokens): what a consumer of the events knows.
    type Mirror = HashMap<Key, (Key, Vec<u32>)>;

    fn apply(mirror: &mut Mirror, d: &Drained) {
        for e in &d.events {
            match e {
                KvEvent::BlockStored {
                    key,
                    parent,
                    tokens,
                    ..
                } => {
                    assert!(
                        mirror.insert(*key, (*parent, tokens.clone())).is_none(),
                        "stored twice without a removal"
                    );
                }
                KvEvent::BlockRemoved { key, .. } => {
                    assert!(mirror.remove(key).is_some(), "removed but never stored");
                }
                KvEvent::AllBlocksCleared => mirror.clear(),
            }
        }
    }

    fn check(c: &PagedCache, mirror: &Mirror) {
        let sh = c.shared();
        assert_eq!(
            sh.index().len(),
            mirror.len(),
            "mirror and index differ in size"
        );
        for (k, (parent, tokens)) in mirror {
            assert!(
                sh.index().contains(sh.pool(), *k, *parent, tokens),
                "mirrored key {k:x} is not in the index"
            );
        }
    }

    #[test]
    fn store_then_evict_in_vllm_order() {
        // A small pool, whose every token this context may hold.
        let mut c = PagedCache::new(Arc::clone(cache(BS * 2 + 1).shared()), usize::MAX).unwrap();
        let sh = Arc::clone(c.shared());
        let n = sh.n_blocks();
        assert_eq!(sh.kv_events_drain(), Drained::default(), "off by default");
        sh.kv_events_enable(Some(64));
        let d = sh.kv_events_drain();
        assert_eq!(d.events, vec![KvEvent::AllBlocksCleared], "an empty memory");
        let p: Vec<u32> = (0..9).map(|i| 100 + i).collect();
        c.table_mut().set_root(0, salt_root(b"t")).unwrap();
        decode(&mut c, 0, &p);
        let keys = sh.block_keys(&p, b"t");
        assert_eq!(keys.len(), 2);
        let stored = |k: usize, parent: Key| KvEvent::BlockStored {
            key: keys[k],
            parent,
            tokens: p[k * BS..(k + 1) * BS].to_vec(),
            medium: Medium::Ram,
        };
        let d = sh.kv_events_drain();
        assert_eq!(
            d.events,
            vec![stored(0, salt_root(b"t")), stored(1, keys[0])]
        );
        assert_ne!(sh.block_keys(&p, b""), keys, "the salt is in the keys");
        // Released: cached, still findable, no event. A second sequence of other tokens needs
        // every block: the cached ones are evicted, the tail first (released first).
        c.seq_rm(0, -1, -1).unwrap();
        assert!(sh.kv_events_drain().events.is_empty());
        let q: Vec<u32> = (0..(n * BS) as u32).map(|i| 500 + i).collect();
        decode(&mut c, 1, &q[..n * BS - 1]);
        let removed = |k: usize| KvEvent::BlockRemoved {
            key: keys[k],
            medium: Medium::Ram,
        };
        let d = sh.kv_events_drain();
        let order: Vec<&KvEvent> = d
            .events
            .iter()
            .filter(|e| matches!(e, KvEvent::BlockRemoved { .. }))
            .collect();
        assert_eq!(order, vec![&removed(1), &removed(0)]);
        let mut m = Mirror::new();
        sh.kv_events_enable(Some(64));
        apply(&mut m, &sh.kv_events_drain());
        check(&c, &m);
        assert_eq!(m.len(), n - 1, "the new prompt's full blocks");
        sh.kv_events_enable(None);
        c.seq_rm(1, -1, -1).unwrap();
        decode(&mut c, 2, &p);
        assert_eq!(sh.kv_events_drain(), Drained::default(), "off again");
    }

    #[test]
    fn overflow_counts_drops_and_the_drain_resyncs() {
        let mut c = cache(64);
        let sh = Arc::clone(c.shared());
        sh.kv_events_enable(Some(2));
        let mut m = Mirror::new();
        apply(&mut m, &sh.kv_events_drain());
        let p: Vec<u32> = (0..21).collect();
        decode(&mut c, 0, &p); // 5 blocks keyed: 5 events for a log of 2
        let d = sh.kv_events_drain();
        assert_eq!(d.dropped, 5);
        assert_eq!(d.events[0], KvEvent::AllBlocksCleared);
        apply(&mut m, &d);
        check(&c, &m);
        assert_eq!(m.len(), 5);
        decode(&mut c, 1, &[7; 9]);
        let d = sh.kv_events_drain();
        assert_eq!((d.events.len(), d.dropped), (2, 0), "within capacity again");
        apply(&mut m, &d);
        check(&c, &m);
    }

    /// Random prompts (sharing prefixes, two salts), removals and evictions in a small pool,
    /// drained at random moments into a small log: the mirror always equals the index.
    #[test]
    fn random_operations_keep_a_mirror_exact() {
        let mut rng = Rng(0x6b76_6576);
        let mut evicted = 0;
        for _ in 0..20 {
            let mut c = cache(6 * BS + 3);
            let sh = Arc::clone(c.shared());
            let cap = 1 + rng.below(12);
            sh.kv_events_enable(Some(cap));
            let mut m = Mirror::new();
            let mut live: Vec<SeqId> = Vec::new();
            let mut next: SeqId = 0;
            for _ in 0..60 {
                if rng.below(3) == 0 && !live.is_empty() {
                    let s = live.swap_remove(rng.below(live.len()));
                    c.seq_rm(s, -1, -1).unwrap();
                } else {
                    while c.n_cells() > 2 * BS {
                        let s = live.remove(0);
                        c.seq_rm(s, -1, -1).unwrap();
                    }
                    let base = rng.below(3) as u32;
                    let len = 1 + rng.below(3 * BS + 2);
                    let p: Vec<u32> = (0..len as u32)
                        .map(|i| if i < 6 { base } else { i * 7 + base })
                        .collect();
                    let salt: &[u8] = if rng.below(2) == 0 { b"" } else { b"s" };
                    c.table_mut().set_root(next, salt_root(salt)).unwrap();
                    decode(&mut c, next, &p);
                    live.push(next);
                    next += 1;
                }
                if rng.below(4) == 0 {
                    apply(&mut m, &sh.kv_events_drain());
                    check(&c, &m);
                }
            }
            apply(&mut m, &sh.kv_events_drain());
            check(&c, &m);
            evicted += sh.pool_stats().evicted;
        }
        assert!(evicted > 20, "the pool evicted ({evicted})");
    }
}
