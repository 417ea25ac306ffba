//! Attention of a *tile* of query tokens of one sequence (a prompt's consecutive tokens, each
//! with its own mask): [`attend_tile`] gives every token of the tile exactly the bits
//! [`super::attend`] gives it alone, while each block's keys and values are read and converted
//! to f32 once for the whole tile instead of once per token.
//!
//! Only the arithmetic's *layout* changes, never its order. The single-token AVX-512 kernel
//! sums a score `q · k` (`head_dim` a multiple of 16) in 16 lanes, lane `l` taking dimensions
//! `l, l + 16, l + 32, ...` by fused multiply-adds in that order, then folds lane `l` with
//! lane `l + 8` and the eight results by a fixed tree: `((b0 + b1) + (b2 + b3)) + ((b4 + b5) +
//! (b6 + b7))`, and multiplies by the scale. The tile kernel puts 16 *cells* in the lanes
//! instead: a block's keys are transposed once (`kt[d]`: dimension `d` of 16 cells), and a
//! query row's 16 scores are 16 accumulators `A_l = sum_c kt[c + l] * q[c + l]` (the same fused
//! chain per lane), folded by the same tree, with no horizontal reduction per cell. The value
//! pass is already laid out this way (a head's output columns in registers, one fused
//! multiply-add per visible cell in cell order, zero weights skipped); the tile kernel takes up
//! to four rows at once over values converted once. The softmax between the two passes is the
//! single-token code itself, per token and head, on the same block and chunk boundaries.
//!
//! The fast path needs AVX-512, F32 or F16 K/V and `head_dim` a multiple of 16 (SmolLM2's and
//! Gemma 3's geometry); anything else runs the single-token kernel token by token, which gives
//! the same bits by definition.

use super::{attend_chunked, chunk_blocks, Geometry, Query, Scratch};
use crate::error::{invalid, Result};
use crate::kv::storage::{KvStorage, KvType};
use crate::quant::simd::{self, SimdLevel};

/// Tokens a caller should put in one tile: enough to share each block's conversion and
/// transposition widely, few enough that a prompt's tiles still spread over the team.
pub const TILE_TOKENS: usize = 16;

/// Buffers of the tile path, kept in [`Scratch`]. Per (KV head, row vector): `hd x 16`
/// values of transposed queries, chunk output and folded output, and 16 of each max and sum.
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
    /// Per cell of the block, 16 rows' scores, then weights.
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
        tiled(
            &geo,
            store,
            table,
            n_kv,
            queries,
            Out::Rows(out),
            scratch,
            chunk,
        );
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
        tiled(
            &geo,
            store,
            table,
            n_kv,
            queries,
            Out::States(states),
            scratch,
            chunk,
        );
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

/// Whether a tile of `tokens` queries at level `lvl` (already capped) takes the AVX-512 tile
/// kernels; otherwise each token runs the single-token kernel.
pub(super) fn fast_path(lvl: SimdLevel, ty: KvType, head_dim: usize, tokens: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && lvl >= SimdLevel::Avx512
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

/// The AVX-512 tile path (F32/F16, `head_dim` a multiple of 16, `lvl` at least AVX-512).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn tiled(
    geo: &Geometry,
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    queries: &[Query],
    out: Out<'_>,
    scratch: &mut Scratch,
    chunk: usize,
) {
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
    // Row r = token * g + head of the group; vector r / 16, lane r % 16 (every KV head alike).
    let nr = nq * g;
    let nv = nr.div_ceil(16);
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
    let big = vecs * hd * 16;
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
        buf.resize(vecs * 16, x);
    }
    scale.clear();
    scale.resize(nv * 16, 0.0);
    for r in 0..nr {
        scale[r] = queries[r / g].scale;
    }
    kf.resize(bs * hd, 0.0);
    vf.resize(bs * hd, 0.0);
    sb.resize(bs * 16, 0.0);
    seen.resize(nv, 0);
    hid.resize(nv * bs, 0);
    fold.resize(nv, 0);
    count.clear();
    count.resize(nq, 0);
    // The queries, transposed: per (KV head, vector), dimension d of its 16 rows.
    let row_q = |kh: usize, r: usize| -> Option<&[f32]> {
        (r < nr).then(|| {
            let (i, h) = (r / g, r % g);
            &queries[i].q[(kh * g + h) * hd..(kh * g + h + 1) * hd]
        })
    };
    for kh in 0..kvh {
        for v in 0..nv {
            let rows: [Option<&[f32]>; 16] = std::array::from_fn(|l| row_q(kh, v * 16 + l));
            let dst = &mut qt[(kh * nv + v) * hd * 16..][..hd * 16];
            // SAFETY: AVX-512 (the caller's `fast_path`); each row holds hd values, dst hd x 16.
            unsafe { x86::transpose_in(&rows, hd, dst) };
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
                let (v, bit) = (r / 16, 1u16 << (r % 16));
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
            // SAFETY: AVX-512 (`fast_path`); the assert keeps the n segments of hd values
            // inside `krows` and `vrows`; kf and vf hold block_size x hd values.
            unsafe {
                let (k, v) = (krows.as_ptr().add(off), vrows.as_ptr().add(off));
                if ty == KvType::F32 {
                    x86::values_f32::<0>(k, geo.stride, n, hd, kf.as_mut_ptr());
                    x86::values_f32::<0>(v, geo.stride, n, hd, vf.as_mut_ptr());
                } else {
                    x86::values_f32::<1>(k, geo.stride, n, hd, kf.as_mut_ptr());
                    x86::values_f32::<1>(v, geo.stride, n, hd, vf.as_mut_ptr());
                }
            }
            for v in (0..nv).filter(|&v| seen[v] != 0) {
                let x = kh * nv + v;
                let st = x86::State {
                    o: co[x * hd * 16..][..hd * 16].as_mut_ptr(),
                    m: cm[x * 16..][..16].as_mut_ptr(),
                    s: cs[x * 16..][..16].as_mut_ptr(),
                };
                // SAFETY: AVX-512 (`fast_path`); qt's vector holds hd x 16 values, kf and vf
                // n x hd, sb n x 16, hid n masks from v * n, the state hd x 16 + 16 + 16.
                unsafe {
                    x86::scores_t(
                        qt[x * hd * 16..].as_ptr(),
                        hd,
                        kf.as_ptr(),
                        n,
                        scale[v * 16..].as_ptr(),
                        &hid[v * n..(v + 1) * n],
                        sb.as_mut_ptr(),
                    );
                    x86::softmax_t(sb.as_mut_ptr(), n, seen[v], hd, &st);
                    x86::values_t(sb.as_ptr(), n, vf.as_ptr(), hd, st.o);
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
                    fold[r / 16] |= 1 << (r % 16);
                }
            }
        }
        fold_lanes(fold, kvh, nv, hd, co, cm, cs, fo, fm, fs);
    }
    // The last chunks, then normalization and the outputs in token-major rows.
    fold.fill(0);
    for (i, &c) in count.iter().enumerate() {
        if c > 0 {
            for h in 0..g {
                let r = i * g + h;
                fold[r / 16] |= 1 << (r % 16);
            }
        }
    }
    fold_lanes(fold, kvh, nv, hd, co, cm, cs, fo, fm, fs);
    let out = match out {
        Out::Rows(out) => out,
        Out::States(states) => {
            // Row r = (token i, head h of KV head kh): lane r % 16 of vector kh * nv + r / 16.
            let len = super::partial_len(gt, hd);
            for (i, st) in states.chunks_exact_mut(len).enumerate() {
                let (o, rest) = st.split_at_mut(gt * hd);
                let (m, s) = rest.split_at_mut(gt);
                for kh in 0..kvh {
                    for h in 0..g {
                        let (r, head) = (i * g + h, kh * g + h);
                        let (x, l) = (kh * nv + r / 16, r % 16);
                        for (d, od) in o[head * hd..(head + 1) * hd].iter_mut().enumerate() {
                            *od = fo[(x * hd + d) * 16 + l];
                        }
                        m[head] = fm[x * 16 + l];
                        s[head] = fs[x * 16 + l];
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
            for (l, slot) in rows.iter_mut().enumerate() {
                let r = v * 16 + l;
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
            // SAFETY: AVX-512 (`fast_path`); the state holds hd x 16 + 16 values, each row hd.
            unsafe {
                x86::finish_out(
                    fo[x * hd * 16..][..hd * 16].as_mut_ptr(),
                    fs[x * 16..][..16].as_ptr(),
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
fn fold_lanes(
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
    for kh in 0..kvh {
        for (v, &mask) in fold.iter().enumerate().take(nv) {
            if mask == 0 {
                continue;
            }
            let x = kh * nv + v;
            let chunk = x86::State {
                o: co[x * hd * 16..][..hd * 16].as_mut_ptr(),
                m: cm[x * 16..][..16].as_mut_ptr(),
                s: cs[x * 16..][..16].as_mut_ptr(),
            };
            let folded = x86::State {
                o: fo[x * hd * 16..][..hd * 16].as_mut_ptr(),
                m: fm[x * 16..][..16].as_mut_ptr(),
                s: fs[x * 16..][..16].as_mut_ptr(),
            };
            // SAFETY: AVX-512 (`fast_path`); both states hold hd x 16 + 16 + 16 values.
            unsafe { x86::fold_t(mask, hd, &chunk, &folded) };
        }
    }
}

/// AVX-512 kernels of the tile path: 16 rows in the lanes of each vector.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::x86::exp_neg512;
    use std::arch::x86_64::*;

    /// One softmax state of 16 rows: `o` (`hd` vectors: dimension `d` of the 16 rows'
    /// outputs), `m` (16 maxima), `s` (16 sums).
    pub(super) struct State {
        pub o: *mut f32,
        pub m: *mut f32,
        pub s: *mut f32,
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
