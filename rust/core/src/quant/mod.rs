//! Quantized block formats (ggml-compatible), dequantization, activation quantization and
//! matrix multiplication with runtime-dispatched SIMD kernels.

pub mod types;

pub use types::GgmlType;
