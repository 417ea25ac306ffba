//! LFM2 (Liquid AI): a hybrid of short-conv blocks and GQA attention, as llama.cpp reads it.
//!
//! Every layer: `h = rms_norm(x) * attn_norm` ("operator norm"), then the layer's mixer, a
//! residual, and a SwiGLU FFN behind `ffn_norm`. A layer whose `head_count_kv` entry is 0 is a
//! short-conv block: `in_proj` (n_embd -> 3 n_embd) gives B, C and x (in that order); `B * x`
//! goes through a causal depthwise convolution of `shortconv.l_cache` taps per channel over
//! time (`shortconv.conv`, ggml dims `[l_cache, n_embd]`; the last tap multiplies the current
//! token), whose last `l_cache - 1` inputs are the sequence's recurrent state
//! (kv/recurrent.rs); `C * conv` goes through `out_proj`. The other layers are GQA attention
//! with per-head RMS norms on q and k (`attn_q_norm`, `attn_k_norm`) and NeoX RoPE. The final
//! norm is `token_embd_norm.weight` (llama.cpp's name for LFM2's output norm); the output is
//! `output.weight` or the tied embedding.
//!
//! The pass is one SPMD region on the model's team like llama.rs's, and shares its steps
//! (`project`, the attention kernel, norms, RoPE); the conv runs one channel range per
//! worker over the batch's tokens in order, each token on its own sequence's state.

use super::config::Config;
use super::llama::{
    group_kv, matrix, output_head, project, residual_swiglu_ffn, store_and_attend, vector,
    AttnSplit, FfnBuffers, PassBuffers, PassViews, WeightRef,
};
use super::{KvIo, Logits, Model};
use crate::batch::Batch;
use crate::error::{model_err, Error, Result};
use crate::gguf::GgufFile;
use crate::kv::attention;
use crate::ops;
use crate::shared::SharedSlice;

/// A layer's token mixer (one per layer, so the size difference of the variants is moot).
#[allow(clippy::large_enum_variant)]
pub enum Mixer {
    Attention {
        wq: WeightRef,
        wk: WeightRef,
        wv: WeightRef,
        wo: WeightRef,
        q_norm: Vec<f32>,
        k_norm: Vec<f32>,
    },
    ShortConv {
        in_proj: WeightRef,
        out_proj: WeightRef,
        /// `[n_embd][l_cache]`: tap `k` of channel `c` at `c * l_cache + k` (oldest first).
        conv: Vec<f32>,
        /// Index of this layer among the conv layers (its part of the state).
        conv_layer: usize,
    },
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub mixer: Mixer,
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

impl Weights {
    /// The matrices the forward pass multiplies by (the output head, not the embedding table).
    pub(super) fn matmul_weights_mut(&mut self) -> Vec<&mut WeightRef> {
        let mut v = vec![&mut self.output];
        for l in &mut self.layers {
            match &mut l.mixer {
                Mixer::Attention { wq, wk, wv, wo, .. } => v.extend([wq, wk, wv, wo]),
                Mixer::ShortConv {
                    in_proj, out_proj, ..
                } => v.extend([in_proj, out_proj]),
            }
            v.extend([&mut l.w_gate, &mut l.w_up, &mut l.w_down]);
        }
        v
    }

    pub fn load(g: &GgufFile, c: &Config) -> Result<Weights> {
        let sc = c
            .shortconv
            .as_ref()
            .ok_or_else(|| model_err("GGUF: lfm2 without shortconv metadata"))?;
        let (d, q, kv, ff, hd) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff, c.head_dim);
        if q != d {
            return Err(model_err(format!(
                "GGUF: lfm2 needs head_count * head_dim == embedding_length, got {q} != {d}"
            )));
        }
        let token_embd = matrix(g, "token_embd.weight", d, c.n_vocab)?;
        let output = if g.tensor("output.weight").is_some() {
            matrix(g, "output.weight", d, c.n_vocab)?
        } else {
            token_embd.clone()
        };
        let mut layers = Vec::with_capacity(c.n_layer);
        let mut conv_layer = 0;
        for i in 0..c.n_layer {
            let p = |s: &str| format!("blk.{i}.{s}");
            let mixer = if sc.is_conv[i] {
                let name = p("shortconv.conv.weight");
                let t = g
                    .tensor(&name)
                    .ok_or_else(|| model_err(format!("GGUF: missing tensor '{name}'")))?;
                if t.dims != [sc.l_cache as u64, d as u64] {
                    return Err(model_err(format!(
                        "GGUF: tensor '{name}' has shape {:?}, expected [{}, {d}]",
                        t.dims, sc.l_cache
                    )));
                }
                let m = Mixer::ShortConv {
                    in_proj: matrix(g, &p("shortconv.in_proj.weight"), d, 3 * d)?,
                    out_proj: matrix(g, &p("shortconv.out_proj.weight"), d, d)?,
                    conv: vector(g, &name, sc.l_cache * d)?,
                    conv_layer,
                };
                conv_layer += 1;
                m
            } else {
                if g.tensor(&p("attn_qkv.weight")).is_some() {
                    return Err(Error::Unsupported(format!(
                        "tensor '{}': fused QKV weights are not supported",
                        p("attn_qkv.weight")
                    )));
                }
                Mixer::Attention {
                    wq: matrix(g, &p("attn_q.weight"), d, q)?,
                    wk: matrix(g, &p("attn_k.weight"), d, kv)?,
                    wv: matrix(g, &p("attn_v.weight"), d, kv)?,
                    wo: matrix(g, &p("attn_output.weight"), q, d)?,
                    q_norm: vector(g, &p("attn_q_norm.weight"), hd)?,
                    k_norm: vector(g, &p("attn_k_norm.weight"), hd)?,
                }
            };
            layers.push(Layer {
                attn_norm: vector(g, &p("attn_norm.weight"), d)?,
                mixer,
                ffn_norm: vector(g, &p("ffn_norm.weight"), d)?,
                w_gate: matrix(g, &p("ffn_gate.weight"), d, ff)?,
                w_up: matrix(g, &p("ffn_up.weight"), d, ff)?,
                w_down: matrix(g, &p("ffn_down.weight"), ff, d)?,
            });
        }
        Ok(Weights {
            token_embd,
            output_norm: vector(g, "token_embd_norm.weight", d)?,
            output,
            layers,
        })
    }
}

/// Values of one sequence's recurrent state: `(l_cache - 1) * n_embd` per conv layer.
pub fn state_floats_per_layer(c: &Config) -> usize {
    c.shortconv
        .as_ref()
        .map_or(0, |s| (s.l_cache - 1) * c.n_embd)
}

/// The recurrent states a batch runs on.
pub(crate) struct ConvStates<'a> {
    /// Every batch sequence's state, `n_conv_layers * state_floats_per_layer` values each, laid
    /// out `[conv layer][channel][l_cache - 1]` (oldest input first); advanced by the pass.
    pub states: &'a mut [f32],
    /// Per token, its sequence's index in `states`.
    pub state_of: &'a [usize],
    /// Snapshots of the state after chosen tokens (checkpoints), same layout per snapshot.
    pub ckpts: &'a mut [f32],
    /// Per token, its snapshot's index in `ckpts`, or [`NO_CHECKPOINT`].
    pub ckpt_of: &'a [usize],
}

pub(crate) const NO_CHECKPOINT: usize = usize::MAX;

/// Runs one batch through an LFM2 model. `io` as for llama.rs (one entry per K/V layer group:
/// the attention layers store and attend through `llama::store_and_attend`, with each layer's
/// mask); `conv_states`: the recurrent states of the batch's sequences, which the pass advances
/// over the batch's tokens.
pub(crate) fn forward(
    model: &Model,
    wts: &Weights,
    io: &mut [KvIo<'_>],
    batch: &Batch,
    conv_states: ConvStates<'_>,
) -> Result<Logits> {
    let ConvStates {
        states,
        state_of,
        ckpts,
        ckpt_of,
    } = conv_states;
    let c = &model.config;
    let n = batch.len();
    let (d, kvd, hd) = (c.n_embd, c.kv_dim(), c.head_dim);
    let l_cache = c.shortconv.as_ref().map_or(2, |s| s.l_cache);
    let dc = l_cache - 1;
    let per_layer = state_floats_per_layer(c);
    let per_seq = per_layer * c.shortconv.as_ref().map_or(0, |s| s.n_conv_layers());
    let bad_ckpt = |&i: &usize| i != NO_CHECKPOINT && (i + 1) * per_seq > ckpts.len();
    if state_of.len() != n
        || ckpt_of.len() != n
        || state_of.iter().any(|&i| (i + 1) * per_seq > states.len())
        || ckpt_of.iter().any(bad_ckpt)
    {
        return Err(Error::Internal(
            "recurrent states do not match the batch".into(),
        ));
    }

    let mut x = vec![0.0f32; n * d];
    let embd = model.mat(&wts.token_embd);
    for (t, row) in x.chunks_exact_mut(d).enumerate() {
        embd.dequantize_row(batch.tokens[t] as usize, row)?;
    }
    let half = c.rope.n_rot / 2;
    let mut cs = vec![(0.0f32, 0.0f32); n * half];
    for (t, chunk) in cs.chunks_exact_mut(half).enumerate() {
        c.rope.cos_sin(batch.positions[t] as f32, chunk);
    }
    let out_rows: Vec<usize> = (0..n).filter(|&t| batch.logits[t]).collect();
    let n_out = out_rows.len();

    let mut bufs = PassBuffers::new(model, x, n, n_out, d);
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
    // The short convolutions' input projection (B, C and x of every token).
    let mut bcx = vec![0.0f32; n * 3 * d];
    let bcx = SharedSlice::new(&mut bcx);
    let states = SharedSlice::new(states);
    let ckpts = SharedSlice::new(ckpts);
    let kv = group_kv(io);
    let (plans, part_len) = AttnSplit::plan(model, &kv, batch);
    let mut part_buf = vec![0.0f32; part_len];
    let split = AttnSplit::new(plans, &mut part_buf);

    let scale = c.attn_scale;

    // Safety pattern (as in llama.rs): each step is a set of tasks (`for_tasks`, `for_rows`,
    // `single`); a task writes only the rows, channels or cells its index assigns to it, and
    // reads shared data only that earlier steps wrote. Nothing shared is written outside a task.
    let ffn = FfnBuffers {
        x: &x,
        o: &o,
        h: &h,
        gate: &gate,
        up: &up,
        down: &down,
    };
    model.team.run(|w| {
        let mut scratch = attention::Scratch::default();
        for (li, layer) in wts.layers.iter().enumerate() {
            if model.fault_at(li) {
                panic!("injected worker panic at layer {li} (test hook)");
            }
            w.for_rows(n, |t| {
                // SAFETY: token rows t of x (read) and h (write) belong to this task.
                unsafe {
                    ops::rms_norm(
                        x.slice(t * d..(t + 1) * d),
                        &layer.attn_norm,
                        c.rms_eps,
                        h.slice_mut(t * d..(t + 1) * d),
                    );
                }
            });
            match &layer.mixer {
                Mixer::Attention {
                    wq,
                    wk,
                    wv,
                    wo,
                    q_norm,
                    k_norm,
                } => {
                    // SAFETY: every member calls this in step; h is not written during it.
                    unsafe { project(model, w, &acts, &h, n, &[wq, wk, wv], &[&q, &k, &v]) };
                    w.for_rows(n, |t| {
                        // SAFETY: token rows t of q and k belong to this task.
                        let (qr, kr) = unsafe {
                            (
                                q.slice_mut(t * d..(t + 1) * d),
                                k.slice_mut(t * kvd..(t + 1) * kvd),
                            )
                        };
                        ops::rms_norm_rows(qr, hd, q_norm, c.rms_eps);
                        ops::rms_norm_rows(kr, hd, k_norm, c.rms_eps);
                        let angles = &cs[t * half..(t + 1) * half];
                        c.rope.apply(qr, hd, angles);
                        c.rope.apply(kr, hd, angles);
                    });
                    // SAFETY: every member calls this in step; q, k, v are not written
                    // during it.
                    unsafe {
                        store_and_attend(
                            w,
                            model,
                            &kv,
                            li,
                            batch,
                            [&q, &k, &v, &attn],
                            &split,
                            scale,
                            &mut scratch,
                        )
                    };
                    // SAFETY: every member calls this in step; attn is not written during it.
                    unsafe { project(model, w, &acts, &attn, n, &[wo], &[&o]) };
                }
                Mixer::ShortConv {
                    in_proj,
                    out_proj,
                    conv,
                    conv_layer,
                } => {
                    // SAFETY: every member calls this in step; h is not written during it.
                    unsafe { project(model, w, &acts, &h, n, &[in_proj], &[&bcx]) };
                    // The conv, one task per channel range, tokens in batch order (a
                    // sequence's tokens come in increasing positions), each on its state.
                    let base = conv_layer * per_layer;
                    w.for_rows(d, |ch| {
                        let taps = &conv[ch * l_cache..(ch + 1) * l_cache];
                        for t in 0..n {
                            let at = state_of[t] * per_seq + base + ch * dc;
                            // SAFETY: channel ch of every state and snapshot and column ch of
                            // every token row of attn belong to this task; bcx is read-only.
                            unsafe {
                                let row = bcx.slice(t * 3 * d..(t + 1) * 3 * d);
                                let (b, cg, xin) = (row[ch], row[d + ch], row[2 * d + ch]);
                                let bx = b * xin;
                                let st = states.slice_mut(at..at + dc);
                                let mut acc = 0.0f32;
                                for (s, &tap) in st.iter().zip(taps) {
                                    acc += s * tap;
                                }
                                acc += bx * taps[dc];
                                st.copy_within(1.., 0);
                                st[dc - 1] = bx;
                                attn.write(t * d + ch, cg * acc);
                                if ckpt_of[t] != NO_CHECKPOINT {
                                    let at = ckpt_of[t] * per_seq + base + ch * dc;
                                    ckpts.slice_mut(at..at + dc).copy_from_slice(st);
                                }
                            }
                        }
                    });
                    // SAFETY: every member calls this in step; attn is not written during it.
                    unsafe { project(model, w, &acts, &attn, n, &[out_proj], &[&o]) };
                }
            }
            // SAFETY: every member calls this in step; nothing else uses these buffers.
            unsafe {
                residual_swiglu_ffn(
                    model,
                    w,
                    &acts,
                    n,
                    &layer.ffn_norm,
                    [&layer.w_gate, &layer.w_up, &layer.w_down],
                    &[],
                    &ffn,
                )
            };
        }
        // Output head, only for rows that want logits.
        // SAFETY: every member calls this in step; x is not written any more.
        unsafe {
            output_head(
                model,
                w,
                &acts,
                &x,
                &out_rows,
                (&wts.output_norm, &wts.output),
                &hs,
                &out,
            )
        };
    });
    Ok(Logits {
        data: bufs.into_logits(model),
        n_rows: n_out,
        n_vocab: c.n_vocab,
    })
}
