//! Tensor operations on f32 activations: RMSNorm, RoPE (normal/NeoX, linear and YaRN scaling),
//! SiLU/SwiGLU, GELU/GeGLU, soft-capping, residual adds. (Attention lives with the KV cache, in `kv::attention`.)
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

/// GELU, tanh approximation (ggml's `ggml_gelu`; ggml reads it from an f16 table, this
/// computes it in f32).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const A: f32 = 0.044_715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + A * x * x)).tanh())
}

/// `gate[i] = gelu_tanh(gate[i]) * up[i]` (GeGLU), in place in `gate`.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh(*g) * u;
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

    /// Values of the tanh-approximated GELU from its formula in f64 (and its limits).
    #[test]
    fn gelu_tanh_values() {
        for x in [-12.0f64, -3.0, -1.0, -0.1, 0.0, 0.5, 1.0, 2.5, 12.0] {
            let want = 0.5
                * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh());
            let got = gelu_tanh(x as f32) as f64;
            assert!(
                (got - want).abs() < 1e-6 * (1.0 + want.abs()),
                "{x}: {got} vs {want}"
            );
        }
        let mut g = [1.0f32, -2.0];
        geglu(&mut g, &[3.0, 0.5]);
        assert_eq!(g, [gelu_tanh(1.0) * 3.0, gelu_tanh(-2.0) * 0.5]);
        let mut l = [0.0f32, 30.0, -1e9];
        softcap(&mut l, 30.0);
        assert_eq!(l[0], 0.0);
        assert!((l[1] - 30.0 * 1f32.tanh()).abs() < 1e-5 && (l[2] + 30.0).abs() < 1e-5);
    }

    #[test]
    fn silu_values() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.7310586).abs() < 1e-6);
        assert!((silu(-20.0)).abs() < 1e-7);
    }
}
