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
//!
//! Measured (release, one AVX-512 core shared with other jobs, so upper bounds): head_dim 64, a
//! GQA group of 3 heads, block size 16: about 40-55 ns per cell for F16 and Q8_0 alike (e.g.
//! ~5 us at n_kv 128, ~40 us at 1024, ~180-200 us at 4096); versus exact f32 keys/values the
//! output error is ~2e-4 mean / 3e-3 max for F16 and ~5e-3 mean / 8e-2 max for Q8_0 (unit-scale
//! values). `kv_measure` (an ignored test) reprints these.
//!
//! # Guarantees
//!
//! * The output equals `softmax(scale * q·k) · v` over the visible cells, computed in f32 on the
//!   stored (F32/F16/Q8_0-decoded) values; the result is numerically stable for any score range
//!   (every exponent is `<= 0`). A head with no visible cell gets an all-zero output.
//! * Cost is O(n_kv * head_dim * group) time, independent of the pool size; memory is one
//!   `block_size * group` score buffer in [`Scratch`], reused across calls.
//! * Kernels: scalar reference plus AVX2 (FMA, F16C `_mm256_cvtph_ps`) and AVX-512
//!   (`_mm512_cvtph_ps`, int8 widening for Q8_0) twins chosen by [`crate::quant::simd::level`]
//!   (`KVSERVE_SIMD` override). They differ only in f32 summation order.
//! * Bad arguments (block id out of range, too short table or positions, wrong row lengths,
//!   a head_dim that does not divide kv_dim) return [`crate::Error::InvalidInput`].

use super::storage::{KvStorage, KvType, Q8_0_BLOCK, Q8_0_BYTES};
use crate::error::{invalid, Result};
use crate::quant::simd::{self, SimdLevel};
use half::f16;

/// Which of the `n_kv` cells a query sees.
#[derive(Clone, Copy)]
pub enum Mask<'a> {
    /// Every cell is visible.
    All,
    /// Cell `i` is visible iff `0 <= positions[i] <= qpos` (negative positions mark empty cells).
    Causal { positions: &'a [i32], qpos: i32 },
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
            Mask::Custom(f) => f(i),
        }
    }
}

/// One query token's attention for one GQA group.
#[derive(Clone, Copy)]
pub struct Query<'a> {
    pub layer: usize,
    /// KV head shared by the group's query heads.
    pub kv_head: usize,
    pub head_dim: usize,
    /// `group * head_dim` values: the group's query rows, already rotated.
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
    let ty = store.kv_type();
    let hd = query.head_dim;
    ty.check_dim(hd, "head_dim")?;
    let kv_dim = store.kv_dim();
    if !kv_dim.is_multiple_of(hd) || query.kv_head >= kv_dim / hd {
        return Err(invalid(format!(
            "attention: kv_head {} with head_dim {hd} outside kv_dim {kv_dim}",
            query.kv_head
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
    if q.is_empty() || !q.len().is_multiple_of(hd) || out.len() != q.len() {
        return Err(invalid(format!(
            "attention: q has {} values and out {}, expected the same multiple of head_dim {hd}",
            q.len(),
            out.len()
        )));
    }
    let g = q.len() / hd;
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
    if let Mask::Causal { positions, .. } = query.mask {
        if positions.len() < n_kv {
            return Err(invalid(format!(
                "attention: {} positions for {n_kv} cells",
                positions.len()
            )));
        }
    }
    let lvl = lvl.min(simd::detect());
    let seg_off = query.kv_head * ty.row_bytes(hd);
    let stride = store.row_bytes();

    scratch.scores.resize(g * bs, 0.0);
    scratch.max.clear();
    scratch.max.resize(g, f32::NEG_INFINITY);
    scratch.sum.clear();
    scratch.sum.resize(g, 0.0);
    out.fill(0.0);
    let mask = query.mask;

    for (bi, &blk) in table[..nb].iter().enumerate() {
        let base = bi * bs;
        let n = bs.min(n_kv - base);
        if !(0..n).any(|j| mask.visible(base + j)) {
            continue;
        }
        let scores = &mut scratch.scores[..g * n];
        let krows = &store.rows(query.layer, blk as usize, false)[seg_off..];
        block_scores(lvl, ty, q, hd, krows, stride, n, query.scale, scores);
        for j in 0..n {
            if !mask.visible(base + j) {
                for h in 0..g {
                    scores[h * n + j] = f32::NEG_INFINITY;
                }
            }
        }
        for h in 0..g {
            let row = &mut scores[h * n..(h + 1) * n];
            let block_max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let old = scratch.max[h];
            let new = old.max(block_max);
            if new == f32::NEG_INFINITY {
                row.fill(0.0);
                continue;
            }
            let c = (old - new).exp();
            if c != 1.0 {
                scratch.sum[h] *= c;
                for o in &mut out[h * hd..(h + 1) * hd] {
                    *o *= c;
                }
            }
            let mut s = 0.0f32;
            for x in row.iter_mut() {
                *x = (*x - new).exp();
                s += *x;
            }
            scratch.sum[h] += s;
            scratch.max[h] = new;
        }
        let vrows = &store.rows(query.layer, blk as usize, true)[seg_off..];
        block_accumulate(lvl, ty, scores, hd, vrows, stride, n, out);
    }
    for (h, o) in out.chunks_exact_mut(hd).enumerate() {
        let s = scratch.sum[h];
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        for x in o {
            *x *= inv;
        }
    }
    Ok(())
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
                match ty {
                    KvType::F32 => x86::scores512::<0>(qp, g, hd, rp, stride, n, scale, op),
                    KvType::F16 => x86::scores512::<1>(qp, g, hd, rp, stride, n, scale, op),
                    KvType::Q8_0 => x86::scores512::<2>(qp, g, hd, rp, stride, n, scale, op),
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
                match ty {
                    KvType::F32 => x86::accum512::<0>(pp, g, hd, rp, stride, n, ap),
                    KvType::F16 => x86::accum512::<1>(pp, g, hd, rp, stride, n, ap),
                    KvType::Q8_0 => x86::accum512::<2>(pp, g, hd, rp, stride, n, ap),
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
        if hd.is_multiple_of(32) {
            // Register path: 32 output columns stay in 4 registers across the block's rows.
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
                            let seg = rows.add(j * stride);
                            if T == 2 {
                                let blk = seg.add(34 * (c / 32));
                                let wd = _mm256_set1_ps(w * f16_scale(blk));
                                for (k, rk) in r.iter_mut().enumerate() {
                                    *rk = _mm256_fmadd_ps(wd, q8x8(blk.add(2 + 8 * k)), *rk);
                                }
                            } else {
                                let wv = _mm256_set1_ps(w);
                                for (k, rk) in r.iter_mut().enumerate() {
                                    *rk = _mm256_fmadd_ps(wv, load8::<T>(seg, c + 8 * k), *rk);
                                }
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
            ];
            for g in [1, 3] {
                let q = rng.normals(g * hd, 1.0);
                for mask in masks {
                    let query = Query {
                        layer: 1,
                        kv_head: n_kv_heads - 1,
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
        let bad_layer = Query { layer: 1, ..ok };
        assert!(attend(&s, &[0], 4, &bad_layer, &mut out, &mut sc).is_err());
        let bad_hd = Query {
            head_dim: 16,
            kv_head: 0,
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

    /// Accuracy and speed of the cache types (run with
    /// `cargo test --release -p kvserve-core --lib kv_measure -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn kv_measure() {
        let (hd, n_kv_heads, g, bs) = (64, 3, 3, 16);
        let kv_dim = hd * n_kv_heads;
        for n_kv in [128usize, 1024, 4096] {
            let nb = n_kv / bs;
            let mut rng = Rng(n_kv as u64);
            // Keys with outlier channels; rotated-query scale; unit values.
            let keys: Vec<Vec<f32>> = (0..n_kv)
                .map(|_| {
                    let mut k = rng.normals(kv_dim, 1.0);
                    for c in (3..kv_dim).step_by(17) {
                        k[c] *= 6.0;
                    }
                    k
                })
                .collect();
            let vals: Vec<Vec<f32>> = (0..n_kv).map(|_| rng.normals(kv_dim, 1.0)).collect();
            let queries: Vec<Vec<f32>> = (0..16).map(|_| rng.normals(g * hd, 1.5)).collect();
            let table: Vec<u32> = rng.table(nb, nb);
            let mut exact = KvStorage::new(
                KvLayout {
                    ty: KvType::F32,
                    n_layers: 1,
                    kv_dim,
                    block_size: bs,
                },
                nb,
            )
            .unwrap();
            for i in 0..n_kv {
                exact
                    .write(0, table[i / bs], i % bs, &keys[i], &vals[i])
                    .unwrap();
            }
            for ty in [KvType::F32, KvType::F16, KvType::Q8_0] {
                let layout = KvLayout {
                    ty,
                    n_layers: 1,
                    kv_dim,
                    block_size: bs,
                };
                let mut s = KvStorage::new(layout, nb).unwrap();
                for i in 0..n_kv {
                    s.write(0, table[i / bs], i % bs, &keys[i], &vals[i])
                        .unwrap();
                }
                let (mut max_e, mut sum_e, mut cnt) = (0.0f64, 0.0f64, 0usize);
                let mut out = vec![0.0; g * hd];
                let mut sc = Scratch::default();
                for q in &queries {
                    let query = Query {
                        layer: 0,
                        kv_head: 1,
                        head_dim: hd,
                        q,
                        scale: 1.0 / (hd as f32).sqrt(),
                        mask: Mask::All,
                    };
                    attend(&s, &table, n_kv, &query, &mut out, &mut sc).unwrap();
                    let want = reference(&exact, &table, n_kv, &query);
                    for (&o, &w) in out.iter().zip(&want) {
                        let e = (o as f64 - w).abs();
                        max_e = max_e.max(e);
                        sum_e += e;
                        cnt += 1;
                    }
                }
                for lvl in SimdLevel::available() {
                    if lvl == SimdLevel::Avx512Vnni {
                        continue;
                    }
                    let q = &queries[0];
                    let query = Query {
                        layer: 0,
                        kv_head: 1,
                        head_dim: hd,
                        q,
                        scale: 0.125,
                        mask: Mask::All,
                    };
                    let reps = (200_000 / n_kv).max(20);
                    let t0 = std::time::Instant::now();
                    for _ in 0..reps {
                        attend_at(lvl, &s, &table, n_kv, &query, &mut out, &mut sc).unwrap();
                    }
                    let us = t0.elapsed().as_secs_f64() * 1e6 / reps as f64;
                    println!(
                        "n_kv={n_kv:5} {:5} {:7}: {us:8.2} us per (token, GQA group of {g} heads), {:6.2} ns/cell; max abs err {max_e:.2e} mean {:.2e}",
                        ty.name(),
                        lvl.name(),
                        us * 1e3 / n_kv as f64,
                        sum_e / cnt as f64
                    );
                }
            }
        }
    }
}
