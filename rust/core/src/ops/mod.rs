//! Tensor operations on f32 activations: RMSNorm, RoPE (normal/NeoX, linear and YaRN scaling),
//! SiLU/SwiGLU, residual adds. (Attention lives with the KV cache, in `kv::attention`.)
//!
//! Activations are row-major `[n_tokens][dim]` slices. None of these functions allocate per
//! element; all are deterministic for a given SIMD level.

pub mod rope;

pub use rope::{Rope, RopeScaling};

/// `out = x / sqrt(mean(x^2) + eps) * w`, one row. The sum runs in f64 like ggml.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(x.len(), w.len());
    debug_assert_eq!(x.len(), out.len());
    let sum: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// In-place RMSNorm of every `dim`-sized row of `x` with weight `w`.
pub fn rms_norm_rows(x: &mut [f32], dim: usize, w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(dim) {
        let sum: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let mean = (sum / dim as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `gate[i] = silu(gate[i]) * up[i]` (SwiGLU), in place in `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// `x[i] += y[i]`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
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

    #[test]
    fn silu_values() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.7310586).abs() < 1e-6);
        assert!((silu(-20.0)).abs() < 1e-7);
    }
}
