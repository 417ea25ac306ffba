//! Rotary position embeddings as ggml computes them: "normal" (adjacent pairs, llama) and NeoX
//! (halves, qwen2/qwen3) layouts, linear and YaRN frequency scaling, optional per-dimension
//! frequency factors (Llama 3.1's `rope_freqs.weight`).
//!
//! The angle of pair `i` at position `p` is `p * base^(-2i/n_rot) / factor_i`, accumulated in
//! f32 one pair at a time like ggml so that our rotations agree with llama.cpp's bit for bit as
//! far as possible.

/// How the rotary frequencies are stretched for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions are multiplied by `1/factor`.
    Linear {
        factor: f32,
    },
    /// YaRN: interpolate low frequencies, extrapolate high ones, with a ramp in between.
    Yarn {
        factor: f32,
        orig_ctx: u32,
        ext_factor: f32,
        attn_factor: f32,
        beta_fast: f32,
        beta_slow: f32,
    },
}

#[derive(Debug, Clone)]
pub struct Rope {
    /// Rotated dimensions per head (the rest pass through).
    pub n_rot: usize,
    pub neox: bool,
    pub freq_base: f32,
    pub scaling: RopeScaling,
    /// Per-pair frequency divisors (len n_rot/2), when the model ships them.
    pub freq_factors: Option<Vec<f32>>,
}

impl Rope {
    fn freq_scale(&self) -> f32 {
        match self.scaling {
            RopeScaling::None => 1.0,
            RopeScaling::Linear { factor } | RopeScaling::Yarn { factor, .. } => 1.0 / factor,
        }
    }

    /// YaRN correction range [low, high] of pair dims (ggml's `rope_yarn_corr_dims`).
    fn yarn_corr_dims(&self, orig_ctx: u32, beta_fast: f32, beta_slow: f32) -> [f32; 2] {
        let n = self.n_rot as f32;
        let corr = |n_rot: f32| {
            n * (orig_ctx as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * self.freq_base.ln())
        };
        let start = corr(beta_fast).floor();
        let end = corr(beta_slow).ceil();
        [start.max(0.0), end.min(n - 1.0)]
    }

    /// Fills `cs` (len n_rot/2) with (cos, sin) of every rotated pair at `pos`.
    pub fn cos_sin(&self, pos: f32, cs: &mut [(f32, f32)]) {
        let half = self.n_rot / 2;
        debug_assert_eq!(cs.len(), half);
        let theta_scale = self.freq_base.powf(-2.0 / self.n_rot as f32);
        let freq_scale = self.freq_scale();
        let (ext_factor, mut mscale, corr) = match self.scaling {
            RopeScaling::Yarn {
                orig_ctx,
                ext_factor,
                attn_factor,
                beta_fast,
                beta_slow,
                ..
            } => (
                ext_factor,
                attn_factor,
                self.yarn_corr_dims(orig_ctx, beta_fast, beta_slow),
            ),
            _ => (0.0, 1.0, [0.0, 0.0]),
        };
        if ext_factor != 0.0 {
            mscale *= 1.0 + 0.1 * (1.0 / freq_scale).ln();
        }
        let mut theta_base = pos;
        for (i, slot) in cs.iter_mut().enumerate() {
            let ff = self.freq_factors.as_ref().map_or(1.0, |f| f[i]);
            let theta_extrap = theta_base / ff;
            let theta_interp = freq_scale * theta_extrap;
            let theta = if ext_factor != 0.0 {
                let y = (i as f32 - corr[0]) / (corr[1] - corr[0]).max(0.001);
                let ramp = 1.0 - y.clamp(0.0, 1.0);
                let mix = ramp * ext_factor;
                theta_interp * (1.0 - mix) + theta_extrap * mix
            } else {
                theta_interp
            };
            *slot = (theta.cos() * mscale, theta.sin() * mscale);
            theta_base *= theta_scale;
        }
    }

    /// Rotates every head (`head_dim` values each) of one token's row in place.
    pub fn apply(&self, row: &mut [f32], head_dim: usize, cs: &[(f32, f32)]) {
        let half = self.n_rot / 2;
        for head in row.chunks_exact_mut(head_dim) {
            if self.neox {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * c - b * s;
                    head[i + half] = a * s + b * c;
                }
            } else {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * c - b * s;
                    head[2 * i + 1] = a * s + b * c;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope(neox: bool) -> Rope {
        Rope {
            n_rot: 8,
            neox,
            freq_base: 10000.0,
            scaling: RopeScaling::None,
            freq_factors: None,
        }
    }

    #[test]
    fn rotation_preserves_norm_and_matches_complex_multiply() {
        for neox in [false, true] {
            let r = rope(neox);
            let mut cs = vec![(0.0, 0.0); 4];
            r.cos_sin(7.0, &mut cs);
            let x: Vec<f32> = (0..8).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut y = x.clone();
            r.apply(&mut y, 8, &cs);
            let n0: f32 = x.iter().map(|v| v * v).sum();
            let n1: f32 = y.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-5);
            for i in 0..4 {
                let theta = 7.0f64 * 10000f64.powf(-2.0 * i as f64 / 8.0);
                let (ia, ib) = if neox { (i, i + 4) } else { (2 * i, 2 * i + 1) };
                let (a, b) = (x[ia] as f64, x[ib] as f64);
                assert!((y[ia] as f64 - (a * theta.cos() - b * theta.sin())).abs() < 1e-4);
                assert!((y[ib] as f64 - (a * theta.sin() + b * theta.cos())).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn rotations_compose_additively() {
        // Rotating by p then by d equals rotating by p + d: the basis of the lazy K-shift.
        let r = rope(false);
        let x: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
        let (mut a, mut b, mut c) = (
            vec![(0.0, 0.0); 4],
            vec![(0.0, 0.0); 4],
            vec![(0.0, 0.0); 4],
        );
        r.cos_sin(5.0, &mut a);
        r.cos_sin(3.0, &mut b);
        r.cos_sin(8.0, &mut c);
        let mut y1 = x.clone();
        r.apply(&mut y1, 8, &a);
        r.apply(&mut y1, 8, &b);
        let mut y2 = x.clone();
        r.apply(&mut y2, 8, &c);
        for i in 0..8 {
            assert!((y1[i] - y2[i]).abs() < 1e-4);
        }
    }

    #[test]
    fn linear_scaling_divides_positions() {
        let mut r = rope(true);
        r.scaling = RopeScaling::Linear { factor: 4.0 };
        let mut a = vec![(0.0, 0.0); 4];
        r.cos_sin(8.0, &mut a);
        let mut b = vec![(0.0, 0.0); 4];
        rope(true).cos_sin(2.0, &mut b);
        for i in 0..4 {
            assert!((a[i].0 - b[i].0).abs() < 1e-5 && (a[i].1 - b[i].1).abs() < 1e-5);
        }
    }
}
