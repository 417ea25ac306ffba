//! AVX-512 VNNI kernels for the legacy block types against Q8 activations:
//! - `dot_row`: one row times one token, 256-bit `vpdpbusd` per block (decode path);
//! - `tile`: `R` rows times `G * 16` tokens over the packed activation layout (prefill path).
//!
//! Tile kernel idea: a 64-byte activation line holds 4 consecutive quants of one block for 16
//! tokens; broadcasting 4 unpacked weight bytes of one row to all lanes lets one `vpdpbusd`
//! advance 16 (row, token) dot products by 4 elements. Weights are unpacked once per row and
//! block and reused for every token group; scaling by `d * da` (per lane) happens once per block.
//! Q8_0 weights are made unsigned with `w ^ 0x80 = w + 128`, corrected by `-128 * d * sa`.

#![cfg(target_arch = "x86_64")]

use super::avx2::{
    block_bytes, f16_load, natural_kernel, u32_load, T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1,
};
use super::q8::Line;
use std::arch::x86_64::*;

/// One 256-bit u8 x i8 VNNI dot.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_vnni256(w: __m256i, a: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a)
}

natural_kernel!(
    dot_row,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    dot_vnni256
);

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
