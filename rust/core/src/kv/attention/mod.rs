//! Attention of one query token over one sequence's KV blocks: all query heads of one GQA group
//! (the heads sharing KV head `kv_head`) against the first `n_kv` cells of a block table.
//!
//! Cell `i` of the sequence lives in block `table[i / block_size]`, slot `i % block_size`. The
//! kernel walks the table block by block with an online softmax: for each block it computes the
//! group's scores (one pass over the block's key segments, each read once for all heads), folds
//! them into a running max and sum per head (rescaling the accumulated output when the max
//! grows), and adds the value segments weighted by `exp(score - max)`. Masked cells get weight
//! exactly 0 and are skipped in the value pass. In the SIMD value pass, when `head_dim` is a
//! multiple of 64 (AVX-512) or 32 (AVX2), each head's output columns stay in registers across
//! the block's rows, so the accumulator is loaded and stored once per block, not once per cell.
//! The AVX-512 kernels take up to 4 heads of the group at once (`head_dim` a multiple of 16, of
//! 32 for Q8_0): each key and value segment is converted to f32 once for all of them, the
//! partial sums of 8 cells' scores are reduced together, and the softmax exponentials of a
//! block are computed 16 at a time (`exp_shift_sum`). The AVX2 kernels (F32/F16 K/V) take 3
//! or 2 heads at once the same way, 4 keys at a time in the score pass; each score and output
//! keeps the one-head kernel's arithmetic and bits. In-process A/B (`attend`, one thread,
//! Zen 3, median of 60 alternating rounds): 1.25-1.54x for Gemma 3's group of 4 heads x 256,
//! 1.01-1.24x for SmolLM2's 3 KV heads of 3 x 64. In a decode step, whose K/V mostly comes
//! from memory, it shows where sequences share blocks (SmolLM2, 4 sequences sharing 1,024
//! cells: 1.04x per step) and is within the noise for one sequence.
//!
//! A prompt's consecutive tokens are taken as a tile ([`attend_tile`], `tile.rs`): 16 (AVX-512)
//! or 8 (AVX2) query rows to a vector, each block's keys and values converted once for all of
//! them, every row's arithmetic (and so its bits) the same as here. `cargo bench --bench kv`'s
//! `prompt_tile` measured it at 2.1x the per-token kernel for 16 tokens at depth 1,024 on
//! AVX-512, 1.5-1.7x on AVX2.
//!
//! The cells are taken in chunks ([`CHUNK_CELLS`]: runs of consecutive blocks that hold a
//! visible cell). Each chunk's softmax state (unnormalized output, max, sum per head) starts
//! empty and the states are folded in chunk order ([`merge_chunks`]). One task can fold every
//! chunk itself ([`attend`]), or the team can compute a deep sequence's chunks in parallel
//! ([`attend_chunk`]) and one task fold them: the arithmetic and its order are the same, so the
//! bits are too. The model splits a decode step's attention this way when it has few
//! sequences (`model::llama::store_and_attend`): one sequence at 4,096 cells is then 16 chunks
//! per KV head over the whole team, not one task per KV head (3 for SmolLM2, 1 for Gemma 3).
//!
//! Measured (release, one AVX-512 core shared with other jobs, so upper bounds): head_dim 64, a
//! GQA group of 3 heads, block size 16, F16: about 24 ns per cell at n_kv 128 (~3 us per token
//! and group; 62-65 ns before the head-group kernels, in the same conditions), 35-45 ns at
//! 1024-4096 where the cache no longer holds the keys and values; versus exact f32 keys/values the
//! output error is ~2e-4 mean / 3e-3 max for F16 and ~5e-3 mean / 8e-2 max for Q8_0 (unit-scale
//! values). `cargo bench -p kvserve-core --bench kv` reprints the speed (rust/core/benches/kv.rs).
//!
//! # Guarantees
//!
//! * The output equals `softmax(scale * q·k) · v` over the visible cells, computed in f32 on the
//!   stored (F32/F16/Q8_0-decoded) values; the result is numerically stable for any score range
//!   (every exponent is `<= 0`). A head with no visible cell gets an all-zero output.
//! * Cost is O(n_kv * head_dim * group) time, independent of the pool size; memory is one
//!   `block_size * group` score buffer and one chunk state in [`Scratch`], reused across calls.
//! * A deep sequence's K/V is read from memory, not the caches. A block's rows hold every KV
//!   head side by side, so one query takes all of a token's KV heads ([`Query::kv_heads`]):
//!   each block is read in one pass, heads in turn, while the next visible block is prefetched
//!   into L2. `cargo bench --bench kv`'s `decode_step_deep` (every layer and KV head of
//!   SmolLM2 at 4,096 cells, 94 MB, one thread) went from 24-26 ms (one KV head per query,
//!   ~55-70 ns per cell and KV head) to 15-20 ms on the AMD EPYC development host; without
//!   the prefetch it is ~20 ms, prefetching into L1 or two blocks ahead is no better. A
//!   pattern-only probe (the same reads, no arithmetic) takes ~19 ms one head at a time and
//!   ~7-8 ms a whole block at a time, against ~5.5 ms for one sequential sweep. The next
//!   block's 192 line requests are issued a share at a time, before each of the block's
//!   kernels: issued together they fill the core's miss buffers and stall it (perf put most
//!   of `run_blocks`' samples on them). That took the bench to 11-14 ms, and SmolLM2's decode
//!   at depth 4,096 to ~1.4x (B = 1) and ~1.6x (B = 4) the previous build.
//! * Kernels: scalar reference plus AVX2 (FMA, F16C `_mm256_cvtph_ps`) and AVX-512
//!   (`_mm512_cvtph_ps`, int8 widening for Q8_0) twins chosen by [`crate::quant::simd::level`]
//!   (`KVSERVE_SIMD` override). They differ only in f32 summation order.
//! * Bad arguments (block id out of range, too short table or positions, wrong row lengths,
//!   a head_dim that does not divide kv_dim) return [`crate::Error::InvalidInput`].

use super::storage::{KvStorage, KvType, Q8_0_BLOCK, Q8_0_BYTES};
use crate::error::{invalid, Result};
use crate::quant::simd::{self, SimdLevel};
use half::f16;

mod tile;
pub use tile::{attend_tile, attend_tile_at, attend_tile_states, TILE_TOKENS};

/// Which of the `n_kv` cells a query sees.
#[derive(Clone, Copy)]
pub enum Mask<'a> {
    /// Every cell is visible.
    All,
    /// Cell `i` is visible iff `0 <= positions[i] <= qpos` (negative positions mark empty cells).
    Causal { positions: &'a [i32], qpos: i32 },
    /// Causal within a sliding window: cell `i` is visible iff
    /// `0 <= positions[i] <= qpos` and `qpos - positions[i] < window` (llama.cpp's standard
    /// SWA mask).
    Window {
        positions: &'a [i32],
        qpos: i32,
        window: i32,
    },
    /// Cell `i` is visible iff `f(i)`.
    Custom(&'a dyn Fn(usize) -> bool),
}

impl Mask<'_> {
    #[inline]
    fn visible(&self, i: usize) -> bool {
        match self {
            Mask::All => true,
            Mask::Causal { positions, qpos } => {
                let p = positions[i];
                p >= 0 && p <= *qpos
            }
            Mask::Window {
                positions,
                qpos,
                window,
            } => {
                let p = positions[i];
                p >= 0 && p <= *qpos && *qpos - p < *window
            }
            Mask::Custom(f) => f(i),
        }
    }
}

/// One query token's attention for the GQA groups of `kv_heads` consecutive KV heads from
/// `kv_head` (each group: `q.len() / (kv_heads * head_dim)` query heads).
#[derive(Clone, Copy)]
pub struct Query<'a> {
    pub layer: usize,
    /// First KV head, shared by the first group's query heads.
    pub kv_head: usize,
    /// KV heads taken together (at least 1): each block's keys and values of all of them are
    /// read in one pass over the block, whose rows hold them side by side.
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `kv_heads * group * head_dim` values: the groups' query rows, already rotated, in head
    /// order.
    pub q: &'a [f32],
    /// Score scale, usually `1/sqrt(head_dim)`.
    pub scale: f32,
    pub mask: Mask<'a>,
}

/// Reusable per-thread buffers of [`attend`].
#[derive(Default, Debug)]
pub struct Scratch {
    scores: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    part: Vec<f32>,
    /// The visible blocks of the chunk being computed.
    run: Vec<usize>,
    /// The masked cells of the block being computed.
    hidden: Vec<usize>,
    /// The buffers of [`attend_tile`].
    tile: tile::TileScratch,
}

/// Cells per chunk (rounded down to whole blocks, at least one block). Attention over a
/// sequence is computed chunk by chunk: a chunk is a run of consecutive *visible* blocks (blocks
/// with at least one cell the query sees), each chunk's softmax state is kept apart, and the
/// states are folded in chunk order ([`merge_chunks`]), whether one task computes every chunk
/// ([`attend`]) or the team computes them in parallel ([`attend_chunk`], then
/// [`merge_chunks`]). Both give the same bits, so a sequence's output never depends on how its
/// attention was split (the batch, the team's size, the step's plan), nor on blocks it cannot
/// see (a window group's pruned blocks, the cells of later tokens in a prompt batch).
pub const CHUNK_CELLS: usize = 256;

/// Visible blocks per chunk for blocks of `block_size` cells.
pub fn chunk_blocks(block_size: usize) -> usize {
    (CHUNK_CELLS / block_size.max(1)).max(1)
}

/// The table indices of the blocks (of the `n_kv` cells) that hold a cell visible under
/// `mask`, in order, into `out` (cleared first). Chunk `c` is
/// `out[c * chunk_blocks(bs)..][..chunk_blocks(bs)]`.
pub fn visible_blocks(n_kv: usize, block_size: usize, mask: &Mask, out: &mut Vec<usize>) {
    out.clear();
    let bs = block_size.max(1);
    for bi in 0..n_kv.div_ceil(bs) {
        let base = bi * bs;
        if (base..n_kv.min(base + bs)).any(|i| mask.visible(i)) {
            out.push(bi);
        }
    }
}

/// How many chunks `n_visible` visible blocks make (at least 1).
pub fn n_chunks(n_visible: usize, block_size: usize) -> usize {
    n_visible.div_ceil(chunk_blocks(block_size)).max(1)
}

/// Values of one chunk's softmax state for a group of `g` heads of `head_dim` values: the
/// unnormalized output (`g * head_dim`: `sum_j exp(s_j - max) v_j` per head), then the
/// running max (`g`) and the sum of exponentials (`g`) per head.
pub fn partial_len(g: usize, head_dim: usize) -> usize {
    g * (head_dim + 2)
}

/// Attention of `query` over cells `0..n_kv` of the sequence whose blocks are `table`; writes
/// `group * head_dim` values to `out`. Uses the process-wide SIMD level.
pub fn attend(
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    query: &Query,
    out: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    attend_at(simd::level(), store, table, n_kv, query, out, scratch)
}

/// [`attend`] with an explicit kernel level (capped at what the CPU supports).
pub fn attend_at(
    lvl: SimdLevel,
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    query: &Query,
    out: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    let chunk = chunk_blocks(store.block_size());
    attend_chunked(lvl, store, table, n_kv, query, out, scratch, chunk)
}

/// [`attend_at`] with `chunk` visible blocks per chunk (tests take small chunks).
#[allow(clippy::too_many_arguments)]
fn attend_chunked(
    lvl: SimdLevel,
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    query: &Query,
    out: &mut [f32],
    scratch: &mut Scratch,
    chunk: usize,
) -> Result<()> {
    let geo = Geometry::check(store, table, n_kv, query, out.len())?;
    let (g, hd, bs) = (geo.g, query.head_dim, store.block_size());
    let Scratch {
        scores,
        max,
        sum,
        part,
        run,
        hidden,
        ..
    } = scratch;
    max.clear();
    max.resize(g, f32::NEG_INFINITY);
    sum.clear();
    sum.resize(g, 0.0);
    out.fill(0.0);
    part.resize(partial_len(g, hd), 0.0);
    // Visible blocks, `chunk` at a time (the same runs as `visible_blocks`).
    let mask = query.mask;
    run.clear();
    for bi in 0..geo.nb {
        let base = bi * bs;
        if !(base..n_kv.min(base + bs)).any(|i| mask.visible(i)) {
            continue;
        }
        run.push(bi);
        if run.len() == chunk {
            run_blocks(
                lvl, &geo, store, table, run, n_kv, query, part, scores, hidden,
            );
            fold_chunk(g, hd, part, max, sum, out);
            run.clear();
        }
    }
    if !run.is_empty() {
        run_blocks(
            lvl, &geo, store, table, run, n_kv, query, part, scores, hidden,
        );
        fold_chunk(g, hd, part, max, sum, out);
    }
    finish(hd, sum, out);
    Ok(())
}

/// The softmax state ([`partial_len`] values in `part`) of `query` over the table entries
/// `blocks` (one chunk of [`visible_blocks`]) of cells `0..n_kv`; [`merge_chunks`] of every
/// chunk's state, in order, gives [`attend`]'s output bit for bit.
pub fn attend_chunk(
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    blocks: &[usize],
    query: &Query,
    part: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    chunk_state(
        simd::level(),
        store,
        table,
        n_kv,
        blocks,
        query,
        part,
        scratch,
    )
}

#[allow(clippy::too_many_arguments)]
fn chunk_state(
    lvl: SimdLevel,
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    blocks: &[usize],
    query: &Query,
    part: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    let geo = Geometry::check(store, table, n_kv, query, query.q.len())?;
    if part.len() != partial_len(geo.g, query.head_dim) {
        return Err(invalid(format!(
            "attention: a chunk state holds {} values, got {}",
            partial_len(geo.g, query.head_dim),
            part.len()
        )));
    }
    if let Some(&b) = blocks.iter().find(|&&b| b >= geo.nb) {
        return Err(invalid(format!(
            "attention: chunk block {b} outside the {} blocks of {n_kv} cells",
            geo.nb
        )));
    }
    run_blocks(
        lvl,
        &geo,
        store,
        table,
        blocks,
        n_kv,
        query,
        part,
        &mut scratch.scores,
        &mut scratch.hidden,
    );
    Ok(())
}

/// The folded, unnormalized state of `query` over cells `0..n_kv` of `table` (`heads` query
/// heads; [`partial_len`] values in `st`): each chunk's state folded from empty in chunk
/// order, as [`attend_chunked`] and [`merge_chunks`] do (the token-by-token twin of
/// [`attend_tile_states`]).
#[allow(clippy::too_many_arguments)]
fn folded_state(
    lvl: SimdLevel,
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    query: &Query,
    heads: usize,
    st: &mut [f32],
    scratch: &mut Scratch,
    chunk: usize,
) -> Result<()> {
    let geo = Geometry::check(store, table, n_kv, query, query.q.len())?;
    let hd = query.head_dim;
    let mut vis = Vec::new();
    visible_blocks(n_kv, store.block_size(), &query.mask, &mut vis);
    let (o, rest) = st.split_at_mut(heads * hd);
    let (m, s) = rest.split_at_mut(heads);
    o.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    s.fill(0.0);
    let Scratch {
        scores,
        part,
        hidden,
        ..
    } = scratch;
    part.resize(partial_len(heads, hd), 0.0);
    for blocks in vis.chunks(chunk) {
        run_blocks(
            lvl, &geo, store, table, blocks, n_kv, query, part, scores, hidden,
        );
        fold_chunk(heads, hd, part, m, s, o);
    }
    Ok(())
}

/// Folds chunk states (each [`partial_len`]`(g, head_dim)` values, in chunk order) into the
/// normalized output of `g` heads (`out`: `g * head_dim` values): the same arithmetic, in the
/// same order, as [`attend`] uses on its own chunks.
pub fn merge_chunks<'p>(
    g: usize,
    head_dim: usize,
    parts: impl IntoIterator<Item = &'p [f32]>,
    out: &mut [f32],
    scratch: &mut Scratch,
) {
    assert_eq!(
        out.len(),
        g * head_dim,
        "merge_chunks: out holds g * head_dim values"
    );
    let Scratch { max, sum, .. } = scratch;
    max.clear();
    max.resize(g, f32::NEG_INFINITY);
    sum.clear();
    sum.resize(g, 0.0);
    out.fill(0.0);
    for part in parts {
        fold_chunk(g, head_dim, part, max, sum, out);
    }
    finish(head_dim, sum, out);
}

/// `(max, sum, out) <- (max, sum, out) (+) part` per head: both sides rescaled to the larger
/// max. A chunk with no visible cell (max `-inf`) changes nothing; the first chunk with one is
/// copied exactly (its factor is `exp(0) = 1`, the empty state's `exp(-inf) = 0`).
fn fold_chunk(
    g: usize,
    hd: usize,
    part: &[f32],
    max: &mut [f32],
    sum: &mut [f32],
    out: &mut [f32],
) {
    let (po, rest) = part.split_at(g * hd);
    let (pm, ps) = rest.split_at(g);
    for h in 0..g {
        if pm[h] == f32::NEG_INFINITY {
            continue;
        }
        let m = max[h].max(pm[h]);
        let (a, b) = ((max[h] - m).exp(), (pm[h] - m).exp());
        sum[h] = sum[h] * a + ps[h] * b;
        max[h] = m;
        for (o, &p) in out[h * hd..(h + 1) * hd]
            .iter_mut()
            .zip(&po[h * hd..(h + 1) * hd])
        {
            *o = *o * a + p * b;
        }
    }
}

/// Divides each head's output by its sum (a head with no visible cell: all zeros).
fn finish(hd: usize, sum: &[f32], out: &mut [f32]) {
    for (h, o) in out.chunks_exact_mut(hd).enumerate() {
        let s = sum[h];
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        for x in o {
            *x *= inv;
        }
    }
}

/// What [`Geometry::check`] derived from a valid call.
struct Geometry {
    /// Query heads of the call (every group).
    g: usize,
    /// Query heads per KV head.
    group: usize,
    /// Blocks that hold the `n_kv` cells.
    nb: usize,
    /// Offset of the KV head's segment in a row, and the row stride.
    seg_off: usize,
    stride: usize,
}

impl Geometry {
    fn check(
        store: &KvStorage,
        table: &[u32],
        n_kv: usize,
        query: &Query,
        out_len: usize,
    ) -> Result<Geometry> {
        let ty = store.kv_type();
        let hd = query.head_dim;
        ty.check_dim(hd, "head_dim")?;
        let kv_dim = store.kv_dim();
        let nh = query.kv_heads;
        if nh == 0 || !kv_dim.is_multiple_of(hd) || query.kv_head + nh > kv_dim / hd {
            return Err(invalid(format!(
                "attention: kv_heads {}..{} with head_dim {hd} outside kv_dim {kv_dim}",
                query.kv_head,
                query.kv_head + nh
            )));
        }
        if query.layer >= store.n_layers() {
            return Err(invalid(format!(
                "attention: layer {} out of range ({} layers)",
                query.layer,
                store.n_layers()
            )));
        }
        let q = query.q;
        if q.is_empty() || !q.len().is_multiple_of(hd * nh) || out_len != q.len() {
            return Err(invalid(format!(
                "attention: q has {} values and out {out_len}, expected the same multiple of \
                 head_dim {hd} times {nh} KV heads",
                q.len(),
            )));
        }
        let bs = store.block_size();
        let nb = n_kv.div_ceil(bs);
        if nb > table.len() {
            return Err(invalid(format!(
                "attention: {n_kv} cells need {nb} blocks, the table has {}",
                table.len()
            )));
        }
        if let Some(&b) = table[..nb]
            .iter()
            .find(|&&b| b as usize >= store.n_blocks())
        {
            return Err(invalid(format!(
                "attention: block id {b} out of range ({} blocks)",
                store.n_blocks()
            )));
        }
        if let Mask::Causal { positions, .. } | Mask::Window { positions, .. } = query.mask {
            if positions.len() < n_kv {
                return Err(invalid(format!(
                    "attention: {} positions for {n_kv} cells",
                    positions.len()
                )));
            }
        }
        Ok(Geometry {
            g: q.len() / hd,
            group: q.len() / hd / nh,
            nb,
            seg_off: query.kv_head * ty.row_bytes(hd),
            stride: store.row_bytes(),
        })
    }
}

/// The softmax state of `query` over table entries `blocks` (of the `n_kv` cells; each below
/// `geo.nb`) into `part` ([`partial_len`] values), starting from the empty state. Block by
/// block, every KV head of the query in turn: the block's rows hold the heads side by side, so
/// one head's pass loads the lines the next ones read, and the next visible block is
/// prefetched (into L2) while this one is computed. A head's arithmetic is the same whichever
/// heads it is taken with.
#[allow(clippy::too_many_arguments)]
fn run_blocks(
    lvl: SimdLevel,
    geo: &Geometry,
    store: &KvStorage,
    table: &[u32],
    blocks: &[usize],
    n_kv: usize,
    query: &Query,
    part: &mut [f32],
    scores: &mut Vec<f32>,
    hidden: &mut Vec<usize>,
) {
    let lvl = simd::cap(lvl);
    let ty = store.kv_type();
    let (gt, g, hd, bs) = (geo.g, geo.group, query.head_dim, store.block_size());
    let seg = ty.row_bytes(hd);
    let (out, rest) = part.split_at_mut(gt * hd);
    let (max, sum) = rest.split_at_mut(gt);
    out.fill(0.0);
    max.fill(f32::NEG_INFINITY);
    sum.fill(0.0);
    scores.resize(g * bs, 0.0);
    let (q, mask) = (query.q, query.mask);
    for (i, &bi) in blocks.iter().enumerate() {
        let blk = table[bi] as usize;
        let base = bi * bs;
        let n = bs.min(n_kv - base);
        // The block's masked cells, found once for all its KV heads.
        hidden.clear();
        hidden.extend((0..n).filter(|&j| !mask.visible(base + j)));
        if hidden.len() == n {
            continue;
        }
        let next = blocks.get(i + 1).map(|&b| table[b] as usize);
        // The next block's lines are asked for a share at a time, between this block's
        // kernels: all at once, the requests fill the core's miss buffers and stall it.
        let pieces = 2 * query.kv_heads;
        let (krows, vrows) = (
            store.rows(query.layer, blk, false),
            store.rows(query.layer, blk, true),
        );
        for kh in 0..query.kv_heads {
            let off = geo.seg_off + kh * seg;
            let heads = kh * g..(kh + 1) * g;
            let scores = &mut scores[..g * n];
            let qh = &q[heads.start * hd..heads.end * hd];
            if let Some(next) = next {
                prefetch_block(store, query.layer, next, 2 * kh, pieces);
            }
            block_scores(
                lvl,
                ty,
                qh,
                hd,
                &krows[off..],
                geo.stride,
                n,
                query.scale,
                scores,
            );
            for &j in hidden.iter() {
                for h in 0..g {
                    scores[h * n + j] = f32::NEG_INFINITY;
                }
            }
            let out = &mut out[heads.start * hd..heads.end * hd];
            let (max, sum) = (&mut max[heads.clone()], &mut sum[heads]);
            for h in 0..g {
                let row = &mut scores[h * n..(h + 1) * n];
                let block_max = row_max(row);
                let old = max[h];
                let new = old.max(block_max);
                if new == f32::NEG_INFINITY {
                    row.fill(0.0);
                    continue;
                }
                if new != old {
                    let c = (old - new).exp();
                    sum[h] *= c;
                    for o in &mut out[h * hd..(h + 1) * hd] {
                        *o *= c;
                    }
                }
                sum[h] += exp_shift_sum(lvl, row, new);
                max[h] = new;
            }
            if let Some(next) = next {
                prefetch_block(store, query.layer, next, 2 * kh + 1, pieces);
            }
            block_accumulate(lvl, ty, scores, hd, &vrows[off..], geo.stride, n, out);
        }
    }
}

/// The largest of `row` (`-inf` when empty; NaNs are passed over, as by `f32::max`), in 16
/// independent lanes, so that it vectorizes: the maximum does not depend on the order.
#[inline]
fn row_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = row.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = l.max(x);
        }
    }
    for (l, &x) in lanes.iter_mut().zip(tail) {
        *l = l.max(x);
    }
    lanes.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// Asks for share `piece` of `pieces` of block `blk`'s key and value lines of `layer` to be
/// brought into L2: a hint only (it changes no result and never faults); a no-op off x86-64.
#[inline]
fn prefetch_block(store: &KvStorage, layer: usize, blk: usize, piece: usize, pieces: usize) {
    #[cfg(target_arch = "x86_64")]
    for rows in [store.rows(layer, blk, false), store.rows(layer, blk, true)] {
        let lines = rows.len().div_ceil(64);
        let (l0, l1) = (lines * piece / pieces, lines * (piece + 1) / pieces);
        for off in (64 * l0..64 * l1).step_by(64) {
            // SAFETY: SSE is part of x86-64's baseline; a prefetch reads nothing
            // architecturally and cannot fault, and the address lies inside `rows`.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
                _mm_prefetch::<_MM_HINT_T1>(rows.as_ptr().add(off).cast());
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (store, layer, blk);
}

/// `x = exp(x - m)` for every element of `row` (`m` finite, at least every finite `x`; `-inf`
/// gives exactly 0); returns the sum of the results. The AVX-512 and AVX2 kernels'
/// exponential is within a few ulps of `f32::exp` and their sums are taken in another order
/// than the scalar twin's.
fn exp_shift_sum(lvl: SimdLevel, row: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if lvl >= SimdLevel::Avx512 {
        // SAFETY: `lvl` is capped at `simd::detect()` by the caller (AVX-512F/BW/VL/DQ
        // present); the kernel reads and writes `row.len()` values at its start.
        return unsafe { x86::exp_shift_sum512(row.as_mut_ptr(), row.len(), m) };
    }
    #[cfg(target_arch = "x86_64")]
    if lvl >= SimdLevel::Avx2 {
        // SAFETY: `lvl` is capped at `simd::detect()` by the caller (AVX2 and FMA present);
        // the kernel reads and writes `row.len()` values at its start.
        return unsafe { x86::exp_shift_sum256(row.as_mut_ptr(), row.len(), m) };
    }
    let _ = lvl;
    exp_shift_sum_scalar(row, m)
}

/// Scalar twin of [`exp_shift_sum`].
fn exp_shift_sum_scalar(row: &mut [f32], m: f32) -> f32 {
    let mut s = 0.0f32;
    for x in row.iter_mut() {
        *x = (*x - m).exp();
        s += *x;
    }
    s
}

/// `out[h * n + j] = scale * dot(q_h, seg_j)`, `seg_j` the `head_dim` values at
/// `rows[j * stride..]`.
fn block_scores(
    lvl: SimdLevel,
    ty: KvType,
    q: &[f32],
    hd: usize,
    rows: &[u8],
    stride: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
) {
    let g = q.len() / hd;
    let seg = ty.row_bytes(hd);
    assert!(out.len() >= g * n && (n == 0 || (n - 1) * stride + seg <= rows.len()));
    #[cfg(target_arch = "x86_64")]
    {
        let (qp, rp, op) = (q.as_ptr(), rows.as_ptr(), out.as_mut_ptr());
        if lvl >= SimdLevel::Avx512 {
            // SAFETY: `lvl` is capped at `simd::detect()`, so AVX-512F/BW/VL/DQ, AVX2, FMA and
            // F16C exist; the assert above keeps every row segment inside `rows` and every
            // output inside `out`; q holds g * hd values.
            unsafe {
                use x86::{heads_path, scores512, scores512_groups};
                match ty {
                    KvType::F32 if heads_path::<0>(hd) => {
                        scores512_groups::<0>(qp, g, hd, rp, stride, n, scale, op)
                    }
                    KvType::F16 if heads_path::<1>(hd) => {
                        scores512_groups::<1>(qp, g, hd, rp, stride, n, scale, op)
                    }
                    KvType::Q8_0 if heads_path::<2>(hd) => {
                        scores512_groups::<2>(qp, g, hd, rp, stride, n, scale, op)
                    }
                    KvType::F32 => scores512::<0>(qp, g, hd, rp, stride, n, scale, op),
                    KvType::F16 => scores512::<1>(qp, g, hd, rp, stride, n, scale, op),
                    KvType::Q8_0 => scores512::<2>(qp, g, hd, rp, stride, n, scale, op),
                }
            }
            return;
        }
        if lvl >= SimdLevel::Avx2 {
            // SAFETY: as above, with AVX2, FMA and F16C detected.
            unsafe {
                match ty {
                    KvType::F32 => x86::scores256::<0>(qp, g, hd, rp, stride, n, scale, op),
                    KvType::F16 => x86::scores256::<1>(qp, g, hd, rp, stride, n, scale, op),
                    KvType::Q8_0 => x86::scores256::<2>(qp, g, hd, rp, stride, n, scale, op),
                }
            }
            return;
        }
    }
    let _ = lvl;
    for j in 0..n {
        let s = &rows[j * stride..j * stride + seg];
        for h in 0..g {
            out[h * n + j] = scale * dot_scalar(ty, &q[h * hd..(h + 1) * hd], s);
        }
    }
}

/// `acc_h += sum_j p[h * n + j] * seg_j` for the `acc.len() / hd` heads; zero weights are skipped.
fn block_accumulate(
    lvl: SimdLevel,
    ty: KvType,
    p: &[f32],
    hd: usize,
    rows: &[u8],
    stride: usize,
    n: usize,
    acc: &mut [f32],
) {
    let g = acc.len() / hd;
    let seg = ty.row_bytes(hd);
    assert!(p.len() >= g * n && (n == 0 || (n - 1) * stride + seg <= rows.len()));
    #[cfg(target_arch = "x86_64")]
    {
        let (pp, rp, ap) = (p.as_ptr(), rows.as_ptr(), acc.as_mut_ptr());
        if lvl >= SimdLevel::Avx512 {
            // SAFETY: `lvl` is capped at `simd::detect()` (AVX-512F/BW/VL/DQ, AVX2, FMA, F16C);
            // the assert keeps segments inside `rows` and weights inside `p`; acc holds g * hd.
            unsafe {
                use x86::{accum512, accum512_groups, heads_path};
                match ty {
                    KvType::F32 if heads_path::<0>(hd) => {
                        accum512_groups::<0>(pp, g, hd, rp, stride, n, ap)
                    }
                    KvType::F16 if heads_path::<1>(hd) => {
                        accum512_groups::<1>(pp, g, hd, rp, stride, n, ap)
                    }
                    KvType::Q8_0 if heads_path::<2>(hd) => {
                        accum512_groups::<2>(pp, g, hd, rp, stride, n, ap)
                    }
                    KvType::F32 => accum512::<0>(pp, g, hd, rp, stride, n, ap),
                    KvType::F16 => accum512::<1>(pp, g, hd, rp, stride, n, ap),
                    KvType::Q8_0 => accum512::<2>(pp, g, hd, rp, stride, n, ap),
                }
            }
            return;
        }
        if lvl >= SimdLevel::Avx2 {
            // SAFETY: as above, with AVX2, FMA and F16C detected.
            unsafe {
                match ty {
                    KvType::F32 => x86::accum256::<0>(pp, g, hd, rp, stride, n, ap),
                    KvType::F16 => x86::accum256::<1>(pp, g, hd, rp, stride, n, ap),
                    KvType::Q8_0 => x86::accum256::<2>(pp, g, hd, rp, stride, n, ap),
                }
            }
            return;
        }
    }
    let _ = lvl;
    for j in 0..n {
        let s = &rows[j * stride..j * stride + seg];
        for h in 0..g {
            let w = p[h * n + j];
            if w != 0.0 {
                axpy_scalar(ty, w, s, &mut acc[h * hd..(h + 1) * hd]);
            }
        }
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32()
}

/// Scalar reference: `dot(q, decode(seg))`, Q8_0 summed per 32-block then scaled.
fn dot_scalar(ty: KvType, q: &[f32], seg: &[u8]) -> f32 {
    match ty {
        KvType::F32 => q
            .iter()
            .zip(seg.chunks_exact(4))
            .map(|(&a, b)| a * f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .sum(),
        KvType::F16 => q.iter().enumerate().map(|(i, &a)| a * f16_at(seg, i)).sum(),
        KvType::Q8_0 => q
            .chunks_exact(Q8_0_BLOCK)
            .zip(seg.chunks_exact(Q8_0_BYTES))
            .map(|(qb, b)| {
                let s: f32 = qb
                    .iter()
                    .zip(&b[2..])
                    .map(|(&a, &x)| a * x as i8 as f32)
                    .sum();
                f16_at(b, 0) * s
            })
            .sum(),
    }
}

/// Scalar reference: `acc += w * decode(seg)`.
fn axpy_scalar(ty: KvType, w: f32, seg: &[u8], acc: &mut [f32]) {
    match ty {
        KvType::F32 => {
            for (a, b) in acc.iter_mut().zip(seg.chunks_exact(4)) {
                *a += w * f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        KvType::F16 => {
            for (i, a) in acc.iter_mut().enumerate() {
                *a += w * f16_at(seg, i);
            }
        }
        KvType::Q8_0 => {
            for (ab, b) in acc
                .chunks_exact_mut(Q8_0_BLOCK)
                .zip(seg.chunks_exact(Q8_0_BYTES))
            {
                let wd = w * f16_at(b, 0);
                for (a, &x) in ab.iter_mut().zip(&b[2..]) {
                    *a += wd * x as i8 as f32;
                }
            }
        }
    }
}

/// SIMD twins. `T`: 0 = F32, 1 = F16, 2 = Q8_0 (head_dim a multiple of 32 for Q8_0).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
    use std::arch::x86_64::*;

    /// # Safety
    /// `p` points to 2 readable bytes.
    #[inline(always)]
    unsafe fn f16_scale(p: *const u8) -> f32 {
        // SAFETY: guaranteed by the caller; unaligned read.
        f16::from_bits(u16::from_le(unsafe { p.cast::<u16>().read_unaligned() })).to_f32()
    }

    /// Element `i` of an F32 (`T = 0`) or F16 segment.
    ///
    /// # Safety
    /// Element `i` is inside the segment.
    #[inline(always)]
    unsafe fn elem<const T: u8>(seg: *const u8, i: usize) -> f32 {
        // SAFETY: guaranteed by the caller; unaligned reads.
        unsafe {
            if T == 0 {
                f32::from_bits(u32::from_le(seg.add(4 * i).cast::<u32>().read_unaligned()))
            } else {
                f16_scale(seg.add(2 * i))
            }
        }
    }

    // ---------------------------------------------------------------- AVX-512

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn load16<const T: u8>(seg: *const u8, i: usize) -> __m512 {
        // SAFETY: the caller guarantees elements i..i+16 are inside the segment.
        unsafe {
            if T == 0 {
                _mm512_loadu_ps(seg.add(4 * i).cast())
            } else {
                _mm512_cvtph_ps(_mm256_loadu_si256(seg.add(2 * i).cast()))
            }
        }
    }

    /// 16 int8 at `p` as f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn q8x16(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable bytes.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dot512<const T: u8>(q: *const f32, seg: *const u8, hd: usize) -> f32 {
        // SAFETY: the caller guarantees hd values at q and one hd-value segment at seg.
        unsafe {
            if T == 2 {
                let mut acc = _mm512_setzero_ps();
                for b in 0..hd / 32 {
                    let blk = seg.add(34 * b);
                    let qb = q.add(32 * b);
                    let lo = _mm512_mul_ps(q8x16(blk.add(2)), _mm512_loadu_ps(qb));
                    let t = _mm512_fmadd_ps(q8x16(blk.add(18)), _mm512_loadu_ps(qb.add(16)), lo);
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(f16_scale(blk)), t, acc);
                }
                return _mm512_reduce_add_ps(acc);
            }
            let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut i = 0;
            while i + 32 <= hd {
                a0 = _mm512_fmadd_ps(load16::<T>(seg, i), _mm512_loadu_ps(q.add(i)), a0);
                a1 = _mm512_fmadd_ps(load16::<T>(seg, i + 16), _mm512_loadu_ps(q.add(i + 16)), a1);
                i += 32;
            }
            if i + 16 <= hd {
                a0 = _mm512_fmadd_ps(load16::<T>(seg, i), _mm512_loadu_ps(q.add(i)), a0);
                i += 16;
            }
            let mut s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
            while i < hd {
                s += elem::<T>(seg, i) * *q.add(i);
                i += 1;
            }
            s
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn axpy512<const T: u8>(w: f32, seg: *const u8, acc: *mut f32, hd: usize) {
        // SAFETY: the caller guarantees hd values at acc and one hd-value segment at seg.
        unsafe {
            if T == 2 {
                for b in 0..hd / 32 {
                    let blk = seg.add(34 * b);
                    let wd = _mm512_set1_ps(w * f16_scale(blk));
                    let a = acc.add(32 * b);
                    _mm512_storeu_ps(
                        a,
                        _mm512_fmadd_ps(wd, q8x16(blk.add(2)), _mm512_loadu_ps(a)),
                    );
                    let a = a.add(16);
                    _mm512_storeu_ps(
                        a,
                        _mm512_fmadd_ps(wd, q8x16(blk.add(18)), _mm512_loadu_ps(a)),
                    );
                }
                return;
            }
            let wv = _mm512_set1_ps(w);
            let mut i = 0;
            while i + 16 <= hd {
                let a = acc.add(i);
                _mm512_storeu_ps(
                    a,
                    _mm512_fmadd_ps(wv, load16::<T>(seg, i), _mm512_loadu_ps(a)),
                );
                i += 16;
            }
            while i < hd {
                *acc.add(i) += w * elem::<T>(seg, i);
                i += 1;
            }
        }
    }

    /// # Safety
    /// AVX-512F/BW/VL/DQ, AVX2, FMA, F16C available; `q` holds `g * hd` values, `out`
    /// `g * n`; segment `j < n` (`hd` values of type `T`) starts at `rows + j * stride`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn scores512<const T: u8>(
        q: *const f32,
        g: usize,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        scale: f32,
        out: *mut f32,
    ) {
        for j in 0..n {
            // SAFETY: within the bounds the caller guarantees.
            unsafe {
                let seg = rows.add(j * stride);
                for h in 0..g {
                    *out.add(h * n + j) = dot512::<T>(q.add(h * hd), seg, hd) * scale;
                }
            }
        }
    }

    /// # Safety
    /// As [`scores512`], with `p` holding `g * n` weights and `acc` `g * hd` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn accum512<const T: u8>(
        p: *const f32,
        g: usize,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        acc: *mut f32,
    ) {
        if hd.is_multiple_of(64) {
            // Register path: 64 output columns stay in 4 registers across the block's rows.
            for h in 0..g {
                for c in (0..hd).step_by(64) {
                    // SAFETY: columns c..c+64 of head h are inside acc; row segments and
                    // weights are within the bounds the caller guarantees.
                    unsafe {
                        let a = acc.add(h * hd + c);
                        let mut r = [
                            _mm512_loadu_ps(a),
                            _mm512_loadu_ps(a.add(16)),
                            _mm512_loadu_ps(a.add(32)),
                            _mm512_loadu_ps(a.add(48)),
                        ];
                        for j in 0..n {
                            let w = *p.add(h * n + j);
                            if w == 0.0 {
                                continue;
                            }
                            let seg = rows.add(j * stride);
                            if T == 2 {
                                for b in 0..2 {
                                    let blk = seg.add(34 * (c / 32 + b));
                                    let wd = _mm512_set1_ps(w * f16_scale(blk));
                                    r[2 * b] = _mm512_fmadd_ps(wd, q8x16(blk.add(2)), r[2 * b]);
                                    r[2 * b + 1] =
                                        _mm512_fmadd_ps(wd, q8x16(blk.add(18)), r[2 * b + 1]);
                                }
                            } else {
                                let wv = _mm512_set1_ps(w);
                                for (k, rk) in r.iter_mut().enumerate() {
                                    *rk = _mm512_fmadd_ps(wv, load16::<T>(seg, c + 16 * k), *rk);
                                }
                            }
                        }
                        for (k, rk) in r.iter().enumerate() {
                            _mm512_storeu_ps(a.add(16 * k), *rk);
                        }
                    }
                }
            }
            return;
        }
        for j in 0..n {
            // SAFETY: within the bounds the caller guarantees.
            unsafe {
                let seg = rows.add(j * stride);
                for h in 0..g {
                    let w = *p.add(h * n + j);
                    if w != 0.0 {
                        axpy512::<T>(w, seg, acc.add(h * hd), hd);
                    }
                }
            }
        }
    }

    /// `exp(x)` of 16 values `x <= 0` (or `-inf`), within a few ulps of `f32::exp`: `x =
    /// k ln 2 + r` with `|r| <= ln 2 / 2`, a degree-6 polynomial for `e^r`, scaled by `2^k`
    /// (`vscalefps`). Below -87.3 (`e^x` under the smallest normal float, and `-inf`) it gives
    /// 0.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) fn exp_neg512(x: __m512) -> __m512 {
        let live = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(-87.33655));
        let x = _mm512_max_ps(x, _mm512_set1_ps(-87.33655));
        let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        // ln 2 split into a high part exact in products with k and the rest.
        let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693_145_75), x);
        let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428_606_8e-6), r);
        // Taylor coefficients 1/i! for i = 6 down to 0 (Horner).
        let mut p = _mm512_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, k))
    }

    /// AVX-512 kernel of `exp_shift_sum`.
    ///
    /// # Safety
    /// AVX-512F/BW/VL/DQ, AVX2, FMA, F16C available; `row` holds `n` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn exp_shift_sum512(row: *mut f32, n: usize, m: f32) -> f32 {
        let mv = _mm512_set1_ps(m);
        let mut sum = _mm512_setzero_ps();
        let mut i = 0;
        // SAFETY: i..i+16 (or the masked rest) lies inside the n values (caller).
        unsafe {
            while i < n {
                let keep: u16 = if n - i >= 16 {
                    0xFFFF
                } else {
                    (1u16 << (n - i)) - 1
                };
                let x = _mm512_maskz_loadu_ps(keep, row.add(i));
                let e = _mm512_maskz_mov_ps(keep, exp_neg512(_mm512_sub_ps(x, mv)));
                _mm512_mask_storeu_ps(row.add(i), keep, e);
                sum = _mm512_add_ps(sum, e);
                i += 16;
            }
        }
        hsum16(sum)
    }

    /// The sum of 16 lanes by a fixed tree: `a_i = x_i + x_{i+8}`, `b_i = a_i + a_{i+4}`,
    /// `c_i = b_i + b_{i+2}`, then `c_0 + c_1`. The tile kernels add 16 vectors of cells in
    /// this order (`tile::x86::softmax_rows`), so a token's sum has the same bits either way.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) fn hsum16(x: __m512) -> f32 {
        let a = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps::<1>(x));
        let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
        _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)))
    }

    /// Sum of each of 8 vectors: lane `i` of the result is the sum of `v[i]`'s lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    fn reduce8(v: &[__m256; 8]) -> __m256 {
        let a0 = _mm256_hadd_ps(v[0], v[1]);
        let a1 = _mm256_hadd_ps(v[2], v[3]);
        let a2 = _mm256_hadd_ps(v[4], v[5]);
        let a3 = _mm256_hadd_ps(v[6], v[7]);
        // Lane i (of each half): vector i's (of 0..4, then 4..8) half sums.
        let b0 = _mm256_hadd_ps(a0, a1);
        let b1 = _mm256_hadd_ps(a2, a3);
        let lo = _mm256_permute2f128_ps::<0x20>(b0, b1);
        let hi = _mm256_permute2f128_ps::<0x31>(b0, b1);
        _mm256_add_ps(lo, hi)
    }

    /// Scores of `G` heads of the group at once (`q`: their `G * hd` values, `out`: their
    /// `G * n` scores, row stride `n`): each key segment is loaded and converted once for all
    /// heads, and the 16 partial sums of 8 cells per head are reduced together.
    ///
    /// # Safety
    /// AVX-512F/BW/VL/DQ, AVX2, FMA, F16C available; `hd` a multiple of 16 (of 32 for Q8_0);
    /// `q` holds `G * hd` values, `out` `G * n`; segment `j < n` starts at `rows + j * stride`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn scores512_heads<const T: u8, const G: usize>(
        q: *const f32,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        scale: f32,
        out: *mut f32,
    ) {
        let sc = _mm256_set1_ps(scale);
        let mut part = [[_mm256_setzero_ps(); 8]; G];
        for j in 0..n {
            // SAFETY: within the bounds the caller guarantees.
            unsafe {
                let seg = rows.add(j * stride);
                let mut acc = [_mm512_setzero_ps(); G];
                if T == 2 {
                    for b in 0..hd / 32 {
                        let blk = seg.add(34 * b);
                        let (k0, k1) = (q8x16(blk.add(2)), q8x16(blk.add(18)));
                        let d = _mm512_set1_ps(f16_scale(blk));
                        for (h, a) in acc.iter_mut().enumerate() {
                            let qb = q.add(h * hd + 32 * b);
                            let t = _mm512_mul_ps(k0, _mm512_loadu_ps(qb));
                            let t = _mm512_fmadd_ps(k1, _mm512_loadu_ps(qb.add(16)), t);
                            *a = _mm512_fmadd_ps(d, t, *a);
                        }
                    }
                } else {
                    for c in (0..hd).step_by(16) {
                        let k = load16::<T>(seg, c);
                        for (h, a) in acc.iter_mut().enumerate() {
                            *a = _mm512_fmadd_ps(k, _mm512_loadu_ps(q.add(h * hd + c)), *a);
                        }
                    }
                }
                for (h, a) in acc.iter().enumerate() {
                    part[h][j % 8] =
                        _mm256_add_ps(_mm512_castps512_ps256(*a), _mm512_extractf32x8_ps::<1>(*a));
                }
                if j % 8 == 7 || j + 1 == n {
                    // Lanes past j belong to earlier cells or none: not stored.
                    let j0 = j - j % 8;
                    let keep = (1u8 << (j - j0)).wrapping_mul(2).wrapping_sub(1);
                    for (h, p) in part.iter().enumerate() {
                        let s = _mm256_mul_ps(reduce8(p), sc);
                        _mm256_mask_storeu_ps(out.add(h * n + j0), keep, s);
                    }
                }
            }
        }
    }

    /// Value pass of `G` heads at once (`p`: their `G * n` weights, row stride `n`; `acc`:
    /// their `G * hd` outputs): each value segment is loaded and converted once per 64 columns
    /// for all heads, whose outputs stay in registers across the block's rows. A zero weight
    /// adds nothing (masked cells are never read into an output).
    ///
    /// # Safety
    /// As [`scores512_heads`], with `p` holding `G * n` weights and `acc` `G * hd` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn accum512_heads<const T: u8, const G: usize>(
        p: *const f32,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        acc: *mut f32,
    ) {
        for c0 in (0..hd).step_by(64) {
            let kn = ((hd - c0) / 16).min(4);
            // SAFETY: columns c0..c0 + 16 kn of every head are inside acc; segments and
            // weights are within the bounds the caller guarantees.
            unsafe {
                let mut r = [[_mm512_setzero_ps(); 4]; G];
                for (h, rh) in r.iter_mut().enumerate() {
                    for (k, rk) in rh.iter_mut().enumerate().take(kn) {
                        *rk = _mm512_loadu_ps(acc.add(h * hd + c0 + 16 * k));
                    }
                }
                for j in 0..n {
                    let w: [f32; G] = std::array::from_fn(|h| *p.add(h * n + j));
                    if w.iter().all(|&x| x == 0.0) {
                        continue;
                    }
                    let seg = rows.add(j * stride);
                    let mut v = [_mm512_setzero_ps(); 4];
                    let mut d = [1.0f32; 2];
                    for (k, vk) in v.iter_mut().enumerate().take(kn) {
                        let c = c0 + 16 * k;
                        *vk = if T == 2 {
                            let blk = seg.add(34 * (c / 32));
                            d[k / 2] = f16_scale(blk);
                            q8x16(blk.add(2 + 16 * (k % 2)))
                        } else {
                            load16::<T>(seg, c)
                        };
                    }
                    for (h, rh) in r.iter_mut().enumerate() {
                        let live = if w[h] != 0.0 { 0xFFFF } else { 0 };
                        for (k, rk) in rh.iter_mut().enumerate().take(kn) {
                            let wk = _mm512_set1_ps(if T == 2 { w[h] * d[k / 2] } else { w[h] });
                            *rk = _mm512_mask3_fmadd_ps(wk, v[k], *rk, live);
                        }
                    }
                }
                for (h, rh) in r.iter().enumerate() {
                    for (k, rk) in rh.iter().enumerate().take(kn) {
                        _mm512_storeu_ps(acc.add(h * hd + c0 + 16 * k), *rk);
                    }
                }
            }
        }
    }

    /// Whether the head-group kernels take `hd` for type `T`.
    pub(super) fn heads_path<const T: u8>(hd: usize) -> bool {
        hd.is_multiple_of(if T == 2 { 32 } else { 16 })
    }

    /// [`scores512_heads`] over all `g` heads, up to 4 at a time.
    ///
    /// # Safety
    /// As [`scores512`], with `heads_path::<T>(hd)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn scores512_groups<const T: u8>(
        q: *const f32,
        g: usize,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        scale: f32,
        out: *mut f32,
    ) {
        let mut h0 = 0;
        while h0 < g {
            // SAFETY: heads h0..h0 + 4 (or fewer) of q and out, within the caller's bounds.
            unsafe {
                let (qh, oh) = (q.add(h0 * hd), out.add(h0 * n));
                match g - h0 {
                    1 => scores512_heads::<T, 1>(qh, hd, rows, stride, n, scale, oh),
                    2 => scores512_heads::<T, 2>(qh, hd, rows, stride, n, scale, oh),
                    3 => scores512_heads::<T, 3>(qh, hd, rows, stride, n, scale, oh),
                    _ => scores512_heads::<T, 4>(qh, hd, rows, stride, n, scale, oh),
                }
            }
            h0 += 4;
        }
    }

    /// [`accum512_heads`] over all `g` heads, up to 4 at a time.
    ///
    /// # Safety
    /// As [`accum512`], with `heads_path::<T>(hd)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn accum512_groups<const T: u8>(
        p: *const f32,
        g: usize,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        acc: *mut f32,
    ) {
        let mut h0 = 0;
        while h0 < g {
            // SAFETY: heads h0..h0 + 4 (or fewer) of p and acc, within the caller's bounds.
            unsafe {
                let (ph, ah) = (p.add(h0 * n), acc.add(h0 * hd));
                match g - h0 {
                    1 => accum512_heads::<T, 1>(ph, hd, rows, stride, n, ah),
                    2 => accum512_heads::<T, 2>(ph, hd, rows, stride, n, ah),
                    3 => accum512_heads::<T, 3>(ph, hd, rows, stride, n, ah),
                    _ => accum512_heads::<T, 4>(ph, hd, rows, stride, n, ah),
                }
            }
            h0 += 4;
        }
    }

    // ---------------------------------------------------------------- AVX2

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<const T: u8>(seg: *const u8, i: usize) -> __m256 {
        // SAFETY: the caller guarantees elements i..i+8 are inside the segment.
        unsafe {
            if T == 0 {
                _mm256_loadu_ps(seg.add(4 * i).cast())
            } else {
                _mm256_cvtph_ps(_mm_loadu_si128(seg.add(2 * i).cast()))
            }
        }
    }

    /// 8 int8 at `p` as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8x8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable bytes.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot256<const T: u8>(q: *const f32, seg: *const u8, hd: usize) -> f32 {
        // SAFETY: the caller guarantees hd values at q and one hd-value segment at seg.
        unsafe {
            if T == 2 {
                let mut acc = _mm256_setzero_ps();
                for b in 0..hd / 32 {
                    let blk = seg.add(34 * b);
                    let qb = q.add(32 * b);
                    let mut t = _mm256_mul_ps(q8x8(blk.add(2)), _mm256_loadu_ps(qb));
                    for k in 1..4 {
                        t = _mm256_fmadd_ps(
                            q8x8(blk.add(2 + 8 * k)),
                            _mm256_loadu_ps(qb.add(8 * k)),
                            t,
                        );
                    }
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_scale(blk)), t, acc);
                }
                return hsum256(acc);
            }
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i + 16 <= hd {
                a0 = _mm256_fmadd_ps(load8::<T>(seg, i), _mm256_loadu_ps(q.add(i)), a0);
                a1 = _mm256_fmadd_ps(load8::<T>(seg, i + 8), _mm256_loadu_ps(q.add(i + 8)), a1);
                i += 16;
            }
            if i + 8 <= hd {
                a0 = _mm256_fmadd_ps(load8::<T>(seg, i), _mm256_loadu_ps(q.add(i)), a0);
                i += 8;
            }
            let mut s = hsum256(_mm256_add_ps(a0, a1));
            while i < hd {
                s += elem::<T>(seg, i) * *q.add(i);
                i += 1;
            }
            s
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy256<const T: u8>(w: f32, seg: *const u8, acc: *mut f32, hd: usize) {
        // SAFETY: the caller guarantees hd values at acc and one hd-value segment at seg.
        unsafe {
            if T == 2 {
                for b in 0..hd / 32 {
                    let blk = seg.add(34 * b);
                    let wd = _mm256_set1_ps(w * f16_scale(blk));
                    for k in 0..4 {
                        let a = acc.add(32 * b + 8 * k);
                        let x = q8x8(blk.add(2 + 8 * k));
                        _mm256_storeu_ps(a, _mm256_fmadd_ps(wd, x, _mm256_loadu_ps(a)));
                    }
                }
                return;
            }
            let wv = _mm256_set1_ps(w);
            let mut i = 0;
            while i + 8 <= hd {
                let a = acc.add(i);
                _mm256_storeu_ps(
                    a,
                    _mm256_fmadd_ps(wv, load8::<T>(seg, i), _mm256_loadu_ps(a)),
                );
                i += 8;
            }
            while i < hd {
                *acc.add(i) += w * elem::<T>(seg, i);
                i += 1;
            }
        }
    }

    /// [`exp_neg512`] on 8 lanes: the same reduction and polynomial, `2^k` built in the
    /// exponent field (`k >= -126` once `x` is clamped, so the power is a normal float).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn exp_neg256(x: __m256) -> __m256 {
        let live = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(-87.33655));
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.33655));
        let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693_145_75), x);
        let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428_606_8e-6), r);
        let mut p = _mm256_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(k),
            _mm256_set1_epi32(127),
        ));
        _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2)))
    }

    /// AVX2 kernel of `exp_shift_sum`.
    ///
    /// # Safety
    /// AVX2, FMA, F16C available; `row` holds `n` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn exp_shift_sum256(row: *mut f32, n: usize, m: f32) -> f32 {
        let mv = _mm256_set1_ps(m);
        let mut sum = _mm256_setzero_ps();
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mut i = 0;
        // SAFETY: i..i+8 (or the masked rest) lies inside the n values (caller).
        unsafe {
            while i + 8 <= n {
                let e = exp_neg256(_mm256_sub_ps(_mm256_loadu_ps(row.add(i)), mv));
                _mm256_storeu_ps(row.add(i), e);
                sum = _mm256_add_ps(sum, e);
                i += 8;
            }
            if i < n {
                let keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((n - i) as i32), lanes);
                let x = _mm256_maskload_ps(row.add(i), keep);
                let e = _mm256_and_ps(_mm256_castsi256_ps(keep), exp_neg256(_mm256_sub_ps(x, mv)));
                _mm256_maskstore_ps(row.add(i), keep, e);
                sum = _mm256_add_ps(sum, e);
            }
        }
        hsum256(sum)
    }

    /// Lane `j` of the result: the sum of `v[j]`'s 8 lanes (`hadd` tree, then the halves).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn reduce8_256(v: &[__m256; 8]) -> __m256 {
        let s01 = _mm256_hadd_ps(v[0], v[1]);
        let s23 = _mm256_hadd_ps(v[2], v[3]);
        let s45 = _mm256_hadd_ps(v[4], v[5]);
        let s67 = _mm256_hadd_ps(v[6], v[7]);
        let t0 = _mm256_hadd_ps(s01, s23);
        let t1 = _mm256_hadd_ps(s45, s67);
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(t0, t1),
            _mm256_permute2f128_ps::<0x31>(t0, t1),
        )
    }

    /// The runs `(first head, heads)` in which the AVX2 head-group kernels take a group of `g`
    /// heads: 3 when 3 are left, 1 when 1, else 2. Measured on Zen 3 (one process, alternating):
    /// 3 heads at once beat 2 + 1; for 4, two pairs beat one pass of 4 (4 heads over 16 value
    /// columns 0.77x, 4 heads x 2 keys of scores 0.90x).
    fn head_runs(g: usize) -> impl Iterator<Item = (usize, usize)> {
        let mut h0 = 0;
        std::iter::from_fn(move || {
            (h0 < g).then(|| {
                let k = match g - h0 {
                    1 => 1,
                    3 => 3,
                    _ => 2,
                };
                h0 += k;
                (h0 - k, k)
            })
        })
    }

    /// Lanes `0..4` of the result: the sums of `v[0..4]`'s 8 lanes, by `reduce8_256`'s tree
    /// (each vector's lanes `((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7))`), so a score summed
    /// here has the bits of the 8-key path's.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn reduce4_256(v: &[__m256; 4]) -> __m128 {
        let s01 = _mm256_hadd_ps(v[0], v[1]);
        let s23 = _mm256_hadd_ps(v[2], v[3]);
        let t = _mm256_hadd_ps(s01, s23);
        _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t))
    }

    /// Scores of keys `j0..j0 + NK` (`NK <= 4`) for `G` heads at once: each key's 8 values
    /// are loaded and converted once for all the heads (their queries are read from L1), one
    /// accumulator per (head, key), dimensions `l, l + 8, ...` in lane `l` as in the one-head
    /// path, reduced by [`reduce4_256`] and scaled: the one-head path's bits.
    ///
    /// # Safety
    /// AVX2, FMA, F16C available; `T` is F32 or F16, `hd` a multiple of 8; `q` holds `G * hd`
    /// values; `out` row `h` (stride `n`) has room for cells `j0..j0 + NK`; segment `j` of
    /// those keys starts at `rows + j * stride`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores256_keys<const T: u8, const G: usize, const NK: usize>(
        q: *const f32,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        j0: usize,
        scale: f32,
        out: *mut f32,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 4]; G];
        // SAFETY: keys j0..j0 + NK, dimensions i..i + 8 of each segment and query row, and
        // the stored scores are within the caller's bounds.
        unsafe {
            for i in (0..hd).step_by(8) {
                for jj in 0..NK {
                    let k = load8::<T>(rows.add((j0 + jj) * stride), i);
                    for (h, a) in acc.iter_mut().enumerate() {
                        a[jj] = _mm256_fmadd_ps(k, _mm256_loadu_ps(q.add(h * hd + i)), a[jj]);
                    }
                }
            }
            let sv = _mm_set1_ps(scale);
            for (h, a) in acc.iter().enumerate() {
                let s = _mm_mul_ps(reduce4_256(a), sv);
                let o = out.add(h * n + j0);
                if NK == 4 {
                    _mm_storeu_ps(o, s);
                } else {
                    let mut tmp = [0f32; 4];
                    _mm_storeu_ps(tmp.as_mut_ptr(), s);
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), o, NK);
                }
            }
        }
    }

    /// The scores of `G` heads over the block's `n` keys, [`scores256_keys`] `NK` keys at a
    /// time (`G * NK` accumulators: 8 or 12 of the 16 registers).
    ///
    /// # Safety
    /// As [`scores256_keys`] for every key `0..n`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores256_heads<const T: u8, const G: usize, const NK: usize>(
        q: *const f32,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        scale: f32,
        out: *mut f32,
    ) {
        let mut j0 = 0;
        // SAFETY: every call covers keys inside 0..n (the caller's bounds).
        unsafe {
            while j0 + NK <= n {
                scores256_keys::<T, G, NK>(q, hd, rows, stride, n, j0, scale, out);
                j0 += NK;
            }
            match n - j0 {
                0 => {}
                1 => scores256_keys::<T, G, 1>(q, hd, rows, stride, n, j0, scale, out),
                2 => scores256_keys::<T, G, 2>(q, hd, rows, stride, n, j0, scale, out),
                _ => scores256_keys::<T, G, 3>(q, hd, rows, stride, n, j0, scale, out),
            }
        }
    }

    /// The scores of one head over the block's `n` keys, 8 keys at a time: one accumulator
    /// per key (dimensions `l, l + 8, ...` in lane `l`), the 8 reduced together by
    /// [`reduce8_256`] (no horizontal sum per score), then scaled.
    ///
    /// # Safety
    /// As [`scores256_keys`] with `G = 1`, for every key `0..n`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores256_one<const T: u8>(
        q: *const f32,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        scale: f32,
        out: *mut f32,
    ) {
        let sv = _mm256_set1_ps(scale);
        let mut j0 = 0;
        while j0 < n {
            let nk = (n - j0).min(8);
            let mut acc = [_mm256_setzero_ps(); 8];
            // SAFETY: keys j0..j0 + nk are inside the block and dimensions i..i + 8 inside
            // each segment and q (the caller's bounds).
            unsafe {
                for i in (0..hd).step_by(8) {
                    let qv = _mm256_loadu_ps(q.add(i));
                    for (jj, a) in acc.iter_mut().enumerate().take(nk) {
                        let seg = rows.add((j0 + jj) * stride);
                        *a = _mm256_fmadd_ps(load8::<T>(seg, i), qv, *a);
                    }
                }
                let sc = _mm256_mul_ps(reduce8_256(&acc), sv);
                let o = out.add(j0);
                if nk == 8 {
                    _mm256_storeu_ps(o, sc);
                } else {
                    let mut tmp = [0f32; 8];
                    _mm256_storeu_ps(tmp.as_mut_ptr(), sc);
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), o, nk);
                }
            }
            j0 += 8;
        }
    }

    /// # Safety
    /// AVX2, FMA, F16C available; otherwise as [`scores512`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores256<const T: u8>(
        q: *const f32,
        g: usize,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        scale: f32,
        out: *mut f32,
    ) {
        if T != 2 && hd.is_multiple_of(8) {
            // The heads in runs of 3 or 2 (`head_runs`), 4 keys at a time, each key converted
            // once for the run; a head left alone takes 8 keys at a time. Every score has the
            // same bits either way.
            for (h0, k) in head_runs(g) {
                // SAFETY: heads h0..h0 + k of q and out, within the caller's bounds.
                unsafe {
                    let (qg, og) = (q.add(h0 * hd), out.add(h0 * n));
                    match k {
                        1 => scores256_one::<T>(qg, hd, rows, stride, n, scale, og),
                        3 => scores256_heads::<T, 3, 4>(qg, hd, rows, stride, n, scale, og),
                        _ => scores256_heads::<T, 2, 4>(qg, hd, rows, stride, n, scale, og),
                    }
                }
            }
            return;
        }
        for j in 0..n {
            // SAFETY: within the bounds the caller guarantees.
            unsafe {
                let seg = rows.add(j * stride);
                for h in 0..g {
                    *out.add(h * n + j) = dot256::<T>(q.add(h * hd), seg, hd) * scale;
                }
            }
        }
    }

    /// Value pass of `G` heads at once over `8 * CW` output columns from `c0`: each value
    /// row's 8 columns are loaded and converted once for all the heads, whose outputs stay in
    /// `G * CW` registers across the block's rows. Per head and column the fused
    /// multiply-adds are the one-head path's, in cell order, a zero weight adding nothing
    /// (the same bits).
    ///
    /// # Safety
    /// AVX2, FMA, F16C available; `T` is F32 or F16; `p` holds `G` rows of `n` weights
    /// (stride `n`), `acc` `G` rows of `hd` values with columns `c0..c0 + 8 * CW` inside each;
    /// segment `j < n` starts at `rows + j * stride` and holds those columns.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accum256_cols<const T: u8, const G: usize, const CW: usize>(
        p: *const f32,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        acc: *mut f32,
        c0: usize,
    ) {
        // SAFETY: every access is inside the bounds the caller guarantees.
        unsafe {
            let mut r = [[_mm256_setzero_ps(); CW]; G];
            for (h, rh) in r.iter_mut().enumerate() {
                for (k, rk) in rh.iter_mut().enumerate() {
                    *rk = _mm256_loadu_ps(acc.add(h * hd + c0 + 8 * k));
                }
            }
            for j in 0..n {
                let w: [f32; G] = std::array::from_fn(|h| *p.add(h * n + j));
                let live = w.map(|x| x != 0.0);
                if !live.contains(&true) {
                    continue;
                }
                let seg = rows.add(j * stride);
                let wv = w.map(|x| _mm256_set1_ps(x));
                if !live.contains(&false) {
                    for k in 0..CW {
                        let v = load8::<T>(seg, c0 + 8 * k);
                        for (rh, &wh) in r.iter_mut().zip(&wv) {
                            rh[k] = _mm256_fmadd_ps(wh, v, rh[k]);
                        }
                    }
                } else {
                    for k in 0..CW {
                        let v = load8::<T>(seg, c0 + 8 * k);
                        for ((rh, &wh), &lh) in r.iter_mut().zip(&wv).zip(&live) {
                            if lh {
                                rh[k] = _mm256_fmadd_ps(wh, v, rh[k]);
                            }
                        }
                    }
                }
            }
            for (h, rh) in r.iter().enumerate() {
                for (k, rk) in rh.iter().enumerate() {
                    _mm256_storeu_ps(acc.add(h * hd + c0 + 8 * k), *rk);
                }
            }
        }
    }

    /// [`accum256_cols`] over all `hd` columns (a multiple of `8 * CW`).
    ///
    /// # Safety
    /// As [`accum256_cols`] for every column block.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accum256_heads<const T: u8, const G: usize, const CW: usize>(
        p: *const f32,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        acc: *mut f32,
    ) {
        for c0 in (0..hd).step_by(8 * CW) {
            // SAFETY: columns c0..c0 + 8 CW lie inside hd (a multiple of 8 CW).
            unsafe { accum256_cols::<T, G, CW>(p, hd, rows, stride, n, acc, c0) }
        }
    }

    /// # Safety
    /// AVX2, FMA, F16C available; otherwise as [`accum512`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn accum256<const T: u8>(
        p: *const f32,
        g: usize,
        hd: usize,
        rows: *const u8,
        stride: usize,
        n: usize,
        acc: *mut f32,
    ) {
        if T != 2 && hd.is_multiple_of(32) {
            // The heads in runs of 3 or 2 (`head_runs`), each value row converted once for the
            // run, 32 columns of each head in registers across the block's rows.
            for (h0, k) in head_runs(g) {
                // SAFETY: heads h0..h0 + k of p and acc, within the caller's bounds.
                unsafe {
                    let (pg, ag) = (p.add(h0 * n), acc.add(h0 * hd));
                    match k {
                        1 => accum256_heads::<T, 1, 4>(pg, hd, rows, stride, n, ag),
                        3 => accum256_heads::<T, 3, 4>(pg, hd, rows, stride, n, ag),
                        _ => accum256_heads::<T, 2, 4>(pg, hd, rows, stride, n, ag),
                    }
                }
            }
            return;
        }
        if T == 2 && hd.is_multiple_of(32) {
            // Q8_0: 32 output columns stay in 4 registers across the block's rows.
            for h in 0..g {
                for c in (0..hd).step_by(32) {
                    // SAFETY: columns c..c+32 of head h are inside acc; row segments and
                    // weights are within the bounds the caller guarantees.
                    unsafe {
                        let a = acc.add(h * hd + c);
                        let mut r = [
                            _mm256_loadu_ps(a),
                            _mm256_loadu_ps(a.add(8)),
                            _mm256_loadu_ps(a.add(16)),
                            _mm256_loadu_ps(a.add(24)),
                        ];
                        for j in 0..n {
                            let w = *p.add(h * n + j);
                            if w == 0.0 {
                                continue;
                            }
                            let blk = rows.add(j * stride + 34 * (c / 32));
                            let wd = _mm256_set1_ps(w * f16_scale(blk));
                            for (k, rk) in r.iter_mut().enumerate() {
                                *rk = _mm256_fmadd_ps(wd, q8x8(blk.add(2 + 8 * k)), *rk);
                            }
                        }
                        for (k, rk) in r.iter().enumerate() {
                            _mm256_storeu_ps(a.add(8 * k), *rk);
                        }
                    }
                }
            }
            return;
        }
        for j in 0..n {
            // SAFETY: within the bounds the caller guarantees.
            unsafe {
                let seg = rows.add(j * stride);
                for h in 0..g {
                    let w = *p.add(h * n + j);
                    if w != 0.0 {
                        axpy256::<T>(w, seg, acc.add(h * hd), hd);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::storage::KvLayout;

    /// Deterministic generator (splitmix64): uniform in [0, 1) and standard normal values.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn uniform(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64
        }
        fn normal(&mut self) -> f32 {
            let (u, v) = (self.uniform().max(1e-300), self.uniform());
            ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
        }
        fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
            (0..n).map(|_| self.normal() * scale).collect()
        }
        /// A shuffled selection of `k` distinct block ids out of `n`.
        fn table(&mut self, n: usize, k: usize) -> Vec<u32> {
            let mut ids: Vec<u32> = (0..n as u32).collect();
            for i in (1..n).rev() {
                ids.swap(i, (self.next() % (i as u64 + 1)) as usize);
            }
            ids.truncate(k);
            ids
        }
    }

    /// Writes random keys (with a few large "outlier" channels, as real keys have) and values
    /// into cells `0..n_kv` of `table`, for every layer.
    fn fill(s: &mut KvStorage, table: &[u32], n_kv: usize, rng: &mut Rng) {
        let d = s.kv_dim();
        for layer in 0..s.n_layers() {
            for i in 0..n_kv {
                let mut k = rng.normals(d, 1.0);
                for c in (3..d).step_by(17) {
                    k[c] *= 6.0;
                }
                let v = rng.normals(d, 1.0);
                let bs = s.block_size();
                s.write(layer, table[i / bs], i % bs, &k, &v).unwrap();
            }
        }
    }

    /// Naive f64 attention over the stored (decoded) values.
    fn reference(s: &KvStorage, table: &[u32], n_kv: usize, q: &Query) -> Vec<f64> {
        let (hd, bs, d) = (q.head_dim, s.block_size(), s.kv_dim());
        let g = q.q.len() / hd;
        let (mut k, mut v) = (vec![0.0; d], vec![0.0; d]);
        let mut out = vec![0.0f64; g * hd];
        for h in 0..g {
            let mut scores = Vec::new();
            let mut rows = Vec::new();
            for i in (0..n_kv).filter(|&i| q.mask.visible(i)) {
                s.read_k(q.layer, table[i / bs], i % bs, &mut k).unwrap();
                s.read_v(q.layer, table[i / bs], i % bs, &mut v).unwrap();
                let ks = &k[q.kv_head * hd..(q.kv_head + 1) * hd];
                let dot: f64 = (0..hd).map(|t| q.q[h * hd + t] as f64 * ks[t] as f64).sum();
                scores.push(dot * q.scale as f64);
                rows.push(v[q.kv_head * hd..(q.kv_head + 1) * hd].to_vec());
            }
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
            for (sc, row) in scores.iter().zip(&rows) {
                let w = (sc - m).exp() / z;
                for t in 0..hd {
                    out[h * hd + t] += w * row[t] as f64;
                }
            }
        }
        out
    }

    fn max_err(a: &[f32], b: &[f64]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y).abs())
            .fold(0.0, f64::max)
    }

    #[test]
    fn matches_f64_reference_for_every_type_level_and_mask() {
        let mut rng = Rng(42);
        // (type, head_dim, n_kv_heads, block_size): head_dim 24 exercises the scalar tails.
        let cases = [
            (KvType::F32, 64, 2, 16),
            (KvType::F16, 64, 2, 16),
            (KvType::Q8_0, 64, 2, 16),
            (KvType::F32, 24, 3, 5),
            (KvType::F16, 24, 3, 5),
            (KvType::Q8_0, 32, 2, 7),
            (KvType::F16, 128, 1, 32),
            // 80 columns: a partial 64-column chunk in the value pass; Q8_0 with 96.
            (KvType::F16, 80, 1, 16),
            (KvType::Q8_0, 96, 1, 16),
            // Gemma 3: head_dim 256, one KV head of four query heads.
            (KvType::F16, 256, 1, 16),
        ];
        for (ty, hd, n_kv_heads, bs) in cases {
            let layout = KvLayout {
                ty,
                n_layers: 2,
                kv_dim: hd * n_kv_heads,
                block_size: bs,
            };
            let mut s = KvStorage::new(layout, 40).unwrap();
            let n_kv = 7 * bs + 3;
            let table = rng.table(40, 8);
            fill(&mut s, &table, n_kv, &mut rng);
            // Positions with gaps, some empty cells (-1) and some beyond the query position.
            let positions: Vec<i32> = (0..n_kv as i32)
                .map(|i| if i % 11 == 5 { -1 } else { i })
                .collect();
            let qpos = n_kv as i32 - 2 * bs as i32;
            let every_third = |i: usize| i.is_multiple_of(3);
            let masks = [
                Mask::All,
                Mask::Causal {
                    positions: &positions,
                    qpos,
                },
                Mask::Custom(&every_third),
                // A window that hides whole blocks and parts of others.
                Mask::Window {
                    positions: &positions,
                    qpos,
                    window: 2 * bs as i32 + 3,
                },
            ];
            // The head-group kernels: AVX-512 takes 4 heads then 1 of 5, AVX2 2 + 2 of 4 and
            // 2 + 3 of 5.
            for g in [1, 3, 4, 5] {
                let q = rng.normals(g * hd, 1.0);
                for mask in masks {
                    let query = Query {
                        layer: 1,
                        kv_head: n_kv_heads - 1,
                        kv_heads: 1,
                        head_dim: hd,
                        q: &q,
                        scale: 1.0 / (hd as f32).sqrt(),
                        mask,
                    };
                    let want = reference(&s, &table, n_kv, &query);
                    let mut scalar = vec![0.0; g * hd];
                    let mut scratch = Scratch::default();
                    for lvl in SimdLevel::available() {
                        let mut out = vec![f32::NAN; g * hd];
                        attend_at(lvl, &s, &table, n_kv, &query, &mut out, &mut scratch).unwrap();
                        let e = max_err(&out, &want);
                        assert!(e < 2e-5, "{ty:?} hd={hd} g={g} {lvl:?}: error {e}");
                        if lvl == SimdLevel::Scalar {
                            scalar = out;
                        } else {
                            let d = max_err(
                                &out,
                                &scalar.iter().map(|&x| x as f64).collect::<Vec<_>>(),
                            );
                            assert!(d < 1e-5, "{ty:?} {lvl:?} vs scalar: {d}");
                        }
                    }
                }
            }
        }
    }

    /// Chunked attention: over 13 blocks in chunks of 1, 3 and 4 visible blocks (a partial
    /// last chunk; masks that hide whole blocks), at every SIMD level: (a) the output matches
    /// the f64 reference; (b) each chunk's state computed apart ([`chunk_state`] over its run
    /// of [`visible_blocks`], as the team's tasks do) and folded by [`merge_chunks`] gives the
    /// same bits as [`attend_chunked`] computing every chunk itself; (c) dropping the blocks
    /// the query cannot see from the front of the table (a window group's pruning) changes no
    /// bit; (d) a sequence within one chunk gives the bits of one chunk of every block.
    #[test]
    fn chunks_computed_apart_merge_to_the_same_bits() {
        let mut rng = Rng(77);
        for (ty, hd, bs) in [
            (KvType::F16, 64, 16),
            (KvType::Q8_0, 64, 16),
            (KvType::F32, 24, 5),
            (KvType::F16, 256, 16),
        ] {
            let n_kv_heads = 2;
            let layout = KvLayout {
                ty,
                n_layers: 1,
                kv_dim: hd * n_kv_heads,
                block_size: bs,
            };
            let mut s = KvStorage::new(layout, 24).unwrap();
            let n_kv = 12 * bs + 5;
            let table = rng.table(24, 13);
            fill(&mut s, &table, n_kv, &mut rng);
            let positions: Vec<i32> = (0..n_kv as i32).collect();
            let g = 3;
            let q = rng.normals(g * hd, 1.0);
            let masks = [
                Mask::Causal {
                    positions: &positions,
                    qpos: n_kv as i32 - 1,
                },
                // Hides the first blocks entirely (and the end: beyond the query).
                Mask::Window {
                    positions: &positions,
                    qpos: n_kv as i32 - 2 * bs as i32,
                    window: 5 * bs as i32 + 2,
                },
                // Only the first half: later blocks are hidden.
                Mask::Causal {
                    positions: &positions,
                    qpos: (n_kv / 2) as i32,
                },
            ];
            for mask in masks {
                let query = Query {
                    layer: 0,
                    kv_head: 1,
                    kv_heads: 1,
                    head_dim: hd,
                    q: &q,
                    scale: 1.0 / (hd as f32).sqrt(),
                    mask,
                };
                let want = reference(&s, &table, n_kv, &query);
                let mut vis = Vec::new();
                visible_blocks(n_kv, bs, &mask, &mut vis);
                let mut scratch = Scratch::default();
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                for lvl in SimdLevel::available() {
                    for per in [1usize, 3, 4] {
                        let mut out = vec![f32::NAN; g * hd];
                        attend_chunked(lvl, &s, &table, n_kv, &query, &mut out, &mut scratch, per)
                            .unwrap();
                        let e = max_err(&out, &want);
                        assert!(e < 2e-5, "{ty:?} {lvl:?} per={per}: error {e}");
                        let parts: Vec<Vec<f32>> = vis
                            .chunks(per)
                            .map(|run| {
                                let mut p = vec![f32::NAN; partial_len(g, hd)];
                                let mut sc = Scratch::default();
                                chunk_state(lvl, &s, &table, n_kv, run, &query, &mut p, &mut sc)
                                    .unwrap();
                                p
                            })
                            .collect();
                        let mut merged = vec![f32::NAN; g * hd];
                        let it = parts.iter().map(|p| &p[..]);
                        merge_chunks(g, hd, it, &mut merged, &mut scratch);
                        assert_eq!(
                            bits(&merged),
                            bits(&out),
                            "{ty:?} {lvl:?} per={per}: merged chunk states differ from attend"
                        );
                        // The hidden blocks before the first visible one, dropped.
                        let drop = vis[0];
                        if drop > 0 {
                            let (t2, p2) = (&table[drop..], &positions[drop * bs..]);
                            let mask2 = match mask {
                                Mask::Window { qpos, window, .. } => Mask::Window {
                                    positions: p2,
                                    qpos,
                                    window,
                                },
                                _ => unreachable!("only the window mask hides the front"),
                            };
                            let q2 = Query {
                                mask: mask2,
                                ..query
                            };
                            let mut pruned = vec![f32::NAN; g * hd];
                            let n2 = n_kv - drop * bs;
                            attend_chunked(lvl, &s, t2, n2, &q2, &mut pruned, &mut scratch, per)
                                .unwrap();
                            assert_eq!(bits(&pruned), bits(&out), "{ty:?} {lvl:?} per={per}");
                        }
                    }
                    // One chunk of every block is the default chunking for a short sequence.
                    let short = 3 * bs;
                    let (mut a, mut b) = (vec![0.0; g * hd], vec![0.0; g * hd]);
                    attend_at(lvl, &s, &table, short, &query, &mut a, &mut scratch).unwrap();
                    attend_chunked(lvl, &s, &table, short, &query, &mut b, &mut scratch, 13)
                        .unwrap();
                    assert_eq!(bits(&a), bits(&b));
                }
            }
        }
        // Chunk counts: at least one, whole blocks per chunk.
        let per = chunk_blocks(16);
        assert_eq!(per * 16, CHUNK_CELLS);
        assert_eq!(n_chunks(0, 16), 1);
        assert_eq!(n_chunks(per, 16), 1);
        assert_eq!(n_chunks(per + 1, 16), 2);
        assert_eq!(chunk_blocks(CHUNK_CELLS * 2), 1);
        // A wrong-sized chunk state, or a block outside the cells, is an error, not a panic.
        let layout = KvLayout {
            ty: KvType::F16,
            n_layers: 1,
            kv_dim: 64,
            block_size: 16,
        };
        let s = KvStorage::new(layout, 2).unwrap();
        let q = vec![0.5; 64];
        let query = Query {
            layer: 0,
            kv_head: 0,
            kv_heads: 1,
            head_dim: 64,
            q: &q,
            scale: 0.125,
            mask: Mask::All,
        };
        let mut sc = Scratch::default();
        assert!(attend_chunk(&s, &[0], 16, &[0], &query, &mut [0.0; 10], &mut sc).is_err());
        let mut p = vec![0.0; partial_len(1, 64)];
        assert!(attend_chunk(&s, &[0, 1], 16, &[1], &query, &mut p, &mut sc).is_err());
        assert!(attend_chunk(&s, &[0, 1], 32, &[1], &query, &mut p, &mut sc).is_ok());
    }

    /// The AVX-512 exponential of the softmax against its scalar twin (`f32::exp`): a few
    /// ulps over the range scores take, exactly 0 for `-inf` and below the normal range, and
    /// the sums within f32 rounding; row lengths with a masked tail.
    /// Several KV heads in one query give, head for head, the bits of one query per KV head,
    /// at every level, with every mask and chunk size; and their chunk states merge to the
    /// same bits.
    #[test]
    fn kv_heads_together_give_each_heads_bits() {
        let mut rng = Rng(11);
        // (type, head_dim, n_kv_heads, block_size, group): SmolLM2's 3 x 64 with groups of 3.
        let cases = [
            (KvType::F16, 64, 3, 16, 3),
            (KvType::Q8_0, 64, 3, 16, 3),
            (KvType::F32, 24, 4, 5, 2),
            (KvType::F16, 80, 2, 7, 5),
        ];
        for (ty, hd, n_kv_heads, bs, g) in cases {
            let layout = KvLayout {
                ty,
                n_layers: 2,
                kv_dim: hd * n_kv_heads,
                block_size: bs,
            };
            let mut s = KvStorage::new(layout, 40).unwrap();
            let n_kv = 9 * bs + 4;
            let table = rng.table(40, 10);
            fill(&mut s, &table, n_kv, &mut rng);
            let positions: Vec<i32> = (0..n_kv as i32)
                .map(|p| if p == 6 { -1 } else { p })
                .collect();
            let q = rng.normals(n_kv_heads * g * hd, 1.0);
            let masks = [
                Mask::All,
                Mask::Causal {
                    positions: &positions,
                    qpos: (n_kv / 2) as i32,
                },
                Mask::Window {
                    positions: &positions,
                    qpos: n_kv as i32 - 1,
                    window: 3 * bs as i32 + 1,
                },
            ];
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            // Head ranges: all heads, and a middle range where there are enough.
            let ranges = [(0, n_kv_heads), (1, n_kv_heads - 1)];
            for mask in masks {
                for (kh0, nh) in ranges {
                    let qs = &q[kh0 * g * hd..(kh0 + nh) * g * hd];
                    let together = Query {
                        layer: 1,
                        kv_head: kh0,
                        kv_heads: nh,
                        head_dim: hd,
                        q: qs,
                        scale: 1.0 / (hd as f32).sqrt(),
                        mask,
                    };
                    let mut scratch = Scratch::default();
                    let mut vis = Vec::new();
                    visible_blocks(n_kv, bs, &mask, &mut vis);
                    for lvl in SimdLevel::available() {
                        for per in [2usize, 64] {
                            let mut out = vec![f32::NAN; nh * g * hd];
                            attend_chunked(
                                lvl,
                                &s,
                                &table,
                                n_kv,
                                &together,
                                &mut out,
                                &mut scratch,
                                per,
                            )
                            .unwrap();
                            for kh in 0..nh {
                                let cols = kh * g * hd..(kh + 1) * g * hd;
                                let alone = Query {
                                    kv_head: kh0 + kh,
                                    kv_heads: 1,
                                    q: &qs[cols.clone()],
                                    ..together
                                };
                                let mut one = vec![f32::NAN; g * hd];
                                attend_chunked(
                                    lvl,
                                    &s,
                                    &table,
                                    n_kv,
                                    &alone,
                                    &mut one,
                                    &mut scratch,
                                    per,
                                )
                                .unwrap();
                                assert_eq!(
                                    bits(&out[cols]),
                                    bits(&one),
                                    "{ty:?} {lvl:?} per={per} kv head {}",
                                    kh0 + kh
                                );
                                let e = max_err(&one, &reference(&s, &table, n_kv, &alone));
                                assert!(e < 2e-5, "{ty:?} {lvl:?}: error {e}");
                            }
                            let parts: Vec<Vec<f32>> = vis
                                .chunks(per)
                                .map(|run| {
                                    let mut p = vec![f32::NAN; partial_len(nh * g, hd)];
                                    let mut sc = Scratch::default();
                                    chunk_state(
                                        lvl, &s, &table, n_kv, run, &together, &mut p, &mut sc,
                                    )
                                    .unwrap();
                                    p
                                })
                                .collect();
                            let mut merged = vec![f32::NAN; nh * g * hd];
                            let it = parts.iter().map(|p| &p[..]);
                            merge_chunks(nh * g, hd, it, &mut merged, &mut scratch);
                            assert_eq!(bits(&merged), bits(&out), "{ty:?} {lvl:?} per={per}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn exp_shift_sum_matches_scalar() {
        let mut rng = Rng(9);
        let levels: Vec<SimdLevel> = SimdLevel::available()
            .into_iter()
            .filter(|&l| l >= SimdLevel::Avx2)
            .collect();
        for &lvl in &levels {
            for n in [1usize, 5, 16, 23, 64] {
                for spread in [0.01f32, 1.0, 10.0, 60.0] {
                    let mut row: Vec<f32> = rng.normals(n, spread);
                    let masked = n / 2 + 1; // a masked cell (row[0] keeps the maximum finite)
                    if n > 1 {
                        row[masked] = f32::NEG_INFINITY;
                    }
                    if n > 5 {
                        row[1] = -200.0;
                        row[2] = -87.0;
                    }
                    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) + 0.25;
                    let mut want = row.clone();
                    let ws = exp_shift_sum_scalar(&mut want, m);
                    let mut got = row.clone();
                    let gs = exp_shift_sum(lvl, &mut got, m);
                    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        let tol = 4.0 * f32::EPSILON * w;
                        assert!(
                            (g - w).abs() <= tol || (w < f32::MIN_POSITIVE && g == 0.0),
                            "n={n} spread={spread} i={i} x={}: {g} vs {w}",
                            row[i] - m
                        );
                    }
                    if n > 1 {
                        assert_eq!(got[masked], 0.0);
                    }
                    assert!((gs - ws).abs() <= 8.0 * f32::EPSILON * ws, "{gs} vs {ws}");
                }
            }
        }
        let line = format!(
            "simd coverage: attention softmax exp: scalar vs {:?} (this CPU: {})\n",
            levels.iter().map(|l| l.name()).collect::<Vec<_>>(),
            simd::detect().name()
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        if simd::detect() >= SimdLevel::Avx2 {
            assert!(!levels.is_empty());
        }
    }

    #[test]
    fn masked_and_empty_cases() {
        let layout = KvLayout {
            ty: KvType::F16,
            n_layers: 1,
            kv_dim: 32,
            block_size: 4,
        };
        let mut s = KvStorage::new(layout, 4).unwrap();
        let table = [3u32, 1, 0];
        let mut rng = Rng(7);
        fill(&mut s, &table, 10, &mut rng);
        let q = rng.normals(32, 1.0);
        let mut out = vec![0.0; 32];
        let mut scratch = Scratch::default();
        // Only cell 6 visible: the output is exactly its value row.
        let only6 = |i: usize| i == 6;
        let query = Query {
            layer: 0,
            kv_head: 0,
            kv_heads: 1,
            head_dim: 32,
            q: &q,
            scale: 0.2,
            mask: Mask::Custom(&only6),
        };
        attend(&s, &table, 10, &query, &mut out, &mut scratch).unwrap();
        let mut v = vec![0.0; 32];
        s.read_v(0, 1, 2, &mut v).unwrap();
        assert_eq!(out, v);
        // Nothing visible: zeros.
        let none = |_: usize| false;
        let q0 = Query {
            mask: Mask::Custom(&none),
            ..query
        };
        attend(&s, &table, 10, &q0, &mut out, &mut scratch).unwrap();
        assert!(out.iter().all(|&x| x == 0.0));
        // Cells past n_kv are never read: a table of exactly ceil(n_kv / bs) blocks suffices.
        attend(&s, &table[..2], 5, &query, &mut out, &mut scratch).unwrap();
        assert!(out.iter().all(|&x| x == 0.0));
        // Huge scores stay finite (stable softmax).
        let big: Vec<f32> = q.iter().map(|x| x * 1e4).collect();
        let qb = Query {
            q: &big,
            mask: Mask::All,
            ..query
        };
        attend(&s, &table, 10, &qb, &mut out, &mut scratch).unwrap();
        assert!(out.iter().all(|x| x.is_finite()));
    }

    /// A masked cell is never read into the output: non-finite keys and values stored in
    /// it (garbage of a cell beyond the query, say) change nothing, at every level and type.
    #[test]
    fn masked_cells_with_non_finite_values_change_nothing() {
        let mut rng = Rng(13);
        for ty in [KvType::F32, KvType::F16, KvType::Q8_0] {
            let (hd, g, bs) = (64, 3, 8);
            let layout = KvLayout {
                ty,
                n_layers: 1,
                kv_dim: hd,
                block_size: bs,
            };
            let mut s = KvStorage::new(layout, 4).unwrap();
            let table = [2u32, 0, 3];
            let n_kv = 20;
            fill(&mut s, &table, n_kv, &mut rng);
            let q = rng.normals(g * hd, 1.0);
            let hidden = |i: usize| i != 5 && i != 17;
            let query = Query {
                layer: 0,
                kv_head: 0,
                kv_heads: 1,
                head_dim: hd,
                q: &q,
                scale: 0.125,
                mask: Mask::Custom(&hidden),
            };
            let mut scratch = Scratch::default();
            let mut want = Vec::new();
            for lvl in SimdLevel::available() {
                let mut out = vec![f32::NAN; g * hd];
                attend_at(lvl, &s, &table, n_kv, &query, &mut out, &mut scratch).unwrap();
                want.push(out);
            }
            for (i, bad) in [(5usize, f32::NAN), (17, f32::INFINITY)] {
                let row = vec![bad; hd];
                s.write(0, table[i / bs], i % bs, &row, &row).unwrap();
            }
            for (lvl, want) in SimdLevel::available().into_iter().zip(&want) {
                let mut out = vec![f32::NAN; g * hd];
                attend_at(lvl, &s, &table, n_kv, &query, &mut out, &mut scratch).unwrap();
                assert!(out.iter().all(|x| x.is_finite()), "{ty:?} {lvl:?}");
                assert_eq!(&out, want, "{ty:?} {lvl:?}");
            }
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        let layout = KvLayout {
            ty: KvType::Q8_0,
            n_layers: 1,
            kv_dim: 64,
            block_size: 4,
        };
        let s = KvStorage::new(layout, 2).unwrap();
        let q = vec![0.0; 32];
        let mut out = vec![0.0; 32];
        let mut sc = Scratch::default();
        let ok = Query {
            layer: 0,
            kv_head: 1,
            kv_heads: 1,
            head_dim: 32,
            q: &q,
            scale: 1.0,
            mask: Mask::All,
        };
        assert!(attend(&s, &[0, 1], 8, &ok, &mut out, &mut sc).is_ok());
        assert!(attend(&s, &[0, 1], 9, &ok, &mut out, &mut sc).is_err());
        assert!(attend(&s, &[0, 2], 8, &ok, &mut out, &mut sc).is_err());
        let bad_head = Query { kv_head: 2, ..ok };
        assert!(attend(&s, &[0], 4, &bad_head, &mut out, &mut sc).is_err());
        // Two KV heads from head 1 of 2; no KV head; q not a multiple of the two heads' rows.
        let past_end = Query { kv_heads: 2, ..ok };
        assert!(attend(&s, &[0], 4, &past_end, &mut out, &mut sc).is_err());
        let no_head = Query { kv_heads: 0, ..ok };
        assert!(attend(&s, &[0], 4, &no_head, &mut out, &mut sc).is_err());
        let (q3, mut out3) = (vec![0.0; 96], vec![0.0; 96]);
        let odd = Query {
            kv_head: 0,
            kv_heads: 2,
            q: &q3,
            ..ok
        };
        assert!(attend(&s, &[0], 4, &odd, &mut out3, &mut sc).is_err());
        let (q4, mut out4) = (vec![0.0; 128], vec![0.0; 128]);
        let two = Query { q: &q4, ..odd };
        assert!(attend(&s, &[0], 4, &two, &mut out4, &mut sc).is_ok());
        let bad_layer = Query { layer: 1, ..ok };
        assert!(attend(&s, &[0], 4, &bad_layer, &mut out, &mut sc).is_err());
        let bad_hd = Query {
            head_dim: 16,
            kv_head: 0,
            kv_heads: 1,
            ..ok
        };
        assert!(attend(&s, &[0], 4, &bad_hd, &mut out, &mut sc).is_err());
        let pos = [0, 1, 2];
        let short = Query {
            mask: Mask::Causal {
                positions: &pos,
                qpos: 5,
            },
            ..ok
        };
        assert!(attend(&s, &[0], 4, &short, &mut out, &mut sc).is_err());
        assert!(attend(&s, &[0], 4, &ok, &mut out[..16], &mut sc).is_err());
    }
}
