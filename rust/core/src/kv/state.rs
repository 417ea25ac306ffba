//! Sequence state: the cells of one sequence — positions, token ids and the K/V rows of every
//! layer exactly as stored (f16, q8_0 or f32 bytes) — as bytes, and those bytes written back into
//! an empty sequence without recomputation. The role of llama.cpp's
//! `llama_state_seq_get_data`/`llama_state_seq_set_data`, in kvserve's own format.
//!
//! Two versions share the magic `KVSQ`: **version 1** holds the cells of one K/V memory (one
//! layer group); it is the whole state of a model with one K/V group (as it always was). A model
//! with several K/V groups (Gemma 3's sliding-window and global layers: [`LayerGroups`]) writes
//! **version 2**, a container of one version-1 *section* per group, each holding the cells that
//! group holds for the sequence: all positions for a full-attention group, only its window (what
//! it kept after pruning) for a window group.
//!
//! Why a container of per-group sections rather than one new per-cell format: a group is a
//! memory of its own (its pool, its layers, its identity, see `Model::kv_memory`), and a window
//! group has no K/V at all for the positions it dropped, so there is no "cell of every layer"
//! to write for them. A section is exactly what one group holds, read and validated by the same
//! code as a one-group state against that group's memory (its identity covers the weights, the
//! group's kind and layers); the container only says which groups there are and where each
//! section is. One-group models keep writing and reading version 1 byte for byte, so their
//! existing states and session files still load. An older build that reads a version-2 state
//! says "format version 2" instead of misreading it.
//!
//! # Version 1: the cells of one group (little-endian)
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 4 | magic `KVSQ` |
//! | 4 | 4 | format version (`1`) |
//! | 8 | 16 | weights identity of the memory (`SharedKv::weights_id`: for a one-group model `model::model_identity`, u128; for a group of a several-group model the group's own id, which also covers its kind and layers) |
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
//! `row` is the type's row size for `kv_dim` values. The length must match exactly.
//!
//! # Version 2: layer groups (little-endian)
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 4 | magic `KVSQ` |
//! | 4 | 4 | format version (`2`) |
//! | 8 | 16 | weights identity of the model (`model::model_identity`, u128) |
//! | 24 | 4 | `g`: K/V groups |
//! | 28 | 20g | per group, in the model's group order: kind (u32: 0 full, 1 window), window (u32, positions; 0 for full), layers (u32), section length in bytes (u64) |
//! | 28+20g | ... | the `g` sections in the same order, each a version-1 state of that group |
//!
//! The lengths must add up exactly. Neither version carries a checksum: whoever stores the bytes
//! (kvserve's session files) adds one. A hybrid model's state appends its recurrent part after
//! either version (`model::Context::seq_state_read`).
//!
//! # Rules
//!
//! - **Read** (`seq_state_read`): pending copy-on-write copies and K-shifts are applied first,
//!   so every K row is rotated for its cell's position. Cells are written in position order; a
//!   sequence with two cells at one position cannot be written (`InvalidInput`). An unknown or
//!   empty sequence gives a state of 0 cells (in every section).
//! - **Write** (`seq_state_write`) goes into an *empty* sequence (in every group) and is one
//!   batch transaction across all groups: the whole input is validated first (magic, version,
//!   weights identity, the groups' kinds, windows and layers, each section's K/V type and shape,
//!   flags, exact lengths, increasing non-negative positions, token ids in the vocabulary, and
//!   that every cell a non-primary group holds is a cell of the primary group with the same
//!   token); then the cells are planned like a decode batch in every group (all or nothing:
//!   `KvCacheFull` if a pool or the context limit cannot hold them, and every group is rolled
//!   back), the rows are copied into their slots, and only then is every group committed: full
//!   blocks of a clean state (positions `0, 1, 2, ...`) get their content keys and enter the
//!   prefix index, exactly as if the tokens had been decoded. A state read from a sequence that
//!   was not clean marks the new sequence not clean, so none of its blocks is ever keyed. On any
//!   error nothing changed in any group.
//! - A window group's cells are written at their positions, from its first held position on,
//!   and that first cell goes to slot `pos mod block_size` of its block (as in a sequence
//!   decoded from position 0 and then pruned), so attention walks the same block layout and a
//!   restored sequence continues bit for bit as the original. (The planner starts a sequence at
//!   slot 0, so the write plans filler cells before it in the same block and removes them after
//!   the commit; when they would start at position 0 the sequence is marked not clean first, so
//!   they are never keyed.) A window sequence that does not start at position 0 gets no content
//!   keys, as a pruned one never does.
//! - **Check** (`seq_state_check`) runs the write's validation (the same parser) without writing
//!   anything, and then checks the cells against the tokens the sequence must hold: the
//!   primary group's cells are those tokens at positions `0..n`, another full group holds the
//!   same cells, and a window group of `w` holds a run ending at `n - 1` from at most
//!   `max(0, n - w + 1)` (what the next token sees). A session's state is checked so before it
//!   is loaded; a state that passes is written as the sequence of those tokens.
//! - Writing trusts that the rows are the K/V of those tokens under those weights (as loading
//!   a model trusts its file): the identity checks reject other models, layouts and formats,
//!   and the container's checksum rejects damage.

use std::sync::Arc;

use super::cache::PagedCache;
use super::memory::{GroupKind, LayerGroups};
use super::prefix::Key;
use super::table::{BatchTx, Pos, SeqId};
use crate::batch::Batch;
use crate::error::{Error, Result};

/// First bytes of a sequence state.
pub const STATE_MAGIC: [u8; 4] = *b"KVSQ";
/// Version of the one-group format (the cells of one K/V memory).
pub const STATE_VERSION: u32 = 1;
/// Version of the layer-group container (one version-1 section per K/V group).
pub const GROUPS_VERSION: u32 = 2;
const HEADER: usize = 48;
const GROUPS_HEADER: usize = 28;
const GROUP_ENTRY: usize = 20;
const FLAG_CLEAN: u32 = 1;

fn bad(msg: impl Into<String>) -> Error {
    Error::InvalidInput(format!("sequence state: {}", msg.into()))
}

fn u32_at(d: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(d[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(d: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(d[at..at + 8].try_into().expect("8 bytes"))
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

/// A state's cells planned and written into one group's cache, not yet committed.
#[must_use = "a staged state must be committed or rolled back"]
struct Staged {
    tx: BatchTx,
    seq: SeqId,
    /// Filler cells planned at `[fill.0, fill.1)` before the first real cell (window groups).
    fill: Option<(Pos, Pos)>,
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

    /// Checks `data` (a version-1 state) against this memory (see the module docs) without
    /// changing anything.
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
        if version == GROUPS_VERSION {
            return Err(bad(
                "a state of a model with several K/V layer groups (format version 2); this \
                 memory is one group (another model or layout)",
            ));
        }
        if version != STATE_VERSION {
            return Err(bad(format!(
                "format version {version}, this build reads versions {STATE_VERSION} and \
                 {GROUPS_VERSION}"
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

    /// `InvalidInput` unless `seq >= 0` has no cells here.
    fn check_empty(&self, seq: SeqId) -> Result<()> {
        if seq < 0 {
            return Err(bad(format!("needs a sequence id >= 0, got {seq}")));
        }
        if self.table().seq_pos_max(seq) >= 0 {
            return Err(bad(format!(
                "sequence {seq} is not empty; a state is written into an empty sequence"
            )));
        }
        Ok(())
    }

    /// Plans the cells of `st` into the empty sequence `seq` as one batch and copies their
    /// rows into their slots, without committing (`None` for 0 cells). With `align`, the first
    /// cell goes to slot `pos mod block_size` (filler cells before it, removed at commit).
    /// `KvCacheFull` (nothing changed) when the cells do not fit.
    fn stage_state(&mut self, seq: SeqId, st: &Parsed, align: bool) -> Result<Option<Staged>> {
        let n = st.positions.len();
        if n == 0 {
            return Ok(None);
        }
        let first = st.positions[0];
        let n_fill = if align {
            first as usize % self.table().block_size()
        } else {
            0
        };
        let base = first - n_fill as Pos;
        let mut batch = Batch {
            tokens: Vec::with_capacity(n_fill + n),
            positions: (base..first).collect(),
            seq_ids: vec![seq; n_fill + n],
            logits: vec![false; n_fill + n],
        };
        // Fillers carry a valid token id; their rows are never read (removed before any use).
        batch.tokens.resize(n_fill, st.tokens[0]);
        batch.tokens.extend_from_slice(&st.tokens);
        batch.positions.extend_from_slice(&st.positions);
        let shared = Arc::clone(self.shared());
        let mut storage = shared.lock_storage();
        let (slots, tx) = self.begin_batch(&batch, &mut storage)?;
        if !st.clean || (n_fill > 0 && base == 0) {
            // Before the commit: nothing of this sequence is ever keyed (nor are fillers that
            // would look like a run from position 0).
            self.table_mut().taint(seq);
        }
        let mut written = Ok(());
        'rows: for layer in 0..shared.layout().n_layers {
            for v in [false, true] {
                for (i, &(b, sl)) in slots[n_fill..].iter().enumerate() {
                    written = storage.write_row_raw(layer, b, sl as usize, v, st.row(layer, v, i));
                    if written.is_err() {
                        break 'rows;
                    }
                }
            }
        }
        drop(storage);
        match written {
            Ok(()) => Ok(Some(Staged {
                tx,
                seq,
                fill: (n_fill > 0).then_some((base, first)),
            })),
            Err(e) => {
                self.rollback(tx);
                Err(e)
            }
        }
    }

    /// Commits a staged state (its full clean blocks get their keys) and drops its fillers.
    fn commit_staged(&mut self, s: Staged) {
        self.commit(s.tx);
        if let Some((p0, p1)) = s.fill {
            self.table_mut().seq_rm(s.seq, p0, p1);
        }
    }

    /// Writes a state (from [`PagedCache::seq_state_read`], possibly of another context or
    /// process) into the empty sequence `seq`; returns its cell count. Token ids must be below
    /// `n_vocab`. All or nothing (see the module docs): `InvalidInput` for a bad state or a
    /// non-empty `seq`, `KvCacheFull` when the cells do not fit.
    pub fn seq_state_write(&mut self, seq: SeqId, data: &[u8], n_vocab: usize) -> Result<usize> {
        self.check_empty(seq)?;
        let st = self.parse_state(data, n_vocab)?;
        let n = st.positions.len();
        if let Some(s) = self.stage_state(seq, &st, false)? {
            self.commit_staged(s);
        }
        Ok(n)
    }
}

/// A sequence state validated and written into every K/V group of a [`LayerGroups`], not yet
/// committed: [`LayerGroups::seq_state_commit`] or [`LayerGroups::seq_state_rollback`] it.
#[must_use = "a staged state must be committed or rolled back"]
pub struct StagedState {
    groups: Vec<Option<Staged>>,
    n: usize,
}

/// Kind code and window of a group in the version-2 container.
fn kind_code(kind: GroupKind) -> (u32, u32) {
    match kind {
        GroupKind::Full => (0, 0),
        GroupKind::Window(w) => (1, w.min(u32::MAX as usize) as u32),
        GroupKind::Recurrent => (2, 0),
    }
}

fn kind_name(code: u32, window: u32) -> String {
    match code {
        0 => "full".into(),
        1 => format!("window {window}"),
        c => format!("kind {c}"),
    }
}

impl LayerGroups {
    /// The K/V state of `seq` (see the module docs): version 1 for a model with one K/V
    /// group, else the version-2 container of every group's cells; `weights_id` is the model's
    /// identity (`model::model_identity`). The recurrent group is not part of it.
    pub fn seq_state_read(&mut self, seq: SeqId, weights_id: Key) -> Result<Vec<u8>> {
        if self.groups().len() == 1 {
            return self.groups_mut()[0].cache.seq_state_read(seq);
        }
        let mut sections = Vec::with_capacity(self.groups().len());
        for g in self.groups_mut() {
            sections.push(g.cache.seq_state_read(seq)?);
        }
        let g = self.groups().len();
        let size = GROUPS_HEADER + GROUP_ENTRY * g + sections.iter().map(Vec::len).sum::<usize>();
        let mut out = Vec::new();
        out.try_reserve_exact(size).map_err(|_| {
            Error::OutOfMemory(format!("cannot allocate {size} bytes of sequence state"))
        })?;
        out.extend_from_slice(&STATE_MAGIC);
        out.extend_from_slice(&GROUPS_VERSION.to_le_bytes());
        out.extend_from_slice(&weights_id.to_le_bytes());
        out.extend_from_slice(&(g as u32).to_le_bytes());
        for (grp, sec) in self.groups().iter().zip(&sections) {
            let (code, window) = kind_code(grp.kind);
            for w in [code, window, grp.layers.len() as u32] {
                out.extend_from_slice(&w.to_le_bytes());
            }
            out.extend_from_slice(&(sec.len() as u64).to_le_bytes());
        }
        for sec in &sections {
            out.extend_from_slice(sec);
        }
        debug_assert_eq!(out.len(), size);
        Ok(out)
    }

    /// Splits a version-2 container into its sections after checking it against these groups
    /// (identity, group count, kinds, windows, layers, lengths).
    fn split_groups<'a>(&self, data: &'a [u8], weights_id: Key) -> Result<Vec<&'a [u8]>> {
        let groups = self.groups();
        let g = groups.len();
        if data.len() >= 8 && data[..4] == STATE_MAGIC && u32_at(data, 4) == STATE_VERSION {
            return Err(bad(format!(
                "a state of a model with one K/V group (format version 1); this model has {g} \
                 layer groups (another model or layout)"
            )));
        }
        if data.len() < GROUPS_HEADER {
            return Err(bad(format!(
                "{} bytes is shorter than the {GROUPS_HEADER}-byte header (truncated?)",
                data.len()
            )));
        }
        if data[..4] != STATE_MAGIC {
            return Err(bad("wrong magic (not a kvserve sequence state)"));
        }
        let version = u32_at(data, 4);
        if version != GROUPS_VERSION {
            return Err(bad(format!(
                "format version {version}, this build reads versions {STATE_VERSION} and \
                 {GROUPS_VERSION}"
            )));
        }
        let id = u128::from_le_bytes(data[8..24].try_into().expect("16 bytes"));
        if id != weights_id {
            return Err(bad(format!(
                "made by another model (weights identity {id:032x}, this model's is \
                 {weights_id:032x})"
            )));
        }
        let got_g = u32_at(data, 24) as usize;
        let mine: Vec<String> = groups
            .iter()
            .map(|x| {
                let (c, w) = kind_code(x.kind);
                format!("{} ({} layers)", kind_name(c, w), x.layers.len())
            })
            .collect();
        if got_g != g {
            return Err(bad(format!(
                "{got_g} K/V layer groups, this model has {g}: {} (another layout)",
                mine.join(", ")
            )));
        }
        let table = GROUPS_HEADER + GROUP_ENTRY * g;
        if data.len() < table {
            return Err(bad(format!(
                "{} bytes is shorter than the {table}-byte group table (truncated?)",
                data.len()
            )));
        }
        let mut at = table;
        let mut sections = Vec::with_capacity(g);
        for (i, grp) in groups.iter().enumerate() {
            let e = GROUPS_HEADER + GROUP_ENTRY * i;
            let (code, window, layers) =
                (u32_at(data, e), u32_at(data, e + 4), u32_at(data, e + 8));
            let (want_code, want_window) = kind_code(grp.kind);
            if (code, window, layers as usize) != (want_code, want_window, grp.layers.len()) {
                return Err(bad(format!(
                    "group {i} is {} ({layers} layers), this model's is {} (another layout)",
                    kind_name(code, window),
                    mine[i]
                )));
            }
            let len = u64_at(data, e + 12);
            let end = usize::try_from(len)
                .ok()
                .and_then(|l| at.checked_add(l))
                .filter(|&end| end <= data.len())
                .ok_or_else(|| {
                    bad(format!(
                        "group {i}'s section of {len} bytes runs past the end of the {} bytes \
                         (truncated or corrupt)",
                        data.len()
                    ))
                })?;
            sections.push(&data[at..end]);
            at = end;
        }
        if at != data.len() {
            return Err(bad(format!(
                "{} bytes, but the groups' sections end at {at} (corrupt)",
                data.len()
            )));
        }
        Ok(sections)
    }

    /// Splits and validates `data` (a K/V state from [`LayerGroups::seq_state_read`]) against
    /// these groups without changing anything: the container (identity, group count, kinds,
    /// windows, layers, lengths), every group's section ([`PagedCache::parse_state`]: header,
    /// exact length, increasing positions, tokens in the vocabulary), and that every cell of a
    /// non-primary group is a cell of the primary group with the same token. One parser for
    /// [`LayerGroups::seq_state_stage`] and [`LayerGroups::seq_state_check`].
    fn parse_groups<'a>(
        &self,
        data: &'a [u8],
        n_vocab: usize,
        weights_id: Key,
    ) -> Result<Vec<Parsed<'a>>> {
        let g = self.groups().len();
        let sections = if g == 1 {
            vec![data]
        } else {
            self.split_groups(data, weights_id)?
        };
        let mut parsed = Vec::with_capacity(g);
        for (i, (grp, sec)) in self.groups().iter().zip(&sections).enumerate() {
            let p = grp.cache.parse_state(sec, n_vocab);
            parsed.push(p.map_err(|e| match e {
                Error::InvalidInput(m) if g > 1 => Error::InvalidInput(format!("group {i}: {m}")),
                e => e,
            })?);
        }
        // Every cell of another group is a cell of the primary group, with the same token.
        let pi = self.primary_index();
        let primary = &parsed[pi];
        for (i, p) in parsed.iter().enumerate().filter(|&(i, _)| i != pi) {
            for (&pos, &tok) in p.positions.iter().zip(&p.tokens) {
                match primary.positions.binary_search(&pos) {
                    Ok(j) if primary.tokens[j] == tok => {}
                    Ok(j) => {
                        return Err(bad(format!(
                            "group {i} holds token {tok} at position {pos}, group {pi} token {} \
                             (corrupt)",
                            primary.tokens[j]
                        )))
                    }
                    Err(_) => {
                        return Err(bad(format!(
                            "group {i} holds position {pos}, which group {pi} does not (corrupt)"
                        )))
                    }
                }
            }
        }
        Ok(parsed)
    }

    /// Checks, without writing anything, that `data` (a K/V state from
    /// [`LayerGroups::seq_state_read`]; a hybrid model's recurrent part already split off) is a
    /// state of this model and K/V format (`LayerGroups::parse_groups`: every length exact,
    /// every header field in range, every group consistent with the primary) that holds exactly
    /// `tokens`: the primary group's cells are positions `0..n` holding `tokens` (`n =
    /// tokens.len()`), another full-attention group holds the same cells, and a window group of
    /// `w` positions holds a run of positions ending at `n - 1` that covers what the next token
    /// sees (`max(0, n - w + 1) .. n`). Returns `n`; any mismatch is `InvalidInput`. A state
    /// that passes is written by [`LayerGroups::seq_state_write`] (given room) as the sequence
    /// of `tokens`.
    pub fn seq_state_check(
        &self,
        data: &[u8],
        n_vocab: usize,
        weights_id: Key,
        tokens: &[u32],
    ) -> Result<usize> {
        let parsed = self.parse_groups(data, n_vocab, weights_id)?;
        let n = tokens.len();
        let pi = self.primary_index();
        let several = self.groups().len() > 1;
        let group = |i: usize| {
            if several {
                format!("group {i}: ")
            } else {
                String::new()
            }
        };
        let p = &parsed[pi];
        if p.positions.len() != n {
            return Err(bad(format!(
                "{}{} cells, but the sequence has {n} tokens",
                group(pi),
                p.positions.len()
            )));
        }
        if let Some(i) = (0..n).find(|&i| p.positions[i] != i as Pos) {
            return Err(bad(format!(
                "{}cell {i} is at position {}, expected {i} (a sequence's tokens are at \
                 positions 0..{n})",
                group(pi),
                p.positions[i]
            )));
        }
        if let Some(i) = (0..n).find(|&i| p.tokens[i] != tokens[i]) {
            return Err(bad(format!(
                "{}position {i} holds token {}, the sequence's token there is {}",
                group(pi),
                p.tokens[i],
                tokens[i]
            )));
        }
        // The other groups' cells are the primary's (parse_groups): each must hold what its
        // layers need of them.
        for (i, (grp, q)) in self.groups().iter().zip(&parsed).enumerate() {
            let need = match grp.kind {
                _ if i == pi => continue,
                GroupKind::Full | GroupKind::Recurrent => 0,
                GroupKind::Window(w) => (n + 1).saturating_sub(w.max(1)),
            };
            // Increasing positions within 0..n: `first + m == n` makes them the run first..n.
            let m = q.positions.len();
            let first = q.positions.first().map_or(n, |&x| x as usize);
            if first + m != n || first > need {
                return Err(bad(format!(
                    "{}holds {m} cells from position {first}, but must hold every position \
                     from {need} to {} (corrupt)",
                    group(i),
                    n as i64 - 1
                )));
            }
        }
        Ok(n)
    }

    /// Validates `data` (a state from [`LayerGroups::seq_state_read`] of this model, any context
    /// or process) completely and writes its cells into the empty sequence `seq` of every
    /// group, without committing: nothing of it is visible to the prefix index yet. `InvalidInput`
    /// for a bad state or a non-empty `seq`, `KvCacheFull` when some group cannot hold its
    /// cells; on error nothing changed in any group.
    pub fn seq_state_stage(
        &mut self,
        seq: SeqId,
        data: &[u8],
        n_vocab: usize,
        weights_id: Key,
    ) -> Result<StagedState> {
        for g in self.groups() {
            g.cache.check_empty(seq)?;
        }
        let g = self.groups().len();
        let parsed = self.parse_groups(data, n_vocab, weights_id)?;
        let pi = self.primary_index();
        let n = parsed[pi].positions.len();
        let mut staged = Vec::with_capacity(g);
        for (grp, p) in self.groups_mut().iter_mut().zip(&parsed) {
            let align = matches!(grp.kind, GroupKind::Window(_));
            match grp.cache.stage_state(seq, p, align) {
                Ok(s) => staged.push(s),
                Err(e) => {
                    self.seq_state_rollback(StagedState { groups: staged, n });
                    return Err(e);
                }
            }
        }
        Ok(StagedState { groups: staged, n })
    }

    /// Commits a staged state in every group; returns the primary group's cell count (the
    /// sequence's tokens).
    pub fn seq_state_commit(&mut self, s: StagedState) -> usize {
        for (grp, st) in self.groups_mut().iter_mut().zip(s.groups) {
            if let Some(st) = st {
                grp.cache.commit_staged(st);
            }
        }
        s.n
    }

    /// Undoes a staged state in every group: each holds what it held before.
    pub fn seq_state_rollback(&mut self, s: StagedState) {
        for (grp, st) in self.groups_mut().iter_mut().zip(s.groups) {
            if let Some(st) = st {
                grp.cache.rollback(st.tx);
            }
        }
    }

    /// [`LayerGroups::seq_state_stage`] and commit: writes a state into the empty sequence
    /// `seq` of every group, all or nothing; returns the number of the sequence's cells.
    pub fn seq_state_write(
        &mut self,
        seq: SeqId,
        data: &[u8],
        n_vocab: usize,
        weights_id: Key,
    ) -> Result<usize> {
        let s = self.seq_state_stage(seq, data, n_vocab, weights_id)?;
        Ok(self.seq_state_commit(s))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// `data` with the little-endian u32 at `at` set to `v` (a corrupted state, for tests).
    fn with_u32(data: &[u8], at: usize, v: u32) -> Vec<u8> {
        let mut d = data.to_vec();
        d[at..at + 4].copy_from_slice(&v.to_le_bytes());
        d
    }

    /// `data` with the lowest bit of byte `at` flipped.
    fn with_bit_flipped(data: &[u8], at: usize) -> Vec<u8> {
        let mut d = data.to_vec();
        d[at] ^= 1;
        d
    }
    use crate::kv::memory::Memory;
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
        let set = |at: usize, v: u32| with_u32(&data, at, v);
        let flip = |at: usize| with_bit_flipped(&data, at);
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

    // --- several layer groups (a window group and a full group, as Gemma 3) ---

    const WIN: usize = 6;
    const MODEL: Key = 0x5eed;

    /// Layers 0 and 2 in a window group of `WIN` positions, 1 and 3 in a full group (the
    /// window group first, as Gemma 3's layer 0 is local); pools of `n_win` and `n_full` blocks.
    fn groups(n_win: usize, n_full: usize) -> LayerGroups {
        use crate::kv::memory::Group;
        let group = |kind, layers: Vec<usize>, m: Arc<SharedKv>| Group {
            kind,
            layers,
            cache: cache(&m),
        };
        LayerGroups::new(
            vec![
                group(
                    GroupKind::Window(WIN),
                    vec![0, 2],
                    memory(KvType::F16, n_win, 21),
                ),
                group(GroupKind::Full, vec![1, 3], memory(KvType::F16, n_full, 22)),
            ],
            None,
        )
        .unwrap()
    }

    /// [`decode`] in every group (K/V from [`value`] of the model layer), then the windows are
    /// pruned, as `Context::decode` does.
    fn decode_groups(m: &mut LayerGroups, seq: SeqId, tokens: &[u32], pos0: Pos) {
        let b = Batch::prompt(tokens, pos0, seq);
        let mut txs = Vec::new();
        for g in m.groups_mut() {
            let shared = Arc::clone(g.cache.shared());
            let mut st = shared.lock_storage();
            let (slots, tx) = g.cache.begin_batch(&b, &mut st).unwrap();
            for (i, &layer) in g.layers.iter().enumerate() {
                let kv = |w: usize| -> Vec<f32> {
                    (0..tokens.len() * D)
                        .map(|x| value(tokens[x / D], pos0 + (x / D) as Pos, layer, x % D, w))
                        .collect()
                };
                PagedCache::write(&mut st, i, &slots, &kv(0), &kv(1));
            }
            txs.push(tx);
        }
        for (g, tx) in m.groups_mut().iter_mut().zip(txs) {
            g.cache.commit(tx);
        }
        m.prune_windows(&[seq]);
        for g in m.groups() {
            g.cache.table().check().unwrap();
        }
    }

    fn snapshot_groups(m: &LayerGroups) -> Vec<impl PartialEq + std::fmt::Debug> {
        m.groups().iter().map(|g| snapshot(&g.cache)).collect()
    }

    /// Positions per slot of `seq`'s blocks in a group (the attention layout; block ids aside).
    fn layout_of(m: &mut LayerGroups, gi: usize, seq: SeqId) -> Vec<i32> {
        m.groups_mut()[gi].cache.view(seq).positions
    }

    /// A pruned sequence's state holds each group's cells (the window group only its window),
    /// writes back into another memory with the same cells, rows and slot layout, re-reads
    /// byte for byte, is keyed in the full group as a decode would be and not in the window
    /// group, and goes on exactly like the original.
    #[test]
    fn layer_group_state_roundtrips_and_continues_like_the_original() {
        let (mut a, mut b) = (groups(16, 16), groups(16, 16));
        let t = tokens(23, 8);
        decode_groups(&mut a, 0, &t[..10], 0);
        decode_groups(&mut a, 0, &t[10..17], 10);
        decode_groups(&mut a, 0, &t[17..], 17);
        assert_eq!(
            dump(&a.groups()[0].cache, 0)[0].0,
            17,
            "the window was pruned"
        );
        decode_groups(&mut b, 1, &tokens(9, 300), 0); // b is not empty
        let data = a.seq_state_read(0, MODEL).unwrap();
        assert_eq!(u32_at(&data, 4), GROUPS_VERSION);
        assert_eq!(u32_at(&data, 24), 2);
        let win_len = u64_at(&data, GROUPS_HEADER + 12) as usize;
        let full_len = u64_at(&data, GROUPS_HEADER + GROUP_ENTRY + 12) as usize;
        let row = KvType::F16.row_bytes(D);
        assert_eq!(win_len, HEADER + 8 * WIN + 2 * LAYERS * WIN * row);
        assert_eq!(full_len, HEADER + 8 * 23 + 2 * LAYERS * 23 * row);
        assert_eq!(
            data.len(),
            GROUPS_HEADER + 2 * GROUP_ENTRY + win_len + full_len
        );

        assert_eq!(b.seq_state_write(5, &data, VOCAB, MODEL).unwrap(), 23);
        for gi in 0..2 {
            let (ga, gb) = (&a.groups()[gi].cache, &b.groups()[gi].cache);
            assert_eq!(dump(gb, 5), dump(ga, 0), "group {gi}: cells, tokens, rows");
            gb.table().check().unwrap();
            assert_eq!(
                layout_of(&mut b, gi, 5),
                layout_of(&mut a, gi, 0),
                "group {gi}"
            );
        }
        assert_eq!(b.seq_state_read(5, MODEL).unwrap(), data, "byte-identical");
        let (full_a, full_b) = (&a.groups()[1].cache, &b.groups()[1].cache);
        assert_eq!(
            keys(full_b, 5),
            keys(full_a, 0),
            "the full group keyed as a decode"
        );
        assert!(keys(full_b, 5)[..5].iter().all(|&k| k != NO_KEY));
        assert!(keys(&b.groups()[0].cache, 5).iter().all(|&k| k == NO_KEY));
        for extra in [&[5u32, 6, 7][..], &[8], &[9, 10, 11, 12, 13]] {
            let p = a.seq_pos_max(0) + 1;
            decode_groups(&mut a, 0, extra, p);
            decode_groups(&mut b, 5, extra, p);
            for gi in 0..2 {
                let (ga, gb) = (&a.groups()[gi].cache, &b.groups()[gi].cache);
                assert_eq!(dump(gb, 5), dump(ga, 0), "group {gi} after more tokens");
                assert_eq!(layout_of(&mut b, gi, 5), layout_of(&mut a, gi, 0));
            }
        }
        // An empty sequence: empty sections, and writing them adds nothing.
        let empty = a.seq_state_read(7, MODEL).unwrap();
        assert_eq!(empty.len(), GROUPS_HEADER + 2 * GROUP_ENTRY + 2 * HEADER);
        let before = snapshot_groups(&b);
        assert_eq!(b.seq_state_write(6, &empty, VOCAB, MODEL).unwrap(), 0);
        assert_eq!(snapshot_groups(&b), before);
    }

    /// A window that starts inside the first block (positions 1..): the filler cell before it
    /// sits at position 0, so without care block 0 would look like a clean run from 0 and be
    /// keyed with a token that was never there. The window group keys nothing.
    #[test]
    fn window_fillers_at_position_zero_are_never_keyed() {
        let (mut a, mut b) = (groups(16, 16), groups(16, 16));
        let t = tokens(WIN + 1, 12);
        decode_groups(&mut a, 0, &t, 0);
        assert_eq!(dump(&a.groups()[0].cache, 0)[0].0, 1);
        let data = a.seq_state_read(0, MODEL).unwrap();
        b.seq_state_write(0, &data, VOCAB, MODEL).unwrap();
        let win_b = &b.groups()[0].cache;
        assert_eq!(dump(win_b, 0), dump(&a.groups()[0].cache, 0));
        assert_eq!(win_b.shared().prefix_stats().indexed, 0);
        assert!(keys(win_b, 0).iter().all(|&k| k == NO_KEY));
        assert_eq!(layout_of(&mut b, 0, 0), layout_of(&mut a, 0, 0));
        decode_groups(&mut b, 0, &tokens(9, 70), WIN as Pos + 1);
        assert_eq!(b.groups()[0].cache.shared().prefix_stats().indexed, 0);
    }

    #[test]
    fn bad_layer_group_states_change_no_group() {
        let mut a = groups(16, 16);
        let t = tokens(19, 2);
        decode_groups(&mut a, 0, &t[..9], 0);
        decode_groups(&mut a, 0, &t[9..], 9);
        let data = a.seq_state_read(0, MODEL).unwrap();
        let win = GROUPS_HEADER + 2 * GROUP_ENTRY; // the window section
        let win_len = u64_at(&data, GROUPS_HEADER + 12) as usize;
        let full = win + win_len; // the full section
        let mut b = groups(16, 16);
        decode_groups(&mut b, 1, &tokens(9, 70), 0);
        decode_groups(&mut b, 2, &tokens(8, 90), 0);
        b.seq_rm(2, -1, -1).unwrap(); // cached blocks
        let set = |at: usize, v: u32| with_u32(&data, at, v);
        let flip = |at: usize| with_bit_flipped(&data, at);
        let mut longer = data.clone();
        longer.push(0);
        // The window section one byte shorter and the full one one byte longer.
        let mut boundary = set(GROUPS_HEADER + 12, win_len as u32 - 1);
        let full_len = u64_at(&data, GROUPS_HEADER + GROUP_ENTRY + 12) as u32;
        boundary[GROUPS_HEADER + GROUP_ENTRY + 12..][..4]
            .copy_from_slice(&(full_len + 1).to_le_bytes());
        let one_group = {
            let mut c = cache(&memory(KvType::F16, 16, 22));
            decode(&mut c, 0, &t, 0);
            c.seq_state_read(0).unwrap()
        };
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("empty", Vec::new(), "shorter than"),
            (
                "header, truncated",
                data[..GROUPS_HEADER - 1].to_vec(),
                "shorter",
            ),
            (
                "group table, truncated",
                data[..win - 1].to_vec(),
                "group table",
            ),
            (
                "one byte short",
                data[..data.len() - 1].to_vec(),
                "runs past the end",
            ),
            ("half", data[..data.len() / 2].to_vec(), "runs past the end"),
            ("one byte more", longer, "sections end at"),
            ("magic", flip(0), "magic"),
            ("version", set(4, 3), "format version 3"),
            ("a one-group state", one_group, "one K/V group"),
            ("weights identity", flip(8), "another model"),
            ("group count", set(24, 3), "3 K/V layer groups"),
            ("group kind", set(GROUPS_HEADER, 0), "another layout"),
            ("window size", set(GROUPS_HEADER + 4, 7), "window 7"),
            (
                "layers",
                set(GROUPS_HEADER + GROUP_ENTRY + 8, 3),
                "3 layers",
            ),
            (
                "section lengths",
                set(GROUPS_HEADER + 12, win_len as u32 - 1),
                "sections end at",
            ),
            ("section boundary", boundary, "group 0: sequence state: 1"),
            (
                "a section's identity",
                flip(win + 8),
                "group 0: sequence state: made by",
            ),
            ("a section's cell count", set(full + 44, 18), "group 1"),
            (
                "token differs between groups",
                set(win + HEADER + 4 * WIN, t[13] + 1),
                "holds token",
            ),
            (
                "a position the full group lacks",
                set(win + HEADER + 4 * (WIN - 1), 30),
                "does not",
            ),
        ];
        for (what, d, why) in cases {
            let before = snapshot_groups(&b);
            let e = b.seq_state_write(3, &d, VOCAB, MODEL).unwrap_err();
            assert!(matches!(e, Error::InvalidInput(_)), "{what}: {e}");
            assert!(e.to_string().contains(why), "{what}: {e}");
            assert_eq!(snapshot_groups(&b), before, "{what}: nothing changed");
        }
        let before = snapshot_groups(&b);
        assert!(
            b.seq_state_write(1, &data, VOCAB, MODEL).is_err(),
            "not empty"
        );
        assert!(
            b.seq_state_write(-1, &data, VOCAB, MODEL).is_err(),
            "negative id"
        );
        assert!(
            b.seq_state_write(3, &data, 100, MODEL).is_err(),
            "vocabulary"
        );
        assert!(
            b.seq_state_write(3, &data, VOCAB, MODEL + 1).is_err(),
            "other model"
        );
        assert_eq!(snapshot_groups(&b), before);
        // A several-group state given to a one-group memory.
        let e = cache(&memory(KvType::F16, 16, 22))
            .seq_state_write(0, &data, VOCAB)
            .unwrap_err();
        assert!(e.to_string().contains("several K/V layer groups"), "{e}");
        // The window group (first) fits, the full group (second) does not: the window
        // group's staged cells are undone too, and nothing was keyed.
        let mut c = groups(16, 4);
        decode_groups(&mut c, 0, &[1, 2], 0);
        let before = snapshot_groups(&c);
        let e = c.seq_state_write(1, &data, VOCAB, MODEL).unwrap_err();
        assert!(matches!(e, Error::KvCacheFull(_)), "{e}");
        assert_eq!(snapshot_groups(&c), before);
        // The good state still loads after all that.
        assert_eq!(b.seq_state_write(3, &data, VOCAB, MODEL).unwrap(), 19);
        for gi in 0..2 {
            assert_eq!(
                dump(&b.groups()[gi].cache, 3),
                dump(&a.groups()[gi].cache, 0)
            );
            b.groups()[gi].cache.table().check().unwrap();
        }
    }

    // --- checking a state against the tokens it must hold (seq_state_check) ---

    /// A one-group memory (layers 0 and 1 in one full-attention group) over `m`.
    fn one(m: Arc<SharedKv>) -> LayerGroups {
        use crate::kv::memory::Group;
        let g = Group {
            kind: GroupKind::Full,
            layers: vec![0, 1],
            cache: cache(&m),
        };
        LayerGroups::new(vec![g], None).unwrap()
    }

    /// Positions and tokens of `seq` in group `gi`, in position order.
    fn cells_of(m: &LayerGroups, gi: usize, seq: SeqId) -> Vec<(Pos, u32)> {
        dump(&m.groups()[gi].cache, seq)
            .into_iter()
            .map(|(p, t, _)| (p, t))
            .collect()
    }

    #[test]
    fn state_check_accepts_exactly_the_sequence_s_tokens() {
        let mut a = one(memory(KvType::F16, 16, 31));
        let t = tokens(10, 5);
        decode_groups(&mut a, 0, &t[..6], 0);
        decode_groups(&mut a, 0, &t[6..], 6);
        let data = a.seq_state_read(0, MODEL).unwrap();
        // Another memory of the same model (the identity is the memory's).
        let b = one(memory(KvType::F16, 16, 31));
        let before = snapshot_groups(&b);
        assert_eq!(b.seq_state_check(&data, VOCAB, MODEL, &t).unwrap(), 10);
        let empty = a.seq_state_read(5, MODEL).unwrap();
        assert_eq!(b.seq_state_check(&empty, VOCAB, MODEL, &[]).unwrap(), 0);
        let set = |at: usize, v: u32| with_u32(&data, at, v);
        let mut longer = data.clone();
        longer.push(0);
        let mut t_more = t.clone();
        t_more.push(1);
        let mut t_other = t.clone();
        t_other[3] += 1;
        // A sequence at positions 1..11: the right tokens, one position off.
        let mut c = one(memory(KvType::F16, 16, 31));
        decode_groups(&mut c, 0, &t, 1);
        let from_one = c.seq_state_read(0, MODEL).unwrap();
        let cases: Vec<(&str, Vec<u8>, &[u32], &str)> = vec![
            (
                "one byte short",
                data[..data.len() - 1].to_vec(),
                &t,
                "truncated",
            ),
            ("one byte more", longer, &t, "truncated or corrupt"),
            ("header only", data[..HEADER].to_vec(), &t, "truncated"),
            (
                "empty state",
                empty.clone(),
                &t,
                "0 cells, but the sequence has 10",
            ),
            (
                "fewer tokens",
                data.clone(),
                &t[..9],
                "10 cells, but the sequence has 9",
            ),
            ("more tokens", data.clone(), &t_more, "the sequence has 11"),
            (
                "another token expected",
                data.clone(),
                &t_other,
                "position 3 holds token",
            ),
            (
                "another token stored",
                set(HEADER + 4 * 10 + 4 * 3, t[3] + 1),
                &t,
                "position 3 holds token",
            ),
            (
                "last position one off",
                set(HEADER + 4 * 9, 10),
                &t,
                "cell 9 is at position 10",
            ),
            ("positions from 1", from_one, &t, "cell 0 is at position 1"),
            ("cell count", set(44, 9), &t, "truncated or corrupt"),
            ("magic", with_bit_flipped(&data, 1), &t, "magic"),
            ("version", set(4, 7), &t, "format version 7"),
            ("unknown flag", set(40, 4), &t, "unknown flags"),
            (
                "token out of vocabulary",
                set(HEADER + 40, VOCAB as u32),
                &t,
                "out of range",
            ),
        ];
        for (what, d, want, why) in cases {
            let e = b.seq_state_check(&d, VOCAB, MODEL, want).unwrap_err();
            assert!(matches!(e, Error::InvalidInput(_)), "{what}: {e}");
            assert!(e.to_string().contains(why), "{what}: {e}");
        }
        // Another model, another K/V type, a state of several groups.
        let other = one(memory(KvType::F16, 16, 32)).seq_state_check(&data, VOCAB, MODEL, &t);
        assert!(other.unwrap_err().to_string().contains("another model"));
        let q8 = one(memory(KvType::Q8_0, 16, 31)).seq_state_check(&data, VOCAB, MODEL, &t);
        assert!(q8.unwrap_err().to_string().contains("K/V type code"));
        let mut g = groups(16, 16);
        decode_groups(&mut g, 0, &t, 0);
        let two = g.seq_state_read(0, MODEL).unwrap();
        let e = b.seq_state_check(&two, VOCAB, MODEL, &t).unwrap_err();
        assert!(e.to_string().contains("several K/V layer groups"), "{e}");
        // Nothing was written, and the state still checks and loads.
        assert_eq!(snapshot_groups(&b), before);
        let mut b = b;
        assert_eq!(b.seq_state_write(2, &data, VOCAB, MODEL).unwrap(), 10);
        assert_eq!(cells_of(&b, 0, 2), cells_of(&a, 0, 0));
    }

    /// With a window group: the window must hold the positions the next token sees (exactly
    /// the boundary), the groups' count and kinds must be this model's, and the window's cells
    /// must be the full group's.
    #[test]
    fn layer_group_state_check_wants_the_window_the_next_token_sees() {
        let t = tokens(19, 8);
        let mut a = groups(16, 16);
        decode_groups(&mut a, 0, &t[..9], 0);
        decode_groups(&mut a, 0, &t[9..], 9);
        // Pruned to 13..19 (W = 6 after the last token 18); the next token (19) sees 14..19.
        assert_eq!(cells_of(&a, 0, 0)[0].0, 13);
        let b = groups(16, 16);
        let data = a.seq_state_read(0, MODEL).unwrap();
        assert_eq!(b.seq_state_check(&data, VOCAB, MODEL, &t).unwrap(), 19);
        assert!(b.seq_state_check(&data, VOCAB, MODEL + 1, &t).is_err());
        let set = |at: usize, v: u32| with_u32(&data, at, v);
        let win = GROUPS_HEADER + 2 * GROUP_ENTRY;
        for (what, d, why) in [
            ("group count", set(24, 1), "1 K/V layer groups"),
            ("group kind", set(GROUPS_HEADER, 0), "another layout"),
            ("window size", set(GROUPS_HEADER + 4, 5), "window 5"),
            (
                "window token",
                set(win + HEADER + 4 * 6, 3),
                "holds token 3",
            ),
        ] {
            let e = b.seq_state_check(&d, VOCAB, MODEL, &t).unwrap_err();
            assert!(e.to_string().contains(why), "{what}: {e}");
        }
        // The window pruned one position too far: seq_state_write takes it, the check does not.
        for (cut, ok) in [(14, true), (15, false)] {
            let mut c = groups(16, 16);
            decode_groups(&mut c, 0, &t, 0);
            c.groups_mut()[0].cache.table_mut().prune_front(0, cut);
            let d = c.seq_state_read(0, MODEL).unwrap();
            let r = b.seq_state_check(&d, VOCAB, MODEL, &t);
            assert_eq!(r.is_ok(), ok, "window from {cut}: {r:?}");
            if let Err(e) = r {
                assert!(e.to_string().contains("from 14 to 18"), "{e}");
            }
            assert_eq!(
                groups(16, 16).seq_state_write(0, &d, VOCAB, MODEL).unwrap(),
                19
            );
        }
        // Shorter than the window: the window group holds every position.
        let mut c = groups(16, 16);
        decode_groups(&mut c, 0, &t[..4], 0);
        let d = c.seq_state_read(0, MODEL).unwrap();
        assert_eq!(b.seq_state_check(&d, VOCAB, MODEL, &t[..4]).unwrap(), 4);
        c.groups_mut()[0].cache.table_mut().prune_front(0, 1);
        let d = c.seq_state_read(0, MODEL).unwrap();
        let e = b.seq_state_check(&d, VOCAB, MODEL, &t[..4]).unwrap_err();
        assert!(e.to_string().contains("from 0 to 3"), "{e}");
    }

    /// Where a one-bit flip of `data` is harmless to the check: the K/V rows (not checkable
    /// without the model) and the clean flag (bit 0 of byte 40) of every version-1 section;
    /// `sections` are the sections' (offset, length).
    fn harmless(sections: &[(usize, usize)], data: &[u8], at: usize, bit: u32) -> bool {
        sections.iter().any(|&(off, len)| {
            let n = u32_at(data, off + 44) as usize;
            (at >= off + HEADER + 8 * n && at < off + len) || (at == off + 40 && bit == 0)
        })
    }

    /// Random corruptions of real states (one group; a window and a full group): every one-bit
    /// flip fails the check exactly where the format leaves nothing to check (a simple model
    /// of the layout says where: `harmless`); any corruption the check passes is written by
    /// `seq_state_write` as the sequence of the expected tokens; none panics.
    #[test]
    fn random_corruptions_fail_the_check_or_load_as_the_tokens() {
        let mut rng = crate::test_rng::Rng(0x5eed_cafe);
        let t = tokens(11, 21);
        let mut one_a = one(memory(KvType::Q8_0, 16, 31));
        decode_groups(&mut one_a, 0, &t, 0);
        let mut two_a = groups(16, 16);
        decode_groups(&mut two_a, 0, &t[..5], 0);
        decode_groups(&mut two_a, 0, &t[5..], 5);
        let cases = [
            (one_a.seq_state_read(0, MODEL).unwrap(), true),
            (two_a.seq_state_read(0, MODEL).unwrap(), false),
        ];
        for (data, is_one) in cases {
            let fresh = || {
                if is_one {
                    one(memory(KvType::Q8_0, 16, 31))
                } else {
                    groups(16, 16)
                }
            };
            let sections: Vec<(usize, usize)> = if is_one {
                vec![(0, data.len())]
            } else {
                let mut at = GROUPS_HEADER + 2 * GROUP_ENTRY;
                (0..2)
                    .map(|i| {
                        let len = u64_at(&data, GROUPS_HEADER + GROUP_ENTRY * i + 12) as usize;
                        at += len;
                        (at - len, len)
                    })
                    .collect()
            };
            let checker = fresh();
            let (mut passed, mut failed) = (0, 0);
            for round in 0..1500 {
                let mut d = data.clone();
                let mut expect_ok = None;
                match round % 5 {
                    0..=2 => {
                        let (at, bit) = (rng.below(d.len()), rng.below(8) as u32);
                        d[at] ^= 1 << bit;
                        expect_ok = Some(harmless(&sections, &data, at, bit));
                    }
                    3 => {
                        // Several random bytes anywhere.
                        for _ in 0..1 + rng.below(4) {
                            let at = rng.below(d.len());
                            d[at] = rng.next() as u8;
                        }
                    }
                    _ => {
                        let n = rng.below(2 * data.len());
                        d.resize(n, rng.next() as u8);
                        expect_ok = (n != data.len()).then_some(false);
                    }
                }
                let r = checker.seq_state_check(&d, VOCAB, MODEL, &t);
                if let Some(ok) = expect_ok {
                    assert_eq!(r.is_ok(), ok, "round {round}: {r:?}");
                }
                match r {
                    Ok(n) => {
                        passed += 1;
                        assert_eq!(n, t.len());
                        let mut b = fresh();
                        assert_eq!(b.seq_state_write(0, &d, VOCAB, MODEL).unwrap(), n);
                        let want: Vec<(Pos, u32)> = (0..n as Pos).zip(t.iter().copied()).collect();
                        let pi = b.primary_index();
                        assert_eq!(cells_of(&b, pi, 0), want, "round {round}");
                        for (gi, g) in b.groups().iter().enumerate() {
                            g.cache.table().check().unwrap();
                            let got = cells_of(&b, gi, 0);
                            assert_eq!(got[..], want[want.len() - got.len()..], "group {gi}");
                        }
                    }
                    Err(e) => {
                        failed += 1;
                        assert!(matches!(e, Error::InvalidInput(_)), "round {round}: {e}");
                    }
                }
            }
            assert!(
                passed > 100 && failed > 100,
                "{passed} passed, {failed} failed"
            );
        }
    }
}
