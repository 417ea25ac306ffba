//! AVX2/FMA/F16C kernels for the legacy block types against Q8 activations (one weight row
//! times one token), plus helpers shared with the AVX-512 kernels.
//!
//! Every block is unpacked to 32 unsigned bytes `q` (Q8_0: `|w|`, with the activation signs
//! flipped where `w < 0`) so that one u8 x i8 dot gives `sum(q * qa)`; the result is scaled by
//! `d * da` in f32 and the per-block `m_eff * sa` term is added (see `legacy`). `maddubs`
//! cannot saturate here: |q| <= 128 and |qa| <= 127, so a pair sums to at most 32512.

#![cfg(target_arch = "x86_64")]

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

/// Horizontal sum of 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// u8 x i8 dot of groups of 4 bytes into 8 i32 lanes (maddubs + madd).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_maddubs(w: __m256i, a: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1))
}

/// Generates a one-row-one-token kernel `$name::<T>(row, qa, ds, nb)` for the feature
/// set `$feat`, with `$dot(q, a) -> __m256i` the 4-byte u8 x i8 dot.
macro_rules! natural_kernel {
    ($name:ident, $feat:literal, $dot:path) => {
        /// Dot product of one legacy row (`nb` blocks at `row`) with one token's Q8
        /// activations (`qa`: `32 * nb` quants, `ds`: `nb` interleaved pairs `(da, sa)`).
        ///
        /// # Safety
        /// The features in the attribute are available and all pointers cover `nb` blocks.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn $name<const T: u8>(
            row: *const u8,
            qa: *const i8,
            ds: *const f32,
            nb: usize,
        ) -> f32 {
            use std::arch::x86_64::*;
            use $crate::quant::avx2::{block_bytes, hsum256, unpack};
            let ts = block_bytes(T);
            let mut acc0 = _mm256_setzero_ps();
            let mut acc1 = _mm256_setzero_ps();
            let mut mins = 0.0f32;
            let mut b = 0;
            // SAFETY: b < nb keeps every pointer inside the caller-guaranteed ranges.
            unsafe {
                while b + 2 <= nb {
                    let a0 = _mm256_loadu_si256(qa.add(b * 32).cast());
                    let a1 = _mm256_loadu_si256(qa.add(b * 32 + 32).cast());
                    let (w0, a0, d0, m0) = unpack::<T>(row.add(b * ts), a0);
                    let (w1, a1, d1, m1) = unpack::<T>(row.add(b * ts + ts), a1);
                    let p0 = _mm256_cvtepi32_ps($dot(w0, a0));
                    let p1 = _mm256_cvtepi32_ps($dot(w1, a1));
                    acc0 = _mm256_fmadd_ps(p0, _mm256_set1_ps(d0 * *ds.add(2 * b)), acc0);
                    acc1 = _mm256_fmadd_ps(p1, _mm256_set1_ps(d1 * *ds.add(2 * b + 2)), acc1);
                    mins += m0 * *ds.add(2 * b + 1) + m1 * *ds.add(2 * b + 3);
                    b += 2;
                }
                if b < nb {
                    let a0 = _mm256_loadu_si256(qa.add(b * 32).cast());
                    let (w0, a0, d0, m0) = unpack::<T>(row.add(b * ts), a0);
                    let p0 = _mm256_cvtepi32_ps($dot(w0, a0));
                    acc0 = _mm256_fmadd_ps(p0, _mm256_set1_ps(d0 * *ds.add(2 * b)), acc0);
                    mins += m0 * *ds.add(2 * b + 1);
                }
                hsum256(_mm256_add_ps(acc0, acc1)) + mins
            }
        }
    };
}

natural_kernel!(dot_row, "avx2,fma,f16c", dot_maddubs);

/// [`dot_row`] of one row with `N` tokens at once: each block is unpacked once for all tokens
/// (the activation-independent part; Q8_0's sign adjustment needs the token). For every token
/// the f32 operations are exactly those of `dot_row` (two alternating accumulators, the tail
/// block into the first, `mins` as there), so `out[i]` has the same bits as
/// `dot_row::<T>(row, qa[i], ds[i], nb)`: a token's result does not depend on the others.
///
/// # Safety
/// AVX2/FMA/F16C available; `row` covers `nb` blocks of type `T`; every `qa[i]` covers
/// `32 * nb` quants and every `ds[i]` `2 * nb` floats.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_row_tokens<const T: u8, const N: usize>(
    row: *const u8,
    qa: &[*const i8; N],
    ds: &[*const f32; N],
    nb: usize,
) -> [f32; N] {
    let ts = block_bytes(T);
    let mut acc0 = [_mm256_setzero_ps(); N];
    let mut acc1 = [_mm256_setzero_ps(); N];
    let mut mins = [0.0f32; N];
    let zero = _mm256_setzero_si256();
    let mut b = 0;
    // SAFETY: b < nb keeps every pointer inside the caller-guaranteed ranges; `unpack` with a
    // zero activation vector returns the weights (Q8_0: the signed weights' absolute values
    // and the sign-adjusted zero, which is unused).
    unsafe {
        while b + 2 <= nb {
            let (w0, _, d0, m0) = unpack::<T>(row.add(b * ts), zero);
            let (w1, _, d1, m1) = unpack::<T>(row.add(b * ts + ts), zero);
            let (s0, s1) = if T == T_Q8_0 {
                (
                    _mm256_loadu_si256(row.add(b * ts + 2).cast()),
                    _mm256_loadu_si256(row.add(b * ts + ts + 2).cast()),
                )
            } else {
                (zero, zero)
            };
            for i in 0..N {
                let mut a0 = _mm256_loadu_si256(qa[i].add(b * 32).cast());
                let mut a1 = _mm256_loadu_si256(qa[i].add(b * 32 + 32).cast());
                if T == T_Q8_0 {
                    a0 = _mm256_sign_epi8(a0, s0);
                    a1 = _mm256_sign_epi8(a1, s1);
                }
                let p0 = _mm256_cvtepi32_ps(dot_maddubs(w0, a0));
                let p1 = _mm256_cvtepi32_ps(dot_maddubs(w1, a1));
                let d = ds[i];
                acc0[i] = _mm256_fmadd_ps(p0, _mm256_set1_ps(d0 * *d.add(2 * b)), acc0[i]);
                acc1[i] = _mm256_fmadd_ps(p1, _mm256_set1_ps(d1 * *d.add(2 * b + 2)), acc1[i]);
                mins[i] += m0 * *d.add(2 * b + 1) + m1 * *d.add(2 * b + 3);
            }
            b += 2;
        }
        if b < nb {
            let (w0, _, d0, m0) = unpack::<T>(row.add(b * ts), zero);
            let s0 = if T == T_Q8_0 {
                _mm256_loadu_si256(row.add(b * ts + 2).cast())
            } else {
                zero
            };
            for i in 0..N {
                let mut a0 = _mm256_loadu_si256(qa[i].add(b * 32).cast());
                if T == T_Q8_0 {
                    a0 = _mm256_sign_epi8(a0, s0);
                }
                let p0 = _mm256_cvtepi32_ps(dot_maddubs(w0, a0));
                let d = ds[i];
                acc0[i] = _mm256_fmadd_ps(p0, _mm256_set1_ps(d0 * *d.add(2 * b)), acc0[i]);
                mins[i] += m0 * *d.add(2 * b + 1);
            }
        }
        std::array::from_fn(|i| hsum256(_mm256_add_ps(acc0[i], acc1[i])) + mins[i])
    }
}
