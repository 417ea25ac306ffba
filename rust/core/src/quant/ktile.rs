//! Prefill tile for K-quant weights (Q4_K, Q5_K, Q6_K) at AVX-512 VNNI: `R` rows x 16 tokens
//! per kernel call over the wide packed Q8_K activations (`q8::pack_q8k`).
//!
//! Each weight row is unpacked once per task and block range into [`KBlock`]s (one signed byte
//! per weight, its scales, mins and constants), reused for every token group. The kernel keeps
//! tokens in the 16 lanes: one 64-byte activation line holds 4 consecutive quants of each
//! token (as `q + 128`), and one `vpdpbusd` with 4 weight bytes broadcast from the unpacked
//! block advances 16 (row, token) sums by 4 elements; each line feeds the `R` rows. The
//! `+ 128` of the activations is taken back exactly with a per-(row, block) integer constant.
//!
//! Per (row, token) the results are the bits of the scalar twin (`kquants::dot_q*_k_scalar`,
//! the canonical order: exact super-block sums `sumi` and `summ`, then one fma each), which the
//! per-row AVX-512 kernels follow too: a token's outputs do not depend on its batch.

#![cfg(target_arch = "x86_64")]

use super::kquants::{f16_at, q6_quant, unpack_scales_mins, QK_K};
use super::q8::{Line, QuantizedActs, GROUP, K_LINES};
use super::{GgmlType, QMatrix};
use crate::shared::SharedSlice;
use std::arch::x86_64::*;

/// One super-block of one weight row, unpacked for the kernel.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct KBlock {
    /// The 256 integer weights in element order: `q` (Q4_K, Q5_K) or `q - 32` (Q6_K).
    w: [i8; QK_K],
    /// Scale of each sub-block (8 of 32 weights, or 16 of 16 for Q6_K).
    sc: [i32; 16],
    /// Q4_K/Q5_K: the mins of sub-blocks `(2i, 2i + 1)` as an i16 pair.
    mins: [i32; 4],
    /// `128 * sum_s sc[s] * (sum of the weights of sub-block s)`: what the `+ 128` of the
    /// activations adds to `sumi`.
    corr: i32,
    /// The block's f16 `d` and `dmin` (Q6_K: `dmin` unused) as f32.
    d: f32,
    dmin: f32,
}

impl KBlock {
    const ZERO: KBlock = KBlock {
        w: [0; QK_K],
        sc: [0; 16],
        mins: [0; 4],
        corr: 0,
        d: 0.0,
        dmin: 0.0,
    };
}

const KQ4: u8 = 0;
const KQ5: u8 = 1;
const KQ6: u8 = 2;

/// Whether the tile serves weights of `ty`.
pub(crate) fn serves(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)
}

/// Unpacks one block of type `KT` (`blk` holds exactly its bytes).
fn unpack<const KT: u8>(blk: &[u8], out: &mut KBlock) {
    let w = &mut out.w;
    let (subs, len) = if KT == KQ6 { (16, 16) } else { (8, 32) };
    if KT == KQ6 {
        out.d = f16_at(blk, 208);
        out.dmin = 0.0;
        for h in 0..2 {
            let ql = &blk[64 * h..64 * h + 64];
            let qh = &blk[128 + 32 * h..128 + 32 * h + 32];
            for k in 0..4 {
                for l in 0..32 {
                    w[128 * h + 32 * k + l] = q6_quant(ql, qh, k, l) as i8 - 32;
                }
            }
        }
        for (g, s) in out.sc.iter_mut().enumerate() {
            *s = blk[192 + g] as i8 as i32;
        }
        out.mins = [0; 4];
    } else {
        out.d = f16_at(blk, 0);
        out.dmin = f16_at(blk, 2);
        let (sc, m) = unpack_scales_mins(&blk[4..16]);
        let (sc, m) = (sc.to_le_bytes(), m.to_le_bytes());
        let (qh, qs) = if KT == KQ5 {
            (&blk[16..48], &blk[48..176])
        } else {
            (&blk[16..16], &blk[16..144])
        };
        for j in 0..4 {
            for l in 0..32 {
                let q = qs[32 * j + l];
                let (mut lo, mut hi) = (q & 0x0f, q >> 4);
                if KT == KQ5 {
                    lo |= ((qh[l] >> (2 * j)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                }
                w[64 * j + l] = lo as i8;
                w[64 * j + 32 + l] = hi as i8;
            }
        }
        for s in 0..8 {
            out.sc[s] = sc[s] as i32;
        }
        out.sc[8..].fill(0);
        for i in 0..4 {
            out.mins[i] = (m[2 * i] as u32 | (m[2 * i + 1] as u32) << 16) as i32;
        }
    }
    let mut corr = 0i32;
    for s in 0..subs {
        let sum: i32 = w[s * len..(s + 1) * len].iter().map(|&v| v as i32).sum();
        corr += out.sc[s] * sum;
    }
    out.corr = 128 * corr;
}

/// Blocks unpacked at a time per row (a row of up to 16 * 256 columns is unpacked once).
const BLOCK_CHUNK: usize = 16;
/// Token groups that share one unpacking of the rows: their activations (about 4.3 KiB per
/// block and group) should stay in L2 while the rows pass over them.
const L2_BUDGET: usize = 512 * 1024;
const MAX_GROUPS: usize = 16;

/// Rows `r0..r1` times token groups `g0..g1` of `w` with the wide packed Q8_K `a`.
///
/// # Safety
/// Only at level Avx512Vnni (detected) with `a` packed wide for `w`'s type; the caller owns rows
/// r0..r1 x groups g0..g1 of `out` exclusively.
pub(super) unsafe fn range(
    w: &QMatrix,
    a: &QuantizedActs,
    out: &SharedSlice<f32>,
    r0: usize,
    r1: usize,
    g0: usize,
    g1: usize,
) {
    // SAFETY: forwarded contract.
    unsafe {
        match w.ty {
            GgmlType::Q4_K => range_t::<KQ4>(w, a, out, r0, r1, g0, g1),
            GgmlType::Q5_K => range_t::<KQ5>(w, a, out, r0, r1, g0, g1),
            _ => range_t::<KQ6>(w, a, out, r0, r1, g0, g1),
        }
    }
}

unsafe fn range_t<const KT: u8>(
    w: &QMatrix,
    a: &QuantizedActs,
    out: &SharedSlice<f32>,
    r0: usize,
    r1: usize,
    g0: usize,
    g1: usize,
) {
    let nb = w.cols / QK_K;
    let per_group = nb * K_LINES * 64;
    let gc = (L2_BUDGET / per_group).clamp(1, MAX_GROUPS);
    // Scratch for every call of this task (filled before use: only its first rows and groups
    // are read).
    let mut blocks = [[KBlock::ZERO; BLOCK_CHUNK]; 4];
    let mut acc = [[[[0f32; GROUP]; 2]; 4]; MAX_GROUPS];
    let mut gs = g0;
    while gs < g1 {
        let ge = (gs + gc).min(g1);
        let mut r = r0;
        while r + 4 <= r1 {
            // SAFETY: forwarded contract; rows r..r+4 x groups gs..ge are owned.
            unsafe { rows::<KT, 4>(w, a, out, r, gs, ge, &mut blocks, &mut acc) };
            r += 4;
        }
        while r < r1 {
            // SAFETY: forwarded contract; row r x groups gs..ge are owned.
            unsafe { rows::<KT, 1>(w, a, out, r, gs, ge, &mut blocks, &mut acc) };
            r += 1;
        }
        gs = ge;
    }
}

/// Per (group, row): the f32 accumulators `acc` and `accm` of the canonical order.
type Acc = [[[f32; GROUP]; 2]; 4];

/// Rows `r..r + R` times groups `gs..ge` (at most `MAX_GROUPS`).
unsafe fn rows<const KT: u8, const R: usize>(
    w: &QMatrix,
    a: &QuantizedActs,
    out: &SharedSlice<f32>,
    r: usize,
    gs: usize,
    ge: usize,
    blocks: &mut [[KBlock; BLOCK_CHUNK]; 4],
    acc: &mut [Acc; MAX_GROUPS],
) {
    let nb = w.cols / QK_K;
    let ts = w.ty.type_size();
    let ng = ge - gs;
    for accg in acc.iter_mut().take(ng) {
        *accg = [[[0.0; GROUP]; 2]; 4];
    }
    let mut b0 = 0;
    while b0 < nb {
        let b1 = (b0 + BLOCK_CHUNK).min(nb);
        for (i, row_blocks) in blocks.iter_mut().enumerate().take(R) {
            let row = w.row(r + i);
            for b in b0..b1 {
                unpack::<KT>(&row[b * ts..(b + 1) * ts], &mut row_blocks[b - b0]);
            }
        }
        for gi in 0..ng {
            let gb = (gs + gi) * nb + b0;
            // The slices prove the packed buffers cover blocks b0..b1 of the group.
            let lines = &a.packed[gb * K_LINES..(gb + b1 - b0) * K_LINES];
            let pd = &a.pd[gb * GROUP..(gb + b1 - b0) * GROUP];
            // SAFETY: the caller only takes this path at level Avx512Vnni (detected); the
            // slices above cover `b1 - b0` blocks; `blocks` holds that many per row.
            unsafe { kernel::<KT, R>(blocks, b1 - b0, lines.as_ptr(), pd.as_ptr(), &mut acc[gi]) };
        }
        b0 = b1;
    }
    let n = a.n_tokens;
    for (gi, accg) in acc.iter().enumerate().take(ng) {
        let t0 = (gs + gi) * GROUP;
        for lane in 0..GROUP.min(n - t0) {
            let at = (t0 + lane) * w.rows + r;
            // SAFETY: token t0 + lane < n and rows r..r+R: inside `out`; the caller owns this
            // tile exclusively.
            let dst = unsafe { out.slice_mut(at..at + R) };
            for (o, ra) in dst.iter_mut().zip(accg) {
                *o = if KT == KQ6 {
                    ra[0][lane]
                } else {
                    ra[0][lane] - ra[1][lane]
                };
            }
        }
    }
}

/// The first `R` (at most 4) unpacked rows times one group of 16 tokens over `nbc` blocks: adds each block's
/// `fma(sumi, d * d_a, .)` to `acc[r][0]` and `fma(summ, dmin * d_a, .)` to `acc[r][1]`.
///
/// # Safety
/// The features in the attribute are available; `lines` covers `nbc * K_LINES` lines and `pd`
/// `nbc * 16` floats; `blocks[r]` holds at least `nbc` unpacked blocks for `r < R <= 4`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn kernel<const KT: u8, const R: usize>(
    blocks: &[[KBlock; BLOCK_CHUNK]; 4],
    nbc: usize,
    lines: *const Line,
    pd: *const f32,
    acc: &mut Acc,
) {
    let (subs, per_sub) = if KT == KQ6 { (16, 4) } else { (8, 8) };
    // SAFETY: every access stays in the ranges of the contract (b < nbc, k < K_LINES, r < R,
    // weight offsets 4k + 4 <= 256).
    unsafe {
        let mut fa = [[_mm512_setzero_ps(); 2]; R];
        for r in 0..R {
            fa[r][0] = _mm512_loadu_ps(acc[r][0].as_ptr());
            fa[r][1] = _mm512_loadu_ps(acc[r][1].as_ptr());
        }
        for b in 0..nbc {
            let lb = lines.add(b * K_LINES);
            let dv = _mm512_loadu_ps(pd.add(b * GROUP));
            let mut sumi = [_mm512_setzero_si512(); R];
            for s in 0..subs {
                let mut ia = [_mm512_setzero_si512(); R];
                for k in s * per_sub..(s + 1) * per_sub {
                    let line = _mm512_load_si512(lb.add(k).cast());
                    for r in 0..R {
                        let wq = blocks[r][b].w.as_ptr().add(4 * k);
                        let wv = _mm512_set1_epi32(wq.cast::<i32>().read_unaligned());
                        ia[r] = _mm512_dpbusd_epi32(ia[r], line, wv);
                    }
                }
                for r in 0..R {
                    let sc = _mm512_set1_epi32(blocks[r][b].sc[s]);
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(ia[r], sc));
                }
            }
            for r in 0..R {
                let blk = &blocks[r][b];
                let si = _mm512_sub_epi32(sumi[r], _mm512_set1_epi32(blk.corr));
                let dr = _mm512_mul_ps(_mm512_set1_ps(blk.d), dv);
                fa[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), dr, fa[r][0]);
                if KT != KQ6 {
                    let mut sm = _mm512_setzero_si512();
                    for i in 0..4 {
                        let sl = _mm512_load_si512(lb.add(64 + i).cast());
                        sm = _mm512_dpwssd_epi32(sm, sl, _mm512_set1_epi32(blk.mins[i]));
                    }
                    let dm = _mm512_mul_ps(_mm512_set1_ps(blk.dmin), dv);
                    fa[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sm), dm, fa[r][1]);
                }
            }
        }
        for r in 0..R {
            _mm512_storeu_ps(acc[r][0].as_mut_ptr(), fa[r][0]);
            _mm512_storeu_ps(acc[r][1].as_mut_ptr(), fa[r][1]);
        }
    }
}
