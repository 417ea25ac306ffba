//! Sequence state: the cells of one sequence — positions, token ids and the K/V rows of every
//! layer exactly as stored (f16, q8_0 or f32 bytes) — as bytes, and those bytes written back into
//! an empty sequence without recomputation. The role of llama.cpp's
//! `llama_state_seq_get_data`/`llama_state_seq_set_data`, in kvserve's own format.
//!
//! # Format (version 1, little-endian)
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 4 | magic `KVSQ` |
//! | 4 | 4 | format version (`1`) |
//! | 8 | 16 | weights identity (`model::model_identity`, u128) |
//! | 24 | 4 | K/V type code (ggml type ids: F32 = 0, F16 = 1, Q8_0 = 8) |
//! | 28 | 4 | layers |
//! | 32 | 4 | `kv_dim` (values per token row) |
//! | 36 | 4 | `head_dim` |
//! | 40 | 4 | flags: bit 0 = the sequence was clean (see docs/KV_SEMANTICS.md); others 0 |
//! | 44 | 4 | `n`: cells |
//! | 48 | 4n | positions (i32), strictly increasing |
//! | 48+4n | 4n | token ids (u32) |
//! | 48+8n | 2·layers·n·row | per layer: the K rows of the `n` cells, then their V rows |
//!
//! `row` is the type's row size for `kv_dim` values. The length must match exactly. The bytes
//! carry no checksum: whoever stores them (kvserve's session files) adds one.
//!
//! # Rules
//!
//! - **Read** (`seq_state_read`): pending copy-on-write copies and K-shifts are applied first,
//!   so every K row is rotated for its cell's position. Cells are written in position order; a
//!   sequence with two cells at one position cannot be written (`InvalidInput`). An unknown or
//!   empty sequence gives a state of 0 cells.
//! - **Write** (`seq_state_write`) goes into an *empty* sequence and is one batch transaction:
//!   the whole input is validated first (magic, version, weights identity, K/V type and shape,
//!   flags, exact length, increasing non-negative positions, token ids in the vocabulary); then
//!   the cells are planned like a decode batch (all or nothing: `KvCacheFull` if the pool or the
//!   context limit cannot hold them), the rows are copied into their slots, and only then is
//!   the batch committed: full blocks of a clean state (positions `0, 1, 2, ...`) get their
//!   content keys and enter the prefix index, exactly as if the tokens had been decoded. A state
//!   read from a sequence that was not clean marks the new sequence not clean, so none of its
//!   blocks is ever keyed. On any error nothing changed.
//! - Writing trusts that the rows are the K/V of those tokens under those weights (as loading
//!   a model trusts its file): the identity check rejects other models and formats, and the
//!   container's checksum rejects damage.

use std::sync::Arc;

use super::cache::PagedCache;
use super::table::{Pos, SeqId};
use crate::batch::Batch;
use crate::error::{Error, Result};

/// First bytes of a sequence state.
pub const STATE_MAGIC: [u8; 4] = *b"KVSQ";
/// Version of the sequence state format.
pub const STATE_VERSION: u32 = 1;
const HEADER: usize = 48;
const FLAG_CLEAN: u32 = 1;

fn bad(msg: impl Into<String>) -> Error {
    Error::InvalidInput(format!("sequence state: {}", msg.into()))
}

fn u32_at(d: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(d[at..at + 4].try_into().expect("4 bytes"))
}

/// A validated state (borrowing the K/V rows of the input).
struct Parsed<'a> {
    clean: bool,
    positions: Vec<Pos>,
    tokens: Vec<u32>,
    rows: &'a [u8],
    row: usize,
}

impl Parsed<'_> {
    /// The K (`v = false`) or V row of cell `i` in `layer`.
    fn row(&self, layer: usize, v: bool, i: usize) -> &[u8] {
        let n = self.positions.len();
        let at = ((2 * layer + usize::from(v)) * n + i) * self.row;
        &self.rows[at..at + self.row]
    }
}

impl PagedCache {
    /// The state of sequence `seq` (see the module docs for the format). `InvalidInput` if
    /// `seq < 0` or two of its cells share a position.
    pub fn seq_state_read(&mut self, seq: SeqId) -> Result<Vec<u8>> {
        if seq < 0 {
            return Err(bad(format!("needs a sequence id >= 0, got {seq}")));
        }
        // Pending K-shifts first: every K row is then rotated for its cell's position.
        self.apply_pending()?;
        let mut cells = self.table().cells(seq);
        cells.sort_by_key(|c| c.0);
        if let Some(w) = cells.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(bad(format!(
                "sequence {seq} has two cells at position {}",
                w[0].0
            )));
        }
        let shared = Arc::clone(self.shared());
        let layout = *shared.layout();
        let row = layout.row_bytes();
        let n = cells.len();
        let n32 =
            u32::try_from(n).map_err(|_| bad(format!("sequence {seq} has too many cells")))?;
        let mut out = Vec::new();
        let size = HEADER + 8 * n + 2 * layout.n_layers * n * row;
        out.try_reserve_exact(size).map_err(|_| {
            Error::OutOfMemory(format!("cannot allocate {size} bytes of sequence state"))
        })?;
        out.extend_from_slice(&STATE_MAGIC);
        out.extend_from_slice(&STATE_VERSION.to_le_bytes());
        out.extend_from_slice(&shared.weights_id().to_le_bytes());
        let clean = if self.table().is_clean(seq) {
            FLAG_CLEAN
        } else {
            0
        };
        for w in [
            layout.ty.code(),
            layout.n_layers as u32,
            layout.kv_dim as u32,
            shared.head_dim() as u32,
            clean,
            n32,
        ] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        for &(p, _, _) in &cells {
            out.extend_from_slice(&p.to_le_bytes());
        }
        for &(_, b, sl) in &cells {
            out.extend_from_slice(&self.table().cell_token(b, sl).to_le_bytes());
        }
        let storage = shared.lock_storage();
        for layer in 0..layout.n_layers {
            for v in [false, true] {
                for &(_, b, sl) in &cells {
                    out.extend_from_slice(storage.row_raw(layer, b, sl as usize, v)?);
                }
            }
        }
        debug_assert_eq!(out.len(), size);
        Ok(out)
    }

    /// Checks `data` against this memory (see the module docs) without changing anything.
    fn parse_state<'a>(&self, data: &'a [u8], n_vocab: usize) -> Result<Parsed<'a>> {
        if data.len() < HEADER {
            return Err(bad(format!(
                "{} bytes is shorter than the {HEADER}-byte header (truncated?)",
                data.len()
            )));
        }
        if data[..4] != STATE_MAGIC {
            return Err(bad("wrong magic (not a kvserve sequence state)"));
        }
        let version = u32_at(data, 4);
        if version != STATE_VERSION {
            return Err(bad(format!(
                "format version {version}, this build reads version {STATE_VERSION}"
            )));
        }
        let shared = self.shared();
        let id = u128::from_le_bytes(data[8..24].try_into().expect("16 bytes"));
        if id != shared.weights_id() {
            return Err(bad(format!(
                "made by another model (weights identity {id:032x}, this model's is {:032x})",
                shared.weights_id()
            )));
        }
        let layout = shared.layout();
        let want = [
            ("K/V type code", layout.ty.code()),
            ("layer count", layout.n_layers as u32),
            ("kv_dim", layout.kv_dim as u32),
            ("head_dim", shared.head_dim() as u32),
        ];
        for (i, (what, expect)) in want.into_iter().enumerate() {
            let got = u32_at(data, 24 + 4 * i);
            if got != expect {
                return Err(bad(format!(
                    "{what} is {got}, this memory's is {expect} (K/V type {})",
                    layout.ty.name()
                )));
            }
        }
        let flags = u32_at(data, 40);
        if flags & !FLAG_CLEAN != 0 {
            return Err(bad(format!("unknown flags {flags:#x}")));
        }
        let n = u32_at(data, 44) as usize;
        let row = layout.row_bytes();
        let size = n
            .checked_mul(2 * layout.n_layers * row + 8)
            .and_then(|x| x.checked_add(HEADER))
            .ok_or_else(|| bad(format!("{n} cells is too many")))?;
        if data.len() != size {
            return Err(bad(format!(
                "{} bytes, but {n} cells of this model take {size} (truncated or corrupt)",
                data.len()
            )));
        }
        let positions: Vec<Pos> = data[HEADER..HEADER + 4 * n]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        if let Some(i) =
            (0..n).find(|&i| positions[i] < 0 || (i > 0 && positions[i] <= positions[i - 1]))
        {
            return Err(bad(format!(
                "position {} of cell {i} is negative or not above the previous one",
                positions[i]
            )));
        }
        let tokens: Vec<u32> = data[HEADER + 4 * n..HEADER + 8 * n]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        if let Some(i) = tokens.iter().position(|&t| t as usize >= n_vocab) {
            return Err(bad(format!(
                "token {} of cell {i} is out of range (vocabulary has {n_vocab})",
                tokens[i]
            )));
        }
        Ok(Parsed {
            clean: flags & FLAG_CLEAN != 0,
            positions,
            tokens,
            rows: &data[HEADER + 8 * n..],
            row,
        })
    }

    /// Writes a state (from [`PagedCache::seq_state_read`], possibly of another context or
    /// process) into the empty sequence `seq`; returns its cell count. Token ids must be below
    /// `n_vocab`. All or nothing (see the module docs): `InvalidInput` for a bad state or a
    /// non-empty `seq`, `KvCacheFull` when the cells do not fit.
    pub fn seq_state_write(&mut self, seq: SeqId, data: &[u8], n_vocab: usize) -> Result<usize> {
        if seq < 0 {
            return Err(bad(format!("needs a sequence id >= 0, got {seq}")));
        }
        if self.table().seq_pos_max(seq) >= 0 {
            return Err(bad(format!(
                "sequence {seq} is not empty; a state is written into an empty sequence"
            )));
        }
        let st = self.parse_state(data, n_vocab)?;
        let n = st.positions.len();
        if n == 0 {
            return Ok(0);
        }
        let batch = Batch {
            tokens: st.tokens.clone(),
            positions: st.positions.clone(),
            seq_ids: vec![seq; n],
            logits: vec![false; n],
        };
        let shared = Arc::clone(self.shared());
        let mut storage = shared.lock_storage();
        let (slots, tx) = self.begin_batch(&batch, &mut storage)?;
        if !st.clean {
            // Before the commit: nothing of this sequence is ever keyed.
            self.table_mut().taint(seq);
        }
        let mut written = Ok(());
        'rows: for layer in 0..shared.layout().n_layers {
            for v in [false, true] {
                for (i, &(b, sl)) in slots.iter().enumerate() {
                    written = storage.write_row_raw(layer, b, sl as usize, v, st.row(layer, v, i));
                    if written.is_err() {
                        break 'rows;
                    }
                }
            }
        }
        match written {
            Ok(()) => {
                self.commit(tx);
                Ok(n)
            }
            Err(e) => {
                self.rollback(tx);
                Err(e)
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::kv::pool::{BlockId, NO_KEY};
    use crate::kv::prefix::Key;
    use crate::kv::storage::{KvLayout, KvType};
    use crate::kv::SharedKv;
    use crate::ops::{Rope, RopeScaling};

    const BS: usize = 4;
    const D: usize = 32; // q8_0 rows hold whole 32-value blocks
    const HEAD: usize = 8;
    const LAYERS: usize = 2;
    const VOCAB: usize = 1000;

    fn memory(ty: KvType, n_blocks: usize, weights: Key) -> Arc<SharedKv> {
        let rope = Rope {
            n_rot: HEAD,
            neox: false,
            freq_base: 10000.0,
            scaling: RopeScaling::None,
            freq_factors: None,
        };
        let layout = KvLayout {
            ty,
            n_layers: LAYERS,
            kv_dim: D,
            block_size: BS,
        };
        Arc::new(SharedKv::new(layout, HEAD, rope, n_blocks, weights).unwrap())
    }

    fn cache(m: &Arc<SharedKv>) -> PagedCache {
        PagedCache::new(Arc::clone(m), 1 << 20).unwrap()
    }

    /// A K (`kv = 0`) or V (`kv = 1`) value that depends on everything that names it.
    fn value(t: u32, p: Pos, layer: usize, j: usize, kv: usize) -> f32 {
        (t as f32 * 0.37 + p as f32 * 0.11 + layer as f32 * 0.7 + j as f32 * 0.013 + kv as f32)
            .sin()
    }

    /// Decodes `tokens` into `seq` at positions `pos0..` (K/V from [`value`]).
    fn decode(c: &mut PagedCache, seq: SeqId, tokens: &[u32], pos0: Pos) {
        let b = Batch::prompt(tokens, pos0, seq);
        let shared = Arc::clone(c.shared());
        let mut st = shared.lock_storage();
        let (slots, tx) = c.begin_batch(&b, &mut st).unwrap();
        for layer in 0..LAYERS {
            let kv = |w: usize| -> Vec<f32> {
                (0..tokens.len() * D)
                    .map(|i| value(tokens[i / D], pos0 + (i / D) as Pos, layer, i % D, w))
                    .collect()
            };
            PagedCache::write(&mut st, layer, &slots, &kv(0), &kv(1));
        }
        drop(st);
        c.commit(tx);
        c.table().check().unwrap();
    }

    /// Per cell of `seq` in position order: position, token and every stored row (bytes).
    fn dump(c: &PagedCache, seq: SeqId) -> Vec<(Pos, u32, Vec<u8>)> {
        let mut cells = c.table().cells(seq);
        cells.sort_by_key(|x| x.0);
        let st = c.shared().lock_storage();
        cells
            .into_iter()
            .map(|(p, b, sl)| {
                let mut rows = Vec::new();
                for layer in 0..LAYERS {
                    for v in [false, true] {
                        rows.extend_from_slice(st.row_raw(layer, b, sl as usize, v).unwrap());
                    }
                }
                (p, c.table().cell_token(b, sl), rows)
            })
            .collect()
    }

    /// Content keys (pool tags) of the blocks of `seq`, in position order.
    fn keys(c: &PagedCache, seq: SeqId) -> Vec<u64> {
        let mut cells = c.table().cells(seq);
        cells.sort_by_key(|x| x.0);
        let mut blocks: Vec<BlockId> = cells.iter().map(|x| x.1).collect();
        blocks.dedup();
        blocks.iter().map(|&b| c.table().pool().key(b)).collect()
    }

    /// Everything a failed write must leave alone.
    fn snapshot(c: &PagedCache) -> impl PartialEq + std::fmt::Debug {
        let pool = c.table().pool();
        let blocks: Vec<_> = (0..pool.total() as BlockId)
            .map(|b| (pool.refcount(b), pool.key(b)))
            .collect();
        let seqs: Vec<_> = (0..8).map(|s| c.table().cells(s)).collect();
        (
            seqs,
            c.stats(),
            pool.stats(),
            blocks,
            c.shared().prefix_stats(),
        )
    }

    fn tokens(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i * 31 + salt) % VOCAB as u32)
            .collect()
    }

    #[test]
    fn state_roundtrips_in_every_kv_type() {
        for ty in [KvType::F32, KvType::F16, KvType::Q8_0] {
            let (ma, mb) = (memory(ty, 16, 7), memory(ty, 16, 7));
            let (mut a, mut b) = (cache(&ma), cache(&mb));
            let t = tokens(10, 1);
            decode(&mut a, 3, &t, 0);
            decode(&mut b, 0, &tokens(6, 500), 0); // b is not empty: the write goes beside it
            let data = a.seq_state_read(3).unwrap();
            let row = ty.row_bytes(D);
            assert_eq!(
                data.len(),
                HEADER + 8 * 10 + 2 * LAYERS * 10 * row,
                "{ty:?}"
            );
            assert_eq!(b.seq_state_write(5, &data, VOCAB).unwrap(), 10);
            b.table().check().unwrap();
            assert_eq!(
                dump(&b, 5),
                dump(&a, 3),
                "{ty:?}: cells, tokens, rows as stored"
            );
            assert_eq!(b.seq_state_read(5).unwrap(), data, "{ty:?}: byte-identical");
            // The restored sequence goes on like the original.
            decode(&mut a, 3, &[77, 78, 79], 10);
            decode(&mut b, 5, &[77, 78, 79], 10);
            assert_eq!(dump(&b, 5), dump(&a, 3), "{ty:?}: after more tokens");
            // Into another sequence of the same context too.
            assert_eq!(a.seq_state_write(4, &data, VOCAB).unwrap(), 10);
            assert_eq!(dump(&a, 4), dump(&b, 5)[..10].to_vec());
            a.table().check().unwrap();
            // An empty sequence has an empty state, and writing it adds nothing.
            let empty = a.seq_state_read(6).unwrap();
            assert_eq!(empty.len(), HEADER);
            let before = snapshot(&b);
            assert_eq!(b.seq_state_write(6, &empty, VOCAB).unwrap(), 0);
            assert_eq!(snapshot(&b), before);
        }
    }

    /// A clean state is keyed at commit exactly as a decode of its tokens would be: the same
    /// keys, found by `match_prefix`; a context with prefix caching off keys nothing.
    #[test]
    fn written_clean_state_is_keyed_like_a_decode() {
        let (ma, mb) = (memory(KvType::F16, 16, 9), memory(KvType::F16, 16, 9));
        let (mut a, mut b) = (cache(&ma), cache(&mb));
        let t = tokens(10, 3);
        decode(&mut a, 0, &t, 0);
        let data = a.seq_state_read(0).unwrap();
        b.seq_state_write(2, &data, VOCAB).unwrap();
        let (ka, kb) = (keys(&a, 0), keys(&b, 2));
        assert_eq!(ka.len(), 3);
        assert!(ka[0] != NO_KEY && ka[1] != NO_KEY && ka[2] == NO_KEY);
        assert_eq!(
            kb, ka,
            "same content keys as the decode that made the state"
        );
        assert_eq!(mb.prefix_stats().indexed, 2);
        b.table_mut().seq_rm(2, -1, -1);
        assert_eq!(b.match_prefix(1, &t).unwrap(), 8);
        assert_eq!(dump(&b, 1), dump(&a, 0)[..8].to_vec());
        b.table().check().unwrap();

        let mc = memory(KvType::F16, 16, 9);
        let mut c = cache(&mc);
        c.set_prefix_cache(false);
        c.seq_state_write(0, &data, VOCAB).unwrap();
        assert!(keys(&c, 0).iter().all(|&k| k == NO_KEY));
        assert_eq!(mc.prefix_stats().indexed, 0);
    }

    /// A sequence that was shifted is not clean: its state says so, and the written sequence
    /// never gets a content key, also for blocks it fills later.
    #[test]
    fn state_of_a_shifted_sequence_is_never_keyed() {
        let (ma, mb) = (memory(KvType::F16, 16, 5), memory(KvType::F16, 16, 5));
        let (mut a, mut b) = (cache(&ma), cache(&mb));
        let t = tokens(12, 4);
        decode(&mut a, 0, &t, 0);
        a.table_mut().seq_rm(0, 0, 4);
        a.table_mut().seq_add(0, 4, -1, -4).unwrap();
        let data = a.seq_state_read(0).unwrap();
        assert_eq!(u32_at(&data, 40), 0, "flags: not clean");
        let want: Vec<Pos> = (0..8).collect();
        let got: Vec<Pos> = dump(&a, 0).iter().map(|x| x.0).collect();
        assert_eq!(got, want);
        assert_eq!(b.seq_state_write(0, &data, VOCAB).unwrap(), 8);
        a.apply_pending().unwrap(); // a no-op if the read applied the K-shift, as it must
        assert_eq!(dump(&b, 0), dump(&a, 0), "shifted keys are read as rotated");
        decode(&mut b, 0, &tokens(9, 40), 8);
        assert!(keys(&b, 0).iter().all(|&k| k == NO_KEY));
        assert_eq!(mb.prefix_stats().indexed, 0);
        b.table().check().unwrap();
    }

    #[test]
    fn bad_states_change_nothing() {
        let ma = memory(KvType::F16, 16, 11);
        let mut a = cache(&ma);
        let t = tokens(10, 6);
        decode(&mut a, 0, &t, 0);
        let data = a.seq_state_read(0).unwrap();
        let mb = memory(KvType::F16, 16, 11);
        let mut b = cache(&mb);
        decode(&mut b, 1, &tokens(9, 70), 0);
        decode(&mut b, 2, &tokens(8, 90), 0);
        b.table_mut().seq_rm(2, -1, -1); // two cached blocks
        let set = |at: usize, v: u32| {
            let mut d = data.clone();
            d[at..at + 4].copy_from_slice(&v.to_le_bytes());
            d
        };
        let flip = |at: usize| {
            let mut d = data.clone();
            d[at] ^= 1;
            d
        };
        let mut longer = data.clone();
        longer.push(0);
        let mut swapped = data.clone();
        swapped.copy_within(HEADER..HEADER + 4, HEADER + 8);
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", Vec::new()),
            ("header only, truncated", data[..HEADER - 1].to_vec()),
            ("one byte short", data[..data.len() - 1].to_vec()),
            ("half", data[..data.len() / 2].to_vec()),
            ("one byte more", longer),
            ("magic", flip(0)),
            ("version", set(4, 2)),
            ("weights identity", flip(8)),
            ("K/V type", set(24, KvType::Q8_0.code())),
            ("layers", set(28, 3)),
            ("kv_dim", set(32, 64)),
            ("head_dim", set(36, 16)),
            ("unknown flag", set(40, 3)),
            ("cell count", set(44, 11)),
            ("positions not increasing", swapped),
            ("negative position", set(HEADER + 4 * 9, u32::MAX)),
            (
                "token out of vocabulary",
                set(HEADER + 4 * 10 + 4 * 3, VOCAB as u32),
            ),
        ];
        for (what, d) in cases {
            let before = snapshot(&b);
            let e = b.seq_state_write(3, &d, VOCAB).unwrap_err();
            assert!(matches!(e, Error::InvalidInput(_)), "{what}: {e}");
            assert_eq!(snapshot(&b), before, "{what}: nothing changed");
        }
        let before = snapshot(&b);
        assert!(b.seq_state_write(1, &data, VOCAB).is_err(), "not empty");
        assert!(b.seq_state_write(-1, &data, VOCAB).is_err(), "negative id");
        assert!(b.seq_state_write(3, &data, 100).is_err(), "vocabulary");
        assert_eq!(snapshot(&b), before);
        // Other weights, another K/V type: rejected.
        let other = cache(&memory(KvType::F16, 16, 12)).seq_state_write(0, &data, VOCAB);
        assert!(format!("{}", other.unwrap_err()).contains("another model"));
        let q8 = cache(&memory(KvType::Q8_0, 16, 11)).seq_state_write(0, &data, VOCAB);
        assert!(format!("{}", q8.unwrap_err()).contains("K/V type code"));
        // No room: KvCacheFull, nothing changed (a pool of 3 blocks with one held, and a
        // context whose token limit is below the state's cells).
        let mc = memory(KvType::F16, 3, 11);
        let mut c = cache(&mc);
        decode(&mut c, 0, &[1, 2], 0);
        let before = snapshot(&c);
        let e = c.seq_state_write(1, &data, VOCAB).unwrap_err();
        assert!(matches!(e, Error::KvCacheFull(_)), "{e}");
        assert_eq!(snapshot(&c), before);
        let mut d = PagedCache::new(Arc::clone(&mb), 9).unwrap();
        let e = d.seq_state_write(0, &data, VOCAB).unwrap_err();
        assert!(matches!(e, Error::KvCacheFull(_)), "{e}");
        assert!(d.table().cells(0).is_empty());
        // The good state still loads after all that.
        assert_eq!(b.seq_state_write(3, &data, VOCAB).unwrap(), 10);
        assert_eq!(dump(&b, 3), dump(&a, 0));
        b.table().check().unwrap();
    }

    #[test]
    fn unreadable_sequences_are_errors() {
        let m = memory(KvType::F16, 16, 1);
        let mut c = cache(&m);
        assert!(c.seq_state_read(-1).is_err());
        decode(&mut c, 0, &[1, 2, 3], 0);
        decode(&mut c, 1, &[4, 5, 6], 0);
        c.table_mut().seq_cp(0, 2, -1, -1).unwrap();
        c.table_mut().seq_cp(1, 2, -1, -1).unwrap();
        let e = c.seq_state_read(2).unwrap_err();
        assert!(format!("{e}").contains("two cells at position 0"), "{e}");
    }
}
