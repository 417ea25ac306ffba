//! Gemma 3 forward pass, as llama.cpp reads `gemma3` GGUF files: token embeddings scaled by
//! sqrt(n_embd); per layer RMSNorm (weights as stored) before attention, q/k RMSNorm per head,
//! NeoX RoPE with the layer's base (local layers 10,000 or `rope.freq_base_swa`, global layers
//! the metadata base and scaling), attention with the layer's mask (sliding window on local
//! layers), RMSNorm after attention, residual, RMSNorm before the FFN, GELU(tanh)-gated FFN,
//! RMSNorm after it, residual; final norm, output matrix (tied to the embeddings when absent)
//! and final logit soft-capping when the metadata has it.
//!
//! Matmuls, attention and cache writes are the shared steps of [`super::llama`]; this file only
//! composes them.

use super::config::{Config, LayerKind};
use super::llama::{
    group_kv, hint_next, matrix, project, store_and_attend_rows, vector, AttnSplit, Outputs,
    PassBuffers, PassViews, WeightRef,
};
use super::{KvIo, Logits, Model};
use crate::batch::Batch;
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::kv::attention;
use crate::ops;

pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: WeightRef,
    pub wk: WeightRef,
    pub wv: WeightRef,
    pub wo: WeightRef,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub post_attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: WeightRef,
    pub w_up: WeightRef,
    pub w_down: WeightRef,
    pub post_ffn_norm: Vec<f32>,
}

pub struct Weights {
    pub token_embd: WeightRef,
    pub output_norm: Vec<f32>,
    pub output: WeightRef,
    pub layers: Vec<Layer>,
}

impl Weights {
    /// The matrices the forward pass multiplies by (the output head, not the embedding table).
    pub(super) fn matmul_weights_mut(&mut self) -> Vec<&mut WeightRef> {
        let mut v = vec![&mut self.output];
        for l in &mut self.layers {
            v.extend([&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo]);
            v.extend([&mut l.w_gate, &mut l.w_up, &mut l.w_down]);
        }
        v
    }

    pub fn load(g: &GgufFile, c: &Config) -> Result<Weights> {
        let d = c.n_embd;
        let token_embd = matrix(g, "token_embd.weight", d, c.n_vocab)?;
        let output = if g.tensor("output.weight").is_some() {
            matrix(g, "output.weight", d, c.n_vocab)?
        } else {
            token_embd.clone()
        };
        let (q, kv, ff, hd) = (c.q_dim(), c.kv_dim(), c.n_ff, c.head_dim);
        let mut layers = Vec::with_capacity(c.n_layer);
        for i in 0..c.n_layer {
            let p = |s: &str| format!("blk.{i}.{s}");
            layers.push(Layer {
                attn_norm: vector(g, &p("attn_norm.weight"), d)?,
                wq: matrix(g, &p("attn_q.weight"), d, q)?,
                wk: matrix(g, &p("attn_k.weight"), d, kv)?,
                wv: matrix(g, &p("attn_v.weight"), d, kv)?,
                wo: matrix(g, &p("attn_output.weight"), q, d)?,
                q_norm: vector(g, &p("attn_q_norm.weight"), hd)?,
                k_norm: vector(g, &p("attn_k_norm.weight"), hd)?,
                post_attn_norm: vector(g, &p("post_attention_norm.weight"), d)?,
                ffn_norm: vector(g, &p("ffn_norm.weight"), d)?,
                w_gate: matrix(g, &p("ffn_gate.weight"), d, ff)?,
                w_up: matrix(g, &p("ffn_up.weight"), d, ff)?,
                w_down: matrix(g, &p("ffn_down.weight"), ff, d)?,
                post_ffn_norm: vector(g, &p("post_ffw_norm.weight"), d)?,
            });
        }
        Ok(Weights {
            token_embd,
            output_norm: vector(g, "output_norm.weight", d)?,
            output,
            layers,
        })
    }
}

/// Runs one batch through a Gemma 3 model (same contract as [`super::llama::forward`]).
pub(crate) fn forward(
    model: &Model,
    wts: &Weights,
    io: &mut [KvIo<'_>],
    batch: &Batch,
) -> Result<Logits> {
    let c = &model.config;
    let n = batch.len();
    let (d, qd, kvd, hd, ff) = (c.n_embd, c.q_dim(), c.kv_dim(), c.head_dim, c.n_ff);

    // Scaled token embeddings and the RoPE angles of both kinds of layer (cheap, serial).
    let mut x = vec![0.0f32; n * d];
    let embd = model.mat(&wts.token_embd);
    for (t, row) in x.chunks_exact_mut(d).enumerate() {
        embd.dequantize_row(batch.tokens[t] as usize, row)?;
        ops::scale(row, c.embd_scale);
    }
    let half = c.rope.n_rot / 2;
    let angles = |rope: &ops::Rope| {
        let mut cs = vec![(0.0f32, 0.0f32); n * half];
        for (t, chunk) in cs.chunks_exact_mut(half).enumerate() {
            rope.cos_sin(batch.positions[t] as f32, chunk);
        }
        cs
    };
    let cs_global = angles(&c.rope);
    let cs_local = c.rope_local.as_ref().map(angles);
    let outputs = Outputs::of(batch);
    let n_out = outputs.rows.len();
    let out_rows = outputs.head_rows();

    let mut bufs = PassBuffers::new(model, x, n, n_out, qd);
    let PassViews {
        x,
        h,
        q,
        k,
        v,
        attn,
        o,
        gate,
        up,
        down,
        hs,
        out,
        acts,
    } = bufs.views();
    let kv = group_kv(io);
    let (plans, part_len) = AttnSplit::plan(model, &kv, batch);
    let mut part_buf = vec![0.0f32; part_len];
    let split = AttnSplit::new(plans, &mut part_buf);
    let (last_plans, last_len) = outputs.plan(model, &kv);
    let mut last_part = vec![0.0f32; last_len];
    let last_split = AttnSplit::new(last_plans, &mut last_part);
    let eps = c.rms_eps;

    // Safety pattern as in `llama::forward`: each step is a set of tasks; a task writes only the
    // rows its index assigns to it and reads what earlier steps wrote.
    let head = &wts.output;
    model.team.run(|w| {
        let mut scratch = attention::Scratch::default();
        for (li, layer) in wts.layers.iter().enumerate() {
            if model.fault_at(li) {
                panic!("injected worker panic at layer {li} (test hook)");
            }
            let (rope, cs) = match (c.layer_kinds[li], &c.rope_local, &cs_local) {
                (LayerKind::Window(_), Some(r), Some(cs)) => (r, cs),
                _ => (&c.rope, &cs_global),
            };
            // 1. h = norm(x).
            w.for_rows(n, |t| {
                // SAFETY: token rows t of x (read) and h (write) belong to this task.
                unsafe {
                    ops::rms_norm(
                        x.slice(t * d..(t + 1) * d),
                        &layer.attn_norm,
                        eps,
                        h.slice_mut(t * d..(t + 1) * d),
                    )
                };
            });
            // 2. Q, K, V.
            hint_next(model, w, n, &[&layer.wo, &layer.w_gate, &layer.w_up], &[]);
            // SAFETY: every member calls this in step; h is not written during it.
            unsafe {
                project(
                    model,
                    w,
                    &acts,
                    &h,
                    n,
                    &[&layer.wq, &layer.wk, &layer.wv],
                    &[&q, &k, &v],
                )
            };
            // 3. q/k norms per head, RoPE.
            w.for_rows(n, |t| {
                // SAFETY: token rows t of q and k belong to this task.
                let (qr, kr) = unsafe {
                    (
                        q.slice_mut(t * qd..(t + 1) * qd),
                        k.slice_mut(t * kvd..(t + 1) * kvd),
                    )
                };
                ops::rms_norm_rows(qr, hd, &layer.q_norm, eps);
                ops::rms_norm_rows(kr, hd, &layer.k_norm, eps);
                let a = &cs[t * half..(t + 1) * half];
                rope.apply(qr, hd, a);
                rope.apply(kr, hd, a);
            });
            // 4-5. Store K and V, attention (windowed on local layers); in the last layer only
            // for the rows that want logits when some do not (`llama::Outputs`): `n` is then
            // the rows the rest of the layer computes.
            // SAFETY: every member calls this in step; q, k, v, x are not written during it.
            let n = unsafe {
                store_and_attend_rows(
                    w,
                    model,
                    &kv,
                    li,
                    batch,
                    &outputs,
                    [&q, &k, &v, &attn, &x],
                    [&split, &last_split],
                    c.attn_scale,
                    &mut scratch,
                )
            };
            if n == 0 {
                break; // nothing wants logits: the K/V were all the layer had to give
            }
            // 6. Output projection.
            hint_next(
                model,
                w,
                n,
                &[&layer.w_gate, &layer.w_up, &layer.w_down],
                &[],
            );
            // SAFETY: every member calls this in step; attn is not written during it.
            unsafe { project(model, w, &acts, &attn, n, &[&layer.wo], &[&o]) };
            // 7. x += norm(o); h = norm(x).
            w.for_rows(n, |t| {
                // SAFETY: token rows t of x, o, h belong to this task.
                unsafe {
                    let or = o.slice_mut(t * d..(t + 1) * d);
                    ops::rms_norm_rows(or, d, &layer.post_attn_norm, eps);
                    let xr = x.slice_mut(t * d..(t + 1) * d);
                    ops::add_assign(xr, or);
                    ops::rms_norm(xr, &layer.ffn_norm, eps, h.slice_mut(t * d..(t + 1) * d));
                }
            });
            // 8. Gate and up, GeGLU.
            let next_qkv = wts.layers.get(li + 1).map(|l| [&l.wq, &l.wk, &l.wv]);
            let next: &[&WeightRef] = match &next_qkv {
                Some(qkv) => qkv,
                None => std::slice::from_ref(&head),
            };
            hint_next(model, w, n, &[&layer.w_down], next);
            // SAFETY: every member calls this in step; h is not written during it.
            unsafe {
                project(
                    model,
                    w,
                    &acts,
                    &h,
                    n,
                    &[&layer.w_gate, &layer.w_up],
                    &[&gate, &up],
                )
            };
            w.for_rows(n, |t| {
                // SAFETY: token rows t of gate (write) and up (read) belong to this task.
                unsafe {
                    ops::geglu(
                        gate.slice_mut(t * ff..(t + 1) * ff),
                        up.slice(t * ff..(t + 1) * ff),
                    )
                };
            });
            // 9. Down, x += norm(down).
            hint_next(model, w, n, next, &[]);
            // SAFETY: every member calls this in step; gate is not written during it.
            unsafe { project(model, w, &acts, &gate, n, &[&layer.w_down], &[&down]) };
            w.for_rows(n, |t| {
                // SAFETY: token rows t of x and down belong to this task.
                unsafe {
                    let dr = down.slice_mut(t * d..(t + 1) * d);
                    ops::rms_norm_rows(dr, d, &layer.post_ffn_norm, eps);
                    ops::add_assign(x.slice_mut(t * d..(t + 1) * d), dr);
                }
            });
        }
        if n_out == 0 {
            return;
        }
        w.for_rows(n_out, |r| {
            let t = out_rows[r];
            // SAFETY: output row r of hs belongs to this task; x is read-only now.
            unsafe {
                ops::rms_norm(
                    x.slice(t * d..(t + 1) * d),
                    &wts.output_norm,
                    eps,
                    hs.slice_mut(r * d..(r + 1) * d),
                )
            };
        });
        // SAFETY: every member calls this in step; hs is not written during it.
        unsafe { project(model, w, &acts, &hs, n_out, &[&wts.output], &[&out]) };
        if let Some(cap) = c.final_softcap {
            w.for_rows(n_out, |r| {
                // SAFETY: logits row r belongs to this task; the projection step is over.
                unsafe { ops::softcap(out.slice_mut(r * c.n_vocab..(r + 1) * c.n_vocab), cap) };
            });
        }
    });
    Ok(Logits {
        data: bufs.into_logits(model),
        n_rows: n_out,
        n_vocab: c.n_vocab,
    })
}
