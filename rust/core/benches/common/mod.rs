//! Shared inputs of the micro-benchmarks: a seeded generator (the same data on every run and
//! every commit, so two runs compare like with like) and quantized blocks with sane scales.

#![allow(dead_code)] // each bench target uses a part of it

use half::f16;

/// xorshift64*: deterministic, good enough for benchmark data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Roughly normal (sum of four uniforms), times `scale`.
    pub fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (self.f() + self.f() + self.f() + self.f()) * 0.87 * scale)
            .collect()
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Little-endian bytes of `x` as f16 (block scales).
pub fn f16_bytes(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}
