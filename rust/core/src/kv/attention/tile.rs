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

use super::{
    attend_chunked, chunk_blocks, exp_shift_sum, finish, fold_chunk, partial_len, row_max,
    Geometry, Query, Scratch,
};
use crate::error::{invalid, Result};
use crate::kv::storage::{KvStorage, KvType};
use crate::quant::simd::{self, SimdLevel};

/// Tokens a caller should put in one tile: enough to share each block's conversion and
/// transposition widely, few enough that a prompt's tiles still spread over the team.
pub const TILE_TOKENS: usize = 16;

/// Buffers of the tile path, kept in [`Scratch`].
#[derive(Default, Debug)]
pub(super) struct TileScratch {
    /// One 16-cell piece of a block's keys of one KV head, transposed (`head_dim` x 16).
    kt: Vec<f32>,
    /// A block's values of one KV head as f32 (`block_size` x `head_dim`).
    vf: Vec<f32>,
    /// The scores of the tokens that see the block: per token `group x n`.
    scores: Vec<f32>,
    /// Per token, its current chunk's softmax state (`partial_len` values).
    state: Vec<f32>,
    /// Per token, the running max and sum over its folded chunks (one per head).
    max: Vec<f32>,
    sum: Vec<f32>,
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
    for q in queries {
        let shape = |q: &Query| (q.layer, q.kv_head, q.kv_heads, q.head_dim, q.q.len());
        if shape(q) != shape(q0) {
            return Err(invalid(
                "attention: a tile's queries differ in layer, KV heads or head size",
            ));
        }
        Geometry::check(store, table, n_kv, q, ql)?;
    }
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
        tiled(lvl, &geo, store, table, n_kv, queries, out, scratch, chunk);
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

/// Empties a chunk state: output 0, max `-inf`, sum 0 (as `run_blocks` starts a chunk).
fn empty_state(st: &mut [f32], heads: usize, hd: usize) {
    let (o, rest) = st.split_at_mut(heads * hd);
    let (m, s) = rest.split_at_mut(heads);
    o.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    s.fill(0.0);
}

/// The AVX-512 tile path (F32/F16, `head_dim` a multiple of 16, `lvl` at least AVX-512).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn tiled(
    lvl: SimdLevel,
    geo: &Geometry,
    store: &KvStorage,
    table: &[u32],
    n_kv: usize,
    queries: &[Query],
    out: &mut [f32],
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
    let (seg, ql, plen) = (ty.row_bytes(hd), gt * hd, partial_len(gt, hd));
    let TileScratch {
        kt,
        vf,
        scores,
        state,
        max,
        sum,
        count,
        who,
        hidden,
        at,
    } = &mut scratch.tile;
    kt.resize(hd * 16, 0.0);
    vf.resize(bs * hd, 0.0);
    scores.resize(nq * g * bs, 0.0);
    state.resize(nq * plen, 0.0);
    for st in state.chunks_exact_mut(plen) {
        empty_state(st, gt, hd);
    }
    max.clear();
    max.resize(nq * gt, f32::NEG_INFINITY);
    sum.clear();
    sum.resize(nq * gt, 0.0);
    count.clear();
    count.resize(nq, 0);
    out.fill(0.0);
    let layer = q0.layer;
    for bi in 0..geo.nb {
        let base = bi * bs;
        let n = bs.min(n_kv - base);
        // The tokens that see a cell of the block, with their masked cells.
        who.clear();
        hidden.clear();
        at.clear();
        at.push(0);
        for (i, q) in queries.iter().enumerate() {
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
        let blk = table[bi] as usize;
        let (krows, vrows) = (store.rows(layer, blk, false), store.rows(layer, blk, true));
        let rows = who.len() * g;
        for kh in 0..q0.kv_heads {
            let off = geo.seg_off + kh * seg;
            assert!((n - 1) * geo.stride + off + seg <= krows.len().min(vrows.len()));
            // Scores of every (token, head) row, 16 cells at a time.
            for j0 in (0..n).step_by(16) {
                let m = 16.min(n - j0);
                // SAFETY: `lvl` is at least AVX-512 and capped at `simd::detect()`; the
                // assert keeps the m segments of head_dim values from cell j0 inside `krows`;
                // kt holds head_dim x 16 values.
                unsafe {
                    let k = krows.as_ptr().add(off + j0 * geo.stride);
                    if ty == KvType::F32 {
                        x86::transpose_keys::<0>(k, geo.stride, m, hd, kt.as_mut_ptr());
                    } else {
                        x86::transpose_keys::<1>(k, geo.stride, m, hd, kt.as_mut_ptr());
                    }
                }
                let sp = scores.as_mut_ptr();
                let mut r0 = 0;
                while r0 < rows {
                    let rr = (rows - r0).min(4);
                    // Rows past `rr` repeat valid ones and are not passed on.
                    let row = |r: usize| {
                        let (wi, h) = ((r0 + r) % rows / g, (r0 + r) % g);
                        let qi = &queries[who[wi]];
                        let qp = qi.q[(kh * g + h) * hd..].as_ptr();
                        // SAFETY: (wi * g + h) * n + j0 < who.len() * g * n <= scores.len().
                        (qp, qi.scale, unsafe { sp.add((wi * g + h) * n + j0) })
                    };
                    let q: [(*const f32, f32, *mut f32); 4] = std::array::from_fn(row);
                    // SAFETY: as above; rows r0..r0 + rr are distinct (token, head) pairs, each
                    // with head_dim query values and m score slots from cell j0 of its row of
                    // n (the rows past rr are not touched).
                    unsafe {
                        match rr {
                            1 => x86::scores_rows::<1>(kt.as_ptr(), hd, first(&q), m),
                            2 => x86::scores_rows::<2>(kt.as_ptr(), hd, first(&q), m),
                            3 => x86::scores_rows::<3>(kt.as_ptr(), hd, first(&q), m),
                            _ => x86::scores_rows::<4>(kt.as_ptr(), hd, q, m),
                        }
                    }
                    r0 += rr;
                }
            }
            // Masks and the online softmax, per token and head, as `run_blocks` does them.
            for (wi, &i) in who.iter().enumerate() {
                let sc = &mut scores[wi * g * n..(wi + 1) * g * n];
                for &j in &hidden[at[wi]..at[wi + 1]] {
                    for h in 0..g {
                        sc[h * n + j] = f32::NEG_INFINITY;
                    }
                }
                let st = &mut state[i * plen..(i + 1) * plen];
                let (o, rest) = st.split_at_mut(gt * hd);
                let (mx, sm) = rest.split_at_mut(gt);
                for h in 0..g {
                    let hh = kh * g + h;
                    let row = &mut sc[h * n..(h + 1) * n];
                    let block_max = row_max(row);
                    let old = mx[hh];
                    let new = old.max(block_max);
                    if new == f32::NEG_INFINITY {
                        row.fill(0.0);
                        continue;
                    }
                    if new != old {
                        let c = (old - new).exp();
                        sm[hh] *= c;
                        for x in &mut o[hh * hd..(hh + 1) * hd] {
                            *x *= c;
                        }
                    }
                    sm[hh] += exp_shift_sum(lvl, row, new);
                    mx[hh] = new;
                }
            }
            // SAFETY: as above for `vrows`; vf holds block_size x head_dim values.
            unsafe {
                let v = vrows.as_ptr().add(off);
                if ty == KvType::F32 {
                    x86::values_f32::<0>(v, geo.stride, n, hd, vf.as_mut_ptr());
                } else {
                    x86::values_f32::<1>(v, geo.stride, n, hd, vf.as_mut_ptr());
                }
            }
            let (wp, ap) = (scores.as_ptr(), state.as_mut_ptr());
            let mut r0 = 0;
            while r0 < rows {
                let rr = (rows - r0).min(4);
                let row = |r: usize| {
                    let (wi, h) = ((r0 + r) % rows / g, (r0 + r) % g);
                    let i = who[wi];
                    // SAFETY: row wi * g + h of n weights lies inside `scores`, and head
                    // kh * g + h's outputs inside token i's chunk state in `state`.
                    unsafe {
                        (
                            wp.add((wi * g + h) * n),
                            ap.add(i * plen + (kh * g + h) * hd),
                        )
                    }
                };
                let r: [(*const f32, *mut f32); 4] = std::array::from_fn(row);
                // SAFETY: as above; each row's n weights and head_dim outputs are in `scores`
                // and `state`, and rows r0..r0 + rr are distinct (token, head) pairs.
                unsafe {
                    match rr {
                        1 => x86::accum_rows::<1>(vf.as_ptr(), hd, n, first(&r)),
                        2 => x86::accum_rows::<2>(vf.as_ptr(), hd, n, first(&r)),
                        3 => x86::accum_rows::<3>(vf.as_ptr(), hd, n, first(&r)),
                        _ => x86::accum_rows::<4>(vf.as_ptr(), hd, n, r),
                    }
                }
                r0 += rr;
            }
        }
        for &i in who.iter() {
            count[i] += 1;
            if count[i] == chunk {
                let st = &mut state[i * plen..(i + 1) * plen];
                let (mx, sm) = (
                    &mut max[i * gt..(i + 1) * gt],
                    &mut sum[i * gt..(i + 1) * gt],
                );
                fold_chunk(gt, hd, st, mx, sm, &mut out[i * ql..(i + 1) * ql]);
                empty_state(st, gt, hd);
                count[i] = 0;
            }
        }
    }
    for i in 0..nq {
        let o = &mut out[i * ql..(i + 1) * ql];
        if count[i] > 0 {
            let st = &state[i * plen..(i + 1) * plen];
            let (mx, sm) = (
                &mut max[i * gt..(i + 1) * gt],
                &mut sum[i * gt..(i + 1) * gt],
            );
            fold_chunk(gt, hd, st, mx, sm, o);
        }
        finish(hd, &sum[i * gt..(i + 1) * gt], o);
    }
}

/// The first `R` of four row descriptions.
#[cfg(target_arch = "x86_64")]
fn first<T: Copy, const R: usize>(rows: &[T; 4]) -> [T; R] {
    std::array::from_fn(|r| rows[r])
}

/// AVX-512 kernels of the tile path. `T`: 0 = F32, 1 = F16 segments.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

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

    /// `kt[d * 16 + j]` = value `d` of the key segment of cell `j < m` (at `rows + j *
    /// stride`), 0 for the cells `m..16`; `d < hd`.
    ///
    /// # Safety
    /// AVX-512F and F16C available; `m <= 16`; `hd` a multiple of 16; `m` segments of `hd`
    /// values of type `T` at `rows + j * stride`; `kt` holds `hd * 16` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn transpose_keys<const T: u8>(
        rows: *const u8,
        stride: usize,
        m: usize,
        hd: usize,
        kt: *mut f32,
    ) {
        for d0 in (0..hd).step_by(16) {
            let mut r = [_mm512_setzero_ps(); 16];
            for (j, rj) in r.iter_mut().enumerate().take(m) {
                // SAFETY: cell j < m's segment holds values d0..d0 + 16 (caller).
                *rj = unsafe { load16::<T>(rows.add(j * stride), d0) };
            }
            transpose16(&mut r);
            for (i, ri) in r.iter().enumerate() {
                // SAFETY: row d0 + i < hd of kt (caller).
                unsafe { _mm512_storeu_ps(kt.add((d0 + i) * 16), *ri) };
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

    /// The scores of `R` query rows over the 16 cells of `kt` (`rows[r]`: the row's `hd`
    /// query values, its scale, and where its `m` scores go): per row, lane `l` of
    /// accumulator `A_l` sums `kt[c + l] * q[c + l]` for `c = 0, 16, ...` by fused
    /// multiply-adds, and `B_l = A_l + A_{l+8}` are added as `((B0 + B1) + (B2 + B3)) +
    /// ((B4 + B5) + (B6 + B7))`: for every cell, the single-token kernel's arithmetic in its
    /// order.
    ///
    /// # Safety
    /// AVX-512F available; `kt` holds `hd * 16` values, `hd` a multiple of 16; each row's
    /// query holds `hd` values and its output `m <= 16` writable values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn scores_rows<const R: usize>(
        kt: *const f32,
        hd: usize,
        rows: [(*const f32, f32, *mut f32); R],
        m: usize,
    ) {
        let zero = _mm512_setzero_ps();
        let (mut pend_b, mut pend_c, mut pend_d) = ([zero; R], [zero; R], [zero; R]);
        let mut s = [zero; R];
        for l in 0..8 {
            let (mut a, mut b) = ([zero; R], [zero; R]);
            for c in (0..hd).step_by(16) {
                // SAFETY: rows c + l and c + l + 8 < hd of kt; query values c + l (+ 8) < hd.
                unsafe {
                    let k0 = _mm512_loadu_ps(kt.add((c + l) * 16));
                    let k1 = _mm512_loadu_ps(kt.add((c + l + 8) * 16));
                    for r in 0..R {
                        let q = rows[r].0;
                        a[r] = _mm512_fmadd_ps(k0, _mm512_set1_ps(*q.add(c + l)), a[r]);
                        b[r] = _mm512_fmadd_ps(k1, _mm512_set1_ps(*q.add(c + l + 8)), b[r]);
                    }
                }
            }
            for r in 0..R {
                let bl = _mm512_add_ps(a[r], b[r]);
                if l % 2 == 0 {
                    pend_b[r] = bl;
                    continue;
                }
                let c = _mm512_add_ps(pend_b[r], bl);
                if l % 4 == 1 {
                    pend_c[r] = c;
                    continue;
                }
                let d = _mm512_add_ps(pend_c[r], c);
                if l == 3 {
                    pend_d[r] = d;
                } else {
                    s[r] = _mm512_add_ps(pend_d[r], d);
                }
            }
        }
        let keep: u16 = if m >= 16 { 0xFFFF } else { (1u16 << m) - 1 };
        for r in 0..R {
            let (_, scale, out) = rows[r];
            // SAFETY: m writable values at out (caller).
            unsafe { _mm512_mask_storeu_ps(out, keep, _mm512_mul_ps(s[r], _mm512_set1_ps(scale))) };
        }
    }

    /// The value pass of `R` rows (`rows[r]`: the row's `n` weights and its `hd` outputs)
    /// over the `n` cells of `vf`: each output column adds `w_j * v_j` by fused multiply-adds
    /// in cell order, skipping zero weights, with 64 columns of each row in registers: the
    /// single-token kernel's arithmetic in its order.
    ///
    /// # Safety
    /// AVX-512F available; `vf` holds `n * hd` values, `hd` a multiple of 16; each row's
    /// weights hold `n` values and its outputs `hd`, and no two rows' outputs overlap.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn accum_rows<const R: usize>(
        vf: *const f32,
        hd: usize,
        n: usize,
        rows: [(*const f32, *mut f32); R],
    ) {
        for c0 in (0..hd).step_by(64) {
            // SAFETY: as the caller guarantees, for columns c0..c0 + 16 KN.
            unsafe {
                match (hd - c0) / 16 {
                    1 => accum_cols::<R, 1>(vf, hd, c0, n, rows),
                    2 => accum_cols::<R, 2>(vf, hd, c0, n, rows),
                    3 => accum_cols::<R, 3>(vf, hd, c0, n, rows),
                    _ => accum_cols::<R, 4>(vf, hd, c0, n, rows),
                }
            }
        }
    }

    /// [`accum_rows`] for the `16 * KN` columns from `c0` (the sizes are constants, so the
    /// `R x KN` accumulators stay in registers).
    ///
    /// # Safety
    /// As [`accum_rows`], with columns `c0..c0 + 16 * KN` inside `hd`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn accum_cols<const R: usize, const KN: usize>(
        vf: *const f32,
        hd: usize,
        c0: usize,
        n: usize,
        rows: [(*const f32, *mut f32); R],
    ) {
        // SAFETY: columns c0..c0 + 16 KN of each row's outputs and of each cell's values, and
        // each row's n weights, are within the bounds the caller guarantees.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); KN]; R];
            for (r, ar) in acc.iter_mut().enumerate() {
                for (k, a) in ar.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(rows[r].1.add(c0 + 16 * k));
                }
            }
            for j in 0..n {
                let w: [f32; R] = std::array::from_fn(|r| *rows[r].0.add(j));
                if w.iter().all(|&x| x == 0.0) {
                    continue;
                }
                let row = vf.add(j * hd + c0);
                let v: [__m512; KN] = std::array::from_fn(|k| _mm512_loadu_ps(row.add(16 * k)));
                for (r, ar) in acc.iter_mut().enumerate() {
                    let live = if w[r] != 0.0 { 0xFFFF } else { 0 };
                    let wv = _mm512_set1_ps(w[r]);
                    for (k, a) in ar.iter_mut().enumerate() {
                        *a = _mm512_mask3_fmadd_ps(wv, v[k], *a, live);
                    }
                }
            }
            for (r, ar) in acc.iter().enumerate() {
                for (k, a) in ar.iter().enumerate() {
                    _mm512_storeu_ps(rows[r].1.add(c0 + 16 * k), *a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
