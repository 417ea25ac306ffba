//! Binding of `kvserve_core::quant`: dequantization (tests compare it with `gguf.quants`) and
//! the SIMD level in use.

use kvserve_core::quant::{self, GgmlType};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffer::new_logits;
use crate::errors::to_py;

/// Dequantizes `n` elements of ggml type `type_name` ("Q4_K", "F16", ...) from `data`.
#[pyfunction]
pub fn dequantize(py: Python<'_>, type_name: &str, data: &[u8], n: usize) -> PyResult<Py<PyAny>> {
    let ty = GgmlType::from_name(type_name)
        .ok_or_else(|| PyValueError::new_err(format!("unknown ggml type '{type_name}'")))?;
    let mut out = vec![0.0f32; n];
    let src = data.to_vec();
    py.detach(|| quant::dequantize(ty, &src, &mut out))
        .map_err(to_py)?;
    new_logits(py, out, 1, n)
}

/// The kernel family in use: "scalar", "neon" (aarch64), "avx2", "avx512" or "avx512vnni".
#[pyfunction]
pub fn simd_level() -> &'static str {
    quant::simd::level().name()
}
