//! Dense f32 vector kernels for attention: `dot` and `axpy`, each with a scalar reference and
//! AVX2/AVX-512 twins selected at run time by [`crate::quant::simd::level`].

use crate::quant::simd::{level, SimdLevel};

/// Scalar reference dot product (16 partial sums, same association as the SIMD twins).
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0.0f32; 16];
    let chunks = n / 16;
    for c in 0..chunks {
        for j in 0..16 {
            acc[j] += a[c * 16 + j] * b[c * 16 + j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 16..n {
        s += a[i] * b[i];
    }
    s
}

/// Scalar reference `y += alpha * x`.
pub fn axpy_scalar(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// Dot product of two equal-length f32 slices.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_at(level(), a, b)
}

/// `y += alpha * x`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    axpy_at(level(), alpha, x, y)
}

/// Dot product with an explicit kernel level (tests compare levels).
pub fn dot_at(lvl: SimdLevel, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if lvl >= SimdLevel::Avx512 && crate::quant::simd::detect() >= SimdLevel::Avx512 {
            // SAFETY: the CPU supports AVX-512F (checked by `detect`).
            return unsafe { x86::dot_avx512(a, b) };
        }
        if lvl >= SimdLevel::Avx2 && crate::quant::simd::detect() >= SimdLevel::Avx2 {
            // SAFETY: the CPU supports AVX2 and FMA (checked by `detect`).
            return unsafe { x86::dot_avx2(a, b) };
        }
    }
    let _ = lvl;
    dot_scalar(a, b)
}

/// `y += alpha * x` with an explicit kernel level.
pub fn axpy_at(lvl: SimdLevel, alpha: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if lvl >= SimdLevel::Avx512 && crate::quant::simd::detect() >= SimdLevel::Avx512 {
            // SAFETY: the CPU supports AVX-512F (checked by `detect`).
            return unsafe { x86::axpy_avx512(alpha, x, y) };
        }
        if lvl >= SimdLevel::Avx2 && crate::quant::simd::detect() >= SimdLevel::Avx2 {
            // SAFETY: the CPU supports AVX2 and FMA (checked by `detect`).
            return unsafe { x86::axpy_avx2(alpha, x, y) };
        }
    }
    let _ = lvl;
    axpy_scalar(alpha, x, y)
}

/// `out = sum_i w[i] * rows[idx[i] * stride + off ..][..out.len()]`: the value-weighted sum of
/// attention. Accumulates in registers (one pass over the rows per 64 outputs) instead of a
/// read-modify-write of `out` per row.
pub fn weighted_sum(
    w: &[f32],
    rows: &[f32],
    stride: usize,
    off: usize,
    idx: &[usize],
    out: &mut [f32],
) {
    weighted_sum_at(level(), w, rows, stride, off, idx, out)
}

/// [`weighted_sum`] with an explicit kernel level.
pub fn weighted_sum_at(
    lvl: SimdLevel,
    w: &[f32],
    rows: &[f32],
    stride: usize,
    off: usize,
    idx: &[usize],
    out: &mut [f32],
) {
    let hd = out.len();
    assert_eq!(w.len(), idx.len());
    for &i in idx {
        assert!(
            i * stride + off + hd <= rows.len(),
            "weighted_sum row {i} out of bounds"
        );
    }
    #[cfg(target_arch = "x86_64")]
    if lvl >= SimdLevel::Avx512
        && crate::quant::simd::detect() >= SimdLevel::Avx512
        && hd.is_multiple_of(16)
    {
        // SAFETY: AVX-512F is available (checked); every row slice read is in bounds (asserted
        // above) and `out` holds hd values.
        unsafe { x86::weighted_sum_avx512(w, rows.as_ptr(), stride, off, idx, out) };
        return;
    }
    let _ = lvl;
    weighted_sum_scalar(w, rows, stride, off, idx, out);
}

/// Scalar reference of [`weighted_sum`].
pub fn weighted_sum_scalar(
    w: &[f32],
    rows: &[f32],
    stride: usize,
    off: usize,
    idx: &[usize],
    out: &mut [f32],
) {
    out.fill(0.0);
    let hd = out.len();
    for (&p, &i) in w.iter().zip(idx) {
        let r = &rows[i * stride + off..i * stride + off + hd];
        for (o, &v) in out.iter_mut().zip(r) {
            *o += p * v;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n <= len of both slices; unaligned loads are allowed.
            let (va, vb) = unsafe {
                (
                    _mm512_loadu_ps(a.as_ptr().add(i)),
                    _mm512_loadu_ps(b.as_ptr().add(i)),
                )
            };
            acc = _mm512_fmadd_ps(va, vb, acc);
            i += 16;
        }
        let mut s = _mm512_reduce_add_ps(acc);
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n <= len of both slices; unaligned loads are allowed.
            unsafe {
                acc0 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i)),
                    _mm256_loadu_ps(b.as_ptr().add(i)),
                    acc0,
                );
                acc1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                    _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                    acc1,
                );
            }
            i += 16;
        }
        let acc = _mm256_add_ps(acc0, acc1);
        let hi = _mm256_extractf128_ps(acc, 1);
        let lo = _mm256_castps256_ps128(acc);
        let s4 = _mm_add_ps(hi, lo);
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        let mut s = _mm_cvtss_f32(s1);
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn axpy_avx512(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let va = _mm512_set1_ps(alpha);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n <= len of both slices.
            unsafe {
                let p = y.as_mut_ptr().add(i);
                _mm512_storeu_ps(
                    p,
                    _mm512_fmadd_ps(va, _mm512_loadu_ps(x.as_ptr().add(i)), _mm512_loadu_ps(p)),
                );
            }
            i += 16;
        }
        while i < n {
            y[i] += alpha * x[i];
            i += 1;
        }
    }

    /// # Safety
    /// The CPU must support AVX-512F; `out.len()` is a multiple of 16; every row
    /// `rows[idx[i] * stride + off ..][..out.len()]` is in bounds.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn weighted_sum_avx512(
        w: &[f32],
        rows: *const f32,
        stride: usize,
        off: usize,
        idx: &[usize],
        out: &mut [f32],
    ) {
        let hd = out.len();
        let mut c0 = 0;
        while c0 < hd {
            let width = (hd - c0).min(64);
            let mut acc = [_mm512_setzero_ps(); 4];
            let nv = width / 16;
            for (&p, &i) in w.iter().zip(idx) {
                let vp = _mm512_set1_ps(p);
                // SAFETY: the row slice is in bounds (caller); c0 + 16 * j + 16 <= hd.
                let base = unsafe { rows.add(i * stride + off + c0) };
                for (j, a) in acc.iter_mut().enumerate().take(nv) {
                    // SAFETY: see above.
                    *a = _mm512_fmadd_ps(vp, unsafe { _mm512_loadu_ps(base.add(16 * j)) }, *a);
                }
            }
            for (j, a) in acc.iter().enumerate().take(nv) {
                // SAFETY: c0 + 16 * j + 16 <= hd = out.len().
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(c0 + 16 * j), *a) };
            }
            c0 += width;
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let va = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n <= len of both slices.
            unsafe {
                let p = y.as_mut_ptr().add(i);
                _mm256_storeu_ps(
                    p,
                    _mm256_fmadd_ps(va, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(p)),
                );
            }
            i += 8;
        }
        while i < n {
            y[i] += alpha * x[i];
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn simd_weighted_sum_matches_scalar() {
        let stride = 200;
        let rows = data(stride * 9, 3);
        let idx = [0usize, 3, 4, 8];
        let w = data(4, 4);
        for (hd, off) in [(16usize, 0usize), (64, 64), (80, 100), (128, 8), (24, 5)] {
            let mut want = vec![0.0; hd];
            weighted_sum_scalar(&w, &rows, stride, off, &idx, &mut want);
            let mut exact = vec![0.0f64; hd];
            for (&p, &i) in w.iter().zip(&idx) {
                for j in 0..hd {
                    exact[j] += p as f64 * rows[i * stride + off + j] as f64;
                }
            }
            for j in 0..hd {
                assert!((want[j] as f64 - exact[j]).abs() < 1e-5);
            }
            for lvl in SimdLevel::available() {
                let mut got = vec![9.0; hd];
                weighted_sum_at(lvl, &w, &rows, stride, off, &idx, &mut got);
                for j in 0..hd {
                    assert!(
                        (got[j] - want[j]).abs() <= 1e-5 * (1.0 + want[j].abs()),
                        "{lvl:?} hd={hd}"
                    );
                }
            }
        }
    }

    #[test]
    fn simd_dot_and_axpy_match_scalar() {
        for n in [0, 1, 7, 16, 31, 64, 100, 129] {
            let a = data(n, 1);
            let b = data(n, 2);
            let want = dot_scalar(&a, &b);
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((want as f64 - exact).abs() < 1e-4);
            for lvl in SimdLevel::available() {
                let got = dot_at(lvl, &a, &b);
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{lvl:?} n={n}"
                );
                let mut y1 = b.clone();
                let mut y2 = b.clone();
                axpy_scalar(0.75, &a, &mut y1);
                axpy_at(lvl, 0.75, &a, &mut y2);
                for (p, q) in y1.iter().zip(&y2) {
                    assert!((p - q).abs() <= 1e-6 * (1.0 + p.abs()), "{lvl:?} n={n}");
                }
            }
        }
    }
}
