//! Quantized block formats (ggml-compatible), dequantization, activation quantization and
//! matrix multiplication with runtime-dispatched SIMD kernels.
//!
//! Guarantees: dequantization follows ggml's reference formulas; every SIMD kernel computes
//! the same integer block dot products as its scalar twin (results differ only by f32 summation
//! order; the AVX-512 VNNI and NEON kernels not even that: they follow the scalar order and return
//! its bits); SIMD code runs only at a [`SimdLevel`] the CPU was detected to support. AMX is never
//! used.

pub mod avx2;
pub mod avx512;
pub mod float;
pub mod kquants;
#[cfg(target_arch = "x86_64")]
pub(crate) mod ktile;
pub mod legacy;
pub mod matmul;
pub(crate) mod neon;
pub mod q8;
pub mod simd;
pub mod types;
pub mod x16;

pub use matmul::{matmul, matmul_q, try_matmul_q, MatmulJob};
pub use q8::{
    act_format_index, quantize_acts, quantize_acts_into, try_quantize_acts, QuantizedActs,
    N_ACT_FORMATS,
};
pub use simd::SimdLevel;
pub use types::GgmlType;

use crate::error::{invalid, Error, Result};
use q8::ActKind;

fn unsupported(ty: GgmlType) -> Error {
    Error::Unsupported(format!(
        "tensor type {} is not supported; supported types are {}",
        ty.name(),
        GgmlType::supported_list()
    ))
}

/// Converts `dst.len()` elements of type `ty` stored in `src` to f32.
///
/// Errors if `ty` has no kernels here (the message lists the supported types), if
/// `dst.len()` is not a whole number of blocks, or if `src.len()` is not exactly the bytes of
/// `dst.len()` elements.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    if !ty.is_supported() {
        return Err(unsupported(ty));
    }
    let need = ty.row_bytes(dst.len() as u64).ok_or_else(|| {
        invalid(format!(
            "{} holds blocks of {} elements; {} elements is not a whole number of blocks",
            ty.name(),
            ty.block_size(),
            dst.len()
        ))
    })?;
    if src.len() as u64 != need {
        return Err(invalid(format!(
            "{} elements of {} take {need} bytes, got {}",
            dst.len(),
            ty.name(),
            src.len()
        )));
    }
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => float::dequantize(ty, src, dst),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
            legacy::dequantize(ty, src, dst)
        }
        GgmlType::Q4_K => kquants::dequantize_q4_k(src, dst),
        GgmlType::Q5_K => kquants::dequantize_q5_k(src, dst),
        GgmlType::Q6_K => kquants::dequantize_q6_k(src, dst),
        _ => return Err(unsupported(ty)),
    }
    Ok(())
}

/// A row-major matrix of `rows` rows of `cols` elements of type `ty`, borrowed from `data`,
/// with an optional copy of its first rows in the one-token decode layout ([`x16`]).
#[derive(Clone, Copy)]
pub struct QMatrix<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    /// [`x16::repack`] of `data` (set by [`QMatrix::with_x16`]).
    pub x16: Option<&'a [u8]>,
}

impl<'a> QMatrix<'a> {
    /// Checks that `ty` is supported, `cols` is a whole number of blocks and `data` holds
    /// exactly `rows` rows.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self> {
        if !ty.is_supported() {
            return Err(unsupported(ty));
        }
        let rb = ty.row_bytes(cols as u64).ok_or_else(|| {
            invalid(format!(
                "{} matrix: {cols} columns is not a multiple of {}",
                ty.name(),
                ty.block_size()
            ))
        })?;
        let total = rb.checked_mul(rows as u64);
        if total != Some(data.len() as u64) {
            return Err(invalid(format!(
                "{} matrix {rows}x{cols} needs {} bytes, got {}",
                ty.name(),
                total.map_or("an overflowing number of".to_string(), |t| t.to_string()),
                data.len()
            )));
        }
        Ok(QMatrix {
            ty,
            rows,
            cols,
            data,
            x16: None,
        })
    }

    /// The matrix with `x16`, the [`x16::repack`] of its data, for one-token products (checked:
    /// a supported type and the length of the copy of every full group of rows).
    pub fn with_x16(self, x16: &'a [u8]) -> Result<Self> {
        let nb = self.cols / self.ty.block_size();
        let want = self.rows / x16::ROWS * nb * x16::group_block_bytes(self.ty);
        if !x16::supports(self.ty) || x16.len() != want || want == 0 {
            return Err(invalid(format!(
                "{} matrix {}x{}: a decode copy of {} bytes does not fit it",
                self.ty.name(),
                self.rows,
                self.cols,
                x16.len()
            )));
        }
        Ok(QMatrix {
            x16: Some(x16),
            ..self
        })
    }

    /// Bytes per row.
    #[inline]
    pub fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_size() * self.ty.type_size()
    }

    /// The bytes of row `r`. Panics if `r >= rows` (an indexing bug in the caller).
    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        assert!(
            r < self.rows,
            "row {r} out of range for a matrix of {} rows",
            self.rows
        );
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Dequantizes row `r` into `dst` (`dst.len() == cols`).
    pub fn dequantize_row(&self, r: usize, dst: &mut [f32]) -> Result<()> {
        if r >= self.rows {
            return Err(invalid(format!(
                "row {r} out of range for a matrix of {} rows",
                self.rows
            )));
        }
        if dst.len() != self.cols {
            return Err(invalid(format!(
                "row has {} columns, destination holds {}",
                self.cols,
                dst.len()
            )));
        }
        dequantize(self.ty, self.row(r), dst)
    }
}

/// Dot product of one weight row of type `ty` with token `token` of `a`, computed with the
/// kernels of `level` (capped at what this CPU runs, see [`simd::cap`]).
///
/// # Panics
/// If `a` was not quantized for `ty`, `token` is out of range or `w_row` is not one row of
/// `a.cols()` elements.
pub fn vec_dot(
    ty: GgmlType,
    w_row: &[u8],
    a: &QuantizedActs,
    token: usize,
    level: SimdLevel,
) -> f32 {
    assert!(
        a.serves(ty),
        "activations were not quantized for {}",
        ty.name()
    );
    assert!(
        token < a.n_tokens,
        "token {token} out of range ({} tokens)",
        a.n_tokens
    );
    let rb = ty.row_bytes(a.cols as u64).unwrap_or(u64::MAX);
    assert_eq!(w_row.len() as u64, rb, "weight row has the wrong length");
    dot_row(ty, w_row, a, token, simd::cap(level))
}

/// Unchecked-shape dispatcher used by the matmul (shapes validated once there).
#[inline]
pub(crate) fn dot_row(
    ty: GgmlType,
    row: &[u8],
    a: &QuantizedActs,
    t: usize,
    level: SimdLevel,
) -> f32 {
    let cols = a.cols;
    match a.kind {
        ActKind::F32 => float::vec_dot(ty, row, &a.f[t * cols..(t + 1) * cols], level),
        ActKind::Q8K => {
            let nb = cols / kquants::QK_K;
            let k = &a.k[t * nb..(t + 1) * nb];
            match ty {
                GgmlType::Q4_K => kquants::vec_dot_q4_k(row, k, level),
                GgmlType::Q5_K => kquants::vec_dot_q5_k(row, k, level),
                _ => kquants::vec_dot_q6_k(row, k, level),
            }
        }
        ActKind::Q8 => {
            let nb = cols / legacy::QK;
            let qa = &a.qs[t * cols..(t + 1) * cols];
            let ds = &a.ds[2 * t * nb..2 * (t + 1) * nb];
            legacy_dot(ty, row, qa, ds, level)
        }
    }
}

/// Tokens per call of [`dot_row_tokens`] (the AVX2 kernel's accumulators for 4 tokens fill
/// the 16 AVX2 registers).
pub(crate) const DOT_ROW_TOKENS: usize = 4;

/// `out[i]` = [`dot_row`] of `row` with token `t0 + i` of `a`, for at most
/// [`DOT_ROW_TOKENS`] tokens: legacy weights at the AVX2 levels (below VNNI) unpack each
/// block once for all of them (`avx2::dot_row_tokens`, same bits as `dot_row` per token), and
/// so do K-quant weights at the AVX2 level (`kquants::dot_row_tokens_avx2`); elsewhere one
/// `dot_row` per token.
#[inline]
pub(crate) fn dot_row_tokens(
    ty: GgmlType,
    row: &[u8],
    a: &QuantizedActs,
    t0: usize,
    level: SimdLevel,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if a.kind == ActKind::Q8 && (SimdLevel::Avx2..SimdLevel::Avx512Vnni).contains(&level) {
        let n = out.len();
        assert!(n <= DOT_ROW_TOKENS && t0 + n <= a.n_tokens);
        let cols = a.cols;
        let nb = cols / legacy::QK;
        assert_eq!(
            row.len(),
            nb * ty.type_size(),
            "weight row has the wrong length"
        );
        let qa: [*const i8; DOT_ROW_TOKENS] =
            std::array::from_fn(|i| a.qs[(t0 + i.min(n - 1)) * cols..].as_ptr());
        let ds: [*const f32; DOT_ROW_TOKENS] =
            std::array::from_fn(|i| a.ds[2 * (t0 + i.min(n - 1)) * nb..].as_ptr());
        macro_rules! run {
            ($n:literal) => {{
                let q: &[*const i8; $n] = qa[..$n].try_into().expect("length");
                let d: &[*const f32; $n] = ds[..$n].try_into().expect("length");
                // SAFETY: AVX2/FMA/F16C were detected (`level` >= Avx2 never exceeds
                // detection); the row holds `nb` blocks (asserted) and each token pointer
                // starts a token's `cols` quants and `2 * nb` scales inside `a` (t0 + i <
                // n_tokens, asserted).
                let v = unsafe {
                    use avx2::{T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0};
                    let r = row.as_ptr();
                    match ty {
                        GgmlType::Q4_0 => avx2::dot_row_tokens::<T_Q4_0, $n>(r, q, d, nb),
                        GgmlType::Q4_1 => avx2::dot_row_tokens::<T_Q4_1, $n>(r, q, d, nb),
                        GgmlType::Q5_0 => avx2::dot_row_tokens::<T_Q5_0, $n>(r, q, d, nb),
                        GgmlType::Q5_1 => avx2::dot_row_tokens::<T_Q5_1, $n>(r, q, d, nb),
                        _ => avx2::dot_row_tokens::<T_Q8_0, $n>(r, q, d, nb),
                    }
                };
                out.copy_from_slice(&v);
            }};
        }
        match n {
            0 => {}
            1 => run!(1),
            2 => run!(2),
            3 => run!(3),
            _ => run!(4),
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if a.kind == ActKind::Q8K && simd::cap(level) == SimdLevel::Avx2 && !out.is_empty() {
        let n = out.len();
        assert!(n <= DOT_ROW_TOKENS && t0 + n <= a.n_tokens);
        let nb = a.cols / kquants::QK_K;
        let k: [&[kquants::BlockQ8K]; DOT_ROW_TOKENS] =
            std::array::from_fn(|i| &a.k[(t0 + i.min(n - 1)) * nb..][..nb]);
        kquants::dot_row_tokens_avx2(ty, row, &k[..n], out);
        return;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot_row(ty, row, a, t0 + i, level);
    }
}

/// Lowest level of each SIMD kernel of the legacy row dot (see `simd::coverage`).
#[cfg(test)]
pub(crate) const LEGACY_DOT_KERNELS: [SimdLevel; 3] =
    [SimdLevel::Neon, SimdLevel::Avx2, SimdLevel::Avx512Vnni];

/// Legacy row dot at `level`; slices are one row / one token of matching length.
#[inline]
fn legacy_dot(ty: GgmlType, row: &[u8], qa: &[i8], ds: &[f32], level: SimdLevel) -> f32 {
    let nb = ds.len() / 2;
    debug_assert!(qa.len() == nb * 32 && row.len() == nb * ty.type_size());
    #[cfg(target_arch = "x86_64")]
    {
        use avx2::{T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0};
        let (r, q, d) = (row.as_ptr(), qa.as_ptr(), ds.as_ptr());
        if level >= SimdLevel::Avx512Vnni {
            // SAFETY: AVX-512 VNNI (and AVX2/FMA/F16C) were detected since `level` never exceeds
            // `simd::detect()`; the pointers cover `nb` blocks of row and activations.
            unsafe {
                return match ty {
                    GgmlType::Q4_0 => avx512::dot_row2::<T_Q4_0>(r, q, d, nb),
                    GgmlType::Q4_1 => avx512::dot_row2::<T_Q4_1>(r, q, d, nb),
                    GgmlType::Q5_0 => avx512::dot_row2::<T_Q5_0>(r, q, d, nb),
                    GgmlType::Q5_1 => avx512::dot_row2::<T_Q5_1>(r, q, d, nb),
                    _ => avx512::dot_row2::<T_Q8_0>(r, q, d, nb),
                };
            }
        }
        if level >= SimdLevel::Avx2 {
            // SAFETY: AVX2/FMA/F16C were detected (level >= Avx2); pointers cover `nb` blocks.
            unsafe {
                return match ty {
                    GgmlType::Q4_0 => avx2::dot_row::<T_Q4_0>(r, q, d, nb),
                    GgmlType::Q4_1 => avx2::dot_row::<T_Q4_1>(r, q, d, nb),
                    GgmlType::Q5_0 => avx2::dot_row::<T_Q5_0>(r, q, d, nb),
                    GgmlType::Q5_1 => avx2::dot_row::<T_Q5_1>(r, q, d, nb),
                    _ => avx2::dot_row::<T_Q8_0>(r, q, d, nb),
                };
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    if level >= SimdLevel::Neon {
        // SAFETY: NEON was detected (`level` >= Neon never exceeds `simd::detect()`).
        return unsafe { neon::legacy_dot(ty, row, qa, ds) };
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = level;
    legacy::vec_dot_scalar(ty, row, qa, ds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dequantize_validates() {
        let mut y = [0f32; 32];
        assert!(dequantize(GgmlType::Q4_1, &[0u8; 20], &mut y).is_ok());
        assert!(dequantize(GgmlType::Q4_1, &[0u8; 19], &mut y).is_err());
        assert!(dequantize(GgmlType::Q4_1, &[0u8; 20], &mut y[..31]).is_err());
        let e = dequantize(GgmlType::IQ2_XS, &[0u8; 74], &mut [0f32; 256]).unwrap_err();
        assert!(e.to_string().contains("Q4_1"), "{e}");
    }

    #[test]
    fn qmatrix_checks_shapes() {
        let data = vec![0u8; 3 * 40];
        let m = QMatrix::new(GgmlType::Q4_1, 3, 64, &data).unwrap();
        assert_eq!(m.row(2).len(), 40);
        assert!(QMatrix::new(GgmlType::Q4_1, 4, 64, &data).is_err());
        assert!(QMatrix::new(GgmlType::Q4_1, 3, 60, &data).is_err());
        assert!(QMatrix::new(GgmlType::Q8_1, 3, 64, &data).is_err());
        let mut y = vec![0f32; 64];
        assert!(m.dequantize_row(3, &mut y).is_err());
        assert!(m.dequantize_row(0, &mut y[..10]).is_err());
        m.dequantize_row(1, &mut y).unwrap();
    }
}
