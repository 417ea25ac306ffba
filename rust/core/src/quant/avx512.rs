//! AVX-512 VNNI kernels for the legacy block types against Q8 activations:
//! - `dot_row2`: one row times one token, two blocks per 512-bit `vpdpbusd`, 8 blocks reduced
//!   to exact per-block sums in 8 lanes (decode path);
//! - `tile`: `R` rows times `G * 16` tokens over the wide packed activation layout (prefill);
//! - `tile8` and `tile4`: rows times up to 8 or 4 tokens over the narrow packed layouts
//!   (decode of a few sequences), with 256-bit vectors so that few lanes are wasted.
//!
//! All follow the canonical f32 order of `legacy::vec_dot_scalar` (8 slot accumulators,
//! block `b` into slot `b % 8`, fixed final tree), so for every (row, token) they return the
//! same bits as each other and as the scalar reference: a token's result does not depend on
//! the batch it is in.
//!
//! Tile kernel idea: a 64-byte activation line holds 4 consecutive quants of one block for 16
//! tokens; broadcasting 4 unpacked weight bytes of one row to all lanes lets one `vpdpbusd`
//! advance 16 (row, token) dot products by 4 elements. Weights are unpacked once per row and
//! block and reused for every token group; scaling by `d * da` (per lane) happens once per block.
//! Q8_0 weights are made unsigned with `w ^ 0x80 = w + 128`, corrected by `-128 * d * sa`.

#![cfg(target_arch = "x86_64")]

use super::avx2::{block_bytes, f16_load, u32_load, T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1};
use super::q8::Line;
use std::arch::x86_64::*;

/// Unsigned weight bytes of one or two blocks in element order (`[b0 | b1]`, zeros for a
/// missing `b1`). Q8_0 is offset by 128 (see the module docs).
///
/// # Safety
/// The features in the attribute are available; the blocks are readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn weights_pair<const T: u8, const TWO: bool>(b0: *const u8) -> __m512i {
    let ts = block_bytes(T);
    // SAFETY: reads stay inside the one or two blocks (caller).
    unsafe {
        match T {
            T_Q4_0 | T_Q4_1 | T_Q5_0 | T_Q5_1 => {
                let off = match T {
                    T_Q4_0 => 2,
                    T_Q4_1 => 4,
                    T_Q5_0 => 6,
                    _ => 8,
                };
                let q0 = _mm_loadu_si128(b0.add(off).cast());
                let q1 = if TWO {
                    _mm_loadu_si128(b0.add(ts + off).cast())
                } else {
                    _mm_setzero_si128()
                };
                let y = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(q0), q1);
                let z =
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(y), _mm256_srli_epi16::<4>(y));
                let z = _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
                // [q0 lo, q1 lo, q0 hi, q1 hi] -> [q0 lo, q0 hi, q1 lo, q1 hi]
                let z = _mm512_shuffle_i64x2::<0xD8>(z, z);
                if T == T_Q5_0 || T == T_Q5_1 {
                    let hoff = if T == T_Q5_0 { 2 } else { 4 };
                    let h0 = u32_load(b0.add(hoff)) as u64;
                    let h1 = if TWO {
                        u32_load(b0.add(ts + hoff)) as u64
                    } else {
                        0
                    };
                    let hb = _mm512_maskz_mov_epi8(h0 | (h1 << 32), _mm512_set1_epi8(0x10));
                    _mm512_or_si512(z, hb)
                } else {
                    z
                }
            }
            _ => {
                let w0 = _mm256_loadu_si256(b0.add(2).cast());
                let w1 = if TWO {
                    _mm256_loadu_si256(b0.add(ts + 2).cast())
                } else {
                    _mm256_setzero_si256()
                };
                let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(w0), w1);
                let z = _mm512_xor_si512(z, _mm512_set1_epi8(-128));
                if TWO {
                    z
                } else {
                    _mm512_maskz_mov_epi8(0xFFFF_FFFF, z)
                }
            }
        }
    }
}

/// Block (and slot) held by lane `k` of [`reduce4`]'s result: pairs `(2p, 2p + 1)` come in
/// as vector `p`.
const PERM8: [i32; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
/// Inverse of [`PERM8`]: lane of slot `j`.
const INV8: [i32; 8] = [0, 4, 1, 5, 2, 6, 3, 7];
/// `ds` index of `da` for lane `k` (`2 * PERM8[k]`; the upper 8 entries are unused).
const IDA: [i32; 16] = [0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0];

/// Reduces 4 vectors of `vpdpbusd` partials (vector `p` holds blocks `2p` and `2p + 1`, 8 lanes
/// each) to the 8 exact block sums, block `PERM8[k]` in lane `k`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn reduce4(v: &[__m512i; 4]) -> __m256i {
    let h = |a: __m512i, b: __m512i| {
        _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
    };
    let a = h(v[0], v[1]);
    let b = h(v[2], v[3]);
    // 128-bit lane L now holds [v0, v1, v2, v3] partial sums of quarter L.
    let s = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    let r = _mm512_add_epi32(
        _mm512_shuffle_i32x4::<0x08>(s, s),
        _mm512_shuffle_i32x4::<0x0D>(s, s),
    );
    _mm512_castsi512_si256(r)
}

/// Dot product of one legacy row (`nb` blocks at `row`) with one token's Q8 activations
/// (`qa`: `32 * nb` quants, `ds`: `nb` interleaved `(da, sa)`), 8 blocks per step with the
/// 8 lanes of the accumulator as the slots of the canonical order (`legacy::vec_dot_scalar`).
///
/// # Safety
/// The features in the attribute are available and all pointers cover `nb` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_row2<const T: u8>(
    row: *const u8,
    qa: *const i8,
    ds: *const f32,
    nb: usize,
) -> f32 {
    let ts = block_bytes(T);
    // SAFETY: the tables hold 8, 8 and 16 i32.
    let (perm, inv, ida) = unsafe {
        (
            _mm256_loadu_si256(PERM8.as_ptr().cast()),
            _mm256_loadu_si256(INV8.as_ptr().cast()),
            _mm512_loadu_si512(IDA.as_ptr().cast()),
        )
    };
    let t = ts as i32;
    let goff = _mm256_setr_epi32(0, 2 * t, 4 * t, 6 * t, t, 3 * t, 5 * t, 7 * t);
    let isa = _mm512_add_epi32(ida, _mm512_set1_epi32(1));
    let mut acc = _mm256_setzero_ps();
    let mut g0 = 0;
    // SAFETY: full steps read blocks g0..g0+8 <= nb; the tail step reads only blocks < nb
    // (masked loads and gathers, zero vectors for missing pairs).
    unsafe {
        while g0 < nb {
            let rem = nb - g0;
            let blk = row.add(g0 * ts);
            if rem <= 2 {
                // Cheaper tail for one pair (the common 18-block rows): blocks g0 and g0 + 1
                // go to slots 0 and 1, i.e. lanes 0 and 4 of the accumulator.
                let two = rem == 2;
                let v = if two {
                    let w = weights_pair::<T, true>(blk);
                    let a = _mm512_loadu_si512(qa.add(g0 * 32).cast());
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a)
                } else {
                    let w = weights_pair::<T, false>(blk);
                    let a = _mm512_maskz_loadu_epi8(0xFFFF_FFFF, qa.add(g0 * 32));
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a)
                };
                let t =
                    _mm256_hadd_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
                let t = _mm256_hadd_epi32(t, t);
                let u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
                let isum = _mm256_permutevar8x32_epi32(
                    _mm256_castsi128_si256(u),
                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                );
                let r1 = if two { u32_load(blk.add(ts)) as i32 } else { 0 };
                let raw = _mm256_setr_epi32(u32_load(blk) as i32, 0, 0, 0, r1, 0, 0, 0);
                let k: u8 = if two { 0x11 } else { 0x01 };
                let m2 = (1u16 << (2 * rem)) - 1;
                let dsv = _mm512_maskz_loadu_ps(m2, ds.add(2 * g0));
                acc = scale_acc::<T>(isum, raw, dsv, ida, isa, k, acc);
                break;
            }
            let mut v = [_mm512_setzero_si512(); 4];
            for (p, vp) in v.iter_mut().enumerate() {
                let b = g0 + 2 * p;
                if b + 1 < nb {
                    let w = weights_pair::<T, true>(row.add(b * ts));
                    let a = _mm512_loadu_si512(qa.add(b * 32).cast());
                    *vp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
                } else if b < nb {
                    let w = weights_pair::<T, false>(row.add(b * ts));
                    let a = _mm512_maskz_loadu_epi8(0xFFFF_FFFF, qa.add(b * 32));
                    *vp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
                }
            }
            let isum = reduce4(&v);
            let (k, raw, dsv) = if rem >= 8 {
                (
                    0xFFu8,
                    _mm256_i32gather_epi32::<1>(blk.cast(), goff),
                    _mm512_loadu_ps(ds.add(2 * g0)),
                )
            } else {
                let k = _mm256_cmplt_epi32_mask(perm, _mm256_set1_epi32(rem as i32));
                let m2 = (1u16 << (2 * rem)) - 1;
                (
                    k,
                    _mm256_mmask_i32gather_epi32::<1>(_mm256_setzero_si256(), k, goff, blk.cast()),
                    _mm512_maskz_loadu_ps(m2, ds.add(2 * g0)),
                )
            };
            acc = scale_acc::<T>(isum, raw, dsv, ida, isa, k, acc);
            g0 += 8;
        }
    }
    tree8(_mm256_permutevar8x32_ps(acc, inv))
}

/// One step of the canonical order on the slot lanes `k`: `raw` holds the first u32 of each
/// lane's block (`d`, and `m` for Q4_1/Q5_1), `dsv` the token's `(da, sa)` pairs of the step.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn scale_acc<const T: u8>(
    isum: __m256i,
    raw: __m256i,
    dsv: __m512,
    ida: __m512i,
    isa: __m512i,
    k: u8,
    acc: __m256,
) -> __m256 {
    let c = match T {
        T_Q4_0 => -8.0,
        T_Q5_0 => -16.0,
        _ => -128.0,
    };
    let d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(raw));
    let m = if T == T_Q4_1 || T == T_Q5_1 {
        _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32::<16>(raw)))
    } else {
        _mm256_mul_ps(d, _mm256_set1_ps(c))
    };
    let da = _mm512_castps512_ps256(_mm512_permutexvar_ps(ida, dsv));
    let sa = _mm512_castps512_ps256(_mm512_permutexvar_ps(isa, dsv));
    let sc = _mm256_mul_ps(d, da);
    let acc = _mm256_mask3_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc, k);
    _mm256_mask3_fmadd_ps(m, sa, acc, k)
}

/// The canonical final reduction of 8 slot accumulators (slot `j` in lane `j`): lanes
/// `j + j+4`, then `j + j+2`, then `0 + 1`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn tree8(v: __m256) -> f32 {
    let h4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)))
}

/// Unpacks one block into two vectors of 16 unsigned weight bytes each broadcast to all four
/// 128-bit lanes (elements 0..16 and 16..32), returning them with `(d, m_eff)`.
///
/// # Safety
/// The features in the attribute are available; `blk` points at a whole block of type `T`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_bcast<const T: u8>(blk: *const u8) -> (__m512i, __m512i, f32, f32) {
    let lo4 = _mm512_set1_epi8(0x0F);
    // SAFETY: every offset is inside one block of type `T` (caller).
    unsafe {
        let d = f16_load(blk);
        match T {
            T_Q4_0 | T_Q4_1 | T_Q5_0 | T_Q5_1 => {
                let off = match T {
                    T_Q4_0 => 2,
                    T_Q4_1 => 4,
                    T_Q5_0 => 6,
                    _ => 8,
                };
                let q = _mm512_broadcast_i32x4(_mm_loadu_si128(blk.add(off).cast()));
                let mut lo = _mm512_and_si512(q, lo4);
                let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), lo4);
                if T == T_Q5_0 || T == T_Q5_1 {
                    let hoff = if T == T_Q5_0 { 2 } else { 4 };
                    let hb = _mm256_maskz_mov_epi8(u32_load(blk.add(hoff)), _mm256_set1_epi8(0x10));
                    lo = _mm512_or_si512(lo, _mm512_broadcast_i32x4(_mm256_castsi256_si128(hb)));
                    hi = _mm512_or_si512(
                        hi,
                        _mm512_broadcast_i32x4(_mm256_extracti128_si256::<1>(hb)),
                    );
                }
                let m = match T {
                    T_Q4_0 => -8.0 * d,
                    T_Q5_0 => -16.0 * d,
                    _ => f16_load(blk.add(2)),
                };
                (lo, hi, d, m)
            }
            _ => {
                let flip = _mm512_set1_epi8(-128);
                let lo = _mm512_broadcast_i32x4(_mm_loadu_si128(blk.add(2).cast()));
                let hi = _mm512_broadcast_i32x4(_mm_loadu_si128(blk.add(18).cast()));
                (
                    _mm512_xor_si512(lo, flip),
                    _mm512_xor_si512(hi, flip),
                    d,
                    -128.0 * d,
                )
            }
        }
    }
}

/// `R` weight rows times `G` packed groups of 16 tokens. `lines`, `pd`, `ps` point at group 0 of
/// the range (layout of `QuantizedActs::packed`, `nb` blocks per token); `out[r][g][lane]`
/// receives the dot of row `r` with token `16 g + lane` of the range.
///
/// # Safety
/// The features in the attribute are available; each `rows[r]` covers `nb` blocks of type `T`;
/// `lines` covers `G * nb * 8` lines and `pd`/`ps` cover `G * nb * 16` floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn tile<const T: u8, const R: usize, const G: usize>(
    rows: &[*const u8; R],
    nb: usize,
    lines: *const Line,
    pd: *const f32,
    ps: *const f32,
    out: &mut [[[f32; 16]; G]; R],
) {
    let ts = block_bytes(T);
    // Slot results of the canonical order (`legacy::vec_dot_scalar`), lanes = tokens. Blocks
    // are visited slot-major (s, s + 8, ...), so one register accumulator per (row, group)
    // suffices; the order of the f32 operations per slot is the canonical one.
    let slot = |s: usize| -> [[__m512; G]; R] {
        let mut facc = [[_mm512_setzero_ps(); G]; R];
        let mut b = s;
        // SAFETY: b < nb, g < G, k < 8 and r < R keep every access inside the ranges above.
        unsafe {
            while b < nb {
                let mut da = [_mm512_setzero_ps(); G];
                let mut sa = [_mm512_setzero_ps(); G];
                for g in 0..G {
                    da[g] = _mm512_loadu_ps(pd.add((g * nb + b) * 16));
                    sa[g] = _mm512_loadu_ps(ps.add((g * nb + b) * 16));
                }
                let line = |g: usize, k: usize| -> __m512i {
                    _mm512_load_si512(lines.add((g * nb + b) * 8 + k).cast())
                };
                for r in 0..R {
                    let (lo, hi, d, m) = unpack_bcast::<T>(rows[r].add(b * ts));
                    let mut iacc = [_mm512_setzero_si512(); G];
                    macro_rules! step {
                        ($src:expr, $perm:literal, $k:literal) => {
                            let w = _mm512_shuffle_epi32::<$perm>($src);
                            for g in 0..G {
                                iacc[g] = _mm512_dpbusd_epi32(iacc[g], w, line(g, $k));
                            }
                        };
                    }
                    step!(lo, 0x00, 0);
                    step!(lo, 0x55, 1);
                    step!(lo, 0xAA, 2);
                    step!(lo, 0xFF, 3);
                    step!(hi, 0x00, 4);
                    step!(hi, 0x55, 5);
                    step!(hi, 0xAA, 6);
                    step!(hi, 0xFF, 7);
                    let vd = _mm512_set1_ps(d);
                    let vm = _mm512_set1_ps(m);
                    for g in 0..G {
                        let sc = _mm512_mul_ps(vd, da[g]);
                        let f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[g]), sc, facc[r][g]);
                        facc[r][g] = _mm512_fmadd_ps(vm, sa[g], f);
                    }
                }
                b += 8;
            }
        }
        facc
    };
    // The slots' tree ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)), folded as the slots
    // come (as in `tile_unpacked`: no array of every slot, no memset per call).
    let add = |x: [[__m512; G]; R], y: [[__m512; G]; R]| -> [[__m512; G]; R] {
        std::array::from_fn(|r| std::array::from_fn(|g| _mm512_add_ps(x[r][g], y[r][g])))
    };
    let b0 = add(add(slot(0), slot(4)), add(slot(2), slot(6)));
    let b1 = add(add(slot(1), slot(5)), add(slot(3), slot(7)));
    let sum = add(b0, b1);
    for (o, v) in out.iter_mut().zip(sum) {
        for (og, vg) in o.iter_mut().zip(v) {
            // SAFETY: 16 floats at `og`.
            unsafe { _mm512_storeu_ps(og.as_mut_ptr(), vg) };
        }
    }
}

/// Stores the first `rows` (1 to 4) rows of a tile's results (`res[row][lane]`, one lane per
/// token) transposed: token lane `l < lanes` gets `res[0..rows][l]` at `dst + l * stride`. Four
/// rows go through two unpacks and a shuffle to one 4-float store per token, where the scalar
/// twin [`store_transposed_scalar`] makes `rows` stores per token.
///
/// # Safety
/// The features in the attribute are available; `dst + l * stride + i` is writable for every
/// `l < lanes` and `i < rows`, and nothing else accesses those elements meanwhile.
#[target_feature(enable = "avx512f,avx512vl")]
pub(crate) unsafe fn store_transposed(
    res: &[[f32; 16]; 4],
    rows: usize,
    lanes: usize,
    dst: *mut f32,
    stride: usize,
) {
    debug_assert!((1..=4).contains(&rows) && lanes <= 16);
    // SAFETY: each row of `res` holds 16 floats.
    let [a, b, c, d] = res.map(|r| unsafe { _mm512_loadu_ps(r.as_ptr()) });
    // Per 128-bit lane j: [a b a b] pairs, then [a b c d] of token 4j + k in u[k].
    let (t0, t1) = (_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    let (t2, t3) = (_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    let u = [
        _mm512_shuffle_ps::<0x44>(t0, t2),
        _mm512_shuffle_ps::<0xEE>(t0, t2),
        _mm512_shuffle_ps::<0x44>(t1, t3),
        _mm512_shuffle_ps::<0xEE>(t1, t3),
    ];
    let mask = (1u8 << rows) - 1;
    for (k, &uk) in u.iter().enumerate() {
        let q = [
            _mm512_castps512_ps128(uk),
            _mm512_extractf32x4_ps::<1>(uk),
            _mm512_extractf32x4_ps::<2>(uk),
            _mm512_extractf32x4_ps::<3>(uk),
        ];
        for (j, &v) in q.iter().enumerate() {
            let l = 4 * j + k;
            if l < lanes {
                // SAFETY: l < lanes: the caller's contract covers dst + l * stride + 0..rows,
                // and the mask writes only those `rows` floats.
                unsafe {
                    let p = dst.add(l * stride);
                    if rows == 4 {
                        _mm_storeu_ps(p, v);
                    } else {
                        _mm_mask_storeu_ps(p, mask, v);
                    }
                }
            }
        }
    }
}

/// Scalar twin of [`store_transposed`] (the matmul wrote its tiles this way before).
///
/// # Safety
/// As [`store_transposed`], without the features.
#[cfg(test)]
pub(crate) unsafe fn store_transposed_scalar(
    res: &[[f32; 16]; 4],
    rows: usize,
    lanes: usize,
    dst: *mut f32,
    stride: usize,
) {
    for l in 0..lanes {
        for (i, r) in res.iter().enumerate().take(rows) {
            // SAFETY: the caller's contract covers dst + l * stride + i.
            unsafe { *dst.add(l * stride + i) = r[l] };
        }
    }
}

/// One legacy block of one weight row unpacked for [`tile_unpacked`]: the 32 integer weights
/// `q` (0..16 or 0..32, so they fit the signed operand of `vpdpbusd`), `d`, `m_eff` (as
/// `legacy::unpack_block` returns them) and `corr = 128 * sum(q)`.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct UBlock {
    pub(crate) q: [i8; 32],
    pub(crate) d: f32,
    pub(crate) m: f32,
    pub(crate) corr: i32,
}

impl UBlock {
    pub(crate) const ZERO: UBlock = UBlock {
        q: [0; 32],
        d: 0.0,
        m: 0.0,
        corr: 0,
    };
}

/// Unpacks one block of 4- or 5-bit type `T` into `out` (the values of
/// `legacy::unpack_block`, whose results the tests compare through the kernels).
///
/// # Safety
/// The features in the attribute are available; `blk` points at a whole block of type `T`
/// (not Q8_0).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn unpack_ublock<const T: u8>(blk: *const u8, out: &mut UBlock) {
    debug_assert!(T != super::avx2::T_Q8_0);
    // SAFETY: reads stay inside the block (caller); `out.q` holds 32 bytes.
    unsafe {
        let q = _mm512_castsi512_si256(weights_pair::<T, false>(blk));
        _mm256_storeu_si256(out.q.as_mut_ptr().cast(), q);
        let s = _mm256_sad_epu8(q, _mm256_setzero_si256());
        let s = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let sum = _mm_cvtsi128_si64(_mm_add_epi64(s, _mm_unpackhi_epi64(s, s))) as i32;
        let d = f16_load(blk);
        out.d = d;
        out.m = match T {
            T_Q4_0 => -8.0 * d,
            T_Q5_0 => -16.0 * d,
            _ => f16_load(blk.add(2)),
        };
        out.corr = 128 * sum;
    }
}

/// The first `R` (at most 4) of the rows in `rows` (each `nb` [`UBlock`]s) times one packed
/// group of 16 tokens (`lines`, `pd`, `ps` at the group's block 0, layout of
/// `QuantizedActs::packed`); `out[r][lane]` receives the dot of row `r` with token `lane`.
///
/// The variant of [`tile`] for 4- and 5-bit weights unpacked once per task: each activation
/// line is loaded once for the `R` rows and flipped to `qa + 128` (unsigned), the weight bytes
/// come broadcast from the unpacked rows straight into `vpdpbusd`, and `corr` takes the `+ 128`
/// back exactly, so the integer block sums and the f32 operations are those of the canonical
/// order (`legacy::vec_dot_scalar`): the same bits as every other kernel.
///
/// # Safety
/// The features in the attribute are available; `rows[r]` points at `nb` blocks for `r < R`;
/// `lines` covers `nb * 8` lines and `pd`/`ps` cover `nb * 16` floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn tile_unpacked<const R: usize>(
    rows: &[*const UBlock; 4],
    nb: usize,
    lines: *const Line,
    pd: *const f32,
    ps: *const f32,
    out: &mut [[f32; 16]; 4],
) {
    let flip = _mm512_set1_epi8(-128);
    // Slot `s` of each row: blocks s, s + 8, ... (0 past `nb`).
    let slot = |s: usize| -> [__m512; R] {
        let mut facc = [_mm512_setzero_ps(); R];
        let mut b = s;
        // SAFETY: b < nb, k < 8 and r < R keep every access inside the ranges of the contract.
        unsafe {
            while b < nb {
                let da = _mm512_loadu_ps(pd.add(b * 16));
                let sa = _mm512_loadu_ps(ps.add(b * 16));
                let blk: [&UBlock; R] = std::array::from_fn(|r| &*rows[r].add(b));
                let mut ia = [_mm512_setzero_si512(); R];
                for k in 0..8 {
                    let line =
                        _mm512_xor_si512(_mm512_load_si512(lines.add(b * 8 + k).cast()), flip);
                    for r in 0..R {
                        let wq = blk[r].q.as_ptr().add(4 * k).cast::<i32>().read_unaligned();
                        ia[r] = _mm512_dpbusd_epi32(ia[r], line, _mm512_set1_epi32(wq));
                    }
                }
                for r in 0..R {
                    let isum = _mm512_sub_epi32(ia[r], _mm512_set1_epi32(blk[r].corr));
                    let sc = _mm512_mul_ps(_mm512_set1_ps(blk[r].d), da);
                    let f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, facc[r]);
                    facc[r] = _mm512_fmadd_ps(_mm512_set1_ps(blk[r].m), sa, f);
                }
                b += 8;
            }
        }
        facc
    };
    // The slots' tree ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)), folded as the slots
    // come: an array of every slot indexed by a run-time slot lived in memory and was zeroed
    // by a 2 KiB memset per call (~4% of a prompt step).
    let add = |x: [__m512; R], y: [__m512; R]| -> [__m512; R] {
        std::array::from_fn(|r| _mm512_add_ps(x[r], y[r]))
    };
    let b0 = add(add(slot(0), slot(4)), add(slot(2), slot(6)));
    let b1 = add(add(slot(1), slot(5)), add(slot(3), slot(7)));
    let sum = add(b0, b1);
    for (o, v) in out.iter_mut().zip(sum) {
        // SAFETY: 16 floats at `o`.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
    }
}

/// Unpacks one block into two 256-bit vectors of 16 unsigned weight bytes, each copied to both
/// 128-bit halves (elements 0..16 and 16..32), returning them with `d` and `m_eff` broadcast to
/// all lanes; the 256-bit twin of [`unpack_bcast`] for the narrow tile.
///
/// # Safety
/// The features in the attribute are available; `blk` points at a whole block of type `T`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_bcast256<const T: u8>(blk: *const u8) -> (__m256i, __m256i, __m256, __m256) {
    let lo4 = _mm256_set1_epi8(0x0F);
    // SAFETY: every offset is inside one block of type `T` (caller): the 8 bytes converted to
    // floats start the block (every block type has at least 18 bytes).
    unsafe {
        // d (and m for Q4_1/Q5_1) in lanes 0 (and 1).
        let h = _mm_cvtph_ps(_mm_loadl_epi64(blk.cast()));
        let dv = _mm256_broadcastss_ps(h);
        match T {
            T_Q4_0 | T_Q4_1 | T_Q5_0 | T_Q5_1 => {
                let off = match T {
                    T_Q4_0 => 2,
                    T_Q4_1 => 4,
                    T_Q5_0 => 6,
                    _ => 8,
                };
                let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(blk.add(off).cast()));
                let mut lo = _mm256_and_si256(q, lo4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), lo4);
                if T == T_Q5_0 || T == T_Q5_1 {
                    let hoff = if T == T_Q5_0 { 2 } else { 4 };
                    let qh = u32_load(blk.add(hoff));
                    // Bit j of the mask selects byte j: the element's fifth bit, in both halves.
                    let mlo = (qh & 0xFFFF) * 0x1_0001;
                    let mhi = (qh >> 16) * 0x1_0001;
                    let h = _mm256_set1_epi8(0x10);
                    lo = _mm256_or_si256(lo, _mm256_maskz_mov_epi8(mlo, h));
                    hi = _mm256_or_si256(hi, _mm256_maskz_mov_epi8(mhi, h));
                }
                // -8 d and -16 d are exact, as in the scalar reference.
                let mv = match T {
                    T_Q4_0 => _mm256_mul_ps(dv, _mm256_set1_ps(-8.0)),
                    T_Q5_0 => _mm256_mul_ps(dv, _mm256_set1_ps(-16.0)),
                    _ => _mm256_broadcastss_ps(_mm_movehdup_ps(h)),
                };
                (lo, hi, dv, mv)
            }
            _ => {
                let flip = _mm256_set1_epi8(-128);
                let lo = _mm256_broadcastsi128_si256(_mm_loadu_si128(blk.add(2).cast()));
                let hi = _mm256_broadcastsi128_si256(_mm_loadu_si128(blk.add(18).cast()));
                (
                    _mm256_xor_si256(lo, flip),
                    _mm256_xor_si256(hi, flip),
                    dv,
                    _mm256_mul_ps(dv, _mm256_set1_ps(-128.0)),
                )
            }
        }
    }
}

/// Tokens of one narrow packed group (see `q8::Pack::Narrow`).
pub(crate) const NARROW_LANES: usize = 8;

/// `R` weight rows times up to 8 tokens in the narrow packed layout (decode of a few
/// sequences): a 32-byte line holds 4 consecutive quants of one block for each of the 8
/// tokens, so one 256-bit `vpdpbusd` with 4 weight bytes broadcast advances 8 (row, token)
/// dot products by 4 elements. Each row's block is unpacked once for all tokens; the 8 lines
/// of a block are loaded once for all `R` rows. `lines` is block 0's first line (`nb * 8`
/// lines of 32 bytes), `pd`/`ps` the per-(block, lane) scales (`nb * 8` floats each);
/// `out[r][lane]` receives the dot of row `r` with token `lane` (zero-padded lanes give
/// values to ignore).
///
/// The f32 operations per (row, token) are those of the canonical order
/// (`legacy::vec_dot_scalar`), so the results are bit-identical to the scalar reference, to
/// `dot_row2` and to `tile`: the exact per-block integer sum (split over two accumulators,
/// which integer addition makes order-free), then per slot `fma(m, sa, fma(isum, d * da, acc))`.
///
/// # Safety
/// The features in the attribute are available; each `rows[r]` covers `nb` blocks of type `T`;
/// `lines` covers `nb * 8` 32-byte lines (32-byte aligned) and `pd`/`ps` cover `nb * 8` floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn tile8<const T: u8, const R: usize>(
    rows: &[*const u8; R],
    nb: usize,
    lines: *const u8,
    pd: *const f32,
    ps: *const f32,
    out: &mut [[f32; NARROW_LANES]; R],
) {
    let ts = block_bytes(T);
    // Slot `s` (blocks s, s + 8, ...; 0 past `nb`), folded as the slots come by the tree
    // ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)) (as in `tile_unpacked`).
    let slot = |s: usize| -> [__m256; R] {
        // SAFETY: b < nb, k < 8 and r < R keep every access inside the ranges above.
        unsafe {
            let mut facc = [_mm256_setzero_ps(); R];
            let mut b = s;
            while b < nb {
                let da = _mm256_loadu_ps(pd.add(b * NARROW_LANES));
                let sa = _mm256_loadu_ps(ps.add(b * NARROW_LANES));
                let base = lines.add(b * 8 * 32);
                let a: [__m256i; 8] =
                    std::array::from_fn(|k| _mm256_load_si256(base.add(k * 32).cast()));
                for r in 0..R {
                    let (lo, hi, dv, mv) = unpack_bcast256::<T>(rows[r].add(b * ts));
                    let z = _mm256_setzero_si256();
                    let i0 = _mm256_dpbusd_epi32(z, _mm256_shuffle_epi32::<0x00>(lo), a[0]);
                    let i1 = _mm256_dpbusd_epi32(z, _mm256_shuffle_epi32::<0x00>(hi), a[4]);
                    let i0 = _mm256_dpbusd_epi32(i0, _mm256_shuffle_epi32::<0x55>(lo), a[1]);
                    let i1 = _mm256_dpbusd_epi32(i1, _mm256_shuffle_epi32::<0x55>(hi), a[5]);
                    let i0 = _mm256_dpbusd_epi32(i0, _mm256_shuffle_epi32::<0xAA>(lo), a[2]);
                    let i1 = _mm256_dpbusd_epi32(i1, _mm256_shuffle_epi32::<0xAA>(hi), a[6]);
                    let i0 = _mm256_dpbusd_epi32(i0, _mm256_shuffle_epi32::<0xFF>(lo), a[3]);
                    let i1 = _mm256_dpbusd_epi32(i1, _mm256_shuffle_epi32::<0xFF>(hi), a[7]);
                    let isum = _mm256_add_epi32(i0, i1);
                    let sc = _mm256_mul_ps(dv, da);
                    let f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, facc[r]);
                    facc[r] = _mm256_fmadd_ps(mv, sa, f);
                }
                b += 8;
            }
            facc
        }
    };
    let add = |x: [__m256; R], y: [__m256; R]| -> [__m256; R] {
        std::array::from_fn(|i| _mm256_add_ps(x[i], y[i]))
    };
    let b0 = add(add(slot(0), slot(4)), add(slot(2), slot(6)));
    let b1 = add(add(slot(1), slot(5)), add(slot(3), slot(7)));
    for (o, v) in out.iter_mut().zip(add(b0, b1)) {
        // SAFETY: 8 floats at `o`.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
    }
}

/// Tokens of one quarter-width packed group (see `q8::Pack::Narrow4`).
pub(crate) const NARROW4_LANES: usize = 4;

/// Unpacks block `b` of two rows into `[row A | row B]` vectors: `lo` holds elements 0..16 of
/// A in the low 128 bits and of B in the high 128 bits, `hi` elements 16..32 likewise (unsigned
/// bytes, Q8_0 offset by 128); `dv`/`mv` hold `d` and `m_eff` of A in the low four lanes and of
/// B in the high four.
///
/// # Safety
/// The features in the attribute are available; `a` and `b` point at whole blocks of type `T`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_pair<const T: u8>(
    a: *const u8,
    b: *const u8,
) -> (__m256i, __m256i, __m256, __m256) {
    let lo4 = _mm256_set1_epi8(0x0F);
    // SAFETY: every offset is inside one block of type `T` (caller); the 8 bytes converted to
    // floats start the block (every block type has at least 18 bytes).
    unsafe {
        let ha = _mm_cvtph_ps(_mm_loadl_epi64(a.cast()));
        let hb = _mm_cvtph_ps(_mm_loadl_epi64(b.cast()));
        let h = _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(ha), hb);
        let dv = _mm256_permute_ps::<0x00>(h);
        let pair = |off: usize| {
            _mm256_inserti128_si256::<1>(
                _mm256_castsi128_si256(_mm_loadu_si128(a.add(off).cast())),
                _mm_loadu_si128(b.add(off).cast()),
            )
        };
        match T {
            T_Q4_0 | T_Q4_1 | T_Q5_0 | T_Q5_1 => {
                let off = match T {
                    T_Q4_0 => 2,
                    T_Q4_1 => 4,
                    T_Q5_0 => 6,
                    _ => 8,
                };
                let q = pair(off);
                let mut lo = _mm256_and_si256(q, lo4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), lo4);
                if T == T_Q5_0 || T == T_Q5_1 {
                    let hoff = if T == T_Q5_0 { 2 } else { 4 };
                    let (qa, qb) = (u32_load(a.add(hoff)), u32_load(b.add(hoff)));
                    // Bit j of the mask selects byte j: the element's fifth bit.
                    let mlo = (qa & 0xFFFF) | (qb << 16);
                    let mhi = (qa >> 16) | (qb & 0xFFFF_0000);
                    let h = _mm256_set1_epi8(0x10);
                    lo = _mm256_or_si256(lo, _mm256_maskz_mov_epi8(mlo, h));
                    hi = _mm256_or_si256(hi, _mm256_maskz_mov_epi8(mhi, h));
                }
                // -8 d and -16 d are exact, as in the scalar reference.
                let mv = match T {
                    T_Q4_0 => _mm256_mul_ps(dv, _mm256_set1_ps(-8.0)),
                    T_Q5_0 => _mm256_mul_ps(dv, _mm256_set1_ps(-16.0)),
                    _ => _mm256_permute_ps::<0x55>(h),
                };
                (lo, hi, dv, mv)
            }
            _ => {
                let flip = _mm256_set1_epi8(-128);
                (
                    _mm256_xor_si256(pair(2), flip),
                    _mm256_xor_si256(pair(18), flip),
                    dv,
                    _mm256_mul_ps(dv, _mm256_set1_ps(-128.0)),
                )
            }
        }
    }
}

/// `2 * P` weight rows (pairs) times up to 4 tokens in the quarter-width packed layout: a
/// 16-byte line holds 4 consecutive quants of one block for each of the 4 tokens and is
/// broadcast to both 128-bit halves, while the halves of the weight vector hold two different
/// rows, so one 256-bit `vpdpbusd` advances 2 rows x 4 tokens by 4 elements and no lane is
/// wasted from 4 tokens on. `lines` is block 0's first line (`nb * 8` lines of 16 bytes),
/// `pd`/`ps` the per-(block, lane) scales (`nb * 4` floats each); `out[p][h * 4 + lane]`
/// receives the dot of row `2p + h` with token `lane`.
///
/// Same canonical order as [`tile8`]: bit-identical to the scalar reference per (row, token).
///
/// # Safety
/// The features in the attribute are available; each `rows[i]` covers `nb` blocks of type `T`;
/// `lines` covers `nb * 8` 16-byte lines (16-byte aligned) and `pd`/`ps` cover `nb * 4` floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn tile4<const T: u8, const P: usize>(
    rows: &[[*const u8; 2]; P],
    nb: usize,
    lines: *const u8,
    pd: *const f32,
    ps: *const f32,
    out: &mut [[f32; 2 * NARROW4_LANES]; P],
) {
    let ts = block_bytes(T);
    // Slot `s` (blocks s, s + 8, ...; 0 past `nb`), folded as the slots come by the tree
    // ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)) (as in `tile_unpacked`).
    let slot = |s: usize| -> [__m256; P] {
        // SAFETY: b < nb, k < 8 and p < P keep every access inside the ranges above.
        unsafe {
            let mut facc = [_mm256_setzero_ps(); P];
            let mut b = s;
            while b < nb {
                let da = _mm256_broadcast_ps(&*pd.add(b * NARROW4_LANES).cast::<__m128>());
                let sa = _mm256_broadcast_ps(&*ps.add(b * NARROW4_LANES).cast::<__m128>());
                let base = lines.add(b * 8 * 16);
                let a: [__m256i; 8] = std::array::from_fn(|k| {
                    _mm256_broadcastsi128_si256(_mm_load_si128(base.add(k * 16).cast()))
                });
                for p in 0..P {
                    let [ra, rb] = rows[p];
                    let (lo, hi, dv, mv) = unpack_pair::<T>(ra.add(b * ts), rb.add(b * ts));
                    let z = _mm256_setzero_si256();
                    let i0 = _mm256_dpbusd_epi32(z, _mm256_shuffle_epi32::<0x00>(lo), a[0]);
                    let i1 = _mm256_dpbusd_epi32(z, _mm256_shuffle_epi32::<0x00>(hi), a[4]);
                    let i0 = _mm256_dpbusd_epi32(i0, _mm256_shuffle_epi32::<0x55>(lo), a[1]);
                    let i1 = _mm256_dpbusd_epi32(i1, _mm256_shuffle_epi32::<0x55>(hi), a[5]);
                    let i0 = _mm256_dpbusd_epi32(i0, _mm256_shuffle_epi32::<0xAA>(lo), a[2]);
                    let i1 = _mm256_dpbusd_epi32(i1, _mm256_shuffle_epi32::<0xAA>(hi), a[6]);
                    let i0 = _mm256_dpbusd_epi32(i0, _mm256_shuffle_epi32::<0xFF>(lo), a[3]);
                    let i1 = _mm256_dpbusd_epi32(i1, _mm256_shuffle_epi32::<0xFF>(hi), a[7]);
                    let isum = _mm256_add_epi32(i0, i1);
                    let sc = _mm256_mul_ps(dv, da);
                    let f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, facc[p]);
                    facc[p] = _mm256_fmadd_ps(mv, sa, f);
                }
                b += 8;
            }
            facc
        }
    };
    let add = |x: [__m256; P], y: [__m256; P]| -> [__m256; P] {
        std::array::from_fn(|i| _mm256_add_ps(x[i], y[i]))
    };
    let b0 = add(add(slot(0), slot(4)), add(slot(2), slot(6)));
    let b1 = add(add(slot(1), slot(5)), add(slot(3), slot(7)));
    for (o, v) in out.iter_mut().zip(add(b0, b1)) {
        // SAFETY: 8 floats at `o`.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
    }
}
