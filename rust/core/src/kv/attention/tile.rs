//! Attention of a *tile* of query tokens of one sequence (a prompt's consecutive tokens, each
//! with its own mask): [`attend_tile`] gives every token of the tile exactly the bits
//! [`super::attend`] gives it alone, while each block's keys and values are read and converted
//! to f32 once for the whole tile instead of once per token.
//!
//! Only the arithmetic's *layout* changes, never its order. The single-token AVX-512 kernel
//! sums a score `q · k` (`head_dim` a multiple of 16) in 16 lanes, lane `l` taking dimensions
//! `l, l + 16, l + 32, ...` by fused multiply-adds in that order, then folds lane `l` with
//! lane `l + 8` and the eight results by a fixed tree: `((b0 + b1) + (b2 + b3)) + ((b4 + b5) +
//! (b6 + b7))`, and multiplies by the scale. The tile kernel puts 16 query *rows* (token x
//! head) in the lanes instead: the tile's queries are transposed once (`qt[d]`: dimension `d`
//! of 16 rows), and a cell's 16 scores are 16 accumulators `A_l = sum_c qt[c + l] * k[c + l]`
//! (the same fused chain per lane, a key value broadcast), folded by the same tree, with no
//! horizontal reduction per score. The value pass keeps a row's output columns in the lanes
//! (one fused multiply-add per visible cell in cell order, zero weights skipped); the softmax
//! between the two passes is the single-token one lane by lane (its block maxima, rescaling
//! by the scalar `exp`, weights by the same vector `exp`, their sum in the same order), on the
//! same block and chunk boundaries.
//!
//! The AVX2 kernels (`x86::avx2`) do the same with 8 rows a vector against the single-token
//! AVX2 kernels: 8 accumulators per score (dimensions `l, l + 8, ...`) folded by
//! `((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))`, the block's weights summed 8 cells
//! apart and then by `hsum256`'s tree. `cargo bench --bench kv`'s `prompt_tile` measured them
//! at 1.5-1.7x the per-token kernel on a Zen 3 core (the AVX-512 ones: 2.1x on a Xeon).
//!
//! The fast path needs AVX2 (or AVX-512), F32 or F16 K/V and `head_dim` a multiple of 16
//! (SmolLM2's and Gemma 3's geometry); anything else runs the single-token kernel token by
//! token, which gives the same bits by definition.

use super::{attend_chunked, chunk_blocks, Geometry, Query, Scratch};
use crate::error::{invalid, Result};
use crate::kv::storage::{KvStorage, KvType};
use crate::quant::simd::{self, SimdLevel};

/// Tokens a caller should put in one tile: enough to share each block's conversion and
/// transposition widely, few enough that a prompt's tiles still spread over the team.
pub const TILE_TOKENS: usize = 16;

/// Buffers of the tile path, kept in [`Scratch`]. Per (KV head, row vector): `hd x 16`
/// values of transposed queries, chunk output and folded output, and 16 of each max and sum
/// (`hd x 8` and 8 for the AVX2 kernels).
#[derive(Default, Debug)]
pub(super) struct TileScratch {
    qt: Vec<f32>,
    co: Vec<f32>,
    cm: Vec<f32>,
    cs: Vec<f32>,
    fo: Vec<f32>,
    fm: Vec<f32>,
    fs: Vec<f32>,
    /// Per row vector, each lane's score scale.
    scale: Vec<f32>,
    /// A block's keys and values of one KV head as f32 (`block_size x head_dim`).
    kf: Vec<f32>,
    vf: Vec<f32>,
    /// Per cell of the block, a row vector's scores (16 or 8 rows), then their weights.
    sb: Vec<f32>,
    /// Per row vector: the lanes whose token sees the block; per (row vector, cell): the
    /// lanes for which the cell is masked; the lanes whose chunk ends at the block.
    seen: Vec<u16>,
    hid: Vec<u16>,
    fold: Vec<u16>,
    /// Per token, visible blocks in its current chunk.
    count: Vec<usize>,
    /// The tokens that see the block, and their masked cells (`hidden[at[w]..at[w + 1]]`).
    who: Vec<usize>,
    hidden: Vec<usize>,
    at: Vec<usize>,
}

/// Attention of each of `queries` (tokens of one sequence: the same table, `n_kv`, layer, KV
/// heads and head size; each its own `q`, scale and mask) over cells `0..n_kv` of `table`;
/// token `i`'s output goes to `out[i * q.len()..][..q.len()]`. Bit for bit what
/// [`super::attend`] gives each token alone.
pub fn attend_tile(
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    queries: &[Query],
    out: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    attend_tile_at(simd::level(), store, table, n_kv, queries, out, scratch)
}

/// [`attend_tile`] with an explicit kernel level (capped at what the CPU supports).
pub fn attend_tile_at(
    lvl: SimdLevel,
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    queries: &[Query],
    out: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    let chunk = chunk_blocks(store.block_size());
    tile_chunked(lvl, store, table, n_kv, queries, out, scratch, chunk)
}

/// [`attend_tile_at`] with `chunk` visible blocks per chunk (tests take small chunks).
#[allow(clippy::too_many_arguments)]
pub(super) fn tile_chunked(
    lvl: SimdLevel,
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    queries: &[Query],
    out: &mut [f32],
    scratch: &mut Scratch,
    chunk: usize,
) -> Result<()> {
    let Some(q0) = queries.first() else {
        return if out.is_empty() {
            Ok(())
        } else {
            Err(invalid("attention: an empty tile has no output"))
        };
    };
    let ql = q0.q.len();
    if out.len() != queries.len() * ql {
        return Err(invalid(format!(
            "attention: a tile of {} queries of {ql} values needs {} outputs, got {}",
            queries.len(),
            queries.len() * ql,
            out.len()
        )));
    }
    check_queries(store, table, n_kv, queries)?;
    let lvl = simd::cap(lvl);
    if !fast_path(lvl, store.kv_type(), q0.head_dim, queries.len()) {
        for (q, o) in queries.iter().zip(out.chunks_exact_mut(ql)) {
            attend_chunked(lvl, store, table, n_kv, q, o, scratch, chunk)?;
        }
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    {
        let geo = Geometry::check(store, table, n_kv, q0, ql)?;
        let out = Out::Rows(out);
        if lvl >= SimdLevel::Avx512 {
            tiled::<x86::W16>(&geo, store, table, n_kv, queries, out, scratch, chunk);
        } else {
            tiled::<x86::W8>(&geo, store, table, n_kv, queries, out, scratch, chunk);
        }
    }
    Ok(())
}

/// The softmax state of each of `queries` over cells `0..n_kv` of `table`, folded over its
/// chunks and not normalized: [`super::partial_len`]`(heads, head_dim)` values per query in
/// `states` (query `i`'s from `i * len`), every head's output, then maxima, then sums, as
/// [`super::attend_chunk`] writes one chunk's. The queries may belong to different
/// sequences that share these blocks (each with its own mask): given first to
/// [`super::merge_chunks`], followed by the states of a query's later chunks, such a state
/// gives [`super::attend`]'s bits, provided every query's visible blocks here are whole
/// chunks (`n_kv` cells in a multiple of [`super::chunk_blocks`] blocks, all seen by every
/// query). This is how a decode step's users of one cached document read its K/V once
/// between them.
pub fn attend_tile_states(
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    queries: &[Query],
    states: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    let chunk = chunk_blocks(store.block_size());
    let Some(q0) = queries.first() else {
        return if states.is_empty() {
            Ok(())
        } else {
            Err(invalid("attention: no queries have no states"))
        };
    };
    let (hd, ql) = (q0.head_dim, q0.q.len());
    if !ql.is_multiple_of(hd) {
        return Err(invalid("attention: query rows are not whole heads"));
    }
    let len = super::partial_len(ql / hd, hd);
    if states.len() != queries.len() * len {
        return Err(invalid(format!(
            "attention: {} queries' states need {} values, got {}",
            queries.len(),
            queries.len() * len,
            states.len()
        )));
    }
    check_queries(store, table, n_kv, queries)?;
    let lvl = simd::cap(simd::level());
    if !fast_path(lvl, store.kv_type(), hd, queries.len()) {
        // Token by token: each chunk's state folded from empty, as `merge_chunks` does.
        let heads = ql / hd;
        for (q, st) in queries.iter().zip(states.chunks_exact_mut(len)) {
            super::folded_state(lvl, store, table, n_kv, q, heads, st, scratch, chunk)?;
        }
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    {
        let geo = Geometry::check(store, table, n_kv, q0, ql)?;
        let out = Out::States(states);
        if lvl >= SimdLevel::Avx512 {
            tiled::<x86::W16>(&geo, store, table, n_kv, queries, out, scratch, chunk);
        } else {
            tiled::<x86::W8>(&geo, store, table, n_kv, queries, out, scratch, chunk);
        }
    }
    Ok(())
}

/// Where [`tiled`] puts its results: normalized rows, or folded states.
#[cfg(target_arch = "x86_64")]
enum Out<'o> {
    Rows(&'o mut [f32]),
    States(&'o mut [f32]),
}

/// Checks that `queries` (at least one) share layer, KV heads and head size, and that each
/// fits `table` and `n_kv` ([`Geometry::check`]).
fn check_queries(store: &KvStorage, table: &[u32], n_kv: usize, queries: &[Query]) -> Result<()> {
    let q0 = &queries[0];
    let shape = |q: &Query| (q.layer, q.kv_head, q.kv_heads, q.head_dim, q.q.len());
    for q in queries {
        if shape(q) != shape(q0) {
            return Err(invalid(
                "attention: a tile's queries differ in layer, KV heads or head size",
            ));
        }
        Geometry::check(store, table, n_kv, q, q0.q.len())?;
    }
    Ok(())
}

/// Whether a tile of `tokens` queries at level `lvl` (already capped) takes the tile kernels
/// (AVX-512 or AVX2); otherwise each token runs the single-token kernel.
pub(super) fn fast_path(lvl: SimdLevel, ty: KvType, head_dim: usize, tokens: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && lvl >= SimdLevel::Avx2
        && ty != KvType::Q8_0
        && head_dim.is_multiple_of(16)
        && tokens > 1
}

/// The positions of a block's cells `base..base + n` in one positions slice: the least and
/// the greatest of those `>= 0` (`i32::MAX`/`i32::MIN` when none), and whether any is `< 0`
/// (an empty cell).
#[derive(Clone, Copy)]
struct BlockPositions {
    of: (*const i32, usize),
    lo: i32,
    hi: i32,
    empty: bool,
}

impl BlockPositions {
    fn of(positions: &[i32], base: usize, n: usize) -> BlockPositions {
        let (mut lo, mut hi, mut empty) = (i32::MAX, i32::MIN, false);
        for &p in &positions[base..base + n] {
            if p < 0 {
                empty = true;
            } else {
                lo = lo.min(p);
                hi = hi.max(p);
            }
        }
        BlockPositions {
            of: (positions.as_ptr(), positions.len()),
            lo,
            hi,
            empty,
        }
    }
}

/// Whether `mask` hides every cell of `base..base + n` (`Some(true)`), none (`Some(false)`),
/// or some (`None`: ask cell by cell), from the block's positions (computed once per
/// positions slice in `stats`). The same answers as [`super::Mask::visible`] per cell.
fn block_hidden(
    mask: &super::Mask,
    base: usize,
    n: usize,
    stats: &mut Option<BlockPositions>,
) -> Option<bool> {
    use super::Mask;
    let (positions, qpos, window) = match *mask {
        Mask::All => return Some(false),
        Mask::Custom(_) => return None,
        Mask::Causal { positions, qpos } => (positions, qpos, None),
        Mask::Window {
            positions,
            qpos,
            window,
        } => (positions, qpos, Some(window)),
    };
    let st = match stats {
        Some(st) if st.of == (positions.as_ptr(), positions.len()) => *st,
        _ => *stats.insert(BlockPositions::of(positions, base, n)),
    };
    let q = i64::from(qpos);
    // No cell at or before the query (or none at all): all hidden.
    if i64::from(st.lo) > q {
        return Some(true);
    }
    match window {
        None => (!st.empty && i64::from(st.hi) <= q).then_some(false),
        Some(w) => {
            // `qpos - p` as the per-cell test computes it, in i32: only where it cannot wrap.
            let (d_lo, d_hi) = (q - i64::from(st.lo), q - i64::from(st.hi));
            let fits = |d: i64| i32::try_from(d).is_ok();
            if !fits(d_lo) || !fits(d_hi) {
                return None;
            }
            let w = i64::from(w);
            if d_hi >= w {
                // Every cell is at least `window` before the query (or after it).
                return Some(true);
            }
            (!st.empty && d_hi >= 0 && d_lo < w).then_some(false)
        }
    }
}

/// The tile path (F32/F16, `head_dim` a multiple of 16) with the kernels of `K`: `K::L`
/// rows in the lanes of each vector (16 for AVX-512, 8 for AVX2); the caller checked that the
/// CPU has `K`'s level (`fast_path`).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn tiled<K: x86::Lanes>(
    geo: &Geometry,
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    queries: &[Query],
    out: Out<'_>,
    scratch: &mut Scratch,
    chunk: usize,
) {
    let lanes = K::L;
    let q0 = &queries[0];
    let ty = store.kv_type();
    let (gt, g, hd, bs, nq) = (
        geo.g,
        geo.group,
        q0.head_dim,
        store.block_size(),
        queries.len(),
    );
    let (kvh, seg, ql) = (q0.kv_heads, ty.row_bytes(hd), gt * hd);
    // Row r = token * g + head of the group; vector r / L, lane r % L (every KV head alike).
    let nr = nq * g;
    let nv = nr.div_ceil(lanes);
    let TileScratch {
        qt,
        co,
        cm,
        cs,
        fo,
        fm,
        fs,
        scale,
        kf,
        vf,
        sb,
        seen,
        hid,
        fold,
        count,
        who,
        hidden,
        at,
    } = &mut scratch.tile;
    let vecs = kvh * nv;
    let big = vecs * hd * lanes;
    qt.resize(big, 0.0);
    for buf in [&mut *co, &mut *fo] {
        buf.clear();
        buf.resize(big, 0.0);
    }
    for (buf, x) in [
        (&mut *cm, f32::NEG_INFINITY),
        (&mut *fm, f32::NEG_INFINITY),
        (&mut *cs, 0.0),
        (&mut *fs, 0.0),
    ] {
        buf.clear();
        buf.resize(vecs * lanes, x);
    }
    scale.clear();
    scale.resize(nv * lanes, 0.0);
    for r in 0..nr {
        scale[r] = queries[r / g].scale;
    }
    kf.resize(bs * hd, 0.0);
    vf.resize(bs * hd, 0.0);
    sb.resize(bs * lanes, 0.0);
    seen.resize(nv, 0);
    hid.resize(nv * bs, 0);
    fold.resize(nv, 0);
    count.clear();
    count.resize(nq, 0);
    // The queries, transposed: per (KV head, vector), dimension d of its L rows.
    let row_q = |kh: usize, r: usize| -> Option<&[f32]> {
        (r < nr).then(|| {
            let (i, h) = (r / g, r % g);
            &queries[i].q[(kh * g + h) * hd..(kh * g + h + 1) * hd]
        })
    };
    for kh in 0..kvh {
        for v in 0..nv {
            let rows: [Option<&[f32]>; 16] =
                std::array::from_fn(|l| (l < lanes).then(|| row_q(kh, v * lanes + l)).flatten());
            let dst = &mut qt[(kh * nv + v) * hd * lanes..][..hd * lanes];
            // SAFETY: K's level (the caller's `fast_path`); each row holds hd values, dst
            // hd x L.
            unsafe { K::transpose_in(&rows, hd, dst) };
        }
    }
    let layer = q0.layer;
    for bi in 0..geo.nb {
        let base = bi * bs;
        let n = bs.min(n_kv - base);
        // The tokens that see a cell of the block, with their masked cells.
        who.clear();
        hidden.clear();
        at.clear();
        at.push(0);
        let mut stats: Option<BlockPositions> = None;
        for (i, q) in queries.iter().enumerate() {
            match block_hidden(&q.mask, base, n, &mut stats) {
                Some(true) => continue,
                Some(false) => {
                    who.push(i);
                    at.push(hidden.len());
                    continue;
                }
                None => {}
            }
            let before = hidden.len();
            hidden.extend((0..n).filter(|&j| !q.mask.visible(base + j)));
            if hidden.len() - before == n {
                hidden.truncate(before);
                continue;
            }
            who.push(i);
            at.push(hidden.len());
        }
        if who.is_empty() {
            continue;
        }
        seen.fill(0);
        hid[..nv * n].fill(0);
        for (wi, &i) in who.iter().enumerate() {
            for h in 0..g {
                let r = i * g + h;
                let (v, bit) = (r / lanes, 1u16 << (r % lanes));
                seen[v] |= bit;
                for &j in &hidden[at[wi]..at[wi + 1]] {
                    hid[v * n + j] |= bit;
                }
            }
        }
        let blk = table[bi] as usize;
        let (krows, vrows) = (store.rows(layer, blk, false), store.rows(layer, blk, true));
        for kh in 0..kvh {
            let off = geo.seg_off + kh * seg;
            assert!((n - 1) * geo.stride + off + seg <= krows.len().min(vrows.len()));
            // SAFETY: K's level (`fast_path`); the assert keeps the n segments of hd values
            // inside `krows` and `vrows`; kf and vf hold block_size x hd values.
            unsafe {
                let (k, v) = (krows.as_ptr().add(off), vrows.as_ptr().add(off));
                let f16 = ty != KvType::F32;
                K::values_f32(f16, k, geo.stride, n, hd, kf.as_mut_ptr());
                K::values_f32(f16, v, geo.stride, n, hd, vf.as_mut_ptr());
            }
            for v in (0..nv).filter(|&v| seen[v] != 0) {
                let x = kh * nv + v;
                let st = x86::State {
                    o: co[x * hd * lanes..][..hd * lanes].as_mut_ptr(),
                    m: cm[x * lanes..][..lanes].as_mut_ptr(),
                    s: cs[x * lanes..][..lanes].as_mut_ptr(),
                };
                // SAFETY: K's level (`fast_path`); qt's vector holds hd x L values, kf and vf
                // n x hd, sb n x L, hid n masks from v * n, the state hd x L + L + L.
                unsafe {
                    K::scores_t(
                        qt[x * hd * lanes..].as_ptr(),
                        hd,
                        kf.as_ptr(),
                        n,
                        scale[v * lanes..].as_ptr(),
                        &hid[v * n..(v + 1) * n],
                        sb.as_mut_ptr(),
                    );
                    K::softmax_t(sb.as_mut_ptr(), n, seen[v], hd, &st);
                    K::values_t(sb.as_ptr(), n, vf.as_ptr(), hd, st.o);
                }
            }
        }
        // Chunk ends: fold the chunk state of the tokens that saw `chunk` visible blocks.
        fold.fill(0);
        for &i in who.iter() {
            count[i] += 1;
            if count[i] == chunk {
                count[i] = 0;
                for h in 0..g {
                    let r = i * g + h;
                    fold[r / lanes] |= 1 << (r % lanes);
                }
            }
        }
        fold_lanes::<K>(fold, kvh, nv, hd, co, cm, cs, fo, fm, fs);
    }
    // The last chunks, then normalization and the outputs in token-major rows.
    fold.fill(0);
    for (i, &c) in count.iter().enumerate() {
        if c > 0 {
            for h in 0..g {
                let r = i * g + h;
                fold[r / lanes] |= 1 << (r % lanes);
            }
        }
    }
    fold_lanes::<K>(fold, kvh, nv, hd, co, cm, cs, fo, fm, fs);
    let out = match out {
        Out::Rows(out) => out,
        Out::States(states) => {
            // Row r = (token i, head h of KV head kh): lane r % L of vector kh * nv + r / L.
            let len = super::partial_len(gt, hd);
            for (i, st) in states.chunks_exact_mut(len).enumerate() {
                let (o, rest) = st.split_at_mut(gt * hd);
                let (m, s) = rest.split_at_mut(gt);
                for kh in 0..kvh {
                    for h in 0..g {
                        let (r, head) = (i * g + h, kh * g + h);
                        let (x, l) = (kh * nv + r / lanes, r % lanes);
                        for (d, od) in o[head * hd..(head + 1) * hd].iter_mut().enumerate() {
                            *od = fo[(x * hd + d) * lanes + l];
                        }
                        m[head] = fm[x * lanes + l];
                        s[head] = fs[x * lanes + l];
                    }
                }
            }
            return;
        }
    };
    for kh in 0..kvh {
        for v in 0..nv {
            let x = kh * nv + v;
            let mut rows: [Option<&mut [f32]>; 16] = Default::default();
            let mut rest = &mut out[..];
            let mut taken = 0;
            for (l, slot) in rows.iter_mut().enumerate().take(lanes) {
                let r = v * lanes + l;
                if r >= nr {
                    break;
                }
                let (i, h) = (r / g, r % g);
                let at = i * ql + (kh * g + h) * hd;
                let tail = std::mem::take(&mut rest);
                let (_, from) = tail.split_at_mut(at - taken);
                let (row, after) = from.split_at_mut(hd);
                *slot = Some(row);
                rest = after;
                taken = at + hd;
            }
            // SAFETY: K's level (`fast_path`); the state holds hd x L + L values, each row hd.
            unsafe {
                K::finish_out(
                    fo[x * hd * lanes..][..hd * lanes].as_mut_ptr(),
                    fs[x * lanes..][..lanes].as_ptr(),
                    hd,
                    &mut rows,
                )
            };
        }
    }
}

/// Folds the chunk state of the lanes in `fold` (per row vector, every KV head) into the
/// folded state and empties it (`fold_chunk`, then `empty_state`, lane by lane).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn fold_lanes<K: x86::Lanes>(
    fold: &[u16],
    kvh: usize,
    nv: usize,
    hd: usize,
    co: &mut [f32],
    cm: &mut [f32],
    cs: &mut [f32],
    fo: &mut [f32],
    fm: &mut [f32],
    fs: &mut [f32],
) {
    let lanes = K::L;
    for kh in 0..kvh {
        for (v, &mask) in fold.iter().enumerate().take(nv) {
            if mask == 0 {
                continue;
            }
            let x = kh * nv + v;
            let chunk = x86::State {
                o: co[x * hd * lanes..][..hd * lanes].as_mut_ptr(),
                m: cm[x * lanes..][..lanes].as_mut_ptr(),
                s: cs[x * lanes..][..lanes].as_mut_ptr(),
            };
            let folded = x86::State {
                o: fo[x * hd * lanes..][..hd * lanes].as_mut_ptr(),
                m: fm[x * lanes..][..lanes].as_mut_ptr(),
                s: fs[x * lanes..][..lanes].as_mut_ptr(),
            };
            // SAFETY: K's level (`fast_path`); both states hold hd x L + L + L values.
            unsafe { K::fold_t(mask, hd, &chunk, &folded) };
        }
    }
}

/// AVX-512 kernels of the tile path: 16 rows in the lanes of each vector.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::x86::exp_neg512;
    use std::arch::x86_64::*;

    /// One softmax state of `L` rows (16 for AVX-512, 8 for AVX2): `o` (`hd` vectors:
    /// dimension `d` of the rows' outputs), `m` (`L` maxima), `s` (`L` sums).
    pub(super) struct State {
        pub o: *mut f32,
        pub m: *mut f32,
        pub s: *mut f32,
    }

    /// The tile kernels at one vector width: `L` rows in the lanes of each vector, the lane
    /// masks (`u16`) holding `L` bits. Every function needs the CPU to have the level of its
    /// implementation (AVX-512 for [`W16`], AVX2 + FMA + F16C for [`W8`]); otherwise the
    /// buffers are as the AVX-512 functions of this module document, with `L` for 16.
    pub(super) trait Lanes {
        const L: usize;
        /// # Safety
        /// As [`transpose_in`].
        unsafe fn transpose_in(rows: &[Option<&[f32]>; 16], hd: usize, dst: &mut [f32]);
        /// [`values_f32`] of F16 (`f16`) or F32 values.
        ///
        /// # Safety
        /// As [`values_f32`].
        unsafe fn values_f32(
            f16: bool,
            rows: *const u8,
            stride: usize,
            n: usize,
            hd: usize,
            vf: *mut f32,
        );
        /// # Safety
        /// As [`scores_t`].
        #[allow(clippy::too_many_arguments)]
        unsafe fn scores_t(
            qt: *const f32,
            hd: usize,
            kf: *const f32,
            n: usize,
            scale: *const f32,
            hid: &[u16],
            sb: *mut f32,
        );
        /// # Safety
        /// As [`softmax_t`].
        unsafe fn softmax_t(sb: *mut f32, n: usize, seen: u16, hd: usize, st: &State);
        /// # Safety
        /// As [`values_t`].
        unsafe fn values_t(sb: *const f32, n: usize, vf: *const f32, hd: usize, o: *mut f32);
        /// # Safety
        /// As [`fold_t`].
        unsafe fn fold_t(mask: u16, hd: usize, chunk: &State, folded: &State);
        /// # Safety
        /// As [`finish_out`].
        unsafe fn finish_out(
            o: *mut f32,
            s: *const f32,
            hd: usize,
            rows: &mut [Option<&mut [f32]>; 16],
        );
    }

    /// The AVX-512 kernels below: 16 rows a vector, the single-token AVX-512 kernels' order.
    pub(super) struct W16;

    /// The AVX2 kernels of [`avx2`]: 8 rows a vector, the single-token AVX2 kernels' order.
    pub(super) struct W8;

    impl Lanes for W16 {
        const L: usize = 16;
        unsafe fn transpose_in(rows: &[Option<&[f32]>; 16], hd: usize, dst: &mut [f32]) {
            // SAFETY: forwarded (the caller's contract).
            unsafe { transpose_in(rows, hd, dst) }
        }
        unsafe fn values_f32(
            f16: bool,
            rows: *const u8,
            stride: usize,
            n: usize,
            hd: usize,
            vf: *mut f32,
        ) {
            // SAFETY: forwarded (the caller's contract).
            unsafe {
                if f16 {
                    values_f32::<1>(rows, stride, n, hd, vf)
                } else {
                    values_f32::<0>(rows, stride, n, hd, vf)
                }
            }
        }
        unsafe fn scores_t(
            qt: *const f32,
            hd: usize,
            kf: *const f32,
            n: usize,
            scale: *const f32,
            hid: &[u16],
            sb: *mut f32,
        ) {
            // SAFETY: forwarded (the caller's contract).
            unsafe { scores_t(qt, hd, kf, n, scale, hid, sb) }
        }
        unsafe fn softmax_t(sb: *mut f32, n: usize, seen: u16, hd: usize, st: &State) {
            // SAFETY: forwarded (the caller's contract).
            unsafe { softmax_t(sb, n, seen, hd, st) }
        }
        unsafe fn values_t(sb: *const f32, n: usize, vf: *const f32, hd: usize, o: *mut f32) {
            // SAFETY: forwarded (the caller's contract).
            unsafe { values_t(sb, n, vf, hd, o) }
        }
        unsafe fn fold_t(mask: u16, hd: usize, chunk: &State, folded: &State) {
            // SAFETY: forwarded (the caller's contract).
            unsafe { fold_t(mask, hd, chunk, folded) }
        }
        unsafe fn finish_out(
            o: *mut f32,
            s: *const f32,
            hd: usize,
            rows: &mut [Option<&mut [f32]>; 16],
        ) {
            // SAFETY: forwarded (the caller's contract).
            unsafe { finish_out(o, s, hd, rows) }
        }
    }

    impl Lanes for W8 {
        const L: usize = 8;
        unsafe fn transpose_in(rows: &[Option<&[f32]>; 16], hd: usize, dst: &mut [f32]) {
            avx2::transpose_in(rows, hd, dst)
        }
        unsafe fn values_f32(
            f16: bool,
            rows: *const u8,
            stride: usize,
            n: usize,
            hd: usize,
            vf: *mut f32,
        ) {
            // SAFETY: forwarded (the caller's contract).
            unsafe {
                if f16 {
                    avx2::values_f32::<1>(rows, stride, n, hd, vf)
                } else {
                    avx2::values_f32::<0>(rows, stride, n, hd, vf)
                }
            }
        }
        unsafe fn scores_t(
            qt: *const f32,
            hd: usize,
            kf: *const f32,
            n: usize,
            scale: *const f32,
            hid: &[u16],
            sb: *mut f32,
        ) {
            // SAFETY: forwarded (the caller's contract).
            unsafe { avx2::scores_t(qt, hd, kf, n, scale, hid, sb) }
        }
        unsafe fn softmax_t(sb: *mut f32, n: usize, seen: u16, hd: usize, st: &State) {
            // SAFETY: forwarded (the caller's contract).
            unsafe { avx2::softmax_t(sb, n, seen, hd, st) }
        }
        unsafe fn values_t(sb: *const f32, n: usize, vf: *const f32, hd: usize, o: *mut f32) {
            // SAFETY: forwarded (the caller's contract).
            unsafe { avx2::values_t(sb, n, vf, hd, o) }
        }
        unsafe fn fold_t(mask: u16, hd: usize, chunk: &State, folded: &State) {
            // SAFETY: forwarded (the caller's contract).
            unsafe { avx2::fold_t(mask, hd, chunk, folded) }
        }
        unsafe fn finish_out(
            o: *mut f32,
            s: *const f32,
            hd: usize,
            rows: &mut [Option<&mut [f32]>; 16],
        ) {
            // SAFETY: forwarded (the caller's contract).
            unsafe { avx2::finish_out(o, s, hd, rows) }
        }
    }

    /// AVX2 kernels of the tile path: 8 rows in the lanes of each vector, each row's
    /// arithmetic that of the single-token AVX2 kernels (`scores256`, `exp_shift_sum256`,
    /// `accum256`) in their order, and `fold_chunk` and `finish` lane by lane in scalar code.
    pub(super) mod avx2 {
        use super::super::super::x86::exp_neg256;
        use super::State;
        use std::arch::x86_64::*;

        /// The lanes of `bits` (bit `l` for lane `l`) as an all-ones mask per lane.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        fn lane_mask(bits: u16) -> __m256 {
            let lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            let b = _mm256_and_si256(_mm256_set1_epi32(i32::from(bits)), lanes);
            _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, lanes))
        }

        /// `dst[d * 8 + l]` = value `d` of row `l < 8` (0 for a missing row).
        pub(super) fn transpose_in(rows: &[Option<&[f32]>; 16], hd: usize, dst: &mut [f32]) {
            for (l, row) in rows.iter().take(8).enumerate() {
                for d in 0..hd {
                    dst[d * 8 + l] = row.map_or(0.0, |r| r[d]);
                }
            }
        }

        /// `vf[j * hd + d]` = value `d` of the segment of cell `j < n`, as f32.
        ///
        /// # Safety
        /// AVX2 and F16C available; `hd` a multiple of 8; `n` segments of `hd` values of
        /// type `T` (0: F32, 1: F16) at `rows + j * stride`; `vf` holds `n * hd` values.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn values_f32<const T: u8>(
            rows: *const u8,
            stride: usize,
            n: usize,
            hd: usize,
            vf: *mut f32,
        ) {
            for j in 0..n {
                for c in (0..hd).step_by(8) {
                    // SAFETY: within the bounds the caller guarantees.
                    unsafe {
                        let seg = rows.add(j * stride);
                        let x = if T == 0 {
                            _mm256_loadu_ps(seg.add(4 * c).cast())
                        } else {
                            _mm256_cvtph_ps(_mm_loadu_si128(seg.add(2 * c).cast()))
                        };
                        _mm256_storeu_ps(vf.add(j * hd + c), x);
                    }
                }
            }
        }

        /// Scores of 8 rows (transposed queries `qt`, `hd x 8`) for the `n` cells of `kf`:
        /// `sb[j * 8 + l]` = row `l`'s scaled score of cell `j`, `-inf` where `hid[j]` has
        /// lane `l`. `scores256`'s order per row and cell: lane `a_i` of its accumulator
        /// takes dimensions `i, i + 8, ...` by fused multiply-adds, then `((a0 + a1) + (a2 +
        /// a3)) + ((a4 + a5) + (a6 + a7))` (`reduce8_256`), times the scale.
        ///
        /// # Safety
        /// AVX2 and FMA available; `hd` a multiple of 8; `qt` holds `hd * 8` values, `kf`
        /// `n * hd`, `scale` 8, `sb` `n * 8`; `hid` has `n` masks.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn scores_t(
            qt: *const f32,
            hd: usize,
            kf: *const f32,
            n: usize,
            scale: *const f32,
            hid: &[u16],
            sb: *mut f32,
        ) {
            let mut j = 0;
            // SAFETY: cells j.. (J or fewer) within the bounds the caller guarantees.
            unsafe {
                let sc = _mm256_loadu_ps(scale);
                while j + 4 <= n {
                    scores_cells::<4>(qt, hd, kf, j, sc, hid, sb);
                    j += 4;
                }
                match n - j {
                    3 => scores_cells::<3>(qt, hd, kf, j, sc, hid, sb),
                    2 => scores_cells::<2>(qt, hd, kf, j, sc, hid, sb),
                    1 => scores_cells::<1>(qt, hd, kf, j, sc, hid, sb),
                    _ => {}
                }
            }
        }

        /// [`scores_t`] for the `J` cells from `j0` (each transposed query vector loaded
        /// once for all of them). Accumulators `i` and `i + 1` are summed side by side, so
        /// that `2 J` fused multiply-add chains are in flight (one chain per accumulator is
        /// bound by the instruction's latency).
        ///
        /// # Safety
        /// As [`scores_t`], with cells `j0..j0 + J` inside the `n`.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn scores_cells<const J: usize>(
            qt: *const f32,
            hd: usize,
            kf: *const f32,
            j0: usize,
            sc: __m256,
            hid: &[u16],
            sb: *mut f32,
        ) {
            let zero = _mm256_setzero_ps();
            let (mut pend_c, mut pend_d) = ([zero; J], [zero; J]);
            let mut s = [zero; J];
            for l in (0..8).step_by(2) {
                let (mut a, mut b) = ([zero; J], [zero; J]);
                for c in (0..hd).step_by(8) {
                    // SAFETY: rows c + l (+ 1) < hd of qt; key values c + l (+ 1) of cells
                    // j0..j0 + J inside kf (caller).
                    unsafe {
                        let qa = _mm256_loadu_ps(qt.add((c + l) * 8));
                        let qb = _mm256_loadu_ps(qt.add((c + l + 1) * 8));
                        for jj in 0..J {
                            let k = kf.add((j0 + jj) * hd + c + l);
                            a[jj] = _mm256_fmadd_ps(qa, _mm256_broadcast_ss(&*k), a[jj]);
                            b[jj] = _mm256_fmadd_ps(qb, _mm256_broadcast_ss(&*k.add(1)), b[jj]);
                        }
                    }
                }
                for jj in 0..J {
                    // (a_l + a_{l+1}), then the pairs and the halves of the tree.
                    let c = _mm256_add_ps(a[jj], b[jj]);
                    if l % 4 == 0 {
                        pend_c[jj] = c;
                        continue;
                    }
                    let d = _mm256_add_ps(pend_c[jj], c);
                    if l == 2 {
                        pend_d[jj] = d;
                    } else {
                        s[jj] = _mm256_add_ps(pend_d[jj], d);
                    }
                }
            }
            let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
            for (jj, sj) in s.iter().enumerate() {
                let j = j0 + jj;
                let x = _mm256_blendv_ps(_mm256_mul_ps(*sj, sc), ninf, lane_mask(hid[j]));
                // SAFETY: cell j's 8 scores inside sb (caller).
                unsafe { _mm256_storeu_ps(sb.add(j * 8), x) };
            }
        }

        /// The online softmax step of a block for the lanes in `seen` (`run_blocks`' per
        /// head, lane by lane): block max, rescale of the state when it grows (by the same
        /// scalar `exp`), weights `exp(x - max)` (`exp_neg256`) in place of the scores of
        /// `sb` (0 for lanes that do not take part), their sum in `exp_shift_sum256`'s order
        /// added to the state's.
        ///
        /// # Safety
        /// AVX2 and FMA available; `sb` holds `n * 8` values; the state `hd * 8 + 8 + 8`.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn softmax_t(sb: *mut f32, n: usize, seen: u16, hd: usize, st: &State) {
            let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
            // SAFETY: within the bounds the caller guarantees.
            unsafe {
                let mut bm = ninf;
                for j in 0..n {
                    // `maxps` gives its second operand where the first is NaN: NaN scores
                    // are passed over, as by `f32::max`.
                    bm = _mm256_max_ps(_mm256_loadu_ps(sb.add(j * 8)), bm);
                }
                // Lanes that do not take part keep their max (`max(old, -inf)`).
                let sm = lane_mask(seen);
                let old = _mm256_loadu_ps(st.m);
                let new = _mm256_max_ps(old, _mm256_blendv_ps(ninf, bm, sm));
                let bits = |m: __m256| _mm256_movemask_ps(m) as u16;
                let live = seen & bits(_mm256_cmp_ps::<_CMP_NEQ_OQ>(new, ninf));
                let grow = live & bits(_mm256_cmp_ps::<_CMP_NEQ_OQ>(new, old));
                // No stores of blends below: the compiler makes those masked stores, which
                // are microcoded and slow on AMD cores. Products by 1.0 and sums with +0.0
                // leave the other lanes' bits as they were instead.
                if grow != 0 {
                    let (mut o, mut nw) = ([0f32; 8], [0f32; 8]);
                    _mm256_storeu_ps(o.as_mut_ptr(), old);
                    _mm256_storeu_ps(nw.as_mut_ptr(), new);
                    let c: [f32; 8] = std::array::from_fn(|l| {
                        if grow >> l & 1 == 1 {
                            (o[l] - nw[l]).exp()
                        } else {
                            1.0
                        }
                    });
                    let c = _mm256_loadu_ps(c.as_ptr());
                    _mm256_storeu_ps(st.s, _mm256_mul_ps(_mm256_loadu_ps(st.s), c));
                    for d in 0..hd {
                        let p = st.o.add(d * 8);
                        _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_loadu_ps(p), c));
                    }
                }
                // Weights, and their sum per lane in the order of `exp_shift_sum256` over
                // the block's cells: cell j into sum j % 8, then `hsum256`'s tree. A lane
                // that does not take part gets weights and a sum of +0.0 (its state's sum is
                // never -0.0: it starts at +0.0 and only takes products by and sums of
                // values >= 0).
                let lm = lane_mask(live);
                let mut u = [_mm256_setzero_ps(); 8];
                for j in 0..n {
                    let p = sb.add(j * 8);
                    let x = _mm256_loadu_ps(p);
                    let e = _mm256_and_ps(lm, exp_neg256(_mm256_sub_ps(x, new)));
                    _mm256_storeu_ps(p, e);
                    u[j % 8] = _mm256_add_ps(u[j % 8], e);
                }
                let add = |a: __m256, b: __m256| _mm256_add_ps(a, b);
                let sum = add(
                    add(add(u[0], u[4]), add(u[2], u[6])),
                    add(add(u[1], u[5]), add(u[3], u[7])),
                );
                _mm256_storeu_ps(st.s, _mm256_add_ps(_mm256_loadu_ps(st.s), sum));
                _mm256_storeu_ps(st.m, new);
            }
        }

        /// The value pass of 8 rows: output `o[d]` (lane `l`: row `l`'s column `d`) takes
        /// `w_j * v_j[d]` by fused multiply-adds in cell order, lanes with a zero weight
        /// left alone (`accum256`'s arithmetic per row).
        ///
        /// # Safety
        /// AVX2 and FMA available; `hd` a multiple of 8; `sb` holds `n * 8` weights, `vf`
        /// `n * hd` values, `o` `hd * 8`.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn values_t(
            sb: *const f32,
            n: usize,
            vf: *const f32,
            hd: usize,
            o: *mut f32,
        ) {
            for d0 in (0..hd).step_by(8) {
                // SAFETY: output vectors d0..d0 + 8, weights of cells j < n and their values
                // d0..d0 + 8, within the bounds the caller guarantees.
                unsafe {
                    let mut acc: [__m256; 8] =
                        std::array::from_fn(|k| _mm256_loadu_ps(o.add((d0 + k) * 8)));
                    for j in 0..n {
                        let w = _mm256_loadu_ps(sb.add(j * 8));
                        let nz = _mm256_cmp_ps::<_CMP_NEQ_UQ>(w, _mm256_setzero_ps());
                        let bits = _mm256_movemask_ps(nz);
                        if bits == 0 {
                            continue;
                        }
                        let v = vf.add(j * hd + d0);
                        if bits == 0xff {
                            for (k, a) in acc.iter_mut().enumerate() {
                                *a = _mm256_fmadd_ps(w, _mm256_broadcast_ss(&*v.add(k)), *a);
                            }
                        } else {
                            for (k, a) in acc.iter_mut().enumerate() {
                                let x = _mm256_fmadd_ps(w, _mm256_broadcast_ss(&*v.add(k)), *a);
                                *a = _mm256_blendv_ps(*a, x, nz);
                            }
                        }
                    }
                    for (k, a) in acc.iter().enumerate() {
                        _mm256_storeu_ps(o.add((d0 + k) * 8), *a);
                    }
                }
            }
        }

        /// `fold_chunk` then `empty_state` for the lanes in `mask`, lane by lane in the same
        /// scalar arithmetic: `folded <- folded (+) chunk` (lanes whose chunk max is `-inf`
        /// unchanged).
        ///
        /// # Safety
        /// Both states hold `hd * 8 + 8 + 8` values.
        pub(super) unsafe fn fold_t(mask: u16, hd: usize, chunk: &State, folded: &State) {
            for l in (0..8).filter(|l| mask >> l & 1 == 1) {
                // SAFETY: lane l < 8 of each state's maxima and sums, and of its hd output
                // vectors of 8 (the caller's bounds).
                unsafe {
                    let pm = *chunk.m.add(l);
                    if pm != f32::NEG_INFINITY {
                        let fm = *folded.m.add(l);
                        let m = fm.max(pm);
                        let (a, b) = ((fm - m).exp(), (pm - m).exp());
                        *folded.s.add(l) = *folded.s.add(l) * a + *chunk.s.add(l) * b;
                        *folded.m.add(l) = m;
                        for d in 0..hd {
                            let (f, p) = (folded.o.add(d * 8 + l), chunk.o.add(d * 8 + l));
                            *f = *f * a + *p * b;
                        }
                    }
                    *chunk.m.add(l) = f32::NEG_INFINITY;
                    *chunk.s.add(l) = 0.0;
                    for d in 0..hd {
                        *chunk.o.add(d * 8 + l) = 0.0;
                    }
                }
            }
        }

        /// `finish` of 8 rows (each output times the inverse of its sum, all zeros for a
        /// sum of 0), into the rows: `rows[l][d]` = value `d` of lane `l` (absent rows
        /// skipped).
        ///
        /// # Safety
        /// `o` holds `hd * 8` values and `s` 8; each present row `hd`.
        pub(super) unsafe fn finish_out(
            o: *mut f32,
            s: *const f32,
            hd: usize,
            rows: &mut [Option<&mut [f32]>; 16],
        ) {
            for (l, row) in rows.iter_mut().take(8).enumerate() {
                let Some(row) = row else { continue };
                // SAFETY: lane l < 8 of the sums and of the hd output vectors (caller).
                unsafe {
                    let s = *s.add(l);
                    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                    for (d, x) in row[..hd].iter_mut().enumerate() {
                        *x = *o.add(d * 8 + l) * inv;
                    }
                }
            }
        }
    }

    /// 16 values of a segment from element `i`, as f32.
    ///
    /// # Safety
    /// AVX-512F and F16C available; elements `i..i + 16` are inside the segment.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn load16<const T: u8>(seg: *const u8, i: usize) -> __m512 {
        // SAFETY: guaranteed by the caller; unaligned loads.
        unsafe {
            if T == 0 {
                _mm512_loadu_ps(seg.add(4 * i).cast())
            } else {
                _mm512_cvtph_ps(_mm256_loadu_si256(seg.add(2 * i).cast()))
            }
        }
    }

    /// Lane indices of one butterfly step of a 16 x 16 transpose with blocks of `b` lanes:
    /// row `i` (`i & b == 0`) keeps its lanes with `L & b == 0` and takes its partner row
    /// `i + b`'s lanes `L - b` into the others (`hi = false`); the partner keeps its lanes with
    /// `L & b != 0` and takes row `i`'s lanes `L + b` into the others (`hi = true`). Indices
    /// 16.. name the second operand of `_mm512_permutex2var_ps`.
    const fn butterfly(b: usize, hi: bool) -> [i32; 16] {
        let mut idx = [0i32; 16];
        let mut l = 0;
        while l < 16 {
            idx[l] = match (hi, l & b == 0) {
                (false, true) => l as i32,
                (false, false) => (16 + l - b) as i32,
                (true, true) => (l + b) as i32,
                (true, false) => (16 + l) as i32,
            };
            l += 1;
        }
        idx
    }

    const STEPS: [(usize, [i32; 16], [i32; 16]); 4] = [
        (8, butterfly(8, false), butterfly(8, true)),
        (4, butterfly(4, false), butterfly(4, true)),
        (2, butterfly(2, false), butterfly(2, true)),
        (1, butterfly(1, false), butterfly(1, true)),
    ];

    /// Transposes 16 rows of 16 values: block swaps of 8, 4, 2 and 1 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) fn transpose16(r: &mut [__m512; 16]) {
        for (b, lo, hi) in STEPS {
            // SAFETY: the index arrays hold 16 i32 values (64 bytes).
            let (lo, hi) = unsafe {
                (
                    _mm512_loadu_si512(lo.as_ptr().cast()),
                    _mm512_loadu_si512(hi.as_ptr().cast()),
                )
            };
            for i in 0..16 {
                if i & b == 0 {
                    let (x, y) = (r[i], r[i + b]);
                    r[i] = _mm512_permutex2var_ps(x, lo, y);
                    r[i + b] = _mm512_permutex2var_ps(x, hi, y);
                }
            }
        }
    }

    /// `dst[d * 16 + l]` = value `d` of row `l` (0 for a missing row).
    ///
    /// # Safety
    /// AVX-512F available; `hd` a multiple of 16; each present row holds `hd` values and
    /// `dst` `hd * 16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn transpose_in(rows: &[Option<&[f32]>; 16], hd: usize, dst: &mut [f32]) {
        assert!(dst.len() >= hd * 16 && rows.iter().flatten().all(|r| r.len() >= hd));
        for d0 in (0..hd).step_by(16) {
            let mut r = [_mm512_setzero_ps(); 16];
            for (l, row) in rows.iter().enumerate() {
                if let Some(row) = row {
                    // SAFETY: d0 + 16 <= hd <= row.len() (assert).
                    r[l] = unsafe { _mm512_loadu_ps(row.as_ptr().add(d0)) };
                }
            }
            transpose16(&mut r);
            for (i, ri) in r.iter().enumerate() {
                // SAFETY: (d0 + i) * 16 + 16 <= hd * 16 <= dst.len() (assert).
                unsafe { _mm512_storeu_ps(dst.as_mut_ptr().add((d0 + i) * 16), *ri) };
            }
        }
    }

    /// `vf[j * hd + d]` = value `d` of the segment of cell `j < n`, as f32.
    ///
    /// # Safety
    /// AVX-512F and F16C available; `hd` a multiple of 16; `n` segments of `hd` values of
    /// type `T` at `rows + j * stride`; `vf` holds `n * hd` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn values_f32<const T: u8>(
        rows: *const u8,
        stride: usize,
        n: usize,
        hd: usize,
        vf: *mut f32,
    ) {
        for j in 0..n {
            for c in (0..hd).step_by(16) {
                // SAFETY: within the bounds the caller guarantees.
                unsafe {
                    _mm512_storeu_ps(vf.add(j * hd + c), load16::<T>(rows.add(j * stride), c))
                };
            }
        }
    }

    /// Scores of 16 rows (transposed queries `qt`, `hd x 16`) for the `n` cells of `kf`
    /// (`n x hd` keys): `sb[j * 16 + l]` = row `l`'s scaled score of cell `j`, `-inf` where
    /// `hid[j]` has lane `l`. Per row and cell the single-token kernel's arithmetic in its
    /// order (see the module documentation).
    ///
    /// # Safety
    /// AVX-512F available; `hd` a multiple of 16; `qt` holds `hd * 16` values, `kf` `n * hd`,
    /// `scale` 16, `sb` `n * 16`; `hid` has `n` masks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn scores_t(
        qt: *const f32,
        hd: usize,
        kf: *const f32,
        n: usize,
        scale: *const f32,
        hid: &[u16],
        sb: *mut f32,
    ) {
        let mut j = 0;
        // SAFETY: cells j.. (4 or fewer) within the bounds the caller guarantees.
        unsafe {
            let sc = _mm512_loadu_ps(scale);
            while j + 4 <= n {
                scores_cells::<4>(qt, hd, kf, j, sc, hid, sb);
                j += 4;
            }
            match n - j {
                3 => scores_cells::<3>(qt, hd, kf, j, sc, hid, sb),
                2 => scores_cells::<2>(qt, hd, kf, j, sc, hid, sb),
                1 => scores_cells::<1>(qt, hd, kf, j, sc, hid, sb),
                _ => {}
            }
        }
    }

    /// [`scores_t`] for the `J` cells from `j0` (each transposed query vector loaded once
    /// for all of them).
    ///
    /// # Safety
    /// As [`scores_t`], with cells `j0..j0 + J` inside the `n`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn scores_cells<const J: usize>(
        qt: *const f32,
        hd: usize,
        kf: *const f32,
        j0: usize,
        sc: __m512,
        hid: &[u16],
        sb: *mut f32,
    ) {
        let zero = _mm512_setzero_ps();
        let (mut pend_b, mut pend_c, mut pend_d) = ([zero; J], [zero; J], [zero; J]);
        let mut s = [zero; J];
        for l in 0..8 {
            let (mut a, mut b) = ([zero; J], [zero; J]);
            for c in (0..hd).step_by(16) {
                // SAFETY: rows c + l (+ 8) < hd of qt; key values c + l (+ 8) of cells
                // j0..j0 + J inside kf (caller).
                unsafe {
                    let qa = _mm512_loadu_ps(qt.add((c + l) * 16));
                    let qb = _mm512_loadu_ps(qt.add((c + l + 8) * 16));
                    for jj in 0..J {
                        let k = kf.add((j0 + jj) * hd + c + l);
                        a[jj] = _mm512_fmadd_ps(qa, _mm512_set1_ps(*k), a[jj]);
                        b[jj] = _mm512_fmadd_ps(qb, _mm512_set1_ps(*k.add(8)), b[jj]);
                    }
                }
            }
            for jj in 0..J {
                let bl = _mm512_add_ps(a[jj], b[jj]);
                if l % 2 == 0 {
                    pend_b[jj] = bl;
                    continue;
                }
                let c = _mm512_add_ps(pend_b[jj], bl);
                if l % 4 == 1 {
                    pend_c[jj] = c;
                    continue;
                }
                let d = _mm512_add_ps(pend_c[jj], c);
                if l == 3 {
                    pend_d[jj] = d;
                } else {
                    s[jj] = _mm512_add_ps(pend_d[jj], d);
                }
            }
        }
        for (jj, sj) in s.iter().enumerate() {
            let j = j0 + jj;
            let x = _mm512_mask_mov_ps(
                _mm512_mul_ps(*sj, sc),
                hid[j],
                _mm512_set1_ps(f32::NEG_INFINITY),
            );
            // SAFETY: cell j's 16 scores inside sb (caller).
            unsafe { _mm512_storeu_ps(sb.add(j * 16), x) };
        }
    }

    /// The online softmax step of a block for the lanes in `seen` (`run_blocks`' per head,
    /// lane by lane): block max, rescale of the state when it grows (by the same scalar
    /// `exp`), weights `exp(x - max)` in place of the scores of `sb` (0 for lanes that do not
    /// take part), their sum added to the state's.
    ///
    /// # Safety
    /// AVX-512F available; `sb` holds `n * 16` values; the state `hd * 16 + 16 + 16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn softmax_t(sb: *mut f32, n: usize, seen: u16, hd: usize, st: &State) {
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        // SAFETY: within the bounds the caller guarantees.
        unsafe {
            let mut bm = ninf;
            for j in 0..n {
                let x = _mm512_loadu_ps(sb.add(j * 16));
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
                bm = _mm512_max_ps(bm, _mm512_mask_mov_ps(x, nan, ninf));
            }
            let old = _mm512_loadu_ps(st.m);
            let new = _mm512_max_ps(old, bm);
            let live = seen & _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(new, ninf);
            let grow = live & _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(new, old);
            if grow != 0 {
                let (mut o, mut nw) = ([0f32; 16], [0f32; 16]);
                _mm512_storeu_ps(o.as_mut_ptr(), old);
                _mm512_storeu_ps(nw.as_mut_ptr(), new);
                let c: [f32; 16] = std::array::from_fn(|l| {
                    if grow >> l & 1 == 1 {
                        (o[l] - nw[l]).exp()
                    } else {
                        1.0
                    }
                });
                let c = _mm512_loadu_ps(c.as_ptr());
                let s = _mm512_loadu_ps(st.s);
                _mm512_storeu_ps(st.s, _mm512_mask_mul_ps(s, grow, s, c));
                for d in 0..hd {
                    let p = st.o.add(d * 16);
                    let x = _mm512_loadu_ps(p);
                    _mm512_storeu_ps(p, _mm512_mask_mul_ps(x, grow, x, c));
                }
            }
            // Weights, and their sum per lane in the order of `exp_shift_sum512` over the
            // block's cells (cells past 16 added lane-wise first, then `hsum16`'s tree).
            let mut u = [_mm512_setzero_ps(); 16];
            for j in 0..n {
                let p = sb.add(j * 16);
                let x = _mm512_loadu_ps(p);
                let e = _mm512_maskz_mov_ps(live, exp_neg512(_mm512_sub_ps(x, new)));
                _mm512_storeu_ps(p, e);
                u[j % 16] = _mm512_add_ps(u[j % 16], e);
            }
            let a: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(u[i], u[i + 8]));
            let b: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(a[i], a[i + 4]));
            let c0 = _mm512_add_ps(b[0], b[2]);
            let c1 = _mm512_add_ps(b[1], b[3]);
            let sum = _mm512_add_ps(c0, c1);
            let s = _mm512_loadu_ps(st.s);
            _mm512_storeu_ps(st.s, _mm512_mask_add_ps(s, live, s, sum));
            _mm512_storeu_ps(st.m, _mm512_mask_mov_ps(old, live, new));
        }
    }

    /// The value pass of 16 rows: output `o[d]` (lane `l`: row `l`'s column `d`) takes
    /// `w_j * v_j[d]` by fused multiply-adds in cell order, lanes with a zero weight left
    /// alone.
    ///
    /// # Safety
    /// AVX-512F available; `hd` a multiple of 16; `sb` holds `n * 16` weights, `vf` `n * hd`
    /// values, `o` `hd * 16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn values_t(
        sb: *const f32,
        n: usize,
        vf: *const f32,
        hd: usize,
        o: *mut f32,
    ) {
        for d0 in (0..hd).step_by(16) {
            // SAFETY: output vectors d0..d0 + 16, weights of cells j < n and their values
            // d0..d0 + 16, within the bounds the caller guarantees.
            unsafe {
                let mut acc: [__m512; 16] =
                    std::array::from_fn(|k| _mm512_loadu_ps(o.add((d0 + k) * 16)));
                for j in 0..n {
                    let w = _mm512_loadu_ps(sb.add(j * 16));
                    let nz = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(w, _mm512_setzero_ps());
                    if nz == 0 {
                        continue;
                    }
                    let v = vf.add(j * hd + d0);
                    for (k, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_mask3_fmadd_ps(w, _mm512_set1_ps(*v.add(k)), *a, nz);
                    }
                }
                for (k, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(o.add((d0 + k) * 16), *a);
                }
            }
        }
    }

    /// `fold_chunk` then `empty_state` for the lanes in `mask`: `folded <- folded (+) chunk`
    /// (lanes whose chunk max is `-inf` unchanged), by the same scalar `exp` factors.
    ///
    /// # Safety
    /// AVX-512F available; both states hold `hd * 16 + 16 + 16` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn fold_t(mask: u16, hd: usize, chunk: &State, folded: &State) {
        // SAFETY: within the bounds the caller guarantees.
        unsafe {
            let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
            let (pm, fm) = (_mm512_loadu_ps(chunk.m), _mm512_loadu_ps(folded.m));
            let live = mask & _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(pm, ninf);
            if live != 0 {
                let m = _mm512_max_ps(fm, pm);
                let (mut a, mut b) = ([1f32; 16], [1f32; 16]);
                let (mut mv, mut pv, mut fv) = ([0f32; 16], [0f32; 16], [0f32; 16]);
                _mm512_storeu_ps(mv.as_mut_ptr(), m);
                _mm512_storeu_ps(pv.as_mut_ptr(), pm);
                _mm512_storeu_ps(fv.as_mut_ptr(), fm);
                for l in (0..16).filter(|l| live >> l & 1 == 1) {
                    a[l] = (fv[l] - mv[l]).exp();
                    b[l] = (pv[l] - mv[l]).exp();
                }
                let (a, b) = (_mm512_loadu_ps(a.as_ptr()), _mm512_loadu_ps(b.as_ptr()));
                let fold =
                    |x: __m512, y: __m512| _mm512_add_ps(_mm512_mul_ps(x, a), _mm512_mul_ps(y, b));
                let (fs, ps) = (_mm512_loadu_ps(folded.s), _mm512_loadu_ps(chunk.s));
                _mm512_storeu_ps(folded.s, _mm512_mask_mov_ps(fs, live, fold(fs, ps)));
                _mm512_storeu_ps(folded.m, _mm512_mask_mov_ps(fm, live, m));
                for d in 0..hd {
                    let (f, p) = (folded.o.add(d * 16), chunk.o.add(d * 16));
                    let x = _mm512_loadu_ps(f);
                    let y = _mm512_loadu_ps(p);
                    _mm512_storeu_ps(f, _mm512_mask_mov_ps(x, live, fold(x, y)));
                }
            }
            let zero = _mm512_setzero_ps();
            _mm512_storeu_ps(chunk.m, _mm512_mask_mov_ps(pm, mask, ninf));
            let s = _mm512_loadu_ps(chunk.s);
            _mm512_storeu_ps(chunk.s, _mm512_mask_mov_ps(s, mask, zero));
            for d in 0..hd {
                let p = chunk.o.add(d * 16);
                _mm512_storeu_ps(p, _mm512_mask_mov_ps(_mm512_loadu_ps(p), mask, zero));
            }
        }
    }

    /// `finish` of 16 rows (each output divided by its sum, all zeros for a sum of 0), then
    /// the rows back in row-major order: `rows[l][d]` = value `d` of lane `l` (absent rows
    /// skipped).
    ///
    /// # Safety
    /// AVX-512F available; `hd` a multiple of 16; `o` holds `hd * 16` values and `s` 16;
    /// each present row `hd`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn finish_out(
        o: *mut f32,
        s: *const f32,
        hd: usize,
        rows: &mut [Option<&mut [f32]>; 16],
    ) {
        assert!(rows.iter().flatten().all(|r| r.len() >= hd));
        // SAFETY: within the bounds the caller guarantees and the assert.
        unsafe {
            let s = _mm512_loadu_ps(s);
            let pos = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(s, _mm512_setzero_ps());
            let inv = _mm512_maskz_div_ps(pos, _mm512_set1_ps(1.0), s);
            for d0 in (0..hd).step_by(16) {
                let mut r: [__m512; 16] = std::array::from_fn(|i| {
                    _mm512_mul_ps(_mm512_loadu_ps(o.add((d0 + i) * 16)), inv)
                });
                transpose16(&mut r);
                for (l, row) in rows.iter_mut().enumerate() {
                    if let Some(row) = row {
                        _mm512_storeu_ps(row.as_mut_ptr().add(d0), r[l]);
                    }
                }
            }
        }
    }
}

// The crate's test RNG is not built for loom.
#[cfg(all(test, not(loom)))]
mod tests;
