//! K-quant formats (Q4_K, Q5_K, Q6_K) and the Q8_K activation format.
//!
//! PLACEHOLDER: the real implementation is written on another branch with exactly these
//! signatures and replaces this file on merge. Every body here is `unimplemented!()`.

use super::simd::SimdLevel;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// One block of 256 activations quantized to int8 with an f32 scale and 16-element sums.
#[derive(Clone, Copy)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; 256],
    pub bsums: [i16; 16],
}

/// Quantizes `x` (`x.len() == out.len() * 256`) into Q8_K blocks.
pub fn quantize_row_q8_k(_x: &[f32], _out: &mut [BlockQ8K]) {
    unimplemented!("K-quants are provided by the kquants branch")
}

pub fn dequantize_q4_k(_src: &[u8], _dst: &mut [f32]) {
    unimplemented!("K-quants are provided by the kquants branch")
}

pub fn dequantize_q5_k(_src: &[u8], _dst: &mut [f32]) {
    unimplemented!("K-quants are provided by the kquants branch")
}

pub fn dequantize_q6_k(_src: &[u8], _dst: &mut [f32]) {
    unimplemented!("K-quants are provided by the kquants branch")
}

pub fn vec_dot_q4_k(_w: &[u8], _a: &[BlockQ8K], _level: SimdLevel) -> f32 {
    unimplemented!("K-quants are provided by the kquants branch")
}

pub fn vec_dot_q5_k(_w: &[u8], _a: &[BlockQ8K], _level: SimdLevel) -> f32 {
    unimplemented!("K-quants are provided by the kquants branch")
}

pub fn vec_dot_q6_k(_w: &[u8], _a: &[BlockQ8K], _level: SimdLevel) -> f32 {
    unimplemented!("K-quants are provided by the kquants branch")
}
