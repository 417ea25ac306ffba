//! AVX2/FMA/F16C kernels for the legacy block types against Q8 activations (one weight row
//! times one token), plus helpers shared with the AVX-512 kernels.
//!
//! Every block is unpacked to 32 unsigned bytes `q` (Q8_0: `|w|`, with the activation signs
//! flipped where `w < 0`) so that one u8 x i8 dot gives `sum(q * qa)`; the result is scaled by
//! `d * da` in f32 and the per-block `m_eff * sa` term is added (see `legacy`). `maddubs`
//! cannot saturate here: |q| <= 128 and |qa| <= 127, so a pair sums to at most 32512.
//!
//! The kernels follow the canonical order of `legacy::vec_dot_scalar` (each block's exact
//! integer sum reduced across lanes, then two fused multiply-adds into slot `b % 8`), so they
//! give the scalar reference's bits, like the AVX-512 VNNI and NEON kernels and the
//! interleaved copy's (`x16`): a token's outputs are the same on every x86-64 CPU whichever
//! path its rows take. These per-row kernels serve what the copy does not (Q5_1, rows past
//! the last group of 16, `KVSERVE_REPACK=0`).

#![cfg(target_arch = "x86_64")]

use super::legacy::{tree_sum, SLOTS};
use std::arch::x86_64::*;

/// Const-generic type codes (the ggml ids).
pub(crate) const T_Q4_0: u8 = 2;
pub(crate) const T_Q4_1: u8 = 3;
pub(crate) const T_Q5_0: u8 = 6;
pub(crate) const T_Q5_1: u8 = 7;
pub(crate) const T_Q8_0: u8 = 8;

/// Bytes per block for a type code.
pub(crate) const fn block_bytes(t: u8) -> usize {
    match t {
        T_Q4_0 => 18,
        T_Q4_1 => 20,
        T_Q5_0 => 22,
        T_Q5_1 => 24,
        _ => 34,
    }
}

/// Reads the f16 at `p` as f32.
///
/// # Safety
/// F16C available; `p..p+2` readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn f16_load(p: *const u8) -> f32 {
    // SAFETY: two readable bytes at `p` (caller), unaligned read.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Reads the u32 at `p`.
///
/// # Safety
/// `p..p+4` readable.
#[inline(always)]
pub(crate) unsafe fn u32_load(p: *const u8) -> u32 {
    // SAFETY: four readable bytes (caller), unaligned read.
    u32::from_le(unsafe { p.cast::<u32>().read_unaligned() })
}

/// Byte j = 0x10 if bit j of `qh` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn expand_bits(qh: u32) -> __m256i {
    let v = _mm256_set1_epi32(qh as i32);
    let idx = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let v = _mm256_shuffle_epi8(v, idx);
    let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let m = _mm256_cmpeq_epi8(_mm256_and_si256(v, bits), bits);
    _mm256_and_si256(m, _mm256_set1_epi8(0x10))
}

/// Unpacks block `blk` of type `T` against activation bytes `a`: returns `(q, a', d, m_eff)`
/// with `q` unsigned bytes in element order and `a'` the (sign-adjusted) activations.
///
/// # Safety
/// AVX2/FMA/F16C available; `blk` points at a whole block of type `T`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack<const T: u8>(
    blk: *const u8,
    a: __m256i,
) -> (__m256i, __m256i, f32, f32) {
    let lo4 = _mm256_set1_epi8(0x0F);
    // SAFETY: all offsets are inside one block of type `T` (caller).
    unsafe {
        let d = f16_load(blk);
        match T {
            T_Q4_0 | T_Q4_1 => {
                let off = if T == T_Q4_0 { 2 } else { 4 };
                let q = _mm_loadu_si128(blk.add(off).cast());
                let w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), lo4);
                let m = if T == T_Q4_0 {
                    -8.0 * d
                } else {
                    f16_load(blk.add(2))
                };
                (w, a, d, m)
            }
            T_Q5_0 | T_Q5_1 => {
                let (hoff, off) = if T == T_Q5_0 { (2, 6) } else { (4, 8) };
                let q = _mm_loadu_si128(blk.add(off).cast());
                let w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), lo4);
                let w = _mm256_or_si256(w, expand_bits(u32_load(blk.add(hoff))));
                let m = if T == T_Q5_0 {
                    -16.0 * d
                } else {
                    f16_load(blk.add(2))
                };
                (w, a, d, m)
            }
            _ => {
                let w = _mm256_loadu_si256(blk.add(2).cast());
                (_mm256_abs_epi8(w), _mm256_sign_epi8(a, w), d, 0.0)
            }
        }
    }
}

/// u8 x i8 dot of groups of 4 bytes into 8 i32 lanes (maddubs + madd).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_maddubs(w: __m256i, a: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1))
}

/// Horizontal sum of 8 i32 lanes.
///
/// # Safety
/// AVX2 available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// The exact canonical integer sum of a block (`legacy::vec_dot_scalar`) from `unpack`'s
/// `(w, a')` against the block's activations `a`: `sum(q * qa)`, for Q8_0 `sum((q + 128) *
/// qa)` (the sign trick's `sum(|q| * sign(qa, q))` plus `128 * sum(qa)`).
///
/// # Safety
/// AVX2 available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_isum<const T: u8>(w: __m256i, a_adj: __m256i, a: __m256i) -> i32 {
    // SAFETY: register-only AVX2 operations; the caller has AVX2 (this function's contract).
    unsafe {
        let v = dot_maddubs(w, a_adj);
        if T == T_Q8_0 {
            let sa = dot_maddubs(_mm256_set1_epi8(1), a);
            hsum_i32(_mm256_add_epi32(v, _mm256_slli_epi32::<7>(sa)))
        } else {
            hsum_i32(v)
        }
    }
}

/// `unpack`'s `m_eff` in the canonical form: Q8_0's is `-128 d` (its quants counted `+ 128`).
#[inline(always)]
fn canonical_m<const T: u8>(d: f32, m: f32) -> f32 {
    if T == T_Q8_0 {
        -128.0 * d
    } else {
        m
    }
}

/// Dot product of one legacy row (`nb` blocks at `row`) with one token's Q8 activations
/// (`qa`: `32 * nb` quants in -127..=127, `ds`: `nb` interleaved pairs `(da, sa)`), in the
/// canonical order of `legacy::vec_dot_scalar` (the same bits): per block the exact integer
/// sum, reduced across lanes, then `acc[b % 8] = fma(m, sa, fma(isum, d * da, acc[b % 8]))`
/// and the fixed final tree.
///
/// # Safety
/// AVX2/FMA/F16C available; all pointers cover `nb` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_row<const T: u8>(
    row: *const u8,
    qa: *const i8,
    ds: *const f32,
    nb: usize,
) -> f32 {
    // SAFETY: the contract (one token's pointers).
    unsafe { dot_row_tokens::<T, 1>(row, &[qa], &[ds], nb)[0] }
}

/// [`dot_row`] of one row with `N` tokens at once: each block is unpacked once for all tokens
/// (Q8_0's sign adjustment needs the token). `out[i]` has the bits of `dot_row::<T>(row,
/// qa[i], ds[i], nb)` (and of the scalar reference): a token's result does not depend on the
/// others.
///
/// # Safety
/// AVX2/FMA/F16C available; `row` covers `nb` blocks of type `T`; every `qa[i]` covers
/// `32 * nb` quants in -127..=127 and every `ds[i]` `2 * nb` floats.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_row_tokens<const T: u8, const N: usize>(
    row: *const u8,
    qa: &[*const i8; N],
    ds: &[*const f32; N],
    nb: usize,
) -> [f32; N] {
    let ts = block_bytes(T);
    let mut acc = [[0.0f32; SLOTS]; N];
    let zero = _mm256_setzero_si256();
    let mut b0 = 0;
    // SAFETY: b < nb keeps every pointer inside the caller-guaranteed ranges; `unpack` with a
    // zero activation vector returns the weights (Q8_0: the signed weights' absolute values
    // and the sign-adjusted zero, which is unused).
    unsafe {
        while b0 < nb {
            // Constant slot indices (s), so the accumulators stay in registers.
            for s in 0..SLOTS {
                let b = b0 + s;
                if b >= nb {
                    break;
                }
                let blk = row.add(b * ts);
                let (w, _, d, m) = unpack::<T>(blk, zero);
                let m = canonical_m::<T>(d, m);
                let sign = if T == T_Q8_0 {
                    _mm256_loadu_si256(blk.add(2).cast())
                } else {
                    zero
                };
                for i in 0..N {
                    let a = _mm256_loadu_si256(qa[i].add(b * 32).cast());
                    let a_adj = if T == T_Q8_0 {
                        _mm256_sign_epi8(a, sign)
                    } else {
                        a
                    };
                    let isum = block_isum::<T>(w, a_adj, a) as f32;
                    let dsb = ds[i].add(2 * b);
                    acc[i][s] = m.mul_add(*dsb.add(1), isum.mul_add(d * *dsb, acc[i][s]));
                }
            }
            b0 += SLOTS;
        }
    }
    std::array::from_fn(|i| tree_sum(&mut acc[i]))
}
