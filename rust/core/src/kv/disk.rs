//! The local disk tier (L2) of the K/V cache: full keyed blocks of a model's memory kept in a
//! directory, found again by their content keys after the RAM pool evicted them, and after a
//! restart. Semantics: docs/KV_SEMANTICS.md, "Disk tier". A tier belongs to one K/V memory
//! (`SharedKv`): a model with several K/V layer groups (Gemma 3: full and window) has one per
//! group, each under its group's model id. A hybrid model (LFM2) also keeps its recurrent
//! state checkpoints in its full-attention group's tier: entries of this format keyed by
//! `recurrent::checkpoint_key` (its own hash domain), parent the K/V block's key, payload the
//! checkpoint block's bytes (docs/KV_SEMANTICS.md, "Disk tier", "Recurrent groups").
//!
//! **Layout.** `DIR/<model id, 32 hex digits>/<key, 32 hex digits>.kvb`, one file per block,
//! and `DIR/<model id>/LOCK`, locked (`File::try_lock`) by the one tier that uses the
//! directory (a second process gets an `Io` error naming it; a second open in the same process
//! shares the first tier). One file per block rather than an append log: a write is atomic by
//! itself (temporary file, then `rename`), eviction is an `unlink` with no compaction or garbage
//! collection, damage stays confined to one entry, and a reader never sees a half-written
//! entry. The cost is an inode per block (a 360 KiB SmolLM2 block: ~58,000 files for 20 GiB)
//! and an `open` per read (microseconds, against the milliseconds of recomputing a block).
//!
//! **Entry format** (little-endian; version [`VERSION`]):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `KVSDISK\0` |
//! | 8 | 4 | format version |
//! | 12 | 4 | block size `b` (tokens) |
//! | 16 | 16 | model id (`SharedKv::model_id`: weights, K/V type, block size, layout) |
//! | 32 | 16 | the block's content key |
//! | 48 | 16 | its parent key |
//! | 64 | 8 | payload length (`KvStorage::block_raw`: every layer's K and V) |
//! | 72 | `4b` | the block's token ids |
//! | 72 + `4b` | payload length | the payload, as the pool stores it |
//! | end - 16 | 16 | checksum: [`KeyHasher`] over the header (tokens included), then the payload |
//!
//! **Guarantees.** A read returns a block only when the entry's magic, version, block size,
//! model id, key, parent key, tokens, length and checksum all match what was asked; anything
//! else (a torn, truncated, corrupt, other-model or other-version entry, a file that vanished)
//! is a miss, and the entry is removed. So the tier can lose blocks, never hand out wrong
//! ones. The in-memory index (key -> size and LRU rank) is built at open by reading every
//! entry's header (its length checked against the header; the checksum is checked on read),
//! ordered by modification time, which a hit refreshes, so the LRU order survives a restart.
//!
//! **Writes** come from a decode's commit (write-through, `PagedCache::write_through`): the
//! caller copies a block's bytes while it holds the storage lock and [`DiskTier::offer`]s them
//! to a bounded queue (a byte budget, [`DiskOptions::queue_bytes`]); a full queue drops the
//! write (counted) instead of blocking the decode. One writer thread per tier encodes, writes
//! the temporary file, evicts least recently used entries until the new one fits the size
//! limit, and renames it into place. No `fsync`: after a power loss an entry may be torn,
//! which a read detects (a miss).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime};

use super::prefix::{Key, KeyHasher};
use crate::error::{invalid, Error, Result};

/// First bytes of every entry.
pub const MAGIC: [u8; 8] = *b"KVSDISK\0";
/// Entry format version; an entry of another version is a miss (and removed).
pub const VERSION: u32 = 1;
/// Header bytes before the tokens.
const FIXED: usize = 72;
/// Checksum bytes at the end.
const TRAILER: usize = 16;
const DOMAIN_DISK: u64 = 0x6b76_7365_7276_6544; // "kvserveD"

/// Prompts shorter than this many tokens do not look in the tier: the break-even below which
/// reading a prompt's blocks is not faster than recomputing them. Measured by
/// `benches/bench_kv_disk.py` (BENCHMARKS.md, "K/V disk tier"): on the development machine
/// (2 shared cores, SmolLM2-135M, f16 K/V, warm page cache) a 360 KiB block reads back in
/// ~0.3 ms (open, read, checksum, copy into the pool) while computing its 16 tokens takes
/// tens of milliseconds, and the shortest prompt that can map a block (one block and a token,
/// 17 tokens) already reaches its first token in under half the cold time from disk. The
/// break-even is below every prompt the tier can serve, so the default skips none; a tier on
/// a disk slow enough that a block's read approaches the compute time of its tokens wants a
/// higher value ([`DiskOptions::min_tokens`], Engine `kv_disk_min_tokens`).
pub const DEFAULT_MIN_TOKENS: usize = 0;

/// Default byte budget of the write queue ([`DiskOptions::queue_bytes`]).
pub const DEFAULT_QUEUE_BYTES: usize = 64 << 20;

/// How a tier is sized and used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskOptions {
    /// Most bytes of entries kept (files' sizes); least recently used entries go beyond it.
    pub max_bytes: u64,
    /// Prompts shorter than this do not look in the tier (see [`DEFAULT_MIN_TOKENS`]).
    pub min_tokens: usize,
    /// Bytes of blocks waiting for the writer; an offer beyond it is dropped.
    pub queue_bytes: usize,
}

impl DiskOptions {
    /// `max_bytes` with the default break-even and queue.
    pub fn with_size(max_bytes: u64) -> DiskOptions {
        DiskOptions {
            max_bytes,
            min_tokens: DEFAULT_MIN_TOKENS,
            queue_bytes: DEFAULT_QUEUE_BYTES,
        }
    }
}

/// Counters of a tier (since it was opened) and what it holds now.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DiskStats {
    /// Blocks read back (verified) and the tokens they hold.
    pub hit_blocks: u64,
    pub hit_tokens: u64,
    /// Lookups that found no valid entry (not held, or held but invalid).
    pub misses: u64,
    /// Bytes of entries read by hits, and written by the writer.
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Entries written, and offers dropped (queue full, or an I/O error while writing).
    pub writes: u64,
    pub writes_dropped: u64,
    /// Entries removed as invalid (at open or on read) and evicted by the size limit.
    pub removed: u64,
    pub evicted: u64,
    /// Prompt lookups that skipped the tier (shorter than `min_tokens`).
    pub skipped: u64,
    /// Entries and their bytes now; the size limit; entries found by the scan at open.
    pub entries: u64,
    pub bytes_held: u64,
    pub max_bytes: u64,
    pub loaded: u64,
    /// Blocks offered and not yet written.
    pub queued: u64,
    /// Time spent in the reads that hit (seconds; per read: `read_seconds / hit_blocks`).
    pub read_seconds: f64,
    pub min_tokens: usize,
}

impl DiskStats {
    /// Adds `o`'s counts to these (the tiers of a model's several K/V groups, reported as
    /// one): every count and the size limit summed, the larger break-even.
    pub fn merge(&mut self, o: &DiskStats) {
        for (a, b) in [
            (&mut self.hit_blocks, o.hit_blocks),
            (&mut self.hit_tokens, o.hit_tokens),
            (&mut self.misses, o.misses),
            (&mut self.bytes_read, o.bytes_read),
            (&mut self.bytes_written, o.bytes_written),
            (&mut self.writes, o.writes),
            (&mut self.writes_dropped, o.writes_dropped),
            (&mut self.removed, o.removed),
            (&mut self.evicted, o.evicted),
            (&mut self.skipped, o.skipped),
            (&mut self.entries, o.entries),
            (&mut self.bytes_held, o.bytes_held),
            (&mut self.max_bytes, o.max_bytes),
            (&mut self.loaded, o.loaded),
            (&mut self.queued, o.queued),
        ] {
            *a += b;
        }
        self.read_seconds += o.read_seconds;
        self.min_tokens = self.min_tokens.max(o.min_tokens);
    }
}

struct Entry {
    bytes: u64,
    tick: u64,
}

/// The in-memory index: key -> entry, and the LRU order (tick -> key, oldest first).
#[derive(Default)]
struct Index {
    entries: HashMap<Key, Entry>,
    lru: BTreeMap<u64, Key>,
    /// Offered and not yet written (or dropped): not offered again.
    pending: HashSet<Key>,
    next_tick: u64,
    bytes: u64,
    max_bytes: u64,
}

impl Index {
    fn insert(&mut self, key: Key, bytes: u64) {
        self.remove(key);
        let tick = self.next_tick;
        self.next_tick += 1;
        self.entries.insert(key, Entry { bytes, tick });
        self.lru.insert(tick, key);
        self.bytes += bytes;
    }

    fn remove(&mut self, key: Key) -> bool {
        match self.entries.remove(&key) {
            Some(e) => {
                self.lru.remove(&e.tick);
                self.bytes -= e.bytes;
                true
            }
            None => false,
        }
    }

    fn touch(&mut self, key: Key) {
        if let Some(e) = self.entries.get_mut(&key) {
            self.lru.remove(&e.tick);
            e.tick = self.next_tick;
            self.lru.insert(e.tick, key);
            self.next_tick += 1;
        }
    }

    /// The least recently used key.
    fn oldest(&self) -> Option<Key> {
        self.lru.values().next().copied()
    }
}

#[derive(Default)]
struct Counters {
    hit_blocks: AtomicU64,
    misses: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    writes: AtomicU64,
    writes_dropped: AtomicU64,
    removed: AtomicU64,
    evicted: AtomicU64,
    skipped: AtomicU64,
    loaded: AtomicU64,
    queued: AtomicU64,
    read_ns: AtomicU64,
}

/// What the tier and its writer thread share.
struct Shared {
    dir: PathBuf,
    model_id: Key,
    block_size: usize,
    block_bytes: usize,
    index: Mutex<Index>,
    c: Counters,
    min_tokens: AtomicUsize,
    tmp_seq: AtomicU64,
}

/// A block to write.
struct Job {
    key: Key,
    parent: Key,
    tokens: Vec<u32>,
    payload: Vec<u8>,
}

enum Msg {
    Write(Job),
    /// Answered once every message before it was handled.
    Flush(mpsc::Sender<()>),
    /// Tests: the writer says it arrived, then waits until the sender side goes away.
    #[cfg(test)]
    Hold(mpsc::Sender<()>, Receiver<()>),
}

/// The disk tier of one model's K/V memory (see the module docs). Shared by every context of
/// the memory (`SharedKv::set_disk`); thread-safe.
pub struct DiskTier {
    s: Arc<Shared>,
    tx: Mutex<Option<SyncSender<Msg>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// Holds the directory's lock while the tier lives.
    _lock: File,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("dir", &self.s.dir)
            .finish()
    }
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Io(format!("kv disk tier: {what} {}: {e}", path.display()))
}

/// Tiers open in this process, by their directory (`DIR/<model id>`, canonical): a second
/// open of one directory shares the tier instead of fighting over its lock and files.
static OPEN: Mutex<Vec<(PathBuf, Weak<DiskTier>)>> = Mutex::new(Vec::new());

pub(crate) fn entry_len(block_size: usize, payload: usize) -> usize {
    FIXED + 4 * block_size + payload + TRAILER
}

fn key_name(key: Key) -> String {
    format!("{key:032x}.kvb")
}

fn parse_name(name: &str) -> Option<Key> {
    let hex = name.strip_suffix(".kvb")?;
    if hex.len() != 32 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    Key::from_str_radix(hex, 16).ok()
}

fn header(model_id: Key, key: Key, parent: Key, tokens: &[u32], payload_len: usize) -> Vec<u8> {
    let mut h = Vec::with_capacity(FIXED + 4 * tokens.len());
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    h.extend_from_slice(&model_id.to_le_bytes());
    h.extend_from_slice(&key.to_le_bytes());
    h.extend_from_slice(&parent.to_le_bytes());
    h.extend_from_slice(&(payload_len as u64).to_le_bytes());
    for t in tokens {
        h.extend_from_slice(&t.to_le_bytes());
    }
    h
}

fn checksum(header: &[u8], payload: &[u8]) -> [u8; 16] {
    let mut h = KeyHasher::new(DOMAIN_DISK);
    h.write_bytes(header);
    h.write_bytes(payload);
    h.finish().to_le_bytes()
}

/// A whole entry (the format above) for a block: what the shared tier (`super::remote`)
/// stores as a value.
pub(crate) fn encode_entry(
    model_id: Key,
    key: Key,
    parent: Key,
    tokens: &[u32],
    payload: &[u8],
) -> Vec<u8> {
    let mut e = header(model_id, key, parent, tokens, payload.len());
    let sum = checksum(&e, payload);
    e.reserve_exact(payload.len() + TRAILER);
    e.extend_from_slice(payload);
    e.extend_from_slice(&sum);
    e
}

/// The payload of `entry` when it is exactly the entry [`encode_entry`] gives for this model,
/// `key`, `parent`, `tokens` and a payload of `payload_len` bytes, checksum included; `None`
/// for anything else (another version, model, key, parent or content, a wrong length, a
/// damaged byte).
pub(crate) fn entry_payload<'a>(
    entry: &'a [u8],
    model_id: Key,
    key: Key,
    parent: Key,
    tokens: &[u32],
    payload_len: usize,
) -> Option<&'a [u8]> {
    let h_len = FIXED + 4 * tokens.len();
    if entry.len() != entry_len(tokens.len(), payload_len) {
        return None;
    }
    let (h, rest) = entry.split_at(h_len);
    let (payload, sum) = rest.split_at(payload_len);
    let same_tokens = h[FIXED..]
        .chunks_exact(4)
        .zip(tokens)
        .all(|(b, &t)| u32::from_le_bytes(b.try_into().expect("4 bytes")) == t);
    let ok = h[..8] == MAGIC
        && u32_at(h, 8) == VERSION
        && u32_at(h, 12) as usize == tokens.len()
        && u128_at(h, 16) == model_id
        && u128_at(h, 32) == key
        && u128_at(h, 48) == parent
        && u64_at(h, 64) == payload_len as u64
        && same_tokens
        && sum == checksum(h, payload);
    ok.then_some(payload)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u128_at(b: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(b[at..at + 16].try_into().expect("16 bytes"))
}

impl Shared {
    fn path(&self, key: Key) -> PathBuf {
        self.dir.join(key_name(key))
    }

    fn entry_len(&self) -> usize {
        entry_len(self.block_size, self.block_bytes)
    }

    fn index(&self) -> MutexGuard<'_, Index> {
        // Every critical section leaves the index consistent before anything that could
        // panic, so a poisoned lock is still usable.
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the fixed header `h` (tokens included) is an entry of this tier for `key`,
    /// ignoring the parent and tokens.
    fn header_ok(&self, h: &[u8], key: Key) -> bool {
        h.len() == FIXED + 4 * self.block_size
            && h[..8] == MAGIC
            && u32_at(h, 8) == VERSION
            && u32_at(h, 12) as usize == self.block_size
            && u128_at(h, 16) == self.model_id
            && u128_at(h, 32) == key
            && u64_at(h, 64) == self.block_bytes as u64
    }

    /// Removes `key`'s entry and file (an invalid entry: counted as removed), unless the
    /// entry went meanwhile (evicted while it was being read: nothing to remove).
    fn discard(&self, key: Key) {
        let mut ix = self.index();
        if ix.remove(key) {
            let _ = fs::remove_file(self.path(key));
            self.c.removed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Evicts least recently used entries until `incoming` more bytes fit (under the lock).
    fn make_room(&self, ix: &mut Index, incoming: u64) {
        while ix.bytes + incoming > ix.max_bytes {
            let Some(old) = ix.oldest() else {
                break;
            };
            ix.remove(old);
            let _ = fs::remove_file(self.path(old));
            self.c.evicted.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The writer's work for one block.
    fn write(&self, job: Job) {
        let done = |s: &Shared, ok: bool| {
            s.index().pending.remove(&job.key);
            s.c.queued.fetch_sub(1, Ordering::Relaxed);
            if !ok {
                s.c.writes_dropped.fetch_add(1, Ordering::Relaxed);
            }
        };
        if self.index().entries.contains_key(&job.key) {
            done(self, true);
            return;
        }
        let h = header(
            self.model_id,
            job.key,
            job.parent,
            &job.tokens,
            job.payload.len(),
        );
        let sum = checksum(&h, &job.payload);
        let n = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .dir
            .join(format!(".{:032x}.{}.{n}.tmp", job.key, std::process::id()));
        let wrote = File::create(&tmp).and_then(|mut f| {
            f.write_all(&h)?;
            f.write_all(&job.payload)?;
            f.write_all(&sum)
        });
        if wrote.is_err() {
            let _ = fs::remove_file(&tmp);
            done(self, false);
            return;
        }
        let len = (h.len() + job.payload.len() + TRAILER) as u64;
        let mut ix = self.index();
        if len > ix.max_bytes {
            drop(ix);
            let _ = fs::remove_file(&tmp);
            done(self, false);
            return;
        }
        self.make_room(&mut ix, len);
        if fs::rename(&tmp, self.path(job.key)).is_err() {
            drop(ix);
            let _ = fs::remove_file(&tmp);
            done(self, false);
            return;
        }
        ix.insert(job.key, len);
        drop(ix);
        self.c.writes.fetch_add(1, Ordering::Relaxed);
        self.c.bytes_written.fetch_add(len, Ordering::Relaxed);
        done(self, true);
    }

    /// Reads `key`'s entry into `out` after checking everything (see the module docs).
    fn read(&self, key: Key, parent: Key, tokens: &[u32], out: &mut [u8]) -> bool {
        if !self.index().entries.contains_key(&key) {
            self.c.misses.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let t0 = Instant::now();
        let path = self.path(key);
        let ok = (|| -> std::io::Result<bool> {
            let mut f = File::open(&path)?;
            let expect = entry_len(tokens.len(), out.len()) as u64;
            if tokens.len() != self.block_size
                || out.len() != self.block_bytes
                || f.metadata()?.len() != expect
            {
                return Ok(false);
            }
            let mut h = vec![0u8; FIXED + 4 * self.block_size];
            f.read_exact(&mut h)?;
            let same_tokens = h[FIXED..]
                .chunks_exact(4)
                .zip(tokens)
                .all(|(b, &t)| u32::from_le_bytes(b.try_into().expect("4 bytes")) == t);
            if !self.header_ok(&h, key) || u128_at(&h, 48) != parent || !same_tokens {
                return Ok(false);
            }
            f.read_exact(out)?;
            let mut sum = [0u8; TRAILER];
            f.read_exact(&mut sum)?;
            if sum != checksum(&h, out) {
                return Ok(false);
            }
            // Best effort: the file's time is its LRU rank at the next open.
            let _ = f.set_modified(SystemTime::now());
            Ok(true)
        })()
        .unwrap_or(false);
        if !ok {
            self.discard(key);
            self.c.misses.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.index().touch(key);
        let c = &self.c;
        c.hit_blocks.fetch_add(1, Ordering::Relaxed);
        c.bytes_read
            .fetch_add(self.entry_len() as u64, Ordering::Relaxed);
        c.read_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        true
    }

    /// Builds the index from the entries in the directory: stale temporary files and invalid
    /// entries are removed; the rest are ranked by modification time (oldest first).
    fn scan(&self) -> Result<()> {
        let rd = fs::read_dir(&self.dir).map_err(|e| io_err("cannot list", &self.dir, e))?;
        let mut found: Vec<(SystemTime, Key, u64)> = Vec::new();
        let want = self.entry_len() as u64;
        for ent in rd.flatten() {
            let name = ent.file_name();
            let Some(name) = name.to_str() else {
                continue;
            };
            let path = ent.path();
            if name.ends_with(".tmp") {
                // A write killed midway (this tier holds the lock: nobody else writes here).
                let _ = fs::remove_file(&path);
                continue;
            }
            let Some(key) = parse_name(name) else {
                continue;
            };
            let ok = (|| -> std::io::Result<Option<SystemTime>> {
                let mut f = File::open(&path)?;
                let meta = f.metadata()?;
                if meta.len() != want {
                    return Ok(None);
                }
                let mut h = vec![0u8; FIXED + 4 * self.block_size];
                f.read_exact(&mut h)?;
                Ok(self
                    .header_ok(&h, key)
                    .then(|| meta.modified().unwrap_or(SystemTime::UNIX_EPOCH)))
            })();
            match ok {
                Ok(Some(t)) => found.push((t, key, want)),
                _ => {
                    let _ = fs::remove_file(&path);
                    self.c.removed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        found.sort();
        let mut ix = self.index();
        for &(_, key, len) in &found {
            ix.insert(key, len);
        }
        self.c.loaded.store(found.len() as u64, Ordering::Relaxed);
        self.make_room(&mut ix, 0);
        Ok(())
    }
}

fn writer_loop(s: Arc<Shared>, rx: Receiver<Msg>) {
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Write(job) => s.write(job),
            Msg::Flush(done) => {
                let _ = done.send(());
            }
            #[cfg(test)]
            Msg::Hold(arrived, until) => {
                let _ = arrived.send(());
                let _ = until.recv();
            }
        }
    }
}

impl DiskTier {
    /// Opens the tier of the memory with model id `model_id` (blocks of `block_size` tokens
    /// and `block_bytes` bytes) under `dir` (created if missing), sized by `o`. A tier of the
    /// same directory already open in this process is shared (and takes `o`'s size and
    /// break-even). `Io` when the directory cannot be used or another process holds it;
    /// `InvalidInput` when `o.max_bytes` holds no entry.
    pub fn open(
        dir: &Path,
        model_id: Key,
        block_size: usize,
        block_bytes: usize,
        o: DiskOptions,
    ) -> Result<Arc<DiskTier>> {
        let one = entry_len(block_size, block_bytes) as u64;
        if block_size == 0 || block_bytes == 0 || o.max_bytes < one {
            return Err(invalid(format!(
                "kv disk size of {} bytes holds no block (one entry takes {one} bytes)",
                o.max_bytes
            )));
        }
        let sub = dir.join(format!("{model_id:032x}"));
        fs::create_dir_all(&sub).map_err(|e| io_err("cannot create", &sub, e))?;
        let sub = fs::canonicalize(&sub).map_err(|e| io_err("cannot resolve", &sub, e))?;
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        // A tier of this directory that is closing (its last holder is dropping it) holds
        // the lock until its writer has written what was queued: wait for it below.
        let closing = open.iter().any(|(p, w)| *p == sub && w.strong_count() == 0);
        // Only this directory's closed entries go: another directory's may be closing now (a
        // model with several K/V groups opens a tier per group, one after the other), and
        // its next open must still see that to wait for its lock (so at most one closed entry
        // stays per directory ever opened).
        open.retain(|(p, w)| w.strong_count() > 0 || *p != sub);
        if let Some(t) = open
            .iter()
            .find(|(p, _)| *p == sub)
            .and_then(|(_, w)| w.upgrade())
        {
            if t.s.block_bytes != block_bytes || t.s.block_size != block_size {
                return Err(invalid(format!(
                    "kv disk tier {} is open with another block layout",
                    sub.display()
                )));
            }
            t.configure(o);
            return Ok(t);
        }
        let lock_path = sub.join("LOCK");
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock_path)
            .map_err(|e| io_err("cannot open", &lock_path, e))?;
        let mut waited = 0;
        loop {
            match lock.try_lock() {
                Ok(()) => break,
                Err(fs::TryLockError::WouldBlock) if closing && waited < 3000 => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    waited += 10;
                }
                Err(fs::TryLockError::WouldBlock) => {
                    return Err(Error::Io(format!(
                        "kv disk tier: {} is in use by another process",
                        sub.display()
                    )))
                }
                Err(fs::TryLockError::Error(e)) => {
                    return Err(io_err("cannot lock", &lock_path, e))
                }
            }
        }
        let s = Arc::new(Shared {
            dir: sub.clone(),
            model_id,
            block_size,
            block_bytes,
            index: Mutex::new(Index {
                max_bytes: o.max_bytes,
                ..Index::default()
            }),
            c: Counters::default(),
            min_tokens: AtomicUsize::new(o.min_tokens),
            tmp_seq: AtomicU64::new(0),
        });
        s.scan()?;
        let cap = (o.queue_bytes / block_bytes).max(1);
        let (tx, rx) = mpsc::sync_channel(cap);
        let ws = Arc::clone(&s);
        let writer = std::thread::Builder::new()
            .name("kvserve-disk".into())
            .spawn(move || writer_loop(ws, rx))
            .map_err(|e| Error::Io(format!("kv disk tier: cannot start its writer: {e}")))?;
        let t = Arc::new(DiskTier {
            s,
            tx: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
            _lock: lock,
        });
        open.push((sub, Arc::downgrade(&t)));
        Ok(t)
    }

    /// Takes `o`'s size limit (evicting down to it) and break-even; the queue keeps its size.
    pub fn configure(&self, o: DiskOptions) {
        self.s.min_tokens.store(o.min_tokens, Ordering::Relaxed);
        let mut ix = self.s.index();
        ix.max_bytes = o.max_bytes;
        self.s.make_room(&mut ix, 0);
    }

    /// The directory of this tier's entries (`DIR/<model id>`).
    pub fn dir(&self) -> &Path {
        &self.s.dir
    }

    pub fn model_id(&self) -> Key {
        self.s.model_id
    }

    /// Prompts shorter than this skip the tier.
    pub fn min_tokens(&self) -> usize {
        self.s.min_tokens.load(Ordering::Relaxed)
    }

    /// Whether a prompt of `n` tokens looks in the tier; counts the ones that do not.
    pub fn worth_it(&self, n: usize) -> bool {
        let yes = n >= self.min_tokens();
        if !yes {
            self.s.c.skipped.fetch_add(1, Ordering::Relaxed);
        }
        yes
    }

    /// Whether the index holds `key` (an estimate: the entry is verified only when read).
    pub fn contains(&self, key: Key) -> bool {
        self.s.index().entries.contains_key(&key)
    }

    /// Counts a lookup the caller answered as a miss from [`DiskTier::contains`] alone.
    pub fn count_miss(&self) {
        self.s.c.misses.fetch_add(1, Ordering::Relaxed);
    }

    /// Marks `key` (if held) as just used: a block served from RAM keeps its disk copy warm.
    pub fn touch(&self, keys: &[Key]) {
        let mut ix = self.s.index();
        for &k in keys {
            ix.touch(k);
        }
    }

    /// Hands a block to the writer: `payload` (its bytes as the pool stores them) is copied
    /// and queued unless the tier holds or is already writing `key`, or the queue is full
    /// (dropped, counted). Never blocks on I/O. Whether it was queued.
    pub fn offer(&self, key: Key, parent: Key, tokens: &[u32], payload: &[u8]) -> bool {
        if tokens.len() != self.s.block_size || payload.len() != self.s.block_bytes {
            return false;
        }
        {
            let mut ix = self.s.index();
            if ix.entries.contains_key(&key) || !ix.pending.insert(key) {
                return false;
            }
        }
        let job = Job {
            key,
            parent,
            tokens: tokens.to_vec(),
            payload: payload.to_vec(),
        };
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let sent = match tx.as_ref() {
            Some(tx) => match tx.try_send(Msg::Write(job)) {
                Ok(()) => true,
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
            },
            None => false,
        };
        drop(tx);
        if sent {
            self.s.c.queued.fetch_add(1, Ordering::Relaxed);
        } else {
            self.s.index().pending.remove(&key);
            self.s.c.writes_dropped.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// Reads `key`'s block into `out` (`block_bytes` long) if the tier holds a valid entry of
    /// exactly that content (`parent`, `tokens`); a miss otherwise, and an invalid entry is
    /// removed. `out` may be overwritten even on a miss.
    pub fn read(&self, key: Key, parent: Key, tokens: &[u32], out: &mut [u8]) -> bool {
        self.s.read(key, parent, tokens, out)
    }

    /// Waits until every block offered before the call is written (or dropped).
    pub fn flush(&self) {
        let (done, wait) = mpsc::channel();
        let tx = self
            .tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .cloned();
        if let Some(tx) = tx {
            if tx.send(Msg::Flush(done)).is_ok() {
                let _ = wait.recv();
            }
        }
    }

    pub fn stats(&self) -> DiskStats {
        let c = &self.s.c;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (entries, bytes_held, max_bytes) = {
            let ix = self.s.index();
            (ix.entries.len() as u64, ix.bytes, ix.max_bytes)
        };
        let hit_blocks = ld(&c.hit_blocks);
        DiskStats {
            hit_blocks,
            hit_tokens: hit_blocks * self.s.block_size as u64,
            misses: ld(&c.misses),
            bytes_read: ld(&c.bytes_read),
            bytes_written: ld(&c.bytes_written),
            writes: ld(&c.writes),
            writes_dropped: ld(&c.writes_dropped),
            removed: ld(&c.removed),
            evicted: ld(&c.evicted),
            skipped: ld(&c.skipped),
            entries,
            bytes_held,
            max_bytes,
            loaded: ld(&c.loaded),
            queued: ld(&c.queued),
            read_seconds: ld(&c.read_ns) as f64 * 1e-9,
            min_tokens: self.min_tokens(),
        }
    }

    /// Tests: stops the writer until the returned sender is dropped (it has taken every
    /// message before this one when the call returns).
    #[cfg(test)]
    fn hold_writer(&self) -> mpsc::Sender<()> {
        let (arrived, wait) = mpsc::channel();
        let (release, until) = mpsc::channel();
        let tx = self.tx.lock().unwrap().as_ref().cloned().unwrap();
        tx.send(Msg::Hold(arrived, until)).unwrap();
        wait.recv().unwrap();
        release
    }
}

impl Drop for DiskTier {
    /// Writes what is queued, then stops the writer.
    fn drop(&mut self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = w.join();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const BS: usize = 4;
    const BB: usize = 256;
    const MODEL: Key = 0x1234_5678_9abc_def0_1122_3344_5566_7788;

    /// A fresh directory for one test.
    fn tmp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvserve-disk-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn opts(max_entries: u64) -> DiskOptions {
        DiskOptions {
            max_bytes: max_entries * entry_len(BS, BB) as u64,
            min_tokens: 0,
            queue_bytes: 64 * BB,
        }
    }

    /// Block `i`: its tokens, key (chained like content keys), parent and payload, all
    /// distinct per `i`.
    fn block(i: u32) -> (Vec<u32>, Key, Key, Vec<u8>) {
        let tokens: Vec<u32> = (0..BS as u32).map(|t| i * 100 + t).collect();
        let parent = if i == 0 { 0 } else { 1000 + i as Key - 1 };
        let payload: Vec<u8> = (0..BB).map(|b| (b as u32 * 7 + i * 31) as u8).collect();
        (tokens, 1000 + i as Key, parent, payload)
    }

    fn put(t: &DiskTier, i: u32) {
        let (tokens, key, parent, payload) = block(i);
        assert!(t.offer(key, parent, &tokens, &payload), "block {i} queued");
    }

    /// Whether block `i` reads back with exactly its bytes.
    fn get(t: &DiskTier, i: u32) -> bool {
        let (tokens, key, parent, payload) = block(i);
        let mut out = vec![0u8; BB];
        let hit = t.read(key, parent, &tokens, &mut out);
        if hit {
            assert_eq!(out, payload, "block {i} reads back bit for bit");
        }
        hit
    }

    fn file_of(t: &DiskTier, i: u32) -> PathBuf {
        t.dir().join(key_name(block(i).1))
    }

    #[test]
    fn write_then_read_round_trip() {
        let dir = tmp_dir("roundtrip");
        let t = DiskTier::open(&dir, MODEL, BS, BB, opts(8)).unwrap();
        for i in 0..3 {
            put(&t, i);
        }
        t.flush();
        // Already held or queued: not offered again.
        let (tokens, key, parent, payload) = block(1);
        assert!(!t.offer(key, parent, &tokens, &payload));
        for i in 0..3 {
            assert!(get(&t, i), "block {i}");
        }
        assert!(!get(&t, 5), "never written");
        let st = t.stats();
        assert_eq!((st.writes, st.entries, st.hit_blocks), (3, 3, 3));
        assert_eq!(st.hit_tokens, 3 * BS as u64);
        assert_eq!(st.misses, 1);
        assert_eq!(st.bytes_written, 3 * entry_len(BS, BB) as u64);
        assert_eq!(st.bytes_held, st.bytes_written);
        assert_eq!(st.bytes_read, st.bytes_written);
        assert!(st.read_seconds > 0.0);
        // The file is exactly the documented format.
        let bytes = fs::read(file_of(&t, 2)).unwrap();
        let (tokens, key, parent, payload) = block(2);
        let h = header(MODEL, key, parent, &tokens, BB);
        assert_eq!(bytes.len(), FIXED + 4 * BS + BB + TRAILER);
        assert_eq!(&bytes[..8], b"KVSDISK\0");
        assert_eq!(u128_at(&bytes, 32), key);
        assert_eq!(&bytes[..h.len()], &h[..]);
        assert_eq!(&bytes[h.len()..h.len() + BB], &payload[..]);
        assert_eq!(&bytes[h.len() + BB..], &checksum(&h, &payload));
        // Asking for other content under the key (another parent or tokens) is a miss, and
        // the entry that does not hold what its key promises goes.
        let mut out = vec![0u8; BB];
        assert!(!t.read(key, parent + 1, &tokens, &mut out));
        assert!(!t.contains(key));
        assert!(!file_of(&t, 2).exists());
        drop(t);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reopen_finds_the_entries_in_lru_order() {
        let dir = tmp_dir("reopen");
        let t = DiskTier::open(&dir, MODEL, BS, BB, opts(8)).unwrap();
        for i in 0..4 {
            put(&t, i);
            t.flush();
            // Distinct modification times (the LRU rank at the next open).
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // Block 0 is read last: the most recently used at the next open.
        assert!(get(&t, 0));
        let sub = t.dir().to_path_buf();
        // A stale temporary file of a write that was killed goes at open.
        fs::write(sub.join(".dead.1.2.tmp"), b"partial").unwrap();
        drop(t);
        let t = DiskTier::open(&dir, MODEL, BS, BB, opts(3)).unwrap();
        let st = t.stats();
        assert_eq!((st.loaded, st.entries, st.evicted), (4, 3, 1));
        assert!(!sub.join(".dead.1.2.tmp").exists());
        assert!(!get(&t, 1), "the least recently used went to fit 3 entries");
        for i in [0, 2, 3] {
            assert!(get(&t, i), "block {i} survives the restart");
        }
        // Another open in this process shares the tier (and its lock).
        let again = DiskTier::open(&dir, MODEL, BS, BB, opts(3)).unwrap();
        assert!(Arc::ptr_eq(&t, &again));
        drop((t, again));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn invalid_entries_are_misses_and_removed() {
        let dir = tmp_dir("invalid");
        let t = DiskTier::open(&dir, MODEL, BS, BB, opts(16)).unwrap();
        for i in 0..6 {
            put(&t, i);
        }
        t.flush();
        // A flipped payload byte, a truncated file, a header of another version: misses on
        // read, each removed.
        let flip = |i: u32, at: usize| {
            let p = file_of(&t, i);
            let mut b = fs::read(&p).unwrap();
            b[at] ^= 0x40;
            fs::write(&p, b).unwrap();
        };
        flip(0, FIXED + 4 * BS + 17);
        let p1 = file_of(&t, 1);
        let b1 = fs::read(&p1).unwrap();
        fs::write(&p1, &b1[..b1.len() - 5]).unwrap();
        flip(2, 8); // version
        flip(3, b1.len() - 1); // the checksum itself
        for i in 0..4 {
            assert!(!get(&t, i), "block {i} is a miss");
            assert!(!file_of(&t, i).exists(), "block {i}'s file is removed");
            assert!(!t.contains(block(i).1));
        }
        assert!(get(&t, 4) && get(&t, 5), "the others are intact");
        let st = t.stats();
        assert_eq!((st.removed, st.misses, st.entries), (4, 4, 2));
        assert_eq!(st.bytes_held, 2 * entry_len(BS, BB) as u64);
        // Damage found at open: a truncated entry, another model's entry copied in under a
        // name of this tier, an entry whose name is not its key.
        let sub = t.dir().to_path_buf();
        drop(t);
        let other = DiskTier::open(&dir, MODEL + 1, BS, BB, opts(16)).unwrap();
        put(&other, 6);
        other.flush();
        fs::copy(file_of(&other, 6), sub.join(key_name(block(6).1))).unwrap();
        drop(other);
        let b5 = fs::read(sub.join(key_name(block(5).1))).unwrap();
        fs::write(sub.join(key_name(block(5).1)), &b5[..100]).unwrap();
        fs::copy(
            sub.join(key_name(block(4).1)),
            sub.join(key_name(block(7).1)),
        )
        .unwrap();
        let t = DiskTier::open(&dir, MODEL, BS, BB, opts(16)).unwrap();
        let st = t.stats();
        assert_eq!((st.loaded, st.entries, st.removed), (1, 1, 3));
        assert!(get(&t, 4));
        for i in [5, 6, 7] {
            assert!(!sub.join(key_name(block(i).1)).exists(), "block {i}");
            assert!(!get(&t, i));
        }
        // An entry of this model that another model's tier finds in its own directory (a
        // copy) is a miss there on read, and removed.
        let other = DiskTier::open(&dir, MODEL + 1, BS, BB, opts(16)).unwrap();
        fs::copy(file_of(&t, 4), file_of(&other, 4)).unwrap();
        // Not in the other tier's index (not scanned): put it there as the scan would.
        other.s.index().insert(block(4).1, entry_len(BS, BB) as u64);
        assert!(!get(&other, 4), "another model's entry");
        assert!(!file_of(&other, 4).exists());
        assert!(get(&t, 4), "this model's copy is untouched");
        drop((t, other));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn lru_keeps_within_the_size() {
        let dir = tmp_dir("lru");
        let t = DiskTier::open(&dir, MODEL, BS, BB, opts(3)).unwrap();
        let one = entry_len(BS, BB) as u64;
        for i in 0..3 {
            put(&t, i);
        }
        t.flush();
        assert!(get(&t, 0), "block 0 is now the most recently used");
        for i in 3..5 {
            put(&t, i);
            t.flush();
            assert!(t.stats().bytes_held <= 3 * one);
        }
        // The model: an LRU list of 3 entries.
        let mut lru: Vec<u32> = vec![1, 2, 0];
        for i in 3..5 {
            lru.push(i);
            lru.remove(0);
        }
        for i in 0..5 {
            assert_eq!(t.contains(block(i).1), lru.contains(&i), "block {i}");
            assert_eq!(
                file_of(&t, i).exists(),
                lru.contains(&i),
                "file of block {i}"
            );
        }
        let st = t.stats();
        assert_eq!((st.entries, st.bytes_held, st.evicted), (3, 3 * one, 2));
        // A smaller limit evicts at once; one that holds no entry is refused.
        t.configure(opts(1));
        assert_eq!(t.stats().entries, 1);
        assert!(t.contains(block(4).1));
        let err = DiskTier::open(&tmp_dir("lru-small"), MODEL, BS, BB, opts(0)).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
        drop(t);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_full_queue_drops_writes_without_blocking() {
        let dir = tmp_dir("queue");
        let mut o = opts(64);
        o.queue_bytes = 4 * BB; // 4 blocks
        let t = DiskTier::open(&dir, MODEL, BS, BB, o).unwrap();
        let release = t.hold_writer();
        let queued: Vec<bool> = (0..7)
            .map(|i| {
                let (tokens, key, parent, payload) = block(i);
                t.offer(key, parent, &tokens, &payload)
            })
            .collect();
        assert_eq!(queued, [true, true, true, true, false, false, false]);
        assert_eq!(t.stats().queued, 4);
        drop(release);
        t.flush();
        let st = t.stats();
        assert_eq!((st.writes, st.writes_dropped, st.queued), (4, 3, 0));
        assert!((0..4).all(|i| get(&t, i)));
        // A dropped block is offered again later.
        put(&t, 5);
        t.flush();
        assert!(get(&t, 5));
        drop(t);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A writer thread offering blocks while readers read them: every hit is the block's exact
    /// bytes; in the end every block is held or was evicted by the size limit.
    #[test]
    fn concurrent_writer_and_readers() {
        let dir = tmp_dir("concurrent");
        let t = DiskTier::open(&dir, MODEL, BS, BB, opts(40)).unwrap();
        const N: u32 = 120;
        std::thread::scope(|sc| {
            sc.spawn(|| {
                for i in 0..N {
                    let (tokens, key, parent, payload) = block(i);
                    while !t.offer(key, parent, &tokens, &payload) && !t.contains(key) {
                        std::thread::yield_now();
                    }
                }
            });
            for r in 0..2u32 {
                let t = &t;
                sc.spawn(move || {
                    let mut rng = crate::test_rng::Rng(7 + r as u64);
                    for _ in 0..3000 {
                        let i = (rng.next() % N as u64) as u32;
                        get(t, i); // asserts the bytes on a hit
                    }
                });
            }
        });
        t.flush();
        let st = t.stats();
        assert_eq!(st.removed, 0, "no entry was ever found invalid");
        assert_eq!(st.entries, 40);
        assert_eq!(st.writes, N as u64);
        assert_eq!(st.evicted, N as u64 - 40);
        let held = (0..N).filter(|&i| get(&t, i)).count();
        assert_eq!(held, 40);
        drop(t);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A tier reopened while its last holder is still closing it (the writer writing what was
    /// queued, the directory still locked) waits for the close, then finds every block.
    #[test]
    fn reopening_waits_for_a_closing_tier() {
        let dir = tmp_dir("closing");
        let t = DiskTier::open(&dir, MODEL, BS, BB, opts(16)).unwrap();
        let sub = t.dir().to_path_buf();
        let release = t.hold_writer();
        for i in 0..5 {
            put(&t, i);
        }
        let alive = || {
            OPEN.lock()
                .unwrap()
                .iter()
                .any(|(p, w)| *p == sub && w.strong_count() > 0)
        };
        std::thread::scope(|sc| {
            sc.spawn(move || drop(t)); // waits for the held writer
            while alive() {
                std::thread::yield_now();
            }
            // Another directory opened meanwhile (a model's next K/V group) must not make the
            // closing one look closed.
            let other_dir = tmp_dir("closing-other");
            let other = DiskTier::open(&other_dir, MODEL, BS, BB, opts(16)).unwrap();
            let reopened = sc.spawn(|| DiskTier::open(&dir, MODEL, BS, BB, opts(16)).unwrap());
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(!reopened.is_finished(), "the directory is still locked");
            drop(release);
            let t = reopened.join().unwrap();
            assert_eq!(t.stats().loaded, 5);
            assert!((0..5).all(|i| get(&t, i)));
            drop(other);
            fs::remove_dir_all(&other_dir).unwrap();
        });
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn another_process_cannot_take_the_directory() {
        // The lock is per open file description: a second handle stands for another process.
        let dir = tmp_dir("lock");
        let t = DiskTier::open(&dir, MODEL, BS, BB, opts(4)).unwrap();
        let f = File::open(t.dir().join("LOCK")).unwrap();
        assert!(matches!(f.try_lock(), Err(fs::TryLockError::WouldBlock)));
        drop(t);
        f.try_lock().unwrap();
        drop(f);
        fs::remove_dir_all(&dir).unwrap();
    }
}
