//! Quantized block formats (ggml-compatible), dequantization, activation quantization and
//! matrix multiplication with runtime-dispatched SIMD kernels.

pub mod kquants;
pub mod simd;
pub mod types;

pub use simd::SimdLevel;
pub use types::GgmlType;
