//! AVX-512 VNNI kernels for the legacy block types against Q8 activations:
//! - `dot_row2`: one row times one token, two blocks per 512-bit `vpdpbusd` (decode path);
//!   per pair of blocks the weight scales `[d0, m0, d1, m1]` are converted in one instruction
//!   and multiplied with the interleaved activation `[da0, sa0, da1, sa1]`;
//! - `tile`: `R` rows times `G * 16` tokens over the packed activation layout (prefill path).
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

/// `[d0, m_eff0, d1, m_eff1]` for the blocks at `b0` and (if `TWO`) `b0 + ts`; zeros for a
/// missing second block.
///
/// # Safety
/// The features in the attribute are available; the blocks are readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dm_pair<const T: u8, const TWO: bool>(b0: *const u8) -> __m128 {
    let ts = block_bytes(T);
    // SAFETY: reads stay inside the one or two blocks (caller).
    unsafe {
        if T == T_Q4_1 || T == T_Q5_1 {
            let x = _mm_cvtsi32_si128(u32_load(b0) as i32);
            let x = if TWO {
                _mm_insert_epi32::<1>(x, u32_load(b0.add(ts)) as i32)
            } else {
                x
            };
            _mm_cvtph_ps(x)
        } else {
            let h0 = b0.cast::<u16>().read_unaligned() as u32 * 0x1_0001;
            let h1 = if TWO {
                b0.add(ts).cast::<u16>().read_unaligned() as u32 * 0x1_0001
            } else {
                0
            };
            let dd = _mm_cvtph_ps(_mm_set_epi32(0, 0, h1 as i32, h0 as i32));
            let c = match T {
                T_Q4_0 => -8.0,
                T_Q5_0 => -16.0,
                _ => -128.0,
            };
            _mm_mul_ps(dd, _mm_setr_ps(1.0, c, 1.0, c))
        }
    }
}

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

/// One or two blocks starting at block `b`: returns the scaled partial dot (16 lanes) and the
/// `[d*da, m*sa, ...]` products whose odd lanes are the min terms.
///
/// # Safety
/// As for [`dot_row2`], with blocks `b` (and `b + 1` if `TWO`) in range.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn pair_step<const T: u8, const TWO: bool>(
    row: *const u8,
    qa: *const i8,
    ds: *const f32,
    b: usize,
    acc: __m512,
) -> (__m512, __m128) {
    // SAFETY: block b (and b + 1 when TWO) is inside row, qa and ds (caller).
    unsafe {
        let blk = row.add(b * block_bytes(T));
        let w = weights_pair::<T, TWO>(blk);
        let (a, dsv) = if TWO {
            (
                _mm512_loadu_si512(qa.add(b * 32).cast()),
                _mm_loadu_ps(ds.add(2 * b)),
            )
        } else {
            (
                _mm512_maskz_loadu_epi8(0xFFFF_FFFF, qa.add(b * 32)),
                _mm_castpd_ps(_mm_load_sd(ds.add(2 * b).cast())),
            )
        };
        let prod = _mm_mul_ps(dm_pair::<T, TWO>(blk), dsv);
        let idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
        let scale = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(prod));
        let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
        (_mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc), prod)
    }
}

/// Dot product of one legacy row (`nb` blocks at `row`) with one token's Q8 activations
/// (`qa`: `32 * nb` quants, `ds`: `nb` interleaved `(da, sa)`), two blocks per step.
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
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut mins0 = _mm_setzero_ps();
    let mut mins1 = _mm_setzero_ps();
    let mut b = 0;
    // SAFETY: every step reads blocks below nb (caller guarantees nb blocks everywhere).
    unsafe {
        while b + 4 <= nb {
            let (a0, p0) = pair_step::<T, true>(row, qa, ds, b, acc0);
            let (a1, p1) = pair_step::<T, true>(row, qa, ds, b + 2, acc1);
            (acc0, acc1) = (a0, a1);
            mins0 = _mm_add_ps(mins0, p0);
            mins1 = _mm_add_ps(mins1, p1);
            b += 4;
        }
        if b + 2 <= nb {
            let (a0, p0) = pair_step::<T, true>(row, qa, ds, b, acc0);
            acc0 = a0;
            mins0 = _mm_add_ps(mins0, p0);
            b += 2;
        }
        if b < nb {
            let (a1, p1) = pair_step::<T, false>(row, qa, ds, b, acc1);
            acc1 = a1;
            mins1 = _mm_add_ps(mins1, p1);
        }
    }
    let m = _mm_add_ps(mins0, mins1);
    // lanes 1 and 3 hold the min terms
    let m = _mm_add_ss(_mm_movehdup_ps(m), _mm_movehl_ps(m, _mm_movehdup_ps(m)));
    _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + _mm_cvtss_f32(m)
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
    let mut facc = [[_mm512_setzero_ps(); G]; R];
    // SAFETY: b < nb, g < G, k < 8 and r < R keep every access inside the ranges above.
    unsafe {
        for b in 0..nb {
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
        }
        for r in 0..R {
            for g in 0..G {
                _mm512_storeu_ps(out[r][g].as_mut_ptr(), facc[r][g]);
            }
        }
    }
}
