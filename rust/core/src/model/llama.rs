//! Llama-family forward pass (llama, qwen2, qwen3): token embedding, RMSNorm, RoPE, grouped-query
//! attention, SwiGLU feed-forward, tied or separate output.
//!
//! The pass takes a [`Batch`] of (token, position, sequence id, wants logits): matmuls run over all
//! tokens at once, attention runs per token over the cells of that token's own sequence whose
//! position is not after the token's (the causal mask by position, as llama.cpp applies it).

use super::config::{Arch, Config, LayerKind};
use super::{KvIo, Logits, Model};
use crate::batch::Batch;
use crate::error::{model_err, Error, Result};
use crate::gguf::{GgufFile, TensorInfo};
use crate::kv::attention::{self, Mask, Query};
use std::collections::HashMap;
use std::sync::Arc;

use crate::kv::storage::KvStorage;
use crate::kv::{BlockId, PagedCache, SeqId, SeqView};
use crate::ops;
use crate::quant::{self, GgmlType, MatmulJob, QMatrix, QuantizedActs};
use crate::shared::SharedSlice;
use crate::threads::Worker;

/// A weight matrix: where it lives in the mapping and its shape (rows = output features), and
/// its copy in the one-token decode layout when the model made one ([`quant::x16`]).
#[derive(Debug, Clone)]
pub struct WeightRef {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub info: TensorInfo,
    pub x16: Option<Arc<[u8]>>,
}

impl WeightRef {
    /// Bytes the decode copy takes (0: the type has none, or the kernel cannot run here).
    pub(super) fn decode_copy_bytes(&self) -> usize {
        if quant::x16::supports(self.ty) && quant::simd::level() >= quant::simd::SimdLevel::Avx2 {
            self.rows / quant::x16::ROWS * (self.cols / 32) * quant::x16::group_block_bytes(self.ty)
        } else {
            0
        }
    }

    /// Makes the decode copy ([`WeightRef::decode_copy_bytes`] > 0); false when the memory
    /// for it could not be had.
    pub(super) fn repack(&mut self, g: &GgufFile) -> bool {
        if self.x16.is_none() && self.decode_copy_bytes() > 0 {
            self.x16 = quant::x16::repack(self.ty, self.rows, self.cols, g.tensor_data(&self.info))
                .map(Arc::from);
        }
        self.x16.is_some()
    }
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

pub(super) fn tensor<'a>(g: &'a GgufFile, name: &str) -> Result<&'a TensorInfo> {
    g.tensor(name)
        .ok_or_else(|| model_err(format!("GGUF: missing tensor '{name}'")))
}

/// A 2-D matrix with `cols` inputs and `rows` outputs (ggml dims `[cols, rows]`).
pub(super) fn matrix(g: &GgufFile, name: &str, cols: usize, rows: usize) -> Result<WeightRef> {
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
    Ok(WeightRef {
        ty: t.ty,
        rows,
        cols,
        info: t.clone(),
        x16: None,
    })
}

/// A 1-D vector of `n` values, dequantized to f32.
pub(super) fn vector(g: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>> {
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

pub(super) fn opt_vector(g: &GgufFile, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
    if g.tensor(name).is_some() {
        vector(g, name, n).map(Some)
    } else {
        Ok(None)
    }
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
                bq: if bias {
                    opt_vector(g, &p("attn_q.bias"), q)?
                } else {
                    None
                },
                bk: if bias {
                    opt_vector(g, &p("attn_k.bias"), kv)?
                } else {
                    None
                },
                bv: if bias {
                    opt_vector(g, &p("attn_v.bias"), kv)?
                } else {
                    None
                },
                q_norm: if qk_norm {
                    Some(vector(g, &p("attn_q_norm.weight"), hd)?)
                } else {
                    None
                },
                k_norm: if qk_norm {
                    Some(vector(g, &p("attn_k_norm.weight"), hd)?)
                } else {
                    None
                },
                ffn_norm: vector(g, &p("ffn_norm.weight"), d)?,
                w_gate: matrix(g, &p("ffn_gate.weight"), d, ff)?,
                w_up: matrix(g, &p("ffn_up.weight"), d, ff)?,
                w_down: matrix(g, &p("ffn_down.weight"), ff, d)?,
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

impl Model {
    pub(crate) fn mat<'a>(&'a self, w: &'a WeightRef) -> QMatrix<'a> {
        QMatrix {
            ty: w.ty,
            rows: w.rows,
            cols: w.cols,
            data: self.gguf.tensor_data(&w.info),
            x16: w.x16.as_deref(),
        }
    }
}

/// The bytes a decode matmul of `w` streams (its interleaved copy when it has one).
fn stream_bytes<'a>(model: &'a Model, w: &'a WeightRef) -> &'a [u8] {
    let m = model.mat(w);
    m.x16.unwrap_or(m.data)
}

/// Most bytes a member prefetches per hint while it waits (the size of a Zen 3 core's L2:
/// more would evict what it fetched first).
const IDLE_PREFETCH_BYTES: usize = 512 * 1024;

/// Steps of at most this many tokens prefetch the next weights while members wait: their
/// matmuls stream weights at the memory's pace, so bytes fetched during a wait are time saved.
const IDLE_PREFETCH_TOKENS: usize = 16;

/// Before a decode step's matmul: has each member, while it waits (for a one-task step, or at
/// the end of a matmul for its partner's last task), prefetch the weights of the matmuls that
/// come after it, `first` then `then`, in the order they run (`Worker::prefetch_while_waiting`).
/// Measured on SmolLM2 decode, 2 threads, Zen 3 without AVX-512 (one process, the two ways
/// alternating every 8 steps): 3-5% more tokens/s.
pub(super) fn hint_next(
    model: &Model,
    w: &Worker<'_>,
    n: usize,
    first: &[&WeightRef],
    then: &[&WeightRef],
) {
    if n > IDLE_PREFETCH_TOKENS {
        return;
    }
    let mut parts: [&[u8]; 4] = [&[]; 4];
    let mut k = 0;
    for wr in first.iter().chain(then) {
        if k < parts.len() {
            parts[k] = stream_bytes(model, wr);
            k += 1;
        }
    }
    w.prefetch_while_waiting(&parts[..k], IDLE_PREFETCH_BYTES);
}

/// Largest head dimension the attention kernel takes (checked at load).
pub const MAX_HEAD_DIM: usize = 256;

/// Activations of one input, quantized once per format the consuming weights need.
pub(super) type Acts = [QuantizedActs; quant::N_ACT_FORMATS];

/// Quantizes `x` (`n` rows of `cols`) for every weight in `ws` (once per format); without the
/// packed copies when every weight takes the interleaved copy (`copy`, see [`takes_copy`]).
fn quantize_for(acts: &mut Acts, ws: &[&WeightRef], x: &[f32], n: usize, cols: usize, copy: bool) {
    let mut done = [false; quant::N_ACT_FORMATS];
    for w in ws {
        let f = quant::act_format_index(w.ty);
        if !done[f] {
            if copy {
                quant::q8::quantize_acts_impl(&mut acts[f], x, n, cols, w.ty, quant::q8::Pack::None)
            } else {
                quant::quantize_acts_into(&mut acts[f], x, n, cols, w.ty)
            }
            .expect("weight shapes and types were validated at load");
            done[f] = true;
        }
    }
}

/// Whether every weight of `ws` takes the interleaved copy at `level` (the matmul's `Rows16`
/// plan: VNNI and a copy), so that its activations need no packed layout.
fn takes_copy(model: &Model, ws: &[&WeightRef], level: quant::simd::SimdLevel) -> bool {
    level >= quant::simd::SimdLevel::Avx2 && ws.iter().all(|w| model.mat(w).x16.is_some())
}

/// The per-batch buffers of a forward pass (every architecture's pass takes the same set; a
/// hybrid adds its own): `n` token rows of the residual stream `x` (already embedded), the
/// normed input `h`, q/k/v, the attention output and its projection, the FFN's gate/up/down,
/// and for the `n_out` rows that want logits their normed hidden state and logits.
pub(super) struct PassBuffers {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    hs: Vec<f32>,
    logits: Vec<f32>,
    /// Activation buffers (the model's pool; at least `slots`), of which the pass uses the
    /// first `slots`: one per projection, or one for all (see [`project`]).
    acts: Vec<Acts>,
    slots: usize,
}

/// The [`PassBuffers`] as slices the team's tasks share (see `shared::SharedSlice`).
pub(super) struct PassViews<'a> {
    pub x: SharedSlice<'a, f32>,
    pub h: SharedSlice<'a, f32>,
    pub q: SharedSlice<'a, f32>,
    pub k: SharedSlice<'a, f32>,
    pub v: SharedSlice<'a, f32>,
    pub attn: SharedSlice<'a, f32>,
    pub o: SharedSlice<'a, f32>,
    pub gate: SharedSlice<'a, f32>,
    pub up: SharedSlice<'a, f32>,
    pub down: SharedSlice<'a, f32>,
    pub hs: SharedSlice<'a, f32>,
    pub out: SharedSlice<'a, f32>,
    pub acts: SharedSlice<'a, Acts>,
}

impl PassBuffers {
    /// Buffers for `n` tokens whose embedded rows are `x` (`n * n_embd` values), `n_out` of
    /// which want logits, with query rows of `qd` values; the other widths come from `model`'s
    /// config. Every architecture's pass makes 4 projections a layer (two for the mixer, two
    /// for the FFN) and then the output head: that many activation buffers for small batches.
    pub(super) fn new(model: &Model, x: Vec<f32>, n: usize, n_out: usize, qd: usize) -> Self {
        let c = &model.config;
        let (d, kvd, ff, n_vocab) = (c.n_embd, c.kv_dim(), c.n_ff, c.n_vocab);
        let projections = 4 * c.n_layer + 1;
        let slots = if n <= REDO_MAX_TOKENS {
            projections.max(1)
        } else {
            1
        };
        debug_assert_eq!(x.len(), n * d);
        PassBuffers {
            x,
            h: vec![0.0; n * d],
            q: vec![0.0; n * qd],
            k: vec![0.0; n * kvd],
            v: vec![0.0; n * kvd],
            attn: vec![0.0; n * qd],
            o: vec![0.0; n * d],
            gate: vec![0.0; n * ff],
            up: vec![0.0; n * ff],
            down: vec![0.0; n * d],
            hs: vec![0.0; n_out * d],
            logits: vec![0.0; n_out * n_vocab],
            acts: {
                // The model's activation buffers from earlier passes (their allocations kept).
                let mut acts =
                    std::mem::take(&mut *model.acts_pool.lock().unwrap_or_else(|p| p.into_inner()));
                if acts.len() < slots {
                    acts.resize_with(slots, Default::default);
                }
                acts
            },
            slots,
        }
    }

    pub(super) fn views(&mut self) -> PassViews<'_> {
        PassViews {
            x: SharedSlice::new(&mut self.x),
            h: SharedSlice::new(&mut self.h),
            q: SharedSlice::new(&mut self.q),
            k: SharedSlice::new(&mut self.k),
            v: SharedSlice::new(&mut self.v),
            attn: SharedSlice::new(&mut self.attn),
            o: SharedSlice::new(&mut self.o),
            gate: SharedSlice::new(&mut self.gate),
            up: SharedSlice::new(&mut self.up),
            down: SharedSlice::new(&mut self.down),
            hs: SharedSlice::new(&mut self.hs),
            out: SharedSlice::new(&mut self.logits),
            acts: SharedSlice::new(&mut self.acts[..self.slots]),
        }
    }

    /// The logits rows (after the pass); the activation buffers go back to `model`'s pool.
    pub(super) fn into_logits(self, model: &Model) -> Vec<f32> {
        let mut pool = model.acts_pool.lock().unwrap_or_else(|p| p.into_inner());
        if self.acts.len() > pool.len() {
            *pool = self.acts;
        }
        self.logits
    }
}

/// Batches of at most this many tokens quantize each projection's activations into a buffer of
/// their own (not reused within the pass), which makes the projections redoable team steps
/// (see [`matmuls`]); larger batches reuse one buffer (their activations are big, and a pass of
/// long tasks gains less from redos).
pub(super) const REDO_MAX_TOKENS: usize = 16;

/// A redoable matmul step needs a private copy of its outputs in every member's scratch (kept
/// for the model's lifetime): steps with more output values than this (the output head of a
/// large-vocabulary model over many rows) run as plain steps, so that a member's scratch stays
/// within 4 MiB.
const REDO_MAX_OUTPUTS: usize = 1 << 20;

/// `outs[i] = x W_i^T` for every weight in `ws` (same input width), over the first `n` rows of
/// `x`: one task quantizes them once per activation format, then the team runs all the products
/// as one set of tasks.
///
/// `acts` holds one activation buffer per `project` call of the pass (each call takes the next,
/// `Worker::next_call`) or a single one that every call reuses. With one per call, nothing
/// rewrites a call's activations during the pass, so its matmul step is redoable.
///
/// # Safety
/// Every member calls this at the same step; nobody writes `x` during the call and `acts` is
/// used by nothing else.
pub(super) unsafe fn project(
    model: &Model,
    w: &Worker<'_>,
    acts: &SharedSlice<Acts>,
    x: &SharedSlice<f32>,
    n: usize,
    ws: &[&WeightRef],
    outs: &[&SharedSlice<f32>],
) {
    let call = w.next_call();
    let slot = if acts.len() == 1 { 0 } else { call };
    assert!(
        slot < acts.len(),
        "a pass made more projections than it has activation buffers"
    );
    let cols = ws[0].cols;
    let level = quant::simd::level();
    let copy = takes_copy(model, ws, level);
    let wide = ws[0].ty;
    if n >= 2 * quant::q8::GROUP
        && (copy || quant::q8::Pack::for_tokens(n, level) == quant::q8::Pack::Wide)
        && ws
            .iter()
            .all(|wr| quant::act_format_index(wr.ty) == 0 && wr.cols == cols)
    {
        // A prompt's Q8 activations (wide-packed unless every weight takes the interleaved
        // copy) by groups of 16 tokens across the team (one member quantizing while the others
        // waited was ~4% of a prompt step): one task lays the buffers out, then one task per
        // group fills it.
        w.single(|| {
            // SAFETY: one task alone writes `acts[slot]` in this step (and with one buffer per
            // call, no earlier call's task still reads it).
            let a = unsafe { &mut acts.slice_mut(slot..slot + 1)[0][0] };
            a.prepare_wide_q8(n, cols, wide, !copy)
                .expect("weight shapes and types were validated at load");
        });
        let groups = n.div_ceil(quant::q8::GROUP);
        w.for_tasks(groups, |g| {
            // SAFETY: inside a task of this step (a late member must not touch `acts` after it):
            // the previous step laid `acts[slot]` out and nothing changes its buffers' headers
            // until this step is over; each task fills its own group; `x` is read-only.
            unsafe {
                let a = &acts.slice(slot..slot + 1)[0][0];
                let fill = a.wide.expect("laid out by the previous step");
                fill.fill_group(&x.all()[..n * cols], g, level);
            }
        });
    } else {
        w.single(|| {
            // SAFETY: one task alone writes `acts[slot]`, in a step of its own (and with one
            // buffer per call, no earlier call's task still reads it); `x` is read-only
            // (contract).
            unsafe {
                quantize_for(
                    &mut acts.slice_mut(slot..slot + 1)[0],
                    ws,
                    &x.all()[..n * cols],
                    n,
                    cols,
                    copy,
                )
            };
        });
    }
    matmuls(model, w, ws, acts, slot, acts.len() > 1, n, outs);
}

/// Runs `out_i = W_i a` for several weights (`n` tokens of activations in `acts[slot]`) as one
/// set of team tasks (one step). The task count is planned from the shapes alone; the
/// activations are read only inside the tasks, since a member that reaches this step late
/// (after the team has finished it) must not touch them: by then a later step may be rewriting
/// them.
///
/// `redo`: nothing writes `acts[slot]` again before the end of the team's run, so the step runs
/// (unless its outputs exceed `REDO_MAX_OUTPUTS` values) as redoable tasks (`Worker::for_tasks_redoable`): each task computes into its member's
/// scratch, and the run that wins the commit copies its rows into `outs`. A member preempted in
/// the middle of a task then holds up nobody; a waiting member computes the task again.
#[allow(clippy::too_many_arguments)]
pub(super) fn matmuls(
    model: &Model,
    w: &Worker<'_>,
    ws: &[&WeightRef],
    acts: &SharedSlice<Acts>,
    slot: usize,
    redo: bool,
    n: usize,
    outs: &[&SharedSlice<f32>],
) {
    let mut counts = [0usize; 4];
    assert!(ws.len() <= counts.len() && ws.len() == outs.len());
    for (c, wr) in counts.iter_mut().zip(ws) {
        *c = MatmulJob::planned_tasks(&model.mat(wr), n, w.n);
    }
    let counts = &counts[..ws.len()];
    let n_tasks = counts.iter().sum();
    // The first `n` rows of each output (a pass's last layer may compute fewer rows than its
    // buffers hold: `Outputs`).
    let outs: Vec<SharedSlice<'_, f32>> = outs
        .iter()
        .zip(ws)
        .map(|(o, wr)| o.prefix(n * wr.rows))
        .collect();
    let outs: Vec<&SharedSlice<'_, f32>> = outs.iter().collect();
    let outs = &outs[..];
    // The jobs of this step are built by the first task this member runs (the activations may
    // be read only inside tasks), writing into `outs` or, for a redoable step, into `privs`.
    // SAFETY (of every `acts.slice` below): inside a task of this step: the previous step wrote
    // `acts[slot]`, and nobody writes it again before this step is over (which waits for this
    // task) — or, for a redoable step, before the run is over.
    let total: usize = outs.iter().map(|o| o.len()).sum();
    if !redo || total > REDO_MAX_OUTPUTS {
        let mut jobs = None;
        w.for_tasks(n_tasks, |mut i| {
            let jobs = jobs.get_or_insert_with(|| {
                // SAFETY: see above.
                let a = unsafe { &acts.slice(slot..slot + 1)[0] };
                build_jobs(model, ws, a, outs, w.n, counts)
            });
            for j in jobs.iter() {
                if i < j.n_tasks() {
                    // SAFETY: `for_tasks` hands out each index once; the outputs are written
                    // only by these tasks until the step is over.
                    unsafe { j.run_task(i) };
                    return;
                }
                i -= j.n_tasks();
            }
        });
        return;
    }
    // This member's private copies of the outputs (one region of its scratch each).
    let mut scratch = w.scratch();
    let sizes: Vec<usize> = outs.iter().map(|o| o.len()).collect();
    if scratch.len() < total {
        scratch.resize(total, 0.0);
    }
    let mut privs = Vec::with_capacity(sizes.len());
    let mut rest = &mut scratch[..total];
    for &len in &sizes {
        let (head, tail) = rest.split_at_mut(len);
        privs.push(SharedSlice::new(head));
        rest = tail;
    }
    let privs: Vec<&SharedSlice<'_, f32>> = privs.iter().collect();
    let mut jobs = None;
    w.for_tasks_redoable(n_tasks, |mut i, commit| {
        let jobs = jobs.get_or_insert_with(|| {
            // SAFETY: see above.
            let a = unsafe { &acts.slice(slot..slot + 1)[0] };
            build_jobs(model, ws, a, &privs, w.n, counts)
        });
        for (j, job) in jobs.iter().enumerate() {
            if i < job.n_tasks() {
                if i == 0 && j == 0 {
                    model.stall_at(slot);
                }
                // SAFETY: this member runs one task at a time, into its own scratch.
                unsafe { job.run_task(i) };
                if commit.win() {
                    let rows = ws[j].rows;
                    let (rr, tr) = job.task_region(i);
                    for t in tr {
                        let at = t * rows + rr.start..t * rows + rr.end;
                        // SAFETY: the winning run of task i alone writes its region of the
                        // output, once, before the step is over; the private copy is this
                        // member's.
                        unsafe {
                            outs[j]
                                .slice_mut(at.clone())
                                .copy_from_slice(privs[j].slice(at))
                        };
                    }
                }
                return;
            }
            i -= job.n_tasks();
        }
    });
}

/// The matmul jobs `dsts[i] = W_i a` of one step, checked against the planned task counts.
fn build_jobs<'a, 'o>(
    model: &'a Model,
    ws: &[&'a WeightRef],
    a: &'a Acts,
    dsts: &[&'a SharedSlice<'o, f32>],
    threads: usize,
    counts: &[usize],
) -> Vec<MatmulJob<'a, 'o>> {
    let jobs: Vec<MatmulJob<'a, 'o>> = ws
        .iter()
        .zip(dsts)
        .map(|(wr, out)| {
            MatmulJob::new(
                model.mat(wr),
                &a[quant::act_format_index(wr.ty)],
                out,
                threads,
            )
            .expect("weight shapes and types were validated at load")
        })
        .collect();
    let planned: Vec<usize> = jobs.iter().map(|j| j.n_tasks()).collect();
    assert_eq!(planned, counts, "matmul plan differs from its task count");
    jobs
}

/// One layer group's K/V for the pass: its storage, the batch's cells in it, the sequences'
/// views of its blocks (see `model::KvIo`).
pub(super) struct GroupKv<'a> {
    pub storage: SharedSlice<'a, KvStorage>,
    pub cells: &'a [(BlockId, u16)],
    pub views: &'a HashMap<SeqId, SeqView>,
    /// The storage's block size (read before the pass: the storage is written during it).
    pub block_size: usize,
}

/// The [`GroupKv`] of every layer group of `io`.
pub(super) fn group_kv<'a>(io: &'a mut [KvIo<'_>]) -> Vec<GroupKv<'a>> {
    io.iter_mut()
        .map(|g| {
            let KvIo {
                storage,
                cells,
                views,
            } = g;
            let block_size = storage.block_size();
            GroupKv {
                storage: SharedSlice::new(std::slice::from_mut(storage)),
                cells,
                views,
                block_size,
            }
        })
        .collect()
}

/// Below this many tokens per team member, a step's attention is split by chunks of cells
/// too ([`attention::CHUNK_CELLS`]): one sequence's attention at depth then spreads over the
/// whole team instead of one member per token.
const SPLIT_TASKS_PER_MEMBER: usize = 4;

/// How one layer group's attention is split in a pass (the same for each of its layers: they
/// share the mask).
pub(super) struct SplitPlan {
    /// Per token, the index of its first chunk (a prefix sum, `n + 1` entries); each chunk has
    /// one softmax state of every head.
    first: Vec<usize>,
    /// Per token, the table indices of its visible blocks (`attention::visible_blocks`).
    blocks: Vec<Vec<usize>>,
    /// Visible blocks per chunk.
    per: usize,
}

/// How a pass's attention is cut into tasks: per layer group a split plan (`None`: tiles of
/// tokens), and the tiles.
#[derive(Default)]
pub(super) struct PassPlan {
    plans: Vec<Option<SplitPlan>>,
    /// Per layer group (with no split plan): decode tokens that share cached blocks.
    cascades: Vec<Option<CascadePlan>>,
    /// Runs of consecutive tokens of one sequence (`start..end`), at most [`tile_tokens`]
    /// long: one task each when a layer group has no split plan.
    tiles: Vec<(usize, usize)>,
}

/// The split plans of a pass, its tiles, and the chunk states' buffer.
pub(super) struct AttnSplit<'a> {
    plans: Vec<Option<SplitPlan>>,
    cascades: Vec<Option<CascadePlan>>,
    tiles: Vec<(usize, usize)>,
    part: SharedSlice<'a, f32>,
}

impl<'a> AttnSplit<'a> {
    /// The plans of `batch`'s pass over `kv`, and the values the chunk-state buffer needs.
    pub(super) fn plan(model: &Model, kv: &[GroupKv<'_>], batch: &Batch) -> (PassPlan, usize) {
        let c = &model.config;
        let plans: Vec<Option<SplitPlan>> = (0..kv.len())
            .map(|gi| split_plan(model, gi, &kv[gi], batch))
            .collect();
        let n = batch.len();
        let deep = batch
            .positions
            .iter()
            .all(|&p| usize::try_from(p).is_ok_and(|p| p >= n));
        let tiles = tiles(batch, tile_tokens(n, model.team.threads(), deep));
        let cascades: Vec<Option<CascadePlan>> = (0..kv.len())
            .map(|gi| match plans[gi] {
                Some(_) => None,
                None => cascade_plan(model, gi, &kv[gi], batch, &tiles),
            })
            .collect();
        let plen = attention::partial_len(c.n_head, c.head_dim);
        let len = plans
            .iter()
            .flatten()
            .map(|p| p.first[p.first.len() - 1] * plen)
            .chain(cascades.iter().flatten().map(|p| p.n_states * plen))
            .max()
            .unwrap_or(0);
        (
            PassPlan {
                plans,
                cascades,
                tiles,
            },
            len,
        )
    }

    pub(super) fn new(plan: PassPlan, part: &'a mut [f32]) -> AttnSplit<'a> {
        AttnSplit {
            plans: plan.plans,
            cascades: plan.cascades,
            tiles: plan.tiles,
            part: SharedSlice::new(part),
        }
    }
}

/// Tokens per attention tile for a pass of `n` tokens on `threads` members: at most
/// [`attention::TILE_TOKENS`], and few enough that there are about four tiles per member (a
/// prompt's tiles differ in cost: later tokens see more cells). When every token's position
/// is at least `n` (`deep`: normally that many cells come before it, a proxy that costs
/// nothing to check; a wrong guess costs balance, never bits), the tiles cost about the same
/// and one tile per member is enough: tiles of a few tokens each left most of the kernel's lanes empty and
/// converted each block's K/V for few rows (steps of 14 to 100 tokens at depth 1,536 ran
/// 20-40% slower per token).
fn tile_tokens(n: usize, threads: usize, deep: bool) -> usize {
    let threads = threads.max(1);
    let balanced = n / (SPLIT_TASKS_PER_MEMBER * threads);
    let size = if deep {
        balanced.max(n.div_ceil(threads).min(attention::TILE_TOKENS))
    } else {
        balanced
    };
    size.clamp(1, attention::TILE_TOKENS)
}

/// `batch`'s runs of consecutive tokens of one sequence, cut into tiles of at most `size`
/// tokens (of nearly equal length within a run).
fn tiles(batch: &Batch, size: usize) -> Vec<(usize, usize)> {
    let n = batch.len();
    let mut out = Vec::with_capacity(n.div_ceil(size.max(1)));
    let mut start = 0;
    while start < n {
        let seq = batch.seq_ids[start];
        let end = (start..n).find(|&t| batch.seq_ids[t] != seq).unwrap_or(n);
        let pieces = (end - start).div_ceil(size.max(1));
        for p in 0..pieces {
            let (a, b) = ((end - start) * p / pieces, (end - start) * (p + 1) / pieces);
            out.push((start + a, start + b));
        }
        start = end;
    }
    out
}

/// The attention mask of token `t` of `batch` in a layer of kind `kind` (its sequence's
/// `positions` in the layer's group).
fn token_mask<'p>(kind: LayerKind, positions: &'p [i32], qpos: i32) -> Mask<'p> {
    match kind {
        LayerKind::Window(n) => Mask::Window {
            positions,
            qpos,
            window: n.min(i32::MAX as usize) as i32,
        },
        LayerKind::Full | LayerKind::Recurrent => Mask::Causal { positions, qpos },
    }
}

/// The split plan of layer group `gi` for `batch`, or `None` when every token is one task
/// (enough tokens, or no token with more than one chunk).
fn split_plan(model: &Model, gi: usize, kv: &GroupKv<'_>, batch: &Batch) -> Option<SplitPlan> {
    let c = &model.config;
    let n = batch.len();
    if n >= SPLIT_TASKS_PER_MEMBER * model.team.threads() {
        return None;
    }
    let kind = (0..c.n_layer)
        .filter(|&li| model.kv_slot(li).0 == gi)
        .map(|li| c.layer_kinds[li])
        .find(|k| *k != LayerKind::Recurrent)?;
    let per = attention::chunk_blocks(kv.block_size);
    let mut first = Vec::with_capacity(n + 1);
    first.push(0);
    let mut blocks = Vec::with_capacity(n);
    for t in 0..n {
        let view = &kv.views[&batch.seq_ids[t]];
        let mask = token_mask(kind, &view.positions, batch.positions[t]);
        let mut vis = Vec::new();
        attention::visible_blocks(view.positions.len(), kv.block_size, &mask, &mut vis);
        first.push(first[t] + attention::n_chunks(vis.len(), kv.block_size));
        blocks.push(vis);
    }
    (first[n] > n).then_some(SplitPlan { first, blocks, per })
}

/// Decode tokens of one layer group whose sequences share their first cached blocks (the
/// users of one document): each group's shared blocks are read once for all its tokens
/// (`attention::attend_tile_states`, whole chunks only), each token's later chunks on their
/// own (`attention::attend_chunk`), and the states merged in chunk order
/// (`attention::merge_chunks`): the bits of the token's attention alone.
pub(super) struct CascadePlan {
    /// Per group: its tokens and the blocks they share (a multiple of the chunk).
    groups: Vec<(Vec<usize>, usize)>,
    /// Per group, the state index of its first token's shared state (its tokens' follow).
    group_first: Vec<usize>,
    /// The later chunks: (token, range of its visible blocks), state `rest_first + job`.
    rest: Vec<(usize, std::ops::Range<usize>)>,
    rest_first: usize,
    /// Per token in a group: (its shared state, its range of `rest`), and its visible blocks.
    member: Vec<Option<(usize, std::ops::Range<usize>)>>,
    vis: Vec<Vec<usize>>,
    /// The tokens in a group, and the tiles of the others.
    members: Vec<usize>,
    tiles: Vec<(usize, usize)>,
    /// Chunk states in all.
    n_states: usize,
}

/// Tokens a cascade group (each task of it) needs at least: in one process (SmolLM2, depth
/// 1,600, decode steps alternating with and without) groups of 3 users were ~6% slower than
/// each token alone, of 4 to 24 users 7-28% faster.
const CASCADE_MIN_TOKENS: usize = 4;

/// The cascade plan of layer group `gi` for `batch` (tiles `tiles`), or `None` when no two
/// one-token tiles of a causal group share a whole chunk of visible blocks.
fn cascade_plan(
    model: &Model,
    gi: usize,
    kv: &GroupKv<'_>,
    batch: &Batch,
    tiles: &[(usize, usize)],
) -> Option<CascadePlan> {
    let c = &model.config;
    let kind = (0..c.n_layer)
        .filter(|&li| model.kv_slot(li).0 == gi)
        .map(|li| c.layer_kinds[li])
        .find(|k| *k != LayerKind::Recurrent)?;
    if kind != LayerKind::Full {
        return None;
    }
    let n = batch.len();
    let per = attention::chunk_blocks(kv.block_size);
    // One-token tiles whose first chunk of blocks is all visible, by that chunk's block ids.
    let mut vis: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut lead = vec![0usize; n];
    let mut by_first: HashMap<&[u32], Vec<usize>> = HashMap::new();
    for &(t0, t1) in tiles {
        if t1 - t0 != 1 {
            continue;
        }
        let view = &kv.views[&batch.seq_ids[t0]];
        let mask = token_mask(kind, &view.positions, batch.positions[t0]);
        attention::visible_blocks(view.positions.len(), kv.block_size, &mask, &mut vis[t0]);
        lead[t0] = vis[t0]
            .iter()
            .enumerate()
            .take_while(|&(i, &b)| i == b)
            .count();
        if lead[t0] >= per && view.blocks.len() >= per {
            by_first.entry(&view.blocks[..per]).or_default().push(t0);
        }
    }
    let mut groups = Vec::new();
    for (_, toks) in by_first {
        if toks.len() < CASCADE_MIN_TOKENS {
            continue;
        }
        let first = &kv.views[&batch.seq_ids[toks[0]]].blocks;
        let mut shared = usize::MAX;
        for &t in &toks {
            let b = &kv.views[&batch.seq_ids[t]].blocks;
            let common = first.iter().zip(b).take_while(|(x, y)| x == y).count();
            shared = shared.min(common).min(lead[t]);
        }
        let shared = shared / per * per;
        if shared >= per {
            // At most one lane vector of query rows per task (16 / heads per KV head
            // tokens), at least CASCADE_MIN_TOKENS: the group's tasks spread over the team,
            // each reading the shared K/V once.
            let size = (16 / c.n_head.div_ceil(c.n_head_kv).max(1)).max(CASCADE_MIN_TOKENS);
            let pieces = toks
                .len()
                .div_ceil(size)
                .min(toks.len() / CASCADE_MIN_TOKENS);
            for p in 0..pieces {
                let (a, b) = (toks.len() * p / pieces, toks.len() * (p + 1) / pieces);
                if b - a >= CASCADE_MIN_TOKENS {
                    groups.push((toks[a..b].to_vec(), shared));
                }
            }
        }
    }
    if groups.is_empty() {
        return None;
    }
    groups.sort_unstable_by_key(|(toks, _)| toks[0]);
    let mut member: Vec<Option<(usize, std::ops::Range<usize>)>> = vec![None; n];
    let mut group_first = Vec::with_capacity(groups.len());
    let mut rest = Vec::new();
    let mut next = 0;
    let mut members = Vec::new();
    for (toks, shared) in &groups {
        group_first.push(next);
        for &t in toks {
            let r0 = rest.len();
            let tail = vis[t].len();
            let mut a = *shared;
            while a < tail {
                let b = (a + per).min(tail);
                rest.push((t, a..b));
                a = b;
            }
            member[t] = Some((next, r0..rest.len()));
            members.push(t);
            next += 1;
        }
    }
    let rest_first = next;
    let n_states = next + rest.len();
    let others = tiles
        .iter()
        .copied()
        .filter(|&(t0, t1)| t1 - t0 != 1 || member[t0].is_none())
        .collect();
    Some(CascadePlan {
        groups,
        group_first,
        rest,
        rest_first,
        member,
        vis,
        members,
        tiles: others,
        n_states,
    })
}

/// Steps 4 and 5 of a layer, shared by every architecture: one task stores the batch's keys and
/// values of layer `li` at its planned cells in the layer's group; then attention runs as one
/// task per tile (consecutive tokens of one sequence, [`tiles`]; a decode step's tiles are its
/// tokens): its query heads read each cached key and value once (a block's rows, every KV head
/// side by side, in one pass; once for the whole tile, `attention::attend_tile`), over the
/// token's own sequence only, with the layer's mask (causal, or causal within the layer's
/// window). A token's bits do not depend on its tile. `qkva` = [q, k, v, attn output].
///
/// A small batch whose sequences are deep (fewer tokens than [`SPLIT_TASKS_PER_MEMBER`] per
/// member, some token with more than one chunk of cells) is split further: one task per
/// (token, chunk) writes its chunk's softmax state into `part` (at least
/// [`AttnSplit::plan`]'s values), then one task per token folds the token's chunk states in
/// chunk order. Both ways give the same bits (`attention::merge_chunks`).
///
/// A larger batch whose decode tokens share whole chunks of cached blocks (users of one
/// document, [`CascadePlan`]) reads those chunks once per group of about one lane vector of
/// query rows, at least 4 tokens (`attention::attend_tile_states`), computes each token's
/// later chunks on its own, and folds the states per token, again with the same bits.
/// Measured in one process (SmolLM2, 2 threads, decode steps alternating with and without,
/// 15 rounds): at depth 1,600, 24 users of one document 73.9 -> 53.5 ms a step, 6 documents
/// x 4 users 75.8 -> 64.8 ms, 4 x 6 78.4 -> 73.0 ms; at depth 512, 4 x 6 40.6 -> 39.7 ms;
/// at 4,096, 2 x 8 138.8 -> 127.6 ms.
///
/// # Safety
/// Every member calls this at the same step; nobody writes q, k, v during the call, and the
/// attention output's rows and `part` are written only here.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn store_and_attend<'a>(
    w: &Worker<'_>,
    model: &Model,
    kv: &'a [GroupKv<'a>],
    li: usize,
    batch: &'a Batch,
    qkva: [&'a SharedSlice<'a, f32>; 4],
    split: &AttnSplit<'_>,
    scale: f32,
    scratch: &mut attention::Scratch,
) {
    let [q, k, v, attn] = qkva;
    // SAFETY: the caller's contract (every member, in step; k and v not written).
    unsafe {
        store_kv(w, model, kv, li, k, v);
        attend(w, model, kv, li, batch, [q, attn], split, scale, scratch);
    }
}

/// Step 4 of a layer: one task stores the batch's keys and values of layer `li` at its planned
/// cells in the layer's group.
///
/// # Safety
/// Every member calls this at the same step; nobody writes k or v during the call.
pub(super) unsafe fn store_kv(
    w: &Worker<'_>,
    model: &Model,
    kv: &[GroupKv<'_>],
    li: usize,
    k: &SharedSlice<'_, f32>,
    v: &SharedSlice<'_, f32>,
) {
    let (gi, kl) = model.kv_slot(li);
    let GroupKv { storage, cells, .. } = &kv[gi];
    w.single(|| {
        // SAFETY: only this task touches the storage in this step; k and v are read-only.
        unsafe { PagedCache::write(&mut storage.slice_mut(0..1)[0], kl, cells, k.all(), v.all()) };
    });
}

/// Step 5 of a layer: attention of every token of `batch` (query rows `q`, output rows `attn`,
/// by token index) over the cells of its sequence, as [`store_and_attend`] describes, with the
/// tiles and split plans of `split` (made for `batch`).
///
/// # Safety
/// Every member calls this at the same step; nobody writes q or the storage during the call,
/// and the rows of `attn` and `split`'s chunk states are written only here.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn attend<'a>(
    w: &Worker<'_>,
    model: &Model,
    kv: &'a [GroupKv<'a>],
    li: usize,
    batch: &'a Batch,
    [q, attn]: [&'a SharedSlice<'a, f32>; 2],
    split: &AttnSplit<'_>,
    scale: f32,
    scratch: &mut attention::Scratch,
) {
    let c = &model.config;
    let (gi, kl) = model.kv_slot(li);
    let GroupKv { storage, views, .. } = &kv[gi];
    let (qd, hd) = (c.q_dim(), c.head_dim);
    let n = batch.len();
    let kind = c.layer_kinds[li];
    // The query of token t (every head; q is read-only in this step).
    let query = |q_r: &'a [f32], t: usize| -> (&'a SeqView, Query<'a>) {
        let view = &views[&batch.seq_ids[t]];
        let (positions, qpos) = (&view.positions[..], batch.positions[t]);
        let query = Query {
            layer: kl,
            kv_head: 0,
            kv_heads: c.n_head_kv,
            head_dim: hd,
            q: &q_r[t * qd..(t + 1) * qd],
            scale,
            mask: token_mask(kind, positions, qpos),
        };
        (view, query)
    };
    let Some(plan) = &split.plans[gi] else {
        let cascade = split.cascades[gi].as_ref();
        let tiles = cascade.map_or(&split.tiles[..], |cp| &cp.tiles[..]);
        // With a cascade plan: its group and later-chunk tasks first, then the other tiles.
        let (n_groups, n_rest) = cascade.map_or((0, 0), |cp| (cp.groups.len(), cp.rest.len()));
        let plen = attention::partial_len(c.n_head, hd);
        let part = &split.part;
        w.for_tasks(n_groups + n_rest + tiles.len(), |job| {
            if let Some(cp) = cascade.filter(|_| job < n_groups + n_rest) {
                // SAFETY: as below.
                let (store, q_r) = unsafe { (&storage.slice(0..1)[0], q.all()) };
                if job < n_groups {
                    let (toks, shared) = &cp.groups[job];
                    let view = query(q_r, toks[0]).0;
                    let queries: Vec<Query> = toks.iter().map(|&t| query(q_r, t).1).collect();
                    let s0 = cp.group_first[job];
                    // SAFETY: the group's shared states belong to this task only.
                    let states = unsafe { part.slice_mut(s0 * plen..(s0 + toks.len()) * plen) };
                    attention::attend_tile_states(
                        store,
                        &view.blocks[..*shared],
                        shared * kv[gi].block_size,
                        &queries,
                        states,
                        scratch,
                    )
                } else {
                    let r = job - n_groups;
                    let (t, ref range) = cp.rest[r];
                    let (view, query) = query(q_r, t);
                    let s = cp.rest_first + r;
                    // SAFETY: chunk state s belongs to this task only.
                    let out = unsafe { part.slice_mut(s * plen..(s + 1) * plen) };
                    attention::attend_chunk(
                        store,
                        &view.blocks,
                        view.positions.len(),
                        &cp.vis[t][range.clone()],
                        &query,
                        out,
                        scratch,
                    )
                }
                .expect("query shapes were validated at load");
                return;
            }
            let ti = job - n_groups - n_rest;
            let (t0, t1) = tiles[ti];
            // SAFETY: the storage and q are read-only in this step (taken inside the task: a
            // late member must not hold them while a later step writes them).
            let (store, q_r) = unsafe { (&storage.slice(0..1)[0], q.all()) };
            // SAFETY: the rows of tokens t0..t1 of attn belong to this task only.
            let out = unsafe { attn.slice_mut(t0 * qd..t1 * qd) };
            if t1 - t0 == 1 {
                let (view, query) = query(q_r, t0);
                attention::attend(
                    store,
                    &view.blocks,
                    view.positions.len(),
                    &query,
                    out,
                    scratch,
                )
            } else {
                // One sequence's tokens: each block's K/V read once for all of them, each
                // token's bits those of `attend`.
                let view = query(q_r, t0).0;
                let queries: Vec<Query> = (t0..t1).map(|t| query(q_r, t).1).collect();
                attention::attend_tile(
                    store,
                    &view.blocks,
                    view.positions.len(),
                    &queries,
                    out,
                    scratch,
                )
            }
            .expect("query shapes were validated at load");
        });
        if let Some(cp) = cascade {
            w.for_tasks(cp.members.len(), |m| {
                let t = cp.members[m];
                let (shared, ref rest) = cp.member[t].clone().expect("a member of a group");
                // SAFETY: the chunk states were written by the step above and are read-only
                // now; token t's row of attn belongs to this task only.
                let (states, out) = unsafe { (part.all(), attn.slice_mut(t * qd..(t + 1) * qd)) };
                let at = |s: usize| &states[s * plen..(s + 1) * plen];
                let parts =
                    std::iter::once(at(shared)).chain(rest.clone().map(|r| at(cp.rest_first + r)));
                attention::merge_chunks(c.n_head, hd, parts, out, scratch);
            });
        }
        return;
    };
    // Chunk state `job` (token t's chunk job - first[t]) holds every head's softmax state.
    let (first, part) = (&plan.first, &split.part);
    let plen = attention::partial_len(c.n_head, hd);
    w.for_tasks(first[n], |job| {
        // SAFETY: as above.
        let (store, q_r) = unsafe { (&storage.slice(0..1)[0], q.all()) };
        let t = first.partition_point(|&f| f <= job) - 1;
        let (view, query) = query(q_r, t);
        let vis = &plan.blocks[t];
        let ch = job - first[t];
        let blocks = &vis[(ch * plan.per).min(vis.len())..((ch + 1) * plan.per).min(vis.len())];
        // SAFETY: chunk state `job` of part belongs to this task only.
        let out = unsafe { part.slice_mut(job * plen..(job + 1) * plen) };
        attention::attend_chunk(
            store,
            &view.blocks,
            view.positions.len(),
            blocks,
            &query,
            out,
            scratch,
        )
        .expect("query shapes were validated at load");
    });
    w.for_tasks(n, |t| {
        // SAFETY: the chunk states were written by the step above and are read-only now;
        // token t's row of attn belongs to this task only.
        let (states, out) = unsafe { (part.all(), attn.slice_mut(t * qd..(t + 1) * qd)) };
        let parts = (first[t]..first[t + 1]).map(|ch| &states[ch * plen..(ch + 1) * plen]);
        attention::merge_chunks(c.n_head, hd, parts, out, scratch);
    });
}

/// The buffers of a llama-style FFN block (token-major rows: `x`, `o`, `h`, `down` of `n_embd`
/// values, `gate`, `up` of `n_ff`).
pub(super) struct FfnBuffers<'s, 'b> {
    pub x: &'s SharedSlice<'b, f32>,
    pub o: &'s SharedSlice<'b, f32>,
    pub h: &'s SharedSlice<'b, f32>,
    pub gate: &'s SharedSlice<'b, f32>,
    pub up: &'s SharedSlice<'b, f32>,
    pub down: &'s SharedSlice<'b, f32>,
}

/// The second half of a llama-style layer over `n` tokens: `x += o`, `h = norm(x)`, SwiGLU FFN
/// (`w_gate`, `w_up`, `w_down`), `x += down`.
///
/// # Safety
/// Every member calls this at the same step; `b`'s buffers and `acts` are used by nothing else
/// during the call.
pub(super) unsafe fn residual_swiglu_ffn(
    model: &Model,
    w: &Worker<'_>,
    acts: &SharedSlice<Acts>,
    n: usize,
    ffn_norm: &[f32],
    [w_gate, w_up, w_down]: [&WeightRef; 3],
    // The weights of the matmuls after this block's (prefetched while members wait).
    next: &[&WeightRef],
    b: &FfnBuffers<'_, '_>,
) {
    let c = &model.config;
    let (d, ff) = (c.n_embd, c.n_ff);
    let FfnBuffers {
        x,
        o,
        h,
        gate,
        up,
        down,
    } = *b;
    w.for_rows(n, |t| {
        // SAFETY: token rows t of x, o, h belong to this task.
        unsafe {
            let xr = x.slice_mut(t * d..(t + 1) * d);
            ops::add_assign(xr, o.slice(t * d..(t + 1) * d));
            ops::rms_norm(xr, ffn_norm, c.rms_eps, h.slice_mut(t * d..(t + 1) * d));
        }
    });
    hint_next(model, w, n, &[w_down], next);
    // SAFETY: every member calls this in step; h is not written during it.
    unsafe { project(model, w, acts, h, n, &[w_gate, w_up], &[gate, up]) };
    w.for_rows(n, |t| {
        // SAFETY: token rows t of gate (write) and up (read) belong to this task.
        unsafe {
            ops::swiglu(
                gate.slice_mut(t * ff..(t + 1) * ff),
                up.slice(t * ff..(t + 1) * ff),
            )
        };
    });
    hint_next(model, w, n, next, &[]);
    // SAFETY: every member calls this in step; gate is not written during it.
    unsafe { project(model, w, acts, gate, n, &[w_down], &[down]) };
    w.for_rows(n, |t| {
        // SAFETY: token rows t of x (write) and down (read) belong to this task.
        unsafe {
            ops::add_assign(
                x.slice_mut(t * d..(t + 1) * d),
                down.slice(t * d..(t + 1) * d),
            )
        };
    });
}

/// The output head for the rows that want logits: `hs[r] = norm(x[out_rows[r]])`, then
/// `out = hs output^T`.
///
/// # Safety
/// Every member calls this at the same step; `x` is not written during it, and `hs`, `out` and
/// `acts` are used by nothing else.
pub(super) unsafe fn output_head(
    model: &Model,
    w: &Worker<'_>,
    acts: &SharedSlice<Acts>,
    x: &SharedSlice<f32>,
    out_rows: &[usize],
    (output_norm, output): (&[f32], &WeightRef),
    hs: &SharedSlice<f32>,
    out: &SharedSlice<f32>,
) {
    let c = &model.config;
    let d = c.n_embd;
    if out_rows.is_empty() {
        return;
    }
    w.for_rows(out_rows.len(), |r| {
        let t = out_rows[r];
        // SAFETY: output row r of hs belongs to this task; x is read-only now.
        unsafe {
            ops::rms_norm(
                x.slice(t * d..(t + 1) * d),
                output_norm,
                c.rms_eps,
                hs.slice_mut(r * d..(r + 1) * d),
            )
        };
    });
    // SAFETY: every member calls this in step; hs is not written during it.
    unsafe { project(model, w, acts, hs, out_rows.len(), &[output], &[out]) };
}

/// The rows of a pass that want logits, and what the last layer computes. After the last
/// layer's K/V store, a token's attention, output projection and FFN feed only its own logits
/// (llama.cpp's output ids): a prompt chunk wants one row or none, so the last layer then
/// computes those rows alone. Every row's arithmetic is per token (attention per token, matmuls
/// batch-invariant: `quant::legacy`), so the logits are bit for bit those of the full layer.
pub(super) struct Outputs {
    /// The batch rows that want logits, in order.
    pub rows: Vec<usize>,
    /// When some row wants none: the batch of those rows alone (possibly empty), whose
    /// attention the last layer computes (into rows `0..rows.len()`, see [`compact_rows`]).
    pub last: Option<Batch>,
}

impl Outputs {
    pub(super) fn of(batch: &Batch) -> Outputs {
        let rows: Vec<usize> = (0..batch.len()).filter(|&t| batch.logits[t]).collect();
        let last = (rows.len() < batch.len()).then(|| Batch {
            tokens: rows.iter().map(|&t| batch.tokens[t]).collect(),
            positions: rows.iter().map(|&t| batch.positions[t]).collect(),
            seq_ids: rows.iter().map(|&t| batch.seq_ids[t]).collect(),
            logits: vec![true; rows.len()],
        });
        Outputs { rows, last }
    }

    /// The attention plan of the last layer's rows ([`AttnSplit::plan`] of `last`; empty
    /// without them).
    pub(super) fn plan(&self, model: &Model, kv: &[GroupKv<'_>]) -> (PassPlan, usize) {
        match &self.last {
            Some(b) if !b.is_empty() => AttnSplit::plan(model, kv, b),
            _ => (PassPlan::default(), 0),
        }
    }

    /// The rows of the final residual stream the output head reads: `rows`, or their places
    /// `0..rows.len()` once the last layer has compacted them.
    pub(super) fn head_rows(&self) -> Vec<usize> {
        if self.last.is_some() {
            (0..self.rows.len()).collect()
        } else {
            self.rows.clone()
        }
    }
}

/// Moves row `rows[i]` of `buf` (rows of `width` values) to row `i`, for each `i` in order.
/// `rows` is increasing, so `rows[i] >= i`: row `i` is written only after every row that
/// moves from it has been read.
///
/// # Safety
/// One task alone touches `buf` during the call; it holds `rows`' rows.
pub(super) unsafe fn compact_rows(buf: &SharedSlice<'_, f32>, width: usize, rows: &[usize]) {
    let Some(&top) = rows.last() else { return };
    // SAFETY: the caller's contract; rows `0..=top` are inside `buf`.
    let all = unsafe { buf.slice_mut(0..(top + 1) * width) };
    for (i, &t) in rows.iter().enumerate() {
        debug_assert!(t >= i, "output rows are increasing");
        if t != i {
            all.copy_within(t * width..(t + 1) * width, i * width);
        }
    }
}

/// Steps 4 and 5 of layer `li` of a pass whose rows want logits as `outputs` says: store and
/// attend every row (`split`), or, in the last layer when some rows want none, store every
/// row's K/V, move the rows that want logits to the first rows of `q` and `x` and attend them
/// alone (`last_split`, made for `outputs.last`). Returns how many rows the rest of the layer
/// computes (0: none; then nothing after this layer needs computing either).
///
/// # Safety
/// As [`store_and_attend`]'s; besides, nobody reads or writes `x` during the call.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn store_and_attend_rows<'a>(
    w: &Worker<'_>,
    model: &Model,
    kv: &'a [GroupKv<'a>],
    li: usize,
    batch: &'a Batch,
    outputs: &'a Outputs,
    [q, k, v, attn, x]: [&'a SharedSlice<'a, f32>; 5],
    [split, last_split]: [&AttnSplit<'_>; 2],
    scale: f32,
    scratch: &mut attention::Scratch,
) -> usize {
    let c = &model.config;
    match &outputs.last {
        Some(sub) if li + 1 == c.n_layer => {
            // SAFETY: the caller's contract.
            unsafe { store_kv(w, model, kv, li, k, v) };
            if sub.is_empty() {
                return 0;
            }
            w.single(|| {
                // SAFETY: one task alone touches q and x in this step.
                unsafe {
                    compact_rows(q, c.q_dim(), &outputs.rows);
                    compact_rows(x, c.n_embd, &outputs.rows);
                }
            });
            // SAFETY: the caller's contract, over the moved rows.
            unsafe { attend(w, model, kv, li, sub, [q, attn], last_split, scale, scratch) };
            sub.len()
        }
        _ => {
            // SAFETY: the caller's contract.
            unsafe {
                store_and_attend(
                    w,
                    model,
                    kv,
                    li,
                    batch,
                    [q, k, v, attn],
                    split,
                    scale,
                    scratch,
                )
            };
            batch.len()
        }
    }
}

/// Runs one batch through the model, storing its keys and values at the cells each layer group
/// planned (`io`: per group its storage, the cells, and each batch sequence's blocks and
/// positions, including the new cells).
///
/// The pass is one SPMD region on the model's team: every member walks the layers; each step
/// splits its work (tokens, output rows, (token, head) pairs) into tasks the members claim, and
/// is over when they are all done. Activation quantization and cache writes are one task each.
pub(crate) fn forward(
    model: &Model,
    wts: &Weights,
    io: &mut [KvIo<'_>],
    batch: &Batch,
) -> Result<Logits> {
    let c = &model.config;
    let n = batch.len();
    let (d, qd, kvd, hd) = (c.n_embd, c.q_dim(), c.kv_dim(), c.head_dim);

    // Token embeddings and RoPE angles (cheap, serial).
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
    let outputs = Outputs::of(batch);
    let n_out = outputs.rows.len();

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
    // The last layer's attention over the rows that want logits (when some do not).
    let (last_plans, last_len) = outputs.plan(model, &kv);
    let mut last_part = vec![0.0f32; last_len];
    let last_split = AttnSplit::new(last_plans, &mut last_part);
    let head_rows = outputs.head_rows();

    let scale = c.attn_scale;

    // Safety pattern for the whole region: each step is a set of tasks (`for_tasks`, `for_rows`,
    // `single`); a task writes only the rows or cells its index assigns to it, and reads shared
    // data only that earlier steps wrote (a step returns once all its tasks are done). Nothing
    // shared is written outside a task: a member may skip a step the others have finished.
    let ffn = FfnBuffers {
        x: &x,
        o: &o,
        h: &h,
        gate: &gate,
        up: &up,
        down: &down,
    };
    let head = &wts.output;
    model.team.run(|w| {
        let mut scratch = attention::Scratch::default();
        for (li, layer) in wts.layers.iter().enumerate() {
            if model.fault_at(li) {
                panic!("injected worker panic at layer {li} (test hook)");
            }
            // 1. h = norm(x) per token.
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
            // 2. Q, K, V projections.
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
            // 3. Biases, q/k norms, RoPE per token.
            w.for_rows(n, |t| {
                // SAFETY: token rows t of q and k belong to this task.
                let (qr, kr, vr) = unsafe {
                    (
                        q.slice_mut(t * qd..(t + 1) * qd),
                        k.slice_mut(t * kvd..(t + 1) * kvd),
                        v.slice_mut(t * kvd..(t + 1) * kvd),
                    )
                };
                if let Some(b) = &layer.bq {
                    ops::add_assign(qr, b);
                }
                if let Some(b) = &layer.bk {
                    ops::add_assign(kr, b);
                }
                if let Some(b) = &layer.bv {
                    ops::add_assign(vr, b);
                }
                if let Some(qn) = &layer.q_norm {
                    ops::rms_norm_rows(qr, hd, qn, c.rms_eps);
                }
                if let Some(kn) = &layer.k_norm {
                    ops::rms_norm_rows(kr, hd, kn, c.rms_eps);
                }
                let angles = &cs[t * half..(t + 1) * half];
                c.rope.apply(qr, hd, angles);
                c.rope.apply(kr, hd, angles);
            });
            // 4-5. Store K and V, attention: in the last layer, only for the rows that want
            // logits when some do not (`Outputs`).
            // SAFETY: every member calls this in step; q, k, v, x are not written during it.
            let rows = unsafe {
                store_and_attend_rows(
                    w,
                    model,
                    &kv,
                    li,
                    batch,
                    &outputs,
                    [&q, &k, &v, &attn, &x],
                    [&split, &last_split],
                    scale,
                    &mut scratch,
                )
            };
            if rows == 0 {
                break; // nothing wants logits: the K/V were all the layer had to give
            }
            // 6. Output projection.
            hint_next(
                model,
                w,
                rows,
                &[&layer.w_gate, &layer.w_up, &layer.w_down],
                &[],
            );
            // SAFETY: every member calls this in step; attn is not written during it.
            unsafe { project(model, w, &acts, &attn, rows, &[&layer.wo], &[&o]) };
            // 7. Residual, then h = norm(x) for the FFN, per token.
            let next_qkv = wts.layers.get(li + 1).map(|l| [&l.wq, &l.wk, &l.wv]);
            // SAFETY: every member calls this in step; nothing else uses these buffers.
            unsafe {
                residual_swiglu_ffn(
                    model,
                    w,
                    &acts,
                    rows,
                    &layer.ffn_norm,
                    [&layer.w_gate, &layer.w_up, &layer.w_down],
                    match &next_qkv {
                        Some(qkv) => qkv,
                        None => std::slice::from_ref(&head),
                    },
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
                &head_rows,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Tiles cover the batch in order, never span two sequences, and respect the size; a deep
    /// short step gets one whole tile per member, a shallow one (a prompt from its start) about
    /// four per member.
    #[test]
    fn tiles_cover_runs_and_deep_steps_get_whole_tiles() {
        let mut batch = Batch::prompt(&[1; 53], 1536, 0);
        let other = Batch::prompt(&[2; 7], 90, 1);
        batch.tokens.extend(&other.tokens);
        batch.positions.extend(&other.positions);
        batch.seq_ids.extend(&other.seq_ids);
        batch.logits.extend(&other.logits);
        for (n, deep, want) in [
            (53, true, 16),
            (53, false, 6),
            (512, false, 16),
            (4, true, 2),
        ] {
            assert_eq!(tile_tokens(n, 2, deep), want, "{n} {deep}");
        }
        let size = tile_tokens(batch.len(), 2, true);
        let tiles = tiles(&batch, size);
        let mut next = 0;
        for &(a, b) in &tiles {
            assert_eq!(a, next);
            assert!(b > a && b - a <= size);
            assert!(batch.seq_ids[a..b].iter().all(|&s| s == batch.seq_ids[a]));
            next = b;
        }
        assert_eq!(next, batch.len());
        assert_eq!(tiles.len(), 4 + 1, "{tiles:?}");
    }
}
