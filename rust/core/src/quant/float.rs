//! Float weight formats F32, F16 and BF16: dequantization and dot products against f32
//! activations (scalar reference plus AVX2/FMA/F16C and AVX-512 kernels).
//!
//! Weights are read from little-endian bytes with unaligned loads, so any byte slice works.

use super::simd::SimdLevel;
use super::types::GgmlType;
use half::f16;

#[inline(always)]
fn weight_at(ty: GgmlType, b: &[u8], i: usize) -> f32 {
    match ty {
        GgmlType::F32 => f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]),
        GgmlType::F16 => f16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32(),
        GgmlType::BF16 => {
            f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16)
        }
        _ => unreachable!("float weight type expected, got {}", ty.name()),
    }
}

/// True for F32, F16, BF16.
pub fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// Converts `dst.len()` elements; the caller validated `src.len()`.
pub(crate) fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    for (i, y) in dst.iter_mut().enumerate() {
        *y = weight_at(ty, src, i);
    }
}

/// Scalar reference dot product.
pub(crate) fn vec_dot_scalar(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    let mut s = 0.0f32;
    for (i, &v) in x.iter().enumerate() {
        s += weight_at(ty, row, i) * v;
    }
    s
}

/// Lowest level of each SIMD kernel of [`vec_dot`] (see `simd::coverage`).
#[cfg(test)]
pub(crate) const DOT_KERNELS: [SimdLevel; 2] = [SimdLevel::Avx2, SimdLevel::Avx512];

/// Dispatches on `level`; `row` holds `x.len()` weights of type `ty`.
pub(crate) fn vec_dot(ty: GgmlType, row: &[u8], x: &[f32], level: SimdLevel) -> f32 {
    assert_eq!(
        row.len(),
        x.len() * ty.type_size(),
        "float row length mismatch"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if level >= SimdLevel::Avx512 {
            // SAFETY: `level` never exceeds what `simd::detect` found on this CPU, so
            // AVX-512F/BW/VL/DQ, AVX2, FMA and F16C are available; lengths were checked above.
            return unsafe { x86::dot512(ty, row, x) };
        }
        if level >= SimdLevel::Avx2 {
            // SAFETY: AVX2, FMA and F16C were detected (level >= Avx2); lengths checked above.
            return unsafe { x86::dot256(ty, row, x) };
        }
    }
    let _ = level;
    vec_dot_scalar(ty, row, x)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Loads 8 weights starting at element `i` as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(ty: GgmlType, p: *const u8, i: usize) -> __m256 {
        // SAFETY: the caller guarantees elements i..i+8 are inside the row.
        unsafe {
            match ty {
                GgmlType::F32 => _mm256_loadu_ps(p.add(4 * i).cast()),
                GgmlType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i).cast())),
                _ => {
                    let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * i).cast()));
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
                }
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// AVX2, FMA, F16C available; `row.len() == x.len() * ty.type_size()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot256(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let p = row.as_ptr();
        let xp = x.as_ptr();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load stays below `n` elements of both `row` and `x`.
        unsafe {
            while i + 32 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let w = load8(ty, p, i + 8 * k);
                    *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp.add(i + 8 * k)), *a);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(load8(ty, p, i), _mm256_loadu_ps(xp.add(i)), acc[0]);
                i += 8;
            }
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        // SAFETY: same features as this function.
        let mut s = unsafe { hsum256(v) };
        while i < n {
            s += weight_at(ty, row, i) * x[i];
            i += 1;
        }
        s
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn load16(ty: GgmlType, p: *const u8, i: usize) -> __m512 {
        // SAFETY: the caller guarantees elements i..i+16 are inside the row.
        unsafe {
            match ty {
                GgmlType::F32 => _mm512_loadu_ps(p.add(4 * i).cast()),
                GgmlType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * i).cast())),
                _ => {
                    let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(2 * i).cast()));
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
                }
            }
        }
    }

    /// # Safety
    /// AVX-512F/BW/VL/DQ, AVX2, FMA, F16C available; `row.len() == x.len() * ty.type_size()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn dot512(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let p = row.as_ptr();
        let xp = x.as_ptr();
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load stays below `n` elements of both `row` and `x`.
        unsafe {
            while i + 64 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let w = load16(ty, p, i + 16 * k);
                    *a = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp.add(i + 16 * k)), *a);
                }
                i += 64;
            }
            while i + 16 <= n {
                acc[0] = _mm512_fmadd_ps(load16(ty, p, i), _mm512_loadu_ps(xp.add(i)), acc[0]);
                i += 16;
            }
        }
        let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let mut s = _mm512_reduce_add_ps(v);
        while i < n {
            s += weight_at(ty, row, i) * x[i];
            i += 1;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_dequantize_known_values() {
        let vals = [1.0f32, -2.5, 0.0, 65504.0, 1.0 / 1024.0];
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16b: Vec<u8> = vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        let bf16b: Vec<u8> = vals
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        let mut y = [0f32; 5];
        dequantize(GgmlType::F32, &f32b, &mut y);
        assert_eq!(y, vals);
        dequantize(GgmlType::F16, &f16b, &mut y);
        assert_eq!(y, vals);
        dequantize(GgmlType::BF16, &bf16b, &mut y);
        // BF16 truncation of these values is exact except 65504 (0x477FE000 -> 0x477F0000).
        assert_eq!(y[..3], vals[..3]);
        assert_eq!(y[3], f32::from_bits(0x477F_0000));
        assert_eq!(y[4], vals[4]);
    }

    #[test]
    fn simd_float_dots_match_scalar() {
        let mut seed = 7u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let kernels = crate::quant::simd::coverage::simd_kernels(&DOT_KERNELS);
        for n in [1usize, 7, 16, 33, 64, 100, 576] {
            let w: Vec<f32> = (0..n).map(|_| rnd()).collect();
            let x: Vec<f32> = (0..n).map(|_| rnd()).collect();
            for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
                let row: Vec<u8> = match ty {
                    GgmlType::F32 => w.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    GgmlType::F16 => w
                        .iter()
                        .flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes())
                        .collect(),
                    _ => w
                        .iter()
                        .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                        .collect(),
                };
                let want = vec_dot_scalar(ty, &row, &x);
                let norm: f32 = x.iter().map(|v| v.abs()).sum::<f32>() + 1e-6;
                for &level in &kernels {
                    let got = vec_dot(ty, &row, &x, level);
                    assert!(
                        (got - want).abs() <= 1e-5 * norm,
                        "{} n={n} {}: {got} vs {want}",
                        ty.name(),
                        level.name()
                    );
                }
            }
        }
        crate::quant::simd::coverage::report("float weight dot", &DOT_KERNELS, &kernels);
    }
}
