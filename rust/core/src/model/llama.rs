//! Llama-family forward pass (llama, qwen2, qwen3): token embedding, RMSNorm, RoPE, grouped-query
//! attention, SwiGLU feed-forward, tied or separate output.
//!
//! The pass takes a [`Batch`] of (token, position, sequence id, wants logits): matmuls run over all
//! tokens at once, attention runs per token over the cells of that token's own sequence whose
//! position is not after the token's (the causal mask by position, as llama.cpp applies it).

use rayon::prelude::*;

use super::cache::SeqCache;
use super::config::{Arch, Config};
use super::{Logits, Model};
use crate::batch::Batch;
use crate::error::{model_err, Error, Result};
use crate::gguf::{GgufFile, TensorInfo};
use crate::ops::{self, vec as fvec};
use crate::quant::{self, GgmlType, QMatrix};

/// A weight matrix: where it lives in the mapping and its shape (rows = output features).
#[derive(Debug, Clone)]
pub struct WeightRef {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub info: TensorInfo,
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: WeightRef,
    pub wk: WeightRef,
    pub wv: WeightRef,
    pub wo: WeightRef,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: WeightRef,
    pub w_up: WeightRef,
    pub w_down: WeightRef,
}

pub struct Weights {
    pub token_embd: WeightRef,
    pub output_norm: Vec<f32>,
    pub output: WeightRef,
    pub layers: Vec<Layer>,
}

fn tensor<'a>(g: &'a GgufFile, name: &str) -> Result<&'a TensorInfo> {
    g.tensor(name).ok_or_else(|| model_err(format!("GGUF: missing tensor '{name}'")))
}

/// A 2-D matrix with `cols` inputs and `rows` outputs (ggml dims `[cols, rows]`).
fn matrix(g: &GgufFile, name: &str, cols: usize, rows: usize) -> Result<WeightRef> {
    let t = tensor(g, name)?;
    let dims: Vec<u64> = t.dims.clone();
    if dims.len() != 2 || dims[0] as usize != cols || dims[1] as usize != rows {
        return Err(model_err(format!(
            "GGUF: tensor '{name}' has shape {dims:?}, expected [{cols}, {rows}]"
        )));
    }
    if !t.ty.is_supported() {
        return Err(Error::Unsupported(format!(
            "tensor '{name}' has unsupported type {} (supported: {})",
            t.ty.name(),
            GgmlType::supported_list()
        )));
    }
    QMatrix::new(t.ty, rows, cols, g.tensor_data(t))?;
    Ok(WeightRef { ty: t.ty, rows, cols, info: t.clone() })
}

/// A 1-D vector of `n` values, dequantized to f32.
fn vector(g: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>> {
    let t = tensor(g, name)?;
    if t.n_elements as usize != n {
        return Err(model_err(format!(
            "GGUF: tensor '{name}' has {} elements, expected {n}",
            t.n_elements
        )));
    }
    let mut out = vec![0.0f32; n];
    quant::dequantize(t.ty, g.tensor_data(t), &mut out)
        .map_err(|e| model_err(format!("GGUF: tensor '{name}': {e}")))?;
    Ok(out)
}

fn opt_vector(g: &GgufFile, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
    if g.tensor(name).is_some() {
        vector(g, name, n).map(Some)
    } else {
        Ok(None)
    }
}

impl Weights {
    pub fn load(g: &GgufFile, c: &mut Config) -> Result<Weights> {
        let d = c.n_embd;
        let token_embd = matrix(g, "token_embd.weight", d, c.n_vocab)?;
        let output = if g.tensor("output.weight").is_some() {
            matrix(g, "output.weight", d, c.n_vocab)?
        } else {
            token_embd.clone()
        };
        if let Some(t) = g.tensor("rope_freqs.weight") {
            let n = c.rope.n_rot / 2;
            if t.n_elements as usize != n {
                return Err(model_err(format!(
                    "GGUF: tensor 'rope_freqs.weight' has {} elements, expected {n}",
                    t.n_elements
                )));
            }
            c.rope.freq_factors = Some(vector(g, "rope_freqs.weight", n)?);
        }
        let (q, kv, ff, hd) = (c.q_dim(), c.kv_dim(), c.n_ff, c.head_dim);
        let mut layers = Vec::with_capacity(c.n_layer);
        for i in 0..c.n_layer {
            let p = |s: &str| format!("blk.{i}.{s}");
            let bias = matches!(c.arch, Arch::Qwen2);
            let qk_norm = matches!(c.arch, Arch::Qwen3);
            layers.push(Layer {
                attn_norm: vector(g, &p("attn_norm.weight"), d)?,
                wq: matrix(g, &p("attn_q.weight"), d, q)?,
                wk: matrix(g, &p("attn_k.weight"), d, kv)?,
                wv: matrix(g, &p("attn_v.weight"), d, kv)?,
                wo: matrix(g, &p("attn_output.weight"), q, d)?,
                bq: if bias { opt_vector(g, &p("attn_q.bias"), q)? } else { None },
                bk: if bias { opt_vector(g, &p("attn_k.bias"), kv)? } else { None },
                bv: if bias { opt_vector(g, &p("attn_v.bias"), kv)? } else { None },
                q_norm: if qk_norm { Some(vector(g, &p("attn_q_norm.weight"), hd)?) } else { None },
                k_norm: if qk_norm { Some(vector(g, &p("attn_k_norm.weight"), hd)?) } else { None },
                ffn_norm: vector(g, &p("ffn_norm.weight"), d)?,
                w_gate: matrix(g, &p("ffn_gate.weight"), d, ff)?,
                w_up: matrix(g, &p("ffn_up.weight"), d, ff)?,
                w_down: matrix(g, &p("ffn_down.weight"), ff, d)?,
            });
        }
        Ok(Weights { token_embd, output_norm: vector(g, "output_norm.weight", d)?, output, layers })
    }
}

impl Model {
    fn mat(&self, w: &WeightRef) -> QMatrix<'_> {
        QMatrix { ty: w.ty, rows: w.rows, cols: w.cols, data: self.gguf.tensor_data(&w.info) }
    }

    /// `out = x · W^T` for `n` token rows.
    fn linear(&self, w: &WeightRef, x: &[f32], n: usize, out: &mut Vec<f32>) {
        out.resize(n * w.rows, 0.0);
        quant::matmul(&self.mat(w), x, n, out);
    }

    /// Several matrices over the same input, sharing one activation quantization when the
    /// weight types agree.
    fn linear_many(&self, ws: &[&WeightRef], x: &[f32], n: usize, outs: &mut [&mut Vec<f32>]) {
        let mut acts: Option<(GgmlType, quant::QuantizedActs)> = None;
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            out.resize(n * w.rows, 0.0);
            let reuse = matches!(&acts, Some((t, _)) if *t == w.ty);
            if !reuse {
                acts = Some((w.ty, quant::quantize_acts(x, n, w.cols, w.ty)));
            }
            let (_, a) = acts.as_ref().expect("activations were just quantized");
            quant::matmul_q(&self.mat(w), a, out);
        }
    }
}

/// Runs one batch through the model, storing its keys/values in `cache`. Call it inside the
/// model's thread pool (`pool.install`): every parallel kernel runs on the current pool.
pub(crate) fn forward(model: &Model, cache: &mut SeqCache, batch: &Batch) -> Result<Logits> {
    let c = &model.config;
    let w = &model.weights;
    let n = batch.len();
    let (d, qd, kvd, hd) = (c.n_embd, c.q_dim(), c.kv_dim(), c.head_dim);
    let cells = cache.reserve(batch)?;

    // Token embeddings.
    let mut x = vec![0.0f32; n * d];
    let embd = model.mat(&w.token_embd);
    for (t, row) in x.chunks_exact_mut(d).enumerate() {
        embd.dequantize_row(batch.tokens[t] as usize, row)?;
    }

    // RoPE angles per token, shared by all layers.
    let half = c.rope.n_rot / 2;
    let mut cs = vec![(0.0f32, 0.0f32); n * half];
    for (t, chunk) in cs.chunks_exact_mut(half).enumerate() {
        c.rope.cos_sin(batch.positions[t] as f32, chunk);
    }

    let scale = 1.0 / (hd as f32).sqrt();
    let group = c.n_head / c.n_head_kv;
    let mut h = vec![0.0f32; n * d];
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    let mut attn = vec![0.0f32; n * qd];
    let (mut o, mut gate, mut up, mut down) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());

    for (li, layer) in w.layers.iter().enumerate() {
        h.copy_from_slice(&x);
        ops::rms_norm_rows(&mut h, d, &layer.attn_norm, c.rms_eps);
        model.linear_many(&[&layer.wq, &layer.wk, &layer.wv], &h, n, &mut [&mut q, &mut k, &mut v]);
        for (b, buf, width) in [(&layer.bq, &mut q, qd), (&layer.bk, &mut k, kvd), (&layer.bv, &mut v, kvd)] {
            if let Some(b) = b {
                for row in buf.chunks_exact_mut(width) {
                    ops::add_assign(row, b);
                }
            }
        }
        if let Some(qn) = &layer.q_norm {
            ops::rms_norm_rows(&mut q, hd, qn, c.rms_eps);
        }
        if let Some(kn) = &layer.k_norm {
            ops::rms_norm_rows(&mut k, hd, kn, c.rms_eps);
        }
        for t in 0..n {
            let a = &cs[t * half..(t + 1) * half];
            c.rope.apply(&mut q[t * qd..(t + 1) * qd], hd, a);
            c.rope.apply(&mut k[t * kvd..(t + 1) * kvd], hd, a);
        }
        cache.write(li, &cells, &k, &v);

        // Attention: one task per (token, head).
        let cache_ref = &*cache;
        let q_ref = &q;
        {
            attn.par_chunks_mut(hd).enumerate().for_each(|(job, out)| {
                let (t, head) = (job / c.n_head, job % c.n_head);
                let kvh = head / group;
                let qrow = &q_ref[t * qd + head * hd..t * qd + (head + 1) * hd];
                let seq = batch.seq_ids[t];
                let pos = batch.positions[t];
                let (keys, vals, positions) = cache_ref.layer_view(li, seq);
                let mut scores: Vec<f32> = Vec::with_capacity(positions.len());
                let mut idx: Vec<usize> = Vec::with_capacity(positions.len());
                for (ci, &p) in positions.iter().enumerate() {
                    if p <= pos {
                        let kr = &keys[ci * kvd + kvh * hd..ci * kvd + (kvh + 1) * hd];
                        scores.push(fvec::dot(qrow, kr) * scale);
                        idx.push(ci);
                    }
                }
                ops::softmax(&mut scores);
                out.fill(0.0);
                for (&p, &ci) in scores.iter().zip(&idx) {
                    fvec::axpy(p, &vals[ci * kvd + kvh * hd..ci * kvd + (kvh + 1) * hd], out);
                }
            })
        }

        model.linear(&layer.wo, &attn, n, &mut o);
        ops::add_assign(&mut x, &o);

        h.copy_from_slice(&x);
        ops::rms_norm_rows(&mut h, d, &layer.ffn_norm, c.rms_eps);
        model.linear_many(&[&layer.w_gate, &layer.w_up], &h, n, &mut [&mut gate, &mut up]);
        ops::swiglu(&mut gate, &up);
        model.linear(&layer.w_down, &gate, n, &mut down);
        ops::add_assign(&mut x, &down);
    }

    // Output rows only for tokens that want logits.
    let rows: Vec<usize> = (0..n).filter(|&t| batch.logits[t]).collect();
    let mut hs = vec![0.0f32; rows.len() * d];
    for (r, &t) in rows.iter().enumerate() {
        ops::rms_norm(&x[t * d..(t + 1) * d], &w.output_norm, c.rms_eps, &mut hs[r * d..(r + 1) * d]);
    }
    let mut data = Vec::new();
    if !rows.is_empty() {
        model.linear(&w.output, &hs, rows.len(), &mut data);
    }
    Ok(Logits { data, n_rows: rows.len(), n_vocab: c.n_vocab })
}
