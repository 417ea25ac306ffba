//! The shared block tier (L3) of the K/V cache: full keyed blocks in a Redis or Valkey server
//! that every process serving the same model reads and writes, so a prefix one replica
//! computed is a fetch, not a prefill, for the others. Semantics: docs/KV_SEMANTICS.md,
//! "Shared tier". A tier belongs to one K/V memory (`SharedKv`): a model with several K/V
//! layer groups has one per group (its keys carry the group's model id), and a fetch brings
//! one [`Staged`] per group (`LayerGroups::fetch_remote`). A hybrid model's recurrent state
//! checkpoints are entries of its full-attention group's tier (keys of their own hash domain,
//! as on disk); a fetch asks for the one its resume needs with [`RemoteTier::fetch_first`].
//!
//! **Keys and values.** One key per block: `kvs:v1:<model id>:<block key>` (32 hex digits
//! each). The model id (`SharedKv::model_id`) covers the weights' identity, the K/V type, the
//! block size and the layout, and the block key is the content key chain of the prefix cache
//! (salted per tenant): both are computed from content with fixed constants, never from a
//! per-process seed, so every process and machine derives the same keys. The value is the disk
//! tier's entry (`super::disk`: magic, format version, block size, model id, key, parent key,
//! the block's token ids, payload length, the K/V bytes as the pool stores them, checksum), so
//! a reader verifies model, key, parent, tokens, length and checksum, and anything else is a
//! miss. Metadata and data are one value: the store cannot evict one without the other.
//!
//! **Writes** come from a decode's commit (write-through, like the disk tier's): the caller
//! copies the block under the storage lock and [`RemoteTier::offer`]s it to a bounded queue
//! (full: dropped and counted, never blocking a decode); one writer thread sends what is
//! queued as pipelined `SET key value NX PX ttl` (a key another process wrote first is kept).
//!
//! **Reads** ([`RemoteTier::fetch`]) run before a request is queued, on a thread of the
//! caller's (the engine's fetch workers), never on the engine thread: one pipelined round trip
//! of `EXISTS` for every candidate block (the prompt's leading full blocks that neither RAM
//! nor disk holds), then `MGET` of the leading run of hits in batches of [`FETCH_BATCH`]. The
//! verified blocks are staged ([`Staged`]) and copied into the pool by the prefix match when
//! the request is admitted (`PagedCache::match_prefix_staged`), as a disk read would be. A
//! block evicted from the store between the two round trips, or invalid, ends the run there.
//!
//! **Faults.** Every command runs with a timeout ([`RemoteOptions::timeout`]), and so does
//! resolving the store's host name (on a thread of its own: the system resolver has none). A
//! connection or protocol error drops the connection, is counted (`errors`), and turns the tier
//! off for [`RemoteOptions::retry_after`]: fetches and writes are skipped (counted) until then,
//! so a store that is down or slow costs each request at most one timeout and then nothing;
//! the request recomputes what it did not get. Only commands Valkey has too: `AUTH`, `SELECT`,
//! `PING`, `EXISTS`, `MGET`, `SET` with `NX` and `PX`, and (tests) `DEL`.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::disk::{encode_entry, entry_payload};
use super::prefix::Key;
use crate::error::{invalid, Error, Result};

/// Blocks asked for in one `MGET`.
pub const FETCH_BATCH: usize = 8;
/// Blocks sent in one pipeline of `SET`s (and at most [`WRITE_BATCH_BYTES`]).
const WRITE_BATCH: usize = 16;
const WRITE_BATCH_BYTES: usize = 8 << 20;
/// Default time to live of a stored block (the store's own LRU evicts before, under
/// `maxmemory`).
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);
/// Default byte budget of the write queue.
pub const DEFAULT_QUEUE_BYTES: usize = 64 << 20;
/// Default timeout of one command (connect, send, each reply).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(500);
/// Default time the tier stays off after an error.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(2);

/// Prompts shorter than this many tokens do not look in the tier: the measured break-even
/// below which fetching a prompt's blocks is not faster than computing them
/// (`benches/bench_kv_remote.py`, BENCHMARKS.md "Shared K/V tier"). On the development machine
/// (loopback Redis, SmolLM2-135M, f16 K/V: 360 KiB a block) a block arrives in well under a
/// millisecond and its 16 tokens take tens of milliseconds to compute, so the shortest prompt
/// that can map a block already gains; the default skips none. Over a slow network raise it
/// ([`RemoteOptions::min_tokens`], Engine `kv_remote_min_tokens`).
pub const DEFAULT_MIN_TOKENS: usize = 0;

/// How the tier is reached and used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteOptions {
    /// Time to live of written blocks (`PX`).
    pub ttl: Duration,
    /// Prompts shorter than this do not look in the tier.
    pub min_tokens: usize,
    /// Bytes of blocks waiting for the writer; an offer beyond it is dropped.
    pub queue_bytes: usize,
    /// Timeout of a connect and of each read or write on a connection.
    pub timeout: Duration,
    /// How long the tier stays off after an error.
    pub retry_after: Duration,
    /// Most blocks one fetch brings (0: no limit).
    pub max_fetch_blocks: usize,
    /// Most bytes of fetched blocks staged at once, over every fetch whose request is not
    /// admitted yet (0: no limit): a long queue of requests with long fetched prompts holds
    /// at most this much memory; a fetch beyond it brings fewer blocks (the rest is computed).
    pub max_staged_bytes: u64,
}

impl Default for RemoteOptions {
    fn default() -> RemoteOptions {
        RemoteOptions {
            ttl: DEFAULT_TTL,
            min_tokens: DEFAULT_MIN_TOKENS,
            queue_bytes: DEFAULT_QUEUE_BYTES,
            timeout: DEFAULT_TIMEOUT,
            retry_after: DEFAULT_RETRY_AFTER,
            max_fetch_blocks: 0,
            max_staged_bytes: 0,
        }
    }
}

/// Counters of a tier (since it was opened).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RemoteStats {
    /// Fetches that asked the store (one per request with candidate blocks).
    pub fetches: u64,
    /// Blocks fetched and verified, and the tokens they hold.
    pub fetched_blocks: u64,
    pub fetched_tokens: u64,
    /// Fetched blocks that a prefix match copied into the pool (a hit), and their tokens.
    pub hit_blocks: u64,
    pub hit_tokens: u64,
    /// Candidate blocks the store did not have (the first absent one of each fetch; the
    /// blocks after it are not asked for by a match).
    pub misses: u64,
    /// Values that failed verification (another version, model or content, damaged), and
    /// blocks gone between the existence check and the read.
    pub invalid: u64,
    pub lost: u64,
    /// Bytes of values read and written.
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Blocks stored (`SET` took), already there (kept), dropped (queue full, tier off, error).
    pub writes: u64,
    pub writes_existing: u64,
    pub writes_dropped: u64,
    /// Connection or protocol errors and timeouts.
    pub errors: u64,
    /// Fetches skipped: prompt under the break-even, and tier off after an error.
    pub skipped_short: u64,
    pub skipped_down: u64,
    /// Fetches skipped because staged blocks already took [`RemoteOptions::max_staged_bytes`].
    pub skipped_full: u64,
    /// Bytes of fetched blocks staged now (waiting for their requests' admission).
    pub staged_bytes: u64,
    /// Blocks waiting for the writer now.
    pub queued: u64,
    /// Seconds spent in fetches (both round trips, verification included).
    pub fetch_seconds: f64,
    /// The break-even in force ([`RemoteOptions::min_tokens`]).
    pub min_tokens: usize,
    /// Whether the tier is off now after an error.
    pub down: bool,
}

impl RemoteStats {
    /// Adds `o`'s counts to these (the tiers of a model's several K/V groups, reported as
    /// one): every count summed, the larger break-even, down if either is.
    pub fn merge(&mut self, o: &RemoteStats) {
        for (a, b) in [
            (&mut self.fetches, o.fetches),
            (&mut self.fetched_blocks, o.fetched_blocks),
            (&mut self.fetched_tokens, o.fetched_tokens),
            (&mut self.hit_blocks, o.hit_blocks),
            (&mut self.hit_tokens, o.hit_tokens),
            (&mut self.misses, o.misses),
            (&mut self.invalid, o.invalid),
            (&mut self.lost, o.lost),
            (&mut self.bytes_read, o.bytes_read),
            (&mut self.bytes_written, o.bytes_written),
            (&mut self.writes, o.writes),
            (&mut self.writes_existing, o.writes_existing),
            (&mut self.writes_dropped, o.writes_dropped),
            (&mut self.errors, o.errors),
            (&mut self.skipped_short, o.skipped_short),
            (&mut self.skipped_down, o.skipped_down),
            (&mut self.skipped_full, o.skipped_full),
            (&mut self.staged_bytes, o.staged_bytes),
            (&mut self.queued, o.queued),
        ] {
            *a += b;
        }
        self.fetch_seconds += o.fetch_seconds;
        self.min_tokens = self.min_tokens.max(o.min_tokens);
        self.down |= o.down;
    }
}

#[derive(Default)]
struct Counters {
    fetches: AtomicU64,
    fetched_blocks: AtomicU64,
    hit_blocks: AtomicU64,
    misses: AtomicU64,
    invalid: AtomicU64,
    lost: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    writes: AtomicU64,
    writes_existing: AtomicU64,
    writes_dropped: AtomicU64,
    errors: AtomicU64,
    skipped_short: AtomicU64,
    skipped_down: AtomicU64,
    skipped_full: AtomicU64,
    queued: AtomicU64,
    queued_bytes: AtomicU64,
    fetch_ns: AtomicU64,
}

/// Where the store is: `redis://[[user]:password@]host[:port][/db]` (`valkey://` too).
#[derive(Clone, PartialEq, Eq)]
pub struct RemoteAddr {
    pub host: String,
    pub port: u16,
    pub db: u32,
    pub user: Option<String>,
    pub password: Option<String>,
}

impl std::fmt::Debug for RemoteAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        write!(f, "redis://{}:{}/{}", self.host, self.port, self.db)
    }
}

fn percent_decode(s: &str) -> Result<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| invalid("kv remote URL: a bad %-escape in the user or password"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| invalid("kv remote URL: user or password is not UTF-8"))
}

impl RemoteAddr {
    /// Parses a `redis://` or `valkey://` URL (`InvalidInput` saying what is wrong; TLS
    /// schemes are `Unsupported`).
    pub fn parse(url: &str) -> Result<RemoteAddr> {
        let bad = |why: &str| {
            invalid(format!(
                "kv remote URL: {why} (expected redis://[[user]:password@]host[:port][/db])"
            ))
        };
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(bad("no scheme"));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "redis" | "valkey" => {}
            "rediss" | "valkeys" => {
                return Err(Error::Unsupported(
                    "kv remote URL: TLS (rediss://) is not supported; reach the store over a \
                     trusted network or a local TLS tunnel"
                        .into(),
                ))
            }
            s => return Err(bad(&format!("scheme {s:?} is not redis or valkey"))),
        }
        if rest.contains('?') || rest.contains('#') {
            return Err(bad("query strings and fragments are not supported"));
        }
        let (auth, hostpath) = match rest.rsplit_once('@') {
            Some((a, h)) => (Some(a), h),
            None => (None, rest),
        };
        let (hostport, db) = match hostpath.split_once('/') {
            Some((h, "")) => (h, 0),
            Some((h, d)) => (
                h,
                d.parse::<u32>()
                    .map_err(|_| bad("the database is not a number"))?,
            ),
            None => (hostpath, 0),
        };
        let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
            let (h, p) = v6
                .split_once(']')
                .ok_or_else(|| bad("unclosed [ in the host"))?;
            (h.to_string(), p.strip_prefix(':'))
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), Some(p)),
                None => (hostport.to_string(), None),
            }
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let port = match port {
            Some(p) => p
                .parse::<u16>()
                .map_err(|_| bad("the port is not a number"))?,
            None => 6379,
        };
        let (user, password) = match auth {
            None => (None, None),
            Some(a) => match a.split_once(':') {
                Some((u, p)) => (
                    (!u.is_empty()).then(|| percent_decode(u)).transpose()?,
                    Some(percent_decode(p)?),
                ),
                None => (None, Some(percent_decode(a)?)),
            },
        };
        Ok(RemoteAddr {
            host,
            port,
            db,
            user,
            password,
        })
    }
}

/// One reply of the RESP2 protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

fn proto(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.into())
}

/// Name lookups of [`resolve_within`] that may run at once, and those running.
const MAX_RESOLVING: usize = 4;
static RESOLVING: AtomicUsize = AtomicUsize::new(0);

/// The addresses of `host:port`: an IP literal at once; a name by `resolve` (the system
/// resolver, which has no timeout of its own) on a thread of its own, waited for at most
/// `timeout`, so a resolver that hangs costs the caller one timeout like any other fault (the
/// thread ends when the resolver returns; its answer is then dropped). At most
/// [`MAX_RESOLVING`] such threads live at once in the process: past that (a resolver that hangs
/// while the tier retries) a name fails at once instead of leaving one more thread behind.
fn resolve_within(
    host: &str,
    port: u16,
    timeout: Duration,
    resolve: fn(&str, u16) -> io::Result<Vec<SocketAddr>>,
) -> io::Result<Vec<SocketAddr>> {
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    if RESOLVING.fetch_add(1, Ordering::AcqRel) >= MAX_RESOLVING {
        RESOLVING.fetch_sub(1, Ordering::AcqRel);
        return Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!("resolving {host}: {MAX_RESOLVING} earlier lookups have not returned"),
        ));
    }
    let (tx, rx) = mpsc::channel();
    let name = host.to_string();
    let spawned = std::thread::Builder::new()
        .name("kvserve-resolve".into())
        .spawn(move || {
            let _ = tx.send(resolve(&name, port));
            RESOLVING.fetch_sub(1, Ordering::AcqRel);
        });
    if let Err(e) = spawned {
        RESOLVING.fetch_sub(1, Ordering::AcqRel);
        return Err(e);
    }
    match rx.recv_timeout(timeout) {
        Ok(got) => got,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("resolving {host} took longer than {timeout:?}"),
        )),
    }
}

/// One connection: commands out, replies in, each read or write bounded by the timeout.
struct Conn {
    r: BufReader<TcpStream>,
    w: BufWriter<TcpStream>,
}

impl Conn {
    fn open(addr: &RemoteAddr, timeout: Duration) -> io::Result<Conn> {
        let addrs = resolve_within(&addr.host, addr.port, timeout, |h, p| {
            (h, p).to_socket_addrs().map(|a| a.collect())
        })?;
        let mut last = io::Error::new(io::ErrorKind::NotFound, "the host has no address");
        for a in addrs {
            match TcpStream::connect_timeout(&a, timeout) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    s.set_read_timeout(Some(timeout))?;
                    s.set_write_timeout(Some(timeout))?;
                    let mut c = Conn {
                        r: BufReader::with_capacity(1 << 16, s.try_clone()?),
                        w: BufWriter::with_capacity(1 << 16, s),
                    };
                    c.hello(addr)?;
                    return Ok(c);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Authenticates and selects the database (each a reply that must be `+OK`).
    fn hello(&mut self, addr: &RemoteAddr) -> io::Result<()> {
        let mut n = 0;
        if let Some(p) = &addr.password {
            match &addr.user {
                Some(u) => self.send(&[b"AUTH", u.as_bytes(), p.as_bytes()])?,
                None => self.send(&[b"AUTH", p.as_bytes()])?,
            }
            n += 1;
        }
        if addr.db != 0 {
            self.send(&[b"SELECT", addr.db.to_string().as_bytes()])?;
            n += 1;
        }
        self.w.flush()?;
        for _ in 0..n {
            match self.read(64)? {
                Reply::Status(_) => {}
                Reply::Error(e) => return Err(proto(format!("the store refused: {e}"))),
                r => return Err(proto(format!("unexpected reply {r:?}"))),
            }
        }
        Ok(())
    }

    /// Queues one command (sent at the next flush).
    fn send(&mut self, args: &[&[u8]]) -> io::Result<()> {
        write!(self.w, "*{}\r\n", args.len())?;
        for a in args {
            write!(self.w, "${}\r\n", a.len())?;
            self.w.write_all(a)?;
            self.w.write_all(b"\r\n")?;
        }
        Ok(())
    }

    fn line(&mut self) -> io::Result<Vec<u8>> {
        let mut line = Vec::with_capacity(32);
        // A reply line is short; a longer one is not this protocol.
        (&mut self.r).take(4096).read_until(b'\n', &mut line)?;
        if line.len() < 2 || !line.ends_with(b"\r\n") {
            return Err(proto("a reply line without CRLF"));
        }
        line.truncate(line.len() - 2);
        Ok(line)
    }

    /// Reads one reply; a bulk string longer than `max_bulk` is a protocol error.
    fn read(&mut self, max_bulk: usize) -> io::Result<Reply> {
        self.read_at(max_bulk, 0)
    }

    fn read_at(&mut self, max_bulk: usize, depth: usize) -> io::Result<Reply> {
        let line = self.line()?;
        let (&kind, rest) = line.split_first().ok_or_else(|| proto("an empty reply"))?;
        let text = std::str::from_utf8(rest).map_err(|_| proto("a reply line is not UTF-8"))?;
        let num = || {
            text.parse::<i64>()
                .map_err(|_| proto(format!("bad length {text:?}")))
        };
        Ok(match kind {
            b'+' => Reply::Status(text.to_string()),
            b'-' => Reply::Error(text.to_string()),
            b':' => Reply::Int(num()?),
            b'$' => {
                let n = num()?;
                if n < 0 {
                    return Ok(Reply::Bulk(None));
                }
                let n = n as usize;
                if n > max_bulk {
                    return Err(proto(format!("a value of {n} bytes, more than {max_bulk}")));
                }
                let mut v = vec![0u8; n + 2];
                self.r.read_exact(&mut v)?;
                if !v.ends_with(b"\r\n") {
                    return Err(proto("a value without CRLF"));
                }
                v.truncate(n);
                Reply::Bulk(Some(v))
            }
            b'*' => {
                let n = num()?;
                if n < 0 {
                    return Ok(Reply::Array(None));
                }
                if depth > 0 || n > 4096 {
                    return Err(proto("an unexpected nested or huge array"));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.read_at(max_bulk, depth + 1)?);
                }
                Reply::Array(Some(items))
            }
            _ => return Err(proto(format!("unknown reply type {:?}", kind as char))),
        })
    }
}

/// Blocks a fetch brought, verified, waiting for a prefix match to copy them into the pool.
/// Their bytes count against [`RemoteOptions::max_staged_bytes`] until it is dropped.
#[derive(Debug, Default)]
pub struct Staged {
    blocks: HashMap<Key, (Key, Vec<u32>, Vec<u8>)>,
    /// The tiers' counts of staged bytes, and this set's share of each.
    account: Vec<(Arc<AtomicU64>, u64)>,
}

impl Drop for Staged {
    fn drop(&mut self) {
        for (total, n) in self.account.drain(..) {
            total.fetch_sub(n, Ordering::Relaxed);
        }
    }
}

impl Staged {
    /// Blocks staged.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The payload of `key`'s block if it was staged for exactly `parent` and `tokens`.
    pub fn get(&self, key: Key, parent: Key, tokens: &[u32]) -> Option<&[u8]> {
        let (p, t, payload) = self.blocks.get(&key)?;
        (*p == parent && t == tokens).then_some(payload.as_slice())
    }

    /// Adds `other`'s blocks (and their share of the staging budget) to this set.
    pub fn merge(&mut self, mut other: Staged) {
        self.blocks.extend(std::mem::take(&mut other.blocks));
        self.account.append(&mut other.account);
    }
}

/// A block a fetch may ask the store for: its key, parent key and tokens.
pub type Candidate<'a> = (Key, Key, &'a [u32]);

/// A block for the writer, encoded there (the decode that offers it only copies its bytes).
struct Job {
    key: Key,
    parent: Key,
    tokens: Vec<u32>,
    payload: Vec<u8>,
}

enum Msg {
    Write(Job),
    Flush(mpsc::Sender<()>),
}

struct Shared {
    addr: RemoteAddr,
    model_id: Key,
    block_size: usize,
    block_bytes: usize,
    opts: Mutex<RemoteOptions>,
    /// Bytes of staged blocks alive now (see [`Staged`]).
    staged: Arc<AtomicU64>,
    idle: Mutex<Vec<Conn>>,
    down_until: Mutex<Option<Instant>>,
    c: Counters,
}

impl Shared {
    fn opts(&self) -> RemoteOptions {
        *self.opts.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn redis_key(&self, key: Key) -> Vec<u8> {
        format!("kvs:v1:{:032x}:{key:032x}", self.model_id).into_bytes()
    }

    fn value_len(&self) -> usize {
        super::disk::entry_len(self.block_size, self.block_bytes)
    }

    fn down(&self) -> bool {
        let mut d = self.down_until.lock().unwrap_or_else(|e| e.into_inner());
        match *d {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *d = None;
                false
            }
            None => false,
        }
    }

    fn failed(&self, e: &io::Error) {
        self.c.errors.fetch_add(1, Ordering::Relaxed);
        let retry = self.opts().retry_after;
        *self.down_until.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + retry);
        // Other idle connections may be as dead as this one.
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).clear();
        let _ = e;
    }

    /// Runs `f` on a connection (an idle one or a new one); the connection goes back to the
    /// idle list only when `f` succeeded. An error turns the tier off for a while.
    ///
    /// A pooled connection that fails other than by a timeout (the server closed it while it
    /// was idle, as a `timeout` setting does) is retried once on a new connection: every
    /// command sent here may run twice (`EXISTS`, `MGET`, `SET NX`, `PING`, `DEL`).
    fn with_conn<T>(&self, mut f: impl FnMut(&mut Conn) -> io::Result<T>) -> io::Result<T> {
        let pooled = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let timeout = self.opts().timeout;
        let out = match pooled.map(|mut c| f(&mut c).map(|t| (t, c))) {
            Some(Ok(x)) => Ok(x),
            Some(Err(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                ) =>
            {
                Err(e)
            }
            _ => Conn::open(&self.addr, timeout).and_then(|mut c| f(&mut c).map(|t| (t, c))),
        };
        match out {
            Ok((t, c)) => {
                self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(c);
                Ok(t)
            }
            Err(e) => {
                self.failed(&e);
                Err(e)
            }
        }
    }

    /// One pipeline of `SET key value NX PX ttl`.
    fn write_batch(&self, jobs: &[Job]) {
        let ttl = self.opts().ttl.as_millis().max(1).to_string();
        let n = jobs.len() as u64;
        let values: Vec<Vec<u8>> = jobs
            .iter()
            .map(|j| encode_entry(self.model_id, j.key, j.parent, &j.tokens, &j.payload))
            .collect();
        let values = &values;
        let out = self.with_conn(|c| {
            for (j, v) in jobs.iter().zip(values) {
                let k = self.redis_key(j.key);
                c.send(&[b"SET", &k, v, b"NX", b"PX", ttl.as_bytes()])?;
            }
            c.w.flush()?;
            let mut stored = Vec::with_capacity(jobs.len());
            for _ in jobs {
                match c.read(64)? {
                    Reply::Status(_) => stored.push(true),
                    Reply::Bulk(None) => stored.push(false),
                    Reply::Error(e) => return Err(proto(format!("SET refused: {e}"))),
                    r => return Err(proto(format!("unexpected reply to SET: {r:?}"))),
                }
            }
            Ok(stored)
        });
        let c = &self.c;
        match out {
            Ok(stored) => {
                for (v, s) in values.iter().zip(stored) {
                    if s {
                        c.writes.fetch_add(1, Ordering::Relaxed);
                        c.bytes_written.fetch_add(v.len() as u64, Ordering::Relaxed);
                    } else {
                        c.writes_existing.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Err(_) => {
                c.writes_dropped.fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}

fn writer_loop(s: Arc<Shared>, rx: Receiver<Msg>) {
    let mut batch: Vec<Job> = Vec::new();
    let mut flushes: Vec<mpsc::Sender<()>> = Vec::new();
    while let Ok(first) = rx.recv() {
        let mut bytes = 0;
        let take = |m: Msg, batch: &mut Vec<Job>, fl: &mut Vec<_>, bytes: &mut usize| match m {
            Msg::Write(j) => {
                *bytes += s.value_len();
                batch.push(j);
            }
            Msg::Flush(done) => fl.push(done),
        };
        take(first, &mut batch, &mut flushes, &mut bytes);
        while batch.len() < WRITE_BATCH && bytes < WRITE_BATCH_BYTES && flushes.is_empty() {
            match rx.try_recv() {
                Ok(m) => take(m, &mut batch, &mut flushes, &mut bytes),
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            let n = batch.len() as u64;
            if s.down() {
                s.c.writes_dropped.fetch_add(n, Ordering::Relaxed);
            } else {
                s.write_batch(&batch);
            }
            s.c.queued.fetch_sub(n, Ordering::Relaxed);
            s.c.queued_bytes.fetch_sub(bytes as u64, Ordering::Relaxed);
            batch.clear();
        }
        for done in flushes.drain(..) {
            let _ = done.send(());
        }
    }
}

/// A connection to the shared tier for one model's K/V memory (see the module docs).
pub struct RemoteTier {
    s: Arc<Shared>,
    tx: Mutex<Option<SyncSender<Msg>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("addr", &self.s.addr)
            .finish()
    }
}

impl RemoteTier {
    /// A tier on the store at `url` for blocks of `block_size` tokens and `block_bytes` bytes
    /// of the model `model_id`. Does not connect (a store that is down now is a tier that is
    /// off until it answers): `InvalidInput` / `Unsupported` only for a bad URL or options.
    pub fn open(
        url: &str,
        model_id: Key,
        block_size: usize,
        block_bytes: usize,
        o: RemoteOptions,
    ) -> Result<Arc<RemoteTier>> {
        let addr = RemoteAddr::parse(url)?;
        if block_size == 0 || block_bytes == 0 {
            return Err(invalid("kv remote tier: empty blocks"));
        }
        if o.timeout.is_zero() {
            return Err(invalid("kv remote tier: the timeout must be positive"));
        }
        let s = Arc::new(Shared {
            addr,
            model_id,
            block_size,
            block_bytes,
            opts: Mutex::new(o),
            staged: Arc::new(AtomicU64::new(0)),
            idle: Mutex::new(Vec::new()),
            down_until: Mutex::new(None),
            c: Counters::default(),
        });
        // The queue's depth in messages is generous; its byte budget is enforced by `offer`.
        let (tx, rx) = mpsc::sync_channel(4096);
        let w = Arc::clone(&s);
        let writer = std::thread::Builder::new()
            .name("kvserve-kv-remote".into())
            .spawn(move || writer_loop(w, rx))
            .map_err(|e| Error::Io(format!("kv remote tier: cannot start its writer: {e}")))?;
        Ok(Arc::new(RemoteTier {
            s,
            tx: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
        }))
    }

    pub fn model_id(&self) -> Key {
        self.s.model_id
    }

    pub fn addr(&self) -> &RemoteAddr {
        &self.s.addr
    }

    pub fn options(&self) -> RemoteOptions {
        self.s.opts()
    }

    pub fn configure(&self, o: RemoteOptions) {
        *self.s.opts.lock().unwrap_or_else(|e| e.into_inner()) = o;
    }

    /// The store's key of block `key` (`kvs:v1:<model id>:<key>`).
    pub fn redis_key(&self, key: Key) -> String {
        String::from_utf8(self.s.redis_key(key)).expect("ASCII")
    }

    /// Whether the store answers `PING` now (`Err` saying why not).
    pub fn ping(&self) -> std::result::Result<(), String> {
        self.s
            .with_conn(|c| {
                c.send(&[b"PING"])?;
                c.w.flush()?;
                match c.read(64)? {
                    Reply::Status(_) => Ok(()),
                    r => Err(proto(format!("unexpected reply to PING: {r:?}"))),
                }
            })
            .map_err(|e| format!("{:?}: {e}", self.s.addr))
    }

    /// Hands a block to the writer: copied and queued (the writer encodes it) unless the
    /// queue's byte budget is spent or the tier is off (dropped, counted). Never blocks on
    /// I/O. Whether it was queued.
    pub fn offer(&self, key: Key, parent: Key, tokens: &[u32], payload: &[u8]) -> bool {
        let c = &self.s.c;
        if tokens.len() != self.s.block_size || payload.len() != self.s.block_bytes {
            return false;
        }
        let len = self.s.value_len() as u64;
        let budget = self.s.opts().queue_bytes as u64;
        if self.s.down() || c.queued_bytes.load(Ordering::Relaxed) + len > budget {
            c.writes_dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let job = Job {
            key,
            parent,
            tokens: tokens.to_vec(),
            payload: payload.to_vec(),
        };
        c.queued.fetch_add(1, Ordering::Relaxed);
        c.queued_bytes.fetch_add(len, Ordering::Relaxed);
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let sent = match tx.as_ref() {
            Some(tx) => match tx.try_send(Msg::Write(job)) {
                Ok(()) => true,
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
            },
            None => false,
        };
        drop(tx);
        if !sent {
            c.queued.fetch_sub(1, Ordering::Relaxed);
            c.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            c.writes_dropped.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// Waits until every block offered before the call is sent (or dropped).
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

    /// Fetches the leading run of `candidates` (blocks in chain order that the local tiers
    /// lack, of a prompt of `prompt_len` tokens) that the store holds, verified, at most
    /// [`RemoteOptions::max_fetch_blocks`]: one pipelined existence check, then `MGET`s.
    /// Never fails: a fault is a shorter (or empty) run, counted.
    pub fn fetch(&self, candidates: &[Candidate<'_>], prompt_len: usize) -> Staged {
        self.fetch_in(candidates, prompt_len, false)
    }

    /// Fetches the first of `candidates` (in order of preference, e.g. a hybrid model's state
    /// checkpoints from the highest block boundary down) that the store holds, verified: one
    /// pipelined existence check of them all, then one `GET`. An invalid or lost value is
    /// nothing (counted), never another candidate. Never fails, as [`RemoteTier::fetch`].
    pub fn fetch_first(&self, candidates: &[Candidate<'_>], prompt_len: usize) -> Staged {
        self.fetch_in(candidates, prompt_len, true)
    }

    fn fetch_in(&self, candidates: &[Candidate<'_>], prompt_len: usize, first: bool) -> Staged {
        let mut out = Staged::default();
        let s = &self.s;
        let o = s.opts();
        if candidates.is_empty() {
            return out;
        }
        if prompt_len < o.min_tokens {
            s.c.skipped_short.fetch_add(1, Ordering::Relaxed);
            return out;
        }
        if s.down() {
            s.c.skipped_down.fetch_add(1, Ordering::Relaxed);
            return out;
        }
        let t0 = Instant::now();
        s.c.fetches.fetch_add(1, Ordering::Relaxed);
        let mut limit = if o.max_fetch_blocks == 0 {
            candidates.len()
        } else {
            candidates.len().min(o.max_fetch_blocks)
        };
        if first {
            limit = limit.min(1);
        }
        // Reserve the staging budget up front (given back below for blocks not brought).
        let per_block = s.block_bytes as u64;
        let mut reserved = 0;
        if o.max_staged_bytes > 0 {
            let want = limit as u64 * per_block;
            let _ = s
                .staged
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                    let room = o.max_staged_bytes.saturating_sub(used) / per_block * per_block;
                    reserved = want.min(room);
                    Some(used + reserved)
                });
            limit = (reserved / per_block) as usize;
            if limit == 0 {
                s.c.skipped_full.fetch_add(1, Ordering::Relaxed);
                return out;
            }
        }
        let asked = if first {
            candidates
        } else {
            &candidates[..limit]
        };
        let keys: Vec<Vec<u8>> = asked.iter().map(|c| s.redis_key(c.0)).collect();
        let exists = s.with_conn(|c| {
            for k in &keys {
                c.send(&[b"EXISTS", k])?;
            }
            c.w.flush()?;
            let mut present = Vec::with_capacity(keys.len());
            for _ in &keys {
                match c.read(64)? {
                    Reply::Int(n) => present.push(n > 0),
                    r => return Err(proto(format!("unexpected reply to EXISTS: {r:?}"))),
                }
            }
            Ok(present)
        });
        // The blocks to get: the leading run of hits, or (`first`) the first hit.
        let (cands, keys) = match exists {
            Ok(p) if first => match p.iter().position(|&x| x) {
                Some(i) => (&asked[i..=i], &keys[i..=i]),
                None => {
                    s.c.misses.fetch_add(1, Ordering::Relaxed);
                    (&asked[..0], &keys[..0])
                }
            },
            Ok(p) => {
                let run = p.iter().take_while(|&&x| x).count();
                if run < asked.len() {
                    s.c.misses.fetch_add(1, Ordering::Relaxed);
                }
                (&asked[..run], &keys[..run])
            }
            Err(_) => (&asked[..0], &keys[..0]),
        };
        let value_len = s.value_len();
        'batches: for (bi, batch) in cands.chunks(FETCH_BATCH).enumerate() {
            let ks = &keys[bi * FETCH_BATCH..bi * FETCH_BATCH + batch.len()];
            let got = s.with_conn(|c| {
                let mut args: Vec<&[u8]> = Vec::with_capacity(1 + ks.len());
                args.push(b"MGET");
                args.extend(ks.iter().map(Vec::as_slice));
                c.send(&args)?;
                c.w.flush()?;
                match c.read(value_len + 64)? {
                    Reply::Array(Some(v)) if v.len() == ks.len() => Ok(v),
                    r => Err(proto(format!(
                        "unexpected reply to MGET: {:?}",
                        kind_of(&r)
                    ))),
                }
            });
            let Ok(values) = got else {
                break;
            };
            for (&(key, parent, tokens), v) in batch.iter().zip(values) {
                let Reply::Bulk(Some(v)) = v else {
                    s.c.lost.fetch_add(1, Ordering::Relaxed);
                    break 'batches;
                };
                s.c.bytes_read.fetch_add(v.len() as u64, Ordering::Relaxed);
                let Some(p) = entry_payload(&v, s.model_id, key, parent, tokens, s.block_bytes)
                else {
                    s.c.invalid.fetch_add(1, Ordering::Relaxed);
                    break 'batches;
                };
                let payload = p.to_vec();
                out.blocks.insert(key, (parent, tokens.to_vec(), payload));
                s.c.fetched_blocks.fetch_add(1, Ordering::Relaxed);
            }
        }
        s.c.fetch_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let used = out.blocks.len() as u64 * per_block;
        if o.max_staged_bytes > 0 {
            s.staged.fetch_sub(reserved - used, Ordering::Relaxed);
        } else {
            s.staged.fetch_add(used, Ordering::Relaxed);
        }
        out.account = vec![(Arc::clone(&s.staged), used)];
        out
    }

    /// Counts `n` staged blocks a prefix match copied into the pool.
    pub fn count_hits(&self, n: usize) {
        self.s.c.hit_blocks.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Deletes `key`'s block from the store (tests and tools); whether it was there.
    pub fn delete(&self, key: Key) -> std::result::Result<bool, String> {
        let k = self.s.redis_key(key);
        self.s
            .with_conn(|c| {
                c.send(&[b"DEL", &k])?;
                c.w.flush()?;
                match c.read(64)? {
                    Reply::Int(n) => Ok(n > 0),
                    r => Err(proto(format!("unexpected reply to DEL: {r:?}"))),
                }
            })
            .map_err(|e| e.to_string())
    }

    pub fn stats(&self) -> RemoteStats {
        let c = &self.s.c;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let bs = self.s.block_size as u64;
        RemoteStats {
            fetches: ld(&c.fetches),
            fetched_blocks: ld(&c.fetched_blocks),
            fetched_tokens: ld(&c.fetched_blocks) * bs,
            hit_blocks: ld(&c.hit_blocks),
            hit_tokens: ld(&c.hit_blocks) * bs,
            misses: ld(&c.misses),
            invalid: ld(&c.invalid),
            lost: ld(&c.lost),
            bytes_read: ld(&c.bytes_read),
            bytes_written: ld(&c.bytes_written),
            writes: ld(&c.writes),
            writes_existing: ld(&c.writes_existing),
            writes_dropped: ld(&c.writes_dropped),
            errors: ld(&c.errors),
            skipped_short: ld(&c.skipped_short),
            skipped_down: ld(&c.skipped_down),
            skipped_full: ld(&c.skipped_full),
            staged_bytes: self.s.staged.load(Ordering::Relaxed),
            queued: ld(&c.queued),
            fetch_seconds: ld(&c.fetch_ns) as f64 * 1e-9,
            min_tokens: self.s.opts().min_tokens,
            down: self.s.down(),
        }
    }

    fn idle(&self) -> MutexGuard<'_, Vec<Conn>> {
        self.s.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes idle connections (the next command opens a new one).
    pub fn disconnect(&self) {
        self.idle().clear();
    }
}

fn kind_of(r: &Reply) -> &'static str {
    match r {
        Reply::Status(_) => "status",
        Reply::Error(_) => "error",
        Reply::Int(_) => "integer",
        Reply::Bulk(_) => "bulk string",
        Reply::Array(_) => "array of another length",
    }
}

impl Drop for RemoteTier {
    /// Sends what is queued (while the store answers), then stops the writer.
    fn drop(&mut self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = w.join();
        }
    }
}

/// A real Redis server for tests: Debian's `redis-server` on a free loopback port, without
/// persistence, killed when dropped. A missing binary is a clear failure, never a skip.
#[cfg(all(test, not(loom)))]
pub(crate) mod test_server {
    use std::net::TcpListener;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    pub(crate) struct RedisServer {
        child: Child,
        pub port: u16,
    }

    impl RedisServer {
        pub(crate) fn start() -> RedisServer {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .args(["--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!(
                        "cannot start redis-server ({e}): the shared-tier tests need Debian's \
                         redis-server on PATH (apt-get install redis-server; .ci/run installs it)"
                    )
                });
            let s = RedisServer { child, port };
            let t0 = Instant::now();
            while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "redis-server did not listen on port {port} within 10 s"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            s
        }

        pub(crate) fn url(&self) -> String {
            format!("redis://127.0.0.1:{}", self.port)
        }
    }

    impl Drop for RedisServer {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    #[test]
    fn names_resolve_within_the_timeout() {
        use super::resolve_within;
        use std::net::{SocketAddr, ToSocketAddrs};
        use std::time::{Duration, Instant};
        let sys = |h: &str, p: u16| (h, p).to_socket_addrs().map(|a| a.collect::<Vec<_>>());
        let t = Duration::from_secs(5);
        // An IP literal needs no resolver; a name goes through it.
        let never = |_: &str, _: u16| -> std::io::Result<Vec<SocketAddr>> { panic!("called") };
        let ip = resolve_within("127.0.0.1", 6379, t, never).unwrap();
        assert_eq!(ip, vec!["127.0.0.1:6379".parse().unwrap()]);
        let v6 = resolve_within("::1", 7, t, never).unwrap();
        assert_eq!(v6, vec!["[::1]:7".parse().unwrap()]);
        let local = resolve_within("localhost", 6379, t, sys).unwrap();
        assert!(!local.is_empty() && local.iter().all(|a| a.ip().is_loopback()));
        // A resolver that hangs: a TimedOut error after the timeout, not after the resolver.
        let hang = |_: &str, _: u16| -> std::io::Result<Vec<SocketAddr>> {
            std::thread::sleep(Duration::from_secs(3));
            Ok(vec![])
        };
        let t0 = Instant::now();
        let e = resolve_within("example.invalid", 1, Duration::from_millis(100), hang);
        assert_eq!(e.unwrap_err().kind(), std::io::ErrorKind::TimedOut);
        assert!(t0.elapsed() < Duration::from_secs(2));
        // A resolver's error comes through.
        let fail = |_: &str, _: u16| -> std::io::Result<Vec<SocketAddr>> {
            Err(std::io::Error::other("no such host"))
        };
        let e = resolve_within("nowhere", 1, t, fail).unwrap_err();
        assert_eq!(e.to_string(), "no such host");
        // Resolvers that keep hanging leave at most MAX_RESOLVING threads: the lookups past
        // that fail at once (the one above may still hold a place: it sleeps 3 s).
        let short = Duration::from_millis(20);
        let kinds: Vec<_> = (0..super::MAX_RESOLVING + 2)
            .map(|_| {
                resolve_within("hangs.invalid", 1, short, hang)
                    .unwrap_err()
                    .kind()
            })
            .collect();
        let busy = kinds
            .iter()
            .filter(|&&k| k == std::io::ErrorKind::WouldBlock)
            .count();
        assert!(busy >= 2, "{kinds:?}");
        assert!(kinds.iter().all(|&k| matches!(
            k,
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        )));
        // Once they return, lookups run again.
        std::thread::sleep(Duration::from_millis(3500));
        assert_eq!(
            resolve_within("localhost", 6379, t, sys)
                .map(|a| a.is_empty())
                .ok(),
            Some(false)
        );
    }

    use super::test_server::RedisServer;
    use super::*;
    use std::net::TcpListener;

    const BS: usize = 4;
    const BYTES: usize = 64;

    fn tier(url: &str, model_id: Key) -> Arc<RemoteTier> {
        let o = RemoteOptions {
            timeout: Duration::from_millis(300),
            retry_after: Duration::from_millis(400),
            ..RemoteOptions::default()
        };
        RemoteTier::open(url, model_id, BS, BYTES, o).unwrap()
    }

    /// Block `i` of a chain: its tokens, key, parent and payload.
    fn block(i: u32) -> (Vec<u32>, Key, Key, Vec<u8>) {
        let tokens: Vec<u32> = (0..BS as u32).map(|t| 100 * i + t).collect();
        let key = 0xabc0_0000 + i as Key;
        let parent = if i == 0 { 0 } else { key - 1 };
        let payload = (0..BYTES).map(|b| (b as u32 * 7 + i) as u8).collect();
        (tokens, key, parent, payload)
    }

    fn chain(n: u32) -> Vec<(Vec<u32>, Key, Key, Vec<u8>)> {
        (0..n).map(block).collect()
    }

    fn cands(c: &[(Vec<u32>, Key, Key, Vec<u8>)]) -> Vec<Candidate<'_>> {
        c.iter()
            .map(|(t, k, p, _)| (*k, *p, t.as_slice()))
            .collect()
    }

    fn raw(port: u16, args: &[&[u8]]) -> Reply {
        let addr = RemoteAddr::parse(&format!("redis://127.0.0.1:{port}")).unwrap();
        let mut c = Conn::open(&addr, Duration::from_secs(2)).unwrap();
        c.send(args).unwrap();
        c.w.flush().unwrap();
        c.read(1 << 20).unwrap()
    }

    #[test]
    fn parses_urls() {
        let a = RemoteAddr::parse("redis://localhost").unwrap();
        assert_eq!((a.host.as_str(), a.port, a.db), ("localhost", 6379, 0));
        assert_eq!((a.user, a.password), (None, None));
        let a = RemoteAddr::parse("redis://:p%40ss@10.0.0.2:7000/3").unwrap();
        assert_eq!((a.host.as_str(), a.port, a.db), ("10.0.0.2", 7000, 3));
        assert_eq!((a.user, a.password.as_deref()), (None, Some("p@ss")));
        let a = RemoteAddr::parse("valkey://bob:secret@[::1]:6380/").unwrap();
        assert_eq!((a.host.as_str(), a.port, a.db), ("::1", 6380, 0));
        assert_eq!(
            (a.user.as_deref(), a.password.as_deref()),
            (Some("bob"), Some("secret"))
        );
        assert!(
            !format!("{a:?}").contains("secret"),
            "Debug hides the password"
        );
        for bad in [
            "localhost:6379",
            "http://h",
            "redis://",
            "redis://h:99999",
            "redis://h/x",
            "redis://h?db=1",
            "redis://:%zz@h",
        ] {
            assert!(
                matches!(RemoteAddr::parse(bad), Err(Error::InvalidInput(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            RemoteAddr::parse("rediss://h"),
            Err(Error::Unsupported(_))
        ));
    }

    /// Blocks written by one tier are fetched by another (another process: same model id,
    /// same keys), bit for bit; the run stops at the first block the store lacks.
    #[test]
    fn write_then_fetch_round_trip() {
        let r = RedisServer::start();
        let a = tier(&r.url(), 7);
        let c = chain(6);
        for (t, k, p, b) in &c[..4] {
            assert!(a.offer(*k, *p, t, b));
        }
        a.flush();
        let st = a.stats();
        assert_eq!((st.writes, st.writes_dropped, st.errors), (4, 0, 0));
        assert_eq!(
            st.bytes_written,
            4 * super::super::disk::entry_len(BS, BYTES) as u64
        );
        let b = tier(&r.url(), 7);
        let got = b.fetch(&cands(&c), 6 * BS + 1);
        assert_eq!(got.len(), 4);
        for (t, k, p, payload) in &c[..4] {
            assert_eq!(got.get(*k, *p, t), Some(payload.as_slice()));
            assert_eq!(
                got.get(*k, *p + 1, t),
                None,
                "another parent is not this block"
            );
        }
        let st = b.stats();
        assert_eq!((st.fetches, st.fetched_blocks, st.misses), (1, 4, 1));
        // The store's key names the model and the block, and the value has a time to live.
        let key = format!("kvs:v1:{:032x}:{:032x}", 7, c[0].1);
        assert_eq!(a.redis_key(c[0].1), key);
        match raw(r.port, &[b"PTTL", key.as_bytes()]) {
            Reply::Int(ms) => assert!(ms > 0 && ms <= DEFAULT_TTL.as_millis() as i64),
            x => panic!("PTTL: {x:?}"),
        }
        // Another model (or K/V format: another model id) finds nothing.
        let other = tier(&r.url(), 8);
        assert!(other.fetch(&cands(&c), 100).is_empty());
        // SET NX: a second writer of the same key keeps the first value.
        let (t, k, p, _) = &c[0];
        assert!(b.offer(*k, *p, t, &[9u8; BYTES]));
        b.flush();
        assert_eq!(b.stats().writes_existing, 1);
        assert_eq!(
            tier(&r.url(), 7).fetch(&cands(&c[..1]), 100).get(*k, *p, t),
            Some(c[0].3.as_slice())
        );
    }

    /// A deleted block ends the run before it; a damaged or foreign value is a miss
    /// (`invalid`), never a block.
    #[test]
    fn deleted_and_damaged_values_end_the_run() {
        let r = RedisServer::start();
        let a = tier(&r.url(), 7);
        let c = chain(6);
        for (t, k, p, b) in &c {
            a.offer(*k, *p, t, b);
        }
        a.flush();
        assert!(a.delete(c[3].1).unwrap());
        let got = a.fetch(&cands(&c), 100);
        assert_eq!(got.len(), 3);
        // Damage one byte of block 1's value in the store.
        let key = a.redis_key(c[1].1);
        let Reply::Bulk(Some(mut v)) = raw(r.port, &[b"GET", key.as_bytes()]) else {
            panic!("GET");
        };
        let at = v.len() - 40;
        v[at] ^= 1;
        assert_eq!(
            raw(r.port, &[b"SET", key.as_bytes(), &v]),
            Reply::Status("OK".into())
        );
        let got = a.fetch(&cands(&c), 100);
        assert_eq!(got.len(), 1, "only the block before the damaged one");
        assert_eq!(a.stats().invalid, 1);
        // A value stored under the right key for other tokens is not this block either.
        let (t, k, p, _) = &c[0];
        let forged = encode_entry(7, *k, *p, &[1, 2, 3, 4], &c[0].3);
        raw(r.port, &[b"SET", a.redis_key(*k).as_bytes(), &forged]);
        assert!(a.fetch(&cands(&c), 100).get(*k, *p, t).is_none());
    }

    /// A store that accepts connections and never answers costs one timeout, then the tier
    /// rests (fetches and writes skipped) and comes back by itself; nothing panics or hangs.
    #[test]
    fn a_silent_store_costs_one_timeout_then_rests() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        l.set_nonblocking(true).unwrap();
        let hold = std::thread::spawn(move || {
            // Accept and hold connections without a word, for 2 s.
            let mut held = Vec::new();
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(2) {
                if let Ok(s) = l.accept() {
                    held.push(s);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let t = tier(&format!("redis://127.0.0.1:{port}"), 7);
        let c = chain(3);
        let t0 = Instant::now();
        assert!(t.fetch(&cands(&c), 100).is_empty());
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(250), "{took:?}");
        assert!(
            took < Duration::from_secs(2),
            "one timeout, not more: {took:?}"
        );
        let st = t.stats();
        assert_eq!((st.errors, st.down), (1, true));
        let t0 = Instant::now();
        assert!(t.fetch(&cands(&c), 100).is_empty());
        assert!(t0.elapsed() < Duration::from_millis(50), "resting: no wait");
        assert_eq!(t.stats().skipped_down, 1);
        let (tk, k, p, b) = &c[0];
        assert!(!t.offer(*k, *p, tk, b), "writes are dropped while resting");
        std::thread::sleep(Duration::from_millis(450));
        assert!(!t.stats().down, "the rest ends");
        drop(t);
        hold.join().unwrap();
    }

    /// Replies that are not the protocol (garbage, a value longer than any block, a wrong
    /// reply type) are errors, never a panic or a huge allocation; a refused connection too.
    #[test]
    fn malformed_replies_and_refused_connections_are_errors() {
        for reply in [
            &b"garbage\r\n"[..],
            b"$999999999999\r\n",
            b"*99999999\r\n",
            b":1\r\n",
            b"+OK",
        ] {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = l.local_addr().unwrap().port();
            let sent = reply.to_vec();
            let srv = std::thread::spawn(move || {
                if let Ok((mut s, _)) = l.accept() {
                    let mut buf = [0u8; 4096];
                    let _ = s.read(&mut buf);
                    let _ = s.write_all(&sent);
                    std::thread::sleep(Duration::from_millis(400));
                }
            });
            let t = tier(&format!("redis://127.0.0.1:{port}"), 7);
            let c = chain(2);
            // EXISTS gets the reply; `:1` passes it, then MGET meets a closed stream.
            assert!(t.fetch(&cands(&c), 100).is_empty(), "{reply:?}");
            assert_eq!(t.stats().errors, 1);
            srv.join().unwrap();
        }
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let t = tier(&format!("redis://127.0.0.1:{port}"), 7);
        assert!(t.fetch(&cands(&chain(2)), 100).is_empty());
        assert!(t.ping().is_err());
        assert_eq!(t.stats().errors, 2);
    }

    /// Staged blocks count against the budget until dropped: a fetch beyond it brings
    /// fewer blocks, or none (counted), and dropping a staged set gives its bytes back.
    #[test]
    fn staged_blocks_stay_within_their_budget() {
        let r = RedisServer::start();
        let t = tier(&r.url(), 7);
        let c = chain(6);
        for (tk, k, p, b) in &c {
            t.offer(*k, *p, tk, b);
        }
        t.flush();
        t.configure(RemoteOptions {
            max_staged_bytes: 5 * BYTES as u64 + 3,
            ..t.options()
        });
        let first = t.fetch(&cands(&c), 100);
        assert_eq!(first.len(), 5, "the budget's whole blocks");
        assert_eq!(t.stats().staged_bytes, 5 * BYTES as u64);
        assert!(t.fetch(&cands(&c), 100).is_empty());
        assert_eq!(t.stats().skipped_full, 1);
        drop(first);
        assert_eq!(t.stats().staged_bytes, 0);
        let again = t.fetch(&cands(&c[..2]), 100);
        assert_eq!(again.len(), 2);
        assert_eq!(t.stats().staged_bytes, 2 * BYTES as u64);
        drop(again);
        // A fetch that finds less than it reserved gives the rest back at once.
        assert!(t.delete(c[1].1).unwrap());
        let short = t.fetch(&cands(&c), 100);
        assert_eq!(short.len(), 1);
        assert_eq!(t.stats().staged_bytes, BYTES as u64);
    }

    /// A pooled connection the server closed while idle (its `timeout`, a restart) is
    /// replaced on the spot: no error, no rest.
    #[test]
    fn a_connection_the_server_closed_is_replaced_without_an_error() {
        let r = RedisServer::start();
        let t = tier(&r.url(), 7);
        let c = chain(2);
        for (tk, k, p, b) in &c {
            t.offer(*k, *p, tk, b);
        }
        t.flush();
        assert_eq!(t.fetch(&cands(&c), 100).len(), 2);
        match raw(r.port, &[b"CLIENT", b"KILL", b"TYPE", b"normal"]) {
            Reply::Int(n) => assert!(n >= 1, "the tier's pooled connections were killed"),
            x => panic!("CLIENT KILL: {x:?}"),
        }
        assert_eq!(t.fetch(&cands(&c), 100).len(), 2);
        let st = t.stats();
        assert_eq!((st.errors, st.down), (0, false));
    }

    /// Prompts under the break-even do not ask the store.
    #[test]
    fn short_prompts_skip_the_store() {
        let r = RedisServer::start();
        let t = tier(&r.url(), 7);
        t.configure(RemoteOptions {
            min_tokens: 100,
            ..t.options()
        });
        let c = chain(2);
        assert!(t.fetch(&cands(&c), 99).is_empty());
        let st = t.stats();
        assert_eq!((st.skipped_short, st.fetches), (1, 0));
        assert!(t.ping().is_ok());
    }
}
