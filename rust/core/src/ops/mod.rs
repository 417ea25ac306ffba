//! Tensor operations on f32 activations: RMSNorm, RoPE (normal/NeoX, linear and YaRN scaling),
//! SiLU/SwiGLU, GELU/GeGLU, soft-capping, residual adds. (Attention lives with the KV cache, in `kv::attention`.)
//!
//! Activations are row-major `[n_tokens][dim]` slices. None of these functions allocate per
//! element; all are deterministic for a given SIMD level.

pub mod rope;

pub use rope::{Rope, RopeScaling};

use crate::quant::SimdLevel;

/// `out = x / sqrt(mean(x^2) + eps) * w`, one row. The sum runs in f64 like ggml
/// ([`sum_sq`]).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(x.len(), w.len());
    debug_assert_eq!(x.len(), out.len());
    let sum = sum_sq(x);
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// In-place RMSNorm of every `dim`-sized row of `x` with weight `w`.
pub fn rms_norm_rows(x: &mut [f32], dim: usize, w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(dim) {
        let sum = sum_sq(row);
        let mean = (sum / dim as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

/// Lowest level of each SIMD kernel of [`sum_sq`] (see `quant::simd::coverage`).
#[cfg(test)]
pub(crate) const SUM_SQ_KERNELS: [SimdLevel; 1] = [SimdLevel::Avx2];

/// `sum(x[i]^2)` in f64: eight interleaved partial sums (element `i` of the body, the first
/// `len - len % 8`, goes to sum `i % 8`; each square rounded, then added), folded as
/// `((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7))`, then the tail added in order. One
/// running sum (the order before) was a chain of dependent f64 adds, ~1.5% of a prompt step
/// for two norms a layer; eight sums let the SIMD kernel keep two vectors of four.
pub fn sum_sq(x: &[f32]) -> f64 {
    sum_sq_level(x, crate::quant::simd::level())
}

/// [`sum_sq`] with the kernels of `level` (capped to what the CPU has); every level gives the
/// same bits.
pub(crate) fn sum_sq_level(x: &[f32], level: SimdLevel) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if crate::quant::simd::cap(level) >= SimdLevel::Avx2 {
        // SAFETY: AVX2 was detected on this CPU.
        return unsafe { x86::sum_sq_avx2(x) };
    }
    let _ = level;
    let body = x.len() - x.len() % 8;
    let mut acc = [0f64; 8];
    for c in x[..body].chunks_exact(8) {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v as f64 * v as f64;
        }
    }
    sum_sq_tail(acc, &x[body..])
}

/// The fold of [`sum_sq`]'s eight sums and its tail.
#[inline]
fn sum_sq_tail(acc: [f64; 8], tail: &[f32]) -> f64 {
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for &v in tail {
        s += v as f64 * v as f64;
    }
    s
}

/// SiLU, `x / (1 + exp(-x))`, with the exponential of [`exp_f32_wide`] (the scalar twin of
/// the SIMD kernel of [`swiglu`]).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp_f32_wide(-x))
}

/// Lowest level of each SIMD kernel of [`swiglu`] (see `quant::simd::coverage`).
#[cfg(test)]
pub(crate) const SWIGLU_KERNELS: [SimdLevel; 1] = [SimdLevel::Avx2];

/// `gate[i] = silu(gate[i]) * up[i]` (SwiGLU), in place in `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    swiglu_level(gate, up, crate::quant::simd::level())
}

/// [`swiglu`] with the kernels of `level` (capped to what the CPU has); every level gives the
/// same bits.
pub(crate) fn swiglu_level(gate: &mut [f32], up: &[f32], level: SimdLevel) {
    glu_level(Glu::Swi, gate, up, level)
}

/// The gated activations of the FFN, `gate[i] = act(gate[i]) * up[i]`.
#[derive(Clone, Copy, Debug)]
enum Glu {
    /// SiLU: [`swiglu`].
    Swi,
    /// GELU (tanh): [`geglu`].
    Ge,
}

/// `glu` with the kernels of `level` (capped to what the CPU has): the AVX2 kernel, else the
/// activation's scalar twin value by value (the same bits).
fn glu_level(glu: Glu, gate: &mut [f32], up: &[f32], level: SimdLevel) {
    assert_eq!(
        gate.len(),
        up.len(),
        "{glu:?}GLU: gate and up differ in length"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::quant::simd::cap(level) >= SimdLevel::Avx2 {
        // SAFETY: AVX2 and FMA were detected on this CPU; both slices hold gate.len() values.
        unsafe {
            match glu {
                Glu::Swi => x86::swiglu_avx2(gate, up),
                Glu::Ge => x86::geglu_avx2(gate, up),
            }
        };
        return;
    }
    let _ = level;
    let act = match glu {
        Glu::Swi => silu,
        Glu::Ge => gelu_tanh,
    };
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = act(*g) * u;
    }
}

/// Bounds of the f64 argument of [`exp_f32_wide`]: beyond them the f32 result is 0 or
/// infinite anyway, and inside them the f64 steps neither overflow nor underflow.
const WIDE_EXP_BOUND: f64 = 150.0;
const LOG2E_F64: f64 = std::f64::consts::LOG2_E;
/// ln 2 split so that `n * WIDE_LN2_HI` is exact for `|n| < 2^21` (the high part ends in 21
/// zero bits; fdlibm's split), and the rest.
const WIDE_LN2_HI: f64 = f64::from_bits(0x3FE6_2E42_FEE0_0000);
const WIDE_LN2_LO: f64 = f64::from_bits(0x3DEA_39EF_3579_3C76);
/// Taylor coefficients `1/k!` of `exp(r)` for `k = 11` down to `0`: on `|r| <= ln2 / 2` the
/// remainder is under `1e-14` relative.
const WIDE_EXP_C: [f64; 12] = [
    1.0 / 39_916_800.0,
    1.0 / 3_628_800.0,
    1.0 / 362_880.0,
    1.0 / 40_320.0,
    1.0 / 5_040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `exp(x)` computed in f64 and rounded once to f32: within about `1e-14` relative before
/// that rounding, so it is the correctly rounded f32 except for arguments within that distance
/// of a tie (libm's `expf`, whose worst error is about 0.5 ulp, agrees with it on nearly every
/// argument; [`exp_f32`], ~2 ulp, is for kernels that must stay in f32). `x = n ln2 + r`, a
/// degree-11 polynomial in `r`, times `2^n` built in the exponent bits; only `+`, `*`, fused
/// multiply-adds, rounding and bit operations, so the SIMD kernels repeat it exactly. NaN
/// gives NaN; overflow gives infinity, underflow 0 or a subnormal, as f32 `exp` does.
#[inline]
pub fn exp_f32_wide(x: f32) -> f32 {
    let x = (x as f64).clamp(-WIDE_EXP_BOUND, WIDE_EXP_BOUND);
    let n = (x * LOG2E_F64).round_ties_even();
    let r = n.mul_add(-WIDE_LN2_HI, x);
    let r = n.mul_add(-WIDE_LN2_LO, r);
    let mut p = WIDE_EXP_C[0];
    for &c in &WIDE_EXP_C[1..] {
        p = p.mul_add(r, c);
    }
    // n is an integer in -217..=217 here: n + 1023 is a normal exponent (a NaN x: n as i64
    // is 0, and p stays NaN).
    let scale = f64::from_bits(((n as i64 + 1023) as u64) << 52);
    (p * scale) as f32
}

/// GELU, tanh approximation (ggml's `ggml_gelu`; ggml reads it from an f16 table, this
/// computes it in f32): `0.5 x (1 + tanh(y))` with `y = sqrt(2/pi) (x + 0.044715 x^3)`, computed
/// as the equal `x / (1 + exp(-2y))` (no cancellation near 0) with [`exp_f32`]. This is the
/// scalar twin of the SIMD kernel of [`geglu`]: the same f32 operations in the same order
/// (fused multiply-adds included), so both give the same bits.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    let x2 = x * x;
    let inner = GELU_A.mul_add(x2, 1.0);
    let t = x * GELU_M2C;
    x / (1.0 + exp_f32(t * inner))
}

/// `-2 sqrt(2/pi)` and the cubic coefficient of the tanh approximation of GELU.
const GELU_M2C: f32 = -1.595_769_2;
const GELU_A: f32 = 0.044_715;

/// Bounds of the argument of [`exp_f32`] (results stay normal and finite: `2^-126..2^127`).
const EXP_LO: f32 = -87.0;
const EXP_HI: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in a part exact in few bits and the rest (Cody-Waite reduction).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Minimax polynomial of `(exp(r) - 1 - r) / r^2` on `|r| <= ln2 / 2` (Cephes `expf`).
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `exp(x)` within about 2 ulp for `x` in `[-87, 88]` (clamped to that range outside it; NaN
/// gives NaN): `x = n ln2 + r`, a polynomial in `r`, times `2^n` built in the exponent bits.
/// Only `+`, `*`, fused multiply-adds and bit operations, so the SIMD kernels repeat it
/// exactly.
#[inline]
pub fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(EXP_LO, EXP_HI);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_P[0];
    for &c in &EXP_P[1..] {
        p = p.mul_add(r, c);
    }
    let r2 = r * r;
    let y = p.mul_add(r2, r) + 1.0;
    // n is an integer in -126..=127 here (NaN converts to 0 and stays NaN through y).
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    y * scale
}

/// Lowest level of each SIMD kernel of [`geglu`] (see `quant::simd::coverage`).
#[cfg(test)]
pub(crate) const GEGLU_KERNELS: [SimdLevel; 1] = [SimdLevel::Avx2];

/// `gate[i] = gelu_tanh(gate[i]) * up[i]` (GeGLU), in place in `gate`.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    geglu_level(gate, up, crate::quant::simd::level())
}

/// [`geglu`] with the kernels of `level` (capped to what the CPU has); every level gives the
/// same bits.
pub(crate) fn geglu_level(gate: &mut [f32], up: &[f32], level: SimdLevel) {
    glu_level(Glu::Ge, gate, up, level)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    /// [`super::argmax_first`] for AVX2: four registers of running maxima and four of the
    /// indices where each lane first reached its maximum (a strictly greater value replaces
    /// it, so a lane keeps its first maximum), an unordered-compare mask for NaNs, then a
    /// scalar merge of the 32 lanes and the tail.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn argmax_first_avx2(x: &[f32]) -> Option<usize> {
        use std::arch::x86_64::*;
        const L: usize = 32;
        if x.len() < L || x.len() > i32::MAX as usize {
            return super::argmax_first_scalar(x);
        }
        let n = x.len() / L * L;
        let p = x.as_ptr();
        // SAFETY: x.len() >= 32: the four loads read x[0..32].
        let mut best = unsafe {
            [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ]
        };
        let first = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mut cur = [
            first,
            _mm256_add_epi32(first, _mm256_set1_epi32(8)),
            _mm256_add_epi32(first, _mm256_set1_epi32(16)),
            _mm256_add_epi32(first, _mm256_set1_epi32(24)),
        ];
        let mut at = cur;
        let step = _mm256_set1_epi32(L as i32);
        let mut nan = _mm256_setzero_ps();
        let mut i = 0;
        while i < n {
            for k in 0..4 {
                // SAFETY: i + 8 * k + 8 <= i + 32 <= n <= x.len().
                let v = unsafe { _mm256_loadu_ps(p.add(i + 8 * k)) };
                nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
                let gt = _mm256_cmp_ps::<_CMP_GT_OQ>(v, best[k]);
                best[k] = _mm256_blendv_ps(best[k], v, gt);
                at[k] = _mm256_castps_si256(_mm256_blendv_ps(
                    _mm256_castsi256_ps(at[k]),
                    _mm256_castsi256_ps(cur[k]),
                    gt,
                ));
                cur[k] = _mm256_add_epi32(cur[k], step);
            }
            i += L;
        }
        let tail = &x[n..];
        if _mm256_movemask_ps(nan) != 0 || tail.iter().any(|v| v.is_nan()) {
            return x.iter().position(|v| v.is_nan());
        }
        let mut bv = [0.0f32; L];
        let mut bi = [0i32; L];
        for k in 0..4 {
            // SAFETY: both stores write 8 values at 8 * k, inside the 32-value arrays.
            unsafe {
                _mm256_storeu_ps(bv.as_mut_ptr().add(8 * k), best[k]);
                _mm256_storeu_si256(bi.as_mut_ptr().add(8 * k).cast(), at[k]);
            }
        }
        let (mut m, mut mi) = (bv[0], bi[0] as usize);
        for j in 1..L {
            let j_at = bi[j] as usize;
            if bv[j] > m || (bv[j] == m && j_at < mi) {
                (m, mi) = (bv[j], j_at);
            }
        }
        for (k, &v) in tail.iter().enumerate() {
            if v > m {
                (m, mi) = (v, n + k);
            }
        }
        Some(mi)
    }

    use super::{
        gelu_tanh, EXP_HI, EXP_LO, EXP_P, GELU_A, GELU_M2C, LN2_HI, LN2_LO, LOG2E, LOG2E_F64,
        WIDE_EXP_BOUND, WIDE_EXP_C, WIDE_LN2_HI, WIDE_LN2_LO,
    };
    use std::arch::x86_64::*;

    /// [`super::exp_f32`] on 8 lanes, operation for operation.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        // Clamp as the scalar code: a NaN lane stays NaN (the comparisons are false for it).
        let lo = _mm256_set1_ps(EXP_LO);
        let hi = _mm256_set1_ps(EXP_HI);
        let x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo));
        let x = _mm256_blendv_ps(x, hi, _mm256_cmp_ps::<_CMP_GT_OQ>(x, hi));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_P[0]);
        for &c in &EXP_P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let r2 = _mm256_mul_ps(r, r);
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
        // `n as i32` of the scalar code: NaN lanes convert to i32::MIN there to 0 (Rust
        // saturates); the bits differ but the product with a NaN `y` is NaN either way.
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(y, _mm256_castsi256_ps(e))
    }

    /// [`super::sum_sq`]: sums 0-3 in one vector, 4-7 in another, the same fold and tail.
    ///
    /// # Safety
    /// AVX2 is available.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sum_sq_avx2(x: &[f32]) -> f64 {
        let body = x.len() - x.len() % 8;
        let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 <= body <= x.len().
            let v = unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) };
            let a = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
            let b = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v));
            lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
            hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
            i += 8;
        }
        let mut acc = [0f64; 8];
        // SAFETY: 4 f64 each at acc[0..4] and acc[4..8].
        unsafe {
            _mm256_storeu_pd(acc.as_mut_ptr(), lo);
            _mm256_storeu_pd(acc.as_mut_ptr().add(4), hi);
        }
        super::sum_sq_tail(acc, &x[body..])
    }

    /// [`super::exp_f32_wide`] of 4 lanes (f32 arguments widened to f64), the same steps.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp4_wide(x: __m128) -> __m128 {
        // Clamp as the scalar code: a NaN lane stays NaN (the comparisons are false for it).
        let (lo, hi) = (
            _mm256_set1_pd(-WIDE_EXP_BOUND),
            _mm256_set1_pd(WIDE_EXP_BOUND),
        );
        let x = _mm256_cvtps_pd(x);
        let x = _mm256_blendv_pd(x, lo, _mm256_cmp_pd::<_CMP_LT_OQ>(x, lo));
        let x = _mm256_blendv_pd(x, hi, _mm256_cmp_pd::<_CMP_GT_OQ>(x, hi));
        let n = _mm256_round_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_pd(x, _mm256_set1_pd(LOG2E_F64)),
        );
        let r = _mm256_fmadd_pd(n, _mm256_set1_pd(-WIDE_LN2_HI), x);
        let r = _mm256_fmadd_pd(n, _mm256_set1_pd(-WIDE_LN2_LO), r);
        let mut p = _mm256_set1_pd(WIDE_EXP_C[0]);
        for &c in &WIDE_EXP_C[1..] {
            p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(c));
        }
        // n + 1.5 * 2^52 holds n in its low mantissa bits (|n| < 2^51); adding 1023 and
        // shifting by 52 leaves (n + 1023) in the exponent field (806..=1240: sign bit 0).
        let magic = _mm256_set1_pd(6_755_399_441_055_744.0);
        let bits = _mm256_castpd_si256(_mm256_add_pd(n, magic));
        let e = _mm256_slli_epi64::<52>(_mm256_add_epi64(bits, _mm256_set1_epi64x(1023)));
        _mm256_cvtpd_ps(_mm256_mul_pd(p, _mm256_castsi256_pd(e)))
    }

    /// `gate = silu(gate) * up`, 8 lanes at a time (the exponential 4 lanes at a time in
    /// f64), the tail with the scalar twin.
    ///
    /// # Safety
    /// AVX2 and FMA are available; `up.len() >= gate.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn swiglu_avx2(gate: &mut [f32], up: &[f32]) {
        let n = gate.len();
        let body = n - n % 8;
        let one = _mm256_set1_ps(1.0);
        let sign = _mm256_set1_ps(-0.0);
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 <= body <= gate.len() <= up.len().
            unsafe {
                let x = _mm256_loadu_ps(gate.as_ptr().add(i));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                let m = _mm256_xor_ps(x, sign);
                let lo = exp4_wide(_mm256_castps256_ps128(m));
                let hi = exp4_wide(_mm256_extractf128_ps::<1>(m));
                let e = _mm256_set_m128(hi, lo);
                let g = _mm256_div_ps(x, _mm256_add_ps(one, e));
                _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(g, u));
            }
            i += 8;
        }
        for j in body..n {
            gate[j] = super::silu(gate[j]) * up[j];
        }
    }

    /// `gate = gelu_tanh(gate) * up`, 8 lanes at a time, the tail with the scalar twin.
    ///
    /// # Safety
    /// AVX2 and FMA are available; `up.len() >= gate.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn geglu_avx2(gate: &mut [f32], up: &[f32]) {
        let n = gate.len();
        let body = n - n % 8;
        let (m2c, a, one) = (
            _mm256_set1_ps(GELU_M2C),
            _mm256_set1_ps(GELU_A),
            _mm256_set1_ps(1.0),
        );
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 <= body <= gate.len() <= up.len().
            unsafe {
                let x = _mm256_loadu_ps(gate.as_ptr().add(i));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                let x2 = _mm256_mul_ps(x, x);
                let inner = _mm256_fmadd_ps(a, x2, one);
                let t = _mm256_mul_ps(x, m2c);
                let e = exp8(_mm256_mul_ps(t, inner));
                let g = _mm256_div_ps(x, _mm256_add_ps(one, e));
                _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(g, u));
            }
            i += 8;
        }
        for j in body..n {
            gate[j] = gelu_tanh(gate[j]) * up[j];
        }
    }
}

/// `x[i] = cap * tanh(x[i] / cap)` (logit soft-capping).
pub fn softcap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
}

/// `x[i] *= s`.
pub fn scale(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}

/// `x[i] += y[i]`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// The index of the largest value of `x`, the first one on ties; the first NaN if `x` holds
/// any (numpy's `argmax` rule, so greedy sampling in Rust and in numpy pick the same token).
/// `None` for an empty slice. An AVX2 kernel when the CPU has it (32 lanes, each keeping its
/// maximum and where it first saw it, merged lower index first among equal maxima), else
/// [`argmax_first_scalar`], its twin.
pub fn argmax_first(x: &[f32]) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if crate::quant::simd::level() >= SimdLevel::Avx2 {
        // SAFETY: AVX2 was detected on this CPU; the kernel reads only `x`.
        return unsafe { x86::argmax_first_avx2(x) };
    }
    argmax_first_scalar(x)
}

/// [`argmax_first`] as one plain loop.
pub fn argmax_first_scalar(x: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if v.is_nan() {
            return Some(i);
        }
        match best {
            Some((_, m)) if v <= m => {}
            _ => best = Some((i, v)),
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let w = [1.0f32, 2.0, 0.5, 1.0];
        let mut out = [0.0f32; 4];
        rms_norm(&x, &w, 1e-5, &mut out);
        let ms = (1.0 + 4.0 + 9.0 + 0.25) / 4.0;
        let s = 1.0 / (ms + 1e-5f64).sqrt();
        for i in 0..4 {
            assert!((out[i] as f64 - x[i] as f64 * s * w[i] as f64).abs() < 1e-6);
        }
        let mut rows = x.to_vec();
        rms_norm_rows(&mut rows, 4, &w, 1e-5);
        assert_eq!(rows, out.to_vec());
    }

    /// The tanh-approximated GELU from its formula in f64 (and its limits), on a dense grid
    /// and at the extremes where `exp` is clamped.
    #[test]
    fn gelu_tanh_values() {
        let reference = |x: f64| {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
        };
        let grid = (-4000..=4000).map(|i| i as f64 / 200.0);
        for x in grid.chain([-1e4, -60.0, -12.0, -1e-6, 0.0, 1e-30, 12.0, 60.0, 1e4]) {
            let want = reference(x);
            let got = gelu_tanh(x as f32) as f64;
            // The f32 argument of exp carries up to ~|2y| ulp of rounding: allow for it.
            let tol = 2e-6 * (want.abs() + 1e-3 * x.abs()) + 1e-30;
            assert!((got - want).abs() <= tol, "{x}: {got} vs {want}");
        }
        assert!(gelu_tanh(f32::NAN).is_nan());
        let mut l = [0.0f32, 30.0, -1e9];
        softcap(&mut l, 30.0);
        assert_eq!(l[0], 0.0);
        assert!((l[1] - 30.0 * 1f32.tanh()).abs() < 1e-5 && (l[2] + 30.0).abs() < 1e-5);
    }

    /// `exp_f32` against f64 `exp` within 3 ulp over its whole range, and clamped outside.
    #[test]
    fn exp_f32_accuracy() {
        for i in -8700..=8800 {
            let x = i as f32 / 100.0;
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            assert!(
                (got - want).abs() <= 3.0 * f32::EPSILON as f64 * want,
                "{x}: {got} vs {want}"
            );
        }
        assert_eq!(exp_f32(-1000.0), exp_f32(-87.0));
        assert_eq!(exp_f32(1000.0), exp_f32(88.0));
        assert!(exp_f32(88.0).is_finite() && exp_f32(-87.0) > 0.0);
    }

    /// `level_fn`'s SIMD kernels (from `starts`) against the scalar twin `act(g) * u` per
    /// element, bit for bit, over lengths that leave every tail and gates of the magnitudes in
    /// `scales` (from tiny to beyond the exponentials' clamps); a NaN gate stays NaN.
    fn check_glu_twin(
        what: &str,
        starts: &[SimdLevel],
        level_fn: fn(&mut [f32], &[f32], SimdLevel),
        act: fn(f32) -> f32,
        scales: &[f32],
        mut seed: u64,
    ) {
        use crate::quant::simd::coverage;
        let kernels = coverage::simd_kernels(starts);
        let mut f = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) % 2_000_001) as f32 / 1_000_000.0 - 1.0
        };
        let levels: Vec<SimdLevel> = std::iter::once(SimdLevel::Scalar)
            .chain(kernels.clone())
            .collect();
        for len in [0usize, 1, 7, 8, 9, 31, 640, 2051] {
            let gate: Vec<f32> = (0..len).map(|i| f() * scales[i % scales.len()]).collect();
            let up: Vec<f32> = (0..len).map(|_| f() * 3.0).collect();
            let twin: Vec<u32> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| (act(g) * u).to_bits())
                .collect();
            for &level in &levels {
                let mut got = gate.clone();
                level_fn(&mut got, &up, level);
                let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, twin, "{what} len {len} {}", level.name());
            }
        }
        for &level in &levels {
            let mut g = vec![1.0f32; 9];
            g[3] = f32::NAN;
            g[8] = f32::NAN;
            level_fn(&mut g, &[2.0; 9], level);
            assert!(
                g[3].is_nan() && g[8].is_nan() && g[0] == act(1.0) * 2.0,
                "{what}"
            );
        }
        coverage::report(what, starts, &kernels);
    }

    #[test]
    fn geglu_kernels_match_scalar_twin() {
        check_glu_twin(
            "geglu",
            &GEGLU_KERNELS,
            geglu_level,
            gelu_tanh,
            &[0.01, 1.0, 4.0, 100.0],
            7,
        );
    }

    /// `exp_f32_wide` is the f32 rounding of the f64 `exp` (libm's, within an f64 ulp) on
    /// every argument of a fine sweep but near-ties, and within 1 ulp of libm's `expf`; it
    /// overflows, underflows and keeps NaN as f32 `exp` does.
    #[test]
    fn exp_f32_wide_is_rounded_f64_exp() {
        let ulps = |a: f32, b: f32| (a.to_bits() as i64 - b.to_bits() as i64).abs();
        let (mut off_f64, mut off_libm, mut n) = (0, 0, 0);
        for i in -1_100_000..=1_000_000 {
            let x = i as f32 / 10_000.0;
            let got = exp_f32_wide(x);
            let want = (x as f64).exp() as f32;
            assert!(ulps(got, want) <= 1, "{x}: {got} vs {want}");
            off_f64 += (got != want) as usize;
            let libm = x.exp();
            assert!(ulps(got, libm) <= 1, "{x}: {got} vs libm {libm}");
            off_libm += (got != libm) as usize;
            n += 1;
        }
        eprintln!("exp_f32_wide: {off_f64} of {n} off the rounded f64 exp, {off_libm} off libm");
        assert!(
            off_f64 * 100_000 <= n,
            "{off_f64} of {n} differ from the rounded f64 exp"
        );
        assert!(
            off_libm * 100 <= n,
            "{off_libm} of {n} differ from libm's expf"
        );
        assert_eq!(exp_f32_wide(89.0), f32::INFINITY);
        assert_eq!(exp_f32_wide(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32_wide(-104.0), 0.0);
        assert_eq!(exp_f32_wide(f32::NEG_INFINITY), 0.0);
        let sub = exp_f32_wide(-100.0);
        assert!(sub > 0.0 && !sub.is_normal() && ulps(sub, (-100f64).exp() as f32) <= 1);
        assert!(exp_f32_wide(f32::NAN).is_nan());
        assert_eq!(exp_f32_wide(0.0), 1.0);
        assert_eq!(WIDE_LN2_HI.to_bits() & 0x1F_FFFF, 0);
        let ln2 = WIDE_LN2_HI + WIDE_LN2_LO;
        assert!((ln2 - std::f64::consts::LN_2).abs() <= f64::EPSILON * 0.5);
    }

    #[test]
    fn swiglu_kernels_match_scalar_twin() {
        let scales = [0.01, 1.0, 8.0, 100.0, 300.0];
        check_glu_twin("swiglu", &SWIGLU_KERNELS, swiglu_level, silu, &scales, 11);
    }

    /// The sum-of-squares SIMD kernel against its scalar twin, bit for bit, over lengths that
    /// leave every tail and values of every magnitude; both within rounding of the plain sum.
    #[test]
    fn sum_sq_kernels_match_scalar_twin() {
        use crate::quant::simd::coverage;
        let kernels = coverage::simd_kernels(&SUM_SQ_KERNELS);
        let mut seed = 13u64;
        let mut f = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) % 2_000_001) as f32 / 1_000_000.0 - 1.0
        };
        for len in [0usize, 1, 7, 8, 9, 31, 576, 1537, 2048] {
            let x: Vec<f32> = (0..len)
                .map(|i| f() * [1e-3f32, 1.0, 30.0, 1e4][i % 4])
                .collect();
            let twin = sum_sq_level(&x, SimdLevel::Scalar);
            let plain: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
            assert!((twin - plain).abs() <= 1e-12 * plain.max(1e-30), "{len}");
            for &level in &kernels {
                assert_eq!(sum_sq_level(&x, level).to_bits(), twin.to_bits(), "{len}");
            }
        }
        coverage::report("sum_sq", &SUM_SQ_KERNELS, &kernels);
    }

    #[test]
    fn silu_values() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.7310586).abs() < 1e-6);
        assert!((silu(-20.0)).abs() < 1e-7);
    }

    #[test]
    fn argmax_first_matches_its_scalar_twin() {
        // A local xorshift: the crate's test RNG is not built under loom.
        let mut state = 0x5eed_0007u64;
        let mut next = move |lo: i32, hi: i32| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            lo + (state % (hi - lo + 1) as u64) as i32
        };
        for n in [0usize, 1, 2, 15, 16, 17, 31, 32, 33, 100, 1000, 49_152] {
            let mut x: Vec<f32> = (0..n).map(|_| next(-4000, 4000) as f32 / 1000.0).collect();
            assert_eq!(argmax_first(&x), argmax_first_scalar(&x), "n = {n}");
            #[cfg(target_arch = "x86_64")]
            if crate::quant::simd::level() >= SimdLevel::Avx2 {
                // SAFETY: AVX2 was detected.
                let avx2 = unsafe { x86::argmax_first_avx2(&x) };
                assert_eq!(avx2, argmax_first_scalar(&x));
            }
            if n == 0 {
                assert_eq!(argmax_first(&x), None);
                continue;
            }
            // Ties: the maximum at several places, in different lanes and in the tail.
            let m = x.iter().cloned().fold(f32::MIN, f32::max) + 1.0;
            for &p in &[n - 1, n / 2, n / 3, 0] {
                x[p] = m;
                assert_eq!(
                    argmax_first(&x),
                    argmax_first_scalar(&x),
                    "n = {n} tie at {p}"
                );
            }
            assert_eq!(argmax_first(&x), Some(0));
            // All equal, all -inf, a -0.0/0.0 tie.
            let same = vec![f32::NEG_INFINITY; n];
            assert_eq!(argmax_first(&same), Some(0));
            let mut zeros = vec![-0.0f32; n];
            zeros[n - 1] = 0.0;
            assert_eq!(argmax_first(&zeros), Some(0));
            // NaN: the first NaN wins, wherever it is.
            for &p in &[n - 1, n / 2, 0] {
                let mut y = x.clone();
                y[p] = f32::NAN;
                if p != n - 1 {
                    y[n - 1] = f32::NAN;
                }
                assert_eq!(argmax_first(&y), Some(p), "n = {n} NaN at {p}");
                assert_eq!(argmax_first_scalar(&y), Some(p));
            }
            // +inf beats everything; the first of two.
            let mut z = x.clone();
            z[n - 1] = f32::INFINITY;
            z[n / 2] = f32::INFINITY;
            assert_eq!(argmax_first(&z), Some(n / 2));
        }
    }
}
